"""Every size read from a flag or a file is bounded before work depends on it (README, "Bad input": a size beyond
hsgd's stated maxima): a model, a layout, a plan's devices and batch, a schedule, a checkpoint manifest and a
crosscheck dump that declare sizes far beyond a machine end with one line naming the value, the limit and what would
work, within seconds, instead of a loop or an allocation proportional to the declared size. And the searches that
error messages make (the divisors of a size, the factorizations of a world size) and the schedule simulator cost
O(sqrt n) and linear time."""
import time

import pytest

from hsgd.errors import UsageError

SECONDS = 2.0                      # each case, from the call to its one line
BIG = 10**12                       # far beyond any stated maximum


def first_line(fn):
    """(the one line of the UsageError fn raises, seconds it took)."""
    start = time.perf_counter()
    with pytest.raises(UsageError) as e:
        fn()
    took = time.perf_counter() - start
    text = str(e.value)
    assert "\n" not in text, text
    return text, took


# ------------------------------------------------------------------------------------------------ the cases

def model(**sizes):
    from hsgd.model.config import ModelConfig
    return lambda: ModelConfig(**sizes)


def train(*argv, world_size=1):
    """configs_from_args of hsgd.train's flags, then the memory check of one rank (what every rank of hsgd.train,
    hsgd.verify and hsgd.schedule --run runs before any communication)."""
    def run():
        from hsgd.errors import ConfigError
        from hsgd.run.flags import build_parser, configs_from_args
        from hsgd.run.preflight import check_memory
        cfg, tc = configs_from_args(build_parser().parse_args(list(argv)), world_size)
        check_memory(cfg, tc, 1, ConfigError)
    return run


def schedule(kind, m, p, v=1):
    from hsgd.pp.schedules import build
    return lambda: build(kind, m, p, v)


def simulated(m, p):
    """simulate() of a list handed in (the schedule lab's --actions), checked before it is walked."""
    from hsgd.pp.schedules import Action, simulate
    return lambda: simulate([[Action("F", 0)]] * p, m)


