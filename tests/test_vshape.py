"""The V-shaped and two-way schedules (hsgd.pp.vshape: ZB-V, DualPipeV, DualPipe) as data: the placements they run
on, the static check on them, the published numbers reproduced by the simulator (DeepSeek-V3's Table 2 for 1F1B,
ZB1P and DualPipe over a range of costs; the ZB-V paper's zero bubble with 1F1B's memory), the pairs held at the
peak, and the lab's refusals. Training them on 8 ranks: tests/mpi/test_pipeline.py."""
import itertools

import pytest

from hsgd.errors import ConfigError
from hsgd.pp.placement import placement
from hsgd.pp.schedules import Action, Pair, ScheduleError, build, check, flat, placement_of, simulate
from hsgd.pp.timelines import (bubble_formula, bubble_fraction, most_idle, peak_formula, peak_held, stage_idle,
                               table2)


def run(kind, m, p, costs=(1.0, 1.0, 1.0)):
    v = 2 if kind in ("zb-v", "dualpipev", "dualpipe") else 1
    acts = build(kind, m, p, v)
    return acts, simulate(acts, m, v, costs, placement_of(kind, p, v))


def test_the_placements_paths():
    V, D = placement("v", 4, 2), placement("dual", 4, 2)
    assert [V.before(3, 1), V.after(3, 0), V.after(0, 1), V.before(0, 0)] == [(3, 0), (3, 1), None, None]
    assert [D.after(1, 0), D.before(1, 0), D.after(1, 1), D.before(1, 1)] == [(2, 0), (0, 0), (0, 1), (2, 1)]
    assert [D.piece(s, 1) for s in range(4)] == [3, 2, 1, 0] and D.K == 4
    assert [D.runs(c, j, 8) for c in (0, 1) for j in (0, 3, 4, 7)] == [True, True, False, False,
                                                                       False, False, True, True]
    assert [D.local_handoffs(s) for s in range(4)] == [0, 0, 0, 0]       # the two directions meet by message
    with pytest.raises(ConfigError, match="pp=3 must be even, e.g. 2 or 4"):
        placement("dual", 3, 2)


def test_deepseek_v3_table_2_reproduced_over_a_range_of_costs():
    """The idle time of the least busy stage (most_idle) equals Table 2's closed forms, B being a whole backward:
    1F1B (p-1)(F+B), ZB1P (p-1)(F+B-2W), DualPipe (p/2-1)(F&B+B-3W) (DualPipeV, DualPipe of 2p stages folded:
    (p-1)(...)), for F = B here, W <= F and F&B from max(F, B+W) (full overlap) to F+B+W (none)."""
    worst, n = 0.0, 0
    for kind, stages in (("1f1b", (2, 4, 8)), ("zb-h1", (2, 4, 8)), ("dualpipe", (2, 4, 6, 8)),
                         ("dualpipev", (2, 3, 4, 8))):
        for p, extra, f, w in itertools.product(stages, (0, 2, 2 * 4), (1.0, 2.0), (0.25, 0.5, 1.0)):
            m, b, w = 2 * p + extra, f, w * f
            for fb in (f + b + w, 0.85 * (f + b + w), max(f, b + w)):
                _, tl = run(kind, m, p, (f, b, w, fb))
                closed = table2(kind, m, p, (f, b, w, fb))
                worst, n = max(worst, abs(most_idle(tl) - closed)), n + 1
    print(f"Table 2: {n} cases, largest |simulated - closed form| {worst:.1e}")
    assert worst < 1e-9
    assert table2("dualpipe", 8, 4, (1, 2, 1)) is None                 # F != B: outside where it holds


def test_the_peak_pairs_of_table_2_and_of_the_v():
    """1F1B and ZB1P hold p (micro-batch, chunk) pairs at the peak, DualPipe p + 1 (Table 2: PP, PP, PP + 1), each
    pair a p-th of the model; DualPipeV 2p + 1 and ZB-V 2p pairs of half that (ZB-V: 1F1B's memory), on every stage
    where the closed form says (peak_formula)."""
    for p in (2, 4, 6, 8):
        m = 2 * p + 2
        got = {k: [peak_held(a) for a in run(k, m, p)[0]] for k in ("1f1b", "zb-h1", "dualpipe", "dualpipev", "zb-v")}
        v = {"1f1b": 1, "zb-h1": 1}
        for kind, held in got.items():
            assert held == [peak_formula(kind, m, p, s, v.get(kind, 2)) for s in range(p)], (kind, p, held)
        assert (max(got["1f1b"]), max(got["zb-h1"]), max(got["dualpipe"])) == (p, p, p + 1)
        assert max(got["zb-v"]) == 2 * p and max(got["dualpipev"]) == 2 * p + 1
    for p, m in itertools.product((2, 3, 4, 8), range(1, 20)):         # ZB-V below m = 2p too
        held = [peak_held(a) for a in run("zb-v", m, p)[0]]
        assert held == [peak_formula("zb-v", m, p, s, 2) for s in range(p)], (p, m, held)


