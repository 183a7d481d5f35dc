"""The crosscheck of a model with experts (hsgd.model.moe): the reference counted as the dumped layout counts, and
what an expert-parallel bug makes of the gradients.

Two things of a MoE block are computed over rows that the layout chooses (hsgd.ep.layout), so the reference takes
them from the dump's parallel sizes (dp, micro_batches, cp), as tests/mpi/test_moe.py's serial SGD does:

    the balance loss's domain   "micro-batch": each micro-batch's b = B / (dp m) sequences; "sequence"; "global"
    the capacity                each rank's rows of one micro-batch routed together: capacity_groups(B, T, dp, m,
                                cp), DP rank d's micro-batch j at cp rank c's positions (hsgd.cp.split's chunks)

and the selection biases of auxiliary-loss-free balancing from layout.json's "selection_bias" (none: zeros).

What a wrong gradient may be besides classify's patterns (its `others`, computed when a gradient first fails):

    wrong group      expert e's gradient is the sum (or the mean) of the gradients of the experts at its place on
                     each of the ep ranks, {r E/ep + e mod E/ep}: the experts' gradients averaged over dp_comm, whose
                     ranks hold other experts at the same place of their buffers, instead of over edp_comm, the ranks
                     that hold expert e (hsgd.dp.folded)
    balance domain   every gradient is the reference's with the balance loss over each rank's rows (one capacity
                     group a domain group) instead of the declared domain: its counts never summed over the ranks
                     that share a group
"""
import numpy as np

from hsgd.ep.layout import capacity_groups, expert_of
from hsgd.model import serial
from hsgd.model.balance import Domain
from hsgd.model.moe_pass import MoEPass, serial_pass


def counting(dump):
    """(b, groups): the sequences of one micro-batch, B / (dp m), and the rows each rank routes together."""
    p, (B, T) = dump.parallel, dump.idx.shape
    return B // (p["dp"] * p["micro_batches"]), capacity_groups(B, T, p["dp"], p["micro_batches"], p["cp"])


def reference(dump, params, per_rank=False):
    """(loss, grads): hsgd.model.serial in float64 on the dump's parameters and batch, with experts counted as the
    layout counts; per_rank: the balance loss over each rank's rows of a micro-batch instead of the declared
    domain."""
    cfg = dump.cfg
    if not cfg.moe_experts:
        return serial.loss_and_grads(params, dump.idx, dump.targets, cfg)
    b, groups = counting(dump)
    if per_rank:
        moe = MoEPass(cfg, Domain(groups, [len(G) for G in groups], len(groups)), groups, dump.biases)
    else:
        moe = serial_pass(cfg, *dump.idx.shape, np, b, groups, dump.biases)
    return serial.loss_and_grads(params, dump.idx, dump.targets, cfg, moe=moe)


def spans_ranks(dump):
    """Whether the declared balance domain differs from each rank's rows: a balance loss, and a domain whose groups
    the ranks share ("global" over dp x cp x micro-batches > 1, "sequence" over cp > 1 or several sequences a
    micro-batch, "micro-batch" over cp > 1)."""
    cfg, p = dump.cfg, dump.parallel
    if not (cfg.moe_experts and cfg.moe_balance):
        return False
    b = counting(dump)[0]
    spans = {"global": p["dp"] * p["cp"] * p["micro_batches"] > 1, "sequence": p["cp"] > 1 or b > 1,
             "micro-batch": p["cp"] > 1}
    return spans[cfg.moe_balance_domain]


class Others:
    """The gradients an expert-parallel bug gives in the reference's place: of(name) -> [(class, detail, array)],
    classify's `others`; the second reference (balance domain) is run when first asked for."""

    def __init__(self, dump, params, grads0):
        self.dump, self.params, self.grads0, self.balance = dump, params, grads0, None
        self.spans = spans_ranks(dump)

    def of(self, name):
        return self.wrong_group(name) + self.balance_domain(name)

    def wrong_group(self, name):
        """Expert e's gradient as the sum and as the mean of its place's experts on the ep ranks (ep > 1)."""
        e, ep, E = expert_of(name), self.dump.parallel["ep"], self.dump.cfg.moe_experts
        if e is None or ep == 1:
            return []
        per = E // ep
        place = [r * per + e % per for r in range(ep)]                # expert e's place on each ep rank
        total = sum(self.grads0[name.replace(f".experts.{e}.", f".experts.{o}.")] for o in place)
        why = (f"the experts at its place on each of the {ep} ep ranks: averaged over the wrong group, dp_comm, whose "
               f"ranks hold other experts there, where the ranks that hold expert {e} (edp_comm) belong")
        return [("wrong group", f"G is the sum of experts {place}'s gradients, {why}", total),
                ("wrong group", f"G is the mean of experts {place}'s gradients, {why}", total / ep)]

    def balance_domain(self, name):
        """Every gradient as the reference's with the balance loss over each rank's rows."""
        if not self.spans:
            return []
        return [("balance domain", self.detail("G"), self.per_rank()[1][name])]

    def loss(self, loss, tol):
        """What the system's loss is, when it is the reference's with the balance loss over each rank's rows (within
        tol, relative); else None."""
        if self.spans and abs(loss - self.per_rank()[0]) <= tol * abs(self.per_rank()[0]):
            return self.detail("the loss")
        return None

    def per_rank(self):
        if self.balance is None:
            self.balance = reference(self.dump, self.params, per_rank=True)
        return self.balance

    def detail(self, what):
        return (f"{what} is the reference's with the balance loss over each rank's rows instead of the declared "
                f"domain ({self.dump.cfg.moe_balance_domain}): its counts never summed over the ranks that share a "
                f"group")
