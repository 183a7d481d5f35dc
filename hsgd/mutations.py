"""Bugs on purpose: hsgd with one of the mistakes distributed training code is known to make, switched on for the
length of a `with` block, so that the checks (hsgd.verify, the tolerance oracle, hsgd.crosscheck) can be shown to
catch them, and hsgd.crosscheck to name them.

    with injected("missing-tp-scale", "ln_f.weight"):
        verdict = oracle(...)                         # ln_f.weight is flagged, on every layout with tp > 1

Each bug patches one function or method (of hsgd.stage.Stage, which every layout but the one-rank threaded path
runs, or of the tensor-parallel schemes and the ZeRO exchange) and puts it back on leaving the block. Nothing in
hsgd imports this module: it exists for tests and tutorials.
"""
from contextlib import contextmanager

from . import stage as stage_module
from . import tp_schemes, zero

BUGS = {
    "missing-tp-scale": "one parameter's gradient tp times too large, as when a replicated parameter's partial "
                        "gradients are summed over the tp ranks where each rank's was already the whole",
    "dropped-micro-batch": "the last micro-batch's backward pass starts from dloss = 0: its loss counts, its "
                           "gradient never arrives (with --micro-batches >= 2)",
    "low-precision-scale": "one parameter's gradient 10% too large, in low-precision runs only (a code path that "
                           "only bfloat16 and float16 take, such as a scale applied twice): float64 stays exact",
    "unscaled-allgather-adjoint": "the gather scheme's All-Gather adjoint as a Reduce-Scatter without its 1/tp "
                                  "(every rank's dL/dY was already the whole): the layers below it tp times "
                                  "too large (--tp-scheme gather)",
    "zero-without-1/dp": "ZeRO 1 and 2's Reduce-Scatter of the gradients summed over dp, never divided by dp",
    "pipeline-without-1/m": "each micro-batch's backward pass starts from dloss = 1 instead of 1/m: the "
                            "accumulated gradients are m times too large (--micro-batches m)",
    "sequence-without-ln-reduction": "the sequence scheme's replicated parameters (LayerNorms, the projections' "
                                     "biases, wpe) keep each tp rank's partial gradient of its T-shard, never "
                                     "All-Reduced over tp",
    "head-permutation": "the gradient of `name` (a q, k or v weight) hands back this rank's heads in reverse "
                        "order",
}


@contextmanager
def injected(bug, name="ln_f.weight"):
    """Run the block with `bug` (a key of BUGS); `name`: the parameter missing-tp-scale and low-precision-scale
    scale, and head-permutation permutes."""
    Stage = stage_module.Stage
    owner = Stage                                                          # whose attribute the bug replaces
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
    elif bug == "unscaled-allgather-adjoint":
        owner, attr, original = tp_schemes, "allgather_backward", tp_schemes.allgather_backward

        def broken(dy, comm, replicated=True, reduce_scatter=False, scale=None):
            if replicated:
                return original(dy, comm, True, True, 1.0)                 # should have been scale 1/tp
            return original(dy, comm, replicated, reduce_scatter, scale)
    elif bug == "zero-without-1/dp":
        owner, attr, original = zero.ZeroExchange, "average", zero.ZeroExchange.average

        def broken(self):
            original(self)
            self.g_chunk *= self.dp_comm.size                              # undoes the 1/dp
    elif bug == "pipeline-without-1/m":
        attr, original = "receive", Stage.receive

        def broken(self, a, mbs):
            d = original(self, a, mbs)
            if a.kind == "B" and self.chunks[a.chunk].last:
                return d * self.m                                          # should have been S / m
            return d
    elif bug == "sequence-without-ln-reduction":
        owner, attr, original = tp_schemes.Sequence, "finish_replicated", tp_schemes.Sequence.finish_replicated

        def broken(self, part, grads, comm):
            flat, local, names = part                                      # (no Allreduce of the partials)
            for n in names:
                grads[n] += local[n]
    elif bug == "head-permutation":
        attr, original = "run", Stage.run

        def broken(self, params, grads, mbs, *args, **kwargs):
            loss = original(self, params, grads, mbs, *args, **kwargs)
            g = grads.get(name)
            if g is not None:
                hs = self.cfg.d_model // self.cfg.n_heads
                heads = g.shape[1] // hs                                   # this rank's heads, hs columns each
                g[...] = g.reshape(g.shape[0], heads, hs)[:, ::-1].reshape(g.shape).copy()
            return loss
    else:
        raise ValueError(f"bug {bug!r}: one of {', '.join(BUGS)}")
    setattr(owner, attr, broken)
    try:
        yield
    finally:
        setattr(owner, attr, original)
