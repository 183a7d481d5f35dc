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
# # Chapter 18: checking another system's distributed gradients
#
# Every chapter so far checked hsgd against hsgd: a layout against the serial model of the same code base. The
# question a production team asks is about its own system: does our tensor-parallel, data-parallel, gradient-
# accumulating training step compute the gradient of the mean loss, the gradient one device would compute on the
# whole batch? The lecture's section 3.4 (the data-parallel gradient sync across groups) is where most answers go
# wrong: each shard's G gradients must be summed over the groups and divided by G, replicated parameters (the
# LayerNorms) must be reduced too, and nothing else may take part. This chapter checks a system that is not hsgd,
# a PyTorch program, with `python -m hsgd.crosscheck`, from its dump to a verdict that names the bug:
#
# 1. why one step compared per parameter finds what loss curves hide;
# 2. the dump format, shown on a real dump: what `layout.json` says (shards, replicas, padding, a fused q|k|v
#    interleaved per head, transposed `nn.Linear` weights), checked against the parameters it describes;
# 3. hsgd's own dumps (`dump_one_step`, `hsgd.train --dump-step N DIR`) on two layouts of the 8 ranks: PASS;
# 4. the PyTorch system (`benchmarks/crosscheck_torch.py`: DTensor tensor parallelism, data parallelism by hand):
#    its committed dumps, the correct ones and three real bugs, each named by its class;
# 5. deliberately broken hsgd (`hsgd.check.mutations`): four more bugs, dumped and named;
# 6. two pictures: how one tensor's shards come back together, and every parameter's error by class;
# 7. reading a verdict: from the class to the line of code.
#
# Run it with eight ranks (5 to 10 s measured on a 2-core machine without PyTorch; with PyTorch installed,
# section 4 also runs the PyTorch program once, which adds its start-up, 20 to 60 s on a loaded 2-core machine;
# on failure every rank raises, so it exits non-zero without hanging). Rank 0 draws two pictures into
# `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/18_checking_another_system.py
#
# The notebook form (`jupytext --to ipynb tutorials/18_checking_another_system.py`) is for reading: sections 3 and
# 5 need eight MPI ranks. Only rank 0 prints.
#
# Legend: B sequences in the global batch, T sequence length, C d_model, NH heads, hs = C / NH the head size, F
# d_ff, V vocabulary, L layers; dp, pp, tp the sizes of a layout, m (M in the PyTorch program) micro-batches per dp
# rank and step; G a system's gradient of one parameter (assembled from its shards), R the reference's (hsgd's
# serial model in float64 on the same parameters and batch); a "replica" is one full copy of G assembled from one
# set of ranks.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as in chapter 13 (OpenBLAS's thread timeout)
from hsgd.model import serial

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

from hsgd.crosscheck.__main__ import check as crosscheck, copies_of, report
from hsgd.crosscheck.manifest import check_set
from hsgd.crosscheck.read import load
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
# A layout that computes a different gradient from one device seldom crashes. Summing the micro-batches' gradients
# instead of averaging them multiplies every gradient by m: with SGD that is a learning rate m times larger, and the
# loss curve goes down, only differently. A LayerNorm whose gradient is left out of the data-parallel All-Reduce
# keeps, on each dp rank, the gradient of that rank's own rows: the replicas drift apart by a little each step, and
# the loss curve shows it, if at all, after thousands of steps, as a run that is "a bit worse than the paper's".
# Padded vocabulary rows that take part in the softmax change the loss by a fraction of a percent. Comparing loss
# curves against a one-device run cannot tell these apart from a different seed, a different summation order
# (chapter 16) or an unlucky data order.
#
# One step can. Take the parameters before a step and the step's batch, compute the exact gradient of the mean
# loss on one device in float64 (hsgd's `serial.loss_and_grads`, the reference R), and compare it, parameter by
# parameter, with what every rank of the system holds after the step's reductions (G). In float64 a correct layout
# agrees to about 1e-15; a bug shows as an error of order one, and the *shape* of the difference says which bug:
# G = m R is a missing 1/m, replicas whose mean is R are a missing average, gradient on rows that stand for no token
# is padding that takes part. That is what `python -m hsgd.crosscheck DIR` does, on a dump that any system can
# write: a folder of JSON and NumPy `.npz` files, described in `hsgd/crosscheck/FORMAT.md`.

