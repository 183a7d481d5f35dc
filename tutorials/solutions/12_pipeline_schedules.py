"""Solutions to the exercises of chapter 12 (tutorials/12_pipeline_schedules.py).

    mpirun -n 8 python tutorials/solutions/12_pipeline_schedules.py

Exercises 1 to 3 and 5 are arithmetic on lists of actions: rank 0 computes while the other ranks wait asleep
(pictures.on_rank0), and every rank checks the verdicts it broadcasts. Exercise 4 trains one step on the chapter's
4-stage pipeline (dp 2 x pp 4, the 16-block model, float64) for v = 1, 2 and 4.
"""
# mpirun -n 8 python tutorials/solutions/12_pipeline_schedules.py
import itertools
import os
import sys

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
import pictures  # noqa: E402
from checks import Checks, solve, train_config  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.pp.chunks import pp_formula  # noqa: E402
from hsgd.run.report import fmt_bytes  # noqa: E402
from hsgd.pp.placement import placement  # noqa: E402
from hsgd.pp.schedules import Action, Pair, ScheduleError, build, placement_of, simulate  # noqa: E402
from hsgd.pp.timelines import bubble_formula, bubble_fraction, idle_per_stage, most_idle, peak_held  # noqa: E402
from hsgd.pp.schedules import check as check_schedule  # noqa: E402

threadpool_limits(1)                    # eight ranks share the cores, tiny matrices: one BLAS thread each
world = MPI.COMM_WORLD
cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=16, d_ff=32)   # the chapter's model
corpus = Corpus.load(None, cfg.seq_len)


def on_rank0(work):
    """work() on rank 0 while the other ranks sleep (`pictures.on_rank0`, which raises on every rank if work()
    fails there), its result on every rank."""
    return world.bcast(pictures.on_rank0(world, work), root=0)


def accepted(actions, m, v=1):
    """Whether schedules.check runs the lists to their end."""
    return not refusal(actions, m, v)


def refusal(actions, m, v=1, pl=None):
    """schedules.check's message for lists it refuses, "" for lists it accepts (pl: the placement, default the
    loop)."""
    try:
        check_schedule(actions, m, v, pl)
        return ""
    except ScheduleError as e:
        return str(e)


# ---------------------------------------------------------------------------------------------------- exercise 1

