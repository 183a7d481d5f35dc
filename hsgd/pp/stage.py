"""One rank's pipeline stage: its layers, its schedule of micro-batches, and the activations it sends and receives.

A step of one DP group runs m micro-batches through the pp stages: stage s holds v model chunks (hsgd.pp.chunks.
chunk_layers; v = 1 unless the schedule is interleaved), chunk c being the model's piece k that the schedule's
placement says (hsgd.pp.placement: k = c pp + s in the loop), the embedding in piece 0 and the final LayerNorm, LM
head and loss in piece pp v - 1. It runs its schedule, a list of
Actions (hsgd.pp.schedules: F, B, W of a micro-batch and chunk), checked before the first message. Between pieces,
over pp_comm (the same dp and tp coordinates):

    forward of micro-batch j:   piece k   --activation-->        piece k+1, on stage (s+1) mod pp   tag 2(k m + j)
    backward of micro-batch j:  piece k   <--dL/d(activation)--  piece k+1                          tag 2(k m + j) + 1

(the stage of piece k+1 as the schedule's placement says, hsgd.pp.placement: (s+1) mod pp in the loop; when it is
this stage itself, the V's turn, the hand-off is kept here, no message).

The activation is what the tensor-parallel scheme hands from block to block: (B/m, T, C), or for the sequence
scheme this rank's T-shard (B/m, T/tp, C) (tp_model.stage_activation_shape). Sends are non-blocking and completed
at the end of the step; receives block. With a distinct tag per message and a schedule that schedules.check ran to
its end, no stage waits forever. A B whose schedule has a W for the same micro-batch and chunk keeps its weight-
gradient products (hsgd.tp.wgrad) for that W; otherwise it does them at once.

pp = 1 is a pipeline of one stage: the whole model, nobody to send to, and the schedule F0 B0 F1 B1 ... (1F1B with
no warm-up): plain gradient accumulation. Each micro-batch's backward starts from dloss = 1/m, so the gradients
that accumulate (+=) are those of the mean of the micro-batches' mean losses: the gradient of the DP group's slice.
"""
import time
from collections import namedtuple

from hsgd.tp import model as tp_model
from hsgd.model.backend import get_xp, resolve_dtype, to_host
from hsgd.cp.layouts import make_context
from hsgd.model.precision import make_numerics
from hsgd.fp8.scaling import make_fp8
from hsgd.errors import ConfigError
from hsgd.tp.hooks import NO_HOOKS
from hsgd.pp.chunks import parse_split, stage_chunks, stage_names
from hsgd.pp.schedules import KIND_NAMES, Pair, build, check, chunk_count, effective, flat, placement_of
from hsgd.model.threads import cpu_threads, parallel_batches
from hsgd.grid.trace import NullTracer
from hsgd.model.moe import update_selection_bias
from hsgd.ep.dispatch import AllToAll
from hsgd.ep.layout import holds
from hsgd.tp.experts import Experts
from hsgd.tp.wgrad import WeightGrads

# one model chunk of a stage: its piece k of the model, its blocks, whether it has the embedding / the head
Chunk = namedtuple("Chunk", "k layers first last")