# %% [markdown]
# ## 2. The dump format, on a real dump
#
# The PyTorch program of section 4 wrote `tutorials/crosscheck_dumps/torch_tp2_dp2/`: 4 ranks, tp 2 x dp 2, global
# rank = dp_rank x tp + tp_rank. The folder holds `layout.json`, `params.npz` (the whole parameters before the step,
# as PyTorch stores them), `batch.npz` (the global batch), `grads-rank{r}.npz` (rank r's gradient pieces) and,
# written last, `dump.json` (every file's size and sha256: one set of files of one run, or the crosscheck refuses
# the folder as incomplete or mixed). The
# layout says, for every tensor of the system, its full shape, how it maps to hsgd's parameters, and where the
# pieces of its gradient are. Four of its entries, shortened to one line each:

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
# Read the entries from the top. `wte`'s rows, the vocabulary, are split over the tp ranks (axis 0, half each), and
# ranks 2 and 3 hold the same two slices as ranks 0 and 1: a second replica, the other dp rank's. The LayerNorm's
# weight is whole on every rank (`axis` null, four replicas): replicated under tp, and each copy must be the full
# gradient after the step's reductions, so each is checked. The fused `qkv` is PyTorch's `nn.Linear(C, 3C)`, stored
# (out, in), hence `transposed`; its rows are q, k and v interleaved per head, `[q_0 k_0 v_0 q_1 k_1 v_1 ...]`
# (Megatron-LM's layout of its fused query_key_value), so that the column split gives every tp rank whole heads;
# `fused` says so, and `group` = hs rows per piece. `proj` (row-parallel) is split along its input columns, axis 1
# of the stored (out, in) weight. The checks above hold the description to the data: mapped back, the stored
# tensors are exactly the parameters the program started from.
#
# What a system must get right when writing its dump: the gradients after every reduction the step does (over tp,
# dp, micro-batches) and before clipping, weight decay, the optimizer and any loss scale; the full parameters
# before the step; the global batch in the order the mean loss runs over. A system that shards flat chunks of its
# gradients (ZeRO) gathers them to the parameters' shapes first.

# %% [markdown]
# ## 3. hsgd's own dumps
#
# `hsgd.train --dump-step N DIR` writes step N of any run as such a dump (a step watcher: the full parameters and
# the batch before the step, every rank's averaged gradient shards after it, the layout gathered from every rank's
# shard descriptions); `dump_one_step` does the same for one step without a training run. Two layouts of the eight
# ranks, on a model whose vocabulary (V = 15) tp 4 does not divide, so that the last tp rank's rows carry padding:

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
# The table has one row per parameter of the reference: its shape, how the dump holds it (the `split` column:
# "axis 0 / 4, x2 +pad" is four tp slices along axis 0, two replicas, padding entries that must be zero), the
# largest absolute error over every replica, that error relative to the reference's largest entry of the
# parameter (with a floor of 1e-3 of the model's largest gradient entry, so that a gradient that is nearly zero is
# not held to 1e-10 of itself), and the tolerance of the dump's dtype. The k biases' absolute errors are the
# smallest, ~1e-21: their exact gradient is zero (a softmax ignores a shift shared by a row of scores), and what any
# layout computes there is rounding noise; section 4 meets them again.

# %% [markdown]
# ## 4. The PyTorch system
#
# `benchmarks/crosscheck_torch.py` is one training step of the same GPT written the way a PyTorch user writes it,
# without hsgd: an `nn.Module` with `nn.Embedding`, `nn.LayerNorm` and `nn.Linear`, one fused qkv per block;
# `tp*dp` processes (gloo on the CPU) on a 2-D `init_device_mesh("cpu", (dp, tp))`; tensor parallelism by
# `parallelize_module` (`ColwiseParallel` for qkv and fc, `RowwiseParallel` for the projections and the
# vocabulary-parallel embedding, the logits left split over the vocabulary for `loss_parallel()`); data parallelism
# by hand, a `dist.all_reduce` of every gradient over the dp group and a division by dp; gradient accumulation over
# `--micro-batches M`. Its `--bug` switches on one of three real mistakes. It writes the dump itself.
#
# PyTorch is not among hsgd's requirements, so the dumps the program wrote are committed, small (a tiny model,
# under 100 KB each), with the commands that wrote them in `tutorials/crosscheck_dumps/README.md`. When PyTorch is
# installed, the chapter runs the program again for the first of them and checks that the fresh dump equals the
# committed one, so that the committed data cannot drift from the program that claims to write it.

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