def interleaved_by_hand(m, p, s, v, warm=None):
    """Stage s's interleaved list from the chapter's description; warm: the warm-up forwards (default: Megatron-LM's
    2(p-s-1) + (v-1)p, p-s-1 for v = 1)."""
    total = m * v
    if warm is None:
        warm = 2 * (p - s - 1) + (v - 1) * p if v > 1 else p - s - 1
    warm = min(warm, total)

    def mb(i):
        return (i // (p * v)) * p + i % p                   # groups of p micro-batches

    acts = [Action("F", mb(i), (i // p) % v) for i in range(warm)]
    for i in range(total - warm):
        acts += [Action("F", mb(warm + i), ((warm + i) // p) % v), Action("B", mb(i), v - 1 - (i // p) % v)]
    return acts + [Action("B", mb(i), v - 1 - (i // p) % v) for i in range(total - warm, total)]


def exercise_1(check):
    """Megatron-LM's interleaved order by hand."""
    def work():
        cases = [(p, v, m) for p in range(2, 7) for v in range(1, 5) for m in (p, 2 * p, 3 * p)]
        mine = {c: [interleaved_by_hand(c[2], c[0], s, c[1]) for s in range(c[0])] for c in cases}
        same = all(mine[c] == build("interleaved", c[2], c[0], c[1]) for c in cases)
        ok = all(accepted(mine[c], c[2], c[1]) for c in cases)
        ordered = all([a.mb for a in acts if a.kind == "B" and a.chunk == k] == list(range(m))
                      for (p, v, m), lists in mine.items() for acts in lists for k in range(v))
        longer = {}                                          # the interleaved warm-up 2(p-s-1) with one chunk
        for p in (2, 4, 8):
            for m in (p, 2 * p, 4 * p):
                lists = [interleaved_by_hand(m, p, s, 1, warm=2 * (p - s - 1)) for s in range(p)]
                longer[p, m] = (bubble_fraction(simulate(lists, m)), bubble_formula("1f1b", m, p),
                                [peak_held(a) for a in lists], [min(2 * (p - s - 1) + 1, m) for s in range(p)],
                                [peak_held(a) for a in build("1f1b", m, p)])
        return len(cases), same, ok, ordered, longer

    n, same, ok, ordered, longer = on_rank0(work)
    check.holds(f"my interleaved lists == schedules.build, {n} cases (p 2..6, v 1..4, m p..3p)", same)
    check.holds("schedules.check accepts every one", ok)
    check.holds("each chunk's backwards run micro-batches 0, 1, ..., m-1 in order", ordered)
    check("v = 1 with the interleaved warm-up 2(p-s-1): bubble - (p-1)/(m+p-1)",
          max(abs(b - f) for b, f, _, _, _ in longer.values()), 1e-12)
    check.equal("its peak pairs per stage == min(2(p-s-1) + 1, m)", [r[2] for r in longer.values()],
                [r[3] for r in longer.values()])
    b, f, held, _, one = longer[8, 16]
    check.say(f"p = 8, m = 16: pairs held with warm-up 2(p-s-1) {held}, with 1F1B's p-s-1 {one}: the same bubble "
              f"{b:.4f} for up to {max(held) - max(one)} more pairs on stage 0")


# ---------------------------------------------------------------------------------------------------- exercise 2

def one_f_one_b(m, p, s, kind="B"):
    """1F1B: min(p-s-1, m) warm-up forwards, then F and B in turn, then the remaining backwards."""
    warm = min(p - s - 1, m)
    acts = [Action("F", j) for j in range(warm)]
    for j in range(m - warm):
        acts += [Action("F", warm + j), Action(kind, j)]
    return acts + [Action(kind, j) for j in range(m - warm, m)]


def zb_h1_by_hand(m, p, s):
    """1F1B's forwards and (split) backwards, with W j right after B (j + s); the last s W's at the end."""
    out = []
    for a in one_f_one_b(m, p, s):
        out.append(a)
        if a.kind == "B" and a.mb - s >= 0:
            out.append(Action("W", a.mb - s))
    return out + [Action("W", j) for j in range(max(0, m - s), m)]


def exercise_2(check):
    """ZB-H1 by hand."""
    def work():
        rows = []
        for costs in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5)):
            f, b, w = costs
            for p in range(2, 9):
                for m in range(p, 3 * p + 1, p):
                    mine = [zb_h1_by_hand(m, p, s) for s in range(p)]
                    found = build("zb-h1", m, p, costs=costs)
                    rows.append((costs, p, m, mine == found, idle_per_stage(simulate(mine, m, 1, costs)),
                                 idle_per_stage(simulate(found, m, 1, costs)), (p - 1) * (f + b - w),
                                 max(peak_held(a) for a in mine)))
        return rows

    rows = on_rank0(work)
    equal = [r for r in rows if r[0] == (1.0, 1.0, 1.0)]
    half = [r for r in rows if r[0] == (1.0, 1.0, 0.5)]
    check.holds("equal costs: my ZB-H1 == schedules.build('zb-h1'), p = 2..8, m = p, 2p, 3p", all(r[3] for r in equal))
    check("equal costs: my list's idle per stage - (p-1)(F+B-W)", max(abs(r[4] - r[6]) for r in equal), 1e-12)
    check.holds("every stage holds p pairs at most", all(r[7] <= r[1] for r in rows))
    check("W = F/2: my list's and build's idle per stage - (p-1)(F+B-W)",
          max(max(abs(r[4] - r[6]), abs(r[5] - r[6])) for r in half), 1e-12)
    differ = sum(not r[3] for r in half)
    check.say(f"with W = F/2, build's list differs from mine in {differ} of {len(half)} cases (a cheaper W fits "
              f"into other gaps), with the same idle time: the formula fixes the bubble, not the list")


# ---------------------------------------------------------------------------------------------------- exercise 3

def stage_orders(m):
    """Every order of F0..F(m-1), B0..B(m-1) with each forward before its backward."""
    acts = [Action(k, j) for k in "FB" for j in range(m)]
    return [list(o) for o in itertools.permutations(acts)
            if all(o.index(Action("F", j)) < o.index(Action("B", j)) for j in range(m))]


def runs_to_end(lists):
    """My deadlock test: every stage runs its list as far as its inputs allow, again and again, until nothing
    moves; the lists can run if every stage got to its end."""
    p, done, pos = len(lists), set(), [0] * len(lists)
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                if a.kind == "F":
                    need = ("F", s - 1, a.mb) if s > 0 else None               # the activation
                else:
                    need = ("B", s + 1, a.mb) if s < p - 1 else ("F", s, a.mb)   # the gradient, or the loss
                if need is not None and need not in done:
                    break
                done.add((a.kind, s, a.mb))
                pos[s] += 1
                moved = True
    return all(pos[s] == len(lists[s]) for s in range(p))


def exercise_3(check):
    """Every schedule of a small pipeline."""
    def work():
        orders = stage_orders(2)
        out = {}
        for p in (2, 3):
            combos = [list(c) for c in itertools.product(orders, repeat=p)]
            mine = [runs_to_end(c) for c in combos]
            theirs = [accepted(c, 2) for c in combos]
            good = [c for c, ok in zip(combos, theirs) if ok]
            spans = [max(e for row in simulate(c, 2) for _, _, e in row) for c in good]
            pairs = [max(peak_held(a) for a in c) for c in good]
            best = min(range(len(good)), key=lambda i: (spans[i], pairs[i]))
            onefb = build("1f1b", 2, p)
            out[p] = (len(orders), len(combos), mine == theirs, sum(theirs), min(spans), min(pairs),
                      " | ".join(" ".join(map(str, a)) for a in good[best]),
                      " | ".join(" ".join(map(str, a)) for a in onefb),
                      max(e for row in simulate(onefb, 2) for _, _, e in row))
        return out

    out = on_rank0(work)
    check.equal("orders of F0 F1 B0 B1 with each F before its B", out[2][0], 6)
    for p in (2, 3):
        n_orders, n, same, ok, span, pairs, best, onefb, onefb_span = out[p]
        check.holds(f"p = {p}: my deadlock test == schedules.check on all {n} combinations", same)
        check.say(f"p = {p}: {ok} of {n} combinations run; shortest step {span:g} (F = 1, fused B = 2), fewest "
                  f"pairs held {pairs} (running one micro-batch at a time); a shortest one with the fewest pairs: "
                  f"{best}; 1F1B: {onefb}")
        check.equal(f"p = {p}: 1F1B's step == the shortest, 3(m+p-1)", (onefb_span, span), (3.0 * (p + 1),) * 2)


# ---------------------------------------------------------------------------------------------------- exercise 4

def exercise_4(check):
    """What interleaving sends."""
    g = ProcessGrid(world, dp=2, pp=4, tp=1)
    s, p, m, B = g.pp_rank, g.pp, 8, 16
    b = B // g.dp // m
    full, sent = {}, {}
    for v in (1, 2, 4):
        tc = train_config(dp=2, pp=4, tp=1, steps=1, batch_size=B, micro_batches=m, schedule="interleaved",
                          virtual_stages=v, seed=0)
        trainer = HybridTrainer(cfg, g, tc)
        before = g.stats.counts()
        trainer.step(*corpus.batch(0, 1, B), 1)
        sent[v] = {key: n for key, n in g.stats.since(before).items() if key[0] == "pp"}
        full[v] = trainer.full_params()
        trainer.free()
        calls = m * (2 * v - (s == 0) - (s == p - 1))               # each way
        msg = b * cfg.seq_len * cfg.d_model * 8                     # one (b, T, C) float64 activation
        by_hand = {("pp", "Isend"): (calls, calls * msg), ("pp", "Recv"): (calls, calls * msg)}
        check.equal(f"v = {v}: pp_comm calls and bytes == by hand == pp_formula", (sent[v], by_hand),
                    (by_hand, pp_formula(b, cfg, m, s == 0, s == p - 1, 8, "megatron", 1, v)))
    check.holds("v = 1, 2, 4 after one step: parameters bit-identical",
                all(np.array_equal(full[v][n], full[1][n]) for v in (2, 4) for n in full[1]))
    rows = g.pp_comm.allgather_obj([sent[v][("pp", "Isend")] for v in (1, 2, 4)])
    check.say("messages and bytes each stage sends per step")
    check.say(f"stage  {'v = 1 (1F1B)':>16}  {'v = 2':>16}  {'v = 4':>16}")
    for st, row in enumerate(rows):
        check.say(f"{st:>5}  " + "  ".join(f"{c:>3}, {fmt_bytes(n):>11}" for c, n in row))
    g.free()


# ---------------------------------------------------------------------------------------------------- exercise 5

def v_piece(s, c, p):
    """The piece chunk c of stage s holds in the V: down the stages on chunk 0, back up on chunk 1."""
    return s if c == 0 else 2 * p - 1 - s


def v_stage(k, p):
    """The stage that holds piece k in the V."""
    return k if k < p else 2 * p - 1 - k


def v_needs(a, s, p):
    """(kind, piece, micro-batch) that action a of stage s waits for in the V; None: nothing but its own list."""
    k = v_piece(s, a.chunk, p)
    if a.kind == "F":
        return None if k == 0 else ("F", k - 1, a.mb)            # the activation of piece k-1
    if a.kind == "B":
        return ("F", k, a.mb) if k == 2 * p - 1 else ("B", k + 1, a.mb)   # the loss, or the gradient of piece k+1
    return ("B", k, a.mb)                                          # W: its own B


def walk_v(lists, p):
    """Every stage runs its list as far as the V's dependencies allow, again and again until nothing moves (an F&B
    pair runs when both halves' inputs are there). Returns (the position each stage reached, what is done)."""
    done, pos, moved = set(), [0] * p, True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                parts = (a.f, a.b) if isinstance(a, Pair) else (a,)
                if any(n is not None and n not in done for n in (v_needs(x, s, p) for x in parts)):
                    break
                done.update((x.kind, v_piece(s, x.chunk, p), x.mb) for x in parts)
                pos[s] += 1
                moved = True
    return pos, done


def first_stuck(lists, p):
    """None if the V lists run to their end, else (stage, position, action) of the lowest stage that cannot go on,
    and the chain of waits from there: [(stage, action, what it waits for, on which stage)] until a stage waits for
    itself or for a stage already in the chain."""
    pos, done = walk_v(lists, p)
    stuck = [s for s in range(p) if pos[s] < len(lists[s])]
    if not stuck:
        return None, []
    s, chain, seen = stuck[0], [], set()
    while s not in seen:
        seen.add(s)
        a = lists[s][pos[s]]
        need = next(n for n in (v_needs(x, s, p) for x in ((a.f, a.b) if isinstance(a, Pair) else (a,)))
                    if n is not None and n not in done)
        chain.append((s, a, need, v_stage(need[1], p)))
        s = v_stage(need[1], p)
    return (stuck[0], pos[stuck[0]], lists[stuck[0]][pos[stuck[0]]]), chain


def fit_idle(kind, p, ms, costs):
    """Least squares of the simulated most_idle against (F&B, DeepSeek's B = B + W, W, 1) over the costs and m."""
    rows, idle = [], []
    for m in ms:
        acts, pl = build(kind, m, p, 2), placement_of(kind, p, 2)
        for f, b, w, fb in costs:
            rows.append([fb, b + w, w, 1.0])
            idle.append(most_idle(simulate(acts, m, 2, (f, b, w, fb), pl)))
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(idle), rcond=None)
    return coef, float(np.abs(np.array(rows) @ coef - np.array(idle)).max())


def exercise_5(check):
    """The V's turn, and DualPipe's Table 2 from the simulator."""
    def work():
        ok = {(kind, p, m): first_stuck(build(kind, m, p, 2), p)[0] is None
              and not refusal(build(kind, m, p, 2), m, 2, placement("v", p, 2))
              for kind in ("zb-v", "dualpipev") for p in range(2, 7) for m in (2 * p, 3 * p)}
        p, m = 4, 8
        lists = build("zb-v", m, p, 2)
        last = list(lists[p - 1])
        b0 = last.pop(last.index(Action("B", 0, 0)))               # piece 3's backward of micro-batch 0 ...
        last.insert(last.index(Action("B", 0, 1)), b0)             # ... before piece 4's, whose gradient it needs
        broken = lists[:p - 1] + [last]
        stuck, chain = first_stuck(broken, p)
        why = refusal(broken, m, 2, placement("v", p, 2))
        costs = [(1.0, 1.0, 1.0, 3.0), (1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 0.5, 2.0), (2.0, 2.0, 1.0, 4.5),
                 (1.0, 1.0, 0.25, 1.5), (3.0, 3.0, 2.0, 6.0), (2.0, 2.0, 0.5, 3.0)]
        assert all(w <= f and max(f, b + w) <= fb <= f + b + w for f, b, w, fb in costs)   # where Table 2 holds
        fits = {"dualpipe, p = 6": fit_idle("dualpipe", 6, (12, 24), costs),
                "dualpipev, p = 3": fit_idle("dualpipev", 3, (6, 12), costs)}
        return ok, stuck, [(s, str(a), need, t) for s, a, need, t in chain], why, fits

    ok, (s, i, a), chain, why, fits = on_rank0(work)
    check.holds(f"my V walker and schedules.check run ZB-V's, DualPipeV's lists, {len(ok)} cases",
                all(ok.values()))
    check.say(f"broken ZB-V (stage 3's B0 before its B0.1): schedules.check says\n  {why}")
    for st, act, need, t in chain:
        check.say(f"  stage {st} waits at {act} for {need[0]}{need[2]} of piece {need[1]}, on stage {t}")
    check.holds("my walker stops at the action schedules.check names first", f"stage {s} cannot run its action {i}, "
                f"{a}:" in why)
    check.equal("the chain ends on stage 3, whose B0 (piece 3) waits for its own piece 4",
                chain[-1][0:3], (3, "B0", ("B", 4, 0)))
    for name, (coef, resid) in fits.items():
        check.say(f"{name}: most_idle = {coef[0]:+.6f} F&B {coef[1]:+.6f} B {coef[2]:+.6f} W {coef[3]:+.6f} "
                  f"(largest residual {resid:.1e})")
        check(f"{name}: fitted (F&B, B, W, 1) - (2, 2, -6, 0), and the residual",
              max(float(np.abs(coef - [2, 2, -6, 0]).max()), resid), 1e-9)


if __name__ == "__main__":
    solve(Checks(world, tol=1e-12, width=76), [exercise_1, exercise_2, exercise_3, exercise_4, exercise_5])
