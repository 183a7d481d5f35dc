"""The time of one training step, predicted: compute from the FLOPs, communication from the alpha-beta cost of each
collective on the link it crosses, and the pipeline from the schedule simulator (hsgd.pp.schedules).

Legend: B global batch, b micro-batch (sequences), m = B / (dp b) micro-batches, T sequence, C d_model, F d_ff,
V vocabulary, NH heads, L layers; dp, pp, cp, tp the grid, v chunks per stage; n bytes, p ranks in a group;
alpha the latency of a message and beta = 1 / bandwidth of the link (Hockney's model, hsgd.plan.hardware).

Every function returns seconds; with `why` (a list) it appends ("term", "formula = numbers = value") so that
`python -m hsgd.plan --explain` prints each cost as its formula with the numbers filled in.

1. Collectives (Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in
   MPICH"), n the payload as hsgd's CommStats counts it (Allreduce: the buffer; Reduce-Scatter: its whole input;
   All-Gather: its whole output):
       Allreduce       ring             2 (p-1) alpha + 2 (p-1)/p n beta
                       recursive doubling  ceil(log2 p) (alpha + n beta)              (short messages)
                       Rabenseifner     2 log2 p alpha + 2 (p-1)/p n beta              (p a power of two)
       Reduce-Scatter  ring             (p-1) alpha + (p-1)/p n beta
       All-Gather      recursive halving / doubling  log2 p alpha + (p-1)/p n beta    (p a power of two)
       All-to-All      pairwise exchange  (p-1) alpha + (p-1)/p n beta    (Alltoallv: this one only)
                       Bruck            ceil(log2 p) (alpha + n/2 beta)                (short messages)
       a message       alpha + n beta   (Recv, Irecv: the receiver waits for it; Isend does not block)
   A tuned MPI picks per size; the model takes the cheapest of the algorithms above. A hardware file measured
   by --calibrate has its own alpha and beta per collective and group size, used in place of these.
2. Links. Ranks are placed as hsgd.grid.process_grid places them (tp fastest, then cp, pp, dp), devices_per_node to
   a node. A group whose ranks span k consecutive ranks is inside a node when k divides devices_per_node: tp spans tp,
   cp spans cp tp, pp spans pp cp tp, dp (dp x cp ranks) the whole world; the hierarchical exchange's node part spans
   its ranks_per_node dp ranks; an expert-parallel group (ep_span) ep tp when pp = 1 or ep divides cp, ep pp tp when
   cp divides ep, else the whole world, and edp (the ranks holding the same experts) the whole world. Otherwise the
   group crosses the network, whose per-device link is the bottleneck of a ring.
3. Compute: matmul FLOPs at the rate hw.rate(dtype) (peak x efficiency, or what --calibrate measured). Per
   micro-batch on one rank of a stage, N = b T/cp rows: forward 2 N (4C^2 + 2CF)/tp per block (of the family:
   2 N (2C^2 + 2CK + m CF)/tp, micro_batch_flops), the attention's 4 S C/tp with S its query-key scores per sequence
   (T^2 without cp, hsgd.cp.split.attention_blocks with it; with flash attention the causal half), the head's
   2 N C V/tp; a MoE block's MLP is its k experts' and the router's, 2 N (k m C F/tp + C E) (hsgd.plan.experts).
   Backward: input gradients as much as the forward plus the attention's again, weight
   gradients as much as the linears' forward (B + W = 2 F). --recompute full adds the blocks' forward to B,
   selective the attention's. A MoE block's all-to-all (ep > 1, hsgd.plan.experts.alltoall_calls) is in F and B,
   not hidden.
   Elementwise work (LayerNorm, softmax, GELU, residuals, dropout) is bound by memory bandwidth: with the
   hardware file's memory_bandwidth, each activation a layer stores (Korthikanti et al. 2022's count,
   hsgd.plan.paper.activation_bytes, at the layout's bytes per element) is taken as written and read once in the
   forward and twice that in the backward (once more with full recomputation): 2, 4 (+2) x bytes / bandwidth,
   times the hardware's elementwise_passes; and block_overhead seconds per block and micro-batch that neither
   FLOPs nor bytes explain (both measured by --calibrate: hsgd.plan.calibrate.block_cost; 1 and 0 otherwise).
   The optimizer: its state's elements x the seconds per element --calibrate measured, or the bytes it moves per
   element at the memory bandwidth (a fused mixed-precision Adam: 28; hsgd's: 7 or 3 elements for AdamW or SGD).
4. The pipeline: every stage at the slowest stage's F, B, W costs (compute, its exposed tp, cp and ZeRO-3 gathers,
   and a received message per action; none where a piece hands its activation to a piece of the same stage, the
   V's turn on its last stage: hsgd.pp.placement.local_handoffs), through hsgd.pp.schedules.simulate on the
   schedule's placement: its makespan holds the bubble. While searching (simulated=False), gpipe, 1f1b and
   interleaved use the closed form the simulation equals for such stages; the layouts printed are priced again
   with the simulator. zb-h1, zb-v, dualpipev and dualpipe are always simulated, B and W apart where their lists
   split them. An overlapped pair of DualPipe(V) (F&B) is priced as its F and its whole backward, F + B + W: no
   credit for what the pair hides (DeepSeek-AI 2024 overlap one micro-batch's all-to-all and pipeline messages
   with the other's computation; how much that hides depends on kernels this model does not see). Every start in
   a fixed list only grows with the actions' lengths, so this makespan bounds the overlapped one from above.
   The dual placement (DualPipe, hsgd.pp.dual) runs each micro-batch through one of a stage's two pieces: a step
   runs the stage's chunks m/2 times (`runs`), not m, and ends with the stage's gradients sent to its twin and
   received from it (one message of G bytes each way, exposed: the data-parallel exchange starts after it, so
   --dp-overlap hides nothing there).
5. The data-parallel exchange, as its sizes say (hsgd.dp.exchange: when each collective runs, what hides it):
   after the pipeline, unless it overlaps (--dp-overlap: one bucket per group during the last micro-batch's
   backward; ZeRO 2 and 3: each micro-batch's reduce-scatters during its backward, ZeRO 3's gathers before each
   forward and backward; the stale exchange: during the whole next step): then only what the backward cannot hide,
   and at least the last bucket.
Left out: the optimizer's elementwise work, kernel launch and Python overheads,
contention between collectives that run at once, and compute slowed by communication it overlaps with.
"""
import math
from dataclasses import dataclass, field
from functools import lru_cache

