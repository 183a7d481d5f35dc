"""The collectives of FP8's scales in one training step, in closed form: what hsgd.accounting.traffic adds to a
rank's step formula.

Every cast of an operand whose tiles are split over ranks reduces their amax (Allreduce MAX, hsgd.fp8.domains):
per micro-batch and block linear, the casts of hsgd.fp8.linear are

    forward   x once per input (q, k, v share one; fc, or gate and up, share one), w of each linear, along K
    dgrad     dy and w of each linear, along M
    wgrad     x once per input, dy of each linear, along the tokens

(--recompute full casts the forward twice). A cast over comms C moves, on each c in C, one Allreduce of its amax:
one number per tensor, N (rows) or K (columns) numbers for rowwise tiles, none for blockwise (no tile is cut).
--fp8-check adds two Allreduces (MIN, MAX) of the scales over each communicator whose ranks hold the same tiles.
Delayed scaling reduces nothing per cast; its step ends with one Allreduce of the step's amaxes (one float64 per
operand name) over tp and one over dp_comm.
"""
from hsgd.fp8.linear import input_key


def groups(layer, mlp):
    """The block linears of block `layer` as (input name, [weight names]): the linears that read one input."""
    h = f"h.{layer}."
    ins = [h + "mlp.fc.weight"] if mlp == "gelu" else [h + "mlp.gate.weight", h + "mlp.up.weight"]
    return [([h + f"attn.{n}.weight" for n in "qkv"]), [h + "attn.proj.weight"], ins, [h + "mlp.proj.weight"]]


def amax_size(recipe, role, axis, shape):
    """Numbers in one cast's amax (the Allreduce's payload) of a 2-D operand of `shape` with tiles along axis."""
    if recipe.per_tensor:
        return 1
    n, m = shape
    if recipe.block is None:
        return n if axis == 1 else m
    b = recipe.block
    return (n // b) * (m // b) if role == "w" else (n * (m // b) if axis == 1 else (n // b) * m)


def cast_formula(fp8, holders, dp_comm, layers, mlp, shapes, rows, m, itemsize, recompute_full=False,
                 weights_sent=False):
    """{(communicator name, "Allreduce"): (calls, bytes)} of one step's FP8 scale traffic on this rank. fp8: the run's
    hsgd.fp8.scaling.Fp8; holders: the stage's Holders; dp_comm: the step's end reduces delayed scaling's amaxes
    over it; layers: the stage's blocks; mlp: "gelu" or "swiglu"; shapes: {weight name: its local shape (K, M)};
    rows: the tokens of one micro-batch a linear sees (N); m: micro-batches; itemsize: bytes of the run's numbers
    (a current amax is one of them; delayed's record and the checked scales are float64); weights_sent: ZeRO-3 sends
    the weights cast (hsgd.dp.fp8_gather, whose formula counts their scales): the linears cast no w."""
    out = {}

    def add(comms, size, itemsize, times=1):
        for c in comms:
            calls, nbytes = out.get((c.name, "Allreduce"), (0, 0))
            out[(c.name, "Allreduce")] = (calls + times, nbytes + times * size * itemsize)

    def cast(name, role, axis, shape, times):
        spread = holders.spread(name, role)
        size = amax_size(fp8.recipe, role, axis, shape)
        add(fp8.domain(spread, holders, axis, role), size, itemsize, m * times)
        if fp8.check:
            add(holders.share(spread, fp8.recipe, axis), size, 8, 2 * m * times)

    keys = set()
    for i in layers:
        for names in groups(i, mlp):
            K = shapes[names[0]][0]
            fwd = 2 if recompute_full else 1
            cast(names[0], "x", 1, (rows, K), fwd)                   # forward: the input once
            cast(names[0], "x", 0, (rows, K), 1)                     # wgrad: the input along the tokens
            keys.add(("x", input_key(names[0])))
            for n in names:
                Kn, Mn = shapes[n]
                if not weights_sent:
                    cast(n, "w", 0, (Kn, Mn), fwd)                   # forward
                    cast(n, "w", 1, (Kn, Mn), 1)                     # dgrad
                cast(n, "dy", 1, (rows, Mn), 1)                      # dgrad
                cast(n, "dy", 0, (rows, Mn), 1)                      # wgrad
                keys.update({("w", n), ("dy", n)})
    if fp8.recipe.delayed and keys:
        ends = [c for c in (holders.tp, dp_comm) if c is not None and c.size > 1]
        if "amax-dp-only" in fp8.bugs:
            ends = [c for c in ends if c is not holders.tp]
        add(ends, len(keys), 8)
    return out
