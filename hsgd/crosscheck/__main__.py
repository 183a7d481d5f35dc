"""python -m hsgd.crosscheck DIR: check a dump of one training step (any system's; hsgd/crosscheck/FORMAT.md)
against hsgd's serial reference in float64, and name the kind of bug each wrong gradient shows.

    1. check that the folder holds one whole dump of one run (hsgd.crosscheck.manifest: dump.json lists every file
       with its sha256), read and check the dump (hsgd.crosscheck.read; exit 2 with one line when either fails)
    2. the reference: hsgd.model.serial.loss_and_grads in float64 on the dump's parameters and batch (with experts
       counted as the dumped layout counts: its micro-batches, each rank's rows; hsgd.crosscheck.experts)
    3. every tensor's gradient reassembled from its shards, one copy per replica, and mapped to the reference's
       parameters (a transpose, a fused q|k|v or gate|up cut apart)
    4. per parameter hsgd.verify's table: the largest error of any copy, relative to the reference's largest
       entry of that parameter (or to 1e-3 of the model's largest, when that is larger), and the tolerance
    5. every parameter over its tolerance classified (hsgd.crosscheck.classify): constant factor, partial sum,
       padding, permutation, transposed, swapped (fused parts), part missing (a tied weight's), wrong group (an
       expert's), balance domain, missing, not finite, or no simple pattern; every part of a fused tensor "fused
       layout" when another of the usual layouts (relaid: [q | k | v], per query group, per head, per tp rank) reads
       them all right; one over float64's tolerance but within its dtype's (float32's, or the rounding band) is
       "within the rounding band" ("ok, rounding")

Tolerances by the dump's dtype: float64 loss 1e-10 and gradients 1e-10 (hsgd.verify's, the loss a little wider
since another system sums in another order); float32 1e-6 and 1e-4; bfloat16 and float16 the rounding band of the
tolerance oracle (hsgd.check.oracle): the serial model run in float64 with every rounding of the format at hsgd's
rounding points replaced by a random error as large as a rounding's, --draws times; the band of a parameter is
4 x the rms spread of the draws + 4 sqrt(B T) u_float32, in the oracle's Frobenius-relative distance. That band
models hsgd's rounding points, not the other system's: a system that rounds more often than hsgd does can exceed
it without a bug; look at the class ("no simple pattern" then) before calling it one.

Exit code 0 when the loss and every gradient are within tolerance, 1 otherwise, 2 for a dump that cannot be
checked.
"""
import json
import sys

import numpy as np

from hsgd import cli
from hsgd.cli import Parser
from hsgd.check.verdict import LAMBDA
from hsgd.ep.layout import counts_by_layout
from hsgd.errors import UsageError
from hsgd.model.precision import LOW, unit_roundoff
from hsgd.files import writable_file
from hsgd.readers import printable
from .classify import factor_names
from .experts import Others, reference
from .explain import Explainer
from .manifest import check_set
from .read import load

TOLERANCE = {"float64": (1e-10, 1e-10), "float32": (1e-6, 1e-4)}        # (loss, gradients), relative
FLOOR = 1e-3              # a parameter's error is relative to at least FLOOR x the model's largest gradient entry
STRUCTURE = {"float64": 1e-8, "float32": 1e-4}       # classify: equal up to this relative distance
# the most telling class first: a bug that moves the loss (padding in the softmax) changes every gradient a little,
# and those then show "no simple pattern"
FIRST = ("padding", "balance domain", "partial sum", "unreduced", "wrong group", "fused layout", "part missing",
         "swapped", "constant factor", "permutation", "transposed", "missing", "stale replica", "not finite",
         "replicas differ", "no simple pattern")
