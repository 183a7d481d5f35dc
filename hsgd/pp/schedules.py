"""Pipeline schedules as data: for every stage, the list of actions it runs in one step; whether such lists can run
at all (the static check) and their timeline when they do (hsgd.pp.timelines: what a list or a timeline says, the
bubble, the pairs and bytes held, their closed forms and pictures).

An action is Action(kind, mb, chunk):
    F   the forward of micro-batch mb through model chunk `chunk` of this stage
    B   its backward: dL/d(input), sent to the previous stage; and the weight gradients too ("fused"), unless the
        schedule has a W for the same micro-batch and chunk
    W   the weight gradients dW += X^T dY of the chunk's linear layers (hsgd.tp.wgrad), from what B kept
Virtual stages (Narayanan et al. 2021): with v chunks per stage the layers are cut into p v chunks; chunk c of
stage s is the model's piece k = c p + s, so a micro-batch goes stage 0, 1, ..., p-1, then back to stage 0 for
chunk 1, and so on (v = 1: the plain pipeline): the loop placement (hsgd.pp.placement, which also has the V, and
says which stage holds piece k; placement_of(kind) the schedule's). What each action waits for (and nothing else):
    F(k, j)  needs F(k-1, j), from the stage holding piece k-1 ((s-1) mod p in the loop; k = 0: the tokens)
    B(k, j)  needs B(k+1, j), from the stage holding piece k+1 ((s+1) mod p; the last piece: its own F(k, j))
    W(k, j)  needs B(k, j) (same stage)
Messages are sent as soon as an action ends and received when the receiving action starts (hsgd.pp.stage), so these
are the only waits: a list of actions that `check` can run to the end in this model cannot deadlock on MPI.

One builder per schedule, `build(kind, m, p, v, costs)`:
    gpipe        all forwards, then all backwards (Huang et al. 2019)                 holds m micro-batches
    1f1b         min(p-s-1, m) warm-up forwards, then one forward and one backward in turn, then the remaining
                 backwards (PipeDream-Flush: Narayanan et al. 2019, 2021)            holds p-s
    interleaved  1F1B over v chunks per stage in Megatron-LM's order: forwards go through the chunks in groups of
                 p micro-batches (chunk 0 for micro-batches 0..p-1, chunk 1 for the same, ..., then the next
                 p), backwards the same with the chunks reversed; warm-up 2(p-s-1) + (v-1)p forwards
    zb-h1        1F1B's forwards and backwards with B and W split (Qi et al. 2024): a W runs when the stage
                 would otherwise wait for its next input, or when one more forward would hold more than p
                 micro-batches (1F1B's peak, on stage 0); the rest at the end. Built by simulating with the
                 given costs: the list is the order that simulation found (training builds it for equal
                 costs). Every stage may hold p pairs: 1F1B's peak in pairs; in bytes only where every
                 stage's pairs weigh the same (a last stage that keeps the LM head's dY for its W holds more).
Bubbles with equal costs (stage busy time over the span of the step; p stages, m micro-batches): GPipe and 1F1B
(p-1)/(m+p-1); interleaved (p-1)/(v m + p-1), with each chunk's F and B costing 1/v of a stage's (the paper
writes the bubble as a fraction of the ideal time, (1/v)(p-1)/m; hsgd divides by the whole step, as for the
others); ZB-H1 idle time per stage (p-1)(F + B - W) against 1F1B's (p-1)(F + B + W), for m >= p and
W <= min(F, B) (Qi et al. 2024; with F = B = W a third).
Sizes: a schedule holds at most MAX_PIECES = p v m (stage, chunk, micro-batch) triples, checked (check_size) before
any list is built or walked; building, the static check and the simulation are linear in the actions (zb-h1 times
log p), whatever p.
"""
import heapq
from collections import deque

from hsgd.errors import ConfigError
from hsgd.pp import vshape
from hsgd.pp.actions import Action, Pair, flat                          # noqa: F401 (flat: for the importers)
from hsgd.pp.placement import placement

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev", "dualpipe")
PLACEMENTS = {"zb-v": "v", "dualpipev": "v", "dualpipe": "dual"}     # the others: the loop (hsgd.pp.placement)
TWO_CHUNKS = tuple(PLACEMENTS)     # schedules whose stages hold 2 chunks each, whatever --virtual-stages says
MAX_PIECES = 2**18     # p v m, the (stage, chunk, micro-batch) triples of a step: each is an F and a B (and a W) in a
                       # list; 2^18 of them (up to 800k actions) build and simulate in a few seconds


