"""hsgd.crosscheck on hsgd's own dumps, 8 ranks: every factorization dp x pp x tp of 8 ranks under each tensor-parallel
scheme passes (gather and sequence where tp > 1: at tp 1 the three are the same computation), and so do ZeRO, context
parallelism, bfloat16 and float16 within their rounding bands; each deliberately broken hsgd
(hsgd.check.mutations) fails with its bug named: the unscaled All-Gather adjoint and pipelining without 1/m as constant
factors (tp twice: the MLP's fc sits below two gathers; m), ZeRO without 1/dp as the factor dp, the sequence scheme
without its LayerNorm reduction as a partial sum over tp, a head permutation as a permutation of heads.

With experts (a llama block with 8 experts, top-2, in blocks 0 and 2 of 3, slots dropped at capacity 1.0, a balance
loss and a z-loss): layouts with the experts split over ep = 2, 4, 8 ranks pass, each expert's gradient on the ranks
that hold it only (the reference counting as the layout counts: its micro-batches, each rank's rows); and each
expert-parallel bug fails with its name: the experts without 1/ep a factor ep, the experts averaged over dp_comm the
wrong group, the balance loss over each rank's rows instead of the global domain, the router's gradient dropped
missing, every dense parameter passing where the bug does not reach it. A dump of step 2 of auxiliary-loss-free
balancing passes with the selection biases step 1 moved (written in layout.json), and fails without them."""
import io
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.crosscheck.__main__ import check, report
from hsgd.crosscheck.read import load
from hsgd.crosscheck.hsgd_dump import DumpStep, dump_one_step
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import factorizations
from hsgd.check.mutations import injected

from .conftest import WORLD, check as agree, float64_config, say

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=8, d_ff=16)
CORPUS = Corpus(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def crosscheck(cfg=CFG, **kw):
    """Dump step 1 of the layout kw on the 8 ranks, check it on rank 0: (ok, loss row, {name: row}, the table);
    each row's "ranks": the ranks its gradient's shards are on."""
    tc = float64_config(**{**dict(batch_size=8, seed=5, steps=1), **kw})
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hsgd-dump-") if WORLD.Get_rank() == 0 else None)
    try:
        dump_one_step(cfg, tc, WORLD, path, CORPUS)
        verdict = None
        if WORLD.Get_rank() == 0:
            dump = load(path)
            ok, loss_row, rows = check(dump)
            for r in rows:
                r["ranks"] = sorted(s.rank for s in dump.tensors[r["tensor"]].shards)
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


def broken(bug, expect, where, kw, name="ln_f.weight", cfg=CFG, passing=()):
    """The layout kw with `bug` switched on fails; the parameters `where` are classified `expect` (class, and a
    word of the detail), those `passing` pass. Returns the loss row."""
    with injected(bug, name):
        ok, loss_row, rows, table = crosscheck(cfg, **kw)
    say(table[-3000:])
    agree(not ok, f"{bug} passed:\n{table}")
    for n in where:
        cls, word = expect
        agree(rows[n]["class"] == cls and word in rows[n]["detail"],
              f"{bug}: {n} is {rows[n]['class']!r} ({rows[n]['detail']}), expected {cls} ({word})")
    agree(where and all(rows[n]["ok"] for n in passing), f"{bug}: {[n for n in passing if not rows[n]['ok']]} fail")
    return loss_row


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


MOE = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=3, d_ff=8, arch="llama", moe_experts=8,
                  moe_every=2, moe_capacity_factor=1.0, moe_balance=0.1, moe_z_loss=0.01)
EXPERTS = [n for n in MOE.param_shapes() if ".moe.experts." in n]
ROUTERS = [n for n in MOE.param_shapes() if n.endswith("router.weight")]
DENSE = [n for n in MOE.param_shapes() if n not in EXPERTS]


