"""Pipeline schedules as data (hsgd.pp.schedules), without MPI: each builder's lists as documented, the static check
refusing what cannot run (naming the action), the simulated bubbles equal to the closed forms, zero bubble against
1F1B, the byte formula of interleaving, and the schedule lab's command line."""
import os
import subprocess
import sys

import pytest

from hsgd.errors import ConfigError
from hsgd.model.config import ModelConfig
from hsgd.pp import chunks as pp
from hsgd.pp.schedules import Action, ScheduleError, build, check, simulate
from hsgd.pp.timelines import (FORMULA, PEAK_FORMULA, bubble_formula, bubble_fraction, held, held_bytes, idle_per_stage,
                               peak_formula, peak_held)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def names(acts):
    return " ".join(map(str, acts))


def test_the_builders_lists():
    assert names(build("1f1b", 6, 4)[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert names(build("gpipe", 2, 3)[0]) == "F0 F1 B0 B1"
    # Megatron's interleaved order, p = 2, v = 2, m = 4: forwards in groups of p micro-batches per chunk
    assert names(build("interleaved", 4, 2, 2)[0]) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert names(build("interleaved", 4, 2, 2)[1]) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    zb = build("zb-h1", 8, 4)
    assert names(zb[3]).startswith("F0 B0 F1 B1 F2 B2 F3 B3 W0 F4")            # the last stage defers its W's
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)):
        for p in (2, 3, 4):
            for m in (p, 2 * p):
                acts = build(kind, m, p, v)
                check(acts, m, v)                                               # each once, and runs to the end
                kinds = {a.kind for stage in acts for a in stage}
                assert kinds == ({"F", "B", "W"} if kind == "zb-h1" else {"F", "B"})


def test_the_static_check_names_the_action_that_cannot_run():
    F, B = (lambda j: Action("F", j)), (lambda j: Action("B", j))
    # stage 1 wants F1 before it sends B0 back; stage 0 sends F1 only after B0 arrives: a cycle
    deadlock = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1), B(0)]]
    with pytest.raises(ScheduleError) as e:
        check(deadlock, 2)
    print(e.value)
    assert "deadlocks: stage 0 cannot run its action 1, B0: it waits for B0 of stage 1" in str(e.value)
    twice = [[F(0), F(0), B(0), B(1)], [F(0), B(0), F(1), B(1)]]
    with pytest.raises(ScheduleError, match="stage 0 runs F0 twice .* micro-batch 0 would be used twice"):
        check(twice, 2)
    with pytest.raises(ScheduleError, match="stage 1 never runs B1"):
        check([[F(0), B(0), F(1), B(1)], [F(0), B(0), F(1)]], 2)
    with pytest.raises(ScheduleError, match="stage 0 runs B0 \\(action 0\\) before its F0"):
        check([[B(0), F(0)]], 1)
    with pytest.raises(ScheduleError, match="runs W0 \\(action 1\\) before its B0"):
        check([[F(0), Action("W", 0), B(0)]], 1)
    with pytest.raises(ScheduleError, match="is not an Action"):
        check([[F(0), B(0), ("F", 1)]], 2)


def test_simulated_bubbles_equal_the_closed_forms():
    worst = 0.0
    for p in (2, 3, 4, 6, 8):
        for m in (1, 2, p, 2 * p, 3 * p):
            for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)):
                if (kind == "interleaved" and m % p) or (kind == "zb-h1" and m < p):
                    continue
                t = simulate(build(kind, m, p, v), m, v)
                worst = max(worst, abs(bubble_fraction(t) - bubble_formula(kind, m, p, v)))
    for costs in ((1, 2, 1), (1, 1, 0.5), (2, 1, 1), (2, 3, 1), (3, 3, 3)):
        for p in (2, 4, 8):
            for m in (p, 2 * p + 1):
                t = simulate(build("zb-h1", m, p, 1, costs), m, 1, costs)
                worst = max(worst, abs(bubble_fraction(t) - bubble_formula("zb-h1", m, p, 1, costs)))
    print(f"simulated bubble vs {FORMULA}: max difference {worst:.1e}")
    assert worst < 1e-12
    assert bubble_formula("zb-h1", 2, 4) is None and bubble_formula("zb-h1", 8, 4, 1, (1, 1, 2)) is None


