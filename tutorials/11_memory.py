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
# # Chapter 11: memory
#
# Memory is the lecture's reason to split a model at all. Its section 1 names the weakness of data parallelism (in
# translation):
#
# > when the model is very large, every node storing a complete replica of the model may run out of memory;
#
# its section 2 starts from models whose parameters "a single compute node (even with several GPUs) cannot hold",
# and its summary puts the design in one sentence: split the model with model parallelism **to fit limited
# memory**, and replicate the split units with data parallelism to use more data. Section 3.4's Reduce-Scatter
# then All-Gather over dp is, seen from memory, ZeRO's first stage (chapter 8), and section 4.2's micro-batches set
# how many activations a pipeline stage holds (chapter 9).
#
# This chapter counts where a step's bytes go on one rank, then measures each way to spend fewer (tensor and
# sequence sharding, the pipeline schedule, recomputation, ZeRO) against its formula, on 13 combinations of 8 ranks. It
# sets the published formulas next to hsgd's and ends with a whole step measured by hsgd's memory probe (appendix B
# shows how the probe works).
#
# Run it with eight ranks (14.5 to 17.5 s on an idle 2-core machine, over half of it the two traced runs; a failure
# ends every rank). Rank 0 prints, and draws three pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/11_memory.py
#
# Legend: P ranks, dp replicas, p = pp stages, t = tp ranks per stage, m micro-batches per replica and step, B global
# batch, b sequences per micro-batch, T sequence, $\tilde T$ = T/t under sequence sharding (else T), N = bT positions,
# C d_model, NH heads, hs = C/NH, F d_ff, V vocabulary, Vp = ceil(V/t), L layers, s bytes per element (8, float64),
# k optimizer states per parameter (SGD with momentum 1, AdamW 2), $\Phi$ the parameters of a rank's shard, n the
# ranks a ZeRO stage shards over (dp, or the ranks of a node), $c_g$ = ceil($n_g$/n) a rank's chunk of gradient
# group g.

# %%
from hsgd.model.config import ModelConfig   # hsgd first: OpenBLAS's thread timeout
from hsgd.tp import hooks, model as tp_model, shards as tp_shards
from hsgd.accounting import allocations, step_memory
from hsgd.model import serial

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes, activation_formula, paper_activation_bytes
from hsgd.pp.schedules import build
from hsgd.pp.timelines import peak_held
from hsgd.run.report import fmt_bytes
from hsgd.accounting.traffic import step_formula
from hsgd.dp.sharded import ShardedExchange
from hsgd.tp.schemes import make_scheme

import pictures                                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, ring_share, train_config

P = 8
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=74)

cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=4, d_ff=128)   # NH, F, T split 8 ways
SEED, B, S = 0, 8, 8                    # global batch, bytes per float64
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} "
    f"F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size}); B={B}, float64")

grids = {}


def grid_of(dp, pp, tp):
    """One ProcessGrid per layout, built once (every rank builds the same ones, in the same order)."""
    if (dp, pp, tp) not in grids:
        grids[dp, pp, tp] = ProcessGrid(world, dp=dp, pp=pp, tp=tp)
    return grids[dp, pp, tp]


def config(**kw):
    """The float64 run every combination shares: AdamW with weight decay, clipping at 1.0, two steps (one warm-up
    step); `train_config` of tutorials/checks.py, validated as hsgd.train does. The layout and the memory options
    come in kw."""
    return train_config(**{**dict(dp=4, tp=2, steps=2, batch_size=B, optimizer="adamw", lr=0.01, weight_decay=0.1,
                                  clip=1.0, seed=SEED), **kw})

# %% [markdown]
# ## 1. Where the bytes of a step go
#
# A rank training its shard holds four kinds of array:
#
# * **parameters**: $s\Phi$ bytes, $\Phi$ its shard (`tp_shards.shard_numel`: split matrices divided by t; the
#   LayerNorms, `wpe` and the row-parallel biases whole);
# * **gradients**: as many;
# * **optimizer state**: k more copies (SGD's velocity, AdamW's two moments);
# * **activations**: what each layer's forward caches for its backward, alive from a micro-batch's forward until its
#   backward ends, scaling with the micro-batch (b sequences of T), not the parameters.
#
# The first three stay between steps. One step of each optimizer on dp 4 x tp 2:

# %%
g2 = grid_of(4, 1, 2)
phi = tp_shards.shard_numel(cfg, 2)                                     # my shard's parameters (either tp rank)
for opt, k, extra in (("sgd", 1, dict(momentum=0.9, lr=0.1)), ("adamw", 2, {})):
    tr = HybridTrainer(cfg, g2, config(optimizer=opt, **extra))
    tr.step(*corpus.batch(SEED, 1, B), 1)                               # the optimizer's state exists from here
    mem = tr.memory()
    say(f"{opt:<6} parameters {fmt_bytes(mem['params']):>10}  gradients {fmt_bytes(mem['grads']):>10}  "
        f"optimizer state {fmt_bytes(mem['optimizer']):>10}  (Phi = {phi:,} elements, k = {k})")
    check.equal(f"{opt}: trainer.memory() == (s Phi, s Phi, {k} s Phi)",
                (mem["params"], mem["grads"], mem["optimizer"]), (S * phi, S * phi, k * S * phi))
    params = tr.params
    tr.free()

# %% [markdown]
# One micro-batch's activations are the caches `tp_model.stage_forward` returns. Every rank runs one forward of
# b = 2 sequences and counts the distinct arrays its caches hold (`activations.activation_bytes`: a view counts once,
# through its owner; parameters never count). One block's cache, part by part, against
# `activations.activation_formula` (Megatron's scheme, t = 2):