def holders(e, tp, ep):
    """The ranks (pp = 1) that hold expert e: those whose place q = dp_rank cp + cp_rank = rank // tp in dp_comm is
    on ep rank e // (E/ep) (q mod ep, hsgd.grid.process_grid), each tp rank of them its shard."""
    return [r for r in range(8) if (r // tp) % ep == e // (MOE.moe_experts // ep)]


@pytest.mark.parametrize("kw, domain", [(dict(dp=4, tp=2, ep=2, micro_batches=2), "micro-batch"),
                                        (dict(dp=2, cp=2, tp=2, ep=4), "sequence"), (dict(dp=8, tp=1, ep=8), "global")],
                         ids=["dp4-tp2-ep2", "dp2-cp2-tp2-ep4", "dp8-ep8"])
def test_layouts_with_experts_split_over_ep_pass(kw, domain):
    ok, loss_row, rows, table = crosscheck(replace(MOE, moe_balance_domain=domain), **kw)
    say(f"{kw} domain {domain}: loss err {loss_row['error']:.1e}, largest gradient error "
        f"{max(r['error'] for r in rows.values()):.1e}")
    agree(ok, table)
    where = {n: holders(int(n.split(".")[4]), kw.get("tp", 1), kw["ep"]) for n in EXPERTS}
    agree(all(rows[n]["ranks"] == where.get(n, list(range(8))) for n in rows), "the ranks holding each parameter")


def test_experts_without_1_over_ep_are_a_factor_ep():
    broken("experts-without-1/ep", ("constant factor", "= ep:"), EXPERTS, dict(dp=2, cp=2, tp=2, ep=4), cfg=MOE,
           passing=DENSE)


def test_experts_averaged_over_dp_are_the_wrong_group():
    broken("experts-over-dp", ("wrong group", "averaged over the wrong group"), EXPERTS, dict(dp=4, tp=2, ep=2),
           cfg=MOE, passing=DENSE)


@pytest.mark.parametrize("kw, domain", [(dict(dp=4, tp=2, ep=2), "global"), (dict(dp=2, cp=2, tp=2, ep=4), "sequence")],
                         ids=["global", "sequence"])
def test_the_balance_loss_over_each_ranks_rows_is_named(kw, domain):
    loss_row = broken("balance-over-micro-batch", ("balance domain", f"instead of the declared domain ({domain})"),
                      ROUTERS, kw, cfg=replace(MOE, moe_balance_domain=domain))
    agree("each rank's rows" in loss_row["detail"], loss_row)


def test_a_dropped_router_gradient_is_missing():
    broken("router-gradient-dropped", ("missing", "zero"), ROUTERS, dict(dp=4, tp=2, ep=2, micro_batches=2), cfg=MOE,
           passing=[n for n in MOE.param_shapes() if n not in ROUTERS])


def test_a_later_step_passes_with_the_selection_biases_it_used():
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    cfg = replace(MOE, moe_bias_rate=1.0)                       # (large: the biases change what step 2 routes)
    tc = float64_config(batch_size=8, seed=5, steps=2, dp=2, pp=2, tp=2, ep=2, micro_batches=2)
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hsgd-dump-") if WORLD.Get_rank() == 0 else None)
    grid = ProcessGrid(WORLD, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer, watcher = HybridTrainer(cfg, grid, tc), DumpStep(2, path, cfg, tc)
    trainer.step(*CORPUS.batch(tc.seed, 1, tc.batch_size), 1)   # step 1 moves the selection biases
    batch = CORPUS.batch(tc.seed, 2, tc.batch_size)
    watcher.before_step(2, trainer, batch)                      # as hsgd.train --dump-step 2 does
    watcher.after_gradients(trainer, 2, trainer.gradients(*batch))
    trainer.finish()
    trainer.free()
    grid.free()
    verdict = None
    if WORLD.Get_rank() == 0:
        dump = load(path)
        with_biases, without = check(dump), check(replace(dump, biases=None))
        shutil.rmtree(path, ignore_errors=True)
        verdict = (with_biases[0], max(r["error"] for r in with_biases[2]), sorted(dump.biases),
                   without[0], max(r["error"] for r in without[2]))
    ok, err, blocks, ok_without, err_without = WORLD.bcast(verdict)
    say(f"step 2 with the selection biases of {blocks}: largest gradient error {err:.1e}; without them "
        f"{err_without:.1e}")
    agree(ok and blocks == ["h.0.moe", "h.2.moe"] and not ok_without, verdict)