def test_zb_v_has_no_bubble_by_the_zero_bubble_papers_measure():
    """ZB-V (Qi et al. 2024): with F = B = W every stage is busy from its first action to its last (stage_idle 0,
    the papers' bubble rate 1 - m(F+B+W)/longest stage time); over the whole step the fill and drain of the V
    remain, (p-1)F per stage, the closed form bubble_formula gives."""
    for p, m, f in itertools.product((2, 3, 4, 6, 8), (0, 1, 5), (0.5, 1.0, 3.0)):
        m = 2 * p - 1 + m
        _, tl = run("zb-v", m, p, (f, f, f))
        assert stage_idle(tl) < 1e-9
        assert abs(bubble_fraction(tl) - bubble_formula("zb-v", m, p, 2, (f, f, f))) < 1e-12
    for kind in ("dualpipe", "dualpipev"):                              # no overlap credit: equal busy stages
        for p in (2, 4, 8):
            _, tl = run(kind, 2 * p + 4, p)
            assert abs(bubble_fraction(tl) - bubble_formula(kind, 2 * p + 4, p, 2)) < 1e-12


def test_every_list_passes_the_static_check_and_a_broken_v_names_its_stuck_action():
    for kind, p, m in itertools.product(("zb-v", "dualpipev", "dualpipe"), (2, 4, 6), (12, 13, 16)):
        if kind == "dualpipe" and m % 2:
            continue
        acts, _ = run(kind, m, p)
        counts = [sum(1 for a in flat(s) if a.kind == "F") for s in acts]
        assert counts == [m if kind == "dualpipe" else 2 * m] * p        # each micro-batch once per chunk it passes
    acts = build("zb-v", 6, 3, 2)
    broken = [list(a) for a in acts]
    broken[0].remove(Action("F", 0, 1))                                 # stage 0 waits for the loss's input first
    broken[0].insert(0, Action("F", 0, 1))
    with pytest.raises(ScheduleError, match=r"deadlocks: stage 0 cannot run its action 0, F0.1: it waits for F0.1 "
                                            r"of stage 1, which comes at stage 1's action \d+, and stage 1 is stuck "
                                            r"at its action 0, F0"):
        check(broken, 6, 2, placement("v", 3, 2))
    pair = [list(a) for a in build("dualpipev", 8, 2, 2)]
    i = next(i for i, a in enumerate(pair[0]) if isinstance(a, Pair))
    pair[0][i] = Pair(pair[0][i].b, pair[0][i].f)                       # a "pair" of a B and an F: not a pair
    with pytest.raises(ScheduleError, match="or a Pair of an F and a B"):
        check(pair, 8, 2, placement("v", 2, 2))


@pytest.mark.parametrize("kind, p, m, words", [
    ("dualpipe", 3, 12, "pp=3 must be even, e.g. 2 or 4"),
    ("dualpipe", 4, 6, "at least 2 pp = 8 micro-batches (an even number: half from each end); micro_batches=6"),
    ("dualpipe", 4, 9, "an even number: half from each end"),
    ("dualpipev", 4, 7, "at least 2 pp = 8 micro-batches; micro_batches=7 is too few"),
    ("zb-v", 1, 4, "one stage would hand every activation to itself; use --pp 2 or more")])
def test_the_refusals(kind, p, m, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build(kind, m, p, 2)


def test_the_lab_refuses_with_one_line(capsys):
    from hsgd.schedule import main
    for args, words in ((["--pp", "3", "--schedule", "dualpipe"], "pp=3 must be even"),
                        (["--pp", "4", "--schedule", "dualpipev", "--micro-batches", "4", "--batch-size", "8",
                          "--n-layers", "8"],
                         "micro_batches=4 is too few, use --micro-batches 8 or more"),
                        (["--pp", "1", "--schedule", "zb-v"], "use --pp 2 or more"),
                        (["--pp", "2", "--schedule", "dualpipe", "--costs", "1,1,1,1.5"],
                         "cannot take less than its longer part, max(F, B+W) = 2")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert main(["--pp", "4", "--schedule", "dualpipe", "--costs", "1,1,1,2.5", "--n-layers", "4"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "idle of the least busy stage simulated 1.5 | (p/2-1)(F&B+B-3W) = 1.5" in out
    assert "(micro-batch, chunk) pairs [5, 5, 5, 5] (closed form p+1: [5, 5, 5, 5])" in out
