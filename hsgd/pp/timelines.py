"""What a pipeline schedule's list of actions, or the timeline of running it, says without running it again:
the bubble (idle time over the step) and its closed forms, the (micro-batch, chunk) pairs and bytes a stage holds
and their closed forms, and pictures of a timeline. A list is what hsgd.pp.schedules builds, [Action] per stage; a
timeline [[(action, start, end)] per stage], simulated (schedules.simulate) or measured (Stage.timeline).

Closed forms (equal costs per chunk action, p stages, m micro-batches, v chunks per stage; see hsgd.pp.schedules):
    bubble    GPipe, 1F1B (p-1)/(m+p-1);  interleaved (p-1)/(vm+p-1);  ZB-H1 (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W));
              ZB-V (p-1)F/(2m(F+B+W)+(p-1)F) for F = B = W; DualPipeV, DualPipe: their Table 2 idle over itself plus
              a stage's busy time (2m, m chunk passes), where no pair is faster than its parts
    pairs     GPipe m;  1F1B min(p-s, m);  interleaved min(2(p-s-1) + (v-1)p + 1, vm);  ZB-H1 min(p, m);
              ZB-V min(2p, m+s+1, 2m);  DualPipeV 2p+1;  DualPipe p+1 (a pair runs its F, then its B)
Two more measures of idle time, each the one a paper's numbers use (hsgd.pp.vshape; tests/test_vshape.py):
    most_idle     the step's span minus the busy time of the least busy stage: DeepSeek-V3's Table 2 (DeepSeek-AI
                  2024), in its notation B a whole backward (B + W here) and F&B an overlapped pair:
                  1F1B (p-1)(F+B), ZB1P (zb-h1's list for equal costs, the one training runs; zb_h1's greedy
                  list for other costs can leave more) (p-1)(F+B-2W), DualPipe (p/2-1)(F&B+B-3W) (DualPipeV: a DualPipe
                  of 2p stages folded, (p-1)(F&B+B-3W)); exact for F = B here, W <= F and max(F, B+W) <= F&B
                  <= F+B+W, m >= 2p (1F1B, ZB1P: m >= p), as the paper draws them (F and B chunks of one length)
    stage_idle    the longest of the stages' own spans (first action to last) minus its busy time: the zero-bubble
                  papers' "bubble rate" 1 - m(F+B+W) / longest stage time (Qi et al. 2024); 0 for ZB-V with F = B
                  = W and m >= 2p-1
"""


from hsgd.pp.schedules import flat


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


def most_idle(timeline):
    """The span of the step minus the busy time of its least busy stage (DeepSeek-V3's Table 2 bubble)."""
    end = max(e for stage in timeline for _, _, e in stage)
    start = min(s for stage in timeline for _, s, _ in stage)
    return end - start - min(sum(e - s for _, s, e in stage) for stage in timeline)


def stage_idle(timeline):
    """The longest stage's own span (its first action's start to its last's end) minus its busy time, over the
    stages: the zero-bubble papers' measure."""
    return max(stage[-1][2] - stage[0][1] - sum(e - s for _, s, e in stage) for stage in timeline if stage)


TABLE2 = {"1f1b": "(p-1)(F+B)", "zb-h1": "(p-1)(F+B-2W)", "dualpipe": "(p/2-1)(F&B+B-3W)",
          "dualpipev": "(p-1)(F&B+B-3W)"}


def table2(kind, m, p, costs=(1.0, 1.0, 1.0)):
    """DeepSeek-V3's Table 2 idle time (TABLE2[kind], its B being a whole backward, b + w) for costs (f, b, w[, f&b])
    per chunk action, where it holds (the module docstring), else None. Without f&b: no overlap, f + b + w."""
    f, b, w = costs[:3]
    fb = costs[3] if len(costs) > 3 else f + b + w
    B = b + w                                                          # DeepSeek's B: a whole backward
    if kind == "1f1b" and m >= p:
        return (p - 1) * (f + B)
    if kind not in TABLE2 or kind == "1f1b" or m < (p if kind == "zb-h1" else 2 * p) or w > f or \
            abs(f - b) > 1e-12 * max(f, b) or not max(f, B) <= fb <= f + B:
        return None
    if kind == "zb-h1":
        return (p - 1) * (f + B - 2 * w)
    return (p // 2 - 1 if kind == "dualpipe" else p - 1) * (fb + B - 3 * w)


FORMULA = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(vm+p-1)",
           "zb-h1": "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))", "zb-v": "(p-1)F/(2m(F+B+W)+(p-1)F), F=B=W",
           "dualpipev": "I/(2m(F+B+W)+I), I = Table 2's", "dualpipe": "I/(m(F+B+W)+I), I = Table 2's"}


