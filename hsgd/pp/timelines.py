"""What a pipeline schedule's list of actions, or the timeline of running it, says without running it again:
the bubble (idle time over the step) and its closed forms, the (micro-batch, chunk) pairs and bytes a stage holds
and their closed forms, and pictures of a timeline. A list is what hsgd.pp.schedules builds, [Action] per stage; a
timeline [[(action, start, end)] per stage], simulated (schedules.simulate) or measured (Stage.timeline).

Closed forms (equal costs per chunk action, p stages, m micro-batches, v chunks per stage; see hsgd.pp.schedules):
    bubble    GPipe, 1F1B (p-1)/(m+p-1);  interleaved (p-1)/(vm+p-1);  ZB-H1 (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))
    pairs     GPipe m;  1F1B min(p-s, m);  interleaved min(2(p-s-1) + (v-1)p + 1, vm);  ZB-H1 min(p, m)
"""


def bubble_fraction(timeline):
    """Idle fraction of the stages over the span of the step: 1 - (busy time) / (stages x makespan)."""
    end = max(e for stage in timeline for _, _, e in stage)
    start = min(s for stage in timeline for _, s, _ in stage)
    busy = sum(e - s for stage in timeline for _, s, e in stage)
    return 1.0 - busy / (len(timeline) * (end - start))


def idle_per_stage(timeline):
    """The step's span minus the mean busy time of a stage: the bubble as time."""
    end = max(e for stage in timeline for _, _, e in stage)
    start = min(s for stage in timeline for _, s, _ in stage)
    busy = sum(e - s for stage in timeline for _, s, e in stage) / len(timeline)
    return end - start - busy


FORMULA = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(vm+p-1)",
           "zb-h1": "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))"}


def bubble_formula(kind, m, p, v=1, costs=(1.0, 1.0, 1.0)):
    """The closed form of the module docstring (FORMULA[kind]), with costs (f, b, w) per chunk action.

    zb-h1: None for m < p or w > min(f, b), where it does not apply. The simulation of zb_h1's list equals it for
    equal costs (every p <= 8, m >= p: tests/test_schedules.py) and the unequal costs tested there; the list
    scheduling is greedy, and for some costs (f = 3, b = w = 2, p >= 3) it leaves more idle time than this."""
    f, b, w = costs
    if kind == "zb-h1" and (m < p or w > min(f, b)):
        return None
    if kind == "zb-h1":
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle)
    return (p - 1) / ((v if kind == "interleaved" else 1) * m + p - 1)


PEAK_FORMULA = {"gpipe": "m", "1f1b": "min(p-s, m)", "interleaved": "min(2(p-s-1) + (v-1)p + 1, v m)",
                "zb-h1": "min(p, m)"}


def peak_formula(kind, m, p, s, v=1):
    """The (micro-batch, chunk) pairs stage s holds at its peak, in closed form (PEAK_FORMULA[kind]): its warm-up
    forwards plus one (interleaved with v = 1 is 1F1B); zb-h1 lets every stage hold what 1F1B's stage 0 does."""
    if kind == "gpipe":
        return m
    if kind == "zb-h1":
        return min(p, m)
    if kind == "interleaved" and v > 1:
        return min(2 * (p - s - 1) + (v - 1) * p + 1, v * m)
    return min(p - s, m)


def held(actions):
    """[(micro-batch, chunk) pairs held after each action]: from its F until its backward is whole (its B if fused,
    else its W): what the stage keeps activations for."""
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}
    live, out = 0, []
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == "W" or (a.kind == "B" and (a.mb, a.chunk) not in split) else 0
        out.append(live)
    return out


def peak_held(actions):
    """The most (micro-batch, chunk) pairs a stage holds at once."""
    return max(held(actions), default=0)


def held_bytes(actions, keep, keep_after_b):
    """The peak bytes a stage holds: keep[c] per (micro-batch, chunk c) from its F until its backward (the
    forward's caches), replaced at a split B by keep_after_b[c] until its W (the X and dY the W reads)."""
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += keep[a.chunk]
        elif a.kind == "B":
            live += (keep_after_b[a.chunk] if (a.mb, a.chunk) in split else 0) - keep[a.chunk]
        else:
            live -= keep_after_b[a.chunk]
        peak = max(peak, live)
    return peak


def picture(timeline, width=96):
    """A text picture of a timeline (one row per stage): each action drawn over its duration, '.' when idle."""
    t0 = min(s for stage in timeline for _, s, _ in stage)
    t1 = max(e for stage in timeline for _, _, e in stage)
    scale = width / (t1 - t0)
    rows = []
    for s, stage in enumerate(timeline):
        row = ["."] * width
        for name, a, b in stage:
            name = str(name)
            lo, hi = int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))
            label = (name + "-" * width)[:hi - lo] if hi - lo >= len(name) else name[0] * (hi - lo)
            row[lo:hi] = list(label)
        rows.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(rows)


def grid(timeline, slot=None):
    """The timeline as a text grid: one row per stage, one column per time slot of length `slot` (default: the
    shortest action that takes time), each cell the action running then ('.' idle); actions that take no time are
    left out. When some action does not last a whole number of slots, the proportional picture() instead."""
    spans = [e - s for stage in timeline for _, s, e in stage if e > s]
    slot = slot or min(spans)
    if any(abs(x / slot - round(x / slot)) > 1e-9 for stage in timeline for _, x, _ in stage) or \
            any(abs(x / slot - round(x / slot)) > 1e-9 for x in spans):
        return picture(timeline)
    n = int(round(max(e for stage in timeline for _, _, e in stage) / slot))
    cells = [["."] * n for _ in timeline]
    for s, stage in enumerate(timeline):
        for a, lo, hi in stage:
            for t in range(int(round(lo / slot)), int(round(hi / slot))):
                cells[s][t] = str(a)
    w = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {s} | " + " ".join(c.rjust(w) for c in row) for s, row in enumerate(cells))