from hsgd.cp.split import a2a_sizes, attention_blocks
from hsgd.pp.schedules import MAX_PIECES, PLACEMENTS, TWO_CHUNKS, build, effective, placement_of, simulate
from hsgd.tp.schemes import make_scheme
from .experts import alltoall_calls
from .family import kv_columns
from .paper import activation_bytes

BLOCKING = {"Allreduce", "Reduce_scatter_block", "Allgather", "Recv", "Irecv", "Iallreduce",
            "Ireduce_scatter_block", "Sendrecv", "Alltoall", "Alltoallv"}    # what a rank's step waits for (Isend: no)
BASE_OP = {"Iallreduce": "Allreduce", "Ireduce_scatter_block": "Reduce_scatter_block", "Recv": "Sendrecv",
           "Irecv": "Sendrecv", "Send": "Sendrecv", "Isend": "Sendrecv"}


def note(why, term, text):
    if why is not None:
        why.append((term, text))


def fmt_s(t):
    return f"{t * 1e3:.4g} ms" if t < 1 else f"{t:.4g} s"


# ---------------------------------------------------------------------------------------------- 1. collectives
def collective(op, n, p, link, hw=None, why=None, term=None):
    """Seconds of one call of `op` moving n payload bytes on a group of p ranks over `link` (see 1 above)."""
    base = BASE_OP.get(op, op)
    if p == 1 and base != "Sendrecv":
        return 0.0
    fit = hw.measured_cost(base, 2 if base == "Sendrecv" else p) if hw is not None else None
    if fit is not None:
        t = fit[0] + fit[1] * n
        note(why, term, f"{op} measured alpha + beta n = {fit[0]:.3g} + {fit[1]:.3g} x {n:.4g} = {fmt_s(t)}")
        return t
    a, b = link.latency, 1.0 / link.bandwidth
    lg, pow2 = math.ceil(math.log2(p)) if p > 1 else 0, p & (p - 1) == 0
    share = (p - 1) / p * n * b
    if base == "Allreduce":
        algos = {"ring": 2 * (p - 1) * a + 2 * share, "recursive doubling": lg * (a + n * b)}
        if pow2:
            algos["Rabenseifner"] = 2 * lg * a + 2 * share
    elif base in ("Reduce_scatter_block", "Allgather"):
        algos = {"ring": (p - 1) * a + share}
        if pow2:
            algos["recursive halving/doubling"] = lg * a + share
    elif base in ("Alltoall", "Alltoallv"):
        algos = {"pairwise": (p - 1) * a + share}
        if base == "Alltoall":
            algos["Bruck"] = lg * (a + n / 2 * b)
    else:                                                             # a message between two ranks
        algos = {"message": a + n * b}
    name = min(algos, key=algos.get)
    note(why, term, f"{op} of {n:.4g} B on {p} ranks over the {link.name} link ({name}; alpha {a:.3g} s, "
                    f"bandwidth {link.bandwidth:.3g} B/s) = {fmt_s(algos[name])}")
    return algos[name]


