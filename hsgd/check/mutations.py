"""Bugs on purpose: hsgd with one of the mistakes distributed training code is known to make, switched on for the
length of a `with` block, so that the checks (hsgd.verify, the tolerance oracle, hsgd.crosscheck) can be shown to
catch them, and hsgd.crosscheck to name them.

    with injected("missing-tp-scale", "ln_f.weight"):
        verdict = oracle(...)                         # ln_f.weight is flagged, on every layout with tp > 1

Each bug patches one function or method (of hsgd.pp.stage.Stage, which every layout but the one-rank threaded path
runs, of the tensor-parallel schemes and the ZeRO-1 exchange, or, with experts, of the folded exchange and the MoE
blocks, hsgd.dp.folded and hsgd.tp.experts) and puts it back on leaving the block. Nothing in
hsgd imports this module: it exists for tests and tutorials.
"""
from contextlib import contextmanager

from hsgd.pp import stage as stage_module
from hsgd.tp import experts as tp_experts, schemes as tp_schemes
from hsgd.dp import folded, zero1
from hsgd.fp8.scaling import BUGS as FP8_BUGS

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
    "zero-without-1/dp": "ZeRO 1's Reduce-Scatter of the gradients summed over dp, never divided by dp",
    "pipeline-without-1/m": "each micro-batch's backward pass starts from dloss = 1 instead of 1/m: the "
                            "accumulated gradients are m times too large (--micro-batches m)",
    "sequence-without-ln-reduction": "the sequence scheme's replicated parameters (LayerNorms, the projections' "
                                     "biases, wpe) keep each tp rank's partial gradient of its T-shard, never "
                                     "All-Reduced over tp",
    "head-permutation": "the gradient of `name` (a q, k or v weight) hands back this rank's heads in reverse "
                        "order",
    "experts-without-1/ep": "the experts' gradients averaged with 1/edp over their edp_comm replicas where the "
                            "factor is 1/(dp x cp): ep times too large, the loss curve unchanged (--ep > 1; "
                            "pytorch/pytorch #160285)",
    "experts-over-dp": "the experts' gradients averaged over dp_comm, where the ranks hold other experts at the same "
                       "places, instead of over edp_comm (the wrong group: NVIDIA/Megatron-LM #6080; --ep > 1)",
    "balance-over-micro-batch": "the load-balancing loss counted over each rank's own rows (a micro-batch on one "
                                "rank) whatever the declared domain: its counts never summed over the domain's "
                                "ranks (the micro-batch balance that Qiu et al. 2025, \"Demons in the Detail: On "
                                "Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert "
                                "Models\", set against the global batch's)",
    "router-gradient-dropped": "the router's weight gradient never accumulated: the gates' and the auxiliary "
                               "losses' paths to W_r lost, the tokens' gradients intact (huggingface/transformers "
                               "#48687's symptom: a router gradient wrong, the loss right)",
    **FP8_BUGS,                         # an FP8 scale taken over the wrong ranks (--fp8; hsgd.fp8.scaling.BUGS)
}


