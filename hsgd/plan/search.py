"""Every layout a model allows on n devices, what each needs and how fast it runs, best first.

A layout (`Layout`) is dp x pp x cp x tp = n devices, v chunks per stage, a ZeRO stage, the tensor-parallel scheme
(megatron, or sequence: Korthikanti et al. 2022's sequence parallelism), recomputation, a micro-batch of b
sequences (m = B / (dp b) micro-batches), a pipeline schedule and, for a mixture-of-experts model, ep: the ranks of
dp x cp that split each MoE block's experts (hsgd.ep.layout; ep divides dp cp and E). `evaluate` prices one:

    memory      per device by category: hsgd's own (--impl hsgd: hsgd.plan.layout, equal to what hsgd.train
                measures; dense models only) or a Megatron-style mixed-precision run's (--impl megatron:
                hsgd.plan.paper, its parameters per tp rank hsgd.plan.family.megatron_numel and, of the experts,
                hsgd.plan.experts.rank_numel, its attention Layout.attention); it fits
                within (1 - headroom) x the device's memory (HEADROOM, 10%, unless told)
    bytes       per step on each communicator (hsgd.accounting.traffic.rank_bytes; the experts' all-to-all and
                their exchange over edp: hsgd.plan.experts), and on each link type
    time        hsgd.plan.costs.step_time: compute, exposed tp, pp bubble and transfers, cp, dp, ep
    throughput  tokens/s = B T / step time; MFU = the model's FLOPs without recomputation / (time n peak);
                TFLOP/s per device as Narayanan et al. 2021 count it (with recomputation's FLOPs when on)

`search` enumerates (`layouts`), drops what does not split or fit, and sorts by step time. Its schedules are 1F1B
and interleaved unless told (space["schedule"], --schedule): gpipe, zb-h1 and the two-chunk schedules zb-v,
dualpipev and dualpipe too (v = 2 for these; each only where it applies: `schedule_problem`). DualPipe's stage
holds two pieces of the model (hsgd.pp.placement "dual"): its parameters, gradients and optimizer state are those
of both (hsgd.plan.layout.PlannedStage), twice a one-copy schedule's over the stages, and it sends its gradients to
its twin once a step (rank_bytes, hsgd.plan.costs); activations are peak_formula's (micro-batch, chunk) pairs
times a chunk's layers.
"""
from dataclasses import dataclass, replace
from types import SimpleNamespace

from hsgd.model.config import check_at_most, divisors
from hsgd.cp.split import CP_SCHEMES, check_heads
from hsgd.errors import ConfigError, UsageError
from hsgd.dp.make import exchange_sizes
from hsgd.accounting.traffic import rank_bytes
from hsgd.step.settings import MAX_RANKS, TrainConfig
from hsgd.pp.schedules import PLACEMENTS, TWO_CHUNKS
from hsgd.pp.vshape import check_counts
from hsgd.pp.timelines import peak_formula
from .costs import group_links, group_sizes, step_time
from .layout import ITEMSIZE, PlannedStage, plan_rank
from .experts import FoldedExchange, alltoall_formula, expert_groups, in_backward_order, rank_numel
from .family import megatron_numel
from .paper import stage_memory

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1", "zb-v", "dualpipev", "dualpipe")   # --schedule's choices;
                                                         # searched unless it is given: 1f1b and interleaved


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    cp: int = 1
    v: int = 1                       # chunks per stage (interleaved; 2 for zb-v, dualpipev, dualpipe)
    zero: int = 0
    tp_scheme: str = "megatron"      # or "sequence" (sequence parallelism)
    recompute: str = "none"          # "selective", "full"
    b: int = 1                       # sequences per micro-batch
    m: int = 1                       # micro-batches per step, B / (dp b)
    schedule: str = "1f1b"
    dp_overlap: bool = False
    dp_staleness: int = 0
    hierarchical: bool = False
    ranks_per_node: int = None
    cp_scheme: str = "ring"
    itemsize: int = 2                # bytes per element moved and held (hsgd: its dtype's; megatron: 2)
    attention: str = "materialized"  # or "flash": no stored scores (hsgd.plan.paper.activation_bytes)
    ep: int = 1                      # expert-parallel ranks, folded out of dp x cp (MoE models)

    def name(self):
        parts = [f"dp{self.dp} pp{self.pp} tp{self.tp}"] + ([f"cp{self.cp} {self.cp_scheme}"] if self.cp > 1 else [])
        parts[-1] += f" ep{self.ep}" if self.ep > 1 else ""
        parts.append(f"b{self.b} m{self.m}")
        if self.pp > 1:
            parts.append(self.schedule + (f" v{self.v}" if self.v > 1 and self.schedule not in TWO_CHUNKS else ""))
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += ["sp"] if self.tp_scheme == "sequence" else []
        parts += [f"recompute {self.recompute}"] if self.recompute != "none" else []
        parts += ["overlap"] if self.dp_overlap else []
        parts += ["hierarchical"] if self.hierarchical else []
        return ", ".join(parts)

    def train_config(self, batch, dtype, optimizer="adamw"):
        """The hsgd.train settings of this layout (checked: TrainConfig.validate)."""
        tc = TrainConfig(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, virtual_stages=self.v, zero=self.zero,
                         tp_scheme=self.tp_scheme, recompute=self.recompute, micro_batches=self.m,
                         schedule=self.schedule, dp_overlap=self.dp_overlap, dp_staleness=self.dp_staleness,
                         hierarchical=self.hierarchical, ranks_per_node=self.ranks_per_node,
                         cp_scheme=self.cp_scheme, batch_size=batch, dtype=dtype, optimizer=optimizer, ep=self.ep)
        tc.validate()
        tc.resolve_layout(self.dp * self.pp * self.cp * self.tp)
        return tc