class Stage:
    copies = 1                                  # stages holding each of its layers (DualStage: 2, hsgd.pp.dual)

    def __init__(self, cfg, grid, layout, recompute, data):
        """cfg: ModelConfig; grid: ProcessGrid; layout: the Layout settings (tp_scheme, cp_scheme, pp_split,
        schedule, virtual_stages, micro_batches); recompute: what the blocks keep (hsgd.tp.model.block_forward);
        data: the Data settings (dtype, reduce_dtype, device)."""
        self.cfg, self.scheme, self.m, self.recompute = cfg, layout.tp_scheme, layout.micro_batches, recompute
        self.xp, self.dtype = get_xp(data.device), resolve_dtype(data.dtype)   # (ZeRO-3: params may be empty here)
        self.tp_comm, self.pp_comm, self.s, p = grid.tp_comm, grid.pp_comm, grid.pp_rank, grid.pp
        self.grid, self.biases, self.routing = grid, {}, {}             # (the MoE blocks' selection biases, and
                                                                       # their routing in the last step)
        self.ctx = make_context(cfg, grid, layout.cp_scheme, data.device, layout.attention)   # my positions
        self.fp8 = make_fp8(data.fp8_settings())                       # --fp8: the casts' state, or None
        self.use(make_numerics(data.dtype, data.reduce_dtype))         # where bfloat16 / float16 round (precision)
        self.loss_scale = 1.0                                          # float16: the loss scaler's S (step.trainer)
        self.v = v = chunk_count(layout.schedule, layout.virtual_stages)   # (2 for the V and dual schedules)
        kind = effective(layout.schedule, p, v)                        # (one stage: 1F1B; v > 1 refused)
        self.placement = pl = placement_of(kind, p, v)                 # which stage holds each piece
        self.chunks = [Chunk(*ch) for ch in stage_chunks(cfg.n_layers, p, self.s, v, parse_split(layout.pp_split),
                                                         pl)]
        self.layers = [i for ch in self.chunks for i in ch.layers]    # every block this stage holds
        self.first, self.last = any(ch.first for ch in self.chunks), any(ch.last for ch in self.chunks)
        self.names = [n for ch in self.chunks for n in stage_names(cfg, ch.layers, ch.first, ch.last)
                      if holds(n, cfg, grid.ep, grid.ep_rank)]       # (with ep > 1: only my experts)
        everyone = build(kind, self.m, p, v)
        check(everyone, self.m, v, pl)                                 # before any message: refuses a deadlock
        check_tags(self.pp_comm, self.tag(pl.K - 1, self.m - 1) + 2)   # (+2: DualStage's)
        self.actions = everyone[self.s]
        self.peak_held, self.timeline, self.measure_bytes, self.peak_bytes = 0, [], False, 0

    def saved_names(self):
        """The parameters whose copy a checkpoint keeps from this stage: all it holds, but in the dual placement
        only those of its downward piece (pl.holder; the twin writes the other), each parameter once."""
        pl, mine = self.placement, set(self.names)
        return {n for c, ch in enumerate(self.chunks) if pl.holder(ch.k) == (self.s, c)
                for n in stage_names(self.cfg, ch.layers, ch.first, ch.last) if n in mine}

    def use(self, num):
        """Round where `num` (an hsgd.model.precision.Numerics) says: at the model's points (the TPSetup's scheme,
        layer functions and attention: hsgd.tp.rounded), and the tensor-parallel partial sums before they travel
        (comm.payload_round)."""
        self.num = num
        self.setup = tp_model.TPSetup(self.cfg, self.tp_comm, self.scheme, self.recompute, self.ctx, num,
                                      fp8=self.fp8)
        if self.cfg.moe_experts:                                       # the MoE blocks see the layout's ranks
            g = self.grid
            dispatcher = AllToAll(g.ep_comm, self.cfg.moe_experts) if g.ep > 1 else None   # hsgd.ep.dispatch
            self.setup.experts = Experts(self.cfg, self.tp_comm, g.cp_comm, g.dp_comm, g.dp, self.m, g.cp,
                                         dispatcher, self.biases)
        self.tp_comm.payload_round = num.payload if num.rounds and self.tp_comm.size > 1 else None

    def pieces(self, rows):
        """How a micro-batch of `rows` sequences is computed: in one piece (ThreadedStage: one per thread)."""
        return [rows]

    def groups(self):
        """{group: [names]}: this stage's parameters by gradient group, in the order the backward pass ends them."""
        out = {}
        for grp in tp_model.backward_order(self.cfg):
            names = [n for n in self.names if tp_model.param_group(n) == grp]
            if names:
                out[grp] = names
        return out

    def run(self, params, grads, mbs, on_ready=None, tracer=None, hooks=None):
        """One step of this stage: its actions on the micro-batches mbs = [(idx, targets)] (every stage has them;
        only the first piece uses idx, only the last targets). The gradients of (1/m) * each micro-batch's mean
        loss accumulate into `grads`; on_ready(group) is called when a group is final (after the last backward,
        or W, of its chunk); hooks (hsgd.tp.hooks.Hooks) run around every group's forward and backward. Returns
        (1/m) * the sum of the micro-batches' losses on the stage of the last piece (on the device), else 0.0, plus
        (1/m) * the auxiliary losses of this stage's MoE blocks (global_loss sums the stages). Records the (micro-
        batch, chunk) pairs held at once (peak_held) and when each action ran (timeline)."""
        tracer, self.hooks = tracer or NullTracer(), hooks or NO_HOOKS
        self.caches, self.kept, self.sends, self.loss, self.live = {}, {}, [], 0.0, 0
        self.handed = {}                                               # hand-offs between two pieces of this stage
        self.routing = {}                                              # {"h.{i}.moe": load, kept (E,), dropped}
        self.peak_held, self.peak_bytes, self.timeline = 0, 0, []
        acts = flat(self.actions)                                      # (a Pair: its F, then its B)
        split = {(a.mb, a.chunk) for a in acts if a.kind == "W"}
        final = {a.chunk: i for i, a in enumerate(acts) if a.kind == ("W" if (a.mb, a.chunk) in split else "B")}
        on_ready = self.final_groups(on_ready)
        i = 0
        for action in self.actions:
            parts = (action.f, action.b) if isinstance(action, Pair) else (action,)
            inputs = [self.receive(a, mbs) for a in parts]             # the wait here is the bubble
            t0 = time.perf_counter()
            args = dict(micro_batch=parts[0].mb, chunk=parts[0].chunk)
            if len(parts) > 1:                                         # F&B: the backward's too
                args.update(b_micro_batch=parts[1].mb, b_chunk=parts[1].chunk)
            with tracer.span(KIND_NAMES[action.kind], **args):
                for a, inp in zip(parts, inputs):
                    ready = on_ready if final[a.chunk] == i else None  # the chunk's groups are final after this
                    if a.kind == "F":
                        self.forward(a, inp, params, mbs[a.mb][1])
                    elif a.kind == "B":
                        self.backward(a, inp, grads, ready, (a.mb, a.chunk) in split)
                    else:
                        self.weights(a, grads, ready)
                    i += 1
                    if self.measure_bytes:                             # (a Pair: after its F and after its B)
                        self.peak_bytes = max(self.peak_bytes, self.bytes_held(params))
            self.timeline.append((action, t0, time.perf_counter()))
        for req, _ in self.sends:
            req.Wait()
        self.sends, self.caches, self.kept, self.handed = [], {}, {}, {}   # nothing held until the next step
        self.after_backward(grads)
        return self.loss / self.m

    def final_groups(self, on_ready):
        """What run() calls when a group's gradient is final on this stage: on_ready itself (DualStage: nothing
        until the two copies are summed)."""
        return on_ready

    def after_backward(self, grads):
        """After the step's actions (DualStage: the two copies' gradients summed)."""

    def update_biases(self, dp_comm):
        """Auxiliary-loss-free balancing, after a step: each MoE block's selection bias moves by the sign of its
        load error (hsgd.model.moe.update_selection_bias), the load being the step's slots per expert summed over
        the micro-batches and over dp_comm (every rank routing other rows of the step; the tp ranks route alike)."""
        for prefix, r in self.routing.items():
            total = dp_comm.Allreduce(self.xp.asarray(r["load"], dtype=self.xp.int64).copy())   # (E,) the step's
            old = self.biases.get(prefix, self.xp.zeros(self.cfg.moe_experts))
            self.biases[prefix] = update_selection_bias(old, total, self.cfg.moe_bias_rate)

    def receive(self, a, mbs):
        """The input of action a: the token ids, or the activation from piece k-1 (F); dloss = 1/m on the last
        piece, or the gradient from piece k+1 (B); nothing (W)."""
        ch, rows = self.chunks[a.chunk], len(mbs[a.mb][0])
        if a.kind == "W":
            return None
        if a.kind == "F" and ch.first:
            return self.xp.asarray(mbs[a.mb][0])
        if a.kind == "B" and ch.last:
            return self.loss_scale / self.m                            # d(S x mean over the micro-batches)
        if a.kind == "F":                                              # activation in, from piece k-1
            return self.take(rows, self.placement.before(self.s, a.chunk)[0], self.tag(ch.k - 1, a.mb))
        return self.take(rows, self.placement.after(self.s, a.chunk)[0], self.tag(ch.k, a.mb) + 1)   # gradient in

    def take(self, rows, source, tag):
        """The activation or gradient with `tag` from stage `source`: a message, or this stage's own hand-off (two
        pieces on one stage: the V's turn)."""
        if source == self.s:
            return self.handed.pop(tag)
        return self.recv_activation(rows, source=source, tag=tag)

    def hand(self, x, dest, tag):
        """x to stage `dest` with `tag`: a non-blocking send, or kept for this stage's next piece (no message)."""
        if dest == self.s:
            self.handed[tag] = x
        else:
            self.sends.append((self.pp_comm.Isend(x, dest=dest, tag=tag), x))

    def tag(self, k, j):
        """The tag of micro-batch j's activation from piece k to piece k+1 (its gradient: + 1)."""
        return 2 * (k * self.m + j)

    def recv_activation(self, batch, source, tag):
        shape = tp_model.stage_activation_shape(self.scheme, batch, self.cfg, self.tp_comm.size, self.ctx.cp)
        return self.pp_comm.Recv(self.xp.empty(shape, dtype=self.dtype), source=source, tag=tag)

    def forward(self, a, inp, params, targets):
        xp, ch = self.xp, self.chunks[a.chunk]
        out, self.caches[a.mb, a.chunk] = tp_model.stage_forward(params, inp, xp.asarray(targets), ch, self.setup,
                                                                 self.hooks)
        cache = self.caches[a.mb, a.chunk]
        if cache.moe is not None:
            self.loss = self.loss + cache.aux                          # the MoE blocks' auxiliary losses
            for prefix, aux in cache.moe.aux.items():                  # the step's routing, over its micro-batches
                old = self.routing.get(prefix, dict(load=0, kept=0, dropped=0))
                self.routing[prefix] = {k: old[k] + aux[k] for k in old}
        if ch.last:
            self.loss = self.loss + out                                # stays on the device
        else:
            out = xp.ascontiguousarray(out)                            # activation out, to piece k+1
            self.hand(out, self.placement.after(self.s, a.chunk)[0], self.tag(ch.k, a.mb))
        self.live += 1
        self.peak_held = max(self.peak_held, self.live)

    def backward(self, a, dout, grads, on_ready, split):
        """B: dL/d(the chunk's input), sent to piece k-1; the weight-gradient products kept for the W if split."""
        ch = self.chunks[a.chunk]
        wg = WeightGrads() if split else None
        dx = tp_model.stage_backward(dout, self.caches.pop((a.mb, a.chunk)), grads, self.setup, on_ready, self.hooks,
                                     wg, daux=self.loss_scale / self.m)   # (the auxiliary losses' d: as dloss's)
        if not ch.first:                                               # gradient out, to piece k-1
            dx = self.xp.ascontiguousarray(dx)
            self.hand(dx, self.placement.before(self.s, a.chunk)[0], self.tag(ch.k - 1, a.mb) + 1)
        if split:
            self.kept[a.mb, a.chunk] = wg
        else:
            self.live -= 1

    def weights(self, a, grads, on_ready):
        """W: the kept weight-gradient products of a micro-batch and chunk, group by group in backward order. In the
        chunk's last W each group is final as soon as its products are done: on_ready(group) then, so that its
        exchange starts while the W goes on with the groups below."""
        wg = self.kept.pop((a.mb, a.chunk))
        for group in self.chunk_groups(self.chunks[a.chunk]):
            wg.run(grads, group)                                       # (none for the embedding)
            if on_ready is not None:
                on_ready(group)
        self.live -= 1

    def chunk_groups(self, ch):
        """The gradient groups of one chunk, in backward order."""
        return ["head"] * ch.last + [f"h.{i}" for i in reversed(ch.layers)] + ["embedding"] * ch.first

    def bytes_held(self, params):
        """The bytes of the activations this stage holds now: every array its caches and kept weight-gradient
        products reach (a view counted as the array it views, once; the parameters not counted)."""
        def root(x):                                                   # the array a view views
            while getattr(x, "base", None) is not None and hasattr(x.base, "nbytes"):
                x = x.base
            return x
        skip, seen, total = {id(root(x)) for x in params.values()}, set(), 0   # (the flat parameter buffer)
        todo = [c[1:] for c in self.caches.values()] + [[e[2] for e in wg.later] for wg in self.kept.values()] + \
            list(getattr(self, "handed", {}).values())               # (hand-offs to this stage's next piece)
        while todo:
            x = todo.pop()
            if isinstance(x, (tuple, list)):
                todo.extend(x)
            elif hasattr(x, "nbytes") and hasattr(x, "base"):
                x = root(x)
                if id(x) not in seen and id(x) not in skip:
                    seen.add(id(x))
                    total += x.nbytes
        return total

    def loss_only(self, params, idx, targets, hooks=None):
        """The mean loss of one batch, forwards only through the pieces (evaluation): a float on every stage. An FP8
        run casts as in training but records nothing (its amax histories are the training steps')."""
        xp, x = self.xp, None
        if self.fp8 is not None:
            self.fp8.recording = False
        try:
            x = self.forwards_only(params, idx, targets, hooks)
        finally:
            if self.fp8 is not None:
                self.fp8.recording = True
        root = self.placement.stage(self.placement.K - 1)              # the stage holding the loss
        if self.s != root:
            return self.pp_comm.comm.bcast(None, root=root)
        return self.pp_comm.comm.bcast(float(to_host(xp.asarray(x))), root=root)

    def forwards_only(self, params, idx, targets, hooks):
        """loss_only's forwards through this stage's chunks, in the order of their pieces: the last chunk's output
        (the loss on the stage holding the last piece). The dual placement's pieces go down only (each is held
        twice: pl.holder names the downward copy)."""
        xp, pl, x, handed = self.xp, self.placement, None, {}
        mine = [ch for c, ch in enumerate(self.chunks) if pl.holder(ch.k) == (self.s, c)]
        for ch in sorted(mine, key=lambda c: c.k):
            if ch.first:
                inp = xp.asarray(idx)
            elif pl.stage(ch.k - 1) == self.s:
                inp = handed.pop(ch.k)                                 # from this stage's own piece k-1
            else:
                inp = self.recv_activation(len(idx), source=pl.stage(ch.k - 1), tag=ch.k)
            x, _ = tp_model.stage_forward(params, inp, xp.asarray(targets), ch, self.setup, hooks or NO_HOOKS)
            if not ch.last:
                out = xp.ascontiguousarray(x)
                if pl.stage(ch.k + 1) == self.s:
                    handed[ch.k + 1] = out
                else:
                    self.pp_comm.Isend(out, dest=pl.stage(ch.k + 1), tag=ch.k + 1).Wait()
        return x


