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
# The lecture lists fault tolerance among the challenges of hybrid parallel SGD. Its section 4.3 (in translation):
#
# > Hybrid-parallel training jobs are large, with many nodes and long running times, so the probability that a node
# > fails grows. A checkpoint mechanism is needed that periodically saves the model state (parameters, optimizer
# > state) to persistent storage. Because the parameters are spread over different nodes, saving and restoring a
# > checkpoint is itself a distributed operation.
#
# The arithmetic behind the first sentence: if one node fails on average once in a few years, a job on a thousand
# nodes loses one about every day. So a long run is a sequence of segments, each ending in a crash or at its time
# limit and each starting from the last checkpoint. This chapter follows `hsgd.checkpoint.store` and the fault handling
# of `hsgd.step.trainer`, `hsgd.train` and `hsgd.grid.launch` on 8 ranks, a dp 2 x pp 2 x tp 2 grid (chapter 10):
#
# 1. what a checkpoint of a sharded model is: one file per (stage, tensor rank), a manifest with checksums;
# 2. atomic writes: a job killed while saving leaves the previous checkpoint as it was; the newest K are kept;
# 3. exact resume: a run continued from a checkpoint in the same layout ends bit-identical to the uninterrupted one;
# 4. resharding: the same checkpoint continued in other layouts, and exported under the serial names;
# 5. checking before loading: a corrupted shard, a different model, a different optimizer;
# 6. when a rank dies: an exception, a SIGKILL, and `--resume auto`;
# 7. numerical faults: a NaN on one rank, and DP replicas that no longer agree;
# 8. no quiet failure: every collective phase watched, a run whose updates keep being skipped stopped, a killed
#    job's zombie ranks not holding the save folder.
#
# Run it with eight ranks, which share the machine's cores: about 6 s on a quiet 2-core machine (two to four times
# that when other jobs share the cores). On failure every rank raises, so it exits non-zero without hanging:
#
# mpirun -n 8 python tutorials/19_fault_tolerance.py
#
# The notebook form (`jupytext --to ipynb tutorials/19_fault_tolerance.py`) is for reading: the code needs eight
# MPI ranks. Only rank 0 prints. Everything the chapter writes goes into a temporary directory, removed at the end.
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
TMP = world.bcast(tempfile.mkdtemp(prefix="hsgd-ch11-") if rank == 0 else None, root=0)   # one directory for all
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
# blocks (pp), and of each of their weight matrices the columns or rows of its tensor rank (tp). What is there to
# save is the union of the pieces, and the DP replicas hold identical copies of them (chapter 4: the same averaged
# gradient, the same update). So `checkpoint.save(trainer, step, save_dir, keep)`, called by every rank:
#
# * **one file per (stage s, tensor rank t)**, `shard-pp{s}-tp{t}.npz`, written by the rank of that position in the
#   first replica (dp_rank 0): its parameter shards (`param/<name>`) and its optimizer state (`opt/<name>/velocity`
#   for SGD with momentum, `m` and `v` for AdamW). The other dp - 1 replicas write nothing; pp x tp files in all,
#   written in parallel, each rank's I/O proportional to its share of the model;
# * **`manifest.json`**, written by rank 0 once every file is on disk: the model's shape, the layout it was saved
#   in (dp, pp, tp, the tensor-parallel scheme, the blocks per stage), the step, the data position and the seed,
#   the optimizer (and AdamW's step count), the dtype, and the size and SHA-256 of every file.
#
# The data position needs no more than a number: hsgd's batches are a pure function of (seed, step), and the
# initialization of the seed, so the manifest's `next_step` and `seed` are the whole random state of the run. (A
# framework with a shuffling data loader or dropout must also save the generators' states, per rank.)
#
# The run: three steps on the 2 x 2 x 2 grid, then the checkpoint after step 3. This trainer goes on to step 6
# in section 2 and is "the uninterrupted run" that every resumed run is compared with.

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
# The manifest, and the first entries of one shard file (a NumPy `.npz`: a zip of `.npy` arrays). Every rank can
# check that the file of its position holds exactly its own parameter shards and velocities, bit for bit, whether
# it wrote the file (dp_rank 0) or only holds a replica of it (dp_rank 1), and that the file's SHA-256 is the one
# in the manifest:

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
# The picture: on the left, what each file of this checkpoint holds, read back from the four files: for every layer
# (a weight and its bias together) the number of parameter elements in each file, shaded by the share of the full
# layer it is (the velocities double every number). Stage 0's files hold the embeddings and block 0, stage 1's
# block 1, the final LayerNorm and the LM head. A split layer is halved between the two tensor ranks; a replicated
# one (the LayerNorms, `wpe`, the row-parallel layers' biases in Megatron's scheme) is written whole by both, and
# `unshard` reads the copy of tensor rank 0. On the right, the bytes each world rank wrote, from the manifest: the
# four ranks of replica 0 one file each, rank 0 the manifest too, replica 1 nothing.

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
# A job can die at any moment, also while it writes a checkpoint: then the newest checkpoint on disk is half
# written, and the previous one must still be there and usable. `save` orders its work so that this holds:
#
# 1. rank 0 removes the leftovers of an interrupted save (`.tmp-*`), creates a hidden directory
#    `.tmp-step-000004-<pid>` and broadcasts its name;
# 2. the pp x tp writers write their shard files into it, `fsync` them, and send (name, SHA-256, size) to rank 0
#    (`gather`);
# 3. rank 0 writes the manifest into it, `fsync`s the manifest and the directory,
# 4. and **renames** the directory to `step-000004`: the atomic moment. A `rename` inside one file system is atomic
#    (POSIX): a reader sees either no `step-000004` or the complete one, never a part;
# 5. rank 0 removes the oldest checkpoints beyond `keep` (`--keep`, 3 by default) and broadcasts the path.
#
# A kill before step 4 leaves a `.tmp-*` directory with some shard files, perhaps cut off, and no manifest, next to
# the untouched `step-000003` (`--inject-fault 3:4:kill-in-save` does exactly this; `tests/test_faults.py` checks
# it). `complete_checkpoints(save_dir)` (hsgd.checkpoint.runs) lists only `step-*` directories that hold a manifest, so
# `--resume auto` and `resolve` never see the half-written one. Instead of killing a rank of this job, here is that
# state made by hand: a temporary directory of step 4 with half of one shard file in it.

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
# The uninterrupted run goes on to step 6, saving every second step and keeping two, as `--save-interval 2
# --keep 2` would. The save after step 4 removes the leftover of the "interrupted" one, the save after step 6 the
# oldest checkpoint, step 3. Before step 5 the run also keeps its full model of step 4 (a pickled allgather,
# `trainer.full_params()`, for checks only), and at the end its full model of step 6: the reference of everything
# below.

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
# Rotation by step number alone would be dangerous in a folder that more than one run writes into: a fresh run
# next to an older run's step 1000 would see its own step 10 as the oldest and delete it at once. So each
# checkpoint also records its run's *line* (`manifest["run"]`, `hsgd.checkpoint.runs`): a run and the resumptions that
# continue from its newest checkpoint share a line, a fresh run or a resume from an older checkpoint starts a new
# one, `keep` counts only the writing run's own line, and `--resume auto` (`checkpoint.resolve`) follows the line
# written last. From the command line a fresh run into a folder that holds checkpoints is refused unless
# `--overwrite`, and a lock file held by rank 0 keeps a second job out of the folder. (Saved from Python, as here,
# the checkpoints share the line "default".)

