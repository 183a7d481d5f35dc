"""DualPipe's two copies of the model (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1): stage s
of p (p even) holds pieces s and p-1-s (hsgd.pp.placement "dual"), and so does its twin, stage p-1-s. Micro-batches
0 .. m/2-1 go down through the copy of piece k on stage k, micro-batches m/2 .. m-1 up through the copy on stage
p-1-k, so each copy's gradient holds half the micro-batches:

    g_k = sum over j < m/2 of g_k(j)   (on stage k)   +   sum over j >= m/2 of g_k(j)   (on stage p-1-k)

After its actions a stage sends its whole gradient buffer to its twin and receives the twin's, over pp_comm (one
message each way: G bytes, the stage's gradients), and adds it: a + b on one stage and b + a on the other, which
IEEE arithmetic makes equal bit for bit, so the copies stay equal through every update. Only then are the groups
final (on_ready): the data-parallel exchange starts from the summed gradient. The sum regroups the micro-batches'
order of 1F1B's accumulation ((g0 + .. + g_{m/2-1}) + (g_{m/2} + .. )), so the parameters equal 1F1B's to
rounding, not bit for bit.

What it costs: every stage holds the parameters, gradients and optimizer state of two pieces of the model where
one-copy schedules hold one (2 x; DeepSeek-V3's Table 2: "Parameter 2x"), and moves G bytes each way once per step.
Each copy updates with the same summed gradient, so both hold the same weights and optimizer state; a checkpoint
keeps the downward copy only (Stage.saved_names: hsgd.pp.placement's holder). The global gradient norm counts each
layer once (copies = 2: hsgd.step.health.global_norm).

Not with ZeRO 2 or 3 (they reduce-scatter a gradient when its layer's backward ends, before the sum: refused by
hsgd.step.settings), with MoE blocks (each copy would route and balance its own half of the tokens) or FP8 (each
copy its own amax history): refused when the stage is built, below.
"""
from hsgd.errors import ConfigError
from hsgd.pp.stage import Stage


class DualStage(Stage):
    """A Stage of the dual placement: its actions, then the gradients of its two copies summed with its twin's."""
    copies = 2                                  # (the global gradient norm counts each layer once: hsgd.step.health)

    def __init__(self, cfg, grid, layout, recompute, data):
        if cfg.moe_experts or data.fp8:
            raise ConfigError(f"--schedule dualpipe keeps two copies of every piece, each seeing half the micro-"
                              f"batches: {'MoE routing and balancing' if cfg.moe_experts else 'FP8 amax histories'} "
                              "would differ between them; use --schedule dualpipev (one copy, the same V of "
                              "overlapped pairs)")
        super().__init__(cfg, grid, layout, recompute, data)

    def final_groups(self, on_ready):
        self.deferred = on_ready                                       # called in after_backward, once summed
        return None

    def twin(self):
        """The stage holding the same two pieces: p-1-s."""
        return self.grid.pp - 1 - self.s

    def twin_tag(self):
        """The tag of the gradient sent to the twin: past every activation's and gradient's (2(k m + j) + 1)."""
        return self.tag(self.placement.K - 1, self.m - 1) + 2

    def after_backward(self, grads):
        """grads[n] += the twin's grads[n] for every parameter this stage holds (one message each way, packed in
        the model's order), then on_ready for every group in backward order."""
        xp, held = self.xp, set(self.names)
        names = [n for n in self.cfg.param_shapes() if n in held]       # the model's order: the twin's too
        mine = xp.concatenate([grads[n].ravel() for n in names])                       # (G,) this copy's
        other = xp.empty_like(mine)
        req = self.pp_comm.Isend(mine, dest=self.twin(), tag=self.twin_tag())
        self.pp_comm.Recv(other, source=self.twin(), tag=self.twin_tag())
        req.Wait()
        at = 0
        for n in names:
            g = grads[n]
            g += other[at:at + g.size].reshape(g.shape)                # a + b here, b + a on the twin: equal
            at += g.size
        if self.deferred is not None:
            for group in self.groups():
                self.deferred(group)