def check_tags(pp_comm, largest):
    """Refuse a pipeline whose largest message tag MPI cannot carry (MPI promises tags up to 32767 at least;
    MPI.TAG_UB says how far this one goes)."""
    from mpi4py import MPI
    ub = pp_comm.comm.Get_attr(MPI.TAG_UB) if hasattr(pp_comm, "comm") else None
    if ub is not None and largest > ub:
        raise ConfigError(f"the pipeline's messages need tags up to {largest} (2 pp v m), more than this MPI's "
                          f"MPI_TAG_UB = {ub}; use fewer micro-batches or virtual stages")


class ThreadedStage(Stage):
    """A whole model on one rank (pp = 1, tp = 1) whose CPU threads split each micro-batch's sequences: data
    parallelism inside one process. Slice i of a micro-batch of b sequences (b_i of them) runs the forward and
    backward on its own thread with one BLAS thread (threads.parallel_batches), from dloss = (b_i / b) / m into a
    gradient buffer of its own (the last slice: into `grads` itself; the others allocate one per micro-batch,
    freed after it); the buffers are added at the end, in place of an All-Reduce. The same numbers as Stage.run up
    to rounding (the sums run in another order, which depends on the thread count), and no work is handed between
    threads inside a layer, which on small and mid-size models is the faster of the two ways to use the cores
    (tutorial 12).

    The tensor-parallel collectives of the slices run on a one-rank tp_comm: nothing moves, but each slice's calls
    are counted (pieces() says how many slices the last step used, for the byte formulas). An exchange that needs
    on_ready during the backward pass (--dp-overlap) or hooks around each group (ZeRO 2 and 3, --memory) gets the
    plain Stage.run: the slices finish their groups together, at the very end, so there would be nothing to
    overlap, and each slice would need the whole gradient."""
    threads_used = 1                                                   # slices per micro-batch in the last run

    def pieces(self, rows):
        """The slices' row counts for a micro-batch of `rows` sequences, as the last step split them."""
        n = max(1, min(self.threads_used, rows))
        return [rows * (i + 1) // n - rows * i // n for i in range(n)]

    def run(self, params, grads, mbs, on_ready=None, tracer=None, hooks=None):
        plain = self.xp.__name__ == "numpy" and on_ready is None and hooks is None
        self.threads_used = cpu_threads() if plain else 1
        if self.threads_used <= 1:
            return super().run(params, grads, mbs, on_ready, tracer, hooks)
        tracer = tracer or NullTracer()
        self.timeline, loss = [], 0.0
        for j, (idx, targets) in enumerate(mbs):
            t0 = time.perf_counter()
            with tracer.span("forward and backward", micro_batch=j):
                parts = parallel_batches(lambda lo, hi: self.part(params, grads, idx, targets, lo, hi), len(idx))
            for part_loss, part_grads in parts:
                loss = loss + part_loss
                if part_grads is not grads:
                    for name, a in part_grads.items():
                        grads[name] += a
            self.timeline.append((f"F{j}B{j}", t0, time.perf_counter()))
        self.peak_held = 1
        return loss / self.m

    def part(self, params, grads, idx, targets, lo, hi):
        """Sequences lo..hi-1 of a micro-batch: (their share of its loss, the gradient buffer they added into)."""
        xp, share = self.xp, (hi - lo) / len(idx)
        into = grads if hi == len(idx) else {n: xp.zeros_like(p) for n, p in grads.items()}
        out, cache = tp_model.stage_forward(params, xp.asarray(idx[lo:hi]), xp.asarray(targets[lo:hi]),
                                            self.chunks[0], self.setup)
        tp_model.stage_backward(share * self.loss_scale / self.m, cache, into, self.setup)
        return out * share, into
