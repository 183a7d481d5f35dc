"""This rank's pipeline stage, of the class its layout needs (hsgd.pp.stage, hsgd.pp.dual)."""
from hsgd.pp.dual import DualStage
from hsgd.pp.schedules import PLACEMENTS
from hsgd.pp.stage import Stage, ThreadedStage


def make_stage(cfg, grid, layout, recompute, data):
    """This rank's stage (see Stage for the arguments): a ThreadedStage when it holds the whole model and sequence
    alone (pp = tp = cp = 1), a DualStage (hsgd.pp.dual) for DualPipe's two copies, else a Stage."""
    # (experts route a micro-batch's rows together, and FP8's current scales are taken over a micro-batch: neither
    # is ever cut into thread slices)
    alone = grid.pp == 1 and grid.tp == 1 and grid.cp == 1 and not cfg.moe_experts and not data.fp8
    if grid.pp > 1 and PLACEMENTS.get(layout.schedule) == "dual":
        return DualStage(cfg, grid, layout, recompute, data)
    return (ThreadedStage if alone else Stage)(cfg, grid, layout, recompute, data)