def manifest(L, NH, pp, tp, C=None, F=None):
    """check() of a checkpoint manifest (its digest matching) whose model and layout carry these sizes."""
    def run():
        from hsgd.checkpoint.manifest import check, digest
        from hsgd.checkpoint.store import CheckpointError
        m = {"format": "hsgd-checkpoint-1", "step": 1, "dtype": "float32", "data": {}, "files": {},
             "model": {"vocab_size": 256, "seq_len": 8, "d_model": C or NH, "n_heads": NH, "n_layers": L,
                       "d_ff": F or NH},
             "layout": {"dp": 1, "pp": pp, "tp": tp, "cp": 1, "tp_scheme": "megatron", "virtual_stages": 1,
                        "layers": [L // pp] * pp},
             "optimizer": {"name": "sgd", "t": 1}, "run": {"line": "x", "id": None}, "written_ns": 1}
        m["digest"] = digest(m)
        check(m, "step-000001", CheckpointError)
    return run


def dump_header(ranks=1, n_layers=1, **parallel):
    """layout.json's header and tensors read as hsgd.crosscheck.read.load reads them (the model, the ranks, then
    each tensor against the model's parameters)."""
    def run():
        from hsgd.crosscheck import read
        meta = {"format": "hsgd-crosscheck", "version": 1, "dtype": "float64", "loss": 1.0, "ranks": ranks,
                "parallel": parallel, "tensors": {"wte": {"shape": [256, 8], "shards": [{"rank": 0}]}},
                "model": {"vocab_size": 256, "seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": n_layers,
                          "d_ff": 8}}
        cfg, _, _, ranks_, _ = read._header(meta)
        read._tensors(meta["tensors"], cfg, ranks_)
    return run


def reference(B, T, **sizes):
    def run():
        from hsgd.crosscheck.dump import check_reference_fits
        from hsgd.model.config import ModelConfig
        check_reference_fits(ModelConfig(**sizes), (B, T))
    return run


def plan(*argv):
    """python -m hsgd.plan's own checks, in-process."""
    def run():
        from hsgd.plan.__main__ import parse_model
        from hsgd.plan.search import check_search
        flags = dict(zip(argv[::2], argv[1::2]))
        cfg = parse_model(flags.get("--model", "hsgd-default"))
        check_search(cfg, int(flags.get("--batch", 32)), int(flags.get("--devices", 8)))
    return run


CASES = [
    ("d_model 10^12+1, n_heads 2", model(d_model=BIG + 1, n_heads=2),
     "d_model=1000000000001 is more than hsgd takes (at most 1048576); give d_model from 1 to 1048576"),
    ("n_layers 10^9", model(n_layers=10**9), "n_layers=1000000000 is more than hsgd takes (at most 4096)"),
    ("--d-model 10^12+1 --n-heads 2", train("--d-model", str(BIG + 1), "--n-heads", "2"),
     "d_model=1000000000001 is more than hsgd takes (at most 1048576)"),
    ("--tp 2000000", train("--tp", "2000000"), "tp=2000000 is more than hsgd takes (at most 1048576)"),
    ("a model no rank can hold (also hsgd.verify, hsgd.schedule --run)",
     train("--d-model", "1048576", "--n-heads", "2"), "this run needs at least"),
    ("a batch no rank can hold", train("--batch-size", str(2**30)), "this run needs at least"),
    ("--sample-bytes 10^12", train("--sample-bytes", str(BIG)),
     "sample_bytes=1000000000000 is more than hsgd takes (at most 1048576); each byte is a forward pass"),
    ("10^6 micro-batches on 2 stages", train("--pp", "2", "--tp", "1", "--micro-batches", str(2**20),
                                             "--batch-size", str(2**20), "--seq-len", "8", world_size=2),
     "pp x virtual_stages x micro_batches = 2 x 1 x 1048576 = 2097152 is more than a schedule hsgd writes down"),
    ("plan --devices 10^12", plan("--devices", str(BIG)),
     "devices=1000000000000 is more than hsgd takes (at most 1048576)"),
    ("plan --model L=10^9", plan("--model", "L=1000000000,C=128,NH=4"),
     "--model 'L=1000000000,C=128,NH=4': n_layers=1000000000 is more than hsgd takes (at most 4096)"),
    ("plan --batch 10^12", plan("--batch", str(BIG)), "batch=1000000000000 is more than hsgd takes"),
    ("schedule pp 10^5", schedule("1f1b", 8, 10**5),
     "pp x virtual_stages x micro_batches = 100000 x 1 x 8 = 800000 is more than a schedule hsgd writes down"),
    ("zb-h1 m 10^12", schedule("zb-h1", BIG, 4), "is more than a schedule hsgd writes down (at most 262144"),
    ("simulate a list of 10^6 stages", simulated(1, 10**6), "1000000 x 1 x 1 = 1000000 is more than a schedule"),
    ("manifest pp = tp = 10^5", manifest(L=10**5, NH=10**5, pp=10**5, tp=10**5),
     "checkpoint 'step-000001' is corrupt: its manifest describes no valid model (n_layers=100000 is more than"),
    ("manifest of 4096 x 4096 shards", manifest(L=4096, NH=4096, pp=4096, tp=4096),
     "checkpoint 'step-000001' is corrupt: its manifest has a layout of dp x pp x cp x tp = 16777216 ranks, more "
     "than a job has (at most 1048576)"),
    ("dump of 10^9 layers", dump_header(n_layers=10**9),
     "layout.json: model: n_layers=1000000000 is more than hsgd takes (at most 4096)"),
    ("dump of 10^12 ranks", dump_header(ranks=BIG), "layout.json: ranks = 1000000000000 is more than a job has"),
    ("dump of dp 10^12", dump_header(dp=BIG), "layout.json: parallel.dp = 1000000000000 is more than a job has"),
    ("dump of a giant batch", reference(2**30, 64, n_layers=4),
     "the dump's model and batch (B, T) = (1073741824, 64) need at least"),
    ("dump of a giant model", reference(1, 1, n_layers=4096, d_model=2**16, n_heads=1, d_ff=2**16),
     "the dump's model and batch (B, T) = (1, 1) need at least"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("what, fn, expect", CASES, ids=[c[0] for c in CASES])
def test_a_size_beyond_its_bound_is_one_line_within_seconds(what, fn, expect):
    line, took = first_line(fn)
    print(f"{what}: {took:.3f} s: {line}")
    assert line.startswith(expect) or expect in line, line
    assert took < SECONDS, f"{what} took {took:.1f} s"


def test_the_model_bounds_take_every_preset_of_the_planner():
    from hsgd.plan.__main__ import presets
    assert presets()["narayanan-1008b"].n_layers == 128                # the largest there is, well inside


# ------------------------------------------------------------------------------------------------ the searches

@pytest.mark.timeout(20)
def test_divisors_and_factorizations_take_sqrt_time():
    from hsgd.grid.process_grid import factorizations
    from hsgd.model.config import divisors
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))
    start = time.perf_counter()
    assert len(divisors(BIG)) == 169 and divisors(BIG + 1)[:2] == [1, 73]
    assert len(factorizations(2**20)) == 231
    took = time.perf_counter() - start
    print(f"divisors of 10^12 and 10^12 + 1, factorizations of 2^20: {took:.2f} s")
    assert took < SECONDS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind, m, p", [("1f1b", 4, 4096), ("zb-h1", 8, 1024)])
def test_the_schedule_simulator_is_linear_in_the_stages(kind, m, p):
    """Before, each round of the simulator looked at every stage (and zb-h1's builder at every stage per action):
    quadratic in pp, seconds for 4096 stages."""
    from hsgd.pp.schedules import build, simulate
    start = time.perf_counter()
    timeline = simulate(build(kind, m, p), m)
    took = time.perf_counter() - start
    print(f"{kind} m={m} p={p}: {took:.2f} s")
    assert len(timeline) == p and took < SECONDS


def test_the_planner_prices_a_zb_h1_step_too_large_to_write_down_by_its_closed_form():
    """A large-batch plan's zb-h1 step (p v m over MAX_PIECES) is priced by the closed form, which equals the
    simulation where both can be computed, instead of ending the whole search with the schedule lab's refusal."""
    from hsgd.plan.costs import makespan
    from hsgd.pp.schedules import MAX_PIECES
    f, b, w = 1.0, 1.0, 0.5
    assert 6144 * 128 > MAX_PIECES
    big = makespan("zb-h1", 6144, 128, 1, f, b, w)
    small = makespan("zb-h1", 64, 8, 1, f, b, w)                         # simulated
    print(f"zb-h1 m=6144 p=128: {big:g} (closed form); m=64 p=8 simulated: {small:g}")
    assert big == 6144 * (f + b + w) + 127 * (f + b - w) and small == 64 * (f + b + w) + 7 * (f + b - w)