def test_zero_bubble_has_a_third_of_1f1bs_bubble_with_its_peak_pairs():
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            zb, one = build("zb-h1", m, p), build("1f1b", m, p)
            ratio = idle_per_stage(simulate(zb, m)) / idle_per_stage(simulate(one, m))
            peaks = [peak_held(a) for a in zb]
            print(f"p={p} m={m}: zb-h1 idle / 1f1b idle = {ratio:.4f}; pairs held {peaks} vs "
                  f"{[peak_held(a) for a in one]}")
            assert abs(ratio - 1 / 3) < 1e-12 and ratio <= 0.4
            assert max(peaks) == max(peak_held(a) for a in one) == p


def test_the_peak_pairs_held_equal_their_closed_forms():
    n = 0
    for p in (1, 2, 3, 4, 6, 8):
        for m in (1, 2, 3, p, p + 1, 2 * p, 4 * p):
            for kind, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 1), ("interleaved", 2),
                            ("interleaved", 3)):
                if kind == "interleaved" and (m % p or (p == 1 and v > 1)):
                    continue
                acts = build(kind, m, p, v)
                assert [peak_held(a) for a in acts] == [peak_formula(kind, m, p, s, v) for s in range(p)], \
                    (kind, m, p, v)
                n += 1
    assert build("interleaved", 8, 4, 1) == build("1f1b", 8, 4)              # one chunk: 1F1B itself
    print(f"{n} (schedule, m, p, v): every stage's peak equals {PEAK_FORMULA}")


def test_held_counts_until_the_backward_is_whole():
    acts = build("zb-h1", 4, 2)[0]
    assert held(acts)[-1] == 0 and peak_held(acts) == 2
    # keep 10 per pair until its B, then 3 until its W
    F, B, W = (lambda j: Action("F", j)), (lambda j: Action("B", j)), (lambda j: Action("W", j))
    assert held_bytes([F(0), B(0), F(1), W(0), B(1), W(1)], [10], [3]) == 13
    assert held_bytes([F(0), F(1), B(0), B(1)], [10], [3]) == 20


def test_interleaving_sends_v_times_as_often():
    from hsgd.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=8, d_ff=32)
    one = pp.pp_formula(2, cfg, 4, False, False, 8)[("pp", "Isend")]
    two = pp.pp_formula(2, cfg, 4, False, False, 8, v=2)[("pp", "Isend")]
    first = pp.pp_formula(2, cfg, 4, True, False, 8, v=2)[("pp", "Isend")]
    assert two == (2 * one[0], 2 * one[1]) and first[0] == 4 * 3
    assert [len(r) for r in pp.chunk_layers(8, 2, 2)] == [2, 2, 2, 2]