HINT = {"padding": "mask the padded entries (their logits to -inf) or drop them before the loss",
        "partial sum": "a reduction of the partial gradients over the ranks named is missing",
        "constant factor": "a scale by the size named is missing or doubled (a sum where a mean belongs)",
        "permutation": "the order in which pieces are gathered or concatenated (rank order, head order)",
        "transposed": "a weight stored (out, in) read as (in, out), or the dump's transposed flag",
        "fused layout": "the order of a fused tensor's pieces: layout.json's fused.interleave and groups, or the "
                        "system's concatenation (per tp rank, per query group, per head)",
        "part missing": "a weight used twice (tied embeddings: the lookup and the LM head) gets only one use's "
                        "gradient: add the other's before the reduction",
        "swapped": "the order of the fused tensor's parts ([gate | up] or [up | gate]; q, k, v) in the system or in "
                   "layout.json's fused.parts",
        "wrong group": "the experts' gradients are averaged over the ranks of dp x cp, where only the ranks holding "
                       "the same experts (the expert-data-parallel group) belong",
        "balance domain": "the balance loss's counts (f) must be summed over the ranks that share its domain (cp, or "
                          "dp x cp for global) before f multiplies P",
        "missing": "the gradient never reaches this rank's buffer (a hook not called, a buffer not synced)",
        "not finite": "an overflow or a division by zero before this gradient",
        "unreduced": "the All-Reduce (or Reduce-Scatter) over the data-parallel group: missing, over another mesh "
                     "dimension (tp), or its result not copied back into the gradient the ranks named hold",
        "stale replica": "the buffer of the ranks named that do not hold the reference: it is read before the "
                         "reduction writes it, or from an earlier step (a gradient not zeroed, a copy not refreshed)",
        "replicas differ": "no replica holds the reference: a reduction over the wrong group (ranks that do not "
                           "share this parameter, or only some of those that do)",
        "no simple pattern": "the arithmetic itself; compare the forward pass first (the loss)"}


ROTARY = {"rope": " (with rotary positions: a system that turns the pairs (2i, 2i + 1) of a head stores q and k "
                  "so, \"rotary\": \"interleaved\" in layout.json)"}
MAX_DRAWS = 100                                                        # runs of the reference for the band


def build_parser():
    p = Parser(
        prog="python -m hsgd.crosscheck",
        description="Check one training step's distributed gradients, dumped by any system (hsgd.train "
                    "--dump-step N DIR, or another system's writer of hsgd/crosscheck/FORMAT.md), against hsgd's "
                    "serial model in float64: a table of every parameter's largest error, and for each one over "
                    "its tolerance the kind of bug it shows (a constant factor named by the layout's sizes, a "
                    "partial sum, padding that takes part, a permutation of heads or rows, ...). Exit 0: all "
                    "within tolerance; 1: some are not; 2: the dump cannot be checked.",
        epilog="Example: mpirun -n 8 python -m hsgd.train --steps 1 --dump-step 1 dump && "
               "python -m hsgd.crosscheck dump")
    p.add_argument("dump", metavar="DIR", help="the dump's folder (layout.json, params.npz, batch.npz, "
                                               "grads-rank{r}.npz)")
    p.add_argument("--json", metavar="FILE", help="also write the verdict, one object per parameter, to FILE")
    p.add_argument("--draws", type=int, default=3, help="bfloat16 and float16 dumps: runs of the rounding-error "
                                                        f"model that set the band, 2 to {MAX_DRAWS} (default: 3)")
    return p


def copies_of(t, grads):
    """([the full stored gradient of tensor t as replica k holds it], [which ranks replica k came from], [the
    padding entries' arrays]): replica k takes, for every box (a slice along one axis, or a box along two: FSDP x
    TP), the k-th shard holding it (cycling where a box has fewer)."""
    by_box, pads, copies, labels = {}, [], [], []
    for s in t.shards:
        real, pad = s.split(grads[s.rank][s.key].astype(np.float64))
        pads.append(pad)
        if not s.slices:
            copies.append(real)
            labels.append(str(s.rank))
        else:
            by_box.setdefault(s.box(), []).append((s, real))
    if by_box:
        n = max(len(v) for v in by_box.values())
        for k in range(n):
            full, ranks = np.zeros(t.shape), []
            for held in by_box.values():
                s, real = held[k % len(held)]
                full[s.where(len(t.shape))] = real
                ranks.append(str(s.rank))
            copies.append(full)
            labels.append("+".join(ranks))
    return copies, labels, pads