# %% [markdown]
# ## 3. Exact resume in the same layout
#
# Restoring is the mirror image of saving. Every rank, in a new job: `open_checkpoint(path, cfg)` reads the
# manifest and checks the checkpoint (section 5), then `checkpoint.load(trainer, manifest)` sets the rank's shards
# and optimizer state and returns the step the checkpoint was written after; training goes on at the next step,
# whose batch and learning rate are functions of the step. Here a fresh `HybridTrainer` on the same grid stands
# for the restarted job (it starts from the seed's initialization, which `load` overwrites).
#
# In the same layout every rank then performs the same floating-point operations on the same numbers in the same
# order as the uninterrupted run did, so the result is **bit-identical**, not merely close: `np.array_equal` on
# every shard and every velocity.

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
# Why the optimizer state belongs in the checkpoint (the lecture names it): with momentum, the update of step 5
# is $w \leftarrow w - \eta_5 v_5$ with $v_5 = \mu v_4 + g_5$, and $v_4$ carries every earlier gradient. A
# checkpoint of the parameters alone restarts with $v_4 = 0$: the run goes on, but on another trajectory. The same
# resume, with the velocities dropped after loading:

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
# A restarted job often has another shape: fewer nodes after a failure, more when they come back, or another
# trade-off between the dimensions (chapter 10's table). The checkpoint is not tied to the layout it was written in,
# because every piece is a known slice of a full tensor of the serial model. `checkpoint.load` reshards in two steps,
# for each parameter the rank needs in its new stage:
#
# 1. `Shards(manifest).full(name)`: find the old stage that held the parameter (the manifest's blocks per stage),
#    read its piece from the files of all old tensor ranks, `shard-pp{s}-tp0.npz ... shard-pp{s}-tp{tp-1}.npz`,
#    and join them with `tp_shards.unshard(pieces, name, cfg, old_scheme)`: concatenate along the split axis and drop
#    the vocabulary padding;
# 2. `tp_shards.shard(full, name, new_tp_rank, new_tp, new_scheme)`: cut the rank's own piece for the new layout.
#
# The same for the optimizer state, which has the parameters' shapes. Each rank reads whole files and holds full
# tensors for a moment: simple, and fine for the model sizes of this project (a large model would read only the
# byte ranges it needs). Here is what world rank 0 of the layout dp 1 x pp 2 x tp 4, with the lecture's
# All-Gather scheme (chapters 5 and 6), does for four of its parameters, written out by hand. `mlp.proj.weight`
# changes its split axis: rows in Megatron's scheme, columns in the All-Gather scheme; `attn.proj.bias` is
# replicated in Megatron's scheme (each tensor rank adds it after the All-Reduce) and split in the other.

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
# The same four parameters as a picture, every entry of the full tensor coloured by its owner: on top the old
# tensor rank whose file holds it (the saved layout), below the new tensor rank that takes it (dp 1 x pp 2 x tp 4,
# All-Gather scheme); grey where every tensor rank holds the whole tensor. The owners are computed, not drawn by
# hand: `unshard` joins pieces filled with their tensor rank's number, and `shard` cuts each new rank's piece out of
# a tensor of entry numbers. `wte` is split by vocabulary rows in both layouts; `mlp.proj.weight` is split by rows
# in the saved layout and by columns in the new one, so every new piece takes a part of both old files; and the
# replicated `attn.proj.bias` is read from tensor rank 0's file and cut into four.

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
# Now the whole resume, in two other layouts of the same 8 ranks: dp 4 x pp 1 x tp 2 (no pipeline: every rank
# reads the files of both old stages) and dp 1 x pp 2 x tp 4 with the All-Gather scheme. Each builds its grid,
# loads, checks that each of its shards is exactly the slice `tp_shards.shard` cuts from the step-4 model, and trains
# steps 5 and 6. In another layout the sums run in another order (other micro-batches per replica, other partial
# sums per tensor rank), so the result equals the uninterrupted run to rounding, not bit for bit. The error is
# relative to each parameter's largest entry, but at least to 0.02 (the attention k-biases only ever receive
# rounding noise, chapter 6).

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
# The extreme case of resharding is one process: `checkpoint.export(path, out)` (also `python -m hsgd.checkpoint
# export DIR out.npz`) joins every parameter into its full tensor and writes the model under the serial names,
# for `hsgd.model.serial`, `hsgd.sample` or any other tool. Rank 0 exports the checkpoint of step 6 and compares it with
# the uninterrupted run's gathered model, and, as every chapter ends, with serial SGD on one process: the same six
# steps, the whole batch, the same optimizer, schedule and clipping (the serial norm), `serial.sgd`.

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
# A checkpoint is read long after it was written, by another job, perhaps from another file system. `open_checkpoint`
# checks it before anything is loaded, on every rank:
#
# * the manifest exists, is JSON and of hsgd's format (a directory without one is not a checkpoint), and has not
#   been changed since it was written: it records the SHA-256 of its own contents (`hsgd.checkpoint.manifest.digest`);
# * it follows its schema (`hsgd.checkpoint.manifest.check`): every key of its type, a valid model, a layout that splits
#   it, and as files exactly that layout's shard names, so that it cannot send a loader anywhere else or switch the
#   checksums off with an empty list;
# * the model in the manifest is the one being built, else it says what differs;
# * every file the manifest names exists and has the manifest's SHA-256: a file truncated by a full disk, damaged
#   in a copy or changed by hand is caught, and the message names it.
#
# And `load` refuses optimizer state of another kind, and any array that cannot be read or has the wrong shape.
# Loading never executes code (JSON, and `.npz` with `allow_pickle=False`: a pickle could run anything), so a
# checkpoint from elsewhere is safe to open.
#
# The verdict must be collective: if one rank refused and the others went on, they would wait forever in the first
# collective of training. So every rank checks, the verdicts are exchanged, and all raise or all go on together;
# `launch.agree` does this in `hsgd.train`, and the function below writes it out. The damage: one byte flipped in
# the middle of a copy of the checkpoint's `shard-pp1-tp0.npz`.

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
# A checkpoint of another model (here d_model 32 instead of 16), and the checkpoint loaded by a run with AdamW
# instead of SGD (its state would be velocities where moments are expected):

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
# From the command line the same refusal ends the job through `launch.run` (section 6): a `CheckpointError` is a
# `UsageError`, which every rank reaches together after `launch.agree`, so rank 0 prints one line, `hsgd: error:
# ...`, and every rank returns exit code 2, with no traceback. The same path as `mpirun -n 8 python -m hsgd.train
# --resume <the corrupted copy>`, called here as a function (rank 0's stderr caught and shown):

