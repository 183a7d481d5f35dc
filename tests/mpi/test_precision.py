"""Mixed precision on 8 ranks: bfloat16 and float16 (emulated, hsgd.model.precision) train like float32 on 3-D,
sequence- and context-parallel layouts, every rounding point of hsgd.model.precision.POINTS used where it applies; the
gradient exchange in bfloat16 (--reduce-dtype) too; the master weights, gradients and optimizer state stay float32."""
import numpy as np
import pytest
from mpi4py import MPI

from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.model.precision import POINTS

from .conftest import WORLD, check, float64_config, say, train_steps

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "its", "bed", "when", "it", "rained"]
TEXT = " ".join(np.random.default_rng(2).choice(WORDS, 6000)).encode()     # learnable in a few steps
CORPUS = Corpus(TEXT, "words", 16)
STEPS = 8


def run(**kw):
    """STEPS steps in kw["dtype"]; returns (the global loss of each step, the trainer, its grid)."""
    tc = float64_config(**{**dict(steps=STEPS, micro_batches=2, warmup=2, seed=4), **kw})   # kw: the dtype
    grid, trainer, _, _ = train_steps(CFG, CORPUS, tc)
    losses = [trainer.step(*CORPUS.batch(tc.seed, s, tc.batch_size), s).loss for s in range(STEPS + 1, STEPS + 3)]
    return losses, trainer, grid


ZERO3 = dict(dp=4, pp=2, tp=1, zero=3)
ZERO3_PARAMS = {}          # dtype: the parameters after the ZeRO-3 run of test_bfloat16_and_float16_train_like_float32


@pytest.mark.parametrize("layout", [dict(dp=2, pp=2, tp=2, tp_scheme="gather"),
                                    dict(dp=2, cp=2, tp=2, tp_scheme="sequence"), ZERO3],
                         ids=["dp2-pp2-tp2-gather", "dp2-cp2-tp2-sequence", "dp4-pp2-zero3"])
def test_bfloat16_and_float16_train_like_float32(layout):
    """After STEPS steps (and two more, whose losses are compared), each format's loss is within 2% of float32's;
    every point of POINTS rounded on every rank ("payload" where tp > 1; "reduce" only with --reduce-dtype; with
    ZeRO-3 "weights" is each gathered layer, rounded in place)."""
    ref, tr32, g = run(dtype="float32", **layout)
    ok, lines = True, []
    g.free()
    for dtype in ("bfloat16", "float16"):
        losses, tr, g = run(dtype=dtype, **layout)
        rel = max(abs(a - b) / b for a, b in zip(losses, ref))
        used = {p for p, n in tr.num.counts.items() if n}
        expected = set(POINTS) - {"reduce"} - ({"payload"} if g.tp == 1 else set())
        grads = tr.grads.values() if tr.grads is not None else [tr.exchange.grads()]      # (ZeRO 2, 3: released)
        float32 = tr.exchange.master.dtype == np.float32 and all(a.dtype == np.float32 for a in grads)
        good = rel <= 0.02 and used == expected and float32
        ok &= WORLD.allreduce(good, op=MPI.LAND)
        lines.append(f"  {dtype:<9}: losses {[f'{x:.4f}' for x in losses]} (float32 {[f'{x:.4f}' for x in ref]}), "
                     f"max rel diff {rel:.1e}; points rounded {sorted(used)}; master and gradients float32 {float32}")
        if dtype == "float16":
            lines[-1] += f"; loss scale 2^{np.log2(tr.scaler.scale):g}, {tr.scaler.skipped} skipped"
        if layout == ZERO3:                                  # the ZeRO-3 run the next test compares with ZeRO-2
            ZERO3_PARAMS[dtype] = {n: np.array(p) for n, p in tr.exchange.full_params().items()}
        g.free()
    say(f"{layout}, {STEPS} steps:\n" + "\n".join(lines))
    check(ok)


def test_the_gradient_exchange_in_bfloat16():
    """--reduce-dtype bfloat16 with the overlapped all-reduce (each group's gradient rounded as it leaves, the
    average as it arrives): still within 2% of float32. (The plain all-reduce, whole buffer at once: chapter 12.)"""
    ref, _, g = run(dtype="float32", dp=4, tp=2)
    g.free()
    ok, lines = True, []
    for extra in (dict(dp_overlap=True),):
        losses, tr, g = run(dtype="bfloat16", reduce_dtype="bfloat16", dp=4, tp=2, **extra)
        rel = max(abs(a - b) / b for a, b in zip(losses, ref))
        ok &= WORLD.allreduce(rel <= 0.02 and tr.num.counts["reduce"] > 0, op=MPI.LAND)
        lines.append(f"  {extra or 'all-reduce'}: max rel loss diff to float32 {rel:.1e}, gradients rounded to "
                     f"bfloat16 {tr.num.counts['reduce']} times")
        g.free()
    say("dp4 tp2, bfloat16 with --reduce-dtype bfloat16:\n" + "\n".join(lines))
    check(ok)


def test_zero_3_rounds_every_gathered_layer_as_zero_2_rounds_its_copy():
    """bfloat16 and float16: ZeRO-3 (each layer gathered for its forward and again for its backward, rounded in
    place each time) computes with exactly the weights ZeRO-2's rounded copy holds: the parameters after the run
    are bit-identical. A gather that skipped the rounding (forward or backward) would break this."""
    ok, lines = True, []
    for dtype in ("bfloat16", "float16"):
        got = {}
        for zero in (2, 3):
            if zero == 3 and dtype in ZERO3_PARAMS:          # (the same run, made by the test above)
                got[3] = ZERO3_PARAMS[dtype]
                continue
            _, tr, g = run(dtype=dtype, **{**ZERO3, "zero": zero})
            got[zero] = {n: np.array(p) for n, p in tr.exchange.full_params().items()}
            g.free()
        diff = max(float(np.abs(got[2][n] - got[3][n]).max()) for n in got[2])
        ok &= WORLD.allreduce(diff == 0.0, op=MPI.LAND)
        lines.append(f"{dtype}: ZeRO-3 against ZeRO-2 after {STEPS + 2} steps, largest parameter difference {diff}")
    say("\n".join(lines))
    check(ok)
