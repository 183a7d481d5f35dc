"""Solutions to the exercises of chapter 15 (tutorials/15_fp8.py).

    python tutorials/solutions/15_fp8.py

One process, float64, tiny arrays and the chapter's tiny model (exercise 1 runs its serial FP8 reference for one
step, four times). Every check compares with hsgd, a derivation or a hand computation, and stops (non-zero exit) at
the first one that fails.
"""
import math
import os
import sys
from collections import namedtuple

import numpy as np
from threadpoolctl import threadpool_limits

from hsgd.errors import ConfigError
from hsgd.fp8.domains import Holders, check_blocks, check_fp8_layout
from hsgd.fp8.recipes import make_recipe
from hsgd.fp8.reference import serial_fp8_sgd
from hsgd.fp8.scaling import Fp8, past_max
from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.model.precision import FORMATS, round_to
from hsgd.tp.schemes import make_scheme

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks
from checks import Checks, solve, train_config  # noqa: E402

threadpool_limits(1)
CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2, d_ff=64)   # the chapter's
CORPUS = Corpus(np.random.default_rng(5).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes",
                CFG.seq_len)
E4, E5 = "float8_e4m3fn", "float8_e5m2"
SERIAL = Holders()                                   # one rank: nothing shared


def cast(fp8, x, role="dy", name="demo", axis=1):
    """q(x) through fp8.quantize, as a serial model's linear casts operand `role`."""
    return fp8.quantize(x, role, f"{name}:{role}", SERIAL.spread("h.0.mlp.fc.weight", role), SERIAL, axis)


# ------------------------------------------------------------------------------------------------------------ 1
def serial_fp8(tc, replicas):
    """The chapter's serial FP8 reference, with `replicas` chosen: (params, histories) after tc.steps steps."""
    params, _, histories = serial_fp8_sgd(CFG, tc, lambda s: CORPUS.batch(tc.seed, s, tc.batch_size), replicas)
    return params, histories