# %%
caught = io.StringIO()
with contextlib.redirect_stderr(caught):
    code = launch.run(lambda: launch.agree(world, lambda: checkpoint.open_checkpoint(bad, cfg)), world)
say(f"launch.run: exit code {code}; rank 0's stderr: {caught.getvalue().strip()[:110]}...")
check.equal("every rank: launch.run's exit code for a corrupted checkpoint", code, 2)

# %% [markdown]
# Two more ways a job waits forever without any error. A path that is not a regular file: a FIFO or a device such
# as `/dev/zero` in place of a shard (or of the manifest, the data file, the TOML config) is never read to its end,
# so the rank hashing it blocks and the others wait for it in the next collective. `hsgd.files.regular_file`
# is the one gate every input file passes, and refuses such a path with what it is. And a question each rank
# answers for itself: "is there a checkpoint in --save-dir?" can get different answers on different nodes of a
# cluster (a shared file system's cache right after a restart), and then some ranks go into the checkpoint's
# collectives while the others start training. `--resume auto` is therefore decided once, on rank 0, and
# broadcast (`train.resume`); `tests/mpi/test_zero3.py` (its checkpoint tests) gives rank 0 and the others
# different folders.

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
# Two ways a rank can stop in the middle of a run, and what `hsgd` does about each:
#
# * **An exception on one rank** (a bug, a full disk, an out-of-memory error in Python). The danger is not the
#   exception but the others: they are already inside their next collective, waiting for a rank that will never
#   arrive, and an MPI job that hangs holds its whole allocation until the wall-clock limit. `launch.run`, which
#   wraps the MPI entry points (`hsgd.train`, `hsgd.verify`, `hsgd.sample`), catches any exception that is not a
#   usage error or a numerical fault, prints its traceback prefixed with `[rank r]`, and calls `MPI_Abort` on
#   `COMM_WORLD`: the MPI runtime then kills every rank of the job within seconds, and `mpirun` exits non-zero.
#   (`--inject-fault 3:5` raises on rank 3 at step 5.)
# * **A rank killed outright**: SIGKILL from the out-of-memory killer, a node that loses power. No Python runs,
#   nothing can be caught. The MPI launcher notices that one of its processes died and ends the others (MPICH's
#   Hydra prints "BAD TERMINATION"), and the job exits non-zero. (`--inject-fault 5:4:kill` sends SIGKILL to rank 5
#   at step 4.)
# * **A rank asked to stop**: SIGTERM from a scheduler that preempts the job, SIGINT from Ctrl-C. These can be
#   caught, and losing the work since the last checkpoint would be a waste. `hsgd.run.signals.StopRequest` only sets a
#   flag in its handler (a handler that called MPI could interrupt a collective halfway); after every step the
#   ranks agree on the flags with one Allreduce (MAX), since the signal may reach one rank, or reach them at
#   different moments. Then every rank takes the same branch: a checkpoint of the step just finished (with
#   `--save-dir`), and exit code 4 with `hsgd: stopped: SIGTERM after step N; checkpoint ...`.
# * **A rank that stops without dying**: a frozen node, a stuck file system, SIGSTOP. Nothing fails, so nothing
#   reports: the others wait in the next collective until the job's time runs out. `--step-timeout S` starts a
#   watchdog thread on every rank (`hsgd.run.watchdog`) that ends the job with `MPI_Abort` (exit code 5) and one
#   line naming the phase when a collective phase runs past its limit: not only the steps but every place where the
#   ranks wait for each other (section 8 lists them).
#
# Either way the job is over, and what survives is on disk: the last complete checkpoint. The cure is the same
# command again with `--resume auto`, which finds the newest complete checkpoint in `--save-dir`
# (`complete_checkpoints`, section 2), checks it, loads it, possibly into another layout, and continues at the next
# step. The pair of commands, as `tests/test_faults.py` runs them (a rank killed at step 4 after a checkpoint at
# step 3, then the resume; the test checks that the final model is bit-identical to an uninterrupted run's):
#
#     mpirun -n 4 python -m hsgd.train --dtype float64 --steps 6 --save-dir D --save-interval 3 --inject-fault 3:4:kill
#     mpirun -n 4 python -m hsgd.train --dtype float64 --steps 6 --save-dir D --resume auto
#
# (the test's model-size flags left out). The other tests there kill a rank while a checkpoint is written, resume
# on other layouts and world sizes, and damage files.
#
# This chapter does not kill one of its own ranks: that would end it. The second command, though, can run here.
# After a kill in step 5 of a run saving every second step, its save directory holds the checkpoint of step 4;
# `hsgd.train.train`, the function behind `python -m hsgd.train`, with `resume="auto"` continues from it (its
# printed output caught, a few lines shown):

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
# Not every fault kills a process. A NaN or an infinity in one rank's gradient (a learning rate too large, an
# overflow in float16, a flipped bit) spreads: the DP All-Reduce carries it to the replicas, the next step's
# activations to every rank, and a few steps later the whole model is NaN, and so is every checkpoint written after.
# `HybridTrainer.step` therefore looks at its loss and its gradient after the DP average, every step, and the ranks
# exchange one flag each (`allgather`): every rank learns whether *any* rank went wrong, and which. Then all of them
# do the same thing, as chosen by `on_nan` (`--on-nan`):
#
# * `"skip"`: no rank updates; the parameters and the optimizer state stay as they were, `trainer.scaler` counts it
#   (`updates_skipped`; a run without loss scaling keeps the same books with S = 1), and the next step goes on with the
#   next batch. A run whose every step is non-finite has diverged for good: after `max_skips` (`--max-skips`, 10)
#   skipped steps in a row it stops as below, and no checkpoint is written after a skipped step, so that the older,
#   finite ones are not rotated away (`checkpoint.save` itself refuses a state that is not finite, on every rank);
# * `"stop"` (the default): every rank raises `NumericalFault`; `launch.run` turns it into one line from rank 0,
#   `hsgd: stopped: ...`, and exit code 3 on every rank, so the job can be restarted from its last (finite)
#   checkpoint with a smaller learning rate.
#
# The fault is injected as `--inject-fault 3:5:nan` does it, with `hsgd.run.faults.Faults` between the two halves of a
# step (`trainer.gradients`, then `trainer.update`): one NaN in world rank 3's gradient, after the DP average (so
# only rank 3 has it; a real one would already have reached its replica through the All-Reduce).

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
# With `on_nan="stop"` every rank raises `NumericalFault` in the same step: caught here on every rank, and then once
# more through `launch.run`, which gives the exit code of `python -m hsgd.train`:

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
# The other silent fault: DP replicas that no longer agree. The replicas of a shard receive the same averaged gradient
# and apply the same update, so they stay bit-identical (chapter 4); if they differ, something broke that no exception
# reports, a bit flipped in memory or a bug, and the checkpoint (written by the first replica only) would quietly drop
# the others' version. `replica_divergence` (hsgd.dp.average) compares a SHA-256 per parameter over `dp_comm` and names
# the first parameter (in the backward order of the flat buffer) whose replicas differ, with the dp ranks holding each
# version; `--check-replicas N` calls it every N steps through `hsgd.run.diverged.check_replicas`, which stops the run
# like a NaN.
# The smallest possible damage: one entry of `h.0.attn.q.weight` on world rank 5 (replica 1, stage 0, tp_rank 1) moved
# by one unit in the last place, `np.nextafter`.

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
# A fault that ends the job is reported; the dangerous ones are those that do not. Three of them, and the rule for
# each.
#
# **Every collective phase is watched.** A rank may stop anywhere, not only inside a step: while a checkpoint is
# written, in a validation, while rank 0 samples at the end. `hsgd.train` runs each such phase inside
# `Watchdog.phase(what, limit)`, a context manager that `--step-timeout S` watches: a step with its stop
# agreement (S), the checkpoint load of `--resume` (10 S), every checkpoint save (10 S: a save writes and syncs all
# the state, slower than a step on a shared file system), every validation (S per batch:
# the one before the first step, those of `--eval-interval`, the one after the last), the `--dump-step` dump (S),
# the reports at the end (S + 60 s: plots take seconds), and the sample with the final agreement that every rank is
# done (S per sampled byte). A phase that ends past its limit ends the job too, when it ends, and a rank whose
# watchdog has fired goes past no further phase: the exit code is 5 however early (a `--step-timeout 0.001` run
# used to print "ending the job" and exit 0, its ranks finishing before the abort). `tests/test_watched.py` stops
# a rank (`--inject-fault RANK:STEP:stop-in-save`, `-load`, `-validation`, `-dump`, `-sample`: SIGSTOP as the
# phase starts) in each, and each job ends with exit code 5 in seconds. Here, one phase watched without a fault:
# what the phase's `entering` hook (where those faults act) is told, and that nothing fired:

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
# every overflow (chapter 14). A run that has diverged overflows at every scale, so S halves at every step and no
# update is ever applied: such a run used to skip to its end and exit 0, saving nothing (and after about 1090 steps
# S underflowed to 0 and the progress line crashed on log2(0)). Now S below its floor (`MIN_SCALE`, 1: DeepSpeed's
# `min_loss_scale`) ends the run; once an update was applied, the skips count toward `--max-skips` (10 by default)
# like `--on-nan skip`'s (before the first, the back-offs are S finding its level from 2^16, and the floor bounds
# them: 17 halvings); and a run that applied none of its updates never exits 0. Each is `Skipping`, a
# `NumericalFault` (exit code 3), raised on every rank at once (the verdict is collective), after which `hsgd.train`
# writes a checkpoint of the last finite state: the step of the last applied update, whose parameters the skipped
# steps left as they were, with the scaler rewound to its state of then (`rewind`). A scaler fed an overflow at
# every step, on every rank:

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
# And a run whose every update was skipped, even one too short to reach `--max-skips`: `train` with one step whose
# gradient holds a NaN on rank 3 (`--inject-fault 3:1:nan --on-nan skip`), through `launch.run` as `python -m
# hsgd.train` runs it. It used to exit 0 with "1 update(s) skipped".