def rerun():
    """Rank 0: the program run again into a temporary folder, compared with the committed dump; None without
    PyTorch."""
    if not torch_installed():
        return None
    out = tempfile.mkdtemp(prefix="crosscheck-torch-")
    # the program starts its own processes (gloo): none of mpiexec's variables must reach them
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI", "OMPI", "PMIX"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, os.path.join(os.path.dirname(HERE), "benchmarks", "crosscheck_torch.py"),
           *TORCH_DUMPS[RERUN].split(), *MODEL.split(), "--out", out]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RERUN_TIMEOUT_S)
        res = {"rc": r.returncode, "tail": (r.stdout + r.stderr).strip().splitlines()[-3:], "diff": None}
        if r.returncode == 0:
            res["diff"] = dump_difference(folder(RERUN), out)
    except subprocess.TimeoutExpired:
        res = {"rc": "timeout", "tail": [f"no result after {RERUN_TIMEOUT_S} s"], "diff": None}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t0
    return res


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
# Now every committed dump through the crosscheck, as `python -m hsgd.crosscheck tutorials/crosscheck_dumps/NAME`
# would print it (the full table for the first, the verdict and its explanations for the others):

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

ok, loss_row, rows, _ = V["torch_tp2_dp2_ln-not-reduced"]
LN = {n for n in rows if ".ln" in n or n.startswith("ln_f")}
check.holds("ln-not-reduced: FAIL, the loss itself right", not ok and loss_row["ok"])
check.equal("ln-not-reduced: the failing parameters = the LayerNorms'", sorted(failed(rows)), sorted(LN))
check.holds("ln-not-reduced: each a partial sum, the dp groups' mean = R (ranks 0,1 | 2,3)",
            all(rows[n]["class"] == "partial sum" and "(ranks 0,1 | 2,3); their mean is the reference" in
                rows[n]["detail"] for n in LN))

ok, loss_row, rows, _ = V["torch_tp2_dp2_v15_vocab-padding"]
check.holds("vocab-padding: FAIL, and the loss differs too", not ok and not loss_row["ok"])
check.equal("vocab-padding: lm_head.weight's class", rows["lm_head.weight"]["class"], "padding")

# %% [markdown]
# The three bugs look different, and the crosscheck says how:
#
# - **no-microbatch-scale** (each micro-batch's loss backpropagated without the 1/M): every gradient is exactly 3
#   times the reference, and 3 is the layout's number of micro-batches, the only one of its sizes that is 3. That
#   is why this dump runs M = 3: with M = 2 on tp 2 x dp 2 the factor 2 would be "dp or micro-batches or tp", and
#   the crosscheck says all three (exercise 3). The loss is right: the program reports the unscaled loss.
# - **ln-not-reduced** (the LayerNorms left out of the dp All-Reduce): the replicas disagree, ranks 0 and 1 (dp
#   rank 0) hold one value, ranks 2 and 3 another, and their mean is the reference: an average over the 2 dp ranks
#   is missing. Every other parameter is right to 1e-15, so the bug is confined to exactly the parameters the
#   All-Reduce skipped.
# - **vocab-padding** (the padded vocabulary's logits not masked to -inf): the one padded row of lm_head carries
#   gradient, which no real token can cause. Because the padded logit enters the softmax, the loss and every other
#   gradient change too, by a few percent, in no simple pattern: the padding is the one *named* cause, and the table's
#   first line, the loss, confirms the forward pass itself differs.

# %% [markdown]
# ## 5. Bugs on purpose in hsgd
#
# `hsgd.check.mutations.injected(bug, name)` switches on, for the length of a `with` block, one of the mistakes
# distributed training code is known to make, in hsgd itself. Four of them, each dumped on a layout where it shows
# and crosschecked:

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
# The factor dp of ZeRO's missing 1/dp and the factor m of the pipeline's missing 1/m are told apart only because
# the layouts' sizes differ (dp 4 x tp 2, and m = 3 on pp 2 x tp 4): a layout whose sizes are all 2 could not say
# which. The sequence scheme's missing LayerNorm reduction is a partial sum over the 4 tp ranks (each holds its
# T/tp positions' share; their *sum* is R), where the PyTorch program's missing dp average was a *mean*: the class
# names which reduction, the detail which kind. The head permutation is found in the one parameter it touched, and
# the order printed is the one each tp rank's two heads were swapped in.