def describe(t):
    """The split column: how the tensor's gradient is held ("axis 0 / 4": four pieces along axis 0; "axis 0 / 3 x
    axis 1 / 2": a 2-D split)."""
    real = [s for s in t.shards if all(n for _, _, n in s.box())]          # (not the shards of padding alone)
    boxes = {s.box() for s in real if s.slices}
    axes = sorted({a for b in boxes for a, _, _ in b})
    pieces = {a: len({(o, n) for b in boxes for ax, o, n in b if ax == a}) for a in axes}
    holders = len(real) // max(1, len(boxes))
    text = " x ".join(f"axis {a} / {pieces[a]}" for a in axes) if boxes else "whole"
    if holders > 1:
        text += f", x{holders}"
    if any(s.padding for s in t.shards):
        text += " +pad"
    if len(t.parts) > 1:
        text += f", fused {t.interleave}" + (f" {t.groups}" if t.interleave == "groups" else "")
    if t.transposed:
        text += ", T"
    return text


def rounding_band(dump, params, loss0, grads0, draws):
    """{name: band, "loss": band}: the tolerance oracle's band for the dump's low-precision dtype (see the module
    docstring), from `draws` runs of hsgd's one-rank model in float64 through hsgd.check.oracle.Perturbed. The
    gradients' distances are relative to max(||R||, 1e-3 max ||R_Q||) over the gradients alone, as the errors they
    bound."""
    from mpi4py import MPI

    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    from hsgd.check.oracle import Perturbed, spread
    from hsgd.step.settings import TrainConfig
    cfg = dump.cfg
    if counts_by_layout(cfg):
        raise UsageError("the rounding band is drawn on one rank, which would count a capacity or the micro-batch "
                         "balance domain over the whole batch, unlike the dumped layout; check a float64 dump of "
                         "this model, or dump one without --moe-capacity-factor and with the sequence or global "
                         "balance domain")
    B = dump.idx.shape[0]
    tc = TrainConfig(dp=1, tp=1, pp=1, cp=1, batch_size=B, dtype="float64", micro_batches=1)
    runs = []
    grid = ProcessGrid(MPI.COMM_SELF, dp=1, pp=1, tp=1, cp=1)
    trainer = HybridTrainer(dump.cfg, grid, tc)                      # one model, the draws one after the other
    try:
        trainer.exchange.set_params(params)
        trainer.stage.biases.update(getattr(dump, "biases", None) or {})   # the selection biases the step used
        for d in range(draws):
            trainer.use_numerics(Perturbed(dump.dtype, "float32", salt=d + 1))
            loss = float(trainer.gradients(dump.idx, dump.targets))    # (each starts from a zeroed buffer)
            runs.append(({k: np.array(v, dtype=np.float64) for k, v in trainer.averaged_grads().items()},
                         {"loss": np.array(loss)}))
    finally:
        trainer.finish()
        trainer.free()
        grid.free()
    allowance = LAMBDA * (dump.idx.size ** 0.5) * unit_roundoff("float32")
    var = spread([g for g, _ in runs], grads0)
    var.update(spread([x for _, x in runs], {"loss": np.array(loss0)}))
    return {k: LAMBDA * float(np.sqrt(v)) + allowance for k, v in var.items()}


def structure_tolerance(dtype, tol, R, floor2):
    """How close a wrong gradient must come to a candidate for classify to name it: the dtype's STRUCTURE, or
    twice the tolerance; in bfloat16 and float16 twice the band, which is relative to max(||R||, floor2)."""
    if dtype not in LOW:
        return STRUCTURE.get(dtype, None) or 2 * tol
    norm = float(np.linalg.norm(R))
    return 2 * tol * max(norm, floor2) / max(norm, 1e-300)