def lab(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "hsgd.schedule", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def test_the_lab_without_mpi(tmp_path, capsys):
    r = lab("--pp", "4", "--micro-batches", "8", "--schedule", "interleaved", "--virtual-stages", "2",
            "--n-layers", "8", "--plot", str(tmp_path / "s.png"))
    print(r.stdout[-1500:], r.stderr[-500:])
    assert r.returncode == 0
    assert "stage 0 |   F0   F1   F2   F3 F0.1" in r.stdout
    assert "bubble: simulated 0.1579 of the step" in r.stdout and "(p-1)/(vm+p-1) = 0.1579" in r.stdout
    assert "held at the peak, per stage: (micro-batch, chunk) pairs [11, 9, 7, 5]" in r.stdout
    assert os.path.getsize(tmp_path / "s.png") > 1000
    from hsgd.schedule import main                                      # the usage errors, in this process
    for args, words in ((["--schedule", "zb-h1", "--costs", "1,1"], "costs='1,1' must be three numbers F,B,W"),
                        (["--micro-batches", "6", "--batch-size", "12", "--schedule", "interleaved",
                          "--virtual-stages", "2", "--n-layers", "8"], "micro_batches=6 must be a multiple of 4"),
                        (["--schedule", "1f1b", "--virtual-stages", "2", "--n-layers", "8"],
                         "virtual_stages=2 needs the interleaved schedule")):
        assert main(["--pp", "4", *args]) == 2
        assert words in capsys.readouterr().err
    for costs in ("1,1,0", "1,1.5,0.3"):                                  # a W that takes no time; odd slots
        assert main(["--pp", "4", "--schedule", "zb-h1", "--costs", costs]) == 0
        assert "stage 3 |" in capsys.readouterr().out
    for cp, sent in ((1, "128.0 KiB"), (2, "64.0 KiB")):                 # cp halves each message: T/cp positions
        assert main(["--pp", "2", "--tp", "2", "--cp", str(cp), "--seq-len", "16"]) == 0
        assert f"messages sent [8, 8], bytes ['{sent}', '{sent}']" in capsys.readouterr().out


def test_what_the_new_schedules_do_not_combine_with_is_refused():
    from hsgd.errors import ConfigError
    from hsgd.run.flags import configs_from_args
    from hsgd.run.flags import build_parser
    for flags, words in ((["--zero", "2", "--schedule", "zb-h1"], "this schedule computes weight gradients later"),
                         (["--memory", "--schedule", "interleaved", "--virtual-stages", "2"],
                          "measure interleaved with python -m hsgd.schedule --run"),
                         (["--schedule", "interleaved", "--virtual-stages", "3"], "cannot be cut into pp x "
                          "virtual_stages = 2 x 3 = 6 chunks")):
        args = build_parser().parse_args(["--pp", "2", "--tp", "1", "--n-layers", "4", "--micro-batches", "2",
                                          "--batch-size", "8", *flags])
        with pytest.raises(ConfigError, match=words):
            configs_from_args(args, 4)


def test_a_stage_with_chunks_needs_a_pipeline():
    """One stage with v > 1 chunks would send every activation to itself: refused when the stage is built (not
    only by the command line), and so is zb-h1 with ZeRO 2."""
    from mpi4py import MPI

    from hsgd.model.config import ModelConfig
    from hsgd.errors import ConfigError
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.settings import Data, Layout, TrainConfig
    from hsgd.pp.stage import Stage
    cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=4, d_ff=32)
    grid = ProcessGrid(MPI.COMM_WORLD, dp=1, pp=1, tp=1)
    tc = TrainConfig(schedule="interleaved", virtual_stages=2, micro_batches=2)
    with pytest.raises(ConfigError, match="virtual_stages=2 needs pp > 1"):
        Stage(cfg, grid, tc.group(Layout), tc.recompute, tc.group(Data))
    with pytest.raises(ConfigError, match="zb-h1 with --zero 2"):
        TrainConfig(pp=2, schedule="zb-h1", zero=2).validate()
    grid.free()


# ------------------------------------------------------------------------------------------------ placements

def test_placements_say_which_stage_holds_each_piece():
    from hsgd.pp.placement import placement
    for p, v in [(1, 1), (4, 1), (4, 3)]:
        loop = placement("loop", p, v)
        assert [loop.piece(s, c) for c in range(v) for s in range(p)] == list(range(p * v))
        assert all(loop.local_handoffs(s) == 0 for s in range(p))
    V = placement("v", 4, 2)
    assert [V.holder(k) for k in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [V.local_handoffs(s) for s in range(4)] == [0, 0, 0, 1]                 # the turn, on the last stage
    with pytest.raises(ConfigError, match="2 chunks on every stage"):
        placement("v", 4, 3)


def test_a_hand_off_to_the_same_stage_is_no_message():
    from hsgd.pp.chunks import pp_formula
    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=8, d_ff=16)
    turn = pp_formula(2, cfg, 3, False, False, 8, v=2, local=1)[("pp", "Isend")]
    middle = pp_formula(2, cfg, 3, False, False, 8, v=2)[("pp", "Isend")]
    assert turn[0] == 3 * 2 and middle[0] == 3 * 4          # m (2v - 2 local) against m 2v