# %%
b2 = B // 4                                                            # sequences per replica on dp 4
idx, targets = corpus.batch(SEED, 1, b2)
loss, caches = tp_model.forward(params, idx, targets, tp_model.TPSetup(cfg, g2.tp_comm, "megatron"))
N, C, F, NH, T, t = b2 * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.seq_len, 2
block = caches.blocks[0][1]                    # (ln1, a, attention, proj input, ln2, m, GELU, mlp.proj input)
parts = [("LN1: xhat (N, C), rstd (N, 1)", block[0], N * (C + 1)),
         ("LN1's output a, the input of q, k, v (N, C)", block[1], N * C),
         ("attention: q, k, v (N, C/t) x 3, probabilities (b, NH/t, T, T)", block[2],
          (3 * N * C + b2 * NH * T * T) // t),
         ("the heads y, input of attn.proj (N, C/t)", block[3], N * C // t),
         ("LN2: xhat, rstd", block[4], N * (C + 1)),
         ("LN2's output m, the input of fc (N, C)", block[5], N * C),
         ("GELU's cache (N, F/t)", block[6], N * F // t),
         ("GELU's output, input of mlp.proj (N, F/t)", block[7], N * F // t)]
say(f"{'one block, one micro-batch of b = 2, one rank':<66} {'measured':>10} {'formula':>10}")
for what, part, elements in parts:
    say(f"  {what:<64} {activation_bytes(part, params):>10,} {S * elements:>10,}")
formula = activation_formula(cfg, b2, S, t, "megatron")
say(f"  {'block':<64} {activation_bytes(block, params):>10,} {formula['block']:>10,}")
say(f"  {'whole model: L blocks, embedding, final LayerNorm, LM head, loss':<64} "
    f"{activation_bytes(caches, params):>10,} {formula['model']:>10,}")
check.equal("every part of a block's cache == its term of the formula",
            [activation_bytes(part, params) for _, part, _ in parts], [S * e for _, _, e in parts])
check.equal("one micro-batch's caches == activation_formula['model']",
            (activation_bytes(block, params), activation_bytes(caches, params)), (formula["block"], formula["model"]))
per_group = ([activation_bytes(caches.emb, params)] + [activation_bytes(c, params) for _, c in caches.blocks]
             + [activation_bytes(caches.head, params)])                 # embedding, blocks, head: forward order
check.equal("the groups' caches add up to the model's (nothing shared)", sum(per_group), formula["model"])
say(f"parameters of my shard {fmt_bytes(S * phi)}; one micro-batch's activations {fmt_bytes(formula['model'])}, "
    f"of which the attention probabilities {fmt_bytes(cfg.n_layers * S * b2 * NH * T * T // t)}")

# %% [markdown]
# Two parts are whole on every tp rank, the LayerNorms' caches and outputs: Megatron's scheme splits the matrices,
# not the (N, C) activations between them. The probabilities grow with $T^2$, the rest with T: at T = 16 they match
# GELU's cache; at GPT-3's T = 2048 (section 7) they are a large share. A micro-batch's caches build up group by
# group in the forward and are freed together when its backward ends (an autograd engine frees each layer's saved
# tensors after its backward: a ramp, not a plateau).
#
# ## 2. The chapter's runs: 13 combinations on 8 ranks
#
# Each combination is a `TrainConfig` trained two steps by `HybridTrainer` on its own `ProcessGrid` of the 8 ranks.
# Step 2 is measured on every rank: the bytes on every communicator (`grid.stats`, against
# `hsgd.accounting.traffic.step_formula`); the exchange's buffers at every group's forward and backward exit
# (`ExchangeMeter` below, a `hooks.Hooks` chained after the exchange's own that adds up the distinct arrays the
# exchange holds: parameters, gradients and their buckets, communication buffers; free, so it runs for all 13, but
# blind outside the exchange); for two runs (`TRACED`) everything, under hsgd's memory probe (section 9); the
# micro-batches held (`stage.peak_held`) and one micro-batch's caches; `trainer.memory()` and the parameters.

# %%
def arrays(x):
    """The arrays inside x: an array, a dict, list or tuple of them, a FlatBuffer (its .flat), None."""
    if isinstance(x, np.ndarray):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from arrays(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from arrays(v)
    elif hasattr(x, "flat") and hasattr(x, "views"):                  # hsgd.dp.average.FlatBuffer
        yield x.flat


def owner(a):
    """The array that owns a's memory (a view's base)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class ExchangeMeter(hooks.Hooks):
    """The chapter's meter: at the exit of every group's forward and backward, {kind: bytes} of the distinct arrays
    the gradient exchange holds (each owner counted once, under the first kind it is met as)."""

    def __init__(self, ex):
        self.ex, self.samples = ex, []                                  # [(label, {kind: bytes})]

    def held(self):
        ex, found = self.ex, []
        found += [("params", a) for n in ("pbuf", "master_", "whole", "params") for a in arrays(getattr(ex, n, None))]
        found += [("grads", a) for n in ("buf", "g_owned", "g_chunk", "live") for a in arrays(getattr(ex, n, None))]
        if isinstance(ex, ShardedExchange):                             # Reduce-Scatters still in flight:
            for req, _, recv in ex.pending:                             # the bucket MPI reads, the chunk it fills
                found += [("grads", owner(req.keepalive[0])), ("comm", recv)]
        found += [("comm", a) for a in arrays(getattr(ex, "p_send", None))]       # ZeRO-1's Allgather send buffer
        seen = {}
        for kind, a in found:
            seen.setdefault(id(owner(a)), (kind, owner(a).nbytes))
        out = dict.fromkeys(("params", "grads", "comm"), 0)
        for kind, nbytes in seen.values():
            out[kind] += nbytes
        return out

    @contextmanager
    def forward(self, group):
        yield
        self.samples.append((f"F {group}", self.held()))

    @contextmanager
    def backward(self, group):
        yield
        self.samples.append((f"B {group}", self.held()))

    def peaks(self):
        return {kind: max(c[kind] for _, c in self.samples) for kind in ("params", "grads", "comm")}


COMBOS = [("dp 8", dict(dp=8, tp=1)),
          ("tp 2", dict()),
          ("tp 2 sequence", dict(tp_scheme="sequence")),
          ("tp 8 sequence", dict(dp=1, tp=8, tp_scheme="sequence")),
          ("pp 4 GPipe m 4", dict(dp=2, pp=4, tp=1, micro_batches=4, schedule="gpipe")),
          ("pp 4 1F1B m 4", dict(dp=2, pp=4, tp=1, micro_batches=4)),
          ("tp 2 selective", dict(recompute="selective")),
          ("tp 2 full", dict(recompute="full")),
          ("tp 2 ZeRO-1", dict(zero=1)),
          ("tp 2 ZeRO-2", dict(zero=2)),
          ("tp 2 ZeRO-3", dict(zero=3)),
          ("tp 2 ZeRO-3 hybrid", dict(zero=3, hierarchical=True, ranks_per_node=2)),
          ("all four", dict(dp=2, pp=2, tp=2, micro_batches=2, tp_scheme="sequence", recompute="full", zero=3))]


def stage_input(tr, b):
    """One micro-batch's input for my stage: token ids on the first stage, else a random activation (b, T~, C)."""
    st = tr.stage
    if st.first:
        return corpus.batch(SEED, 3, b)
    shape = tp_model.stage_activation_shape(tr.tc.tp_scheme, b, cfg, tr.grid.tp)
    return np.random.default_rng(tr.grid.pp_rank).standard_normal(shape), corpus.batch(SEED, 3, b)[1]


TRACED = ("pp 4 1F1B m 4", "all four")                                 # step 2 also under the memory probe


def run(name, kw):
    """Two steps of one combination; step 2 measured (and traced, for TRACED). Returns this rank's record."""
    tc = config(**kw)
    g = grid_of(tc.dp, tc.pp, tc.tp)
    probe = allocations.MemoryProbe() if name in TRACED else None
    if probe:
        probe.start()                                                  # before the parameters and the state exist
    tr = HybridTrainer(cfg, g, tc)
    tr.step(*corpus.batch(SEED, 1, B), 1)
    ex, meter = tr.exchange, ExchangeMeter(tr.exchange)
    own = ex.hooks                                                     # ZeRO 2 and 3: ShardHooks, else None
    ex.hooks = meter if own is None else hooks.ChainedHooks([own, meter])   # the meter inside the exchange's
    before = g.stats.counts()
    batch = corpus.batch(SEED, 2, B)                                   # (idx, targets): alive through the step
    step2 = lambda: tr.step(*batch, 2)
    info = allocations.traced_step(tr, probe, step2) if probe else step2()   # the probe's hooks innermost
    if probe:
        probe.stop()
    ex.hooks = own
    measured = g.stats.since(before)                                   # step 2's (calls, bytes)
    b = B // tc.dp // tc.micro_batches
    full = tr.exchange.full_params()                                   # ZeRO-3: All-Gathered over the shard comm
    inp, tgt = stage_input(tr, b)
    piece = tp_model.Piece(tr.stage.layers, tr.stage.first, tr.stage.last)
    _, mb_caches = tp_model.stage_forward(full, inp, tgt, piece, tp_model.TPSetup(cfg, g.tp_comm, tc.tp_scheme,
                                                                                  recompute=tc.recompute))
    traced = dict(probe=probe.result(), step_memory=step_memory.step_formula(tr)) if probe else {}
    return dict(name=name, tc=tc, trainer=tr, grid=g, meter=meter, seconds=info.seconds, **traced,
                measured=measured, formula=step_formula(cfg, tc, tr), memory=tr.memory(),
                ex_formula=tr.exchange.sizes.memory_formula(), held=tr.stage.peak_held, b=b,
                mb_act=activation_bytes(mb_caches, full), params={n: np.array(p) for n, p in full.items()})


runs = {name: run(name, kw) for name, kw in COMBOS}
reference = pictures.on_rank0(world, lambda: serial.sgd(cfg, config(), lambda st: corpus.batch(SEED, st, B))[0])
ref = world.bcast(reference, root=0)                                   # serial AdamW's parameters after 2 steps
say(f"{len(runs)} combinations, 2 steps each; serial AdamW on one process as the reference")

# %% [markdown]
# First, every combination computed what serial AdamW computes, and moved exactly its formula's bytes:

# %%
def param_err(r):
    """The largest rel_err of my shards against the matching slices of serial parameters (floor 0.02, chapter 4)."""
    g, scheme = r["grid"], r["tc"].tp_scheme
    return max(rel_err(p, tp_shards.shard(ref[n], n, g.tp_rank, g.tp, scheme), floor=0.02)
               for n, p in r["params"].items())


for name, r in runs.items():
    check(f"{name}: every rank's shards after 2 steps vs serial AdamW", param_err(r), 1e-10)
for name, r in runs.items():
    check.equal(f"{name}: step 2's calls and bytes == step_formula", r["measured"], r["formula"])

# %% [markdown]
# ## 3. Tensor and sequence sharding
#
# Megatron's scheme (chapters 5 and 6) splits the matrices and the heads over t ranks and All-Reduces the (N, C)
# activation twice per block and direction; the sequence scheme (Korthikanti et al. 2022's sequence parallelism)
# replaces each All-Reduce by a Reduce-Scatter to T/t positions and an All-Gather back, so the LayerNorms and the
# activations between the matrices are split too. Parameters divide almost by t either way; activations:
#
# $$\text{megatron: } s\,(4NC + 2N) + s\,(4NC + b\,NH\,T^2 + 2NF)/t, \qquad
#   \text{sequence: } s\,(8NC + 2N + b\,NH\,T^2 + 2NF)/t .$$

# %%
say(f"{'combination':<16}{'t':>3}{'b':>3}  {'parameters':>11}{'activations':>13}{'formula':>10}  "
    f"{'replicated part of a block':>26}")
for name in ("dp 8", "tp 2", "tp 2 sequence", "tp 8 sequence"):
    r = runs[name]
    tc, tr = r["tc"], r["trainer"]
    f = activation_formula(cfg, r["b"], S, tc.tp, tc.tp_scheme)
    whole = 0 if tc.tp_scheme == "sequence" else S * (4 * r["b"] * T * C + 2 * r["b"] * T)
    say(f"{name:<16}{tc.tp:>3}{r['b']:>3}  {fmt_bytes(r['memory']['params']):>11}{fmt_bytes(r['mb_act']):>13}"
        f"{fmt_bytes(f['model']):>10}  {fmt_bytes(whole):>26}")
    check.equal(f"{name}: one micro-batch's caches == activation_formula", r["mb_act"], f["model"])

# %% [markdown]
# On 8 ranks every rank given to tp is taken from dp, so b = B/dp grows with t, and tp 2's activations grow: its
# replicated part is not divided. The sequence scheme divides everything by t: tp 8 with all 8 sequences caches
# about as much as dp 8 with one. Its price (chapter 6): Megatron's bytes on `tp_comm`, in twice the calls.
#
# ## 4. The pipeline schedule: micro-batches in flight
#
# A stage holds the caches of every micro-batch it has run forward and not yet backward: GPipe all m, 1F1B at most
# p - s on stage s (chapter 9), each of b = B/(dp m) sequences. On dp 2 x pp 4 (one block per stage), m = 4:

# %%
def held_table(name):
    r = runs[name]
    rows = world.allgather((r["grid"].pp_rank, r["held"], r["mb_act"]) if r["grid"].dp_rank == 0 else None)
    return [x for x in rows if x]


for name, kind in (("pp 4 GPipe m 4", "gpipe"), ("pp 4 1F1B m 4", "1f1b")):
    r = runs[name]
    rows = held_table(name)
    say(f"{name}: stage (micro-batches held, measured | schedule) x one micro-batch's caches = activations held")
    for s_, held, act in rows:
        want = peak_held(build(kind, 4, 4)[s_])
        say(f"  stage {s_}: {held} | {want} x {fmt_bytes(act):>9} = {fmt_bytes(held * act):>9}")
    check.equal(f"{name}: micro-batches held == peak_held(schedule), every stage",
                r["held"], peak_held(build(kind, 4, 4)[r["grid"].pp_rank]))
check.equal("1F1B holds min(p - s, m), GPipe m", (runs["pp 4 1F1B m 4"]["held"], runs["pp 4 GPipe m 4"]["held"]),
            (min(4 - runs["pp 4 1F1B m 4"]["grid"].pp_rank, 4), 4))

# %% [markdown]
# Under 1F1B stage 0 holds as many as GPipe whenever m <= p; with m >> p (which the bubble asks for) GPipe's m grows
# while 1F1B stays at p - s. Size memory for the first stage, which also holds the embedding.
#
# ## 5. Recomputation: bytes for work
#
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") observe that the
# (b, NH/t, T, T) probabilities are most of a block's cache at long sequences and the cheapest part to recompute: a
# batched product and a softmax, no parameter, no communication. `--recompute selective` keeps q, k, v and
# recomputes the probabilities in the backward (`tp_model.recompute_attention`); `--recompute full` keeps each
# block's input and reruns its forward (`tp_model.recompute_block`), collectives included. Per block and micro-batch:
#
# | --recompute | cached per block | computed again in the backward pass | communicated again |
# |---|---|---|---|
# | none | K = `activation_formula(...)["block"]` | nothing | nothing |
# | selective | K - s b (NH/t) T^2 | the core attention: $4\,b\,(NH/t)\,T^2\,hs$ FLOPs and a softmax | nothing |
# | full | the input x, $s\,b\,\tilde T\,C$ | the block's forward | the block's forward collectives |
#
# The recomputed arrays live only during their block's backward, one block's worth the peak must still hold.
# Measured on one block, with the caches `recompute_block` and `recompute_attention` return:

# %%
def block_terms(r):
    """{recompute: bytes one block keeps per micro-batch} and the bytes alive again while one block's backward
    runs, from activation_formula (hsgd's own formula of section 1)."""
    tc, b = r["tc"], r["b"]
    Tl = T // tc.tp if make_scheme(tc.tp_scheme).splits_T else T
    K0, Pr, X = activation_formula(cfg, b, S, tc.tp, tc.tp_scheme)["block"], S * b * NH * T * T // tc.tp, S * b * Tl * C
    return {"none": K0, "selective": K0 - Pr, "full": X}, {"none": 0, "selective": 3 * S * b * T * C // tc.tp + Pr,
                                                            "full": K0}


r0 = runs["tp 2"]
kept, again = block_terms(r0)
S2 = make_scheme("megatron")
x_in = np.random.default_rng(rank).standard_normal((b2, T, C))
setups = {rc: tp_model.TPSetup(cfg, g2.tp_comm, S2, recompute=rc) for rc in ("full", "selective")}
_, c_full = tp_model.block_forward(x_in, r0["params"], "h.0.", setups["full"])
_, c_sel = tp_model.block_forward(x_in, r0["params"], "h.0.", setups["selective"])
measured_again = {"full": activation_bytes(tp_model.recompute_block(x_in, r0["params"], "h.0.", setups["full"]),
                                           r0["params"]),
                  "selective": activation_bytes(tp_model.recompute_attention(*c_sel[2][1:], setups["selective"]),
                                                r0["params"])}
measured_kept = {"full": activation_bytes(c_full, r0["params"]), "selective": activation_bytes(c_sel, r0["params"])}
say(f"{'--recompute':<12}{'kept per block':>16}{'formula':>10}{'alive again in its backward':>30}{'formula':>10}"
    f"{'micro-batch, all blocks':>26}")
for rc in ("none", "selective", "full"):
    r = runs["tp 2" if rc == "none" else f"tp 2 {rc}"]
    mk = activation_bytes(block, params) if rc == "none" else measured_kept[rc]
    say(f"{rc:<12}{mk:>16,}{kept[rc]:>10,}{measured_again.get(rc, 0):>30,}{again[rc]:>10,}"
        f"{fmt_bytes(r['mb_act']):>26}")
say(f"the probabilities are {(kept['none'] - kept['selective']) / kept['none']:.0%} of a block's cache here")
check.equal("recompute: a block's kept bytes == K, K - P, x (none, selective, full)",
            (activation_bytes(block, params), measured_kept["selective"], measured_kept["full"]),
            (kept["none"], kept["selective"], kept["full"]))
check.equal("recompute: bytes alive again in a block's backward == formula",
            measured_again, {rc: again[rc] for rc in ("selective", "full")})
check.equal("recompute: a micro-batch's caches == L blocks' kept bytes + the rest",
            [runs[n]["mb_act"] - runs["tp 2"]["mb_act"] for n in ("tp 2 selective", "tp 2 full")],
            [cfg.n_layers * (kept[rc] - kept["none"]) for rc in ("selective", "full")])

# %% [markdown]
# **What it costs**, in FLOPs of the products (a block's forward on one rank: $2N(4C^2 + 2CF)/t$ for its linears,
# $4\,b\,(NH/t)\,T^2\,hs$ for attention; a backward twice its forward) and in bytes moved again in step 2, against
# `tp_model.comm_formula(..., recompute="full")` (from the scheme's `block_forward_formula`). Step times are printed,
# not checked: 8 ranks share 2 cores.

# %%
def block_flops(b, tp):
    """(linears, attention products) of one block's forward for one micro-batch of b sequences on one rank."""
    n = b * T
    return 2 * n * (4 * C * C + 2 * C * F) // tp, 4 * b * (NH // tp) * T * T * (C // NH)


lin, att = block_flops(b2, 2)
base_flops = 3 * cfg.n_layers * (lin + att)                            # forward + backward (2x) of the blocks
extra = {"none": 0, "selective": cfg.n_layers * att, "full": cfg.n_layers * (lin + att)}
tp_bytes = {rc: runs["tp 2" if rc == "none" else f"tp 2 {rc}"]["measured"][("tp", "Allreduce")]
            for rc in ("none", "selective", "full")}
say(f"{'--recompute':<12}{'block FLOPs per step':>22}{'extra':>8}{'tp Allreduce calls, payload':>30}"
    f"{'ring, per rank':>16}{'step time (ms)':>16}")
for rc in ("none", "selective", "full"):
    calls, nbytes = tp_bytes[rc]
    secs = runs["tp 2" if rc == "none" else f"tp 2 {rc}"]["seconds"]
    say(f"{rc:<12}{base_flops + extra[rc]:>22,}{extra[rc] / base_flops:>8.1%}{calls:>12} {fmt_bytes(nbytes):>17}"
        f"{fmt_bytes(float(ring_share('Allreduce', 2) * nbytes)):>16}{1e3 * secs:>16.1f}")
again_bytes = {k: v for k, v in S2.block_forward_formula(cfg, b2, S).items()}
check.equal("full: the extra tp traffic == L x the block's forward collectives",
            (tp_bytes["full"][0] - tp_bytes["none"][0], tp_bytes["full"][1] - tp_bytes["none"][1]),
            (cfg.n_layers * again_bytes[("tp", "Allreduce")][0], cfg.n_layers * again_bytes[("tp", "Allreduce")][1]))
check.equal("selective: the same tp traffic as none", tp_bytes["selective"], tp_bytes["none"])
same = {rc: all(np.array_equal(runs[f"tp 2 {rc}"]["params"][n], runs["tp 2"]["params"][n]) for n in params)
        for rc in ("selective", "full")}
check.holds("selective and full: parameters after 2 steps bit-identical to none", all(same.values()))

# %% [markdown]
# Full recomputation adds a third to the blocks' arithmetic and half again their tp traffic, for one (N, C) array
# per block; selective adds a few per cent of products, nothing communicated, and saves the probabilities (the share
# printed above; more at long sequences). The same operations on the same numbers: the parameters are bit-identical.
#
# ## 6. ZeRO stages: sharding what every replica holds
#
# Nothing above divides by dp. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models") shards over the n data-parallel ranks what they all hold alike: stage 1 the optimizer state
# (chapter 8, `hsgd.dp.zero1`), stage 2 also the gradients, stage 3 also the parameters (`hsgd.dp.zero3`,
# `hsgd.dp.sharded`: per layer, each gradient group padded to n chunks $c_g$; a layer's Reduce-Scatter starts when
# its backward ends, overlapping the next; stage 3 All-Gathers a layer before its forward and its backward, and frees
# it after). Hybrid sharding shards within a node and replicates across. Between steps, with $\Phi'$ the flat buffer
# padded to a multiple of dp and $\bar c = \sum_g c_g$:
#
# | stage | parameters | gradients | optimizer state |
# |---|---|---|---|
# | 0 | $s\Phi$ | $s\Phi$ | $ks\Phi$ |
# | 1 | $s\Phi'$ | $s(\Phi' + \Phi'/dp)$ (the full buffer and its averaged chunk) | $ks\Phi'/dp$ |
# | 2 | $s(n\bar c + \bar c)$ (whole, and the chunk it updates) | $s\bar c$ | $ks\bar c$ |
# | 3 | $s\bar c$ | $s\bar c$ | $ks\bar c$ |

# %%
def chunks(r):
    """c-bar: the sum of a ZeRO 2 or 3 exchange's chunks (its sizes' layout), and n, the ranks it shards over."""
    sizes = r["trainer"].exchange.sizes
    return sum(L.c for L in sizes.layout.values()), sizes.n


def between_formula(name):
    r = runs[name]
    tc, k, dp = r["tc"], 2, r["tc"].dp
    ph = sum(p.size for p in r["params"].values())                      # Phi: my shard's parameters
    if tc.zero == 0:
        return {"params": S * ph, "grads": S * ph, "optimizer": k * S * ph}
    if tc.zero == 1:
        pad = -(-ph // dp) * dp                                         # Phi' = dp chunks
        return {"params": S * pad, "grads": S * (pad + pad // dp), "optimizer": k * S * pad // dp}
    cbar, n = chunks(r)
    return {"params": S * (n * cbar + cbar if tc.zero == 2 else cbar), "grads": S * cbar, "optimizer": k * S * cbar}


ZEROS = ("tp 2", "tp 2 ZeRO-1", "tp 2 ZeRO-2", "tp 2 ZeRO-3", "tp 2 ZeRO-3 hybrid")
say(f"between steps, rank 0 (dp 4 x tp 2, AdamW):\n{'':<20}{'parameters':>12}{'gradients':>12}{'optimizer':>12}"
    f"{'total':>12}{'bytes / parameter':>19}")
for name in ZEROS:
    m = runs[name]["memory"]
    ph = sum(p.size for p in runs[name]["params"].values())
    say(f"{name:<20}{m['params']:>12,}{m['grads']:>12,}{m['optimizer']:>12,}{sum(m.values()):>12,}"
        f"{sum(m.values()) / ph:>19.2f}")
    check.equal(f"{name}: trainer.memory() == the table's closed forms", m, between_formula(name))

# %% [markdown]
# Stage 2 keeps the whole parameters *and* the chunk it updates (`master`), $1/dp$ more: the optimizer updates the
# chunk and a per-layer All-Gather writes it back. Bytes per parameter fall from $(2 + k)s$ = 32 towards
# $(2 + k)s/dp$ = 8 at dp 4; hybrid sharding over nodes of 2 keeps twice stage 3's.
#
# **At the peak** a rank holds more: ZeRO-1 and plain dp the whole gradient buffer; ZeRO-2 and 3 two layers' whole
# gradients (the one filling, the one still in its Reduce-Scatter) and the chunk being received; ZeRO-3 also one
# gathered layer. The meter's largest sample of each kind against the exchange's `memory_formula()`:

# %%
say(f"{'':<20}{'params peak':>12}{'grads peak':>12}{'comm peak':>11}   vs memory_formula()")
for name in ZEROS + ("all four",):
    r = runs[name]
    pk = r["meter"].peaks()
    say(f"{name:<20}{pk['params']:>12,}{pk['grads']:>12,}{pk['comm']:>11,}   "
        f"{'equal' if pk == r['ex_formula'] else r['ex_formula']}")
for name, r in runs.items():
    check.equal(f"{name}: the meter's peaks == exchange.sizes.memory_formula()", r["meter"].peaks(), r["ex_formula"])
z1, z2 = runs["tp 2 ZeRO-1"]["meter"].peaks(), runs["tp 2 ZeRO-2"]["meter"].peaks()
whole_grad = runs["tp 2"]["memory"]["grads"]
say(f"gradient peak: ZeRO-1 {fmt_bytes(z1['grads'])}, ZeRO-2 {fmt_bytes(z2['grads'])}: lower by "
    f"{(z1['grads'] - z2['grads']) / whole_grad:.2f} of a whole gradient ({fmt_bytes(whole_grad)})")
check.holds("ZeRO-2's gradient peak is below ZeRO-1's by more than half a whole gradient",
            z1["grads"] - z2["grads"] > whole_grad / 2)

# %% [markdown]
# **What each stage moves** over `dp_comm` (hybrid: the node's and the nodes' communicators), rank 0, step 2,
# payload and ring bytes per rank: stages 1 and 2 an All-Reduce's worth, a Reduce-Scatter and an All-Gather of
# $\Phi'$ (ZeRO's $2\Psi$); stage 3 a Reduce-Scatter and two All-Gathers ($3\Psi$).

# %%
say(f"{'':<20}{'communicator':<14}{'operation':<24}{'calls':>6}{'payload':>11}{'ring, per rank':>16}")
dp_payload = {}
for name in ZEROS:
    r = runs[name]
    sizes = {"dp": r["grid"].dp, "dp-node": 2, "dp-cross": r["grid"].dp // 2}
    dp_payload[name] = 0
    for (comm, op), (calls, nbytes) in sorted(r["measured"].items()):
        if comm.startswith("dp"):
            dp_payload[name] += nbytes
            sent = float(ring_share(op, sizes[comm]) * nbytes)                # non-blocking as blocking
            say(f"{name:<20}{comm:<14}{op:<24}{calls:>6}{nbytes:>11,}{sent:>16,.0f}")
pad_bytes = runs["tp 2 ZeRO-3"]["trainer"].exchange.sizes.size * S                # Psi': the padded flat layout
check.equal("ZeRO-2 moves 2 Psi', ZeRO-3 3 Psi' (payload over dp_comm)",
            (dp_payload["tp 2 ZeRO-2"], dp_payload["tp 2 ZeRO-3"]), (2 * pad_bytes, 3 * pad_bytes))

# %% [markdown]
# One step on rank 0 from the meter's samples: at every group exit the exchange's parameters, gradients and
# buffers, plus the optimizer state and the caches alive (section 1's per-group caches). Plain dp is flat; ZeRO-2
# drops the whole gradient for two layers' buckets; ZeRO-3 also the whole parameters, gathering one layer at a time,
# twice a step: the saw-tooth, checked below sample by sample against its chunks plus the gathered layer.

# %%
def timeline(name, act_per_group):
    """[(label, {kind: bytes})] of one step on this rank: the meter's samples, the optimizer state and the caches
    alive; act_per_group: the caches of each group in forward order (embedding, blocks, head)."""
    r = runs[name]
    out, alive, n_f = [], 0, 0
    base = r["memory"]
    out.append(("start", {"params": base["params"], "grads": base["grads"], "comm": 0,
                          "optimizer": base["optimizer"], "activations": 0}))
    for label, held in r["meter"].samples:
        if label.startswith("F"):
            alive += act_per_group[n_f]
            n_f += 1
        out.append((label, {**held, "optimizer": base["optimizer"], "activations": alive}))
    out.append(("end", {**out[0][1]}))                                 # the caches freed, the buckets gone
    return out


KINDS = ("params", "grads", "optimizer", "activations", "comm")
KIND_COLORS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#8172B2", "activations": "#DD8452",
               "comm": "#937860", "recompute": "#DA8BC3", "other": "#8C8C8C"}
lines = {name: timeline(name, per_group) for name in ("tp 2", "tp 2 ZeRO-2", "tp 2 ZeRO-3")}


def draw_timelines():
    fig, axes = pictures.figure(9.0, 7.0, nrows=3, sharex=True, sharey=True)
    for ax, (name, samples) in zip(axes, lines.items()):
        x = np.arange(len(samples) + 1)                            # the last sample drawn one step wide too
        ys = [np.array([c[kind] for _, c in samples + samples[-1:]]) / 1024 for kind in KINDS]
        ax.stackplot(x, *ys, labels=KINDS, colors=[KIND_COLORS[kd] for kd in KINDS], step="post", alpha=0.9)
        ax.set_title(f"{name} (AdamW, dp 4 x tp 2, b = 2): rank 0 through step 2", fontsize=8)
        ax.set_ylabel("KiB", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(np.arange(len(samples)), [label for label, _ in samples], rotation=90, fontsize=6)
    axes[0].legend(fontsize=6, loc="upper left", ncol=5)
    return pictures.save(fig, "11_step_memory_zero")


path = pictures.on_rank0(world, draw_timelines)
say(f"picture: {path}")
z3 = runs["tp 2 ZeRO-3"]
cbar3, n3 = chunks(z3)
layout3 = z3["trainer"].exchange.sizes.layout                          # {group: its n_g, c_g, offsets}
z3_params = [c["params"] for _, c in z3["meter"].samples]               # at each group's forward and backward exit
z3_want = [S * cbar3 + S * n3 * layout3[label.split()[1]].c for label, _ in z3["meter"].samples]
say(f"ZeRO-3, rank 0: parameters held at the {len(z3_params)} group exits of step 2 from {min(z3_params):,} to "
    f"{max(z3_params):,} bytes; between steps {S * cbar3:,} (s c-bar)")
check.equal("ZeRO-3: parameters at each group's exit == s c-bar + that group gathered, s n c_g",
            z3_params, z3_want)

# %% [markdown]
# ## 7. The published formulas next to hsgd's
#
# **Activations per block.** Korthikanti et al. 2022, Table 2, count the bytes a layer keeps for b sequences of
# length s (our T), hidden size h = C, a heads, t tp ranks, F = 4h, in 16-bit numbers with 1-byte dropout masks.
# hsgd's rows are `activation_formula`'s, with section 5's kept bytes, in 16-bit units, for GPT-3 175B (T = 2048,
# C = 12288, NH = 96, t = 8, b = 1) and this chapter's model (t = 2, b = 2):

# %%
def paper_rows(s_, b, h, a, t_):
    """Korthikanti et al. 2022, Table 2: bytes per layer for each row."""
    att = 5 * a * s_ / (h * t_)
    return {"no parallelism": s_ * b * h * (34 + 5 * a * s_ / h), "tensor parallel": s_ * b * h * (10 + 24 / t_ + att),
            "tensor + sequence parallel": s_ * b * h * (34 / t_ + att),
            "tensor parallel + selective": s_ * b * h * (10 + 24 / t_),
            "tensor + sequence + selective": s_ * b * h * 34 / t_, "full recomputation": 2 * s_ * b * h}


def hsgd_rows(shape, b, t_):
    """hsgd's bytes per block for the same rows, in 16-bit units (activation_formula with s = 2 bytes)."""
    T_, C_, NH_ = shape.seq_len, shape.d_model, shape.n_heads
    Pr = 2 * b * NH_ * T_ * T_ // t_
    K = {(sc, tt): activation_formula(shape, b, 2, tt, sc)["block"] for sc, tt in (("megatron", 1), ("megatron", t_),
                                                                             ("sequence", t_))}
    return {"no parallelism": K["megatron", 1], "tensor parallel": K["megatron", t_],
            "tensor + sequence parallel": K["sequence", t_], "tensor parallel + selective": K["megatron", t_] - Pr,
            "tensor + sequence + selective": K["sequence", t_] - Pr, "full recomputation": 2 * b * T_ * C_}


gpt3 = ModelConfig(vocab_size=51200, seq_len=2048, d_model=12288, n_heads=96, n_layers=96, d_ff=4 * 12288)
toy = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=4, d_ff=128)
for label, shape, b, t_ in (("GPT-3 175B, t = 8, b = 1", gpt3, 1, 8),
                            ("this chapter's model, t = 2, b = 2", toy, 2, 2)):
    paper = paper_rows(shape.seq_len, b, shape.d_model, shape.n_heads, t_)
    mine = hsgd_rows(shape, b, t_)
    say(f"{label}: bytes per layer and micro-batch (16-bit)\n  {'row of Table 2':<32}{'paper':>12}{'hsgd':>12}"
        f"{'hsgd / paper':>14}")
    for row in paper:
        say(f"  {row:<32}{fmt_bytes(paper[row]):>12}{fmt_bytes(mine[row]):>12}{mine[row] / paper[row]:>14.2f}")
    check("Table 2's tensor-parallel rows == hsgd.accounting.activations.paper_activation_bytes",
          max(abs(paper_activation_bytes(shape.seq_len, b, shape.d_model, shape.n_heads, t_, sp)
                  - paper[row]) / paper[row] for sp, row in ((False, "tensor parallel"),
                                                             (True, "tensor + sequence parallel"))), 1e-12)
check.equal("the toy's hsgd rows == this rank's measured tp 2 block caches (float64 / 4)",
            (hsgd_rows(toy, 2, 2)["tensor parallel"] * 4, hsgd_rows(toy, 2, 2)["tensor parallel + selective"] * 4),
            (activation_bytes(block, params), measured_kept["selective"]))

# %% [markdown]
# Where the rows differ:
#
# * **no dropout** in hsgd: the paper's replicated 10 sbh is the LayerNorms' inputs (4), the q, k, v and fc inputs
#   (4) and two dropout masks (2); hsgd keeps the LayerNorms' normalized inputs and 1/std (N more numbers each) and
#   the same two inputs, 8 sbh;
# * **attention**: per score the paper (its section 4.1) keeps the softmax's and the dropout's outputs (2 bytes each)
#   and the mask (1), 5as/h, never the raw scores; hsgd keeps the softmax's output, 2as/h. At T = 2048 this is most
#   of the paper's layer, so selective recomputation saves more there (70% of GPT-3's layer) than in hsgd;
# * **cached instead**: hsgd keeps q, k, v, the merged heads, GELU's derivative and output, 24/t sbh as the paper's
#   split terms; the paper keeps GELU's input;
# * **full recomputation**: the paper keeps each layer's whole input, 2sbh; hsgd's sequence scheme the rank's T/t rows;
# * **element size**: hsgd's are 8 or 4 bytes, never 2; only ratios carry over.
#
# **Model states per parameter.** ZeRO counts, for mixed-precision Adam, 2 bytes of 16-bit parameters, 2 of
# gradients and K = 12 of optimizer state (32-bit master copy, two moments): 16 a parameter, by stage $4 + 12/N_d$,
# $2 + 14/N_d$, $16/N_d$. hsgd has one precision and no master copy: $(2 + k)s$ = 32 for float64 AdamW, and section
# 6's closed forms. Measured per parameter (rank 0, dp 4) against both:

# %%
def zero_paper(stage, nd, K=12):
    """Rajbhandari et al. 2020: bytes per parameter of mixed-precision Adam at each stage, Nd data-parallel ranks."""
    return {0: 2 + 2 + K, 1: 2 + 2 + K / nd, 2: 2 + (2 + K) / nd, 3: (2 + 2 + K) / nd}[stage]


def zero_hsgd(stage, nd, k=2, s=S):
    """hsgd's closed forms of section 6 per parameter, without the padding (one precision, no master copy)."""
    return {0: (2 + k) * s, 1: s * (2 + 1 / nd) + k * s / nd, 2: s * (1 + 1 / nd) + s / nd + k * s / nd,
            3: (2 + k) * s / nd}[stage]


say(f"{'stage':<8}{'ZeRO paper (16-bit Adam)':>26}{'hsgd closed form':>18}{'hsgd measured':>15}")
for z, name in enumerate(ZEROS[:4]):
    m = runs[name]["memory"]
    ph = sum(p.size for p in runs[name]["params"].values())
    say(f"{z:<8}{zero_paper(z, 4):>26.2f}{zero_hsgd(z, 4):>18.2f}{sum(m.values()) / ph:>15.2f}")
    check(f"ZeRO-{z}: measured bytes per parameter vs the closed form (padding only)",
          abs(sum(m.values()) / ph - zero_hsgd(z, 4)) / zero_hsgd(z, 4), 0.01)

# %% [markdown]
# hsgd's parameters *are* the master, so its baseline is $(2 + k)s$, not $4 + 12$; stage 1 keeps the full gradient
# buffer and its averaged chunk, stage 2 the whole parameters and its chunk; padding to n chunks adds less than one
# element per rank and layer.
#
# ## 8. Memory per rank: all 13 combinations
#
# For each combination, its busiest rank at the peak: the meter's peaks, the optimizer state, the activations
# (micro-batches held x one micro-batch's caches) and, with recomputation, one block's recomputed arrays. The kinds'
# peaks are added as if they coincided: an upper bound on these pieces, not on the step, which holds more
# (section 9). Between steps only parameters, gradients and optimizer state are left.

# %%
def peak_parts(r):
    """{kind: bytes} at the peak on this rank (each kind's largest, added)."""
    pk = r["meter"].peaks()
    recompute = block_terms(r)[1][r["tc"].recompute] * (len(r["trainer"].stage.layers) > 0)
    return {"params": pk["params"], "grads": pk["grads"], "optimizer": r["memory"]["optimizer"],
            "activations": r["held"] * r["mb_act"], "comm": pk["comm"], "recompute": recompute}


table = {}
for name, r in runs.items():
    mine = (peak_parts(r), sum(r["memory"].values()))
    table[name] = max(world.allgather(mine), key=lambda x: sum(x[0].values()))    # the busiest rank
PARTS = ("params", "grads", "optimizer", "activations", "comm", "recompute")
say(f"{'combination':<20}" + "".join(f"{p:>12}" for p in PARTS) + f"{'peak':>11}{'between':>10}")
for name, (parts_, between) in table.items():
    say(f"{name:<20}" + "".join(f"{fmt_bytes(parts_[p]):>12}" for p in PARTS)
        + f"{fmt_bytes(sum(parts_.values())):>11}{fmt_bytes(between):>10}")


def draw_bars():
    fig, ax = pictures.figure(9.5, 4.2)
    names = list(table)
    bottom = np.zeros(len(names))
    for part in PARTS:
        kib = np.array([table[n][0][part] for n in names]) / 1024
        ax.bar(names, kib, bottom=bottom, color=KIND_COLORS[part], label=part)
        bottom += kib
    ax.plot(names, [table[n][1] / 1024 for n in names], "k_", markersize=18, label="between steps")
    ax.set_ylabel("KiB on the busiest rank, at the peak", fontsize=8)
    ax.set_title(f"Memory per rank on {P} ranks: B = {B}, float64, AdamW (dp 4 x tp 2 unless named)", fontsize=9)
    ax.tick_params(axis="x", labelrotation=35, labelsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylim(0, 1.3 * max(sum(parts_.values()) for parts_, _ in table.values()) / 1024)
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return pictures.save(fig, "11_memory_per_rank")


path = pictures.on_rank0(world, draw_bars)
say(f"picture: {path}")
check.holds("every way to spend fewer lowers the peak below tp 2's",
            all(sum(table[n][0].values()) < sum(table["tp 2"][0].values())
                for n in ("tp 2 sequence", "tp 2 selective", "tp 2 full", "tp 2 ZeRO-2", "tp 2 ZeRO-3")))

# %% [markdown]
# The picture stacks the six kinds on each busiest rank; the black bar is what it keeps between steps. AdamW's two
# moments are plain dp's largest part, and only ZeRO touches them: ZeRO-1 keeps the rest, ZeRO-2 drops the whole
# gradient, ZeRO-3 the whole parameters too, a quarter of tp 2's between steps (dp = 4). Recomputation touches only
# activations, full paying one block's arrays back at the peak. tp 8 sequence spreads everything over 8 ranks, at
# 8-way collectives in every block; the pipelines divide the parameters by about 3 (embedding and head stay on the
# end stages) but hold up to 4 micro-batches' caches.
#
# ## 9. Measured by an allocation tracker: hsgd's memory probe
#
# Everything above is measured piece by piece, and section 8 adds peaks as if they met. hsgd's memory probe
# (`hsgd.accounting.allocations.MemoryProbe`, what `hsgd.train --memory` prints; appendix B shows how it works)
# measures all of it at once from the allocator's side: every NumPy buffer traced, put in a category by the function
# that allocated it, sampled at the step's start, at every group's forward and backward exit, after each block's
# recomputation and at the end, with the tracker's true peak between samples.
# `hsgd.accounting.step_memory.step_formula(trainer)` walks the schedule through the same moments and adds up what
# should be alive at each: the caches of the micro-batches held, the working activation, the sends not yet
# completed, the receive buffer, ZeRO's gathered group and buckets in flight.
#
# Step 2 of "pp 4 1F1B m 4" and "all four" was traced (`TRACED`, section 2; the probe started before the trainer
# was built, so the parameters and optimizer state are traced too). Their largest sample per category, measured |
# formula, on every rank (ranks with the same numbers share a column), the total, and the true peak:

# %%
CATS = ("params", "grads", "optimizer", "activations", "comm", "recompute", "other")


def per_category(c):
    """{category: bytes} of a sample or a peak, every category present (0 where none)."""
    return {cat: c.get(cat, 0) for cat in CATS}


def probe_columns(name):
    """Rank 0: [(label, measured, formula)] of a traced run's peaks, the ranks with the same numbers in one column."""
    r = runs[name]
    m, f = r["probe"], r["step_memory"]
    mine = (r["grid"].pp_rank, {**per_category(m["peak"]), "total": m["total"]},
            {**per_category(f["peak"]), "total": f["total"]}, m["true_peak"])
    cols = {}
    for rk, (stage, meas, form, true_peak) in enumerate(world.gather(mine) or []):
        col = cols.setdefault(repr((stage, meas, form)), [stage, [], meas, form, 0])
        col[1].append(rk)
        col[4] = max(col[4], true_peak)                                # the largest over the column's ranks
    return [(f"stage {st}: ranks {','.join(map(str, rks))}" if r["grid"].pp > 1 else "every rank",
             {**meas, "true peak": tp_}, form) for st, rks, meas, form, tp_ in cols.values()]


for name in TRACED:
    cols = probe_columns(name)
    if rank == 0:
        say(f"{name}: step 2, bytes at the peak per category, measured by the probe | step_memory.step_formula")
        say(f"  {'':<12}" + "".join(f"{label:^25}" for label, _, _ in cols))
        for row in CATS + ("total",):
            say(f"  {row:<12}" + "".join(f"{m[row]:>11,} | {f[row]:<11,}" for _, m, f in cols))
        say(f"  {'true peak':<12}" + "".join(f"{m['true peak']:>11,} +{m['true peak'] - m['total']:<10,}"
                                             for _, m, f in cols) + "  (the tracker's; + inside a group)")
for name in TRACED:
    m, f = runs[name]["probe"], runs[name]["step_memory"]
    check.equal(f"{name}: the probe's peak per category == step_memory's", per_category(m["peak"]),
                per_category(f["peak"]))
    check.equal(f"{name}: ... and every sample, category by category",
                [(label, per_category(c)) for label, _, c in m["samples"]],
                [(label, per_category(c)) for label, c in f["samples"]])
    check.equal(f"{name}: optimizer == 2 x trainer.memory()'s (moments, masks)",
                m["peak"]["optimizer"], 2 * runs[name]["memory"]["optimizer"])
say(f"{'busiest rank':<16}{'section 8: sum of the pieces':>30}{'probe: largest sample':>23}{'tracker: true peak':>20}")
for name in TRACED:
    m = runs[name]["probe"]
    most = [world.allreduce(x, op=MPI.MAX) for x in (m["total"], m["true_peak"])]
    say(f"{name:<16}{fmt_bytes(sum(table[name][0].values())):>30}{fmt_bytes(most[0]):>23}{fmt_bytes(most[1]):>20}")
    check.holds(f"{name}: section 8's sum < probe's largest sample < true peak",
                sum(table[name][0].values()) < most[0] < most[1])

# %% [markdown]
# Every category on every rank equals the formula byte for byte at every sample, not only at the peak: the
# formula's account of what is alive when is the allocator's. It counts three things the sections before did not:
#
# * **the optimizer's masks**: beside AdamW's moments the trainer keeps two per-element arrays (`HybridTrainer.decay`,
#   `.sharded`), so the optimizer category is twice `trainer.memory()`'s optimizer state;
# * **the working arrays between groups**: the x (or dL/dx) handed between groups, and on a pipeline every output
#   and input gradient sent, held by its `Isend` until the step's end (activations), receive buffers (comm), the
#   step's token windows (other);
# * **what lives and dies inside a group**: the logits' gradient, attention's dS, GELU's pieces; only the true peak
#   sees them (each table's last row, its + column the excess over the largest sample).
#
# So section 8's sum of peaks falls short of the step, the largest sample and the true peak above it on every
# busiest rank. A memory budget is the formula's total plus the largest group's working arrays, and only
# a tracker shows the second.
#
# One step of "all four" from the probe's samples. The ranks of one pipeline stage hold the same bytes in every
# category at every sample, and the two stages differ (checked below from the samples), so one panel per stage:

# %%
r = runs["all four"]
mine = [(label, per_category(c)) for label, _, c in r["probe"]["samples"]]     # my step, sample by sample
per_rank = world.allgather((r["grid"].pp_rank, mine, [sum(c.values()) for _, c in r["step_memory"]["samples"]]))
kinds = {}                                                             # each distinct step -> the ranks that had it
for rk, (stage, samples, totals) in enumerate(per_rank):
    kinds.setdefault(repr(samples), dict(stage=stage, samples=samples, totals=totals, ranks=[]))["ranks"].append(rk)
kinds = sorted(kinds.values(), key=lambda k: k["ranks"])
stages = sorted({st for st, _, _ in per_rank})
say("all four, the kinds of rank: " + "; ".join(f"stage {k['stage']} on ranks {', '.join(map(str, k['ranks']))}"
                                                for k in kinds))
check.equal("all four: ranks with the same samples in every category == the ranks of one stage",
            [k["ranks"] for k in kinds], [[rk for rk, (st, _, _) in enumerate(per_rank) if st == s_] for s_ in stages])


def draw_kinds():
    fig, axes = pictures.figure(11.0, 4.8, ncols=len(kinds), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, k in zip(axes, kinds):
        x = np.arange(len(k["samples"]))
        ys = [np.array([c[cat] for _, c in k["samples"]]) / 1024 for cat in CATS]
        ax.stackplot(x, *ys, labels=CATS, colors=[KIND_COLORS[cat] for cat in CATS], step="mid", alpha=0.9)
        ax.plot(x, np.array(k["totals"]) / 1024, "k_", ms=9, mew=1.5, label="step_formula: total")
        ax.set_title(f"stage {k['stage']}: ranks {', '.join(map(str, k['ranks']))}, each the same", fontsize=9)
        ax.set_xticks(x, [label for label, _ in k["samples"]], rotation=90, fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(x=0)
    axes[0].set_ylabel("KiB", fontsize=8)
    axes[0].set_ylim(0, 1.35 * max(max(k["totals"]) for k in kinds) / 1024)          # room for the legend
    axes[0].legend(fontsize=7, ncol=4, loc="upper left")
    fig.suptitle("all four (dp 2 x pp 2 x tp 2, sequence, full recomputation, ZeRO-3): step 2 on each kind of rank, "
                 "measured by hsgd's memory probe", fontsize=9)
    return pictures.save(fig, "11_step_memory_per_rank")


path = pictures.on_rank0(world, draw_kinds)
say(f"picture: {path}")

# %% [markdown]
# Each panel stacks one stage's categories at every sample of step 2, step_formula's total as black marks. Stage 0
# gathers, uses and frees ZeRO-3's embedding, h.0 and h.1 (the blue steps) and runs both forwards before its first
# backward (1F1B's warm-up: two micro-batches' caches); stage 1 alternates over h.2, h.3 and the head (one
# micro-batch) yet holds more activations (orange): the head caches its softmax over the vocabulary while full
# recomputation leaves each block only its input. Alike: the optimizer state, the chunks, and the pink spikes of one
# block's recomputed caches during its backward.

# %% [markdown]
# ## Check against serial
#
# On 8 ranks, collectively: SGD's and AdamW's model states are $s\Phi$, $s\Phi$, $ks\Phi$; a block's and a forward's
# caches are the formula's; all 13 combinations end at serial AdamW's parameters (float64, $10^{-10}$) and move
# exactly `step_formula`'s bytes; sharding, micro-batches held, recomputation's bytes and collectives, and ZeRO's
# bytes between steps and at the peak equal their formulas; recomputation is bit-identical; ZeRO-2 and 3 move
# $2\Psi'$ and $3\Psi'$; Table 2's rows are `paper_activation_bytes`'s; and the probe's every category, sample and
# rank is `step_memory.step_formula`'s.

# %%
worst, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 11: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"{err:.1e} ({worst})")
for r in runs.values():
    r["trainer"].free()
for g in grids.values():
    g.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `--recompute full` (`tp_model.block_forward` with `TPSetup(..., recompute="full")`, `recompute_block`) | `--recompute-granularity full` with `--recompute-method uniform\|block` and `--recompute-num-layers` (`TransformerConfig.recompute_granularity`, `recompute_method`); `tensor_parallel.checkpoint` (megatron/core/tensor_parallel/random.py) | `activation_checkpointing` config section (`partition_activations`, `cpu_checkpointing`, `number_checkpoints`); `deepspeed.checkpointing.checkpoint` (deepspeed/runtime/activation_checkpointing/checkpointing.py) | `torch.utils.checkpoint.checkpoint` | every block; the repeated tp collectives counted in `comm_formula` |
# | `--recompute selective` (`recompute_attention`) | `--recompute-granularity selective` with `--recompute-modules core_attn` | none (whole functions only) | `torch.utils.checkpoint.create_selective_checkpoint_contexts` (a policy per operator) | only the core attention; gradients checked bit-identical |
# | `--zero 1` (`hsgd.dp.zero1.Zero1Exchange`) | `--use-distributed-optimizer` (`DistributedOptimizer`, megatron/core/optimizer/distrib_optimizer.py) | `zero_optimization.stage` = 1 | `torch.distributed.optim.ZeroRedundancyOptimizer` | the Reduce-Scatter runs after the whole backward pass |
# | `--zero 2`, `--zero 3` (`hsgd.dp.zero2.Zero2Exchange`, `hsgd.dp.zero3.Zero3Exchange`, one gradient group per layer) | `data_parallel_sharding_strategy` = `optim_grads`, `optim_grads_params` (Megatron FSDP, `DistributedDataParallelConfig`) | `zero_optimization.stage` = 2, 3; `stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`, `stage3_max_live_parameters` | `FullyShardedDataParallel` with `ShardingStrategy.SHARD_GRAD_OP` / `FULL_SHARD`; `fully_shard(module, reshard_after_forward=...)` | no prefetch, no persistent small parameters: every layer gathered before its forward and its backward |
# | `--zero 3 --hierarchical --ranks-per-node n` (shard in a node, replicate across) | `outer_dp_sharding_strategy`, `num_distributed_optimizer_instances` | ZeRO++ hierarchical partitioning, `zero_hpz_partition_size` | `ShardingStrategy.HYBRID_SHARD`; `fully_shard` on a 2-D `DeviceMesh` | the chunks All-Reduced over the nodes once a step |
# | `HybridTrainer.memory()`, `exchange.sizes.memory_formula()`, `activation_formula`, `step_memory.step_formula`; `ExchangeMeter` | `report_theoretical_memory`, `compute_activation_memory` (megatron/training/theoretical_memory_usage.py) | `estimate_zero2_model_states_mem_needs_all_live`, `estimate_zero3_model_states_mem_needs_all_live` | none (the allocator's numbers only) | a formula for every moment of the step, checked byte for byte against the probe |
# | `allocations.MemoryProbe` (`hsgd.train --memory`; appendix B) | `torch.cuda.max_memory_allocated` in its logs (`--log-memory-to-tensorboard`) | `see_memory_usage` (deepspeed/runtime/utils.py) | `torch.cuda.memory._record_memory_history`, `_snapshot`; `torch.cuda.max_memory_allocated` | categories from the allocating function, sampled at the formula's moments |
#
# ## Exercises
#
# ### Exercise 1: Table 2 at GPT-3's scale
# From section 7's rows, compute GPT-3 175B's activation memory per rank for one sequence over its 96 layers at
# t = 8, for each row, in the paper's 16-bit bytes and with hsgd's formulas. Check the paper's two claims: the
# probabilities are about 70% of a layer without parallelism, and sequence parallelism with selective recomputation
# needs about 5 times less than tensor parallelism alone; then how much of each saving hsgd keeps, and the shortest
# sequence (a power of 2) at which selective recomputation saves at least half of hsgd's tensor-parallel row.
# (solution: `tutorials/solutions/11_memory.py`, `exercise_1`)
#
# ### Exercise 2: ZeRO-3 with a prefetch
# Write a `hooks.Hooks` that, on entering a group's forward (and backward), also gathers the next group's
# parameters, freeing each group after use. Predict the parameters' peak (the chunks plus the two largest consecutive
# gathered groups), measure it at every group exit as `ExchangeMeter` does, compare with `step_memory.step_formula`'s
# peak without the prefetch, and check that the parameters still equal serial AdamW's and the bytes moved did not
# change.
# (solution: `tutorials/solutions/11_memory.py`, `exercise_2`)
#
# ### Exercise 3: the repeated collectives of full recomputation, by hand
# For the sequence scheme, write what one block's forward moves on `tp_comm` (its All-Gathers and Reduce-Scatters,
# calls and payload), and so what `--recompute full` adds per step over L blocks and m micro-batches; check it
# against a real step with and without recomputation on dp 2 x pp 2 x tp 2, m = 2, and against
# `block_forward_formula`, in both columns (payload, ring bytes per rank).
# (solution: `tutorials/solutions/11_memory.py`, `exercise_3`)
#
# ### Exercise 4: hybrid sharding, how many ranks per node
# On dp 8 x tp 1 (AdamW), compare ZeRO-3 over 8 ranks with hybrid sharding over nodes of 2 and of 4. By hand, from
# the gradient groups' sizes (`stage.groups()`), compute the chunks $c_g$ = ceil($n_g$/n), the bytes a rank keeps
# between steps and what it moves per step on each communicator, payload and ring bytes; check one step of each
# against `trainer.memory()` and `CommStats`. Which sends the fewest bytes between nodes (count all of plain ZeRO-3's
# traffic as crossing), and at what cost in memory?
# (solution: `tutorials/solutions/11_memory.py`, `exercise_4`)