@contextmanager
def injected(bug, name="ln_f.weight"):
    """Run the block with `bug` (a key of BUGS); `name`: the parameter missing-tp-scale and low-precision-scale
    scale, and head-permutation permutes."""
    owner, attr, broken = patch(bug, name)
    original = getattr(owner, attr)
    setattr(owner, attr, broken(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def patch(bug, name):
    """(the object, the attribute the bug replaces, a function of the original that returns the replacement)."""
    if bug in FP8_BUGS:                                  # every FP8 stage made with the bug (its draws too)
        return stage_module, "make_fp8", lambda original: lambda settings, bugs=(): original(settings, {bug})
    if bug == "missing-tp-scale":
        return after_run(lambda st, grads: scale(grads, name, st.tp_comm.size))        # should have been x 1
    if bug == "low-precision-scale":
        return after_run(lambda st, grads: scale(grads, name, 1.1 if st.num.rounds else 1.0))
    if bug == "head-permutation":
        return after_run(lambda st, grads: reverse_heads(grads.get(name), st.cfg.d_model // st.cfg.n_heads))
    if bug == "dropped-micro-batch":                                       # should have been S / m
        return on_dloss(lambda st, a, d: 0.0 * d if a.mb == st.m - 1 and st.m > 1 else d)
    if bug == "pipeline-without-1/m":
        return on_dloss(lambda st, a, d: d * st.m)                         # should have been S / m
    if bug == "unscaled-allgather-adjoint":
        def broken(original):
            def unscaled(dy, comm, replicated=True, reduce_scatter=False, scale=None):
                if replicated:
                    return original(dy, comm, True, True, 1.0)             # should have been scale 1/tp
                return original(dy, comm, replicated, reduce_scatter, scale)
            return unscaled
        return tp_schemes, "allgather_backward", broken
    if bug == "zero-without-1/dp":
        def broken(original):
            def summed(self):
                original(self)
                self.g_chunk *= self.dp_comm.size                          # undoes the 1/dp
            return summed
        return zero1.Zero1Exchange, "average", broken
    if bug in EXPERT_BUGS:
        return patch_experts(bug)
    if bug == "sequence-without-ln-reduction":
        def broken(original):
            def partial(self, part, grads, comm):
                flat, local, names = part                                  # (no Allreduce of the partials)
                for n in names:
                    grads[n] += local[n]
            return partial
        return tp_schemes.Sequence, "finish_replicated", broken
    raise ValueError(f"bug {bug!r}: one of {', '.join(BUGS)}")


EXPERT_BUGS = ("experts-without-1/ep", "experts-over-dp", "balance-over-micro-batch", "router-gradient-dropped")


def patch_experts(bug):
    """patch() for the bugs of expert parallelism and of the MoE blocks (EXPERT_BUGS)."""
    if bug == "experts-without-1/ep":
        def broken(original):
            def average(self):
                original(self)
                self.buf.flat[self.n_dense:] *= self.dp_comm.size / self.edp_comm.size   # 1/edp, not 1/(dp cp)
            return average
        return folded.FoldedExchange, "average", broken
    if bug == "experts-over-dp":
        def broken(original):
            def average(self):
                edp, self.edp_comm = self.edp_comm, self.dp_comm              # the experts' span over dp_comm
                try:
                    original(self)
                finally:
                    self.edp_comm = edp
            return average
        return folded.FoldedExchange, "average", broken
    if bug == "balance-over-micro-batch":
        def broken(original):
            def new_pass(self, B, T, xp):
                moe = original(self, B, T, xp)
                dom = moe.balance.dom
                dom.groups, dom.sizes, dom.comm = [xp.arange(B * T)], [B * T], None   # my rows, counted alone
                dom.n_groups = round(1 / dom.share)
                return moe
            return new_pass
        return tp_experts.Experts, "new_pass", broken
    if bug == "router-gradient-dropped":
        def broken(original):
            def backward(self, dy, cache, grads, daux):
                prefix = next(x for x in cache if isinstance(x, str))       # "h.{i}.moe"
                kept = grads[prefix + ".router.weight"].copy()
                out = original(self, dy, cache, grads, daux)
                grads[prefix + ".router.weight"][...] = kept                 # this block's contribution lost
                return out
            return backward
        return tp_experts.Experts, "backward", broken
    raise ValueError(bug)


def after_run(change):
    """Stage.run, then change(stage, grads) on the gradients of this rank's stage."""
    def broken(original):
        def run(self, params, grads, mbs, *args, **kwargs):
            loss = original(self, params, grads, mbs, *args, **kwargs)
            change(self, grads)
            return loss
        return run
    return stage_module.Stage, "run", broken


def on_dloss(change):
    """Stage.receive, with the dloss a backward action of the last chunk starts from replaced by change(stage,
    action, dloss)."""
    def broken(original):
        def receive(self, a, mbs):
            d = original(self, a, mbs)
            return change(self, a, d) if a.kind == "B" and self.chunks[a.chunk].last else d
        return receive
    return stage_module.Stage, "receive", broken


def scale(grads, name, factor):
    if grads.get(name) is not None:
        grads[name] *= factor


def reverse_heads(g, hs):
    """This rank's heads (blocks of hs columns) of g in reverse order, in place."""
    if g is not None:
        g[...] = g.reshape(g.shape[0], g.shape[1] // hs, hs)[:, ::-1].reshape(g.shape).copy()