# %%
caught = io.StringIO()
with contextlib.redirect_stderr(caught):
    code = launch.run(lambda: train(cfg, config(steps=1, on_nan="skip", inject_fault="3:1:nan"), world,
                                    out=io.StringIO()), world)
say(f"launch.run: exit code {code}; rank 0's stderr: {caught.getvalue().strip()}")
check.equal("a run that applied none of its updates: exit code 3", code, 3)

# %% [markdown]
# **A killed job's zombies do not hold the folder.** While a run trains, rank 0 holds `save_dir/.hsgd-lock` (host
# and pid), and a second job on the folder is refused unless the holder no longer runs. Right after `kill -9` of
# mpirun its ranks are zombies for a moment: they have exited, but their parent has not collected them yet, so
# `kill(pid, 0)` still finds them, and a requeue right after the kill was refused for about a second.
# `hsgd.checkpoint.runs.alive` reads the process state in `/proc/PID/stat` ('Z': a zombie, not running; without
# `/proc`, the holder is given `ZOMBIE_WAIT_S` = 2 s to go). Rank 0 makes one: a child that exits, not collected:

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
# On 8 ranks as dp 2 x pp 2 x tp 2, every verdict reached collectively: a checkpoint holds one file per (stage,
# tensor rank), written by the first replica, each equal to every replica's shards and optimizer state and to the
# SHA-256 in the manifest; a half-written save is ignored and the newest two are kept; resuming in the same layout
# ends bit-identical to the uninterrupted run (parameters, velocities, losses), from Python and through
# `train(resume="auto")`, while a resume without the velocities does not; resharding to dp 4 x pp 1 x tp 2 and to
# dp 1 x pp 2 x tp 4 with the All-Gather scheme cuts exact slices and ends at the uninterrupted run's parameters
# to rounding; the export under serial names equals the gathered model and serial SGD; a corrupted file, another
# model and another optimizer are refused by every rank with what is wrong, with exit code 2, and so is a FIFO in
# place of a shard; a NaN on one rank is
# skipped or stops every rank (exit code 3); a replica that moved by one ulp is named; a phase is watched without
# firing; a scaler that overflows at every step stops at its floor (step 17) or after --max-skips (step 11) and
# rewinds to its last finite state, a run that applied no update exits 3, and a zombie's lock is taken over.

