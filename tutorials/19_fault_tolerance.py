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
# # Chapter 19: fault tolerance, checkpoints of a sharded model
#
# Part IV, operations, starts here: chapters 1-18 made a layout compute the right step; this part keeps such a run
# alive, uses it to check other systems, and moves it onto GPUs. This chapter is how a job survives its failures.
# The lecture's section 4.3 (in translation):
#
# > Hybrid-parallel training jobs are large, with many nodes and long running times, so the probability that a node
# > fails grows. A checkpoint mechanism is needed that periodically saves the model state (parameters, optimizer
# > state) to persistent storage. Because the parameters are spread over different nodes, saving and restoring a
# > checkpoint is itself a distributed operation.
#
# A node that fails once in a few years makes a thousand-node job lose one about every day: a long run is a sequence
# of segments, each starting from the last checkpoint. The chapter follows `hsgd.checkpoint.store` and the fault
# handling of `hsgd.step.trainer`, `hsgd.train` and `hsgd.grid.launch` on a dp 2 x pp 2 x tp 2 grid (chapter 10).
# Eight ranks, about 6 s on a quiet 2-core machine (two to four times that on a loaded one); only rank 0 prints,
# and everything written goes into a temporary directory:
#
# mpirun -n 8 python tutorials/19_fault_tolerance.py
#
# Legend: P ranks, dp replicas, pp stages, tp ranks per stage, B global batch, m micro-batches, T sequence,
# C d_model, NH heads, F d_ff, V vocabulary, L layers; s a stage, t a tensor rank.

# %%
import atexit
import contextlib
import io
import json
import os
import shutil
import socket
import tempfile
import time

import numpy as np

from hsgd.model.config import ModelConfig
from hsgd.checkpoint import store as checkpoint
from hsgd.grid import launch
from hsgd.model import serial
from hsgd.tp import shards as tp_shards
from hsgd.checkpoint.runs import complete_checkpoints
from hsgd.checkpoint.store import CheckpointError, Shards
from hsgd.model.data import Corpus
from hsgd.dp.average import replica_divergence
from hsgd.errors import NumericalFault
from hsgd.run.faults import Faults
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.run.diverged import check_replicas
from hsgd.train import train
from hsgd.checkpoint.runs import ZOMBIE_WAIT_S, FolderLock, proc_state
from hsgd.run.watchdog import CHECKPOINT_TIMES, EXIT_TIMEOUT, REPORTS_S, Watchdog, per_batch
from hsgd.step.health import Skipping
from hsgd.step.loss_scale import MIN_SCALE, LossScaler

import pictures                                     # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

P, DP, PP, TP = 8, 2, 2, 2              # 8 = 2 replicas x 2 stages x 2 tensor-parallel ranks
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=78)
grid = ProcessGrid(world, dp=DP, pp=PP, tp=TP)

cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=32)   # NH, F split 1, 2, 4 ways
SEED, B, STEPS = 0, 8, 6
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
TMP = world.bcast(tempfile.mkdtemp(prefix="hsgd-ch19-") if rank == 0 else None, root=0)   # one directory for all
if rank == 0:
    atexit.register(shutil.rmtree, TMP, ignore_errors=True)   # removed at exit, also when a check fails
SAVE = os.path.join(TMP, "run")         # the --save-dir of the run
say(f"{P} ranks = dp {DP} x pp {PP} x tp {TP}; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} "
    f"NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size}); checkpoints under {TMP}")


def config(**kw):
    """The float64 run every trainer of the chapter shares (`train_config`: SGD with momentum, warm-up, cosine
    schedule over STEPS, clipping, m = 2 micro-batches; validated, as hsgd.train does)."""
    return train_config(**{**dict(dp=DP, pp=PP, tp=TP, steps=STEPS, batch_size=B, micro_batches=2, warmup=2,
                                  clip=1.0, seed=SEED, threads=1), **kw})


def batch(step):
    """The global batch of `step`: a pure function of (seed, step), the same on every rank (chapter 4)."""
    return corpus.batch(SEED, step, B)

# %% [markdown]
# ## 1. What a checkpoint of a sharded model holds
#
# On one process a checkpoint is `np.savez(params)`. On the grid no rank holds the model: rank r holds its stage's
# blocks (pp) and its tensor rank's columns or rows of them (tp), and the DP replicas hold identical copies
# (chapter 4). So `checkpoint.save(trainer, step, save_dir, keep)`, called by every rank, writes:
#
# * **one file per (stage s, tensor rank t)**, `shard-pp{s}-tp{t}.npz`, by the rank of that position in the first
#   replica (dp_rank 0): its parameter shards (`param/<name>`) and optimizer state (`opt/<name>/velocity` for SGD
#   with momentum, `m` and `v` for AdamW). pp x tp files, written in parallel, each rank's I/O proportional to its
#   share of the model;
# * **`manifest.json`**, by rank 0 once every file is on disk: the model's shape, the layout (dp, pp, tp, the
#   tensor-parallel scheme, the blocks per stage), the step, the data position and seed, the optimizer (and AdamW's
#   step count), the dtype, and the size and SHA-256 of every file.
#
# hsgd's batches are a pure function of (seed, step), so `next_step` and `seed` are the whole random state of the
# run. (A framework with a shuffling data loader or dropout must also save the generators' states, per rank.)
#
# The run: three steps, then the checkpoint after step 3. This trainer goes on to step 6 in section 2 and is "the
# uninterrupted run" every resumed run is compared with.

# %%
trainer = HybridTrainer(cfg, grid, config())                           # my stage's shards (float64)
losses = {}                                                            # step -> loss of the uninterrupted run
for step in range(1, 4):
    losses[step] = trainer.step(*batch(step), step).loss
path3 = checkpoint.save(trainer, 3, SAVE, keep=2)                      # collective: every rank calls it
mine = f"shard-pp{grid.pp_rank}-tp{grid.tp_rank}.npz"                  # the file of my (stage, tensor rank)
writers = world.allgather((rank, grid.dp_rank, mine))
say(f"{path3}:")
for name in sorted(os.listdir(path3)):
    by = [r for r, d, f in writers if f == name]
    who = f"world ranks {by} hold it, rank {by[0]} (dp_rank 0) wrote it" if by else "rank 0 wrote it"
    say(f"  {name:<20} {os.path.getsize(os.path.join(path3, name)):>7,} bytes   {who}")

# %% [markdown]
# The manifest, and the first entries of one shard file (a `.npz`, a zip of `.npy` arrays). Every rank checks that
# the file of its position holds exactly its own shards and velocities, bit for bit, whether it wrote the file or
# only holds a replica of it, and that the file's SHA-256 is the manifest's:

# %%
with open(os.path.join(path3, "manifest.json")) as f:
    manifest = json.load(f)
for key in ("format", "step", "model", "layout", "optimizer", "dtype", "data", "rng"):
    say(f"  {key:<9} {manifest[key]}")
for name, info in manifest["files"].items():
    say(f"  files    {name}: pp {info['pp']} tp {info['tp']}, {info['bytes']:,} bytes, sha256 {info['sha256'][:16]}...")
with np.load(os.path.join(path3, mine), allow_pickle=False) as f:
    stored = {k: f[k] for k in f.files}                                # {"param/wte": ..., "opt/wte/velocity": ...}
