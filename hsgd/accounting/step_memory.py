"""This implementation's memory over one training step, per category, at the moments the memory probe
(hsgd.accounting.allocations) samples.

The probe samples at the step's start, at the exit of every gradient group's forward and backward, at the point
inside a block's backward where recomputed arrays are alive (with --recompute selective or full), and at the end.
`stage_samples` walks the stage's schedule (hsgd.pp.chunks) through the same moments and adds up what is alive at each,
from the pieces below; a category's peak is its largest sample, as measured. Per micro-batch of b sequences
(N = b T rows, N~ = b T~, T~ = T/tp for the sequence scheme, else T; s bytes per element; P = b (NH/tp) T^2 s the
attention probabilities):

    X      the activation between blocks, and each dL/dX:          N~ C s
    E      the embedding's cache (first stage): its token ids int64 and owner mask bool     9 N
    H      the head's cache (last stage): LN_f's xhat and rstd, its output, the softmax (N, Vp), target ids,
           owner mask, row numbers:                                 (N~(2C + 1) + N Vp) s + 17 N
    K      one block's cache (hsgd.accounting.activations.activation_formula's "block"), by --recompute:
             none K0;   selective K0 - P (q, k, v kept, the probabilities dropped);   full: X, the block's input
           (selective in general: K0 less the attention's cache, plus q, k, v: selective_kept, 3 N C/tp s but
           where a view of the fused q|k|v product holds the whole product)
    R      recompute, at the "recomputed" point: full K0 (the whole block cache again); selective 3 N C/tp s + P
           (attention's head-split q, k, v copies and the probabilities); none 0
    Q      with rotary positions, the stage's tables cos and sin (T, hs) s each (hsgd.tp.model.TPSetup.rope): made
           by the first forward (or hsgd.train's validation before step 1) and kept by the setup for the run: the
           probe counts them as "other" (hsgd.accounting.allocations.CATEGORY_TABLE), at every sample of a later
           step.
With context parallelism (hsgd.cp.split) T is the rank's T/cp positions, and the attention's share of K0, P and
selective's R are the cp scheme's (hsgd.cp.split.attention_cache_bytes; all-gather and Ulysses keep probabilities,
b NH/tp T/cp T each): ring attention and a2a+p2p (hsgd.cp.hierarchical) keep no probabilities, so selective
recomputation drops nothing and has no "recomputed" point; nor has it with --attention flash (cp = 1),
whose cache holds q, k, v, y and the log-sum-exp in place of the probabilities (P = 0).

What is alive at each sample (this implementation, Stage.run and tp_model.stage_forward / stage_backward):
  * a micro-batch's caches from its forward until its backward has *finished*: stage_backward holds the whole
    StageCache while it runs, so nothing is freed group by group;
  * the working activation: x on leaving a forward group, dx on leaving a backward group (X each);
  * every array a stage sends (its output X after each forward, its dL/d(input) X after each backward) until the
    step's end (Stage.run waits for the sends last): activations;
  * the receive buffer of the running action (X, comm); with --recompute full the first block of a later stage
    caches its input, which is that receive buffer: comm, held until the micro-batch's backward;
  * the sequence scheme's partial gradients of a group's replicated parameters during its backward (grads):
    6 C s per block, T C s for wpe, 2 C s for ln_f (GPT-2; Llama 2 C s, nothing, C s: replicated_bytes);
  * the step's batch (other): hsgd.model.data's token windows (B, T + 1) int64, which idx and targets view;
  * in bfloat16 and float16 the model's rounded copy of the weights (params: the stage's shards again; ZeRO-3
    rounds each gathered layer in place, no copy);
  * the exchange's buffers (its memory_formula(): params, grads, comm) and the optimizer's state (0, 1 or 2 x
    the owned elements for SGD, momentum, AdamW) and its two per-element masks (weight decay, tensor-sharded: the
    owned elements each), all held through the step.
Not sampled: transients inside a group (dlogits, dqkv, the attention's dS, GELU's pieces); the tracker's true
peak shows them. With ZeRO 2 and 3 (hsgd.dp.sharded) what the exchange holds is followed sample by sample
(ShardedInFlight).
"""
import math