def check_model(cfg, tp, cp=1, sequence=False):
    """None if the model splits over tp and cp (heads, d_ff, and key/value heads or tp a multiple of them; the
    sequence for sp and cp), else why not."""
    if cfg.n_heads % tp or cfg.d_ff % tp:
        return f"n_heads={cfg.n_heads} and d_ff={cfg.d_ff} must divide by tp={tp}"
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        return f"n_kv_heads={cfg.n_kv_heads} and tp={tp}: one must divide the other"
    if sequence and cfg.seq_len % (tp * cp):
        return f"seq_len={cfg.seq_len} must divide by tp x cp = {tp * cp} for sequence parallelism"
    if cp > 1 and cfg.seq_len % (2 * cp):
        return f"seq_len={cfg.seq_len} must divide by 2 cp = {2 * cp}"
    return None


MAX_DEVICES = MAX_RANKS   # devices of a plan: a job's ranks
MAX_BATCH = 2**30         # sequences in a planned step
MAX_LAYOUTS = 100_000     # layouts one search prices (about 0.4 ms each: some 40 s), and 10x that looked at


def check_search(cfg, batch, n):
    """Raise ConfigError unless n devices and a batch of `batch` sequences are within the stated maxima (the model's
    own sizes are bounded by ModelConfig): checked before any loop depends on them."""
    check_at_most("devices", n, MAX_DEVICES, f"plan for at most {MAX_DEVICES} devices")
    check_at_most("batch", batch, MAX_BATCH, f"plan a batch of at most {MAX_BATCH} sequences")


def too_many(what):
    return ConfigError(f"the search space holds more than {what}; narrow it with --tp, --pp, --cp, --micro-batch, "
                       "--schedule, --virtual, --zero or --recompute")