say(f"{mine} (world rank 0's): {len(stored)} arrays: " + ", ".join(f"{k} {stored[k].shape}" for k in list(stored)[:4])
    + ", ...")
state = trainer.state_dict()                       # {"params", "moments": {name: {"velocity": my shard's}}, ...}
expected = {f"param/{n}": p for n, p in state["params"].items()}
expected.update({f"opt/{n}/{k}": v for n, st in state["moments"].items() for k, v in st.items()})
check.equal("every rank: the checkpoint's files == pp x tp shards + manifest", set(os.listdir(path3)),
            {f"shard-pp{s}-tp{t}.npz" for s in range(PP) for t in range(TP)} | {"manifest.json"})
check.equal("every rank: the arrays of my position's file == my shards and velocities", set(stored), set(expected))
check.holds("every rank: ... and they hold them bit for bit",
            all(np.array_equal(stored[k], v) for k, v in expected.items()))
check.equal("every rank: my position's file's SHA-256 == the manifest's",
            checkpoint.sha256(os.path.join(path3, mine)), manifest["files"][mine]["sha256"])

# %% [markdown]
# The picture: on the left, for every layer (a weight and its bias together), the parameter elements in each file,
# shaded by the share of the full layer (the velocities double every number). Stage 0's files hold the embeddings
# and block 0, stage 1's block 1, the final LayerNorm and the LM head. A split layer is halved between the tensor
# ranks; a replicated one (the LayerNorms, `wpe`, the row-parallel biases in Megatron's scheme) is written whole by
# both, and `unshard` reads tensor rank 0's copy. On the right, the bytes each world rank wrote: replica 0's four
# ranks one file each, rank 0 the manifest too, replica 1 nothing.

# %%
def layer_of(name):
    """'h.0.attn.q.weight' -> 'h.0.attn.q': a weight and its bias are one row of the picture."""
    return name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name


