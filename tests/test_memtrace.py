"""The memory probe on one process: the attribution puts known allocations in their categories, and one traced
training step (float64, dp = pp = tp = 1) equals hsgd.accounting.step_memory sample by sample for every --recompute;
full recomputation keeps one block's whole cache in the recompute category and less in activations."""
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.model.config import ModelConfig
from hsgd.accounting import activations, allocations, step_memory
from hsgd.model import kernels, optim
from hsgd.tp import model as tp_model
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.step.settings import TrainConfig

CFG = ModelConfig(vocab_size=64, seq_len=32, d_model=16, n_heads=4, n_layers=2, d_ff=64)
CORPUS = Corpus(np.random.default_rng(0).integers(0, 64, 4000, dtype=np.uint8).tobytes(), "random bytes", 32)


def categories_of_new_arrays(fn):
    """{category: bytes} of the NumPy arrays fn() allocates and keeps (returns)."""
    probe = allocations.MemoryProbe()
    tracemalloc.start(allocations.NFRAMES)
    try:
        kept = fn()
        cats, _ = probe.measure()
    finally:
        tracemalloc.stop()
    del kept
    return cats


def test_attribution_of_known_allocations():
    q = k = v = np.ones((2, 8, 8))                                       # (B, T, C): 2 heads of 4
    grid = ProcessGrid(MPI.COMM_SELF)
    setup = tp_model.TPSetup(ModelConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2), grid.tp_comm)
    opt = optim.SGD(0.1, momentum=0.9)
    p, g = {"flat": np.ones(1000)}, {"flat": np.ones(1000)}
    got = {"optimizer": categories_of_new_arrays(lambda: opt.step(p, g) or opt.state),
           "recompute": categories_of_new_arrays(lambda: tp_model.recompute_attention(q, k, v, setup)),
           "other": categories_of_new_arrays(lambda: np.zeros(500))}
    want = {"optimizer": 8000, "recompute": (3 * 64 + 128) * 8 * 2, "other": 4000}   # v; qh, kh, vh, P
    print({c: {k: v for k, v in cats.items() if v} for c, cats in got.items()})
    grid.free()
    for cat, cats in got.items():
        assert cats[cat] == want[cat] and sum(cats.values()) == want[cat]
    fmap = allocations.FunctionMap()
    path = kernels.__file__
    line = [i for i, s in enumerate(open(path), 1) if "def rows(lo, hi):" in s][0]
    assert fmap.function(path, line + 1) == "layernorm_forward.rows"


def traced(recompute):
    tc = TrainConfig(steps=2, batch_size=4, lr=0.05, momentum=0.9, dtype="float64", seed=3, recompute=recompute)
    tc.validate()
    tc.resolve_layout(1)
    grid = ProcessGrid(MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank(), 0))
    result, trainer = allocations.measure_step(lambda: HybridTrainer(CFG, grid, tc),
                                            lambda step: CORPUS.batch(tc.seed, step, tc.batch_size))
    return result, step_memory.step_formula(trainer)


@pytest.mark.parametrize("recompute", tp_model.RECOMPUTE)
def test_one_step_equals_the_formula_sample_by_sample(recompute):
    measured, formula = traced(recompute)
    diffs = [max(abs(m[2].get(c, 0) - f[1].get(c, 0)) for c in set(m[2]) | set(f[1]))
             for m, f in zip(measured["samples"], formula["samples"])]
    print(f"{recompute}: {len(diffs)} samples, max |measured - formula| {max(diffs)} B; peaks {measured['peak']}; "
          f"true peak {measured['true_peak']}")
    assert [s[0] for s in measured["samples"]] == [s[0] for s in formula["samples"]]
    assert max(diffs) == 0


def test_recomputation_trades_activations_for_one_block():
    m = {r: traced(r)[0]["peak"] for r in ("none", "full")}
    block = activations.activation_formula(CFG, 4, 8, 1, "megatron")["block"]
    print(f"activations none {m['none']['activations']} -> full {m['full']['activations']}; recompute (full) "
          f"{m['full']['recompute']} = one block's cache {block}")
    assert m["full"]["activations"] < m["none"]["activations"] / 2 and m["full"]["recompute"] == block