def exercise_1(check):
    """What a power of two does to a cast, and why the reference takes replicas."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 64)) * 2.0 ** rng.uniform(-26, -10, (256, 64))   # a gradient over 16 binades
    same, zeros = [], []
    for k in range(-8, 9):
        fp8 = Fp8("hybrid", make_recipe("tensorwise"))
        same.append(np.array_equal(cast(fp8, 2.0 ** k * x), 2.0 ** k * cast(fp8, x)))
        zeros.append(int(np.count_nonzero(round_to(2.0 ** k * x, E5, saturate=True) == 0)))   # s = 1
    check.say(f"  s = 1 (delayed scaling's first step): values of 2^k x flushed to 0, k = -8..8: {zeros}")
    check.holds("tensorwise: q(2^k x) == 2^k q(x) bit for bit, k = -8..8 (s moves by 2^-k: x s unchanged)", all(same))
    check.holds("s = 1: the flushed count falls as k grows (the cast sees the factor)",
                all(a > b for a, b in zip(zeros, zeros[1:])))
    err, hist = {}, {}
    for recipe in ("tensorwise", "delayed"):
        kw = dict(fp8_history=2) if recipe == "delayed" else {}
        tc = train_config(steps=1, batch_size=8, dp=2, fp8="hybrid", fp8_recipe=recipe, **kw)
        (p2, h2), (p1, h1) = serial_fp8(tc, 2), serial_fp8(tc, 1)
        err[recipe] = max(float(np.abs(p2[n] - p1[n]).max() / max(np.abs(p1[n]).max(), 0.02)) for n in p1)
        hist[recipe] = (h2, h1)
        check.say(f"  {recipe:<10}: serial FP8 reference of dp 2, replicas = 2 vs replicas = 1 after one step: "
                  f"params {err[recipe]:.1e}")
    check("tensorwise: replicas = 2 and replicas = 1 give the same step (current scaling is blind to 2)",
          err["tensorwise"])
    check.holds("delayed: they differ after one step by more than 1e-6 (s = 1 sees the factor 2)",
                err["delayed"] > 1e-6)
    h2, h1 = hist["delayed"]
    ratios = {k: h2[k][0] / h1[k][0] for k in h1}
    check.holds("delayed: the histories of X and W equal (the forward passes are the same) ...",
                all(r == 1.0 for k, r in ratios.items() if k.endswith((":x", ":w"))))
    check.holds("... the last block's first gradient (h.1.mlp.proj:dy, before any FP8 dgrad) exactly 2x",
                ratios["h.1.mlp.proj:dy"] == 2.0)
    check.say(f"  the other dY histories, replicas 2 over 1: "
              f"{min(r for k, r in ratios.items() if k.endswith(':dy')):.4f} to "
              f"{max(r for k, r in ratios.items() if k.endswith(':dy')):.4f}")


# ------------------------------------------------------------------------------------------------------------ 2
def decode(code, ebits, mbits):
    """The value of an 8-bit code: sign, ebits exponent bits (bias 2^(ebits-1) - 1), mbits significand bits;
    exponent 0: subnormal. E4M3fn (4, 3): only S.1111.111 is NaN; E5M2 (5, 2): exponent 31 is inf (m = 0) or NaN."""
    bias = 2 ** (ebits - 1) - 1
    sign = -1.0 if code >> 7 else 1.0
    e, m = (code >> mbits) & (2 ** ebits - 1), code & (2 ** mbits - 1)
    if ebits == 4 and e == 15 and m == 7:
        return math.nan
    if ebits == 5 and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / 2 ** mbits) * 2.0 ** (e - bias)


def exercise_2(check):
    """Count the numbers of E4M3 and E5M2."""
    for fmt, ebits, mbits, count, top in ((E4, 4, 3, 253, 448.0), (E5, 5, 2, 247, 57344.0)):
        f = FORMATS[fmt]
        values = [decode(c, ebits, mbits) for c in range(256)]
        finite = sorted({v for v in values if math.isfinite(v)})              # +0 and -0: one number
        check.say(f"  {fmt}: {sum(1 for v in values if math.isnan(v))} NaN codes, "
                  f"{sum(1 for v in values if math.isinf(v))} infinities, {len(finite)} distinct finite values")
        check.equal(f"{fmt}: distinct finite values, largest, p, smallest normal",
                    (len(finite), finite[-1], mbits + 1, decode(1 << mbits, ebits, mbits)),   # exponent field 1
                    (count, top, f.p, 2.0 ** f.emin))
        check.equal(f"{fmt}: (the count is 2 (2^(e+m) - special codes) - 1, derived: -0 = +0)",
                    count, 2 * (2 ** (ebits + mbits) - (1 if ebits == 4 else 2 ** mbits)) - 1)
        grid = np.array(finite)
        check.holds(f"{fmt}: round_to leaves every one of them unchanged", np.array_equal(round_to(grid, fmt), grid))
        codes = {decode(c, ebits, mbits): c for c in range(128)}            # positive values -> their code
        pos = [v for v in finite if v >= 0]
        mids = np.array([(a + b) / 2 for a, b in zip(pos, pos[1:])])
        even = np.array([a if codes[a] % 2 == 0 else b for a, b in zip(pos, pos[1:])])
        check.holds(f"{fmt}: every midpoint between neighbours rounds to the one with an even code (ties to even)",
                    np.array_equal(round_to(mids, fmt), even))


# ------------------------------------------------------------------------------------------------------------ 3
def grow(g, margin, steps=6, seed=3):
    """Delayed scaling (history 4) of a tensor x0 g^(t-1) at steps t = 1 .. steps: per step (overflow, underflow)."""
    x0 = np.random.default_rng(seed).standard_normal((64, 64))
    fp8 = Fp8("hybrid", make_recipe("delayed", history=4, margin=margin))
    out = []
    for t in range(steps):
        cast(fp8, g ** t * x0, role="x", name="grow")
        fp8.end_step()
        out.append((fp8.last[("x", "overflow")], fp8.last[("x", "underflow")]))
    return out


def exercise_3(check):
    """The margin against a growing tensor."""
    top = past_max(FORMATS[E4])                                   # 464: where rounding passes 448
    runs = {(g, m): grow(g, m) for g in (1.02, 1.05, 1.3, 2.5) for m in (0, 1, 2)}
    for (g, m), r in runs.items():
        check.say(f"  g = {g:<4} margin {m}: overflows per step {[o for o, _ in r]}, underflows {[u for _, u in r]}")
    check.equal("step 1 (s = 1, values near 1): no overflow in any run", [r[0][0] for r in runs.values()],
                [0] * len(runs))
    check.holds("g = 1.3: margin 0 overflows at every later step, margin 1 never",
                all(o > 0 for o, _ in runs[(1.3, 0)][1:]) and all(o == 0 for o, _ in runs[(1.3, 1)]))
    check.holds("g = 2.5: margin 1 still overflows, margin 2 never",
                all(o > 0 for o, _ in runs[(2.5, 1)][1:]) and all(o == 0 for o, _ in runs[(2.5, 2)]))
    check.equal("overflow from step 2 on <=> 448 g / 2^margin > 464, over all 12 runs",
                {k: all(o > 0 for o, _ in r[1:]) for k, r in runs.items()},
                {(g, m): 448 * g / 2 ** m > top for g, m in runs})
    check.holds("the cost: each extra binade of margin flushes no fewer values at the bottom",
                all(sum(u for _, u in runs[(g, m + 1)][1:]) >= sum(u for _, u in runs[(g, m)][1:])
                    for g in (1.02, 1.05, 1.3, 2.5) for m in (0, 1)))


# ------------------------------------------------------------------------------------------------------------ 4
def refused(block, tp, cp):
    """The ConfigError's message of check_blocks, or None when the layout is accepted."""
    try:
        check_blocks(CFG, block, tp, cp)
    except ConfigError as e:
        return str(e)
    return None