if rank == 0:
    layer_names = list(dict.fromkeys(layer_of(n) for n in cfg.param_shapes()))    # in the model's order
    full_size = {lay: sum(int(np.prod(s)) for n, s in cfg.param_shapes().items() if layer_of(n) == lay)
                 for lay in layer_names}
    files = sorted(manifest["files"])                                          # shard-pp{s}-tp{t}.npz
    held = np.zeros((len(layer_names), len(files)), dtype=np.int64)            # elements per (layer, file)
    for j, name in enumerate(files):
        with np.load(os.path.join(path3, name), allow_pickle=False) as f:
            for key in f.files:
                if key.startswith("param/"):
                    held[layer_names.index(layer_of(key[len("param/"):])), j] += f[key].size
    share = held / np.array([full_size[lay] for lay in layer_names])[:, None]  # 1: a whole copy, 1/2: half
    fig, (ax, bx) = pictures.figure(10, 6.2, ncols=2, gridspec_kw=dict(width_ratios=[1.45, 1]))
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1.6, aspect="auto")
    for i in range(len(layer_names)):
        for j in range(len(files)):
            if held[i, j]:
                ax.text(j, i, f"{held[i, j]:,}" + (" (whole)" if share[i, j] == 1 else ""), ha="center",
                        va="center", fontsize=6.5)
    holders = {f: [r for r, _, g in writers if g == f] for f in files}
    ax.set_xticks(range(len(files)), [f"{f[6:-4]}\nranks {holders[f]}\nrank {holders[f][0]} writes"
                                      for f in files], fontsize=7)
    ax.set_yticks(range(len(layer_names)), layer_names, fontsize=7)
    ax.set_title(f"parameter elements per file, step {manifest['step']} (dp {DP} x pp {PP} x tp {TP})", fontsize=8)
    written = [manifest["files"][f]["bytes"] if d == 0 else 0 for r, d, f in writers]   # by world rank
    extra = [os.path.getsize(os.path.join(path3, "manifest.json")) if r == 0 else 0 for r in range(P)]
    bx.bar(range(P), written, color=pictures.COLORS["tp"], label="its shard file (parameters + velocities)")
    bx.bar(range(P), extra, bottom=written, color="0.6", label="manifest.json")
    for r, d, _ in writers:
        if d:
            bx.text(r, 1000, f"0: replica {d}", rotation=90, ha="center", va="bottom", fontsize=7)
    bx.set_xticks(range(P), [f"{r}" for r in range(P)])
    bx.set_xlabel("world rank")
    bx.set_ylabel("bytes written")
    bx.set_title("bytes each rank wrote (from the manifest)", fontsize=8)
    bx.legend(fontsize=7, loc="upper right")
    say(f"picture: {pictures.save(fig, '19_checkpoint_per_rank')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# ## 2. Atomic writes, and keeping the newest K
#
# A job can die while it writes a checkpoint; the previous one must then still be usable. `save` orders its work:
#
# 1. rank 0 removes leftovers of an interrupted save (`.tmp-*`) and creates `.tmp-step-000004-<pid>`;
# 2. the pp x tp writers write and `fsync` their shard files in it and send (name, SHA-256, size) to rank 0;
# 3. rank 0 writes the manifest, `fsync`s it and the directory,
# 4. and **renames** the directory to `step-000004`: the atomic moment (a `rename` inside one file system is
#    atomic in POSIX: a reader sees no `step-000004` or the complete one);
# 5. rank 0 removes the oldest checkpoints beyond `keep` (`--keep`, 3 by default).
#
# A kill before step 4 leaves a `.tmp-*` directory without manifest next to the untouched `step-000003`
# (`--inject-fault 3:4:kill-in-save`; `tests/test_faults.py`). `complete_checkpoints(save_dir)`
# (hsgd.checkpoint.runs) lists only `step-*` directories with a manifest, so `--resume auto` and `resolve` never see
# the half-written one. Here that state is made by hand: half of one shard file in a temporary directory of step 4.

# %%
if rank == 0:                                                          # what a kill during the save of step 4 leaves
    tmp = os.path.join(SAVE, ".tmp-step-000004-4242")                  # (4242: the pid of the dead rank 0)
    os.makedirs(tmp)
    with open(os.path.join(path3, "shard-pp0-tp0.npz"), "rb") as f:
        data = f.read()
    with open(os.path.join(tmp, "shard-pp0-tp0.npz"), "wb") as f:
        f.write(data[:len(data) // 2])                                 # cut off mid-write, and no manifest
world.Barrier()                                                        # the other ranks look only after that
found = complete_checkpoints(SAVE)
say(f"{SAVE} holds {sorted(os.listdir(SAVE))}; complete: {[os.path.basename(p) for p in found]}; "
    f"resolve() -> {os.path.basename(checkpoint.resolve(SAVE))}")
check.equal("every rank: the complete checkpoints == [step-000003]", found, [path3])
check.equal("every rank: open_checkpoint(save_dir) resumes after step", checkpoint.open_checkpoint(SAVE, cfg)["step"],
            3)

# %% [markdown]
# The run goes on to step 6, saving every second step and keeping two (`--save-interval 2 --keep 2`): the save
# after step 4 removes the leftover, the one after step 6 the checkpoint of step 3. The full models of steps 4 and 6
# (`trainer.full_params()`, a pickled allgather, for checks only) are the reference of everything below.

# %%
listings = {}
for step in range(4, STEPS + 1):
    losses[step] = trainer.step(*batch(step), step).loss
    if step == 4:
        full4 = trainer.full_params()                                  # the whole model after step 4, on every rank
    if step % 2 == 0:
        checkpoint.save(trainer, step, SAVE, keep=2)
        listings[step] = sorted(os.listdir(SAVE))
        say(f"after the save of step {step}: {SAVE} holds {listings[step]}")
ref = {n: p.copy() for n, p in trainer.params.items()}                # my shards after step 6
ref_velocity = trainer.opt.moments("flat")["velocity"].copy()        # my velocities, flat (hsgd.model.optim)
ref_full = trainer.full_params()                                      # the whole model after step 6
check.equal("every rank: save_dir's checkpoints after the saves of steps 4 and 6", listings,
            {4: ["step-000003", "step-000004"], 6: ["step-000004", "step-000006"]})
path4 = os.path.join(SAVE, "step-000004")

# %% [markdown]
# Rotation by step number alone would be dangerous in a folder that several runs share: a fresh run next to an older
# run's step 1000 would delete its own step 10 at once. So a checkpoint records its run's *line* (`manifest["run"]`):
# resumptions from a run's newest checkpoint continue its line, `keep` counts only the writer's line, and
# `--resume auto` follows the line written last. A fresh run into a folder with checkpoints is refused unless
# `--overwrite`, and a lock file held by rank 0 keeps a second job out.

# %% [markdown]
# ## 3. Exact resume in the same layout
#
# In a new job every rank calls `open_checkpoint(path, cfg)`, which reads and checks the manifest (section 5), then
# `checkpoint.load(trainer, manifest)`, which sets its shards and optimizer state and returns the step written
# after; training goes on at the next step, whose batch and learning rate are functions of the step. A fresh
# `HybridTrainer` on the same grid stands for the restarted job.
#
# In the same layout every rank then performs the same floating-point operations in the same order as the
# uninterrupted run, so the result is **bit-identical**: `np.array_equal` on every shard and velocity.

# %%
resumed = HybridTrainer(cfg, grid, config())                           # the "restarted job": seed's parameters
manifest4 = checkpoint.open_checkpoint(path4, cfg)                     # checked (section 5)
start = checkpoint.load(resumed, manifest4) + 1                        # 5: the step after the checkpoint
resumed_losses = {}
for step in range(start, STEPS + 1):
    resumed_losses[step] = resumed.step(*batch(step), step).loss
say(f"resumed after step {start - 1}; losses of steps {start}-{STEPS}: "
    f"{' '.join(f'{resumed_losses[s]:.15f}' for s in resumed_losses)}")
say(f"uninterrupted run, the same steps:  {' '.join(f'{losses[s]:.15f}' for s in resumed_losses)}")
check.holds("exact resume: shards bit-identical to the uninterrupted run",
            all(np.array_equal(resumed.params[n], ref[n]) for n in ref))
check.holds("exact resume: velocities bit-identical", np.array_equal(resumed.opt.moments("flat")["velocity"],
                                                                        ref_velocity))
check.equal("exact resume: losses == the uninterrupted run's, bit for bit", resumed_losses,
            {s: losses[s] for s in resumed_losses})

# %% [markdown]
# Why the optimizer state belongs in the checkpoint: with momentum, step 5 is $w \leftarrow w - \eta_5 v_5$ with
# $v_5 = \mu v_4 + g_5$, and $v_4$ carries every earlier gradient. A checkpoint of the parameters alone restarts
# with $v_4 = 0$, on another trajectory. The same resume, with the velocities dropped:

# %%
amnesiac = HybridTrainer(cfg, grid, config())
checkpoint.load(amnesiac, manifest4)
amnesiac.opt.set_moments("flat", {})                                  # as if only the parameters had been saved
for step in range(start, STEPS + 1):
    amnesiac.step(*batch(step), step)
drift = max(rel_err(amnesiac.params[n], ref[n], floor=0.02) for n in ref)
drift = max(world.allgather(drift))
say(f"parameters only, no velocity: largest relative difference to the uninterrupted run after step {STEPS}: "
    f"{drift:.1e}")
check.holds("resume without the velocity ends > 1e-6 away from the uninterrupted run", drift > 1e-6)

# %% [markdown]
# ## 4. Resharding: the same checkpoint in another layout
#
# A restarted job often has another shape: fewer nodes after a failure, more when they come back, another trade-off
# (chapter 17). Every piece of a checkpoint is a known slice of a serial tensor, so `checkpoint.load` reshards, for
# each parameter the rank needs:
#
# 1. `Shards(manifest).full(name)`: read the old stage's pieces from the files of all old tensor ranks and join them
#    with `tp_shards.unshard(pieces, name, cfg, old_scheme)` (concatenate, drop the vocabulary padding);
# 2. `tp_shards.shard(full, name, new_tp_rank, new_tp, new_scheme)`: cut the rank's piece for the new layout.
#
# The optimizer state likewise. Each rank holds full tensors for a moment: fine at this project's sizes (a large
# model would read only the byte ranges it needs). Below, by hand, what world rank 0 of dp 1 x pp 2 x tp 4 with the
# All-Gather scheme (chapters 5 and 6) does for four parameters: `mlp.proj.weight` changes its split axis (rows in
# Megatron's scheme, columns in the other), `attn.proj.bias` is replicated in Megatron's scheme and split in the
# other.

# %%
old, shards = manifest4["layout"], Shards(manifest4)
say(f"saved as dp {old['dp']} x pp {old['pp']} x tp {old['tp']} {old['tp_scheme']}, blocks per stage "
    f"{old['layers']}; world rank 0 of dp 1 x pp 2 x tp 4 gather (stage 0, tp_rank 0) needs:")
say(f"  {'parameter':<20} {'old pieces (file: shape)':<44} {'full':>9}  {'its piece':>9}")
joined, old_shapes = [], {}                                            # by hand == Shards.full == step 4's
for name in ("wte", "h.0.attn.q.weight", "h.0.mlp.proj.weight", "h.0.attn.proj.bias"):
    s = shards.stage_of(name)                                          # the old stage that held it
    pieces = []
    for t in range(old["tp"]):
        with np.load(os.path.join(path4, f"shard-pp{s}-tp{t}.npz"), allow_pickle=False) as f:
            pieces.append(f[f"param/{name}"])
    full = tp_shards.unshard(pieces, name, cfg, old["tp_scheme"])       # (serial shape)
    piece = tp_shards.shard(full, name, 0, 4, "gather")                 # tp_rank 0 of 4
    joined.append(np.array_equal(full, shards.full(name)) and np.array_equal(full, full4[name]))
    old_shapes[name] = [p.shape for p in pieces]                      # for the picture below
    files = ", ".join(f"pp{s}-tp{t}: {p.shape}" for t, p in enumerate(pieces))
    say(f"  {name:<20} {files:<44} {str(full.shape):>9}  {str(piece.shape):>9}")
check.holds("full tensors joined by hand == Shards.full == the step-4 model", all(joined))

# %% [markdown]
# The same four parameters as a picture, every entry coloured by its owner: on top the old tensor rank whose file
# holds it, below the new tensor rank that takes it; grey where every tensor rank holds the whole tensor. The owners
# are computed: `unshard` joins pieces filled with their tensor rank's number, and `shard` cuts each new piece out
# of a tensor of entry numbers. Every new piece of `mlp.proj.weight` takes a part of both old files.

# %%
def owners_old(name, shapes, scheme):
    """(serial shape) the old tensor rank whose file holds each entry; -1 where the parameter is replicated."""
    if tp_shards.split_of(name, scheme)[0] == "rep":
        return np.full(shapes[0], -1)
    return tp_shards.unshard([np.full(s, t) for t, s in enumerate(shapes)], name, cfg, scheme)


def owners_new(shape, name, tp, scheme):
    """(serial shape) the new tensor rank that takes each entry; -1 where every rank takes the whole parameter."""
    if tp_shards.split_of(name, scheme)[0] == "rep":
        return np.full(shape, -1)
    number = np.arange(1, int(np.prod(shape)) + 1).reshape(shape)     # 0 is left for the vocabulary padding
    owner = np.full(shape, -1)
    for t in range(tp):
        mine = tp_shards.shard(number, name, t, tp, scheme)
        owner.flat[mine[mine > 0] - 1] = t
    return owner


if rank == 0:
    from matplotlib.colors import BoundaryNorm, ListedColormap
    palette = ListedColormap(["0.8", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"])   # replicated, tp 0, 1, 2, 3
    norm = BoundaryNorm(np.arange(-1.5, 4.5), palette.N)
    names = list(old_shapes)                                           # the four of the table
    fig, axes = pictures.figure(11, 5.2, nrows=2, ncols=len(names) + 1)   # the last column: the legend
    for j, name in enumerate(names):
        shape = cfg.param_shapes()[name]
        maps = (owners_old(name, old_shapes[name], old["tp_scheme"]), owners_new(shape, name, 4, "gather"))
        for i, (owner, what) in enumerate(zip(maps, (f"saved: {old['tp_scheme']}, tp {old['tp']}",
                                                     "loaded: gather, tp 4"))):
            a = axes[i, j]
            a.imshow(owner.reshape(1, -1) if owner.ndim == 1 else owner, cmap=palette, norm=norm, aspect="auto",
                     interpolation="nearest")
            a.set_title(f"{name} {shape}\n{what}", fontsize=7)
            a.tick_params(labelsize=6)
            a.set_xlabel("column" if owner.ndim == 2 else "entry", fontsize=6)
            if owner.ndim == 1:
                a.set_yticks([])
            else:
                a.set_ylabel("row", fontsize=6)
    for k, label in enumerate(["whole on every\ntensor rank", "tp_rank 0", "tp_rank 1", "tp_rank 2", "tp_rank 3"]):
        axes[0, -1].plot([], [], "s", color=palette(k), ms=9, label=label)
    axes[0, -1].legend(loc="center", fontsize=7, frameon=False, title="entry held by", title_fontsize=7)
    for a in axes[:, -1]:
        a.axis("off")
    say(f"picture: {pictures.save(fig, '19_resharding_map')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# Now the whole resume in two other layouts of the 8 ranks: dp 4 x pp 1 x tp 2 (every rank reads both old stages'
# files) and dp 1 x pp 2 x tp 4 with the All-Gather scheme. Each loads, checks that every shard is exactly the slice
# `tp_shards.shard` cuts from the step-4 model, and trains steps 5 and 6. The sums now run in another order, so the
# result equals the uninterrupted run to rounding, not bit for bit (error relative to each parameter's largest
# entry, floored at 0.02: the attention k-biases only receive rounding noise, chapter 6).

# %%
def resume_in(dp, pp, tp, scheme):
    """Every rank: load step 4 into the layout dp x pp x tp, train to STEPS. Returns (every shard exactly its slice
    of the step-4 model, largest parameter error against the uninterrupted run, largest loss error)."""
    g = ProcessGrid(world, dp=dp, pp=pp, tp=tp)
    t = HybridTrainer(cfg, g, config(dp=dp, pp=pp, tp=tp, tp_scheme=scheme))
    first = checkpoint.load(t, checkpoint.open_checkpoint(path4, cfg)) + 1
    slice_of = lambda full, n: tp_shards.shard(full[n], n, g.tp_rank, tp, scheme)   # my slice of a full model
    exact = all(np.array_equal(p, slice_of(full4, n)) for n, p in t.params.items())
    loss_err = 0.0
    for step in range(first, STEPS + 1):
        loss_err = max(loss_err, abs(t.step(*batch(step), step).loss - losses[step]) / losses[step])
    err = max(rel_err(p, slice_of(ref_full, n), floor=0.02) for n, p in t.params.items())
    t.free()
    g.free()
    return exact, err, loss_err


for dp, pp, tp, scheme in ((4, 1, 2, "megatron"), (1, 2, 4, "gather")):
    exact, err, loss_err = resume_in(dp, pp, tp, scheme)
    layout = f"{dp} x {pp} x {tp} {scheme}"
    check.holds(f"resharded to {layout}: shards exactly the step-4 slices", exact)
    check(f"resharded to {layout}: step 6 vs the uninterrupted run", err, 1e-9)
    check(f"resharded to {layout}: losses vs the uninterrupted run", loss_err, 1e-9)

# %% [markdown]
# The extreme case is one process: `checkpoint.export(path, out)` (`python -m hsgd.checkpoint export DIR out.npz`)
# writes the model under the serial names, for `hsgd.model.serial`, `hsgd.sample` or any other tool. Rank 0 exports
# step 6 and compares it with the uninterrupted run's gathered model and with serial SGD (`serial.sgd`: the same six
# steps, optimizer, schedule and clipping).

# %%
verdict = None
if rank == 0:
    _, exported = checkpoint.export(os.path.join(SAVE, "step-000006"), os.path.join(TMP, "final.npz"))
    with np.load(os.path.join(TMP, "final.npz"), allow_pickle=False) as f:
        on_disk = {k: f[k] for k in f.files}
    same = set(on_disk) == set(ref_full) and all(np.array_equal(on_disk[n], ref_full[n]) for n in ref_full)
    w, _ = serial.sgd(cfg, config(), batch)                            # STEPS steps of serial SGD
    verdict = (same, max(rel_err(on_disk[n], w[n], floor=0.02) for n in w))
    say(f"exported {len(on_disk)} parameters, {sum(a.size for a in on_disk.values()):,} numbers, serial names and "
        f"shapes: {', '.join(f'{n} {on_disk[n].shape}' for n in list(on_disk)[:3])}, ...")
same, serial_err = world.bcast(verdict, root=0)
check.holds("export of step 6 == the uninterrupted run's gathered model, bit for bit", same)
check("export of step 6 (the uninterrupted run) vs serial SGD", serial_err, 1e-9)

# %% [markdown]
# ## 5. Checking before loading
#
# A checkpoint is read long after it was written, by another job, perhaps from another file system.
# `open_checkpoint` checks, on every rank, before anything is loaded:
#
# * the manifest is JSON of hsgd's format and unchanged (it records the SHA-256 of its own contents);
# * it follows its schema (`hsgd.checkpoint.manifest.check`): a valid model, a layout that splits it, and exactly
#   that layout's shard names as files, so it can neither send a loader elsewhere nor switch checksums off;
# * its model is the one being built, else it says what differs;
# * every file has the manifest's SHA-256: a truncated, damaged or edited file is named.
#
# `load` refuses optimizer state of another kind and misshapen arrays. Loading never executes code (JSON, and
# `.npz` with `allow_pickle=False`). The verdict must be collective: if one rank refused and the others went on,
# they would wait forever in training's first collective. `launch.agree` does this in `hsgd.train`; `every_rank`
# below writes it out. The damage: one byte flipped in a copy of `shard-pp1-tp0.npz`.

# %%
def every_rank(fn):
    """Run fn() on every rank; return its result (None where it failed) and every rank's CheckpointError message
    (None where it passed): one small allgather, so that all ranks reach the same verdict."""
    try:
        result, error = fn(), None
    except CheckpointError as e:
        result, error = None, str(e)
    return result, world.allgather(error)


bad = os.path.join(TMP, "copy", "step-000004")
if rank == 0:
    shutil.copytree(path4, bad)                                        # never damage the real one
    with open(os.path.join(bad, "shard-pp1-tp0.npz"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))                               # one byte flipped
world.Barrier()
_, errors = every_rank(lambda: checkpoint.open_checkpoint(bad, cfg))
say(f"corrupted copy: {sum(e is not None for e in errors)} of {P} ranks refused it:\n  {errors[0]}")
check.holds("corrupted shard: refused by every rank", all(e is not None for e in errors))
check.holds("corrupted shard: every message names shard-pp1-tp0.npz as corrupt",
            all("shard-pp1-tp0.npz" in e and "is corrupt" in e for e in errors))

# %% [markdown]
# A checkpoint of another model (d_model 32 instead of 16), and one loaded by an AdamW run:

# %%
wider = ModelConfig(vocab_size=256, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=32)
_, errors = every_rank(lambda: checkpoint.open_checkpoint(path4, wider))
say(f"another model: {sum(e is not None for e in errors)} of {P} ranks refused it:\n  {errors[0]}")
check.holds("another model: refused by every rank, naming d_model",
            all(e is not None and "d_model 16 in the checkpoint vs 32 now" in e for e in errors))
adamw = HybridTrainer(cfg, grid, config(optimizer="adamw", lr=1e-3))
_, errors = every_rank(lambda: checkpoint.load(adamw, manifest4))
say(f"another optimizer: {sum(e is not None for e in errors)} of {P} ranks refused it:\n  {errors[0]}")
check.holds("another optimizer: refused by every rank, saying sgd",
            all(e is not None and "resume with --optimizer sgd" in e for e in errors))

# %% [markdown]
# From the command line the refusal ends the job through `launch.run` (section 6): a `CheckpointError` is a
# `UsageError`, so rank 0 prints one line, `hsgd: error: ...`, and every rank returns exit code 2, no traceback. The
# path of `mpirun -n 8 python -m hsgd.train --resume <the corrupted copy>`, called as a function:

# %%
caught = io.StringIO()
with contextlib.redirect_stderr(caught):
    code = launch.run(lambda: launch.agree(world, lambda: checkpoint.open_checkpoint(bad, cfg)), world)
say(f"launch.run: exit code {code}; rank 0's stderr: {caught.getvalue().strip()[:110]}...")
check.equal("every rank: launch.run's exit code for a corrupted checkpoint", code, 2)

# %% [markdown]
# Two more ways to hang without an error. A FIFO or device (`/dev/zero`) in place of an input file is never read to
# its end while the others wait; `hsgd.files.regular_file`, the gate every input file passes, refuses it. And "is
# there a checkpoint in --save-dir?" can get different answers on different nodes (a shared file system's cache), so
# `--resume auto` is decided on rank 0 and broadcast (`train.resume`; `tests/mpi/test_zero3.py` tests it).

# %%
fifo = os.path.join(TMP, "fifo", "step-000004")
if rank == 0:
    shutil.copytree(path4, fifo)
    os.remove(os.path.join(fifo, "shard-pp0-tp1.npz"))
    os.mkfifo(os.path.join(fifo, "shard-pp0-tp1.npz"))                  # a reader would wait for a writer forever
world.Barrier()
_, errors = every_rank(lambda: checkpoint.open_checkpoint(fifo, cfg))
say(f"a FIFO in place of a shard: {sum(e is not None for e in errors)} of {P} ranks refused it:\n  {errors[0]}")
check.holds("a FIFO in place of a shard: refused by every rank, saying what it is",
            all(e is not None and "is a FIFO" in e for e in errors))

# %% [markdown]
# ## 6. When a rank dies
#
# * **An exception on one rank** (a bug, a full disk). The danger is the others, waiting in their next collective
#   for a rank that never arrives while the job holds its allocation. `launch.run`, which wraps the MPI entry points
#   (`hsgd.train`, `hsgd.verify`, `hsgd.sample`), catches any exception that is not a usage error or a numerical
#   fault, prints its traceback prefixed with `[rank r]`, and calls `MPI_Abort`: every rank is killed within
#   seconds. (`--inject-fault 3:5` raises on rank 3 at step 5.)
# * **A rank killed outright** (SIGKILL from the out-of-memory killer, a node losing power): the launcher ends the
#   others (MPICH's Hydra prints "BAD TERMINATION") and exits non-zero. (`--inject-fault 5:4:kill`.)
# * **A rank asked to stop** (SIGTERM from a preempting scheduler, SIGINT). `hsgd.run.signals.StopRequest` only sets
#   a flag (a handler calling MPI could interrupt a collective halfway); after every step the ranks agree on the
#   flags with one Allreduce (MAX), since the signal may reach one rank only, then all checkpoint the step just
#   finished and exit with code 4.
# * **A rank that stops without dying** (a frozen node, SIGSTOP): nothing reports. `--step-timeout S` starts a
#   watchdog thread per rank (`hsgd.run.watchdog`) that calls `MPI_Abort` (exit code 5), naming the phase, when a
#   collective phase runs past its limit (section 8).
#
# What survives is the last complete checkpoint, and the cure is the same command with `--resume auto`, which finds
# the newest complete one, checks it, loads it (perhaps into another layout) and goes on. As `tests/test_faults.py`
# runs it (the final model must be bit-identical to an uninterrupted run's; model-size flags left out):
#
#     mpirun -n 4 python -m hsgd.train --dtype float64 --steps 6 --save-dir D --save-interval 3 --inject-fault 3:4:kill
#     mpirun -n 4 python -m hsgd.train --dtype float64 --steps 6 --save-dir D --resume auto
#
# The second command can run here: after a kill in step 5 the save directory holds step 4, and `hsgd.train.train`
# with `resume="auto"` continues from it:

# %%
killed = os.path.join(TMP, "killed")                                   # what the dead job left behind
if rank == 0:
    shutil.copytree(path4, os.path.join(killed, "step-000004"))
world.Barrier()
printed = io.StringIO()
summary = train(cfg, config(save_dir=killed, save_interval=2, resume="auto", log_interval=1), world, out=printed)
for line in printed.getvalue().splitlines():
    if line.startswith(("resumed", "step", "checkpoint")):
        say(f"  {line}")
check.holds("train(resume='auto'): shards bit-identical to the uninterrupted run",
            all(np.array_equal(summary["params"][n], ref[n]) for n in ref))
check.equal("train(resume='auto'): losses of steps 5, 6, bit for bit", summary["losses"], [losses[5], losses[6]])

# %% [markdown]
# ## 7. Numerical faults
#
# A NaN or infinity in one rank's gradient (too large a learning rate, a float16 overflow, a flipped bit) spreads
# through the DP All-Reduce and the next activations until the model, and every later checkpoint, is NaN. So
# `HybridTrainer.step` checks its loss and averaged gradient every step and the ranks exchange one flag each
# (`allgather`): all learn whether any rank went wrong, and which, and act alike, as `on_nan` (`--on-nan`) says:
#
# * `"skip"`: no rank updates; `trainer.scaler` counts it (`updates_skipped`) and the next batch follows. After
#   `max_skips` (`--max-skips`, 10) in a row the run stops, and no checkpoint is written after a skipped step, so
#   the finite ones are not rotated away (`checkpoint.save` refuses a non-finite state);
# * `"stop"` (the default): every rank raises `NumericalFault`, and `launch.run` prints `hsgd: stopped: ...` and
#   returns exit code 3, to restart from the last finite checkpoint with a smaller learning rate.
#
# The fault is injected as `--inject-fault 3:5:nan` does it (`hsgd.run.faults.Faults`, between `trainer.gradients`
# and `trainer.update`): one NaN in world rank 3's gradient after the DP average, so only rank 3 has it.

# %%
def poisoned_step(trainer, step):
    """trainer.step(*batch(step), step) with --inject-fault 3:{step}:nan: a NaN on world rank 3 after the exchange."""
    loss = trainer.gradients(*batch(step))
    Faults(f"3:{step}:nan", rank).after_gradients(trainer, step)
    return trainer.update(loss, step)


skipper = HybridTrainer(cfg, grid, config(on_nan="skip"))
checkpoint.load(skipper, manifest4)
before = {n: p.copy() for n, p in skipper.params.items()}
velocity_before = skipper.opt.moments("flat")["velocity"].copy()
info = poisoned_step(skipper, 5)
say(f"on_nan='skip', NaN on rank 3 at step 5: loss {info.loss:.4f}, lr {info.lr}, grad norm {info.grad_norm}, "
    f"skipped {skipper.scaler.updates_skipped} on every rank: {world.allgather(skipper.scaler.updates_skipped)}")
check.holds("on_nan='skip': shards and velocities unchanged by the skipped step",
            all(np.array_equal(skipper.params[n], p) for n, p in before.items())
            and np.array_equal(skipper.opt.moments("flat")["velocity"], velocity_before))
check.equal("on_nan='skip': trainer.scaler.updates_skipped", skipper.scaler.updates_skipped, 1)
info = skipper.step(*batch(6), 6)                                      # the run goes on with the next batch
moved = sum(not np.array_equal(skipper.params[n], p) for n, p in before.items())
say(f"step 6 after it: loss {info.loss:.4f}, lr {info.lr:.2e}, grad norm {info.grad_norm:.3f}; shards changed / "
    f"held on each rank: {' '.join(world.allgather(f'{moved}/{len(before)}'))} (tp_rank 1's wte holds the rows of "
    "bytes 128-255, which none of these batches contains: no gradient, no change)")
check.holds("on_nan='skip': a clean step after it moves shards, and skipped stays 1",
            moved > 0 and skipper.scaler.updates_skipped == 1)

# %% [markdown]
# With `on_nan="stop"` every rank raises `NumericalFault` in the same step, caught here, then once more through
# `launch.run` for the exit code:

# %%
stopper = HybridTrainer(cfg, grid, config(on_nan="stop"))
checkpoint.load(stopper, manifest4)
try:
    poisoned_step(stopper, 5)
    message = None
except NumericalFault as e:
    message = str(e)
messages = world.allgather(message)
say(f"on_nan='stop': {sum(m is not None for m in messages)} of {P} ranks raised NumericalFault:\n  {messages[0]}")
check.holds("on_nan='stop': every rank raised, naming rank 3",
            all(m is not None and "at step 5 on ranks [3]" in m for m in messages))
caught = io.StringIO()
with contextlib.redirect_stderr(caught):
    code = launch.run(lambda: poisoned_step(stopper, 5), world)
say(f"launch.run: exit code {code}; rank 0's stderr: {caught.getvalue().strip()[:60]}...")
check.equal("every rank: launch.run's exit code for a NaN with on_nan='stop'", code, 3)

# %% [markdown]
# The other silent fault: DP replicas that no longer agree. They receive the same averaged gradient and stay
# bit-identical (chapter 4); if they differ, a flipped bit or a bug broke them, and the checkpoint (the first
# replica's) would quietly drop the others' version. `replica_divergence` (hsgd.dp.average) compares a SHA-256 per
# parameter over `dp_comm` and names the first parameter (in the flat buffer's backward order) whose replicas
# differ, with the dp ranks of each version; `--check-replicas N` calls it every N steps
# (`hsgd.run.diverged.check_replicas`) and stops the run like a NaN. The smallest damage: one entry of
# `h.0.attn.q.weight` on world rank 5 (replica 1) moved by one ulp, `np.nextafter`.

# %%
name = "h.0.attn.q.weight"
shift = None
if rank == 5:
    original = trainer.params[name][0, 0]
    trainer.params[name][0, 0] = np.nextafter(original, np.inf)       # the next float64 up
    shift = (float(original), float(trainer.params[name][0, 0]))
shift = world.bcast(shift, root=5)
say(f"world rank 5: {name}[0, 0] = {shift[0]!r} -> {shift[1]!r}")
found = world.allgather(replica_divergence(trainer.exchange, grid.dp_comm))   # collective over each dp_comm
say("replica_divergence() on each rank: " + ", ".join(f"{r}: {d}" for r, d in enumerate(found)))
try:
    check_replicas(trainer, world, STEPS)
    message = None
except NumericalFault as e:
    message = str(e)
messages = world.allgather(message)
say(f"check_replicas: {sum(m is not None for m in messages)} of {P} ranks raised NumericalFault:\n  {messages[0]}")
check.equal("diverged replica: what each rank's dp group reports", found,
            [(name, [[0], [1]]) if r in (1, 5) else None for r in range(P)])
check.holds("diverged replica: every rank stopped, naming it",
            all(m is not None and f"the first parameter that differs is {name}" in m for m in messages))
if rank == 5:
    trainer.params[name][0, 0] = original                             # repaired: the replicas agree again
check.equal("repaired: what replica_divergence() reports on each rank",
            world.allgather(replica_divergence(trainer.exchange, grid.dp_comm)), [None] * P)

# %% [markdown]
# ## 8. No quiet failure
#
# **Every collective phase is watched.** A rank may stop anywhere, not only in a step. `hsgd.train` runs each phase
# in `Watchdog.phase(what, limit)`, watched by `--step-timeout S`: a step with its stop agreement (S), the
# `--resume` load and every save (10 S: a save writes and syncs all the state), every validation (S per batch), the
# `--dump-step` dump (S), the reports at the end (S + 60 s: plots take seconds), and the final sample (S per
# sampled byte). A phase that ends past its limit ends the job too, and a rank whose watchdog fired enters no
# further phase: exit code 5 however early (a `--step-timeout 0.001` run used to exit 0). `tests/test_watched.py`
# stops a rank (SIGSTOP) as each phase starts and each job ends with exit code 5 in seconds. Here, one phase watched
# without a fault:

# %%
S = 30.0                                                                # --step-timeout, far above this validation
seen = []
with Watchdog(S, world, entering=lambda kind, step: seen.append((kind, step))) as dog:
    with dog.phase(f"the validation after step {STEPS}", *per_batch(S, 1), kind="validation", step=STEPS):
        val = trainer.evaluate(corpus, 1, B)                           # collective over dp_comm
say(f"watched: the validation after step {STEPS} (limit {per_batch(S, 1)[0]:g} s): loss {val:.4f}; entering saw "
    f"{seen}; fired: {dog.fired}; exit code of a watchdog abort: {EXIT_TIMEOUT}; the reports' extra {REPORTS_S:g} s")
check.equal("a watched phase: entering(kind, step) called once, nothing fired", (seen, dog.fired),
            ([("validation", STEPS)], False))
check.equal("the numbers of the prose: exit code 5, reports S + 60 s, checkpoints 10 S",
            (EXIT_TIMEOUT, REPORTS_S, CHECKPOINT_TIMES), (5, 60.0, 10))

# %% [markdown]
# **A run whose updates keep being skipped stops.** A float16 run's loss scaler halves S and skips the update at
# every overflow (chapter 14). A diverged run overflows at every scale, and used to skip to its end and exit 0,
# saving nothing (after about 1090 steps S underflowed to 0 and the progress line crashed on log2(0)). Now S below
# its floor (`MIN_SCALE`, 1: DeepSpeed's `min_loss_scale`) ends the run; once an update was applied, skips count
# toward `--max-skips` (before it, S finds its level from 2^16, at most 17 halvings); and a run that applied no
# update never exits 0. Each is `Skipping`, a `NumericalFault` (exit code 3) raised on every rank at once; then
# `hsgd.train` checkpoints the last applied update's state with the scaler rewound to it (`rewind`). A scaler fed
# an overflow at every step:

# %%
def overflow_until_stopped(scaler, first=1):
    """Steps with an inf on every rank from step `first` until the scaler stops the run: (the step it stopped at,
    its message)."""
    for step in range(first, 100):
        try:
            scaler.after_step(grid.world, step, bad=True)              # collective: the ranks' verdicts agreed
        except Skipping as e:
            return step, str(e)


floor_step, floor_message = overflow_until_stopped(LossScaler())        # no update applied yet: the floor decides
after_one = LossScaler()
after_one.after_step(grid.world, 1, bad=False)                         # step 1 applied: from here skips count
skips_step, skips_message = overflow_until_stopped(after_one, first=2)
say(f"2^16 halved at every step from the start: stopped at step {floor_step}:\n  {floor_message}\n"
    f"step 1 applied, then an overflow at every step (--max-skips {config().max_skips}): stopped at step "
    f"{skips_step}:\n  {skips_message}")
check.equal("S = 2^16 x 0.5^17 = 0.5 < MIN_SCALE 1: stopped at step 17", (floor_step, MIN_SCALE), (17, 1.0))
check.equal("--max-skips 10 (the default) in a row after step 1: stopped at step 11", (skips_step,
            config().max_skips), (11, 10))
rewound = LossScaler()
rewound.after_step(grid.world, 1, bad=False)                           # one applied update: S = 2^16 then
for step in (2, 3, 4):
    rewound.after_step(grid.world, step, bad=True)                     # three overflows: S = 2^13
halved = rewound.scale
rewound.rewind()
say(f"after an applied step and 3 overflows S = 2^{np.log2(halved):g}; rewound to the last finite state: "
    f"S = 2^{np.log2(rewound.scale):g}, last applied update at step {rewound.last_applied}")
check.equal("rewind: the scaler's state of the last applied update", (halved, rewound.scale, rewound.last_applied),
            (2.0 ** 13, 2.0 ** 16, 1))

# %% [markdown]
# And a run too short to reach `--max-skips` whose every update was skipped: one step with a NaN on rank 3
# (`--inject-fault 3:1:nan --on-nan skip`), through `launch.run`. It used to exit 0 with "1 update(s) skipped".

# %%
caught = io.StringIO()
with contextlib.redirect_stderr(caught):
    code = launch.run(lambda: train(cfg, config(steps=1, on_nan="skip", inject_fault="3:1:nan"), world,
                                    out=io.StringIO()), world)
say(f"launch.run: exit code {code}; rank 0's stderr: {caught.getvalue().strip()}")
check.equal("a run that applied none of its updates: exit code 3", code, 3)

# %% [markdown]
# **A killed job's zombies do not hold the folder.** While a run trains, rank 0 holds `save_dir/.hsgd-lock` (host
# and pid), and a second job is refused unless the holder no longer runs. Right after `kill -9` of mpirun its ranks
# are zombies for a moment (exited, not yet collected), so `kill(pid, 0)` still found them and a requeue was
# refused for about a second. `hsgd.checkpoint.runs.alive` reads the state in `/proc/PID/stat` ('Z': not running;
# without `/proc` the holder gets `ZOMBIE_WAIT_S` = 2 s to go). Rank 0 makes one: a child that exits, not collected:

# %%
taken = None
if rank == 0:
    child = os.fork()
    if child == 0:
        os._exit(0)                                                     # exits at once; nobody collects it yet
    for _ in range(200):
        if proc_state(child) in ("Z", None):
            break
        time.sleep(0.01)
    folder = os.path.join(TMP, "requeued")
    os.makedirs(folder)
    with open(os.path.join(folder, ".hsgd-lock"), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": child}, f)     # the killed job's lock
    lock = FolderLock(folder)
    lock.acquire()                                                      # refused before: the zombie counted as alive
    taken = (proc_state(child), lock.held)
    lock.release()
    os.waitpid(child, 0)
taken = world.bcast(taken, root=0)
say(f"a lock held by a zombie (state {taken[0]!r}): taken over: {taken[1]}; without /proc the wait is "
    f"{ZOMBIE_WAIT_S:g} s")
check.equal("the zombie's lock taken over at once; the wait without /proc 2 s", (taken[1], ZOMBIE_WAIT_S), (True, 2.0))

# %% [markdown]
# ## Check against serial
#
# On dp 2 x pp 2 x tp 2, every verdict collective: the checkpoint's files equal every replica's state and their
# checksums; a half-written save is ignored; a same-layout resume is bit-identical to the uninterrupted run, a
# resharded one equal to rounding, the export equal to serial SGD; damaged or foreign checkpoints are refused by
# every rank; NaNs, diverged replicas, overflowing scalers and zombie locks are handled as described.

# %%
for t in (resumed, amnesiac, adamw, skipper, stopper, trainer):
    t.free()
grid.free()
worst, err = check.worst([w for w in check.errors if " vs " in w])
say(f"\nchapter 19: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against the "
    f"uninterrupted run and serial {err:.1e} ({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `checkpoint.save`: one `shard-pp{s}-tp{t}.npz` per (stage, tensor rank), written by the rank of dp_rank 0; `manifest.json` (layout, step, seed, checksums) by rank 0 | `dist_checkpointing.save(sharded_state_dict, checkpoint_dir)` (megatron/core/dist_checkpointing/serialization.py): every tensor a `ShardedTensor` (mapping.py) with its global shape and offset, and `replica_id` choosing the one replica that writes; `--ckpt-format torch_dist` | `engine.save_checkpoint(save_dir, tag)` (deepspeed/runtime/engine.py): `mp_rank_XX_model_states.pt` per model-parallel rank, and with ZeRO one `..._optim_states.pt` per data-parallel rank | `torch.distributed.checkpoint.save(state_dict, storage_writer=FileSystemWriter(path))` (state_dict_saver.py, filesystem.py): `.distcp` files and one pickled `.metadata`; replicated tensors written once (`dedup_save_plans`) | NumPy `.npz` and JSON: any tool reads them, and loading executes no code (a pickle could) |
# | the atomic moment: a hidden directory renamed to `step-NNNNNN` once every file and the manifest are on disk; `complete_checkpoints` lists only directories with a manifest | the tracker file `latest_checkpointed_iteration.txt` (`get_checkpoint_tracker_filename`, megatron/training/checkpointing.py), written after the save of `iter_NNNNNNN/`; a dist checkpoint's `metadata.json` written last | the `latest` file, the tag of the newest checkpoint, written by rank 0 after the save (`save_latest=True`) | `FileSystemWriter.finish`: `.metadata.tmp` written, then renamed to `.metadata` | the whole directory appears at once, so a reader never meets half a checkpoint, pointer file or not |
# | `open_checkpoint`: the manifest's own SHA-256, its schema, the model, and every file's SHA-256, before anything is loaded, on every rank | `save(..., verify_integrity=True)` writes `integrity.json` with every file's SHA-256, `load(..., verify_integrity=True)` checks it (`save_integrity_manifest`, `verify_integrity_manifest`, megatron/core/dist_checkpointing/validation.py); off by default | none: no checksums (`"checkpoint": {"tag_validation": ...}` checks only that every rank saves under the same tag) | none: `.metadata` records where each chunk is, not a checksum | always on: a checkpoint is read long after it was written, and the hashing costs one read of files that are read anyway |
# | `checkpoint.load`: any dp, pp, tp and scheme; each rank joins the full tensor (`Shards.full`, `tp_shards.unshard`) and cuts its piece (`tp_shards.shard`) | `dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`: the new layout's `ShardedTensor`s say which slices of each global tensor to read | universal checkpointing: `ds_to_universal.py` (deepspeed/checkpoint/) rewrites a checkpoint as one set of files per parameter, loaded into another layout with `"checkpoint": {"load_universal": true}` | `torch.distributed.checkpoint.load(state_dict, storage_reader=FileSystemReader(path))`: reads, for each `DTensor` of the new layout, the saved chunks that overlap it | every rank reads whole files and holds a full tensor for a moment: simple, and the memory of one parameter at a time |
# | `checkpoint.export` (`python -m hsgd.checkpoint export DIR out.npz`): the model under the serial names | tools/checkpoint/convert.py (loaders and savers between formats and layouts) | `zero_to_fp32.py` (deepspeed/utils/): the full fp32 model from the ZeRO shards | `dcp_to_torch_save` (torch/distributed/checkpoint/format_utils.py) | - |
# | a rank dies: `launch.run` calls `MPI_Abort`, the job ends; `--step-timeout` (a watchdog); the same command again with `--resume auto` | `megatron/training/ft_integration.py` (NVIDIA's resiliency extension: per-section timeouts, `ft_launcher`) and `--inprocess-restart` (megatron/training/inprocess_restart.py) | `DSElasticAgent` (deepspeed/elasticity/elastic_agent.py), on PyTorch's elastic agent | `torchrun --max-restarts N` (torch/distributed/run.py): the agent restarts every worker of the group, and the script loads its newest checkpoint itself | an MPI job does not outlive one of its ranks; the restart is a new `mpirun`, and the only state that crosses it is on disk |
#
# The ideas are the same everywhere: each rank writes what only it holds and one replica of what several hold, an
# index says where every slice lies, and a last small write makes the checkpoint visible. hsgd's index is the layout
# itself; Megatron-LM and PyTorch record every chunk's offset, which also covers layouts no formula describes
# (ZeRO-3's flat chunks).
#
# ## Exercises
#
# ### Exercise 1: how often to save
# A checkpoint costs C seconds, failures come at rate 1/M (exponential; M, the job's mean time between failures,
# is the node's divided by the nodes: 1000 nodes of 5 years make M = 43.8 hours), and a restart costs R. Saving
# after every tau seconds of work, the expected wall time per second of work is (Daly 2006)
# $T(\tau) = M e^{R/M} (e^{(\tau + C)/M} - 1)/\tau$. Young (1974, "A first order approximation to the optimum
# checkpoint interval") found the optimum $\tau \approx \sqrt{2CM}$; Daly (2006, "A higher order estimate of the
# optimum checkpoint interval for restart dumps") corrected it to
# $\sqrt{2CM}\,[1 + \tfrac13\sqrt{C/2M} + \tfrac19 (C/2M)] - C$ (for C < 2M). Find the true optimum by bisection
# on $dT/d\tau = 0$ for C = 300 s and C = 0.05 M (R = 600 s) and compare both formulas with it. Then simulate
# 200,000 segments with exponential failure times: the mean wall time of a segment must agree with the formula
# within 4 standard errors at the optimum, a third of it and three times it, and the waste be least at the optimum.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_1`)
#
# ### Exercise 2: reshard one parameter by hand
# Save a checkpoint on 4 ranks as dp 1 x pp 2 x tp 2 (Megatron's scheme) with V = 250; then, on each rank of
# dp 1 x pp 1 x tp 4 with the All-Gather scheme, build its piece of `h.0.mlp.proj.weight` (rows in the old layout,
# columns in the new) and of `wte` (vocabulary rows padded to a multiple of tp: 2 x 125 before, 4 x 63 after), and
# their velocities, with `json`, `np.load`, `np.concatenate` and slicing only. Check them bit for bit against what
# `checkpoint.load` puts into a `HybridTrainer` of that layout.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_2`)
#
# ### Exercise 3: find the corrupted shard
# Write `verify(path)` that recomputes with `hashlib` alone the manifest's digest (SHA-256 of its JSON without
# "digest", keys sorted) and every file's SHA-256, and returns (digest correct, the files that differ). Check it on
# the intact checkpoint, on a copy with one bit flipped in `shard-pp1-tp0.npz` and on a copy whose manifest was
# edited to start from step 1; and that `open_checkpoint` refuses exactly the two damaged copies.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_3`)
#
# ### Exercise 4: the size of a checkpoint
# Predict from the model's shape and the layout the bytes of arrays in each `shard-pp{s}-tp{t}.npz` (the stage's
# parameters and SGD velocities: a replicated one whole, a split one 1/tp of its split axis, the vocabulary
# ceil(V/tp) rows), and check them against the files. How much more than the serial model and its velocity does the
# checkpoint hold, and why? Check your formula for the difference.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_4`)
