"""Tokens to the ranks of their experts and back: the all-to-all dispatch and combine of expert parallelism, with
their adjoints, as the four calls hsgd.tp.experts makes of a dispatcher (LocalExperts there is the ep = 1 one).

A rank has routed its N rows and sorted its S kept token-slots by expert, xs (S, C), kept[e] rows for expert e. The
E experts are split over the ep ranks of ep_comm in runs of El = E/ep: expert e lives on ep rank e // El, so the
rows for ep rank j are one contiguous run of xs. The forward (Lepikhin et al. 2020, "GShard", section 2.2; the
token dispatcher of Megatron-Core's "alltoall" type):

    send(xs, kept)     1. Alltoall of the counts: kept (E,) in ep blocks of El, block j to rank j; rank j receives
                          counts (ep, El): counts[i, e] rows of source i for its own expert e.
                       2. Alltoallv of the rows: sum(kept of block j) rows to rank j; the received buffer holds
                          source 0's rows (by expert), then source 1's, ...
                       3. the permutation `order` groups them by expert (a stable sort: by source within an
                          expert), so that each local expert computes one run: rows = recv[order].
    receive(ys)        the inverse: out[order] = ys puts the outputs back in received order; the Alltoallv with the
                          counts swapped returns each source its rows, in the order it sent them (xs's).

Each of the four maps is a permutation of rows across the ranks (a 0/1 matrix), so its adjoint is its inverse
(hsgd.grid.comm.Comm.Alltoallv): the backward of receive is "Alltoallv forward, then gather by order" (the
gradients of the outputs travel to the experts), the backward of send is "scatter by order, then Alltoallv back"
(the gradients of the inputs return to their tokens). The counts need no backward: they are integers.

Bytes on ep_comm per MoE block and micro-batch (payload = send buffer, own rows included): the counts E int64
(forward), the rows S C s + R C s forward (dispatch, combine) and S C s + R C s backward, S the rank's kept slots, R
the rows its experts receive: all_to_all_formula, from a step's routing histogram.

Legend: N rows, C d_model, E experts, El = E/ep per rank, S kept slots sent, R rows received, s bytes per element.
"""
import numpy as np

from hsgd.model.backend import array_module, to_host


class AllToAll:
    """The dispatcher of one rank of ep_comm for a MoE block's E experts. send() returns, besides the rows, what its
    receive() and the backward's calls need (the counts and the permutation: `plan`), which the block keeps in its
    cache: micro-batches in flight each have their own."""

    def __init__(self, ep_comm, E):
        self.comm, self.E, self.ep = ep_comm, E, ep_comm.size
        self.El = E // self.ep
        self.first = ep_comm.rank * self.El                           # my experts: first .. first + El - 1

    def send(self, xs, kept):
        """(rows (R, C) for my experts, grouped by expert; {expert: rows}; plan)."""
        xp, ep, El = array_module(xs), self.ep, self.El
        counts = np.ascontiguousarray(to_host(kept), dtype=np.int64)      # (E,) host: the sizes MPI needs
        got = self.comm.Alltoall(counts, np.empty_like(counts)).reshape(ep, El)   # (ep, El) rows of source i for e
        send_counts = counts.reshape(ep, El).sum(axis=1)                  # (ep,) rows to each rank
        recv_counts = got.sum(axis=1)                                     # (ep,) rows from each rank
        recv = xp.empty((int(recv_counts.sum()), xs.shape[1]), dtype=xs.dtype)
        self.comm.Alltoallv(xp.ascontiguousarray(xs), send_counts, recv, recv_counts)
        expert = np.repeat(np.tile(np.arange(El), ep), got.reshape(-1))   # (R,) local expert of each received row
        order = xp.asarray(np.argsort(expert, kind="stable"))            # (R,) grouped by expert, by source within
        mine = {self.first + e: int(n) for e, n in enumerate(got.sum(axis=0))}
        return recv[order], mine, (send_counts, recv_counts, order)

    def receive(self, ys, plan):
        """The outputs (R, C) of my experts, grouped as send gave them -> this rank's (S, C), in xs's order."""
        send_counts, recv_counts, order = plan
        xp = array_module(ys)
        back = xp.empty_like(ys)
        back[order] = ys                                                  # received order again
        out = xp.empty((int(send_counts.sum()), ys.shape[1]), dtype=ys.dtype)
        return self.comm.Alltoallv(back, recv_counts, out, send_counts)

    def receive_backward(self, dys, plan):
        """receive's adjoint: the gradients of this rank's outputs (S, C) to the experts' ranks, grouped by expert
        (R, C)."""
        send_counts, recv_counts, order = plan
        xp = array_module(dys)
        recv = xp.empty((int(recv_counts.sum()), dys.shape[1]), dtype=dys.dtype)
        self.comm.Alltoallv(xp.ascontiguousarray(dys), send_counts, recv, recv_counts)
        return recv[order]

    def send_backward(self, dxs, plan):
        """send's adjoint: the gradients of my experts' inputs (R, C) back to their tokens' ranks: (S, C)."""
        send_counts, recv_counts, order = plan
        xp = array_module(dxs)
        back = xp.empty_like(dxs)
        back[order] = dxs
        out = xp.empty((int(send_counts.sum()), dxs.shape[1]), dtype=dxs.dtype)
        return self.comm.Alltoallv(back, recv_counts, out, send_counts)


def all_to_all_formula(kept, ep_rank, ep, E, C, itemsize, calls, again=1):
    """{("ep", op): (calls, bytes)} of one step on one rank of ep_comm: kept (ep, E), the kept slots each rank of
    the ep group sent to each expert over the step's MoE blocks and micro-batches (its routing histogram); calls:
    the (block, micro-batch) pairs; again: 2 with --recompute full (the forward's three calls run twice)."""
    El = E // ep
    S = int(np.asarray(kept)[ep_rank].sum())                           # rows this rank sent
    R = int(np.asarray(kept)[:, ep_rank * El:(ep_rank + 1) * El].sum())   # rows its experts received
    return {("ep", "Alltoall"): (again * calls, again * calls * E * 8),
            ("ep", "Alltoallv"): (2 * (again + 1) * calls, (again + 1) * (S + R) * C * itemsize)}
