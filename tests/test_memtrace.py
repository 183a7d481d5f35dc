"""The memory probe on one process: the attribution puts known allocations in their categories, and one traced
training step (float64, dp = pp = tp = 1) equals hsgd.accounting.step_memory sample by sample for every --recompute,
for GPT-2 and for Llama with materialized and flash attention; full recomputation keeps one block's whole cache in
the recompute category and less in activations; flash attention's activations are below the materialized ones by
the probabilities less the log-sum-exp and the second y, in every layer."""
import functools
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
LLAMA = ModelConfig(vocab_size=64, seq_len=32, d_model=16, n_heads=4, n_layers=2, d_ff=64, arch="llama")
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


@functools.lru_cache(maxsize=None)
def traced(recompute, cfg=CFG, attention="materialized"):
    """(the probe's result, step_memory.step_formula) of step 2 of a one-process run; each run once per file."""
    tc = TrainConfig(steps=2, batch_size=4, lr=0.05, momentum=0.9, dtype="float64", seed=3, recompute=recompute,
                     attention=attention)
    tc.validate()
    tc.resolve_layout(1)
    grid = ProcessGrid(MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank(), 0))
    result, trainer = allocations.measure_step(lambda: HybridTrainer(cfg, grid, tc),
                                            lambda step: CORPUS.batch(tc.seed, step, tc.batch_size))
    return result, step_memory.step_formula(trainer)


RUNS = [(r, "gpt2", "materialized") for r in tp_model.RECOMPUTE] + \
    [(r, "llama", a) for a in ("materialized", "flash") for r in tp_model.RECOMPUTE] + [("none", "gpt2", "flash")]


@pytest.mark.parametrize("recompute,family,attention", RUNS, ids=["-".join(r) for r in RUNS])
def test_one_step_equals_the_formula_sample_by_sample(recompute, family, attention):
    measured, formula = traced(recompute, LLAMA if family == "llama" else CFG, attention)
    diffs = [max(abs(m[2].get(c, 0) - f[1].get(c, 0)) for c in set(m[2]) | set(f[1]))
             for m, f in zip(measured["samples"], formula["samples"])]
    print(f"{recompute} {family} {attention}: {len(diffs)} samples, max |measured - formula| {max(diffs)} B; peaks "
          f"{measured['peak']}; true peak {measured['true_peak']}")
    assert [s[0] for s in measured["samples"]] == [s[0] for s in formula["samples"]]
    assert max(diffs) == 0


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt2", "llama"])
def test_flash_attention_holds_no_probabilities(cfg):
    """The activations' peak (the caches of every layer, at the end of the forward) falls by L (B NH T^2 - B NH T) s
    from materialized to flash attention: each layer keeps the log-sum-exp in place of the probabilities (and y,
    which the projection keeps anyway: one copy); and nothing is recomputed with --recompute selective."""
    m = {a: traced("none", cfg, a)[0]["peak"]["activations"] for a in ("materialized", "flash")}
    sel = traced("selective", cfg, "flash")[0]["peak"]
    B, T, NH, L = 4, cfg.seq_len, cfg.n_heads, cfg.n_layers
    saved = L * (B * NH * T * T - B * NH * T) * 8
    print(f"{cfg.arch}: activations' peak materialized {m['materialized']} -> flash {m['flash']} B "
          f"(saved {m['materialized'] - m['flash']}, formula {saved}); flash + selective recompute peak "
          f"{sel.get('recompute', 0)}")
    assert m["materialized"] - m["flash"] == saved and sel.get("recompute", 0) == 0


def test_recomputation_trades_activations_for_one_block():
    m = {r: traced(r, CFG, "materialized")[0]["peak"] for r in ("none", "full")}
    block = activations.activation_formula(CFG, 4, 8, 1, "megatron")["block"]
    print(f"activations none {m['none']['activations']} -> full {m['full']['activations']}; recompute (full) "
          f"{m['full']['recompute']} = one block's cache {block}")
    assert m["full"]["activations"] < m["none"]["activations"] / 2 and m["full"]["recompute"] == block