def check(dump, draws=3):
    """The verdict: (ok, loss row, rows) with rows [dict per reference parameter]."""
    params = dump.reference_params()
    loss0, grads0 = reference(dump, params)
    low = dump.dtype in LOW
    tol_loss, tol_grad = TOLERANCE.get(dump.dtype, (None, None))
    floor = FLOOR * max(float(np.abs(g).max()) for g in grads0.values())
    floor2 = FLOOR * max(float(np.linalg.norm(g)) for g in grads0.values())
    band = None
    if low:
        band = rounding_band(dump, params, loss0, grads0, draws)
        tol_loss = band["loss"]
    names = factor_names(dump.parallel, dump.idx.size)
    loss_err = abs(dump.loss - loss0) / abs(loss0) if np.isfinite(dump.loss) else float("inf")
    loss_row = {"system": dump.loss, "reference": loss0, "error": loss_err, "tolerance": tol_loss,
                "ok": bool(loss_err <= tol_loss), "finite": bool(np.isfinite(dump.loss)), "detail": ""}
    if not loss_row["ok"] and loss_row["finite"]:
        loss_row["detail"] = Others(dump, params, grads0).loss(dump.loss, tol_loss) or ""
    why = Explainer(dump, params, grads0, names, floor2)   # what a failing gradient is (made when first asked)
    rows = {}
    for t in dump.tensors.values():
        copies, labels, pads = copies_of(t, dump.grads)
        mapped = [t.to_reference(c) for c in copies]
        split = describe(t)
        for name in t.parts:
            R = grads0[name]
            mine = [m[name] for m in mapped]
            abs_err = float(np.max([np.abs(c - R).max() for c in mine]))     # (NumPy's max keeps a NaN of any copy)
            if low:
                err = float(np.max([np.linalg.norm(c - R) for c in mine])) / max(float(np.linalg.norm(R)), floor2)
                tol = band[name]
            else:
                err = abs_err / max(float(np.abs(R).max()), floor)
                tol = tol_grad
            if not np.isfinite(err):
                err = float("inf")
            pad = float(np.max([np.abs(a).max() for a in pads if a.size] or [0.0]))
            pad_limit = tol * max(float(np.abs(R).max()), floor)     # padding: held to the real entries' measure
            ok = err <= tol and pad <= pad_limit
            row = {"name": name, "shape": list(R.shape), "tensor": t.name, "split": split,
                   "abs_error": abs_err, "error": err, "tolerance": tol, "ok": bool(ok), "class": "", "detail": ""}
            if ok and dump.dtype != "float64" and err > TOLERANCE["float64"][1]:
                row["class"] = "within the rounding band"          # not exact, but as close as the dtype can be
                row["detail"] = (f"{err:.1e}: over float64's {TOLERANCE['float64'][1]:.0e}, within {dump.dtype}'s "
                                 f"{tol:.1e}")
            if not ok:
                row["class"], row["detail"] = why.of(t, name, copies, labels, mine,
                                                     structure_tolerance(dump.dtype, tol, R, floor2),
                                                     pad if pad > pad_limit else 0.0)
            rows[name] = row
    ordered = [rows[n] for n in dump.cfg.param_shapes()]
    ok = loss_row["ok"] and all(r["ok"] for r in ordered)
    return ok, loss_row, ordered


