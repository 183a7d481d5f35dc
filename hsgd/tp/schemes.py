"""The three tensor-parallel schemes as objects: where the activations live between the split matmuls, and the
collectives that carry them into and out of those matmuls.

hsgd.tp.model writes the model once. Wherever the schemes differ it calls its scheme object S:

    a_in = S.enter_forward(a)        into the column-parallel linears (q, k, v; fc; the LM head)
    o    = S.proj_forward(y, W, b)   the attention and MLP output projections, back to the scheme's layout
    x    = S.leave_forward(x)        the embedding's exit: the vocab-parallel lookup is a partial sum
    t0, t1 = S.rows(T)               the positions this rank holds between the split matmuls

and the adjoints (enter_backward, proj_backward, leave_backward) in the backward pass, read upside down.

              enter (forward / backward)          leave (forward / backward)          output projections
  Megatron    f: identity / Allreduce             g: Allreduce / identity             row-parallel, then g
  Gather      f                                   g (the embedding's exit only)       column-parallel, All-Gathered
  Sequence    gather_T: All-Gather along T /      scatter_T: Reduce-Scatter along T   row-parallel, then scatter_T
              Reduce-Scatter along T              / All-Gather along T
Between the split matmuls a rank holds the whole activation (B, T, C), or in Sequence its T-shard (B, T/tp, C).

The operators themselves are in hsgd.tp.layers. make_scheme("megatron" | "gather" | "sequence") builds one.

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, L layers, N = B*T rows, s bytes per element, tp
ranks; T~ is what a rank holds between the split matmuls: T, or T/tp (sequence).
"""
from hsgd.model.backend import array_module
from hsgd.errors import ConfigError
from hsgd.model import ops as model_ops
from hsgd.tp.layers import (allgather_backward, allgather_forward, f_backward, f_forward, g_backward, g_forward,
                        gather_T_backward, gather_T_forward, gather_linear_forward, scatter_T_backward,
                        scatter_T_forward)

SCHEMES = ("megatron", "gather", "sequence")
PROJ_WEIGHTS = ("attn.proj.weight", "mlp.proj.weight")
PROJ_BIASES = ("attn.proj.bias", "mlp.proj.bias")


def make_scheme(scheme, reduce_scatter=False, ops=model_ops):
    """The scheme object for a name in SCHEMES; a scheme object is returned as it is. reduce_scatter: the gather
    scheme's backward pays for a Reduce_scatter_block where the local slice would do (see Gather). ops: where the
    output projections take their products from (linear_forward, linear_input_grad, linear_weight_grad:
    hsgd.model.ops, or an FP8 run's quantizing products, hsgd.fp8.linear)."""
    if not isinstance(scheme, str):
        return scheme
    if scheme == "megatron":
        return Megatron(ops)
    if scheme == "gather":
        return Gather(reduce_scatter, ops)
    if scheme == "sequence":
        return Sequence(ops)
    raise ConfigError(f"tp_scheme={scheme!r} is not known; use one of {', '.join(SCHEMES)}")