def check_size(m, p, v=1):
    """Raise ConfigError unless a schedule of p stages, v chunks and m micro-batches is small enough to write down:
    p v m <= MAX_PIECES (checked before any list is built; building and simulating are linear in it)."""
    if p * v * m > MAX_PIECES:
        raise ConfigError(f"pp x virtual_stages x micro_batches = {p} x {v} x {m} = {p * v * m} is more than a "
                          f"schedule hsgd writes down (at most {MAX_PIECES} pieces of work); use fewer stages or "
                          "micro-batches")


KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients", "F&B": "forward & backward"}


def chunk_count(kind, v):
    """The chunks per stage schedule `kind` runs with --virtual-stages v: 2 for the V and dual schedules
    (TWO_CHUNKS), v for the others."""
    return 2 if kind in TWO_CHUNKS else v


def effective(kind, p, v=1):
    """The schedule a pipeline of p stages runs for `kind`: one stage has no bubble to fill and runs F0 B0 F1 B1 ...
    (1F1B), which holds one micro-batch at a time. Raises ConfigError for v > 1 on one stage."""
    if p == 1 and kind in TWO_CHUNKS:
        raise ConfigError(f"schedule={kind!r} places two chunks on every stage, down the stages and back up (the V"
                          f"{'s of both ends' if kind == 'dualpipe' else ''}): one stage would hand every activation "
                          f"to itself; use --pp {4 if kind == 'dualpipe' else 2} or more, or --schedule 1f1b")
    if p == 1 and v > 1:
        raise ConfigError(f"virtual_stages={v} needs pp > 1: one stage holding v chunks would pass every activation "
                          "to itself; use --pp 2 or more, or --virtual-stages 1")
    return "1f1b" if p == 1 else kind


class ScheduleError(ConfigError):
    """A list of actions that cannot run: a deadlock, a missing or repeated action."""


# ------------------------------------------------------------------------------------------------ the builders

def gpipe(m, p, s):
    return [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)]


def one_f_one_b(m, p, s):
    """1F1B (zb_h1 takes its F's and B's and adds W's)."""
    warm = min(p - s - 1, m)
    acts = [Action("F", j) for j in range(warm)]
    for j in range(m - warm):
        acts += [Action("F", warm + j), Action("B", j)]
    return acts + [Action("B", j) for j in range(m - warm, m)]