def traffic(counts, sizes, links, hw=None, why=None, only=None):
    """{comm: seconds a rank waits} for a step's {(comm, op): (calls, bytes)}: per call its share of the bytes.
    sizes: {comm: ranks}; links: {comm: Link}; only: comms to include (default all)."""
    out = {}
    for (comm, op), (calls, nbytes) in sorted(counts.items()):
        if op not in BLOCKING or not calls or (only is not None and comm not in only) or sizes[comm] == 1:
            continue                                   # (a 1-rank communicator: nothing moves, nothing waits)
        t = calls * collective(op, nbytes / calls, sizes[comm], links[comm], hw)
        note(why, comm, f"{calls} x {op} of {nbytes / calls:.4g} B on {sizes[comm]} ranks ({links[comm].name}) "
                        f"= {fmt_s(t)}")
        out[comm] = out.get(comm, 0.0) + t
    return out


# ---------------------------------------------------------------------------------------------- 2. links
def group_sizes(lay, exchange):
    """{communicator name: ranks} of a layout (lay: .dp .pp .cp .tp) and of its exchange's own (exchange: its
    sizes; the hierarchical exchange's and hybrid sharding's node and cross-node communicators)."""
    return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp, "ep": lay.ep, **exchange.comms()}


def group_links(lay, hw, exchange):
    """{communicator: the Link it crosses}: inside a node when its ranks span at most devices_per_node and the span
    divides it (the groups then align with the nodes; otherwise some group crosses, and all wait for it). A node
    communicator of the exchange spans its consecutive dp ranks, a cross-node one the whole dp span."""
    D, inner = hw.devices_per_node, lay.cp * lay.tp
    span = {"tp": lay.tp, "cp": inner, "pp": lay.pp * inner, "dp": lay.dp * lay.pp * inner}
    span["ep"] = ep_span(lay, span["dp"])
    for name, ranks in exchange.comms().items():
        span[name] = ranks * lay.pp * inner if name.endswith("-node") else span["dp"]
    return {c: hw.intra if k <= D and D % k == 0 else hw.inter for c, k in span.items()}   # (aligned to nodes)


def ep_span(lay, whole):
    """Ranks an expert-parallel group spans: ep consecutive members of dp_comm in its key order dp_rank cp + cp_rank
    (hsgd.ep.layout), tp apart when pp = 1 or ep divides cp (ep tp: the key's rank is key tp + tp_rank, or the cp
    ranks of one replica), ep/cp whole replicas pp cp tp apart when cp divides ep (ep pp tp); otherwise its groups
    straddle replicas unevenly: `whole`, the dp span."""
    if lay.pp == 1 or lay.cp % lay.ep == 0:
        return lay.ep * lay.tp
    return lay.ep * lay.pp * lay.tp if lay.ep % lay.cp == 0 else whole