# %%
for t in (resumed, amnesiac, adamw, skipper, stopper, trainer):
    t.free()
grid.free()
worst, err = check.worst([w for w in check.errors if " vs " in w])
say(f"\nchapter 11: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against the "
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
# The ideas are the same everywhere: each rank writes what only it holds, one replica of what several hold, an
# index of where every slice of every global tensor lies, and a last small write that makes the checkpoint visible.
# Loading in another layout is reading, for each new piece, the saved slices it overlaps. hsgd's index is the layout
# itself (the slices follow from dp, pp, tp and the scheme); Megatron-LM and PyTorch record every chunk's offset,
# which also covers layouts no formula describes (ZeRO-3's flat chunks, for one).
#
# ## Exercises
#
# ### Exercise 1: how often to save
# A checkpoint costs C seconds of a job whose failures come at rate 1/M (exponential; M, the job's mean time
# between failures, is the node's divided by the nodes: 1000 nodes of 5 years make M = 43.8 hours), and a restart
# costs R. With a checkpoint after every tau seconds of work, each segment needs an unbroken tau + C seconds (after
# a failure: R + tau + C), which gives the expected wall time per second of work (Daly 2006)
# $T(\tau) = M e^{R/M} (e^{(\tau + C)/M} - 1)/\tau$. Young (1974, "A first order approximation to the optimum
# checkpoint interval") found the optimum $\tau \approx \sqrt{2CM}$; Daly (2006, "A higher order estimate of the
# optimum checkpoint interval for restart dumps") corrected it to
# $\sqrt{2CM}\,[1 + \tfrac13\sqrt{C/2M} + \tfrac19 (C/2M)] - C$ (for C < 2M). Find the true optimum of $T$ by
# bisection on $dT/d\tau = 0$ for C = 300 s and for C = 0.05 M (R = 600 s), and compare both formulas with it. Then
# simulate: draw exponential failure times for 200,000 segments and check that the mean wall time of a segment
# agrees with the formula within 4 standard errors, at the optimum and at a third and three times it, and that the
# waste is least at the optimum.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_1`)
#
# ### Exercise 2: reshard one parameter by hand
# Save a checkpoint on 4 ranks as dp 1 x pp 2 x tp 2 (Megatron's scheme) with V = 250, then, on each rank of the
# layout dp 1 x pp 1 x tp 4 with the All-Gather scheme, build the rank's piece of `h.0.mlp.proj.weight` (rows in
# the old layout, columns in the new) and of `wte` (vocabulary rows, padded to a multiple of tp: 2 x 125 rows
# before, 4 x 63 after), and their velocities, with `json`, `np.load`, `np.concatenate` and slicing only. Check them
# bit for bit against what `checkpoint.load` puts into a `HybridTrainer` of that layout.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_2`)
#
# ### Exercise 3: find the corrupted shard
# Write `verify(path)` that recomputes, with `hashlib` alone, the manifest's digest (SHA-256 of its JSON without
# the key "digest", keys sorted) and every file's SHA-256, and returns (digest correct, the files that differ). Check
# it on the intact checkpoint, on a copy with one bit flipped in `shard-pp1-tp0.npz`, and on a copy whose manifest
# was edited to start from step 1; and that `open_checkpoint` refuses exactly the two damaged copies.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_3`)
#
# ### Exercise 4: the size of a checkpoint
# Predict, from the model's shape and the layout, the bytes of arrays in each `shard-pp{s}-tp{t}.npz` (parameters
# and SGD velocities of the stage's parameters: a replicated one whole, a split one 1/tp of its split axis, the
# vocabulary ceil(V/tp) rows), and check them against the files. How much more than the serial model and its
# velocity does the checkpoint hold, and why? Check your formula for the difference.
# (solution: `tutorials/solutions/19_fault_tolerance.py`, `exercise_4`)