def report(dump, ok, loss_row, rows, out=None):
    """The table and the verdict, on `out` (default: standard output)."""
    out = out or sys.stdout
    low = dump.dtype in LOW
    metric = "rel. distance" if low else "max rel err"
    print(f"hsgd.crosscheck | {dump.path} | {printable(dump.meta.get('system', '(system not named)'))}", file=out)
    p = dump.parallel
    ep = f" (experts over ep {p['ep']})" if p["ep"] > 1 else ""
    print(f"{dump.ranks} ranks: dp {p['dp']} x pp {p['pp']} x cp {p['cp']} x tp {p['tp']}{ep}, {p['micro_batches']} "
          f"micro-batch(es) | {dump.dtype} | batch {dump.idx.shape[0]} x {dump.idx.shape[1]} | reference: "
          f"hsgd.model.serial in float64", file=out)
    flag = "" if loss_row["ok"] else "   <- over tolerance"
    print(f"loss: system {loss_row['system']:.12g}  reference {loss_row['reference']:.12g}  rel err "
          f"{loss_row['error']:.1e} (tolerance {loss_row['tolerance']:.1e}){flag}", file=out)
    w = max([22] + [len(r["name"]) + 1 for r in rows])                 # (an expert's names are long)
    ws = max([34] + [len(r["split"]) + 1 for r in rows])             # (a fused tensor split along two axes)
    print(f"{'parameter':<{w}}{'shape':>11}  {'split':<{ws}}{'max abs err':>12}{metric:>14}{'tolerance':>10}  verdict",
          file=out)
    for r in rows:
        verdict = ("ok, rounding" if r["class"] else "ok") if r["ok"] else r["class"]
        print(f"{r['name']:<{w}}{str(tuple(r['shape'])):>11}  {r['split']:<{ws}}{r['abs_error']:>12.1e}"
              f"{r['error']:>14.1e}{r['tolerance']:>10.0e}  {verdict}", file=out)
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print("", file=out)
        print("what the failures look like:", file=out)
        for r in bad:
            print(f"  {r['name']}: {r['class']}: {r['detail']}", file=out)
        kinds = {}
        for r in bad:
            kinds.setdefault(r["class"], []).append(r["name"])
        summary = "; ".join(f"{k} ({len(v)})" for k, v in kinds.items())
        print(f"FAIL: {len(bad)} of {len(rows)} parameters over tolerance: {summary}" +
              ("" if loss_row["ok"] else "; and the loss differs: " + (loss_row["detail"] or "the forward pass itself "
                                          "(or the parameters, or the batch written) is not the reference's" +
                                          ROTARY.get(dump.cfg.positions, ""))),
              file=out)
        first = min(kinds, key=lambda k: FIRST.index(k) if k in FIRST else len(FIRST))
        print(f"look first at: {first} ({', '.join(kinds[first][:3])}{', ...' if len(kinds[first]) > 3 else ''})"
              f"; {HINT.get(first, '')}", file=out)
    elif not loss_row["finite"]:
        print("FAIL: every gradient is within tolerance, but the loss the system reports is not finite (inf or "
              "NaN): an overflow in the loss itself, or a loss that was never written", file=out)
    elif not loss_row["ok"]:
        print("FAIL: every gradient is within tolerance, the loss is not: the loss the system reports is not the "
              "mean over all B*T positions (or not of this batch)", file=out)
    else:
        worst = max(rows, key=lambda r: r["error"] / r["tolerance"])
        rounded = sum(1 for r in rows if r["class"])
        print(f"PASS: the loss and all {len(rows)} gradients within tolerance (the closest to it: {worst['name']}, "
              f"{worst['error']:.1e}, {worst['error'] / worst['tolerance']:.1%} of its tolerance)" +
              (f"; {rounded} within the rounding band of {dump.dtype}, not exact" if rounded else ""), file=out)


def main(argv=None):
    """The exit code of python -m hsgd.crosscheck argv: 0 or 1 (the verdict), 2 with one line for a dump that cannot
    be checked or another usage error (hsgd.cli)."""
    return cli.run(lambda: command(build_parser().parse_args(argv)))


def command(args):
    if not 2 <= args.draws <= MAX_DRAWS:
        raise UsageError(f"--draws {args.draws}: the band needs at least 2 draws of the error model, and takes at "
                         f"most {MAX_DRAWS} (each is a run of the reference)")
    if args.json:
        writable_file(args.json, "--json", UsageError)            # before any work (hsgd.run.preflight)
    check_set(args.dump)                                          # one whole set of one run's files
    dump = load(args.dump)
    ok, loss_row, rows = check(dump, args.draws)
    report(dump, ok, loss_row, rows)
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"ok": ok, "loss": loss_row, "parameters": rows}, f, indent=1)
        except OSError as e:
            raise UsageError(f"--json {args.json!r} cannot be written ({e.strerror}); give a writable file") from None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