# %% [markdown]
# ## 6. Two pictures
#
# The first shows how one tensor's gradient comes back together: the rows of the fused qkv weight (stored (3C, C))
# of `torch_tp2_dp2`, coloured by q, k and v, and which rank holds them; then lm_head's rows of `torch_tp2_dp2_v15`
# with the padded row. The second shows every parameter's error, relative, for each PyTorch dump, coloured by the
# class the crosscheck gave it, against the float64 tolerance.

# %%
CLASS_COLORS = {"ok": "#2ca02c", "constant factor": "#1f77b4", "partial sum": "#d62728", "padding": "#9467bd",
                "no simple pattern": "#7f7f7f", "permutation": "#ff7f0e"}


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
    pictures.save(fig, "18_shards_reassembled")

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
    handles = [ax.scatter([], [], color=c, label=k, s=18) for k, c in CLASS_COLORS.items()
               if k != "permutation"]
    handles += [ax.scatter([], [], color="k", marker="osD^v"[y], label=n.replace("torch_", ""), s=18)
                for y, n in enumerate(torch_verdicts)]
    ax.legend(handles=handles, fontsize=6, ncol=2, loc="center left")
    ax.set_title("every parameter of the PyTorch dumps, coloured by the crosscheck's class", fontsize=9)
    pictures.save(fig, "18_errors_by_class")


pictures.on_rank0(world, draw)

# %% [markdown]
# In the first picture each tp rank holds whole heads (rank 0 heads 0 and 1 of q, k and v, rank 1 heads 2 and 3),
# which is why the per-head interleave exists: a block layout `[q | k | v]` split in two would give rank 0 all of q
# and half of k. In the second, the correct dumps sit at 1e-16, six decades under the tolerance; each bug puts its
# parameters near 1 (a factor 3 is an error of 2, a missing average an error of order one), and the padding bug
# leaves every parameter a little off, the one with the padded row named.

# %% [markdown]
# ## 7. Reading a verdict: from the class to the line
#
# | class | what it means | where to look |
# |---|---|---|
# | constant factor = m (micro-batches) | the micro-batches' gradients summed where their mean belongs | the loss divided by m before each backward (`(loss * scale).backward()` in the PyTorch program, `Stage.receive`'s S/m in hsgd) |
# | constant factor = dp | the dp replicas' gradients summed, not averaged | the division by dp after the dp All-Reduce (or the Reduce-Scatter of ZeRO: `Zero1Exchange.average`) |
# | constant factor = tp, or tp x tp | a tensor-parallel adjoint that sums what each rank already held whole | the backward of the All-Gather or All-Reduce in front of the layers that show it (the lowest layer showing the factor is just below the faulty collective) |
# | 1/n of any size | an average where a sum belongs, or a 1/n applied twice | the same reductions, the other way round |
# | partial sum: the mean is R | the replicas of a parameter never averaged over a group (dp: the groups the detail lists) | the list of parameters the dp All-Reduce covers: a replicated parameter left out |
# | partial sum: the sum is R | each rank holds its share of a gradient that needs adding up (a replicated parameter under sequence or context parallelism) | the All-Reduce of the replicated parameters' partial gradients over tp or cp |
# | padding | rows that stand for no token get gradient | the mask of the padded logits (-inf before the softmax) or the embedding's lookup of ids past V |
# | permutation of heads or rows | the right numbers in the wrong places | a gather's order, a reshape of (heads, hs) against (hs, heads), the fused qkv's interleave |
# | transposed | a square weight written the other way round | the dump's `transposed` flag, or a `.T` in the code |
# | missing | the gradient never arrived | a parameter without `requires_grad`, a hook that never fired, a rank that wrote zeros |
# | no simple pattern, with the loss wrong | the forward pass differs | the loss first: masking, a dropout left on, a different epsilon; or the dump's parameters or batch are not what ran |
#
# Two cautions. A factor that is two sizes at once (tp = dp = 2) is named by both: choose a layout for the check
# whose sizes differ (tp 2 x dp 4 x m 3). And the crosscheck reads only what the dump says: a layout.json that
# describes the shards wrongly (exercise 2) produces a failure that is the dump's, not the system's; the loss line
# tells the two apart, as a wrong description of the parameters changes the reference's loss too.