# ---------------------------------------------------------------------------------------------- 3. compute
def a2a_p2p_exposed(lay, counts, links, hw, att):
    """The seconds of a step's cp traffic a rank waits for with --cp-scheme a2a+p2p (hsgd.cp.hierarchical): its
    Alltoalls on the a ranks of a group (cp = a r, hsgd.cp.split.a2a_sizes), a tp adjacent devices (inside a node
    when a tp divides it), all exposed; its Isend/Irecv on the ring of r groups, over cp_comm's link, hidden behind
    3 att (the scores) as the ring's are. att: one micro-batch's attention seconds, the counts a step's (m of them)."""
    a, r = a2a_sizes(lay.cp)
    D, span = hw.devices_per_node, a * lay.tp
    a2a = {k: v for k, v in counts.items() if k == ("cp", "Alltoall")}
    ring = {k: v for k, v in counts.items() if k[0] == "cp" and k[1] != "Alltoall"}
    inner = hw.intra if span <= D and D % span == 0 else hw.inter
    t_a2a = traffic(a2a, {"cp": a}, {"cp": inner}, hw).get("cp", 0.0)
    t_ring = traffic(ring, {"cp": r}, links, hw).get("cp", 0.0)
    return t_a2a + max(0.0, t_ring - 3 * att * lay.m)