class Megatron:
    """Megatron-LM's tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053).

    q, k, v and fc are column-parallel: Y = X A, A = [A_1 ... A_tp], rank i computes X A_i (its NH/tp whole heads,
    which attend locally; its F/tp MLP columns). The attention and MLP output projections are row-parallel:
    Y = X B, B = [B_1; ...; B_tp], rank i computes the partial product X_i B_i. Between the split matmuls every rank
    holds the whole (B, T, C) activation: LayerNorm and the residual stream are replicated. The conjugate pair
        f  (enters a column-parallel region):  forward identity,   backward Allreduce (each rank's dX is partial)
        g  (leaves a row-parallel region):     forward Allreduce,  backward identity  (dY is replicated)
    costs 2 Allreduces of (B, T, C) per block forward (g), 2 backward (f). The embedding's exit is a g too.
    """
    splits_T = False                      # between the split matmuls: the whole T (True: this rank's T-shard)
    gathers_proj_inputs = False           # True: the projections cache their All-Gathered input (the gather scheme)

    def __init__(self, ops=model_ops):
        self.ops = ops                    # the projections' products: linear_forward, _input_grad, _weight_grad

    def check(self, cfg, tp, ok_tps):
        """Raise ConfigError if cfg does not split over tp ranks beyond heads and d_ff (ok_tps: the tp that do)."""

    def enter_forward(self, x, comm):
        """f, forward: identity. x (B, T, C) replicated enters a column-parallel region."""
        return f_forward(x, comm)

    def enter_backward(self, dx, comm):
        """f, backward: Allreduce of the partial dX (B, T, C), each rank's columns' share."""
        return f_backward(dx, comm)

    def leave_forward(self, y, comm):
        """g, forward: Allreduce of the partial sums y (B, T, C) into the whole, replicated Y."""
        return g_forward(y, comm)

    def leave_backward(self, dy, comm):
        """g, backward: identity; dY (B, T, C) is replicated."""
        return g_backward(dy, comm)

    def proj_forward(self, y_part, W_part, b, comm):
        """Row-parallel projection O = leave(Y_i B_i) + b. y_part (B, T, Cin/tp): this rank's heads or MLP columns;
        W_part (Cin/tp, C): its rows of B; b (C,) replicated, added once, after the sum. O is (B, T~, C)."""
        o, cache = self.ops.linear_forward(y_part, W_part)               # (B, T, C) partial: my rows' product
        o = self.leave_forward(o, comm)                                  # (B, T~, C) g: Allreduce | scatter_T
        if b is not None:                                                # (None: a family without biases)
            o += b
        return o, cache

    def proj_backward(self, do, cache, grads, prefix, comm, wg):
        """db += sum of dO over the rows held (sequence: a partial sum); dO = leave^T(dO) (B, T, C);
        dB_i += Y_i^T dO, handed to wg (hsgd.tp.wgrad.WeightGrads: done now, or in the W pass); returns dY_i = dO B_i^T
        (B, T, Cin/tp). prefix: the projection's parameter names without weight/bias, e.g. "h.0.attn.proj.";
        grads: where db goes (replicated: it stays in this pass)."""
        if prefix + "bias" in grads:                                     # (C,) replicated
            grads[prefix + "bias"] += do.reshape(-1, do.shape[-1]).sum(axis=0)
        do = self.leave_backward(do, comm)                               # (B, T, C) g^T: identity | All-Gather
        wg.add(self.ops.linear_weight_grad, (do, cache), prefix + "weight")   # (Cin/tp, C) dB_i += Y_i^T dO
        return self.ops.linear_input_grad(do, cache)                     # (B, T, Cin/tp)

    def rows(self, T, comm):
        """The positions [t0, t1) this rank holds between the split matmuls: all of them."""
        return 0, T

    def split_of(self, name):
        """How a parameter is split: ("rep", None), ("split", axis) or ("vocab", axis)."""
        if name == "wte":
            return "vocab", 0                                            # rows: vocabulary ids
        if name == "lm_head.weight":
            return "vocab", 1                                            # columns: vocabulary ids
        if ".moe.experts." in name:                                      # every expert split as Megatron's MLP, in
            if name.endswith("proj.weight"):                             # every scheme (hsgd.tp.experts)
                return "split", 0                                        # row-parallel
            if name.endswith("proj.bias"):
                return "rep", None                                       # added once: by tp rank 0
            return "split", 1 if name.endswith(".weight") else 0        # fc, gate, up: column-parallel
        if any(f".{m}." in name for m in ("attn.q", "attn.k", "attn.v", "mlp.fc", "mlp.gate", "mlp.up")):
            return "split", 1 if name.endswith(".weight") else 0         # column-parallel
        if name.endswith(PROJ_WEIGHTS):
            return "split", 0                                            # row-parallel: B_i, rows of B
        return "rep", None                                               # wpe, LayerNorms, the projections' biases

    def replicated_grads(self, grads, names):
        """Where the backward pass accumulates the gradients of the replicated parameters `names`, and what
        finish_replicated needs. Every rank computes them whole, from replicated activations: into grads itself."""
        return grads, None

    def finish_replicated(self, part, grads, comm):
        """Nothing to add up: the replicated gradients are whole (and equal) on every rank."""

    def activation_shape(self, batch, cfg, tp, cp=1):
        """The activation one pipeline stage hands to the next: (B, T~, C), of the T/cp positions a rank holds."""
        T = cfg.seq_len // cp
        return (batch, T // tp if self.splits_T else T, cfg.d_model)

    def comm_formula(self, cfg, batch, s, L, first, last, cp=1):
        """{("tp", op): (calls, payload bytes)} of one forward + backward of L blocks, with the embedding if first,
        the LM head and the loss if last. Allreduce: 4L (2 g forward, 2 f backward per block) + 1 (embedding's g)
        + 3 (LM head's f; the cross-entropy's MAX of (N,) and SUM of (2, N)); bytes (4LC + C + C + 3) N s."""
        N, C, emb, head = batch * (cfg.seq_len // cp), cfg.d_model, int(first), int(last)
        calls = 4 * L + emb + 3 * head
        return nonzero({("tp", "Allreduce"): (calls, (4 * L * C + emb * C + head * (C + 3)) * N * s)})

    def block_forward_formula(self, cfg, batch, s, cp=1):
        """{("tp", op): (calls, payload bytes)} of one block's forward alone: what --recompute full repeats.
        Megatron: the two g's, Allreduce of (N, C) each."""
        N, C = batch * (cfg.seq_len // cp), cfg.d_model
        return {("tp", "Allreduce"): (2, 2 * N * C * s)}


class Gather(Megatron):
    """The lecture's scheme: every linear column-split, its output All-Gathered so that every rank holds it whole.

    q, k, v and fc are split as in Megatron (their outputs are consumed locally: attention by heads, GELU
    elementwise), so the All-Gather comes after attention and after GELU. The output projections are column-split
    too, Y = [Y_1 ... Y_tp] = Allgather(X A_i + b_i), with X the All-Gathered heads (or GELU output). The adjoint of
    an All-Gather is a Reduce-Scatter; here the downstream work is replicated, so every rank holds the whole dL/dY
    and the adjoint is the local slice (reduce_scatter=True pays for a Reduce_scatter_block scaled by 1/tp instead:
    the same numbers). The partial dX of each column-split linear is All-Reduced. Enter and leave are Megatron's.
    """
    gathers_proj_inputs = True

    def __init__(self, reduce_scatter=False, ops=model_ops):
        super().__init__(ops)
        self.reduce_scatter = reduce_scatter

    def proj_forward(self, y_part, W_part, b_part, comm):
        """O = Allgather(Allgather(Y_i) A_i + b_i): y_part (B, T, Cin/tp), W_part (Cin, C/tp), b_part (C/tp,)."""
        y = allgather_forward(y_part, comm)                              # (B, T, Cin) Allgather of heads / columns
        return gather_linear_forward(y, W_part, b_part, comm, self.ops.linear_forward)   # (B, T, C) Allgather

    def proj_backward(self, do, cache, grads, prefix, comm, wg):
        """dA_i, db_i from my slice of dO (both split: handed to wg together); dY = Allreduce of the partial dY;
        returns my slice dY_i (B, T, Cin/tp). (tp_layers.gather_linear_backward, its weight gradient separable.)"""
        rs = self.reduce_scatter
        do_part = allgather_backward(do, comm, replicated=True, reduce_scatter=rs)   # (B, T, C/tp) my slice
        wg.add(self.ops.linear_weight_grad, (do_part, cache), prefix + "weight",
               prefix + "bias" if prefix + "bias" in grads else None)  # dA_i += X^T dO_i, db_i
        dy = self.ops.linear_input_grad(do_part, cache)                  # (B, T, Cin) partial: my columns' share
        comm.Allreduce(dy)                                               # (B, T, Cin) whole dY
        return allgather_backward(dy, comm, replicated=True, reduce_scatter=rs)   # (B, T, Cin/tp) my slice

    def split_of(self, name):
        if name.endswith(PROJ_WEIGHTS):
            return "split", 1                                            # column-parallel: A_i, columns
        if name.endswith(PROJ_BIASES):
            return "split", 0
        return super().split_of(name)

    def comm_formula(self, cfg, batch, s, L, first, last, cp=1):
        """Allgather 4L, bytes L (3C + F) N s: per block the heads (C) and proj's output (C), GELU's output (F) and
        proj's output (C). Allreduce 4L + emb + 3 head: the partial dX of those four, bytes (3C + F) L N s, plus the
        embedding, LM head and cross-entropy as in Megatron. With reduce_scatter, Reduce_scatter_block as Allgather."""
        N, C, F, emb, head = batch * (cfg.seq_len // cp), cfg.d_model, cfg.d_ff, int(first), int(last)
        gathered = (4 * L, L * (3 * C + F) * N * s)
        out = {("tp", "Allgather"): gathered,
               ("tp", "Allreduce"): (4 * L + emb + 3 * head, ((3 * C + F) * L + emb * C + head * (C + 3)) * N * s)}
        if self.reduce_scatter:
            out[("tp", "Reduce_scatter_block")] = gathered
        return nonzero(out)

    def block_forward_formula(self, cfg, batch, s, cp=1):
        """The forward's four All-Gathers (heads, attention proj's output, GELU's output, MLP proj's output);
        its Allreduces are all in the backward pass."""
        N, C, F = batch * (cfg.seq_len // cp), cfg.d_model, cfg.d_ff
        return {("tp", "Allgather"): (4, (3 * C + F) * N * s)}


class Sequence(Megatron):
    """Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198): Megatron's split of the matmuls, with what
    lies between them -- LayerNorm, the residual stream, the embedding's output -- split along T.

    Those operations treat every position on its own, so rank r holds only positions [r T/tp, (r+1) T/tp): the
    T-shard x^s (B, T/tp, C). gather_T (All-Gather along T; backward Reduce-Scatter) enters each column-parallel
    region in place of f; scatter_T (Reduce-Scatter along T; backward All-Gather) leaves each row-parallel one in
    place of g, and is the embedding's exit. The model caches only the T-shard of each column-parallel input and
    gathers it again in the backward pass, so every cached activation is divided by tp (hsgd.accounting.activations),
    for 2L + 1 more All-Gathers per step. The replicated parameters (LayerNorms, the projections' biases, wpe) see only
    this rank's rows: their gradients are partial, dw = sum_r dw^(r), and are All-Reduced, one contiguous buffer per
    gradient group. Left out: dropout (hsgd has none), overlapping the collectives with compute.
    """
    splits_T = True

    def check(self, cfg, tp, ok_tps):
        check_seq_len(cfg.seq_len, tp, [t for t in ok_tps if cfg.seq_len % t == 0])

    def enter_forward(self, x_s, comm):
        """gather_T, forward: All-Gather along T, (B, T/tp, C) -> (B, T, C)."""
        return gather_T_forward(x_s, comm)

    def enter_backward(self, dx, comm):
        """gather_T, backward: Reduce-Scatter along T of the partial dX, (B, T, C) -> (B, T/tp, C)."""
        return gather_T_backward(dx, comm)

    def leave_forward(self, y, comm):
        """scatter_T, forward: Reduce-Scatter along T of the partial sums, (B, T, C) -> (B, T/tp, C)."""
        return scatter_T_forward(y, comm)

    def leave_backward(self, dy_s, comm):
        """scatter_T, backward: All-Gather along T, (B, T/tp, C) -> (B, T, C)."""
        return scatter_T_backward(dy_s, comm)

    def rows(self, T, comm):
        """This rank's T-shard of positions [r T/tp, (r+1) T/tp)."""
        check_seq_len(T, comm.size)
        Tl = T // comm.size
        return comm.rank * Tl, (comm.rank + 1) * Tl

    def replicated_grads(self, grads, names):
        """Each rank sees only its rows: the partial gradients go to one zeroed contiguous buffer, through a copy of
        the grads dict whose `names` point into it. Returns (that dict, what finish_replicated needs). No names (a
        family without them, e.g. no wpe with rotary positions): grads itself, nothing to finish."""
        if not names:
            return grads, None
        xp = array_module(grads[names[0]])
        flat = xp.zeros(sum(grads[n].size for n in names), dtype=grads[names[0]].dtype)   # (sum of sizes,)
        local, offset = dict(grads), 0
        for n in names:
            local[n] = flat[offset:offset + grads[n].size].reshape(grads[n].shape)
            offset += grads[n].size
        return local, (flat, local, names)

    def finish_replicated(self, part, grads, comm):
        """Allreduce of the group's partial gradients (one call), then accumulate (+=) them into grads."""
        if part is None:
            return
        flat, local, names = part
        comm.Allreduce(flat)                                             # sum of the tp partials
        for n in names:
            grads[n] += local[n]

    def comm_formula(self, cfg, batch, s, L, first, last, cp=1):
        """Allgather 6L + emb + 2 head, of (N, C) each: per block 2 forward (into q, k, v and fc), the same 2
        again in the backward pass (only T-shards were cached), 2 adjoints of the scatter_T; the embedding's
        adjoint; into the LM head forward and again backward.
        Reduce_scatter_block 4L + emb + head, of (N, C): per block 2 scatter_T forward (attention and MLP proj),
        2 adjoints of the gathers; the embedding's exit; the LM head's adjoint.
        Allreduce L + emb + 3 head: the cross-entropy 2 (3N), one per gradient group of partial replicated
        gradients: block (GPT-2: ln1, ln2, attn.proj.bias, mlp.proj.bias: 6C; Llama: ln1, ln2: 2C), embedding (wpe:
        TC; none with rotary positions), head (ln_f: 2C, or C with RMSNorm).
        (A ring costs an Allreduce 2 (tp-1)/tp of its bytes, an Allgather or Reduce-Scatter (tp-1)/tp: this scheme
        moves what Megatron does, plus the repeated All-Gathers and the small Allreduces.)"""
        N, C, T, emb, head = batch * (cfg.seq_len // cp), cfg.d_model, cfg.seq_len, int(first), int(last)
        ag, rs = 6 * L + emb + 2 * head, 4 * L + emb + head
        norms = 2 if cfg.norm == "layernorm" else 1                      # a norm's weight, and bias
        wpe = int(cfg.positions == "learned")
        ar_bytes = (3 * N * head + (L * (2 * norms + 2 * cfg.bias) + head * norms + T * emb * wpe) * C) * s
        return nonzero({("tp", "Allgather"): (ag, ag * N * C * s),
                        ("tp", "Reduce_scatter_block"): (rs, rs * N * C * s),
                        ("tp", "Allreduce"): (L + emb * wpe + 3 * head, ar_bytes)})

    def block_forward_formula(self, cfg, batch, s, cp=1):
        """gather_T into q, k, v and into fc; scatter_T out of both projections: 2 + 2 calls of (N, C)."""
        N, C = batch * (cfg.seq_len // cp), cfg.d_model
        return {("tp", "Allgather"): (2, 2 * N * C * s), ("tp", "Reduce_scatter_block"): (2, 2 * N * C * s)}


def nonzero(formula):
    """The entries of a {(comm, op): (calls, bytes)} formula with at least one call."""
    return {k: v for k, v in formula.items() if v[0]}


def check_seq_len(T, tp, tps=None):
    """Raise ConfigError unless T splits into tp equal T-shards. tps: the tp values to suggest."""
    if T % tp:
        tps = tps if tps is not None else [t for t in range(1, min(T, 64) + 1) if T % t == 0]
        raise ConfigError(f"seq_len={T} is not divisible by tp={tp}: the sequence scheme gives each tensor-parallel "
                          f"rank seq_len/tp positions; use a seq_len that is a multiple of {tp} "
                          f"(e.g. {[tp * k for k in range(max(T // tp, 1), max(T // tp, 1) + 3)]}) or tp in {tps}")