# %%
exact = [w for w in check.errors if w.startswith(("hsgd", "torch"))]
worst, err = check.worst(exact)
say(f"\nchapter 18: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error of a correct "
    f"layout against the serial reference {err:.1e} ({worst}); "
    f"{'the committed PyTorch dump rewritten and equal' if fresh else 'the committed PyTorch dumps as they are'}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `python -m hsgd.crosscheck DIR`: every parameter's distributed gradient against an exact one-device float64 reference, the failure classified | none: its functional tests compare a run's loss curve with recorded ones (tests/functional_tests/test_cases/.../golden_values_*.json); `check_param_hashes_across_dp_replicas` (megatron/core/utils.py) checks that the dp replicas' parameters are identical, not that they are right | none | none; `torch.testing.assert_close` compares two tensors you bring | one step, per parameter, against an exact reference, and a named kind of bug instead of "the curves differ" |
# | the dump (`hsgd/crosscheck/FORMAT.md`: layout.json with shards, replicas, padding, fused and transposed tensors; `hsgd.train --dump-step N DIR`) | the distributed checkpoint, `--ckpt-format torch_dist` (sharded tensors with their global offsets), and `tools/checkpoint/convert.py` between layouts: parameters and optimizer state, not gradients | `zero_to_fp32.py` (`get_fp32_state_dict_from_zero_checkpoint`): ZeRO's flat partitions consolidated into full fp32 parameters | `torch.distributed.checkpoint` (sharded state dicts with their metadata); `DTensor.full_tensor()` gathers one DTensor | a neutral format any system can write, with the step's gradients and batch, read without pickle |
# | reassembling a gradient from its shards (`copies_of`, every replica separately) | none for gradients | `deepspeed.utils.safe_get_full_grad(param)`: one parameter's full gradient under ZeRO | `DTensor.full_tensor()` on `param.grad` | every replica is checked, so a replica that differs (a missing average) is seen, not hidden by taking rank 0's copy |
# | the padded vocabulary in a shard's `padding` entries, whose gradient must be zero | `--make-vocab-size-divisible-by` (the vocabulary padded to a multiple of it times tp) | none | none: Shard(0) of a tensor tp does not divide leaves uneven pieces; the PyTorch program pads by hand | padding is declared in the dump and checked to carry no gradient |
# | a vocabulary-parallel loss checked in the dump's loss row | `vocab_parallel_cross_entropy` (megatron/core/tensor_parallel/cross_entropy.py) | none | `loss_parallel()` (torch.distributed.tensor.parallel) | the loss is recomputed by the reference, not trusted |
#
# ## Exercises
#
# ### Exercise 1: a dump by hand
# Write the dump of a one-rank "system" with gradient accumulation over 2 micro-batches (`parallel:
# {"micro_batches": 2}`) whose wpe gradient is doubled: the parameters from `hsgd.model.serial.init_params`, a batch,
# the exact gradients from `serial.loss_and_grads`, wpe's times 2, written with `write_layout` and `write_rank`, and
# `dump.json` last (`hsgd.crosscheck.manifest.write_manifest`). Check that the crosscheck fails on wpe alone and
# names the factor "= micro-batches".
# (solution: `tutorials/solutions/18_checking_another_system.py`, `exercise_1`)
#
# ### Exercise 2: a layout.json that lies about the interleave
# Write a one-rank dump whose fused qkv is stored `[q | k | v]` (interleave "block", nn.Linear's (out, in)), and
# check that it passes when layout.json says "block". Then let layout.json say "head" for the same files: what does
# the crosscheck see, in the loss row and in the gradients, and why can it not call this a permutation?
# (solution: `tutorials/solutions/18_checking_another_system.py`, `exercise_2`)
#
# ### Exercise 3: a factor of 2 is ambiguous on tp 2 x dp 2
# With `hsgd.check.mutations.injected("zero-without-1/dp")`, dump hsgd on dp 2 x pp 2 x tp 2 with ZeRO 1 and check that
# the crosscheck names the factor 2 "dp or pp or tp"; then pick a layout of the 8 ranks that names it "dp" alone,
# and check that.
# (solution: `tutorials/solutions/18_checking_another_system.py`, `exercise_3`)
#
# ### Exercise 4: repair the ln-not-reduced dump
# Copy `tutorials/crosscheck_dumps/torch_tp2_dp2_ln-not-reduced`, and in the copy replace every LayerNorm gradient
# on every rank by the mean over the dp ranks (the All-Reduce the program forgot), and seal the copy anew
# (`hsgd.crosscheck.manifest.seal`: the old `dump.json`'s digests no longer hold, and the crosscheck would refuse it
# as a mixed dump). Check that the crosscheck then passes, and that the repaired gradients equal the correct dump's
# (`torch_tp2_dp2`) to 1e-12.
# (solution: `tutorials/solutions/18_checking_another_system.py`, `exercise_4`)