def micro_batch_flops(cfg, b, tp, cp, n_blocks, last, recompute, why=None, attention="materialized", n_moe=0,
                      cp_scheme="ring"):
    """(F, B, W) matmul FLOPs of one micro-batch of b sequences on one rank of a stage (see 3 above), of the model's
    family: per token and block 2 (2C^2 + m C F)/tp + 2 C K_t (m = 2 with GELU, 3 with SwiGLU; K_t = the columns of k
    and v on a rank, NKV hs/tp, or hs when tp > NKV: hsgd.plan.family.kv_columns). Attention materialized: the
    whole T x T scores (the causal half computed too), F 4 S C/tp, B twice that. Flash (Dao 2023, FlashAttention-2):
    only the blocks the causal mask leaves, S = b T^2/2 without cp, and its backward computes the scores again:
    B = 10 S C/tp, 2.5 times the forward's. n_moe of the blocks are MoE: each token runs k experts, and the router
    (C, E), whole on every tp rank: + 2 N ((k - 1) m C F/tp + C E) per MoE block. With context parallelism the ring
    skips the chunk pairs the mask hides (hsgd.cp.split.attention_blocks), and so does a2a+p2p's ring of groups (the
    same count, hsgd.cp.hierarchical.group_scores); the all-gather scores its T/cp queries against all T keys, and
    Ulysses all T positions of its NH/cp heads: T^2/cp a head either way."""
    T, C, F, V = cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.vocab_size
    m, K = (2 if cfg.mlp == "gelu" else 3), kv_columns(cfg, tp)
    N = b * T // cp
    scores = b * (T * T if cp == 1 else attention_blocks(T, cp, 0) if cp_scheme in ("ring", "a2a+p2p") else T * T // cp)
    if attention == "flash" and cp == 1:
        scores = scores / 2                                          # (the blocks under the diagonal)
    lin = n_blocks * 2 * N * (2 * C * C + 2 * C * K * tp + m * C * F) / tp + (2 * N * C * -(-V // tp) if last else 0)
    if n_moe:                                                        # k experts a token, and the router
        lin += n_moe * 2 * N * ((cfg.moe_top_k - 1) * m * C * F / tp + C * cfg.moe_experts)
    att = n_blocks * 4 * scores * C / tp
    f, bwd, w = lin + att, lin + (2.5 if attention == "flash" else 2) * att, lin
    # selective recomputation drops the probabilities and computes them again: only where they are kept (whole
    # attention without cp materialized, the all-gather, Ulysses); the ring, a2a+p2p and flash keep none
    keeps = (attention != "flash") if cp == 1 else cp_scheme in ("allgather", "ulysses")
    extra = {"full": lin - (2 * N * C * -(-V // tp) if last else 0) + att,
             "selective": att if keeps else 0.0}.get(recompute, 0.0)
    note(why, "compute", f"F = 2 N (2C^2 + 2C K_t tp + {m} C F)/tp x {n_blocks} blocks + 4 S C/tp x {n_blocks}"
                         + (" + 2 N C Vp (head)" if last else "")
                         + (f" + 2 N ((k-1) {m} C F/tp + C E) x {n_moe} MoE blocks" if n_moe else "")
                         + f" = {f:.4g} FLOP (N = {N}, K_t = {K}, S = "
                         f"{scores:.6g}, attention {attention}); B = {bwd + extra:.4g} (recompute {recompute}: "
                         f"+{extra:.4g}), W = {w:.4g}")
    return f, bwd + extra, w


# ---------------------------------------------------------------------------------------------- 4. the pipeline
@lru_cache(maxsize=8)
def vshape_actions(kind, m, p, v):
    """hsgd.pp.schedules.build's lists of a V or dual schedule (TWO_CHUNKS), kept for the next costs priced on them;
    ConfigError where the schedule does not exist for m, p (hsgd.pp.vshape.check_counts) or has more than
    MAX_PIECES to write down."""
    return build(kind, m, p, v)


@lru_cache(maxsize=4096)
def makespan(kind, m, p, v, f, b, w, simulated=True):
    """Seconds from the first forward to the last backward of hsgd.pp.schedules' `kind` with per-chunk costs (f, b, w)
    on every stage: the simulator of Step 13 (fused backward b + w for every kind but zb-h1; zb-v, dualpipev and
    dualpipe split B and W where their lists do, on their placement, a Pair costing f + b + w). simulated=False (or
    more than hsgd.pp.schedules.MAX_PIECES to simulate): gpipe, 1f1b and interleaved take their closed form, which
    equals the simulation exactly when every stage costs the same (tests/test_plan.py):  (m v + p - 1)(f + b + w),
    as here. zb-h1 is simulated up to MAX_PIECES (beyond: m(f + b + w) + (p - 1)(f + b - w), its closed form where
    m >= p and w <= min(f, b), else 1F1B's), in integer units
    of f / 100 (B and W rounded to them: at most 0.5% off), because its greedy list breaks ties between equal
    times, which floating-point noise would decide."""
    kind = effective(kind, p, v)
    if kind in TWO_CHUNKS:                                  # (their lists do not depend on the costs: built once)
        timeline = simulate(vshape_actions(kind, m, p, v), m, v, (f, b, w), placement_of(kind, p, v))
        return max(end for stage in timeline for _, _, end in stage)
    if kind == "zb-h1" and p * v * m > MAX_PIECES:          # too many to write down: the closed form, where it holds
        idle = (p - 1) * (f + b - w) if m >= p and w <= min(f, b) else None     # (timelines.bubble_formula)
        return m * (f + b + w) + idle if idle is not None else (m * v + p - 1) * (f + b + w)   # else 1F1B's
    if kind == "zb-h1":
        unit = f / 100
        costs = (100.0, float(round(b / unit)), float(round(w / unit)))
        timeline = simulate(build(kind, m, p, v, costs), m, v, costs)
        return unit * max(end for stage in timeline for _, _, end in stage)
    if not simulated or p * v * m > MAX_PIECES:             # (too many to write down: the closed form, exact here)
        return (m * v + p - 1) * (f + b + w)
    costs = (f, b + w, 0.0)
    timeline = simulate(build(kind, m, p, v, costs), m, v, costs)
    return max(end for stage in timeline for _, _, end in stage)


@dataclass
class StepTime:
    """Seconds of one step, by what a rank spends them on; total = their sum."""
    compute: float
    tp: float
    pp_bubble: float
    pp_transfer: float
    cp: float
    dp: float
    zero_gather: float = 0.0
    elementwise: float = 0.0
    optimizer: float = 0.0
    ep: float = 0.0                                      # the experts' all-to-all
    terms: list = field(default_factory=list)            # the --explain lines: (term, text)

    @property
    def total(self):
        return (self.compute + self.elementwise + self.tp + self.pp_bubble + self.pp_transfer + self.cp + self.dp
                + self.zero_gather + self.optimizer + self.ep)

    def parts(self):
        out = {"compute": self.compute, "elementwise": self.elementwise, "tp": self.tp, "pp bubble": self.pp_bubble,
               "pp transfer": self.pp_transfer,
               "cp": self.cp, "dp": self.dp, "zero-3 gather": self.zero_gather, "optimizer": self.optimizer}
        return out | ({"ep all-to-all": self.ep} if self.ep else {})          # (a dense model's parts as before)


def runs(lay):
    """How many times a step runs all of a stage's chunks: m, each micro-batch passing every chunk; m/2 in the dual
    placement (DualPipe), where each micro-batch passes one of the stage's two pieces (hsgd.pp.dual)."""
    return lay.m // 2 if lay.pp > 1 and PLACEMENTS.get(lay.schedule) == "dual" else lay.m


def twin_bytes(ex):
    """The bytes a stage of the dual placement sends its twin once a step, and receives: its gradients, G = the
    exchange's elements x itemsize (hsgd.pp.dual; what hsgd.accounting.traffic.rank_bytes counts)."""
    return sum(ex.numel.values()) * ex.itemsize


def stage_costs(cfg, lay, stage, hw, rate, sizes, links, mine=None):
    """One run of all its chunks (one micro-batch; see `runs`) on one rank of a stage, stage = (n_blocks, first,
    last, its bytes of a step, its exchange's sizes, its MoE blocks, its index s of pp): {"f", "b", "w": the seconds
    of its forward, backward and weight gradients as the pipeline schedules them (compute, elementwise, exposed tp,
    cp and the exchange's gathers, the messages received, the experts' all-to-all), and their parts "compute",
    "ew", "tp", "cp", "msg", "gather", "rs", "ep"; "twin": the dual placement's gradient exchange with the twin
    stage, once a step}; mine: its --explain lines."""
    n_blocks, first, last, counts, ex, n_moe, s = stage
    p, v = lay.pp, lay.v
    m = runs(lay)                                     # (below, "per micro-batch": per run of all the chunks)
    pl = placement_of(effective(lay.schedule, p, v), p, v)
    local, twin = pl.local_handoffs(s), (twin_bytes(ex) if pl.shape == "dual" else 0)
    fl, bl, wl = micro_batch_flops(cfg, lay.b, lay.tp, lay.cp, n_blocks, last, lay.recompute, mine, lay.attention,
                                   n_moe, lay.cp_scheme)
    t = traffic(counts, sizes, links, hw)
    tp_mb = t.get("tp", 0.0) / m
    fwd = make_scheme(lay.tp_scheme).block_forward_formula(cfg, lay.b, lay.itemsize, lay.cp)
    tp_f = sum(n_blocks * c * collective(op, nb / max(c, 1), lay.tp, links["tp"], hw)
               for (_, op), (c, nb) in fwd.items()) if lay.tp > 1 else 0.0
    tp_f = min(tp_f, tp_mb)
    cp_mb = t.get("cp", 0.0) / m
    att = n_blocks * 4 * lay.b * (cfg.seq_len ** 2 if lay.cp == 1 else attention_blocks(cfg.seq_len, lay.cp, 0)) \
        * cfg.d_model / lay.tp / rate
    cp_exposed = max(0.0, cp_mb - 3 * att) if lay.cp_scheme == "ring" else cp_mb   # ring: hidden behind scores;
    # allgather's collectives and Ulysses' all-to-alls (each waited for by the attention or by what follows): exposed
    if lay.cp_scheme == "a2a+p2p":                   # all-to-alls on a ranks (a tp adjacent devices), exposed; the
        cp_exposed = a2a_p2p_exposed(lay, counts, links, hw, att) / m        # ring across the r groups: hidden
    msg_f = msg_b = twin_s = 0.0                      # per micro-batch: the activations its forwards receive
    if p > 1:                                          # (v - first - local), the gradients its backwards (v - last
        calls, nbytes = counts.get(("pp", "Recv"), (0, 0))                   # - local); local hand-offs: none
        calls, nbytes = calls - bool(twin), nbytes - twin                    # (the twin's gradient: apart)
        one = collective("Recv", nbytes / calls, 2, links["pp"], hw) if calls else 0.0
        msg_f, msg_b = (v - first - local) * one, (v - last - local) * one
        twin_s = collective("Recv", twin, 2, links["pp"], hw) if twin else 0.0
        note(mine, "pp", f"a message of {nbytes / max(calls, 1):.4g} B over the {links['pp'].name} link "
                         f"{fmt_s(one)}; per micro-batch {v - first - local} received by the forwards, "
                         f"{v - last - local} by the backwards" + (f" ({local} hand-off to itself: no message)"
                                                                 if local else "")
                         + (f"; once a step the gradients to the twin stage {p - 1 - s} and back, {twin:.4g} B "
                            f"each way, {fmt_s(twin_s)}" if twin else ""))
    gather = rs = 0.0
    for (comm, op), (calls, nbytes) in ex.formula().items():
        one = collective(op, nbytes / max(calls, 1), sizes[comm], links[comm], hw) if calls else 0.0
        if ex.when((comm, op)) == "forward and backward":            # ZeRO-3's gathers: before each F and each B
            gather += calls * one / (2 * m)
        elif ex.when((comm, op)) == "backward":                      # each micro-batch's, behind its backward
            per_mb = calls * one / m
            rs += max(per_mb * m / calls, per_mb - (bl + wl) / rate)
    ep_f = ep_b = 0.0                                 # per micro-batch: the experts' all-to-all, not hidden
    if n_moe and lay.ep > 1:
        forward, backward = alltoall_calls(cfg, lay.b, lay.cp, lay.ep, lay.itemsize)
        ep_f, ep_b = (n_moe * sum(collective(op, nb, lay.ep, links["ep"], hw) for op, nb in calls)
                      for calls in (forward, backward))
        ep_b += ep_f if lay.recompute == "full" else 0.0
        note(mine, "ep", f"per micro-batch {n_moe} MoE blocks x ({', '.join(f'{op} {nb:.4g} B' for op, nb in forward)}"
                         f" in F; {', '.join(f'{op} {nb:.4g} B' for op, nb in backward)} in B) on {lay.ep} ranks over "
                         f"the {links['ep'].name} link = {fmt_s(ep_f)} in F, {fmt_s(ep_b)} in B")
    ew = 0.0
    if hw.memory_bandwidth:
        for moe, n in ((False, n_blocks - n_moe), (True, n_moe)):       # dense blocks, MoE blocks
            if n:
                act = activation_bytes(cfg, lay.b, lay.tp, lay.tp_scheme == "sequence", "none", lay.cp,
                                       lay.attention, moe) * lay.itemsize / 2
                ew += n * act * hw.elementwise_passes / hw.memory_bandwidth   # a write and a read per activation
    ew_f, ew_b = 2 * ew, (4 + 2 * (lay.recompute == "full")) * ew
    over = n_blocks * hw.block_overhead / 2                           # per block and micro-batch: half F, half B
    ew_f, ew_b = ew_f + over, ew_b + over
    note(mine, "elementwise", f"{n_blocks} blocks x (2 forward + {4 + 2 * (lay.recompute == 'full')} backward) x "
                              f"{hw.elementwise_passes:.3g} passes x the stored activations / the memory bandwidth "
                              f"+ {n_blocks} x block_overhead {fmt_s(hw.block_overhead)} = {fmt_s(ew_f + ew_b)} "
                              "per micro-batch")
    note(mine, "tp", f"per micro-batch {fmt_s(tp_mb)}: the blocks' forward collectives {fmt_s(tp_f)} in F, "
                     f"the rest in B")
    f = fl / rate + ew_f + tp_f + cp_exposed / 3 + msg_f + gather + ep_f
    b = bl / rate + ew_b + (tp_mb - tp_f) + 2 * cp_exposed / 3 + msg_b + gather + rs + ep_b
    w = wl / rate
    return dict(compute=(fl + bl + wl) / rate, ew=ew_f + ew_b, tp=tp_mb, cp=cp_exposed, msg=msg_f + msg_b,
                gather=2 * gather, rs=rs, ep=ep_f + ep_b, f=f, b=b, w=w, twin=twin_s, counts=counts)


def step_time(cfg, lay, stages, hw, rate, explain=False, simulated=True, optimizer_s=0.0):
    """StepTime of layout `lay` (.dp .pp .cp .tp .v .b .m .schedule .recompute .tp_scheme .cp_scheme) whose stages
    are [(n_blocks, first, last, bytes of one step on that stage's rank, its exchange's sizes: hsgd.dp.exchange,
    its MoE blocks, its index s of pp)], on hardware hw with matmul rate `rate` FLOP/s (see the module docstring).
    A step runs each stage's chunks m times (the dual placement: m/2, `runs`)."""
    why = [] if explain else None
    ex = stages[0][4]                                     # (every stage's exchange has the same communicators)
    sizes, links, p, v = group_sizes(lay, ex), group_links(lay, hw, ex), lay.pp, lay.v
    m = runs(lay)
    priced = []
    for s, stage in enumerate(stages):
        mine = [] if explain else None                    # this stage's --explain lines (the slowest one's are kept)
        priced.append(dict(stage_costs(cfg, lay, stage, hw, rate, sizes, links, mine), stage=s, why=mine))
    worst = max(priced, key=lambda c: c["f"] + c["b"] + c["w"])      # (the first of equals)
    if why is not None:
        n_blocks, first, last = stages[worst["stage"]][:3]
        why.append(("stage", f"the slowest stage, whose costs every stage is priced at: {n_blocks} blocks"
                             + (", the embedding" if first else "") + (", the head" if last else "")))
        why.extend(worst["why"])
    kind = effective(lay.schedule, p, v)
    span = makespan(kind, lay.m, p, v, worst["f"] / v, worst["b"] / v, worst["w"] / v, simulated)
    busy = m * (worst["f"] + worst["b"] + worst["w"])
    twin = max(c["twin"] for c in priced)                # (dual: the slowest pair of twins; else 0)
    pairs = "; a pair F&B priced F + B + W" if kind in ("dualpipev", "dualpipe") else ""
    unit = "per micro-batch" if m == lay.m else "per two micro-batches (one down its piece, one up the other)"
    note(why, "pipeline", f"{lay.schedule} on p = {p} stages, m = {lay.m}, v = {v}: {unit} F "
                          f"{fmt_s(worst['f'])}, B {fmt_s(worst['b'])}, W {fmt_s(worst['w'])}{pairs}; simulated "
                          f"makespan {fmt_s(span)}, of which busy {'m/2' if m != lay.m else 'm'} (F + B + W) = "
                          f"{fmt_s(busy)}, bubble {fmt_s(max(span - busy, 0.0))}")
    dp = dp_exposed(lay, worst, stages[worst["stage"]][4], sizes, links, hw, why, m, twin > 0)
    st = StepTime(compute=m * worst["compute"], tp=m * worst["tp"], pp_bubble=max(span - busy, 0.0),
                  pp_transfer=m * worst["msg"] + twin, cp=m * worst["cp"], dp=dp + m * worst["rs"],
                  zero_gather=m * worst["gather"], elementwise=m * worst["ew"], optimizer=optimizer_s,
                  ep=m * worst["ep"], terms=why or [])
    note(why, "optimizer", f"its elements x the measured seconds per element, or the bytes it moves / bandwidth "
                           f"= {fmt_s(optimizer_s)}")
    if explain:
        traffic(worst["counts"], sizes, links, hw, why)
    return st


def dp_exposed(lay, worst, ex, sizes, links, hw, why, m, after_twin=False):
    """Seconds of the data-parallel exchange not hidden behind the backward pass (see 5 above): its collectives that
    run after the pipeline (ex.when; ZeRO 2 and 3's reduce-scatters and ZeRO 3's gathers are counted per micro-batch
    in step_time), less what its hidden_by hides; m runs of the stage's chunks a step. after_twin: the dual
    placement, whose exchange starts only once the twins' gradients are summed (hsgd.pp.dual): buckets hide none."""
    counts = {k: v for k, v in worst["counts"].items() if k in ex.formula() and ex.when(k) == "after"}
    t = sum(traffic(counts, sizes, links, hw).values())
    if ex.hidden_by == "buckets" and after_twin:
        exposed = t
    elif ex.hidden_by == "buckets":                       # all but the last bucket, behind the backward pass
        groups = max(sum(calls for calls, _ in counts.values()), 1)
        exposed = max(t / groups, t - worst["b"] - worst["w"])
    elif ex.hidden_by == "next step":                     # behind the whole next step
        exposed = max(0.0, t - m * (worst["f"] + worst["b"] + worst["w"]))
    else:
        exposed = t
    note(why, "dp", f"exchange {fmt_s(t)} ({'overlapped' if exposed < t else 'after the pipeline'}), exposed "
                    f"{fmt_s(exposed)}")
    return exposed