def bubble_formula(kind, m, p, v=1, costs=(1.0, 1.0, 1.0)):
    """The closed form of the module docstring (FORMULA[kind]), with costs (f, b, w) per chunk action.

    zb-h1: None for m < p or w > min(f, b), where it does not apply. The simulation of zb_h1's list equals it for
    equal costs (every p <= 8, m >= p: tests/test_schedules.py) and the unequal costs tested there; the list
    scheduling is greedy, and for some costs (f = 3, b = w = 2, p >= 3) it leaves more idle time than this."""
    f, b, w = costs[:3]
    if kind in ("dualpipe", "dualpipev"):                              # equal busy stages: no pair faster
        idle = table2(kind, m, p, (f, b, w))
        if idle is None or (len(costs) > 3 and costs[3] != f + b + w):
            return None
        busy = (m if kind == "dualpipe" else 2 * m) * (f + b + w)
        return idle / (busy + idle)
    if kind == "zb-v":
        if not (f == b == w) or m < 2 * p - 1:
            return None
        return (p - 1) * f / (2 * m * (f + b + w) + (p - 1) * f)
    if kind == "zb-h1" and (m < p or w > min(f, b)):
        return None
    if kind == "zb-h1":
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle)
    return (p - 1) / ((v if kind == "interleaved" else 1) * m + p - 1)


PEAK_FORMULA = {"gpipe": "m", "1f1b": "min(p-s, m)", "interleaved": "min(2(p-s-1) + (v-1)p + 1, v m)",
                "zb-h1": "min(p, m)", "zb-v": "min(2p, m+s+1, 2m)", "dualpipev": "2p+1", "dualpipe": "p+1"}


def peak_formula(kind, m, p, s, v=1):
    """The (micro-batch, chunk) pairs stage s holds at its peak, in closed form (PEAK_FORMULA[kind]): its warm-up
    forwards plus one (interleaved with v = 1 is 1F1B); zb-h1 lets every stage hold what 1F1B's stage 0 does."""
    if kind == "gpipe":
        return m
    if kind == "zb-v":
        return min(2 * p, m + s + 1, 2 * m)
    if kind in ("dualpipev", "dualpipe"):
        return (2 * p if kind == "dualpipev" else p) + 1                # (a pair's F before its B frees one)
    if kind == "zb-h1":
        return min(p, m)
    if kind == "interleaved" and v > 1:
        return min(2 * (p - s - 1) + (v - 1) * p + 1, v * m)
    return min(p - s, m)


def held(actions):
    """[(micro-batch, chunk) pairs held after each action]: from its F until its backward is whole (its B if fused,
    else its W): what the stage keeps activations for. A Pair (F&B) counts as its F, then its B."""
    actions = flat(actions)
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}
    live, out = 0, []
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == "W" or (a.kind == "B" and (a.mb, a.chunk) not in split) else 0
        out.append(live)
    return out


def peak_held(actions):
    """The most (micro-batch, chunk) pairs a stage holds at once."""
    return max(held(actions), default=0)


def held_bytes(actions, keep, keep_after_b, handed=0):
    """The peak bytes a stage holds: keep[c] per (micro-batch, chunk c) from its F until its backward (the
    forward's caches), replaced at a split B by keep_after_b[c] until its W (the X and dY the W reads); a Pair
    looked at after its F and after its B. handed: the bytes of an activation the stage hands to itself (the V's
    turn, hsgd.pp.placement.local_handoffs: chunk 0's output from its F until chunk 1's F takes it into its cache,
    chunk 1's input gradient from its B until chunk 0's B reads it), else 0."""
    actions = flat(actions)
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}
    turn = (handed, -handed)                                           # chunk 0 hands on, chunk 1 takes
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += keep[a.chunk] + (turn[a.chunk] if a.chunk < 2 else 0)
        elif a.kind == "B":
            live += (keep_after_b[a.chunk] if (a.mb, a.chunk) in split else 0) - keep[a.chunk] \
                - (turn[a.chunk] if a.chunk < 2 else 0)
        else:
            live -= keep_after_b[a.chunk]
        peak = max(peak, live)
    return peak


def picture(timeline, width=96):
    """A text picture of a timeline (one row per stage): each action drawn over its duration, '.' when idle; where
    its name does not fit, its kind's letter, X for an overlapped pair F&B."""
    t0 = min(s for stage in timeline for _, s, _ in stage)
    t1 = max(e for stage in timeline for _, _, e in stage)
    scale = width / (t1 - t0)
    rows = []
    for s, stage in enumerate(timeline):
        row = ["."] * width
        for name, a, b in stage:
            name = str(name)
            lo, hi = int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))
            letter = "X" if "&" in name else name[0]
            label = (name + "-" * width)[:hi - lo] if hi - lo >= len(name) else letter * (hi - lo)
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