def interleaved(m, p, s, v):
    """Megatron-LM's interleaved 1F1B for stage s (the i-th forward of a stage: micro-batch (i // pv) p + i % p,
    chunk (i // p) % v; the i-th backward the same with the chunk v-1 minus that). Warm-up: 2(p-s-1) + (v-1)p
    forwards (v = 1: p-s-1, which makes it 1F1B)."""
    if m % p and v > 1:
        ok = [x for x in range(p, 4 * p + 1, p)]
        raise ConfigError(f"the interleaved schedule takes the micro-batches in groups of pp={p}: micro_batches={m} "
                          f"must be a multiple of {p}, e.g. {', '.join(map(str, ok))}")
    total = m * v
    mb = lambda i: (i // (p * v)) * p + i % p                           # noqa: E731
    fwd = lambda i: Action("F", mb(i), (i // p) % v)                    # noqa: E731
    bwd = lambda i: Action("B", mb(i), v - 1 - (i // p) % v)            # noqa: E731
    warm = min(2 * (p - s - 1) + (v - 1) * p if v > 1 else p - s - 1, total)     # v = 1: 1F1B itself
    acts = [fwd(i) for i in range(warm)]
    for i in range(total - warm):
        acts += [fwd(warm + i), bwd(i)]
    return acts + [bwd(i) for i in range(total - warm, total)]


def zb_h1(m, p, costs=(1.0, 1.0, 1.0)):
    """Every stage's list for ZB-H1 (see the module docstring), found by list-scheduling 1F1B's F and B (split)
    with the W's, the stages simulated together with costs (f, b, w) per action: the next action placed is the one
    that starts first (the lower stage at a tie). Each stage's candidate lives in a heap and is recomputed only when
    its own stage moves or the action it waits for is placed, so the cost is linear in the actions (times log p)."""
    f, b, w = costs
    order, loop = [one_f_one_b(m, p, s) for s in range(p)], placement("loop", p)
    pos, pending, live = [0] * p, [deque() for _ in range(p)], [0] * p
    free, done, out = [0.0] * p, {}, [[] for _ in range(p)]
    heap, version, waiter = [], [0] * p, {}

    def offer(s):
        """Stage s's candidate (start, s, action) into the heap (an older one of s is stale from now on)."""
        version[s] += 1
        nxt = order[s][pos[s]] if pos[s] < len(order[s]) else None
        dep = None if nxt is None else _dependency(nxt, s, loop)
        ready = None if nxt is None else 0.0 if dep is None else done.get(dep)
        if nxt is not None and ready is None:
            waiter[dep] = s                                               # offered again once dep is placed
        if pending[s] and (nxt is None or (nxt.kind == "F" and live[s] >= p) or ready is None or ready > free[s]):
            heapq.heappush(heap, (free[s], s, pending[s][0], version[s]))  # fill the wait (or make room) with a W
        elif ready is not None:
            heapq.heappush(heap, (max(free[s], ready), s, nxt, version[s]))

    for s in range(p):
        offer(s)
    while heap:
        start, s, a, seen = heapq.heappop(heap)
        if seen != version[s]:
            continue                                                      # stage s has moved on since
        cost = {"F": f, "B": b, "W": w}[a.kind]
        key = (a.kind, s, a.mb, 0)
        done[key], free[s] = start + cost, start + cost
        out[s].append(a)
        if a.kind == "W":
            pending[s].popleft()
            live[s] -= 1
        else:
            pos[s] += 1
            live[s] += a.kind == "F"
            if a.kind == "B":
                pending[s].append(Action("W", a.mb))
        offer(s)
        if key in waiter:
            offer(waiter.pop(key))
    return out


def build(kind, m, p, v=1, costs=(1.0, 1.0, 1.0)):
    """[[Action] per stage] for schedule `kind` (SCHEDULES), m micro-batches, p stages, v chunks per stage."""
    if kind not in SCHEDULES:
        raise ConfigError(f"schedule={kind!r} is not known; use one of {', '.join(SCHEDULES)}")
    check_size(m, p, v)
    effective(kind, p, v)                                               # (one stage: no V; v > 1 needs p > 1)
    if kind in TWO_CHUNKS:
        return vshape.build(kind, m, p, v)
    if v != 1 and kind != "interleaved":
        raise ConfigError(f"virtual_stages={v} needs the interleaved schedule (schedule={kind!r} runs one chunk "
                          f"per stage); use --schedule interleaved, or --virtual-stages 1")
    effective(kind, p, v)                                               # v > 1 needs p > 1
    if kind == "zb-h1":
        return zb_h1(m, p, costs)
    if kind == "interleaved":
        return [interleaved(m, p, s, v) for s in range(p)]
    return [(gpipe if kind == "gpipe" else one_f_one_b)(m, p, s) for s in range(p)]


def check_pipeline(n_layers, layout):
    """Everything a pipeline's flags must satisfy before any work: the layers cut into pp x virtual_stages chunks,
    the schedule's own conditions (build). layout: the Layout settings (what the schedules combine with beyond
    GPipe and 1F1B is checked by TrainConfig.validate)."""
    from hsgd.pp.chunks import chunk_layers, parse_split
    v = chunk_count(layout.schedule, layout.virtual_stages)
    pieces = placement_of(effective(layout.schedule, layout.pp, v), layout.pp, v).K
    chunk_layers(n_layers, layout.pp, pieces // layout.pp, parse_split(layout.pp_split))
    if layout.pp > 1 or v > 1:
        build(layout.schedule, layout.micro_batches, layout.pp, v)


# ------------------------------------------------------------------------------------------------ the static check

def _dependency(a, s, pl):
    """(kind, stage, mb, chunk) of the action that `a` on stage s waits for (None: nothing but its own stage), the
    pieces placed as pl (hsgd.pp.placement) says: F of piece k waits for F of piece k-1, B for B of piece k+1."""
    if a.kind == "F":
        prev = pl.before(s, a.chunk)
        return None if prev is None else ("F", prev[0], a.mb, prev[1])
    if a.kind == "B":
        nxt = pl.after(s, a.chunk)
        return ("F", s, a.mb, a.chunk) if nxt is None else ("B", nxt[0], a.mb, nxt[1])
    return ("B", s, a.mb, a.chunk)


def placement_of(kind, p, v=1):
    """The placement (hsgd.pp.placement) schedule `kind` runs on: the V for zb-v and dualpipev, the dual one for
    dualpipe, the loop (chunk c of stage s is piece c p + s) for the others."""
    return placement(PLACEMENTS.get(kind, "loop"), p, v)


def check(actions, m, v=1, pl=None):
    """Raise ScheduleError unless every stage's list runs each (micro-batch, chunk) F and B exactly once (W at
    most once, after its B) and the stages can run their lists to the end without waiting for each other forever:
    the dependencies of the module docstring, followed in order, the pieces placed as pl says (default: the loop).
    The message names the first action that cannot run. Returns nothing; `simulate` is the same walk with times."""
    simulate(actions, m, v, pl=pl)


def simulate(actions, m, v=1, costs=(1.0, 1.0, 1.0), pl=None):
    """[[(action, start, end)] per stage]: each action starts when its stage is free and its input is there; F
    costs f, B b (fused: b + w), W w (costs = (f, b, w), per chunk); a Pair (F&B) waits for both inputs and costs
    costs[3] if given, else its F and B apart. Raises ScheduleError (see check). A stage runs its list until an
    action's input is missing, then waits; the action that brings the input wakes it again, so every action is
    looked at a bounded number of times (linear in the actions, however many stages)."""
    p, (f, b, w), fb = len(actions), costs[:3], (costs[3] if len(costs) > 3 else None)
    check_size(m, p, v)
    pl = pl or placement("loop", p, v)
    split = _validate(actions, m, v, pl)
    done, timeline, pos, free = {}, [[] for _ in range(p)], [0] * p, [0.0] * p
    awake, waiter = list(range(p - 1, -1, -1)), {}                       # stages to run (stage 0 first)
    cost = lambda a, s: {"F": f, "W": w, "B": b + (w if (a.mb, a.chunk, s) not in split else 0.0)}[a.kind]  # noqa
    while awake:
        s = awake.pop()
        while pos[s] < len(actions[s]):
            a = actions[s][pos[s]]
            parts = (a.f, a.b) if isinstance(a, Pair) else (a,)
            for x in parts:
                if x.kind in "BW" and ("F" if x.kind == "B" else "B", s, x.mb, x.chunk) not in done:
                    raise ScheduleError(f"stage {s} runs {a} (action {pos[s]}) before its "
                                        f"{'F' if x.kind == 'B' else 'B'}{x.mb}{f'.{x.chunk}' if x.chunk else ''}")
            deps = [d for d in (_dependency(x, s, pl) for x in parts) if d is not None]
            missing = [d for d in deps if d not in done]
            if missing:
                waiter.setdefault(missing[0], []).append(s)               # woken when it is done
                break
            took = sum(cost(x, s) for x in parts) if fb is None or len(parts) == 1 else fb
            start = max([free[s]] + [done[d] for d in deps])
            free[s] = start + took
            timeline[s].append((a, start, start + took))
            pos[s] += 1
            for x in parts:
                key = (x.kind, s, x.mb, x.chunk)
                done[key] = free[s]
                awake.extend(waiter.pop(key, ()))
    if any(pos[s] < len(actions[s]) for s in range(p)):
        raise ScheduleError(_deadlock(actions, pos, p, pl))
    return timeline


def _validate(actions, m, v, pl):
    """Each stage's actions in range and each once (a Pair: its F and its B), every micro-batch's F and B on every
    chunk it passes through (pl.runs); returns the set of (mb, chunk, stage) whose B is split."""
    p, seen, split = len(actions), {}, set()
    for s, acts in enumerate(actions):
        for i, a in enumerate(acts):
            parts = (a.f, a.b) if isinstance(a, Pair) and a.f.kind == "F" and a.b.kind == "B" else (a,)
            for x in parts:
                if not isinstance(x, Action) or x.kind not in ("F", "B", "W") or not 0 <= x.mb < m \
                        or not 0 <= x.chunk < v or not pl.runs(x.chunk, x.mb, m):
                    raise ScheduleError(f"stage {s}'s action {i}, {a!r}, is not an Action(kind F, B or W, micro-"
                                        f"batch 0..{m - 1}, chunk 0..{v - 1} that the micro-batch passes through) "
                                        "or a Pair of an F and a B")
                key = (x.kind, s, x.mb, x.chunk)
                if key in seen:
                    raise ScheduleError(f"stage {s} runs {x} twice (actions {seen[key]} and {i}): micro-batch "
                                        f"{x.mb} would be used twice")
                seen[key] = i
                if x.kind == "W":
                    split.add((x.mb, x.chunk, s))
    for s in range(p):
        for c in range(v):
            for j in range(m):
                for kind in "FB":
                    if pl.runs(c, j, m) and (kind, s, j, c) not in seen:
                        raise ScheduleError(f"stage {s} never runs {Action(kind, j, c)}: every micro-batch needs "
                                            f"a forward and a backward on every chunk it passes through")
    return split


def _deadlock(actions, pos, p, pl):
    s = min(s for s in range(p) if pos[s] < len(actions[s]))
    a = actions[s][pos[s]]
    for x in ((a.f, a.b) if isinstance(a, Pair) else (a,)):
        kind, t, j, c = _dependency(x, s, pl)
        want = Action(kind, j, c)
        where = [i for i, y in enumerate(actions[t]) if y == want or (isinstance(y, Pair) and want in y)]
        if pos[t] <= where[0]:
            break
    behind = f"stage {t} is stuck at its action {pos[t]}, {actions[t][pos[t]]}" if pos[t] < len(actions[t]) else ""
    return (f"the schedule deadlocks: stage {s} cannot run its action {pos[s]}, {a}: it waits for {want} of stage "
            f"{t}, which comes at stage {t}'s action {where[0]}" + (f", and {behind}" if behind else "") +
            "; no stage can go on")
