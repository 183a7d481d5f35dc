"""Bugs on purpose: hsgd with one of the mistakes distributed training code is known to make, switched on for the
length of a `with` block, so that the checks (hsgd.verify, the tolerance oracle) can be shown to catch them.

    with injected("missing-tp-scale", "ln_f.weight"):
        verdict = oracle(...)                         # ln_f.weight is flagged, on every layout with tp > 1

Each bug patches one method of hsgd.stage.Stage (every layout but the one-rank threaded path runs it) and puts it
back on leaving the block. Nothing in hsgd imports this module: it exists for tests and tutorials.
"""
from contextlib import contextmanager

from . import stage as stage_module

BUGS = {
    "missing-tp-scale": "one parameter's gradient tp times too large, as when a replicated parameter's partial "
                        "gradients are summed over the tp ranks where each rank's was already the whole",
    "dropped-micro-batch": "the last micro-batch's backward pass starts from dloss = 0: its loss counts, its "
                           "gradient never arrives (with --micro-batches >= 2)",
    "low-precision-scale": "one parameter's gradient 10% too large, in low-precision runs only (a code path that "
                           "only bfloat16 and float16 take, such as a scale applied twice): float64 stays exact",
}


@contextmanager
def injected(bug, name="ln_f.weight"):
    """Run the block with `bug` (a key of BUGS); `name`: the parameter missing-tp-scale and low-precision-scale
    scale."""
    Stage = stage_module.Stage
    if bug == "missing-tp-scale":
        attr, original = "run", Stage.run

        def broken(self, params, grads, mbs, *args, **kwargs):
            loss = original(self, params, grads, mbs, *args, **kwargs)
            if grads.get(name) is not None:
                grads[name] *= self.tp_comm.size                   # should have been x 1
            return loss
    elif bug == "low-precision-scale":
        attr, original = "run", Stage.run

        def broken(self, params, grads, mbs, *args, **kwargs):
            loss = original(self, params, grads, mbs, *args, **kwargs)
            if self.num.rounds and grads.get(name) is not None:
                grads[name] *= 1.1                                  # should have been x 1
            return loss
    elif bug == "dropped-micro-batch":
        attr, original = "receive", Stage.receive

        def broken(self, a, mbs):
            d = original(self, a, mbs)
            if a.kind == "B" and self.chunks[a.chunk].last and a.mb == self.m - 1 and self.m > 1:
                return 0.0 * d                                     # should have been S / m
            return d
    else:
        raise ValueError(f"bug {bug!r}: one of {', '.join(BUGS)}")
    setattr(Stage, attr, broken)
    try:
        yield
    finally:
        setattr(Stage, attr, original)
