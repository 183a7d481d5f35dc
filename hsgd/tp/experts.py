"""The MoE block on a tensor-parallel group: hsgd.model.moe's steps on this rank's shards, with the collectives they
need written out. It takes the place of the MLP between the scheme's enter and leave (hsgd.tp.model), so the
block's tensor-parallel collectives stay those of the dense block:

    m_in = S.enter(m)                                         (B, T, C) whole rows on every tp rank
    routing = route(m_in W_r)                                 replicated: every tp rank routes alike
    xs = m_in[perm // k]                                      dispatch (with ep > 1: dispatcher.send, hsgd.ep)
    ys_i = expert_e(xs) on shards: fc|gate|up columns F/tp, proj rows F/tp -> partial sums over tp
    y_i = sum_j g_j ys_i[inv]                                 combine (ep > 1: dispatcher.receive)
    o = S.leave(y_i)                                          the partial sums completed: Allreduce | Reduce-Scatter

Each expert is split like Megatron's MLP in every scheme (column-parallel in, row-parallel out: its proj bias, a
replicated (C,), is added by tp rank 0 alone, so that the sum over tp adds it once). The backward is the forward's
adjoint, plus one collective that the dense MLP has not: the gates' gradient dgates[n, j] = <dY[n], out[n, j]>
reads the expert's whole output, which is a partial sum on each rank, so the partial dgates (N, k) are summed by an
Allreduce over tp; then every rank runs the router's backward alike (its weight's gradient whole on each rank: a
replicated parameter, like the LayerNorms' in the megatron scheme). The router's input gradient is whole too: it
joins the experts' partial dx after the scheme's enter_backward, on the rows this rank holds (S.rows).

What a forward call's MoE blocks share (the balance loss's Domain and its counts, the capacity groups, the selection
biases, the statistics) is an hsgd.model.moe_pass.MoEPass; Experts.new_pass makes the one of a rank's micro-batch.

Legend: B sequences of the micro-batch, T the rank's positions (T/cp with context parallelism), C d_model, F the
experts' width, E experts, k top-k, N = B T rows, tp ranks.
"""
from hsgd.model.backend import array_module, scatter_add
from hsgd.model.balance import domain
from hsgd.model.moe import (combine_backward, combine_forward, experts_backward, experts_forward, record_balance,
                            route, router_input_grad, routing_aux, z_loss_forward)
from hsgd.model.moe_pass import MoEPass


class LocalExperts:
    """Every expert on this rank (ep = 1): the dispatch and its return are gathers, no communication. The interface
    of an expert-parallel dispatcher (hsgd.ep.dispatch): send (rows to the experts), receive (outputs back) and
    their adjoints."""
    ep = 1

    def send(self, xs, kept):
        """(the rows this rank's experts compute, their counts per expert (kept (E,) here: every expert; a
        dispatcher's {expert: rows}), what the other calls need: nothing here); xs (S_kept, C) sorted by expert."""
        return xs, kept, None

    def receive(self, ys, plan):
        """The experts' outputs (S_kept, C) in the order send took the rows."""
        return ys

    def send_backward(self, dxs, plan):
        return dxs

    def receive_backward(self, dys, plan):
        return dys