def layouts(cfg, batch, n, space):
    """Every Layout of n devices that the model allows, over `space` (a dict of lists: tp, pp, cp, v, zero,
    tp_scheme, recompute, b, schedule, dp_overlap, hierarchical, ep, cp_scheme; attention: one of them, the run's,
    default materialized; None: every value that applies; node_ranks: the
    devices of a node, for the hierarchical exchange). The sizes are the divisors of n (the lists given: their
    values that divide it, each once), and at most MAX_LAYOUTS layouts are made (ConfigError beyond)."""
    check_search(cfg, batch, n)
    out, looked = [], 0
    attention = (space.get("attention") or ["materialized"])[0]
    tps = [t for t in dict.fromkeys(space.get("tp") or divisors(n)) if n % t == 0]
    for tp in tps:
        for cp in dict.fromkeys(space.get("cp") or [1]):
            if n % (tp * cp) or check_model(cfg, tp, cp) is not None:
                continue                                       # (sequence parallelism needs more, never less)
            for pp in dict.fromkeys(space.get("pp") or divisors(n // (tp * cp))):
                if n % (tp * cp * pp) or pp > cfg.n_layers:
                    continue
                dp = n // (tp * cp * pp)
                if batch % dp:
                    continue
                eps = expert_sizes(cfg, dp * cp, space.get("ep"))
                for b in dict.fromkeys(space.get("b") or [x for x in (1, 2, 4, 8) if (batch // dp) % x == 0]):
                    if (batch // dp) % b:
                        continue
                    m = batch // dp // b
                    scheds = space.get("schedule") or ["1f1b", "interleaved"]
                    for sched in (scheds if pp > 1 else ["1f1b"]):            # (one stage: every schedule alike)
                        for v in chunk_counts(sched, space.get("v")):
                            looked += 1
                            if looked > 10 * MAX_LAYOUTS:
                                raise too_many(f"{10 * MAX_LAYOUTS} combinations of sizes")
                            if sched == "interleaved" and v > 1 and (pp * v > cfg.n_layers or m % pp):
                                continue
                            if schedule_problem(cfg, sched, pp, m) is not None:
                                continue                                   # (the V and dual schedules' own)
                            for more in options(space, dp * cp, space.get("node_ranks") and
                                                space["node_ranks"] // (pp * cp * tp), eps, cp_schemes(cfg, tp, cp,
                                                                                                     space)):
                                lay = Layout(dp=dp, pp=pp, tp=tp, cp=cp, v=v, b=b, m=m, schedule=sched,
                                             attention=attention, **more)
                                if lay.tp_scheme == "sequence" and tp == 1:
                                    continue                               # the same as megatron at tp = 1
                                if schedule_problem(cfg, sched, pp, m, lay.zero) is not None:
                                    continue                               # (ZeRO 2 and 3)
                                if check_model(cfg, tp, cp, lay.tp_scheme == "sequence") is None:
                                    out.append(lay)
                                    if len(out) > MAX_LAYOUTS:
                                        raise too_many(f"{MAX_LAYOUTS} layouts")
    return out


def chunk_counts(sched, given=None):
    """The chunks per stage a layout of schedule `sched` may take: those given (default 2) for interleaved, 2 for
    the V and dual schedules (hsgd.pp.schedules.TWO_CHUNKS, whatever --virtual says), 1 for the others."""
    if sched in TWO_CHUNKS:
        return [2]
    return list(dict.fromkeys(given or [2])) if sched == "interleaved" else [1]


def schedule_problem(cfg, sched, pp, m, zero=0):
    """None if the V or dual schedule `sched` (TWO_CHUNKS) runs the model on pp > 1 stages with m micro-batches and
    ZeRO stage `zero`, else why not (the other schedules: None). The V cuts the L layers into 2 pp pieces (2 pp <=
    L); dualpipev needs m >= 2 pp, dualpipe pp even, m even and m >= 2 pp (hsgd.pp.vshape.check_counts) and no
    experts (hsgd.pp.dual: each copy would route its own half of the tokens); none of them ZeRO 2 or 3 (their
    weight gradients come after the backward that reduce-scatters them: hsgd.step.settings)."""
    if sched not in TWO_CHUNKS:
        return None
    if PLACEMENTS[sched] == "v" and 2 * pp > cfg.n_layers:
        return (f"schedule {sched} cuts the L={cfg.n_layers} layers into 2 pp = {2 * pp} pieces: pp={pp} is too "
                f"many; use pp <= {cfg.n_layers // 2}")
    if sched == "dualpipe" and cfg.moe_experts:
        return "schedule dualpipe keeps two copies of every piece, whose experts would route apart: use dualpipev"
    if zero >= 2:
        return (f"schedule {sched} computes weight gradients after the backward that ZeRO {zero} reduce-scatters "
                f"them in: use ZeRO 0 or 1")
    try:
        check_counts(sched, m, pp)
    except ConfigError as err:
        return str(err)
    return None


def expert_sizes(cfg, ndp, given=None):
    """The ep a layout of ndp = dp cp ranks may take: 1 for a dense model, else those of `given` (default: all) that
    divide both ndp and the experts E."""
    if not cfg.moe_experts:
        return [1]
    return [e for e in dict.fromkeys(given or divisors(ndp)) if ndp % e == 0 and cfg.moe_experts % e == 0]


def cp_schemes(cfg, tp, cp, space):
    """The context-parallel schemes a layout of cp ranks may use: none but "ring" without cp (one name for one
    computation), else those of space["cp_scheme"] (default all of hsgd.cp.split.CP_SCHEMES) that can split the
    model's heads (Ulysses: cp divides each tp rank's query and kv heads; a2a+p2p: cp is not prime and its all-to-all
    group of a = cp / (cp's smallest prime factor) ranks divides them; hsgd.cp.split.check_heads)."""
    if cp == 1:
        return ["ring"]
    out = []
    for scheme in space.get("cp_scheme") or CP_SCHEMES:
        try:
            check_heads(cfg.n_heads, cfg.n_kv_heads, cp, tp, scheme)
        except ConfigError:
            continue
        out.append(scheme)
    return out


def options(space, ndp, per_node=None, eps=(1,), schemes=("ring",)):
    """The combinations of ZeRO stage, scheme, recomputation, exchange options in `space`, expert-parallel sizes eps
    and context-parallel schemes. per_node: the dp ranks in one node (space["node_ranks"] devices over the pp cp tp
    ranks of a replica), for the hierarchical exchange (space["hierarchical"]: [False, True]) where 1 < per_node <
    ndp and it divides ndp."""
    for zero in space.get("zero") or [0, 1, 2, 3]:
        if zero and ndp == 1:
            continue
        for scheme in space.get("tp_scheme") or ["megatron", "sequence"]:
            for rc in space.get("recompute") or ["none", "selective", "full"]:
                for overlap in space.get("dp_overlap") or [False]:
                    if overlap and (zero or ndp == 1):
                        continue
                    for hier in space.get("hierarchical") or [False]:
                        if hier and (overlap or zero == 1 or not per_node or not 1 < per_node < ndp
                                     or ndp % per_node):
                            continue
                        for ep in eps:
                            for cp_scheme in schemes:
                                yield dict(zero=zero, tp_scheme=scheme, recompute=rc, dp_overlap=overlap,
                                           hierarchical=hier, ranks_per_node=per_node if hier else None, ep=ep,
                                           cp_scheme=cp_scheme)


OPTIMIZER_BYTES = {"megatron": 28}   # a fused mixed-precision Adam: fp32 weights, m, v read and written (24), the
                                     # fp16 gradient read (2) and the fp16 weights written (2)
HSGD_OPTIMIZER_ELEMENTS = {"adamw": 7, "sgd": 3}     # p, g, m, v read, p, m, v written; p, g, v read, p, v written


def optimizer_seconds(hw, impl, optimizer, itemsize, owned):
    """Seconds of one optimizer step on `owned` elements: measured per element (--calibrate, hsgd's optimizer),
    else the bytes it moves at the memory bandwidth, else 0 (not modelled)."""
    if impl == "hsgd" and optimizer in hw.measured_optimizer:
        return owned * hw.measured_optimizer[optimizer]
    if not hw.memory_bandwidth:
        return 0.0
    per = OPTIMIZER_BYTES["megatron"] if impl == "megatron" else HSGD_OPTIMIZER_ELEMENTS[optimizer] * itemsize
    return owned * per / hw.memory_bandwidth


def rate_of(hw, dtype, efficiency):
    """Matmul FLOP/s per device: what --calibrate measured, else peak x efficiency."""
    if dtype in hw.measured_matmul:
        return hw.measured_matmul[dtype]
    return hw.peak(dtype) * (efficiency if efficiency is not None else (hw.efficiency or 1.0))


HEADROOM = 0.10   # of a device's memory kept free: the CUDA context, NCCL's buffers, the allocator's fragmentation
                  # and the temporaries the formulas leave out (hsgd.plan.paper's "Left out")


def evaluate(cfg, batch, lay, hw, impl="megatron", dtype="bfloat16", efficiency=None, explain=False,
             optimizer="adamw", simulated=True, headroom=HEADROOM):
    """A SimpleNamespace: layout, memory {category: bytes} of the fullest device and its stage, fits (its total
    within usable = (1 - headroom) x the device's memory_bytes), usable, bytes
    {stage: {(comm, op): (calls, bytes)}}, links {link: bytes per device per step}, time (costs.StepTime),
    tokens_per_s, mfu, tflops (per device, Narayanan et al.'s count). Raises ConfigError for settings hsgd.train
    refuses (--impl hsgd), and for a V or dual schedule where it does not apply (schedule_problem; v = 2)."""
    n = lay.dp * lay.pp * lay.cp * lay.tp
    stages = stage_ids(lay.pp)
    if lay.pp > 1 and lay.schedule in TWO_CHUNKS:
        if lay.v != 2:
            raise ConfigError(f"schedule {lay.schedule} holds 2 chunks a stage, not v={lay.v}: give v=2")
        problem = schedule_problem(cfg, lay.schedule, lay.pp, lay.m, lay.zero)
        if problem:
            raise ConfigError(problem)
    if impl == "hsgd" and cfg.moe_experts:
        raise ConfigError("--impl hsgd prices hsgd.train's own accounting (hsgd.accounting), which has no experts "
                          "yet; use --impl megatron for a mixture-of-experts model")
    if impl == "hsgd":
        lay = replace(lay, itemsize=ITEMSIZE[dtype])
        tc = lay.train_config(batch, dtype, optimizer)
        plans = {s: plan_rank(cfg, tc, lay.dp, lay.pp, lay.tp, lay.cp, s) for s in stages}
        mems = {s: at_peak(p["memory"]) for s, p in plans.items() if p["memory"] is not None}
        if not mems:
            raise ConfigError("--impl hsgd has no memory formula for the interleaved and zero-bubble schedules "
                              "(zb-h1, zb-v, dualpipev, dualpipe; hsgd.accounting.step_memory walks one chunk per "
                              "stage with fused backwards)")
        counts = {s: p["bytes"] for s, p in plans.items()}
        exchanges = {s: p["exchange"] for s, p in plans.items()}
        owned = max(p["exchange"].owned_numel() for p in plans.values())
        shapes = {s: (len(p["stage"].layers), p["stage"].first, p["stage"].last) for s, p in plans.items()}
        n_moe = dict.fromkeys(plans, 0)
    else:
        tc = SimpleNamespace(tp_scheme=lay.tp_scheme, recompute=lay.recompute, cp_scheme=lay.cp_scheme,
                             micro_batches=lay.m, batch_size=batch, zero=lay.zero, dp_overlap=lay.dp_overlap,
                             dp_staleness=lay.dp_staleness, hierarchical=lay.hierarchical,
                             ranks_per_node=lay.ranks_per_node, pp_split=None, virtual_stages=lay.v,
                             schedule=lay.schedule)
        mems, counts, shapes, exchanges, owned, n_moe = {}, {}, {}, {}, 0, {}
        for s in stages:
            st = PlannedStage(cfg, tc, lay.pp, s)
            per = megatron_numel(cfg, lay.tp, tied_copy=st.last and not st.first) | rank_numel(cfg, lay.tp, lay.ep)
            numel = st.group_numel(cfg, lay.tp, lay.tp_scheme, per)
            experts = expert_groups(cfg, st.layers, lay.tp, lay.ep)      # {} for a dense model
            if lay.ep == 1 or not experts:                   # every expert on every rank: averaged with the rest
                ex = exchange_sizes(tc, in_backward_order(numel, experts), lay.itemsize, lay.dp * lay.cp, lay.m)
            else:                                            # the experts over edp, flat
                flat = SimpleNamespace(**vars(tc) | dict(hierarchical=False, ranks_per_node=None))
                ex = FoldedExchange(exchange_sizes(tc, numel, lay.itemsize, lay.dp * lay.cp, lay.m),
                                    exchange_sizes(flat, experts, lay.itemsize, lay.dp * lay.cp // lay.ep, lay.m))
            exchanges[s], n_moe[s] = ex, len(experts)
            counts[s] = rank_bytes(cfg, tc, lay.dp, lay.tp, lay.cp, st, ex) | alltoall_formula(cfg, lay, n_moe[s])
            owned = max(owned, ex.owned_numel())
            held = peak_formula(st.kind, lay.m, lay.pp, s, lay.v)            # (micro-batch, chunk) pairs in flight
            mems[s] = stage_memory(cfg, lay, sum(numel.values()), len(st.layers), held, st.last,
                                   experts=sum(experts.values()), n_moe=n_moe[s])
            shapes[s] = (len(st.layers), st.first, st.last)
    full = max(mems, key=lambda s: sum(mems[s].values())) if mems else None
    rate = rate_of(hw, dtype, efficiency)
    t = step_time(cfg, lay, [(*shapes[s], counts[s], exchanges[s], n_moe[s], s) for s in stages], hw, rate, explain,
                  simulated, optimizer_seconds(hw, impl, optimizer, lay.itemsize, owned))
    if explain and full is not None:
        t.terms[:0] = memory_terms(cfg, lay, impl, mems[full], full, plans[full]["memory"]["at"]
                                   if impl == "hsgd" else None)
    peak = hw.peak(dtype)
    tokens = batch * cfg.seq_len
    usable = (1 - headroom) * hw.memory_bytes
    return SimpleNamespace(
        layout=lay, memory=mems.get(full), stage=full, usable=usable,
        fits=sum(mems[full].values()) <= usable if full is not None else None,
        bytes=counts, links=link_bytes(lay, counts[stages[0]], hw, exchanges[stages[0]]), time=t,
        tokens_per_s=tokens / t.total,
        mfu=cfg.step_flops(batch) / (t.total * n * peak),
        tflops=cfg.step_flops(batch, lay.recompute) / (t.total * n) / 1e12, n=n)


def at_peak(formula):
    """{category: bytes} at the sample of hsgd.accounting.step_memory's walk where the total peaks (each category's own
    peak may come at another moment: their sum overstates the step's peak)."""
    return max((cats for _, cats in formula["samples"]), key=lambda cats: sum(cats.values()))


def memory_terms(cfg, lay, impl, mem, stage, at=None):
    """The --explain lines of the memory of the fullest stage."""
    if impl == "hsgd":
        peak = ", ".join(f"{k} {v:.4g} B" for k, v in mem.items())
        return [("memory", f"stage {stage}: hsgd.accounting.step_memory's walk of the schedule (equal to what "
                           f"hsgd.train measures), peak at '{at}': {peak}")]
    nd, s_, b, h = lay.dp * lay.cp, cfg.seq_len // lay.cp, lay.b, cfg.d_model
    experts = [("memory", f"experts: {cfg.moe_experts // lay.ep} of each MoE block's {cfg.moe_experts} on a rank "
                          f"(ep {lay.ep}), each split over tp, the same states divided by edp = {nd // lay.ep} where "
                          f"sharded: params {mem['expert params']:.4g} B, grads {mem['expert grads']:.4g} B, "
                          f"optimizer {mem['expert optimizer']:.4g} B; a MoE block's activations: "
                          "hsgd.plan.experts.kept_bytes in place of its MLP's")] if "expert params" in mem else []
    return [("memory", f"stage {stage}: ZeRO-{lay.zero} model states (Rajbhandari et al. 2020), 2 psi weights, "
                       f"2 psi gradients, 12 psi Adam, divided by Nd = {nd} where sharded: params {mem['params']:.4g}"
                       f" B, grads {mem['grads']:.4g} B, optimizer {mem['optimizer']:.4g} B")] + experts + [
            ("memory", f"activations (Korthikanti et al. 2022, Table 2, for the {cfg.arch} family, {lay.tp_scheme}, "
                       f"recompute {lay.recompute}, attention {lay.attention}): "
                       f"s b h = {s_} x {b} x {h} per layer, times the layers of the stage and the micro-batches in "
                       f"flight = {mem['activations']:.4g} B")]


def stage_ids(pp):
    """The stages whose ranks differ most: the first (embedding, most micro-batches in flight) and the last (the
    head); a middle one when there is one (its blocks)."""
    return sorted({0, pp // 2, pp - 1})


def link_bytes(lay, counts, hw, exchange):
    """{link name: payload bytes per step on it} for one device of stage 0 (exchange: its exchange's sizes)."""
    links, sizes = group_links(lay, hw, exchange), group_sizes(lay, exchange)
    out = {}
    for (comm, op), (_, nbytes) in counts.items():
        if comm in links and op not in ("Isend", "Send") and sizes[comm] > 1:
            out[links[comm].name] = out.get(links[comm].name, 0) + nbytes
    return out


def rank_key(e):
    """Fastest first; at equal time (ZeRO-1 moves what an All-Reduce does) the one that needs less memory."""
    return (round(e.time.total, 9), sum(e.memory.values()) if e.memory is not None else 0.0)


def search(cfg, batch, n, hw, space=None, impl="megatron", dtype="bfloat16", efficiency=None, top=None,
           progress=None, headroom=HEADROOM):
    """(fitting evaluations sorted by step time, how many layouts were tried, why the others were dropped)."""
    space = space or {}
    cands = layouts(cfg, batch, n, space)
    ok, dropped = [], {}
    for i, lay in enumerate(cands):
        if progress and i and i % max(len(cands) // 10, 1) == 0:
            progress(i, len(cands))
        try:
            e = evaluate(cfg, batch, lay, hw, impl, dtype, efficiency, simulated=False, headroom=headroom)
        except (ConfigError, UsageError) as err:
            dropped[str(err)] = dropped.get(str(err), 0) + 1
            continue
        if e.fits is False:
            dropped["does not fit in memory"] = dropped.get("does not fit in memory", 0) + 1
            continue
        ok.append(e)
    ok.sort(key=rank_key)
    ok = ok[:top] if top else ok
    return ok, len(cands), dropped
