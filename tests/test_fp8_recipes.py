"""The scaling recipes and the amax domains of hsgd.fp8, one process: each recipe's cast puts every tile's largest
magnitude at the format's top and commutes with a power of two; finer tiles keep a row of small values that a
tensor's outlier would flush; delayed scaling takes the maximum of its history and forgets past its length; the
declared domains of each operand under the three tensor-parallel schemes; a tile a shard would cut is refused; the
codes FP8 values travel as (hsgd.fp8.codes) are ml_dtypes' bit for bit."""
from collections import namedtuple

import numpy as np
import pytest

from hsgd.errors import ConfigError
from hsgd.fp8.domains import Holders, check_blocks
from hsgd.fp8.recipes import make_recipe
from hsgd.fp8.scaling import Fp8
from hsgd.model.config import ModelConfig
from hsgd.model.precision import FORMATS, round_to
from hsgd.tp.schemes import make_scheme

SERIAL = Holders()


def cast(recipe, x, role="x", axis=1, fmt="hybrid"):
    fp8 = Fp8(fmt, make_recipe(recipe, block=4))
    return fp8.quantize(x, role, "t:" + role, SERIAL.spread("h.0.attn.q.weight", role), SERIAL, axis), fp8


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_a_cast_puts_each_tile_at_the_top_and_commutes_with_powers_of_two(recipe):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)) * np.exp(rng.standard_normal((8, 1)))      # rows of different sizes
    q, _ = cast(recipe, x)
    fmax = FORMATS["float8_e4m3fn"].max
    tiles = {"tensorwise": x.reshape(1, -1), "rowwise": x, "blockwise": x.reshape(-1, 4)}[recipe]
    qt = {"tensorwise": q.reshape(1, -1), "rowwise": q, "blockwise": q.reshape(-1, 4)}[recipe]
    s = fmax / np.abs(tiles).max(axis=1, keepdims=True)
    on_grid = np.abs(round_to(qt * s, "float8_e4m3fn") - qt * s).max() < 1e-9 * fmax   # FP8 numbers times 1/s
    top = np.abs(np.abs(qt * s).max(axis=1) - fmax).max()
    q2, _ = cast(recipe, x * 2.0 ** -7)
    err = np.abs(q2 - q * 2.0 ** -7).max()
    rel = np.abs(q - x).max() / np.abs(x).max()
    print(f"{recipe}: largest |q s| - fmax {top:.1e}, q(2^-7 x) - 2^-7 q(x) {err:.1e}, max rel error {rel:.3f}")
    assert on_grid and top < 1e-9 * fmax and err == 0.0 and rel <= 2.0 ** -4


def test_finer_tiles_keep_the_rows_a_tensor_outlier_flushes():
    x = np.full((4, 8), 1e-3)
    x[0, 0] = 1e4                                                            # one outlier in row 0
    err = {r: float(np.abs(cast(r, x)[0][1:] - x[1:]).max() / 1e-3) for r in ("tensorwise", "rowwise", "blockwise")}
    print("relative error of the rows without the outlier:", err)
    assert err["tensorwise"] == 1.0 and err["rowwise"] < 2.0 ** -4 and err["blockwise"] < 2.0 ** -4   # flushed


def test_delayed_scaling_takes_the_maximum_of_its_history_and_forgets_past_its_length():
    fp8 = Fp8("hybrid", make_recipe("delayed", history=2, margin=1))
    spread = SERIAL.spread("h.0.attn.q.weight", "x")
    for amax in (4.0, 1.0, 2.0):
        fp8.quantize(np.array([[amax, -amax / 2]]), "x", "k:x", spread, SERIAL, 1)
        fp8.end_step()
    x = np.array([[1.0, 3.0]])
    q = fp8.quantize(x, "x", "k:x", spread, SERIAL, 1)
    s = 448.0 / 2.0 / 2.0                                                   # max(1, 2) of the last 2, margin 1
    print("history", fp8.histories, "scale", s)
    assert fp8.histories["k:x"] == [1.0, 2.0] and np.array_equal(q, round_to(x * s, "float8_e4m3fn", True) / s)
    assert fp8.last[("x", "values")] == 2


FakeComm = namedtuple("FakeComm", "size name")


@pytest.mark.parametrize("scheme", ["megatron", "sequence", "gather"])
def test_each_operand_is_reduced_over_the_ranks_that_split_it(scheme):
    S, tp = make_scheme(scheme), FakeComm(2, "tp")
    h = Holders(tp, None, S.split_of, S.splits_T, (0, 4), 8)
    table = {(lin, role): h.spread(f"h.0.{lin}.weight", role) for lin in ("attn.q", "attn.proj")
             for role in ("x", "w", "dy")}
    for (lin, role), sp in table.items():
        print(scheme, lin, role, sp, [c.name for c in h.reduce_over(sp, make_recipe("tensorwise"), 1)])
    assert table[("attn.q", "w")].tp == "split" and table[("attn.q", "dy")].tp == "split"
    assert table[("attn.q", "x")].tp == ("gathered" if scheme == "sequence" else "copy")
    proj_split = scheme != "gather"                                          # row-parallel: K split
    assert table[("attn.proj", "x")].tp == ("split" if proj_split else "copy")
    assert table[("attn.proj", "dy")].tp == ("gathered" if scheme == "sequence" else "copy" if proj_split
                                              else "split")
    rowwise = make_recipe("rowwise")
    assert h.reduce_over(table[("attn.proj", "x")], rowwise, 1) == ([tp] if proj_split else [])   # K is split
    assert h.reduce_over(table[("attn.q", "x")], rowwise, 1) == []                               # a whole row


def test_a_tile_that_a_shard_would_cut_is_refused():
    cfg = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=1, d_ff=64)
    check_blocks(cfg, 16, 2, 1)
    with pytest.raises(ConfigError, match=r"does not divide one tp rank's share of d_model, 32/4 \(8\)"):
        check_blocks(cfg, 16, 4, 1)
    with pytest.raises(ConfigError, match=r"seq_len/\(2 cp\) = 8"):
        check_blocks(cfg, 16, 1, 2)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_codes_are_ml_dtypes_bit_for_bit(fmt):
    """Every one of the 256 codes decodes to ml_dtypes' value (NaN where it has NaN, the sign of zero kept), and every
    finite value encodes back to its code; a saturating cast's values of float32 inputs of every class round-trip."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from hsgd.fp8.codes import code_values, decode, encode
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(getattr(ml_dtypes, fmt)).astype(np.float64)
    mine = code_values(fmt)
    same = np.array_equal(np.isnan(ref), np.isnan(mine)) and np.array_equal(ref[~np.isnan(ref)], mine[~np.isnan(mine)])
    finite = np.isfinite(ref)
    back = np.array_equal(encode(ref[finite], fmt), codes[finite])
    signs = np.array_equal(np.signbit(decode(codes[finite], fmt, np.float32)), np.signbit(ref[finite]))
    x = np.concatenate([np.random.default_rng(0).standard_normal(4000).astype(np.float32) * 10.0 ** k
                        for k in range(-9, 6)] + [np.float32([0.0, -0.0, 1e-45, -1e-45, 3e38, -np.inf, np.inf])])
    q = round_to(x, fmt, saturate=True)
    trip = np.array_equal(decode(encode(q, fmt), fmt, np.float32), q)
    print(f"{fmt}: 256 codes as ml_dtypes {same}, encoded back {back}, signs {signs}; {x.size} casts round-trip {trip}")
    assert same and back and signs and trip
