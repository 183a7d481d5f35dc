# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 20: checking another system's distributed gradients
#
# The second chapter of Part IV, operations. Every chapter so far checked hsgd against hsgd; a production team asks
# it of its own system: does our tensor-parallel, data-parallel, gradient-accumulating step compute the gradient a
# single device would compute on the whole batch? The lecture's section 3.4 (the gradient sync across groups) is
# where most answers go wrong: each shard's G gradients must be summed over the groups and divided by G, replicated
# parameters (the LayerNorms) reduced too. This chapter checks PyTorch programs with `python -m hsgd.crosscheck`,
# from their dump to a verdict that names the bug.
#
# Eight ranks: about 5 s on a 2-core machine without PyTorch; with it, sections 4 and 6 also run two PyTorch
# programs (12 s in all measured, up to a minute on a loaded machine). Rank 0 prints and draws three pictures:
#
# mpirun -n 8 python tutorials/20_checking_another_system.py
#
# Legend: B sequences in the global batch, T sequence length, C d_model, NH heads, hs = C / NH the head size, F d_ff,
# V vocabulary, L layers; dp, pp, tp the sizes of a layout, m (M in the PyTorch program) micro-batches per dp rank
# and step; G a system's gradient of one parameter (assembled from its shards), R the reference's (hsgd's serial
# model in float64, same parameters and batch); a "replica" is one full copy of G assembled from one set of ranks.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as appendix B explains (OpenBLAS's thread timeout)
from hsgd.model import serial

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from hsgd.crosscheck import dcp, from_dcp, fused
from hsgd.crosscheck.__main__ import STRUCTURE, check as crosscheck, copies_of, report
from hsgd.crosscheck.dump import grads_file
from hsgd.crosscheck.local import Local
from hsgd.crosscheck.manifest import check_set, new_run, seal
from hsgd.crosscheck.read import load
from hsgd.crosscheck.write import write_rank
from hsgd.crosscheck.hsgd_dump import dump_one_step
from hsgd.model.data import Corpus
from hsgd.check.mutations import BUGS, injected

import pictures                                  # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, train_config   # tutorials/checks.py, shared by the chapters

P = 8
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=84)
HERE = os.path.dirname(os.path.abspath(__file__))
DUMPS = os.path.join(HERE, "crosscheck_dumps")     # the PyTorch program's dumps, committed (their README.md)


def folder(name):
    return os.path.join(DUMPS, name)


def verdict_of(path, label="DIR"):
    """hsgd.crosscheck on the dump in `path` (rank 0): (ok, loss row, {name: row}, the printed table, with the
    folder's path printed as `label`). As the command does, first the set: dump.json and every file it lists."""
    check_set(path)
    dump = load(path)
    ok, loss_row, rows = crosscheck(dump)
    out = io.StringIO()
    report(dump, ok, loss_row, rows, out)
    return ok, loss_row, {r["name"]: r for r in rows}, out.getvalue().replace(path, label)


def failed(rows):
    return {n for n, r in rows.items() if not r["ok"]}


# %% [markdown]
# ## 1. Why one step, per parameter
#
# A layout that computes a different gradient seldom crashes. Summing the micro-batches' gradients instead of
# averaging them is SGD with an m times larger learning rate: the loss still goes down. A LayerNorm left out of the
# data-parallel All-Reduce lets the replicas drift apart slowly; padded vocabulary rows in the softmax change the
# loss by a fraction of a percent. Loss curves cannot tell these from another seed, another summation order
# (chapter 14) or an unlucky data order.
#
# One step can: compute the exact gradient of the mean loss in float64 on one device (`serial.loss_and_grads`, the
# reference R) from the step's parameters and batch, and compare it per parameter with what every rank holds after
# the step's reductions (G). A correct layout agrees to about 1e-15; a bug shows as an error of order one, and the
# *shape* of the difference names it: G = m R a missing 1/m, replicas whose mean is R a missing average, gradient on
# rows that stand for no token padding that takes part. `python -m hsgd.crosscheck DIR` does this on a dump any
# system can write (JSON and `.npz` files, `hsgd/crosscheck/FORMAT.md`).

# %% [markdown]
# ## 2. The dump format, on a real dump
#
# The PyTorch program of section 4 wrote `tutorials/crosscheck_dumps/torch_tp2_dp2/` on 4 ranks, tp 2 x dp 2, rank =
# dp_rank x tp + tp_rank: `layout.json`, `params.npz` (the whole parameters before the step, as PyTorch stores them),
# `batch.npz`, `grads-rank{r}.npz` (rank r's gradient pieces) and, last, `dump.json` (every file's size and sha256,
# so that an incomplete or mixed folder is refused). The layout gives every tensor's full shape, its mapping to
# hsgd's parameters and where its gradient's pieces are. Four entries:

# %%
def show_format():
    """The layout's header and four entries, and what the mapping gives (rank 0)."""
    path = folder("torch_tp2_dp2")
    with open(os.path.join(path, "layout.json")) as f:
        meta = json.load(f)
    lines = [f"system: {meta['system']}", f"model: {json.dumps(meta['model'])}",
             f"dtype: {meta['dtype']}, loss: {meta['loss']:.12g}, ranks: {meta['ranks']}, "
             f"parallel: {json.dumps(meta['parallel'])}"]
    for name in ("wte", "h.0.ln1.weight", "h.0.attn.qkv.weight", "h.0.attn.proj.weight"):
        e = meta["tensors"][name]
        extra = {k: v for k, v in e.items() if k not in ("shape", "dtype", "shards")}
        shards = ", ".join(f"r{s['rank']}" + ("" if s["axis"] is None else
                                              f" ax{s['axis']}[{s['offset']}:{s['offset'] + s['length']}]"
                                              + (f"+{s['padding']}pad" if s.get("padding") else ""))
                           for s in e["shards"])
        lines.append(f"  {name}: shape {e['shape']} {json.dumps(extra) if extra else ''}")
        lines.append(f"      shards: {shards}")
    dump = load(path)
    cfg, hs = dump.cfg, dump.cfg.d_model // dump.cfg.n_heads
    ref = dump.reference_params()                       # every stored tensor mapped to hsgd's names and shapes
    init = serial.init_params(cfg, seed=0, dtype="float64")    # what the program started from (--seed 0)
    same_init = all(np.array_equal(ref[n], init[n]) for n in init)
    round_trip = all(np.array_equal(t.from_reference(t.to_reference(dump.params[t.name])), dump.params[t.name])
                     and all(np.array_equal(a, ref[p]) for p, a in t.to_reference(t.from_reference(ref)).items())
                     for t in dump.tensors.values())
    qkv = dump.params["h.0.attn.qkv.weight"]            # (3C, C): rows [q_0 k_0 v_0 q_1 ...], hs rows each
    k_head0 = np.array_equal(qkv[hs:2 * hs], init["h.0.attn.k.weight"][:, :hs].T)
    v_head1 = np.array_equal(qkv[5 * hs:6 * hs], init["h.0.attn.v.weight"][:, hs:2 * hs].T)
    t = dump.tensors["lm_head.weight"]
    copies, labels, _ = copies_of(t, dump.grads)
    return dict(lines=lines, same_init=same_init, round_trip=round_trip, k_head0=k_head0, v_head1=v_head1,
                hs=hs, C=cfg.d_model, labels=labels, n_tensors=len(dump.tensors), n_params=len(init))


fmt = pictures.on_rank0(world, show_format, share=True)
for line in fmt["lines"]:
    say(line)
say(f"{fmt['n_tensors']} tensors of the system hold hsgd's {fmt['n_params']} parameters; lm_head.weight's gradient "
    f"reassembled as {len(fmt['labels'])} replicas, from ranks {' and '.join(fmt['labels'])}")
check.holds("the dump's parameters, mapped through layout.json = hsgd.model.serial.init_params(seed 0)",
            fmt["same_init"])
check.holds("every tensor: from_reference(to_reference(x)) = x, and the other way round", fmt["round_trip"])
check.holds(f"fused qkv rows hs..2hs (hs = {fmt['hs']}) = head 0 of k, transposed", fmt["k_head0"])
check.holds("fused qkv rows 5hs..6hs = head 1 of v, transposed", fmt["v_head1"])
check.equal("lm_head's replicas: one per dp rank, each from its two tp ranks", fmt["labels"], ["0+1", "2+3"])

# %% [markdown]
# `wte`'s rows, the vocabulary, are split over the tp ranks; ranks 2 and 3 hold the same slices as ranks 0 and 1, the
# other dp rank's replica. The LayerNorm weight is whole on every rank (`axis` null, four replicas), each copy
# checked. The fused `qkv` is `nn.Linear(C, 3C)`, stored (out, in), hence `transposed`; its rows interleave q, k and
# v per head, `[q_0 k_0 v_0 q_1 k_1 v_1 ...]` (Megatron-LM's fused query_key_value), so the split gives every tp rank
# whole heads (`fused`, with `group` = hs rows per piece). `proj` (row-parallel) is split along axis 1.
#
# What a system must dump: the gradients after every reduction of the step (tp, dp, micro-batches) and before
# clipping, weight decay, the optimizer and any loss scale; the parameters before the step; the global batch in the
# order of the mean loss. A system sharding flat chunks (ZeRO) gathers them to the parameters' shapes first.

