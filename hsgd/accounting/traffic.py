"""The bytes a rank sends in one training step, by formula: {(communicator, operation): (calls, payload bytes)} as
hsgd.grid.comm.CommStats records them. Each part of the algorithm owns its closed form (tp: tp.model.comm_formula, pp:
pp.chunks.pp_formula, cp: cp.split.cp_formula, dp: the exchange's formula()); this module adds them up for one rank
of a layout. hsgd.train prints them next to what it measured (equal, call for call and byte for byte), and the
planner (hsgd.plan.layout) asks the same function with sizes alone. Chapters 10 and 11 check them."""
import numpy as np

from hsgd.cp.split import cp_formula
from hsgd.ep.dispatch import all_to_all_formula
from hsgd.fp8.traffic import cast_formula
from hsgd.model.backend import to_numpy
from hsgd.pp.chunks import pp_formula
from hsgd.tp import model as tp_model
from hsgd.tp.experts import experts_formula
from hsgd.tp.kv import kv_columns


def step_formula(cfg, tc, trainer):
    """{(comm, op): (calls, bytes)} this rank should see in one training step, from the closed forms: the
    tensor-parallel traffic of its stage for m micro-batches, the pipeline's messages and the dp exchange."""
    f = rank_bytes(cfg, tc, trainer.grid.dp, trainer.grid.tp, trainer.grid.cp, trainer.stage, trainer.exchange.sizes)
    grid, stage = trainer.grid, trainer.stage
    if stage.fp8 is not None:                                         # the scales' amax reductions (hsgd.fp8)
        rows = tc.batch_size // grid.dp // tc.micro_batches * (cfg.seq_len // grid.cp)
        wire = getattr(trainer.exchange, "wire", None)                # (ZeRO 3 sending FP8: hsgd.dp.fp8_gather)
        sent = getattr(wire, "sends_fp8", False)
        terms = [cast_formula(stage.fp8, stage.setup.products.holders, grid.dp_comm, stage.layers, cfg.mlp,
                              trainer.shard_shapes, rows, tc.micro_batches, trainer.dtype.itemsize,
                              tc.recompute == "full", sent)] + ([wire.formula()] if sent else [])
        for term in terms:
            for key, (calls, nbytes) in term.items():
                c0, b0 = f.get(key, (0, 0))
                f[key] = (c0 + calls, b0 + nbytes)
    if grid.ep > 1 and stage.routing:                                 # the all-to-all: from the step's routing
        kept = np.stack(grid.ep_comm.allgather_obj(sum(to_numpy(r["kept"]) for r in stage.routing.values())))
        calls = tc.micro_batches * len(stage.routing)
        f.update(all_to_all_formula(kept, grid.ep_rank, grid.ep, cfg.moe_experts, cfg.d_model,
                                    trainer.exchange.sizes.itemsize, calls, 2 if tc.recompute == "full" else 1))
    return f


def rank_bytes(cfg, tc, dp, tp, cp, stage, sizes):
    """step_formula from sizes alone: dp, tp, cp the grid; stage: its .pieces(rows), .layers, .first, .last, .v;
    sizes: the exchange's sizes (its formula() and itemsize; hsgd.dp.make.exchange_sizes for a planned one)."""
    m, itemsize = tc.micro_batches, sizes.itemsize
    per_mb = tc.batch_size // dp // m
    f = {}
    pl = getattr(stage, "placement", None)                           # (a hand-off to itself sends nothing)
    dual = pl is not None and pl.shape == "dual"                     # DualPipe: half the micro-batches a chunk
    parts = [(m // 2, (len(ch.layers), ch.first, ch.last)) for ch in stage.chunks] if dual else \
        [(m, (len(stage.layers), stage.first, stage.last))]
    for rows in stage.pieces(per_mb):                                 # one piece, or one per thread
        for runs, share in parts:
            for k, (calls, nbytes) in tp_model.comm_formula(cfg, rows, itemsize, tc.tp_scheme, stage=share,
                                                            recompute=tc.recompute, cp=cp, tp=tp).items():
                f[k] = (f.get(k, (0, 0))[0] + runs * calls, f.get(k, (0, 0))[1] + runs * nbytes)
    if dual:                                                          # down from stage 0, up from stage pp-1, and
        f.update(pp_formula(per_mb, cfg, m, stage.s == 0, stage.s == pl.p - 1, itemsize, tc.tp_scheme, tp, 1, cp,
                            twin=sum(sizes.numel.values()) * sizes.itemsize))   # to the twin (hsgd.pp.dual)
    else:
        f.update(pp_formula(per_mb, cfg, m, stage.first, stage.last, itemsize, tc.tp_scheme, tp, stage.v, cp,
                            pl.local_handoffs(stage.s) if pl is not None else 0))
    f.update(cp_formula(tc.cp_scheme, cp, per_mb, cfg.seq_len, cfg.d_model, tp, itemsize,
                        sum(runs * share[0] for runs, share in parts), tc.recompute, kv_columns(cfg, tp)))
    f.update(sizes.formula())
    if cfg.moe_experts:                                               # the MoE blocks' own (hsgd.tp.experts)
        chunks = [ch.layers for ch in stage.chunks] if hasattr(stage, "chunks") else [stage.layers]
        for key, (calls, nbytes) in experts_formula(cfg, per_mb, chunks, tp, cp, dp, m, itemsize, tc.tp_scheme,
                                                    tc.recompute).items():
            c0, b0 = f.get(key, (0, 0))
            f[key] = (c0 + calls, b0 + nbytes)
        f = {key: v for key, v in f.items() if v[0]}
    return f