class Experts:
    """The MoE blocks of a stage: which ranks share a balance domain, how tokens reach their experts.
    cfg: the ModelConfig; tp_comm; cp_comm and dp_comm (the "micro-batch" and "sequence" domains' counts are summed
    over cp_comm, "global"'s over dp_comm); dp, m, cp: the layout (a step's sequences are B m dp, a sequence's rows
    T cp); dispatcher: LocalExperts (ep = 1) or hsgd.ep.dispatch's; biases: {prefix: (E,) selection bias}."""

    def __init__(self, cfg, tp_comm, cp_comm=None, dp_comm=None, dp=1, m=1, cp=1, dispatcher=None, biases=None):
        self.cfg, self.settings, self.tp_comm = cfg, cfg.moe_settings(), tp_comm
        self.cp_comm, self.dp_comm, self.dp, self.m, self.cp = cp_comm, dp_comm, dp, m, cp
        self.dispatcher = dispatcher or LocalExperts()
        self.biases = biases if biases is not None else {}

    def new_pass(self, B, T, xp):
        """The MoEPass of a forward call on a micro-batch of B sequences of T rows (this rank's positions)."""
        dom = domain(self.cfg.moe_balance_domain, B, T, xp, step_sequences=B * self.m * self.dp,
                     micro_sequences=B, T_step=T * self.cp, comm=self.cp_comm, global_comm=self.dp_comm)
        return MoEPass(self.cfg, dom, None, self.biases if self.cfg.moe_bias_rate else None)

    def forward(self, m_in, p, prefix, moe, ops):
        """The partial sums y_i (B, T, C) of block `prefix` ("h.{i}.moe") on m_in (B, T, C), and the cache. ops: the
        stage's layer functions (a bfloat16 run's round the experts' products, activations and input gradients at
        their points, hsgd.tp.rounded; the router and the gates stay float32, as Megatron-LM's
        --moe-router-dtype fp32 keeps them)."""
        s, tp, k = self.settings, self.tp_comm, self.settings.top_k
        x2 = m_in.reshape(-1, m_in.shape[-1])                             # (N, C) whole rows
        r, c_router = route(x2, p[prefix + ".router.weight"], s, moe.biases.get(prefix), moe.capacity_groups)
        rows, mine, plan = self.dispatcher.send(x2[r.perm // k], r.kept)  # dispatch: (S_kept, C) by expert
        ys, bounds, c_experts = experts_forward(rows, p, prefix, s, mine, ops, proj_bias=tp.rank == 0)  # partial
        y, slot_out = combine_forward(self.dispatcher.receive(ys, plan), r.inv, r.gates)   # (N, C) partial
        value, balance = record_balance(moe.balance, None, prefix, s, r.probs, r.chosen)
        z, c_z = z_loss_forward(r.logits, s.z_coef)
        moe.aux.setdefault(prefix, routing_aux(r, value, z, x2.shape[0], k))
        return y.reshape(m_in.shape), (c_router, r.perm, r.gates, slot_out, bounds, c_experts, balance, c_z, prefix,
                                       plan)

    def block_backward(self, dx, cache, grads, S, daux):
        """The MoE branch's backward inside a block, through the scheme S: dm (B, T~, C), the experts' partial dx
        entered back over tp (S.enter_backward) plus the router's whole dx on the rows this rank holds (S.rows)."""
        tp = self.tp_comm
        dm_in, dx_router = self.backward(S.leave_backward(dx, tp), cache, grads, daux)   # (B, T, C) each
        dm = S.enter_backward(dm_in, tp)                                  # (B, T~, C) f^T: Allreduce | Reduce-Scatter
        t0, t1 = S.rows(dx_router.shape[1], tp)
        return dm + dx_router[:, t0:t1]                                   # + the router's, whole on every rank

    def backward(self, dy, cache, grads, daux):
        """(dm_in (B, T, C) partial over tp: the experts' share, to be entered back by the scheme; dx_router
        (B, T, C) whole: the router's). dy (B, T, C) whole (the scheme's leave_backward)."""
        c_router, perm, gates, slot_out, bounds, c_experts, balance, c_z, prefix, plan = cache
        xp, tp = array_module(dy), self.tp_comm
        N, k, C = slot_out.shape
        dgates, dslot = combine_backward(dy.reshape(N, C), gates, slot_out)       # (N, k) partial, (N k, C) whole
        if tp.size > 1:
            dgates = tp.Allreduce(xp.ascontiguousarray(dgates))         # (N, k) whole: <dY, the whole output>
        dys = self.dispatcher.receive_backward(dslot[perm], plan)        # to the experts' ranks
        dxs = self.dispatcher.send_backward(experts_backward(dys, bounds, c_experts, grads), plan)   # (S_kept, C)
        dx = xp.zeros((N, C), dtype=dy.dtype)
        scatter_add(dx, perm // k, dxs)                                   # (N, C) partial over tp
        dx_router = router_input_grad(dgates, {"balance": daux, "z": daux}, c_router, balance, c_z, prefix, grads)
        return dx.reshape(dy.shape), dx_router.reshape(dy.shape)


def experts_formula(cfg, rows, chunks, tp, cp, dp, m, itemsize, scheme="megatron", recompute="none",
                    reduce_scatter=False):
    """{(comm, op): (calls, bytes)} the MoE blocks change in one step of a stage (m micro-batches of `rows` sequences
    on this rank, N = rows T/cp rows; chunks: the stage's chunks' blocks), relative to the dense blocks that
    hsgd.tp.model.comm_formula counts. Per MoE block and micro-batch:
      every scheme   + the tp Allreduce of the partial dgates (N, k) (tp > 1)
      sequence       - the All-Gather that re-enters the MLP's input in the backward pass (the experts keep their
                       dispatched rows); - mlp.proj.bias (C) in the block's Allreduce of replicated gradients
      gather         the dense MLP's All-Gathers (GELU's output F, proj's output C; again with --recompute full),
                     its Allreduce of dY (F) and, with reduce_scatter, its two Reduce-Scatters become Megatron's
                     exit: an Allreduce of (N, C) forward (again with --recompute full)
    Per chunk with MoE blocks and micro-batch: the balance loss's Allreduce of its counts (blocks, groups, E) over
    the ranks of its domain: cp_comm ("micro-batch": 1 group, "sequence": one per sequence), dp_comm ("global": 1
    group), when that is more than one rank and alpha > 0. Per step, with auxiliary-loss-free balancing: each
    MoE block's load (E,) int64 All-Reduced over dp_comm."""
    N, C, F, E, k, s = rows * (cfg.seq_len // cp), cfg.d_model, cfg.d_ff, cfg.moe_experts, cfg.moe_top_k, itemsize
    again = 2 if recompute == "full" else 1                           # the forward's collectives run twice
    out = {}

    def add(key, calls, nbytes):
        c0, b0 = out.get(key, (0, 0))
        out[key] = (c0 + calls, b0 + nbytes)

    for layers in chunks:
        n = sum(cfg.is_moe(i) for i in layers)
        if not n:
            continue
        if tp > 1:
            add(("tp", "Allreduce"), m * n, m * n * N * k * s)
        if scheme == "sequence":
            add(("tp", "Allgather"), -m * n, -m * n * N * C * s)
            add(("tp", "Allreduce"), 0, -m * n * C * s * cfg.bias)
        elif scheme == "gather":
            add(("tp", "Allgather"), -2 * again * m * n, -again * m * n * N * (C + F) * s)
            add(("tp", "Allreduce"), (again - 1) * m * n, m * n * N * (again * C - F) * s)
            if reduce_scatter:
                add(("tp", "Reduce_scatter_block"), -2 * m * n, -m * n * N * (C + F) * s)
        if cfg.moe_bias_rate:
            add(("dp", "Allreduce"), n, n * E * 8)
        if not cfg.moe_balance:
            continue
        kind = cfg.moe_balance_domain
        comm, ranks = ("dp", dp * cp) if kind == "global" else ("cp", cp)
        if kind == "global" and dp * cp * m == 1 or ranks == 1:
            continue
        groups = rows if kind == "sequence" else 1
        add((comm, "Allreduce"), m, m * n * groups * E * s)
    return out