# %% [markdown]
# ## 3. hsgd's own dumps
#
# `hsgd.train --dump-step N DIR` writes step N of any run as such a dump; `dump_one_step` does it without a training
# run. Two layouts of the eight ranks, on a vocabulary (V = 15) that tp 4 does not divide, so the last tp rank's
# rows carry padding:

# %%
CFG = ModelConfig(vocab_size=15, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=16)
CORPUS = Corpus(np.random.default_rng(1).integers(0, 15, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def hsgd_verdict(**kw):
    """Dump step 1 of hsgd's layout kw on the 8 ranks, crosscheck it on rank 0: the verdict on every rank."""
    tc = train_config(batch_size=kw.pop("batch_size", 8), steps=1, **kw)
    path = world.bcast(tempfile.mkdtemp(prefix="hsgd-dump-") if rank == 0 else None)
    try:
        dump_one_step(CFG, tc, world, path, CORPUS)
        return pictures.on_rank0(world, lambda: verdict_of(path), share=True)
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


for i, kw in enumerate([dict(dp=2, tp=4), dict(dp=2, pp=2, tp=2, zero=1, micro_batches=2)]):
    name = f"dp {kw['dp']} x pp {kw.get('pp', 1)} x tp {kw['tp']}" + (", ZeRO 1, m 2" if "zero" in kw else "")
    ok, loss_row, rows, table = hsgd_verdict(**kw)
    lines = table.splitlines()
    say(f"\n$ python -m hsgd.crosscheck DIR      (hsgd {kw})")
    for line in (lines[:10] + ["   ..."] + lines[-2:] if i == 0 else lines[:3] + ["   ..."] + lines[-1:]):
        say("  " + line)
    check.holds(f"hsgd {name}: PASS", ok)
    check(f"hsgd {name}: the largest gradient error, relative", max(r["error"] for r in rows.values()))
    check(f"hsgd {name}: the loss, relative", loss_row["error"])

# %% [markdown]
# One row per parameter: its shape, how the dump holds it (`split`: "axis 0 / 4, x2 +pad" is four tp slices along
# axis 0, two replicas, padding that must be zero), the largest absolute error over every replica, that error
# relative to the parameter's largest reference entry (floored at 1e-3 of the model's largest gradient entry), and
# the dtype's tolerance. The k biases' errors, ~1e-21, are rounding noise: their exact gradient is zero (a softmax
# ignores a shift shared by a row of scores); sections 4 and 9 meet them again.

# %% [markdown]
# ## 4. The PyTorch system
#
# `benchmarks/crosscheck_torch.py` is one step of the same GPT as a PyTorch user writes it: `nn.Embedding`,
# `nn.LayerNorm`, `nn.Linear`, one fused qkv per block; `tp*dp` gloo processes on `init_device_mesh("cpu", (dp,
# tp))`; `parallelize_module` for tensor parallelism (`ColwiseParallel` for qkv and fc, `RowwiseParallel` for the
# projections and the vocabulary-parallel embedding, the logits left split for `loss_parallel()`); data parallelism
# by hand, a `dist.all_reduce` over the dp group and a division by dp; `--micro-batches M`. Its `--bug` switches on
# one of three real mistakes.
#
# PyTorch is not among hsgd's requirements, so the program's small dumps are committed (the commands in
# `tutorials/crosscheck_dumps/README.md`); where PyTorch is installed the chapter reruns the first and checks that
# the fresh dump equals the committed one.

# %%
MODEL = "--seq-len 8 --d-model 16 --n-heads 4 --n-layers 1 --d-ff 16"
TORCH_DUMPS = {             # folder: the program's flags (with MODEL); tutorials/crosscheck_dumps/README.md
    "torch_tp2_dp2": "--tp 2 --dp 2 --vocab 16 --batch 4",
    "torch_tp2_dp2_v15": "--tp 2 --dp 2 --vocab 15 --batch 4",
    "torch_tp2_dp2_m3_no-microbatch-scale": "--tp 2 --dp 2 --vocab 16 --batch 6 --micro-batches 3 "
                                            "--bug no-microbatch-scale",
    "torch_tp2_dp2_ln-not-reduced": "--tp 2 --dp 2 --vocab 16 --batch 4 --bug ln-not-reduced",
    "torch_tp2_dp2_v15_vocab-padding": "--tp 2 --dp 2 --vocab 15 --batch 4 --bug vocab-padding",
}
RERUN, RERUN_TIMEOUT_S = "torch_tp2_dp2", 150


def torch_installed():
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def dump_difference(a, b):
    """(the layouts agree, the largest relative difference of the gradients, of the parameters, of the loss, the
    batches equal) between two dumps a and b (folders)."""
    A, B = load(a), load(b)
    keep = ("model", "dtype", "ranks", "parallel", "tensors")
    same_layout = all(A.meta[k] == B.meta[k] for k in keep)
    grads = max(float(np.abs(A.grads[r][k] - B.grads[r][k]).max() / max(float(np.abs(A.grads[r][k]).max()), 1e-300))
                for r in range(A.ranks) for k in A.grads[r])
    params = max(float(np.abs(A.params[k] - B.params[k]).max()) for k in A.params)
    batch = np.array_equal(A.idx, B.idx) and np.array_equal(A.targets, B.targets)
    return same_layout, grads, params, abs(A.loss - B.loss) / abs(A.loss), batch


def run_program(script, flags, out, timeout=RERUN_TIMEOUT_S):
    """Rank 0: `python benchmarks/<script> <flags> --out <out>` in a process of its own: (exit code, or "timeout";
    its last lines, the folder shown as TMP; seconds)."""
    # the program starts its own processes (gloo): none of mpiexec's variables must reach them
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI", "OMPI", "PMIX"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, os.path.join(os.path.dirname(HERE), "benchmarks", script), *flags, "--out", out]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", [f"no result after {timeout} s"]
    return rc, [line.replace(out, "TMP") for line in tail], time.perf_counter() - t0


def rerun():
    """Rank 0: the program run again into a temporary folder, compared with the committed dump; None without
    PyTorch."""
    if not torch_installed():
        return None
    out = tempfile.mkdtemp(prefix="crosscheck-torch-")
    try:
        rc, tail, seconds = run_program("crosscheck_torch.py", [*TORCH_DUMPS[RERUN].split(), *MODEL.split()], out)
        diff = dump_difference(folder(RERUN), out) if rc == 0 else None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"rc": rc, "tail": tail, "diff": diff, "seconds": seconds}


fresh = pictures.on_rank0(world, rerun, share=True)
if fresh is None:
    say("PyTorch is not installed here: the committed dumps are checked as they are (not rewritten)")
else:
    say(f"$ python benchmarks/crosscheck_torch.py {TORCH_DUMPS[RERUN]} {MODEL} --out TMP   "
        f"({fresh['seconds']:.1f} s, exit {fresh['rc']})")
    for line in fresh["tail"]:
        say("  " + line)
    check.holds(f"the PyTorch program ran (within {RERUN_TIMEOUT_S} s) and wrote a dump", fresh["diff"] is not None)
    same_layout, d_grads, d_params, d_loss, same_batch = fresh["diff"]
    check.holds(f"fresh {RERUN}: layout.json's model, ranks, parallel and tensors = the committed", same_layout)
    check.holds(f"fresh {RERUN}: the batch = the committed", same_batch)
    check(f"fresh {RERUN}: the parameters = the committed", d_params, 1e-12)
    check(f"fresh {RERUN}: every rank's gradients = the committed (relative)", d_grads, 1e-12)
    check(f"fresh {RERUN}: the loss = the committed (relative)", d_loss, 1e-12)

# %% [markdown]
# Every committed dump through the crosscheck (the full table for the first, the verdict for the others):

# %%
torch_verdicts = pictures.on_rank0(world, lambda: {n: verdict_of(folder(n), n) for n in TORCH_DUMPS}, share=True)
for i, (name, (ok, loss_row, rows, table)) in enumerate(torch_verdicts.items()):
    lines = table.splitlines()
    say(f"\n$ python -m hsgd.crosscheck {name}     ({TORCH_DUMPS[name]})")
    if i == 0:
        shown = lines
    else:
        explain = [x for x in lines if x.startswith("  ")]
        shown = [lines[2]] + explain[:3] + ([f"  ... ({len(explain) - 3} more)"] if len(explain) > 3 else []) \
            + lines[-1:]
    for line in shown:
        say("  " + (line if len(line) <= 150 else line[:147] + "..."))

V = torch_verdicts
for name in ("torch_tp2_dp2", "torch_tp2_dp2_v15"):
    check.holds(f"{name}: PASS", V[name][0])
    check(f"{name}: the largest gradient error, relative", max(r["error"] for r in V[name][2].values()))
check.holds("torch_tp2_dp2_v15: the padded rows are in the dump (split +pad) and zero",
            "+pad" in V["torch_tp2_dp2_v15"][2]["lm_head.weight"]["split"] and V["torch_tp2_dp2_v15"][2]["wte"]["ok"])

ok, loss_row, rows, _ = V["torch_tp2_dp2_m3_no-microbatch-scale"]
check.holds("no-microbatch-scale: FAIL, the loss itself right", not ok and loss_row["ok"])
check.equal("no-microbatch-scale: every parameter fails but the k biases (exact gradient 0)",
            sorted(set(rows) - failed(rows)), ["h.0.attn.k.bias"])
check.holds("no-microbatch-scale: each a constant factor '3 x the reference = micro-batches'",
            all(rows[n]["class"] == "constant factor" and "3 x the reference = micro-batches:" in rows[n]["detail"]
                for n in failed(rows)))


def own_rows(dp, tp, B):
    """The words of an "unreduced" detail whose replicas each hold their own dp rank's rows' gradient: the ranks of
    dp rank d are d tp .. d tp + tp - 1, its sequences d B/dp .. (d + 1) B/dp - 1 (hsgd.crosscheck.local)."""
    b = B // dp
    return "; ".join(f"ranks {','.join(str(d * tp + t) for t in range(tp))}: the gradient of dp rank {d}'s rows "
                     f"alone (sequences {d * b}..{d * b + b - 1})" for d in range(dp))


ok, loss_row, rows, _ = V["torch_tp2_dp2_ln-not-reduced"]
LN = {n for n in rows if ".ln" in n or n.startswith("ln_f")}
ln_dump = load(folder("torch_tp2_dp2_ln-not-reduced"))          # (tiny: its sizes for the words below)
words = own_rows(ln_dump.parallel["dp"], ln_dump.parallel["tp"], ln_dump.idx.shape[0])
say(f"ln-not-reduced, h.0.ln1.weight: {rows['h.0.ln1.weight']['class']}: {rows['h.0.ln1.weight']['detail']}")
check.holds("ln-not-reduced: FAIL, the loss itself right", not ok and loss_row["ok"])
check.equal("ln-not-reduced: the failing parameters = the LayerNorms'", sorted(failed(rows)), sorted(LN))
check.holds("ln-not-reduced: each unreduced, no replica R, each its dp rank's rows",
            all(rows[n]["class"] == "unreduced" and f"no replica holds the reference, each its own rows' gradient "
                f"({words})" in rows[n]["detail"] for n in LN))

ok, loss_row, rows, _ = V["torch_tp2_dp2_v15_vocab-padding"]
check.holds("vocab-padding: FAIL, and the loss differs too", not ok and not loss_row["ok"])
check.equal("vocab-padding: lm_head.weight's class", rows["lm_head.weight"]["class"], "padding")

# %% [markdown]
# The three bugs look different:
#
# - **no-microbatch-scale** (each micro-batch's loss backpropagated without the 1/M): every gradient is exactly 3 R,
#   and 3 is only the number of micro-batches (with M = 2 on tp 2 x dp 2 it would say "dp or micro-batches or tp",
#   exercise 3). The loss, reported unscaled, is right.
# - **ln-not-reduced** (the LayerNorms left out of the dp All-Reduce): ranks 0 and 1 (dp rank 0) hold one value,
#   ranks 2 and 3 another, each exactly its own dp rank's rows' gradient, which the crosscheck computes on each dp
#   slice of the batch (`hsgd.crosscheck.local`): "unreduced", no replica R. Their mean is R, but "each its own rows"
#   says more: the reduction never ran on these buffers, and every other parameter is right to 1e-15.
# - **vocab-padding** (the padded logits not masked to -inf): the padded row of lm_head gets gradient, which no real
#   token can cause. The padded logit enters the softmax, so the loss and every gradient change, in no simple
#   pattern: the padding is the one *named* cause, and the loss row confirms the forward pass differs.

# %% [markdown]
# ## 5. Bugs on purpose in hsgd
#
# `hsgd.check.mutations.injected(bug, name)` switches on, inside a `with` block, one of the known mistakes of
# distributed training code, in hsgd itself. Four, each on a layout where it shows:

# %%
MUTATIONS = [   # (bug, the parameter it targets, the layout, a parameter to look at, (class, words of the detail))
    ("zero-without-1/dp", "ln_f.weight", dict(dp=4, tp=2, zero=1), "h.1.mlp.fc.weight",
     ("constant factor", "4 x the reference = dp:")),
    ("pipeline-without-1/m", "ln_f.weight", dict(dp=1, pp=2, tp=4, micro_batches=3, batch_size=6), "wte",
     ("constant factor", "3 x the reference = micro-batches:")),
    ("sequence-without-ln-reduction", "ln_f.weight", dict(dp=2, tp=4, tp_scheme="sequence"), "h.0.ln1.weight",
     ("partial sum", "their sum is the reference: a sum over 4 ranks is missing")),
    ("head-permutation", "h.1.attn.q.weight", dict(dp=4, tp=2), "h.1.attn.q.weight",
     ("permutation", "heads along axis 1 in another order: [1, 0, 3, 2]")),
]
mutation_rows = {}
for bug, target, kw, look, (cls, words) in MUTATIONS:
    with injected(bug, target):
        ok, loss_row, rows, table = hsgd_verdict(**dict(kw))
    mutation_rows[bug] = rows
    kinds = sorted({rows[n]["class"] for n in failed(rows)})
    say(f"\n{bug}:\n" + textwrap.fill(BUGS[bug], 116, initial_indent="  ", subsequent_indent="  "))
    say(f"  on {kw}: {len(failed(rows))} of {len(rows)} parameters fail: {', '.join(kinds)}")
    say(f"  {look}: {rows[look]['class']}: {rows[look]['detail'][:140]}")
    check.holds(f"{bug}: FAIL", not ok)
    check.holds(f"{bug}: {look}: {cls}, as expected", rows[look]["class"] == cls and words in rows[look]["detail"])
    if cls == "constant factor":
        check.holds(f"{bug}: every failing parameter shows the same factor",
                    all(words in rows[n]["detail"] for n in failed(rows)))

# %% [markdown]
# ZeRO's missing 1/dp and the pipeline's missing 1/m are told apart only because the layouts' sizes differ (dp 4 x
# tp 2; m = 3 on pp 2 x tp 4). The sequence scheme's missing LayerNorm reduction is a partial sum over the 4 tp ranks
# (their *sum* is R), where section 4's LayerNorms each held one dp rank's rows' gradient ("unreduced"): the class
# names which reduction, the detail which ranks and rows. The head permutation is found in the one parameter it
# touched.

# %% [markdown]
# ## 6. From a Distributed Checkpoint to a verdict (FSDP2 + TP)
#
# `benchmarks/crosscheck_fsdp2.py` is laid out as torchtitan trains a Llama model: torchtitan's names
# (`tok_embeddings`, `layers.{i}.attention.wq` .. `wo`, `feed_forward.w1` .. `w3`, `attention_norm`, `ffn_norm`,
# `norm`, `output`), a 2-D `init_device_mesh("cpu", (dp, tp))`, `parallelize_module` over tp, then FSDP2's
# `fully_shard` over dp on every block and the root. Every weight is a DTensor cut along both mesh dimensions, and
# each rank keeps its box of every gradient (FSDP2 reduce-scatters over dp and divides by dp). The norms stay
# replicated, averaged over dp by hand (one flat bucket, as DDP does). The program saves
# `{"params", "grads", "batch", "loss"}` with `torch.distributed.checkpoint.save` (DCP), and rank 0 writes `hsgd.json`
# beside it (the model and the sizes).
#
# A DCP folder holds a `__{rank}_0.distcp` per rank and `.metadata`, which says where every chunk of every tensor is.
# `.metadata` is a pickle, and unpickling runs whatever code its author put in it, so `python -m
# hsgd.crosscheck.from_dcp DIR --out DUMP` reads it only with `--trust-pickled-metadata`, through PyTorch's reader;
# `--save-metadata-json` keeps it as plain data in `DIR/dcp-metadata.json`, which `--metadata-json` reads without
# PyTorch. The chunks are parsed, never unpickled. Two checkpoints are committed with their `dcp-metadata.json`;
# where PyTorch is installed the program runs again and its checkpoint, read through the pickle, must give the same
# dump.

# %%
FSDP2 = "--dp 3 --tp 2 --vocab 16 --batch 6"    # with MODEL; tutorials/crosscheck_dumps/README.md
DCP_FOLDERS = {"dcp_fsdp2_dp3_tp2": FSDP2, "dcp_fsdp2_dp3_tp2_wrong-mesh-dim": FSDP2 + " --bug wrong-mesh-dim"}
DCP_OK, DCP_BUG = DCP_FOLDERS
WO, WQ = "layers.0.attention.wo.weight", "layers.0.attention.wq.weight"     # stored (out, in): (C, C), (NH hs, C)


def from_dcp_run(args):
    """python -m hsgd.crosscheck.from_dcp args, in this process: (exit code, what it printed)."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = from_dcp.main(args)
    return code, said.getvalue().strip()


@contextlib.contextmanager
def converted(src, how="--metadata-json"):
    """The dump from_dcp makes of the DCP folder src (`how` reads its description: the JSON copy, or the pickle with
    --trust-pickled-metadata), in a temporary folder removed afterwards: (exit code, what it printed with that
    folder shown as DUMP, the folder)."""
    path = tempfile.mkdtemp(prefix="hsgd-dcp-")
    try:
        code, said = from_dcp_run([src, "--out", path, how])
        yield code, said.replace(path, "DUMP"), path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rank_of(chunk):
    """The rank that saved a chunk: the n of its file __{n}_0.distcp."""
    return int(dcp.FILE.fullmatch(chunk["file"]).group(1))


def dcp_section():
    """Rank 0: hsgd.json, the folder's files, the chunks of wo's gradient and the norms' as dcp-metadata.json lists
    them, and for both committed folders the converter's line (--metadata-json: no pickle, no PyTorch), the dump's
    layout entry of wo and the crosscheck's verdict."""
    here = folder(DCP_OK)
    with open(os.path.join(here, "hsgd.json")) as f:
        meta = json.load(f)
    desc = dcp.read_description(os.path.join(here, from_dcp.DCP_JSON))
    grads = {fqn[len("grads."):]: e for fqn, e in desc["tensors"].items() if fqn.startswith("grads.")}
    out = {"meta": meta, "files": {n: os.path.getsize(os.path.join(here, n)) for n in sorted(os.listdir(here))},
           "wo": (grads[WO]["dtype"], grads[WO]["size"],
                  {rank_of(c): (c["offsets"], c["sizes"], c["file"]) for c in grads[WO]["chunks"]}),
           "norms": {fqn: [rank_of(c) for c in e["chunks"]] for fqn, e in grads.items() if "norm" in fqn}}
    for name in DCP_FOLDERS:
        with converted(folder(name)) as (code, said, path):
            with open(os.path.join(path, "layout.json")) as f:
                entry = json.load(f)["tensors"][WO]
            out[name] = (code, said, entry, verdict_of(path, "DUMP"))
    out["B"] = desc["tensors"]["batch.idx"]["size"][0]
    out["no_torch"] = sys.modules.get("torch") is None       # nothing so far has imported PyTorch
    return out


D6 = pictures.on_rank0(world, dcp_section, share=True)
mesh_dp, mesh_tp, mesh_C, mesh_B = (D6["meta"]["parallel"]["dp"], D6["meta"]["parallel"]["tp"],
                                    D6["meta"]["model"]["d_model"], D6["B"])
say(f"$ cat tutorials/crosscheck_dumps/{DCP_OK}/hsgd.json      (the program's rank 0 writes it beside DCP's files)")
for line in textwrap.wrap(json.dumps(D6["meta"]), 114):
    say("  " + line)
for line in textwrap.wrap("the folder: " + ", ".join(f"{n} ({b} bytes)" for n, b in D6["files"].items()), 116):
    say(line)
dtype, size, chunks = D6["wo"]
say(f"\ngrads.{WO} as dcp-metadata.json describes it: {dtype} {size}, {len(chunks)} chunks")
for r, (off, n, file) in sorted(chunks.items()):
    say(f"  {file}: rank {r} = (dp {r // mesh_tp}, tp {r % mesh_tp}) holds rows {off[0]}..{off[0] + n[0] - 1}, "
        f"columns {off[1]}..{off[1] + n[1] - 1}")
per_dp = -(-mesh_C // mesh_dp)                 # FSDP2 cuts dim 0 as torch.chunk: ceil(C/dp) rows each
cols = mesh_C // mesh_tp                         # RowwiseParallel: wo's input columns split over tp
expected = {d * mesh_tp + t: ([d * per_dp, t * cols], [min(per_dp, mesh_C - d * per_dp), cols])
            for d in range(mesh_dp) for t in range(mesh_tp)}
check.equal("wo's chunk on rank r: rows of dp rank r // tp (ceil(C/dp) each, the last the rest), columns of tp "
            "rank r % tp", {r: (o, n) for r, (o, n, _) in chunks.items()}, expected)

for name in DCP_FOLDERS:
    code, said, entry, (ok, loss_row, rows, table) = D6[name]
    say(f"\n$ python -m hsgd.crosscheck.from_dcp tutorials/crosscheck_dumps/{name} --out DUMP --metadata-json")
    say("  " + said)
    if name == DCP_OK:
        say(f'layout.json of DUMP, "{WO}":')
        head = {k: v for k, v in entry.items() if k != "shards"}
        say("  " + json.dumps(head)[:-1] + ', "shards": [')
        for s in entry["shards"]:
            say("    " + json.dumps(s) + ",")
        say("  ]}")
    say("$ python -m hsgd.crosscheck DUMP")
    lines = table.splitlines()
    shown = lines if name == DCP_OK else [lines[2]] + [x for x in lines if x.startswith("  ")] + lines[-2:]
    for line in shown:
        say("  " + (line if len(line) <= 150 else line[:147] + "..."))
    check.holds(f"{name}: converted from its JSON description (exit {code})", code == 0)
check.holds("the conversions read no pickle and imported no PyTorch", D6["no_torch"])

ok, loss_row, rows, _ = D6[DCP_OK][3]
check.holds(f"{DCP_OK}: PASS", ok)
check("torch FSDP2 + TP (DCP): the largest gradient error, relative", max(r["error"] for r in rows.values()))
check("torch FSDP2 + TP (DCP): the loss, relative", loss_row["error"])
ok, loss_row, rows, _ = D6[DCP_BUG][3]
NORMS = sorted(n for n in rows if rows[n]["tensor"].split(".")[-2].endswith("norm"))
check.holds("wrong-mesh-dim: FAIL, the loss itself right", not ok and loss_row["ok"])
check.equal("wrong-mesh-dim: the failing parameters = the three norms'", sorted(failed(rows)), NORMS)
say("")
for n in NORMS:
    fqn, b = rows[n]["tensor"], mesh_B // mesh_dp
    saved = D6["norms"][fqn]
    d = saved[0] // mesh_tp
    say(f"  grads.{fqn}: {len(saved)} chunk, saved by rank {saved[0]} (dp rank {d}) -> {n}: {rows[n]['class']}")
    check.holds(f"wrong-mesh-dim {n}: unreduced, the rows of dp rank {d}, whose rank DCP saved",
                len(saved) == 1 and rows[n]["class"] == "unreduced" and
                f"G is the gradient of dp rank {d}'s rows alone (sequences {d * b}..{d * b + b - 1})"
                in rows[n]["detail"])


def fsdp2_rerun():
    """Rank 0, with PyTorch (None without): the committed .metadata read through PyTorch's reader = its
    dcp-metadata.json; the program run again into a temporary folder, its checkpoint converted through the pickle
    (--trust-pickled-metadata) and compared with the committed folder's dump."""
    if not torch_installed():
        return None
    res = {"same_description": json.loads(json.dumps(dcp.read_metadata(folder(DCP_OK)))) ==
           dcp.read_description(os.path.join(folder(DCP_OK), from_dcp.DCP_JSON)), "diff": None}
    out = tempfile.mkdtemp(prefix="crosscheck-fsdp2-")
    try:
        res["rc"], res["tail"], res["seconds"] = run_program("crosscheck_fsdp2.py", [*FSDP2.split(), *MODEL.split()],
                                                             out)
        if res["rc"] == 0:
            with converted(out, "--trust-pickled-metadata") as (code, said, fresh), \
                    converted(folder(DCP_OK)) as (_, _, kept):
                res["said"] = said
                res["diff"] = dump_difference(kept, fresh) if code == 0 else None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return res


fresh_dcp = pictures.on_rank0(world, fsdp2_rerun, share=True)
if fresh_dcp is None:
    say("\nPyTorch is not installed here: the committed checkpoints are read through their dcp-metadata.json only")
else:
    say(f"\n$ python benchmarks/crosscheck_fsdp2.py {FSDP2} {MODEL} --out TMP   ({fresh_dcp['seconds']:.1f} s, "
        f"exit {fresh_dcp['rc']})")
    for line in fresh_dcp["tail"]:
        say("  " + line)
    say(f"$ python -m hsgd.crosscheck.from_dcp TMP --out DUMP --trust-pickled-metadata\n  {fresh_dcp.get('said')}")
    check.holds(f"{DCP_OK}: its .metadata, unpickled by PyTorch's reader = its dcp-metadata.json",
                fresh_dcp["same_description"])
    check.holds(f"the FSDP2 program ran (within {RERUN_TIMEOUT_S} s), its checkpoint converted",
                fresh_dcp["diff"] is not None)
    same_layout, d_grads, d_params, d_loss, same_batch = fresh_dcp["diff"]
    check.holds(f"fresh {DCP_OK}: the dump's layout (every chunk's rank and box) = the committed's", same_layout)
    check.holds(f"fresh {DCP_OK}: the batch = the committed", same_batch)
    check(f"fresh {DCP_OK}: the parameters = the committed", d_params, 1e-12)
    check(f"fresh {DCP_OK}: every rank's gradients = the committed (relative)", d_grads, 1e-12)
    check(f"fresh {DCP_OK}: the loss = the committed (relative)", d_loss, 1e-12)

# %% [markdown]
# The correct program passes. The `split` column reads as the layout: weights tp splits by rows (`tok_embeddings`,
# `wq`, `wk`, `wv`, `w1`, `w3`, `output`) in strips (section 7; `wk` and `wv`, of fewer rows, in four: one rank's
# chunk is empty), `wo` and `w2` in boxes along both axes, the norms whole.
#
# The wrong-mesh-dim bug averages the norms over the "tp" mesh dimension instead of "dp". A tp group's ranks hold the
# same rows of the batch, so every rank keeps its dp rank's R_d: "unreduced". But DCP saves one copy of a chunk
# several ranks hold (`dedup_save_plans` keeps it on the rank with the least to write so far), so each norm is in
# the file of one rank of DCP's choosing, printed above, and replicas cannot be compared. The class comes from
# comparing that copy with each dp rank's own rows' gradient, and names the saving rank's dp rank. Section 8 shows
# what replicas tell when a dump keeps them all.

# %% [markdown]
# ## 7. Reading a 2-D sharded tensor
#
# A shard with `slices` is a box: an offset and a length along each axis it cuts. `copies_of`
# (`hsgd.crosscheck.__main__`) groups a tensor's shards by box: equal boxes are replicas of one piece, different
# boxes pieces of one copy; copy k takes every box's k-th holder and writes its real entries at the box's place
# (`Shard.where`). DCP saved each chunk once, so `wo`'s gradient comes back as one copy from all six ranks. `wq` is
# cut along one axis only, into six strips:

# %%
def boxes():
    """Rank 0: for wo and wq of the correct FSDP2 checkpoint's dump, every shard's rank and box, the ranks of the one
    copy copies_of assembles, how often each entry is covered; copies_of's wo against DCP's own assembly of its
    chunks (Checkpoint.whole) and against the reference."""
    with converted(folder(DCP_OK)) as (_, _, path):
        dump = load(path)
        out = {}
        for name in (WO, WQ):
            t = dump.tensors[name]
            copies, labels, _ = copies_of(t, dump.grads)
            cover = np.zeros(t.shape, dtype=int)
            for s in t.shards:
                cover[s.where(len(t.shape))] += 1
            out[name] = dict(shape=t.shape, part=t.parts[0], labels=labels, covered=(int(cover.min()),
                             int(cover.max())), shards=[(s.rank, s.box(), s.padding) for s in t.shards])
        ckpt = dcp.Checkpoint(folder(DCP_OK), dcp.read_description(os.path.join(folder(DCP_OK), from_dcp.DCP_JSON)),
                              from_dcp.DCP_JSON)
        G = copies_of(dump.tensors[WO], dump.grads)[0][0]
        _, R = serial.loss_and_grads(dump.reference_params(), dump.idx, dump.targets, dump.cfg)
        out["same_as_dcp"] = bool(np.array_equal(G, ckpt.whole("grads." + WO)))
        out["error"] = float(np.abs(G.T - R[out[WO]["part"]]).max() / np.abs(R[out[WO]["part"]]).max())
    return out


def box_words(box):
    return ", ".join(f"{'rows' if a == 0 else 'columns'} {o}..{o + n - 1}" for a, o, n in box)


B7 = pictures.on_rank0(world, boxes, share=True)
for name in (WO, WQ):
    b = B7[name]
    say(f"{name} ({b['part']} stored (out, in), {b['shape']}): one copy, from ranks {' and '.join(b['labels'])}")
    for r, box, _ in sorted(b["shards"], key=lambda x: x[1]):
        say(f"  rank {r} (dp {r // mesh_tp}, tp {r % mesh_tp}): {box_words(box)}")
rows_wo = sorted({box[0] for _, box, _ in B7[WO]["shards"]})
wq_order = [r for r, _, _ in sorted(B7[WQ]["shards"], key=lambda x: x[1])]
say(f"wo's rows per dp rank: {[n for _, _, n in rows_wo]} (C = {mesh_C} over dp = {mesh_dp}: ceil(C/dp) = {per_dp}, "
    f"the last the rest); wq's rows, in order, from ranks {wq_order}")
check.equal("wo: six boxes, every entry covered exactly once (min, max)", B7[WO]["covered"], (1, 1))
check.equal("wo: one copy, from all six ranks", B7[WO]["labels"], ["+".join(str(r) for r in range(mesh_dp * mesh_tp))])
check.holds("wo: copies_of's assembly = DCP's own of its chunks (Checkpoint.whole), exactly", B7["same_as_dcp"])
check("wo: assembled, transposed = the reference's gradient (relative)", B7["error"])
check.equal("wq: rows in order from tp rank 0's dp ranks, then tp rank 1's (_StridedShard)", wq_order,
            [d * mesh_tp + t for t in range(mesh_tp) for d in range(mesh_dp)])
check.equal("wq: every entry covered exactly once (min, max)", B7[WQ]["covered"], (1, 1))


def draw_boxes():
    fig, axes = pictures.figure(7.2, 3.3, ncols=2)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    for ax, name in zip(axes, (WO, WQ)):
        b = B7[name]
        for r, box, _ in b["shards"]:
            (r0, nr), (c0, nc) = [(o, n) for _, o, n in box] if len(box) == 2 else [box[0][1:], (0, b["shape"][1])]
            ax.bar(c0, nr, width=nc, bottom=r0, align="edge", color=colors[r], edgecolor="white", alpha=0.85)
            ax.text(c0 + nc / 2, r0 + nr / 2, f"rank {r}\n(dp {r // mesh_tp}, tp {r % mesh_tp})", ha="center",
                    va="center", fontsize=6)
        ax.set_xlim(0, b["shape"][1])
        ax.set_ylim(b["shape"][0], 0)
        ax.set_xlabel("column (input feature)", fontsize=7)
        ax.set_ylabel("row (output feature)", fontsize=7)
    axes[0].set_title(f"wo: Shard(0) over dp {mesh_dp}, Shard(1) over tp {mesh_tp}", fontsize=8)
    axes[1].set_title(f"wq: Shard(0) over tp {mesh_tp}, each piece cut over dp {mesh_dp}", fontsize=8)
    pictures.save(fig, "20_dcp_boxes")


pictures.on_rank0(world, draw_boxes)

# %% [markdown]
# In the picture, `wo` (row-parallel, split by input columns over tp) is cut by FSDP2 along its rows over dp, one box
# per rank; `wq` (column-parallel, split by output rows over tp) is cut by FSDP2 along the same rows again, so the full
# tensor's rows come from the ranks in tp-major order: PyTorch's `_StridedShard(0)`, for the dump one axis with six
# strips at their offsets. FSDP2 cuts dimension 0 as `torch.chunk` does, ceil(C/dp) rows per rank and the rest to the
# last; the saved chunks are real rows covering the tensor once, so the dump declares no padding.

# %% [markdown]
# ## 8. Replicas that say which side holds the reference
#
# Where a dump keeps every replica, the classifier asks which replicas hold R and what the others hold. Three bugs
# in a copy of `torch_tp2_dp2` (rank = dp_rank x 2 + tp_rank), one per LayerNorm weight, on dp rank 1's ranks:
#
# - `h.0.ln1.weight`: ranks 2 and 3 keep an earlier gradient (another batch's, as the step before would leave it);
# - `h.0.ln2.weight`: ranks 2 and 3 keep their own rows' gradient R_1: the reduced gradient never reached them;
# - `ln_f.weight`: an All-Reduce over a wrong group (ranks 0, 1, 2): ranks 0 to 2 hold the mean of R_0, R_0 and
#   R_1, rank 3 its own R_1.

# %%
def edited(name, edit):
    """Rank 0: a copy of the committed dump `name` in a temporary folder, every rank's gradients changed by
    edit(dump, grads) (one {key: array} per rank, changed in place), sealed anew (the old dump.json's digests no
    longer hold), and crosschecked: verdict_of's (ok, loss row, rows, table)."""
    path = tempfile.mkdtemp(prefix="hsgd-edit-")
    try:
        shutil.rmtree(path)
        shutil.copytree(folder(name), path)
        dump = load(path)
        grads = [dict(g) for g in dump.grads]
        edit(dump, grads)
        for r, g in enumerate(grads):
            os.remove(os.path.join(path, grads_file(r)))
            write_rank(path, r, g)
        seal(path, new_run(), len(grads))
        return verdict_of(path, name + "-edited")
    finally:
        shutil.rmtree(path, ignore_errors=True)


def replica_bugs(dump, grads):
    params = dump.reference_params()
    own = Local(dump, params).run()                         # [R_d]: each dp slice's own gradient (dp 2: two)
    rng = np.random.default_rng(1)
    other = [rng.integers(0, dump.cfg.vocab_size, dump.idx.shape) for _ in range(2)]
    _, earlier = serial.loss_and_grads(params, *other, dump.cfg)
    for r in (2, 3):                                        # dp rank 1's two tp ranks
        grads[r]["h.0.ln1.weight"] = earlier["h.0.ln1.weight"]
        grads[r]["h.0.ln2.weight"] = own[1]["h.0.ln2.weight"]
    wrong_group = (own[0]["ln_f.weight"] + own[0]["ln_f.weight"] + own[1]["ln_f.weight"]) / 3   # ranks 0, 1, 2
    for r in (0, 1, 2):
        grads[r]["ln_f.weight"] = wrong_group
    grads[3]["ln_f.weight"] = own[1]["ln_f.weight"]


ok, loss_row, rows, _ = pictures.on_rank0(world, lambda: edited("torch_tp2_dp2", replica_bugs), share=True)
say("$ python -m hsgd.crosscheck torch_tp2_dp2-edited      (three LayerNorm weights' replicas changed)")
for n in ("h.0.ln1.weight", "h.0.ln2.weight", "ln_f.weight"):
    say(f"  {n}: {rows[n]['class']}: {rows[n]['detail']}")
check.equal("replicas: the failing parameters", sorted(failed(rows)), ["h.0.ln1.weight", "h.0.ln2.weight",
                                                                        "ln_f.weight"])
check.holds("replicas: ln1 a stale replica, ranks 0 | 1 hold R, 2 | 3 do not",
            rows["h.0.ln1.weight"]["class"] == "stale replica" and
            rows["h.0.ln1.weight"]["detail"].startswith("ranks 0 | 1 hold the reference; ranks 2 | 3 hold another"))
b8 = ln_dump.idx.shape[0] // ln_dump.parallel["dp"]         # (torch_tp2_dp2's layout and batch, as section 4's)
check.holds("replicas: ln2 unreduced, ranks 0 | 1 R, 2 | 3 their own rows (dp rank 1's)",
            rows["h.0.ln2.weight"]["class"] == "unreduced" and
            rows["h.0.ln2.weight"]["detail"].startswith("ranks 0 | 1 hold the reference; ranks 2 | 3 hold their own")
            and f"dp rank 1's rows alone (sequences {b8}..{2 * b8 - 1})" in rows["h.0.ln2.weight"]["detail"])
check.holds("replicas: ln_f's replicas differ, ranks 0,1,2 | 3, none of them R",
            rows["ln_f.weight"]["class"] == "replicas differ" and "(ranks 0,1,2 | 3), none" in
            rows["ln_f.weight"]["detail"])

# %% [markdown]
# A **stale replica**: some ranks hold R, so the reduction is right, and the others something that is neither part
# of R nor their own rows' gradient: look at those ranks' buffer (not zeroed, copied before the reduction wrote it,
# never refreshed). **Unreduced** names what the others hold, their own rows' gradient: the reduction never reached
# them, or (no replica R) never ran. **Replicas differ**: no replica is R and the values neither add up to it nor
# are any rank's own: a reduction over the wrong group. A DCP folder saves one copy, so a stale replica can hide
# entirely: had DCP chosen a rank holding R, the folder would pass.

# %% [markdown]
# ## 9. A fused-block swap found
#
# A system that slices the interleaved qkv of `torch_tp2_dp2` (section 2) with wrong offsets, or concatenates its
# parts in another order than its checkpoint says, leaves every number right and in the wrong place. On copies of
# the dump: k and v exchanged in every head, then in one head only:

# %%
HS = fmt["hs"]


def swap_kv(heads):
    """edit: k's and v's hs rows exchanged in the given heads of the fused qkv weight, on every rank that holds
    them (tp rank t holds rows 3 C t / tp .. : its heads' [q_h k_h v_h] blocks, whole)."""
    def edit(dump, grads):
        t = dump.tensors["h.0.attn.qkv.weight"]
        for s in t.shards:
            w = grads[s.rank][s.key].copy()                     # (3C/tp, C): this rank's heads, 3 hs rows each
            for h in heads:
                first = 3 * HS * h - s.offset                   # head h's block, in this rank's rows
                if 0 <= first < s.length:
                    k, v = slice(first + HS, first + 2 * HS), slice(first + 2 * HS, first + 3 * HS)
                    w[k], w[v] = grads[s.rank][s.key][v], grads[s.rank][s.key][k]
            grads[s.rank][s.key] = w
    return edit


NH = fmt["C"] // HS
for heads in (range(NH), [1]):
    ok, loss_row, rows, _ = pictures.on_rank0(world, lambda: edited("torch_tp2_dp2", swap_kv(heads)), share=True)
    say(f"k and v exchanged in head(s) {list(heads)}:")
    for n in sorted(failed(rows)):
        say(f"  {n}: {rows[n]['class']}: {rows[n]['detail']}")
    check.equal(f"k <-> v in heads {list(heads)}: the failing parameters", sorted(failed(rows)),
                ["h.0.attn.k.weight", "h.0.attn.v.weight"])
    if len(heads) == NH:
        check.holds("k <-> v in every head: swapped, 'h.0.attn.k.weight holds h.0.attn.v.weight's gradient'",
                    rows["h.0.attn.k.weight"]["class"] == "swapped" and rows["h.0.attn.k.weight"]["detail"]
                    .startswith("h.0.attn.k.weight holds h.0.attn.v.weight's gradient"))
    else:
        check.holds("k <-> v in head 1: a permutation of fused blocks, 'k.weight 1 <- v.weight 1'",
                    rows["h.0.attn.k.weight"]["class"] == "permutation" and rows["h.0.attn.k.weight"]["detail"]
                    .endswith("h.0.attn.k.weight 1 <- h.0.attn.v.weight 1"))


def k_bias_blocks():
    """Rank 0, the correct torch_tp2_dp2: the fused qkv bias cut into blocks of hs entries (q_h, k_h, v_h) in G and
    in R; how many (G block, R block) pairs of k-bias blocks are equal within the crosscheck's structure tolerance;
    what fused.moves finds; and what a search finds that matches every block of G to the first block of R it equals,
    without keeping each block's own place first."""
    dump = load(folder("torch_tp2_dp2"))
    t = dump.tensors["h.0.attn.qkv.bias"]
    _, grads0 = serial.loss_and_grads(dump.reference_params(), dump.idx, dump.targets, dump.cfg)
    G, R = copies_of(t, dump.grads)[0][0], t.from_reference(grads0)
    g, r = fused.cut(t, G, HS), fused.cut(t, R, HS)                    # (3 NH blocks, hs)
    labels = [f"{t.parts[part].split('.')[-2]}.bias {b}" for part, b, _ in fused.blocks(t, HS)]
    tol, scale = STRUCTURE["float64"], float(np.linalg.norm(R))
    near = lambda a, b: float(np.linalg.norm(a - b)) <= tol * scale
    k = [i for i, name in enumerate(labels) if name.startswith("k.")]
    first = {i: next(j for j in range(len(r)) if near(g[i], r[j])) for i in range(len(g))}
    return dict(k_norm=float(max(np.linalg.norm(r[i]) for i in k)) / scale, n_k=len(k), tol=tol,
                equal_pairs=sum(near(g[i], r[j]) for i in k for j in k), moves=fused.moves(t, G, R, tol, HS),
                first=[(labels[i], labels[j]) for i, j in first.items() if i != j],
                first_in_k=all(i in k and j == k[0] for i, j in first.items() if i != j))


K9 = pictures.on_rank0(world, k_bias_blocks, share=True)
say(f"correct torch_tp2_dp2, h.0.attn.qkv.bias: the largest k-bias block is {K9['k_norm']:.1e} of ||R||; "
    f"{K9['equal_pairs']} of the {K9['n_k']} x {K9['n_k']} (G block, R block) pairs of k-bias blocks are equal "
    f"within {K9['tol']:.0e} ||R||")
say(f"  fused.moves (each block that equals its own kept first): {K9['moves']}")
say("  each block to the first block of R it equals: " + ", ".join(f"{a} <- {b}" for a, b in K9["first"]))
check.equal("k-bias: every k block of G equals every k block of R within the tolerance", K9["equal_pairs"],
            K9["n_k"] ** 2)
check.holds("k-bias: fused.moves finds no reordering in the correct copy", K9["moves"] is None)
check.holds("k-bias: a first-match search, own place not first, moves k blocks onto k block 0",
            K9["first"] and K9["first_in_k"])

# %% [markdown]
# When every head's k and v trade places, each part holds another's gradient whole: "swapped", named the way round
# it is ("k holds v's"). When one head's do, the classifier lists the moved blocks, each with the reference block it
# holds: "permutation". Both come from `hsgd.crosscheck.fused`, which cuts the fused gradient into blocks of the
# parts' greatest common width (hs here) and matches G's blocks to R's.
#
# The order of the matching matters: the k biases' exact gradient is zero, so every k-bias block, in G and R, is
# rounding noise that "equals" every other within the tolerance, as counted above, and a first-match search would
# report the correct copy as a reordering (the moves printed above). `fused.moves` keeps every block that equals its
# own reference in place, matches only the others among themselves, and names a reordering only when undoing it
# brings the error down tenfold, within the tolerance: a correct copy has no reordering.

# %% [markdown]
# ## 10. Two pictures
#
# The first: the fused qkv weight's rows of `torch_tp2_dp2`, coloured by q, k and v, on the ranks that hold them,
# then lm_head's rows of `torch_tp2_dp2_v15` with the padded row. The second: every parameter's relative error for
# each PyTorch dump, coloured by the crosscheck's class, against the float64 tolerance.

# %%
CLASS_COLORS = {"ok": "#2ca02c", "constant factor": "#1f77b4", "unreduced": "#d62728", "padding": "#9467bd",
                "no simple pattern": "#7f7f7f", "partial sum": "#e377c2", "stale replica": "#bcbd22",
                "replicas differ": "#17becf", "permutation": "#ff7f0e", "swapped": "#8c564b"}


def draw():
    fig, axes = pictures.figure(7.2, 3.4, nrows=2)
    C, hs = fmt["C"], fmt["hs"]
    part = ["q", "k", "v"]
    colors = {"q": "#1f77b4", "k": "#ff7f0e", "v": "#2ca02c"}
    ax = axes[0]
    for r in range(4):                                   # qkv: rows split over tp (axis 0), replicated over dp
        t = r % 2
        for piece in range(3 * C // hs // 2):            # this tp rank's pieces of hs rows
            row0 = t * (3 * C // 2) + piece * hs
            which = part[(row0 // hs) % 3]
            ax.barh(r, hs, left=row0, color=colors[which], edgecolor="white", height=0.7)
            ax.text(row0 + hs / 2, r, f"{which}{row0 // (3 * hs)}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(4), [f"rank {r}" for r in range(4)], fontsize=7)
    ax.set_xlim(0, 3 * C)
    ax.set_title("torch_tp2_dp2: h.0.attn.qkv.weight's rows [q_0 k_0 v_0 q_1 ...] on the ranks (tp splits, dp "
                 "replicates)", fontsize=8)
    ax.invert_yaxis()
    ax = axes[1]
    Vr, Vp = 15, 16                                       # V real rows, padded to tp's multiple
    for r in range(4):
        t = r % 2
        first, rows_ = t * Vp // 2, Vp // 2
        real = min(rows_, Vr - first)
        ax.barh(r, real, left=first, color="#1f77b4", edgecolor="white", height=0.7)
        if rows_ > real:
            ax.barh(r, rows_ - real, left=first + real, color="white", edgecolor="#d62728", hatch="///", height=0.7)
    ax.set_yticks(range(4), [f"rank {r}" for r in range(4)], fontsize=7)
    ax.set_xlim(0, Vp)
    ax.set_xlabel("row of the stored tensor", fontsize=8)
    ax.set_title("torch_tp2_dp2_v15: lm_head.weight's V = 15 rows, padded to 16 (hatched: must get no gradient)",
                 fontsize=8)
    ax.invert_yaxis()
    pictures.save(fig, "20_shards_reassembled")

    fig, ax = pictures.figure(7.2, 3.6)
    names = list(next(iter(torch_verdicts.values()))[2])
    for y, (dump_name, (_, _, rows, _)) in enumerate(torch_verdicts.items()):
        for x, n in enumerate(names):
            r = rows[n]
            cls = "ok" if r["ok"] else r["class"]
            ax.scatter(x + (y - 2) * 0.12, max(r["error"], 1e-18), color=CLASS_COLORS.get(cls, "k"),
                       marker="osD^v"[y], s=18)
    ax.axhline(1e-10, color="k", lw=0.8, ls="--")
    ax.text(len(names) - 0.5, 2e-10, "tolerance (float64)", fontsize=7, ha="right")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=6)
    ax.set_ylabel("max rel. error vs hsgd.model.serial", fontsize=8)
    shown = {"ok" if r["ok"] else r["class"] for _, _, rows, _ in torch_verdicts.values() for r in rows.values()}
    handles = [ax.scatter([], [], color=c, label=k, s=18) for k, c in CLASS_COLORS.items() if k in shown]
    handles += [ax.scatter([], [], color="k", marker="osD^v"[y], label=n.replace("torch_", ""), s=18)
                for y, n in enumerate(torch_verdicts)]
    ax.legend(handles=handles, fontsize=6, ncol=2, loc="center left")
    ax.set_title("every parameter of the PyTorch dumps, coloured by the crosscheck's class", fontsize=9)
    pictures.save(fig, "20_errors_by_class")


pictures.on_rank0(world, draw)

# %% [markdown]
# Each tp rank holds whole heads (rank 0 heads 0 and 1, rank 1 heads 2 and 3): a block layout `[q | k | v]` split in
# two would give rank 0 all of q and half of k. The correct dumps sit at 1e-16, six decades under the tolerance;
# each bug puts its parameters near 1, and the padding bug leaves every parameter a little off, the padded one
# named. The legend's colours for the classes of sections 5, 8 and 9 are kept for them.

# %% [markdown]
# ## 11. Reading a verdict: from the class to the line
#
# | class | what it means | where to look |
# |---|---|---|
# | constant factor = m (micro-batches) | the micro-batches' gradients summed where their mean belongs | the loss divided by m before each backward (`(loss * scale).backward()` in the PyTorch program, `Stage.receive`'s S/m in hsgd) |
# | constant factor = dp | the dp replicas' gradients summed, not averaged | the division by dp after the dp All-Reduce (or ZeRO's Reduce-Scatter: `Zero1Exchange.average`) |
# | constant factor = tp, or tp x tp | a tensor-parallel adjoint that sums what each rank already held whole | the backward of the All-Gather or All-Reduce just above the lowest layer showing the factor |
# | 1/n of any size | an average where a sum belongs, or a 1/n applied twice | the same reductions, the other way round |
# | unreduced: no replica is R, each its own rows' gradient | the dp reduction never ran on this parameter, or ran over a group whose ranks hold the same rows (tp): each dp rank keeps R_d (the detail names ranks and sequences) | the parameters the dp All-Reduce covers, and the group it is given (`mesh["dp"]`, not `mesh["tp"]`) |
# | unreduced: some ranks R, the others their own rows | the reduction ran; its result never reached the named ranks' buffers | the copy from the reduction's buffer into `.grad` on those ranks |
# | unreduced, from a DCP folder (one copy) | as above, seen on the one copy DCP kept, the saving rank's | the same; a bug that spares the saving rank passes unseen |
# | stale replica | some ranks hold R, the others neither a part of R nor their own rows | the buffer of the ranks not holding R: read before the reduction writes it, not zeroed, never refreshed |
# | replicas differ | no replica is R, and they neither add up to it nor are any rank's own rows | a reduction over the wrong group |
# | partial sum: the sum is R | each rank holds its share of a gradient that needs adding up (a replicated parameter under sequence or context parallelism) | the All-Reduce of those partial gradients over tp or cp |
# | partial sum: the mean is R | replicas that are no dp rank's own rows and average to R | the reduction over the groups the detail lists |
# | padding | rows that stand for no token get gradient | the mask of the padded logits (-inf before the softmax), or the embedding's lookup of ids past V |
# | permutation of heads or rows | the right numbers in the wrong places | a gather's order, a reshape of (heads, hs) against (hs, heads), the fused qkv's interleave |
# | permutation of fused blocks | blocks of a fused q\|k\|v or gate\|up moved among its parts (the detail: each block and the reference block it holds) | the offsets a fused tensor is sliced at, per head or per tp rank |
# | swapped: X holds Y's gradient | a whole part of a fused tensor (or a parameter) holds another's | the order of the parts in the concatenation, or in the dump's `fused.parts` |
# | transposed | a square weight written the other way round | the dump's `transposed` flag, or a `.T` in the code |
# | missing | the gradient never arrived | a parameter without `requires_grad`, a hook that never fired, a rank that wrote zeros |
# | no simple pattern, with the loss wrong | the forward pass differs | masking, a dropout left on, another epsilon; or the dump's parameters or batch are not what ran |
#
# Two cautions. A factor equal to two sizes (tp = dp = 2) is named by both: check on a layout whose sizes differ
# (tp 2 x dp 4 x m 3). And a layout.json that describes the shards wrongly (exercise 2) fails the dump, not the
# system; the loss row tells them apart, since a wrong description of the parameters changes the reference's loss.

# %%
exact = [w for w in check.errors if w.startswith(("hsgd", "torch"))]
worst, err = check.worst(exact)
again = "the committed PyTorch dump and checkpoint written again and equal" if fresh and fresh_dcp else \
    "the committed PyTorch dumps and checkpoints as they are"
say(f"\nchapter 20: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error of a correct "
    f"layout against the serial reference {err:.1e} ({worst}); {again}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `python -m hsgd.crosscheck DIR`: every parameter's distributed gradient against an exact one-device float64 reference, the failure classified | none: its functional tests compare a run's loss curve with recorded ones (tests/functional_tests/test_cases/.../golden_values_*.json); `check_param_hashes_across_dp_replicas` (megatron/core/utils.py) checks that the dp replicas' parameters are identical, not that they are right | none | none; `torch.testing.assert_close` compares two tensors you bring | one step, per parameter, against an exact reference, and a named kind of bug instead of "the curves differ" |
# | the dump (`hsgd/crosscheck/FORMAT.md`: layout.json with shards, replicas, padding, fused and transposed tensors; `hsgd.train --dump-step N DIR`) | the distributed checkpoint, `--ckpt-format torch_dist` (sharded tensors with their global offsets), and `tools/checkpoint/convert.py` between layouts: parameters and optimizer state, not gradients | `zero_to_fp32.py` (`get_fp32_state_dict_from_zero_checkpoint`): ZeRO's flat partitions consolidated into full fp32 parameters | `torch.distributed.checkpoint` (sharded state dicts with their metadata); `DTensor.full_tensor()` gathers one DTensor | a neutral format any system can write, with the step's gradients and batch, read without pickle |
# | reassembling a gradient from its shards (`copies_of`, every replica separately) | none for gradients | `deepspeed.utils.safe_get_full_grad(param)`: one parameter's full gradient under ZeRO | `DTensor.full_tensor()` on `param.grad` | every replica is checked, so a replica that differs (unreduced, stale) is seen, not hidden by taking rank 0's copy |
# | the padded vocabulary in a shard's `padding` entries, whose gradient must be zero | `--make-vocab-size-divisible-by` (the vocabulary padded to a multiple of it times tp) | none | none: Shard(0) of a tensor tp does not divide leaves uneven pieces; the PyTorch program pads by hand | padding is declared in the dump and checked to carry no gradient |
# | a vocabulary-parallel loss checked in the dump's loss row | `vocab_parallel_cross_entropy` (megatron/core/tensor_parallel/cross_entropy.py) | none | `loss_parallel()` (torch.distributed.tensor.parallel) | the loss is recomputed by the reference, not trusted |
# | a PyTorch Distributed Checkpoint read as a dump (`python -m hsgd.crosscheck.from_dcp DIR --out DUMP`: each chunk a shard of the rank whose file holds it; `.metadata` only with `--trust-pickled-metadata`, or its JSON copy with `--metadata-json`) | `dist_checkpointing`: a `ShardedTensor` is saved by its main replica only (`is_main_replica(replica_id)`, megatron/core/dist_checkpointing/mapping.py) | the model states are saved by data-parallel rank 0 only (`save_non_zero_checkpoint`, `_configure_checkpointing` in deepspeed/runtime/engine.py) | `dcp.save` (`FileSystemWriter`; torchtitan's `CheckpointManager.save` calls it); `dedup_save_plans` (torch/distributed/checkpoint/_dedup_save_plans.py) keeps each replicated item on one rank, the one with the least to write so far (`DefaultSavePlanner(dedup_save_to_lowest_rank=True)`: the lowest) | the pickle is unpickled only when trusted, the chunks are parsed, never unpickled; the one copy a deduplicated save keeps is compared with each dp rank's own rows' gradient, so the class still names the reduction |
# | a shard cut along two axes (`slices`: FSDP over dp x TP), put back by its offsets (`copies_of`) | `ShardedTensor.from_rank_offsets(key, data, (axis, rank, fragments), ...)`: one offset per cut axis | `ds_to_universal.py` (deepspeed/checkpoint): TP slices and ZeRO partitions merged into whole parameters | torchtitan's `parallelize_llama`: `apply_tp` (`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`) then `apply_fsdp` (`fully_shard` per block): 2-D DTensor placements, `_StridedShard` where both cut dimension 0 | boxes checked to be disjoint and to cover the tensor, assembled without PyTorch |
# | `"rotary": "interleaved"` in layout.json, `from_dcp --names torchtitan-0.3` | `rotary_interleaved` (TransformerConfig; `_apply_rotary_pos_emb_bshd` in megatron/core/models/common/embeddings/rope_utils.py) | none | torchtitan's llama3 `apply_rotary_emb` turns the adjacent pairs (2i, 2i + 1) as complex numbers (`torch.view_as_complex`); torchtitan 0.3 fuses q, k, v as `attention.qkv_linear.wqkv`; Hugging Face's `rotate_half` turns (i, i + hs/2) | the pair order is declared per tensor and mapped to the reference's halves; a loss that differs on a rotary model points at it |
#
# ## Exercises
#
# ### Exercise 1: a dump by hand
# Write the dump of a one-rank "system" with 2 micro-batches (`parallel: {"micro_batches": 2}`) whose wpe gradient
# is doubled: parameters from `hsgd.model.serial.init_params`, a batch, exact gradients from
# `serial.loss_and_grads` (wpe's times 2), written with `write_layout` and `write_rank`, `dump.json` last
# (`hsgd.crosscheck.manifest.write_manifest`). Check that the crosscheck fails on wpe alone, "= micro-batches".
# (solution: `tutorials/solutions/20_checking_another_system.py`, `exercise_1`)
#
# ### Exercise 2: a layout.json that lies about the interleave
# Write a one-rank dump whose fused qkv is stored `[q | k | v]` (interleave "block", nn.Linear's (out, in)), and
# check that it passes when layout.json says "block". Then let layout.json say "head" for the same files: what does
# the crosscheck see, in the loss row and in the gradients, and why can it not call this a permutation?
# (solution: `tutorials/solutions/20_checking_another_system.py`, `exercise_2`)
#
# ### Exercise 3: a factor of 2 is ambiguous on tp 2 x dp 2
# With `hsgd.check.mutations.injected("zero-without-1/dp")`, dump hsgd on dp 2 x pp 2 x tp 2 with ZeRO 1: the
# crosscheck names the factor 2 "dp or pp or tp". Pick a layout of the 8 ranks that names it "dp" alone.
# (solution: `tutorials/solutions/20_checking_another_system.py`, `exercise_3`)
#
# ### Exercise 4: repair the ln-not-reduced dump
# In a copy of `tutorials/crosscheck_dumps/torch_tp2_dp2_ln-not-reduced`, replace every LayerNorm gradient on every
# rank by its mean over the dp ranks (the forgotten All-Reduce) and seal the copy anew
# (`hsgd.crosscheck.manifest.seal`: else the crosscheck refuses it as a mixed dump). Check that it then passes, and
# that the repaired gradients equal the correct dump's (`torch_tp2_dp2`) to 1e-12.
# (solution: `tutorials/solutions/20_checking_another_system.py`, `exercise_4`)
#
# ### Exercise 5: read a Distributed Checkpoint by hand
# From `tutorials/crosscheck_dumps/dcp_fsdp2_dp3_tp2/dcp-metadata.json` alone, find which ranks hold row 13 of the
# gradient of `layers.0.attention.wo.weight` and which hold row 13 of `layers.0.attention.wq.weight`'s, and why the
# answers differ (two ranks for one, one rank for the other). Read those chunks' bytes with
# `hsgd.crosscheck.dcp.Checkpoint(DIR, read_description(...)).read(chunk)`, put row 13 of each together from them,
# and check it against the same row of the gradient `copies_of` assembles from the converted dump
# (`python -m hsgd.crosscheck.from_dcp DIR --out DUMP --metadata-json`), exactly.
# (solution: `tutorials/solutions/20_checking_another_system.py`, `exercise_5`)