def exercise_4(check):
    """A tile that straddles a shard."""
    Comm = namedtuple("Comm", "size name")                       # all Holders reads of a communicator here
    h = Holders(Comm(2, "tp"), Comm(2, "cp"), make_scheme("megatron").split_of)
    block = make_recipe("blockwise", block=16)
    over = {(lin, role): h.reduce_over(h.spread(f"h.0.{lin}.weight", role), block, axis)
            for lin in ("attn.q", "attn.proj", "mlp.fc", "mlp.proj") for role in ("x", "w", "dy") for axis in (0, 1)}
    check.holds("blockwise: reduce_over names no communicator for any operand (tp 2, cp 2): tiles must not be cut",
                all(c == [] for c in over.values()))
    for block, tp, cp in ((32, 2, 1), (16, 1, 2)):
        msg = refused(block, tp, cp)
        check.say(f"  b = {block}, tp = {tp}, cp = {cp}: ConfigError: {msg}")
        check.holds(f"b = {block}, tp = {tp}, cp = {cp}: refused, naming "
                    + ("a tp rank's share of d_model" if tp > 1 else "seq_len/(2 cp)"),
                    msg is not None and ("tp rank's share of d_model" in msg if tp > 1
                                         else "seq_len/(2 cp) = 8" in msg))
    check.equal("b = 16 at tp = 2 and b = 8 at cp = 2: accepted", (refused(16, 2, 1), refused(8, 1, 2)), (None, None))
    tc = train_config(dp=1, tp=2, fp8="hybrid", fp8_recipe="blockwise", fp8_block=32)
    try:
        check_fp8_layout(CFG, tc)                                 # HybridTrainer's first call, before any message
        said = None
    except ConfigError as e:
        said = str(e)
    check.holds("check_fp8_layout (what HybridTrainer calls first) refuses tp 2 with b = 32",
                said is not None and "tp rank's share of d_model" in said)


if __name__ == "__main__":
    check = Checks(tol=1e-12, width=96)
    solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
