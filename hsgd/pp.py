"""Pipeline parallelism: the layers split into pp stages, each DP group's batch into m micro-batches.

The lecture, sections 1 and 4.2: with layers split across workers, one worker computes while the others wait
for its activations; cutting the mini-batch into micro-batches lets the stages work on different micro-batches
at once. What remains idle is the "bubble": with p stages, m micro-batches and equal costs per stage, a fraction
(p - 1) / (m + p - 1) of each stage's step.

Stage s holds the blocks split_layers(L, pp)[s]; stage 0 also the embedding, stage p-1 the final LayerNorm, the
LM head and the loss. Each stage is itself tensor-parallel over tp_comm (hsgd.tp_model.stage_forward/backward).
This module holds the schedules and what can be said of them without running them (the bubble of a simulated
timeline, a text picture, the bytes); hsgd.stage runs a stage's schedule, sending activations forward and their
gradients back over pp_comm.

Schedules (the order in which one stage runs its forward "F j" and backward "B j" actions):
    GPipe (Huang et al. 2019):
            F0 F1 ... F(m-1)  B0 B1 ... B(m-1)                     holds the activations of all m micro-batches
    1F1B (PipeDream-Flush: Narayanan et al. 2019, 2021):
            min(p-s-1, m) warm-up forwards, then one forward and one backward in turn, then the remaining
            backwards                                              holds at most p - s micro-batches
Both accumulate the gradients of the micro-batches in the same order (B0, B1, ...), so they give the same
numbers; they differ in memory (and, with unequal costs, in time).
"""
from .errors import ConfigError

SCHEDULES = ("1f1b", "gpipe")


def split_layers(n_layers, pp, split=None):
    """The blocks of each stage, as ranges. split: layers per stage (a list), default as even as possible
    (the first n_layers % pp stages get one more)."""
    if split is None:
        if pp > n_layers:
            raise ConfigError(f"n_layers={n_layers} cannot be split into pp={pp} stages of at least one layer; "
                              f"use pp <= {n_layers} or more layers")
        base, extra = divmod(n_layers, pp)
        split = [base + (s < extra) for s in range(pp)]
    split = [int(x) for x in split]
    if len(split) != pp or sum(split) != n_layers or min(split) < 1:
        if pp > n_layers:
            raise ConfigError(f"n_layers={n_layers} cannot be split into pp={pp} stages of at least one layer")
        even = ",".join(str(len(r)) for r in split_layers(n_layers, pp))
        raise ConfigError(f"pp_split={','.join(map(str, split))} must give each of the pp={pp} stages at least one "
                          f"layer and add up to n_layers={n_layers}, e.g. {even}")
    bounds = [sum(split[:s]) for s in range(pp + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def parse_split(text):
    """'2,1,1' -> [2, 1, 1]; None stays None."""
    if text is None or isinstance(text, (list, tuple)):
        return text
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"pp_split={text!r} must be layers per stage separated by commas, e.g. 2,2") from None


def stage_names(cfg, layers, first, last):
    """Names of the parameters a stage holds."""
    names = [n for n in cfg.param_shapes() if n.startswith("h.") and int(n.split(".")[1]) in layers]
    if first:
        names = ["wte", "wpe"] + names
    if last:
        names += ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    return names


def schedule(kind, m, p, s):
    """Stage s's actions, [("F", j) or ("B", j)], for m micro-batches on p stages."""
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind != "1f1b":
        raise ConfigError(f"schedule={kind!r} is not known; use one of {', '.join(SCHEDULES)}")
    warm = min(p - s - 1, m)
    acts = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        acts += [("F", warm + j), ("B", j)]
    return acts + [("B", j) for j in range(m - warm, m)]


def peak_in_flight(actions):
    """The most micro-batches whose activations a stage holds at once (forwarded, not yet backwarded)."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(kind, m, p, f_cost=1.0, b_cost=2.0):
    """Start and end times of every action of every stage when each forward costs f_cost and each backward
    b_cost and nothing else takes time: [[(action, start, end), ...] per stage]. An action starts when the stage
    is free and its input has arrived: F(s, j) needs F(s-1, j); B(s, j) needs B(s+1, j) (on the last stage, F(p-1, j)).
    """
    done, timeline, pos, free = {}, [[] for _ in range(p)], [0] * p, [0.0] * p
    acts = [schedule(kind, m, p, s) for s in range(p)]
    while any(pos[s] < len(acts[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(acts[s]):
                continue
            a, j = acts[s][pos[s]]
            dep = (("F", s - 1, j) if s > 0 else None) if a == "F" else \
                (("B", s + 1, j) if s < p - 1 else ("F", s, j))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0.0)
            end = start + (f_cost if a == "F" else b_cost)
            done[(a, s, j)], free[s] = end, end
            timeline[s].append((f"{a}{j}", start, end))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule has a cycle")                 # cannot happen for GPipe / 1F1B
    return timeline


def bubble_fraction(timeline):
    """Idle fraction of the stages over the span of the step: 1 - (busy time) / (stages x makespan)."""
    end = max(e for stage in timeline for _, _, e in stage)
    start = min(s for stage in timeline for _, s, _ in stage)
    busy = sum(e - s for stage in timeline for _, s, e in stage)
    return 1.0 - busy / (len(timeline) * (end - start))


def picture(timeline, width=96):
    """A text picture of a timeline (one row per stage): each action drawn over its duration, '.' when idle."""
    t0 = min(s for stage in timeline for _, s, _ in stage)
    t1 = max(e for stage in timeline for _, _, e in stage)
    scale = width / (t1 - t0)
    rows = []
    for s, stage in enumerate(timeline):
        row = ["."] * width
        for name, a, b in stage:
            lo, hi = int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))
            label = (name + "-" * width)[:hi - lo] if hi - lo >= len(name) else name[0] * (hi - lo)
            row[lo:hi] = list(label)
        rows.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(rows)


def ideal_bubble(m, p):
    return (p - 1) / (m + p - 1)


def pp_formula(batch_per_mb, cfg, m, first, last, itemsize, scheme="megatron", tp=1):
    """{(comm, op): (calls, bytes)} of one step on pp_comm for one stage: an activation out and a gradient in per
    micro-batch towards the next stage, a gradient out and an activation in towards the previous one. A message
    is one activation (tp_model.stage_activation_shape): (B/m, T, C), or the T-shard (B/m, T/tp, C) of the
    sequence scheme."""
    from .tp_model import stage_activation_shape
    B, T, C = stage_activation_shape(scheme, batch_per_mb, cfg, tp)
    msg = B * T * C * itemsize
    sends = m * (not last) + m * (not first)
    out = {}
    if sends:
        out[("pp", "Isend")] = (sends, sends * msg)
        out[("pp", "Recv")] = (sends, sends * msg)
    return out