from hsgd.cp.split import attention_cache_bytes
from hsgd.accounting.activations import activation_formula
from hsgd.dp.sharded import ShardedSizes
from hsgd.tp.kv import kv_columns
from hsgd.tp.model import BLOCK_REPLICATED, EMBEDDING_REPLICATED, HEAD_REPLICATED
from hsgd.tp.schemes import make_scheme

STATE_COPIES = {"sgd": lambda momentum: 1 if momentum else 0, "adamw": lambda momentum: 2}


def selective_kept(cfg, N, tp, s):
    """Bytes of the q, k, v that --recompute selective keeps in place of the attention's cache (hsgd.tp.model
    attention_and_mlp), N rows, as the core attention takes them: q (N, C/tp), k and v (N, K/tp), the rank's kv
    heads. Without rotary positions they are views of the fused q|k|v product, which they hold whole; with them q
    and k are the block's own rotated arrays and v is copied, so that the product goes. Either way
    N (C/tp + 2 K/tp) s."""
    return N * (cfg.d_model // tp + 2 * kv_columns(cfg, tp)) * s


def replicated_bytes(cfg, s):
    """{group kind: bytes} of the parameters each gradient group replicates over tp (hsgd.tp.model's
    BLOCK_REPLICATED, EMBEDDING_REPLICATED, HEAD_REPLICATED, those the family has): GPT-2 6 C s per block (two
    LayerNorms' weights and biases, the projections' biases), T C s (wpe), 2 C s (ln_f); Llama 2 C s, 0, C s."""
    shapes = cfg.param_shapes()

    def numel(names, prefix=""):
        return sum(math.prod(shapes[prefix + n]) for n in names if prefix + n in shapes)
    return {"h": numel(BLOCK_REPLICATED, "h.0.") * s, "embedding": numel(EMBEDDING_REPLICATED) * s,
            "head": numel(HEAD_REPLICATED) * s}


def pieces(cfg, b, s, tp, scheme, recompute, cp=1, cp_scheme="ring", attention="materialized"):
    """{"X", "E", "H", "K", "R", "Q", "partial": {group kind: bytes}} of the module docstring, in bytes. With context
    parallelism the rows are the rank's T/cp positions, and selective recomputation drops the probabilities only
    where the cp scheme keeps them (ring attention and a2a+p2p keep none: nothing is dropped, nothing recomputed);
    attention: --attention (flash keeps none either)."""
    S = make_scheme(scheme)
    T, C, NH = cfg.seq_len // cp, cfg.d_model, cfg.n_heads
    N, Tl, Vp = b * T, T // tp if S.splits_T else T, -(-cfg.vocab_size // tp)
    X = b * Tl * C * s
    A, P = attention_cache_bytes(cp, cp_scheme, b, cfg.seq_len, C, NH, tp, s, attention,
                                 kv_columns(cfg, tp))                 # the attention's cache
    K0 = activation_formula(cfg, b, s, tp, S, cp, cp_scheme, attention)["block"]
    kept_qkv = selective_kept(cfg, N, tp, s)                          # selective keeps q, k, v in place of A
    K = {"none": K0, "selective": K0 - A + kept_qkv if P else K0, "full": X}[recompute]
    R = {"none": 0, "selective": A if P else 0, "full": K0}[recompute]
    partial = replicated_bytes(cfg, s) if scheme == "sequence" else {}
    Q = 2 * T * cfg.head_size * s if cfg.positions == "rope" else 0   # cos, sin of the rank's T (/cp) positions
    return {"X": X, "E": 9 * N, "H": (b * Tl * (2 * C + 1) + N * Vp) * s + 17 * N, "K": K, "R": R, "Q": Q,
            "partial": partial, "recomputes": recompute == "full" or (recompute == "selective" and P > 0)}


class ShardedInFlight:
    """ZeRO 2 and 3 (hsgd.dp.sharded; sizes: the exchange's ShardedSizes), sample by sample: what the exchange holds
    beyond its chunks depends on the moment. The probe samples inside the exchange's hooks, so on leaving group g:
        params  stage 3: g's gathered parameters, n c_g s (forward and backward)
        grads   backward: g's whole bucket n c_g s (being filled); and always the bucket of the group whose
                Reduce-Scatter is in flight (the one whose backward ended last), n c_p s
        comm    the in-flight Reduce-Scatter's receive chunk, c_p s
    After g's backward its Reduce-Scatter starts and the one before completes: g is then the one in flight."""

    def __init__(self, sizes):
        self.sizes, self.pending = sizes, None

    def at(self, kind, group):
        sizes, s = self.sizes, self.sizes.itemsize
        c = lambda g: sizes.layout[g].c if g is not None else 0      # noqa: E731
        own = c(group) if kind == "B" else 0                          # the bucket being filled
        gathered = sizes.n * c(group) * s if not sizes.holds_weight_copy else 0   # stage 3: the group's parameters
        return {"params": gathered, "grads": sizes.n * (own + c(self.pending)) * s, "comm": c(self.pending) * s}

    def done(self, group):
        self.pending = group


class NothingInFlight:
    """The exchanges other than ZeRO 2 and 3: nothing beyond their memory_formula() at any moment."""

    def at(self, kind, group):
        return {}

    def done(self, group):
        pass


class StageWalk:
    """One stage's schedule walked through the probe's moments (see the module docstring): emit() records what
    is alive at one of them; forward(j) and backward(j) walk one action."""

    def __init__(self, pc, layers, first, last, recompute, base, inflight):
        self.pc, self.layers, self.first, self.last = pc, layers, first, last
        self.recompute, self.base, self.inflight = recompute, base, inflight
        self.held, self.sends, self.samples = {}, 0, []   # j -> {"activations", "comm"} caches; bytes sent

    def emit(self, label, act=0, comm=0, grads=0, rec=0, kind=None, group=None):
        cats, extra, held = dict(self.base), self.inflight.at(kind, group), self.held.values()
        cats["activations"] = cats.get("activations", 0) + act + self.sends + sum(h["activations"] for h in held)
        cats["comm"] = cats.get("comm", 0) + comm + sum(h["comm"] for h in held) + extra.get("comm", 0)
        cats["grads"] = cats.get("grads", 0) + grads + extra.get("grads", 0)
        cats["params"] = cats.get("params", 0) + extra.get("params", 0)
        cats["recompute"] = cats.get("recompute", 0) + rec
        self.samples.append((label, cats))

    def forward(self, j):
        pc, X = self.pc, self.pc["X"]
        recv = 0 if self.first else X                     # this action's input: the receive buffer
        cur = self.held[j] = {"activations": 0, "comm": 0}
        if self.first:
            cur["activations"] += pc["E"]
            self.emit(f"F{j} embedding", act=X, comm=recv, kind="F", group="embedding")
        for i, layer in enumerate(self.layers):
            if self.recompute == "full" and i == 0 and not self.first:
                cur["comm"], recv = X, 0                  # the first block caches the receive buffer itself
            else:
                cur["activations"] += pc["K"]
            self.emit(f"F{j} h.{layer}", act=X, comm=recv, kind="F", group=f"h.{layer}")
        if self.last:
            cur["activations"] += pc["H"]
            self.emit(f"F{j} head", act=X, comm=recv, kind="F", group="head")
        else:
            self.sends += X                               # the output, held by its Isend until the step's end

    def backward(self, j):
        pc, X, part = self.pc, self.pc["X"], self.pc["partial"]
        recv = 0 if self.last else X                      # this action's input: the receive buffer
        groups = (["head"] if self.last else []) + [f"h.{layer}" for layer in reversed(self.layers)] + \
            (["embedding"] if self.first else [])
        for g in groups:
            kind = "h" if g.startswith("h.") else g
            if kind == "h" and pc["recomputes"]:         # the probe's point after recomputation
                incoming = 0 if (g == groups[0] and not self.last) else X     # dx in: the receive buffer, or X
                self.emit(f"B{j} {g} recomputed", act=incoming, comm=recv, grads=part.get("h", 0), rec=pc["R"],
                          kind="B", group=g)
            self.emit(f"B{j} {g}", act=X, comm=recv, grads=part.get(kind, 0), kind="B", group=g)
            self.inflight.done(g)
        del self.held[j]
        if not self.first:
            self.sends += X                               # dL/d(input), held by its Isend until the step's end


def stage_samples(pc, layers, first, last, actions, recompute, base, inflight=None):
    """[(label, {category: bytes})] at the probe's moments for one stage running `actions` [("F"|"B", j)].
    pc: pieces(); layers: the stage's blocks; base: {category: bytes} held through the whole step (exchange,
    optimizer); inflight: a ShardedInFlight for ZeRO 2 and 3 (what their hooks hold at each moment), or None."""
    if any(a.kind not in ("F", "B") or a.chunk for a in actions):      # (a W, a second chunk, a Pair F&B)
        raise ValueError("stage_samples walks one chunk per stage with fused backwards (gpipe, 1f1b)")
    inflight = inflight or NothingInFlight()
    walk = StageWalk(pc, layers, first, last, recompute, base, inflight)
    walk.emit("start")
    for kind, j, _ in actions:
        walk.forward(j) if kind == "F" else walk.backward(j)
    walk.sends = 0
    inflight.done(None)                                   # finish(): every Reduce-Scatter completed
    walk.emit("end")
    return walk.samples


def optimizer_formula(tc, sizes):
    """The optimizer's state and masks in bytes (see the module docstring): tc the settings, sizes the exchange's
    (hsgd.dp.exchange)."""
    copies = STATE_COPIES[tc.optimizer](tc.momentum)
    return (copies + 2) * sizes.owned_numel() * sizes.itemsize        # state, and the decay and tp-sharded masks


def step_formula(trainer):
    """{"peak": {category: bytes}, "total": the largest sample's sum, "at": its label, "samples": [...]} of one
    training step on this rank, in the categories of hsgd.accounting.allocations."""
    grid, st = trainer.grid, trainer.stage
    return rank_formula(trainer.cfg, trainer.tc, grid.dp, grid.tp, grid.cp, st, trainer.exchange.sizes,
                        trainer.num.rounds, st.ctx.held_bytes())


def rank_formula(cfg, tc, dp, tp, cp, stage, sizes, rounds, cp_held=0):
    """step_formula from sizes alone: dp, tp, cp the grid; stage: its .layers, .first, .last and .actions (gpipe or
    1f1b: one chunk, fused B); sizes: the exchange's (hsgd.dp.make.exchange_sizes for a planned one); rounds:
    bfloat16 or float16 (the model's rounded copy of the weights); cp_held: the context layout's own arrays
    (ctx.held_bytes())."""
    b, s = tc.batch_size // dp // tc.micro_batches, sizes.itemsize
    pc = pieces(cfg, b, s, tp, tc.tp_scheme, tc.recompute, cp, tc.cp_scheme, tc.attention)
    inflight = ShardedInFlight(sizes) if isinstance(sizes, ShardedSizes) else None
    base = ({"params": sizes.param_bytes(), "grads": sizes.grad_bytes(), "comm": 0} if inflight is not None
            else dict(sizes.memory_formula()))
    if rounds and sizes.holds_weight_copy:  # bf16 / fp16: the model's rounded copy of the weights, held through
        base["params"] += sum(sizes.numel.values()) * s                  # the step (ZeRO-3: the gathered group)
    base["optimizer"] = optimizer_formula(tc, sizes)
    base["activations"] = 0
    base["other"] = tc.batch_size * (cfg.seq_len + 1) * 8             # the step's token windows (B, T+1) int64
    base["other"] += pc["Q"] if stage.layers else 0                   # the rotary tables, held since they were made
    if cp > 1:                             # my positions of idx and targets (int64), the layout's own arrays
        base["other"] += 2 * tc.batch_size // dp * (cfg.seq_len // cp) * 8 + cp_held
    samples = stage_samples(pc, list(stage.layers), stage.first, stage.last, stage.actions, tc.recompute, base,
                            inflight)
    cats = sorted({c for _, cs in samples for c in cs})
    totals = [sum(c.values()) for _, c in samples]
    top = max(range(len(totals)), key=totals.__getitem__)
    peak = {c: max(cs.get(c, 0) for _, cs in samples) for c in cats}
    return {"peak": peak, "total": totals[top], "at": samples[top][0], "samples": samples}
