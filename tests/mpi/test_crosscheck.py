"""hsgd.crosscheck on hsgd's own dumps, 8 ranks: every factorization dp x pp x tp of 8 ranks under each tensor-parallel
scheme passes (gather and sequence where tp > 1: at tp 1 the three are the same computation), and so do ZeRO, context
parallelism, bfloat16 and float16 within their rounding bands; each deliberately broken hsgd
(hsgd.check.mutations) fails with its bug named: the unscaled All-Gather adjoint and pipelining without 1/m as constant
factors (tp twice: the MLP's fc sits below two gathers; m), ZeRO without 1/dp as the factor dp, the sequence scheme
without its LayerNorm reduction as a partial sum over tp, a head permutation as a permutation of heads."""
import io
import shutil
import tempfile

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.crosscheck.__main__ import check, report
from hsgd.crosscheck.read import load
from hsgd.crosscheck.hsgd_dump import dump_one_step
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import factorizations
from hsgd.check.mutations import injected

from .conftest import WORLD, check as agree, float64_config, say

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=8, d_ff=16)
CORPUS = Corpus(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def crosscheck(**kw):
    """Dump step 1 of the layout kw on the 8 ranks, check it on rank 0: (ok, loss row, {name: row}, the table)."""
    tc = float64_config(**{**dict(batch_size=8, seed=5, steps=1), **kw})
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hsgd-dump-") if WORLD.Get_rank() == 0 else None)
    try:
        dump_one_step(CFG, tc, WORLD, path, CORPUS)
        verdict = None
        if WORLD.Get_rank() == 0:
            dump = load(path)
            ok, loss_row, rows = check(dump)
            out = io.StringIO()
            report(dump, ok, loss_row, rows, out)
            verdict = ok, loss_row, {r["name"]: r for r in rows}, out.getvalue()
        return WORLD.bcast(verdict)
    finally:
        if WORLD.Get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("scheme", ["megatron", "gather", "sequence"])
def test_every_factorization_of_8_ranks_passes(scheme):
    worst = 0.0
    for dp, pp, tp in factorizations(8):
        if tp == 1 and scheme != "megatron":
            continue                    # at tp 1 the schemes compute the same bits: the megatron pass has them
        m = 2 if pp > 1 and 8 // dp >= 2 else 1
        ok, loss_row, rows, table = crosscheck(dp=dp, pp=pp, tp=tp, tp_scheme=scheme, micro_batches=m)
        err = max(r["error"] for r in rows.values())
        worst = max(worst, err)
        say(f"{scheme} dp {dp} pp {pp} tp {tp} m {m}: loss err {loss_row['error']:.1e}, largest gradient error "
            f"{err:.1e}")
        agree(ok, f"{scheme} dp {dp} pp {pp} tp {tp}:\n{table}")
    say(f"{scheme}: largest error over the layouts {worst:.1e}")


@pytest.mark.parametrize("kw", [dict(dp=4, tp=2, zero=1), dict(dp=2, pp=2, tp=2, zero=2, micro_batches=2),
                                dict(dp=4, tp=2, zero=3, recompute="full"), dict(dp=2, cp=2, tp=2),
                                dict(dp=2, pp=2, tp=2, schedule="interleaved", virtual_stages=2, micro_batches=2),
                                dict(dp=2, tp=4, dtype="bfloat16"), dict(dp=4, tp=2, dtype="float16")],
                         ids=["zero1", "zero2-pp", "zero3-recompute", "cp", "interleaved", "bfloat16", "float16"])
def test_sharded_and_context_parallel_layouts_pass(kw):
    ok, loss_row, rows, table = crosscheck(**kw)
    say(f"{kw}: largest gradient error {max(r['error'] for r in rows.values()):.1e}")
    agree(ok, table)
    rounded = sum(r["class"] == "within the rounding band" for r in rows.values())
    agree(rounded > len(rows) // 2 if "dtype" in kw else rounded == 0, f"{rounded} rows called rounding:\n{table}")


# the attention k-biases' exact gradient is zero (a softmax ignores a shift shared by a row of scores): what the
# layouts compute there is rounding noise, ~1e-17, within tolerance however it is scaled
ZERO_GRADIENT = [f"h.{i}.attn.k.bias" for i in range(CFG.n_layers)]
EVERY = [n for n in CFG.param_shapes() if n not in ZERO_GRADIENT]


def broken(bug, expect, where, kw, name="ln_f.weight"):
    """The layout kw with `bug` switched on fails; the parameters `where` are classified `expect` (class, and a
    word of the detail)."""
    with injected(bug, name):
        ok, loss_row, rows, table = crosscheck(**kw)
    say(table[-3000:])
    agree(not ok, f"{bug} passed:\n{table}")
    for n in where:
        cls, word = expect
        agree(rows[n]["class"] == cls and word in rows[n]["detail"],
              f"{bug}: {n} is {rows[n]['class']!r} ({rows[n]['detail']}), expected {cls} ({word})")


def test_unscaled_allgather_adjoint_is_a_factor_tp():
    broken("unscaled-allgather-adjoint", ("constant factor", "= tp x tp:"), ["h.7.mlp.fc.weight", "h.7.mlp.fc.bias"],
           dict(dp=2, tp=4, tp_scheme="gather"))


def test_zero_without_1_over_dp_is_a_factor_dp():
    broken("zero-without-1/dp", ("constant factor", "= dp:"), EVERY, dict(dp=4, tp=2, zero=1))


def test_pipelining_without_1_over_m_is_a_factor_of_the_micro_batches():
    broken("pipeline-without-1/m", ("constant factor", "= micro-batches:"), EVERY,
           dict(dp=1, pp=2, tp=4, micro_batches=8, batch_size=16))


def test_sequence_scheme_without_its_layernorm_reduction_is_a_partial_sum_over_tp():
    replicated = ["wpe", "h.0.ln1.weight", "h.3.attn.proj.bias", "h.7.ln2.bias", "ln_f.weight"]
    broken("sequence-without-ln-reduction", ("partial sum", "a sum over 4 ranks"), replicated,
           dict(dp=2, tp=4, tp_scheme="sequence"))


def test_a_head_permutation_is_named():
    broken("head-permutation", ("permutation", "heads along axis 1 in another order: [1, 0, 3, 2, 5, 4, 7, 6]"),
           ["h.2.attn.q.weight"], dict(dp=2, tp=4), name="h.2.attn.q.weight")
