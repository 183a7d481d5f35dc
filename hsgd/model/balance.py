"""The load-balancing loss over a declared domain of tokens, for one MoE layer or a whole model's MoE blocks.

Switch's loss (Fedus et al. 2021, "Switch Transformers", eq. 4), per MoE block l and token group G of the domain:

    balance = alpha E  (1 / #groups) sum_G  sum_i f_Gi P_Gi
    f_Gi = (token-slots of G routed to expert i, before drops) / (|G| k)      a count: no gradient
    P_Gi = (1 / |G|) sum_{n in G} p_n,i                                       p: the router's probabilities

Uniform routing gives f = P = 1/E and balance = alpha. What the groups are is the domain (ModelConfig.
moe_balance_domain): "micro-batch" (the sequences a DP group's pipeline carries at once), "sequence" (each sequence
alone: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.1.2's sequence-wise loss) or "global" (the whole
global batch). A different domain is a different loss, not a rounding difference: Megatron-LM's aux_loss,
seq_aux_loss and global_aux_loss are these three. Over the blocks ("each") every MoE block has its loss, summed; or
("pooled", Hugging Face's Mixtral) one f and one P count all MoE blocks' rows together, as if one layer:
f_Gi = (slots of G routed to i in any block) / (L_moe |G| k), P_Gi the mean over G's rows of every block.

A layout computes its share. A rank's forward sees some rows of some groups (a micro-batch's B_mb sequences, T/cp
positions of each with context parallelism); the counts of a group are summed over the ranks that hold its rows
(Domain.comm: cp_comm, or dp_comm for "global") before f is known; P needs no communication, since

    balance = sum over ranks r of  alpha E (1/#groups) sum_G sum_i f_Gi (1/|G|) sum_{n in G, held by r} p_n,i

and the rank's backward needs dbalance/dp_n,i = alpha E f_Gi / (#groups |G|) for its own rows only. The trainer
averages every rank's loss and gradient over the R = dp x cp x m micro-batch shards of a step, so each rank's local
value is its share times 1/Domain.share (share = its rows / the step's rows = 1/R): the same convention as the mean
cross-entropy, whose average over the shards is the global mean. In one serial call share = 1 and comm is None.

    Domain(groups, sizes, n_groups, share, comm)     the rows of one forward call, and where the groups' counts meet
    domain(kind, B, T, xp, step_sequences, ...)      the Domain of a call on B sequences of T rows (serial or a rank)
    Balance(alpha, E, k, domain, pooled)             add(key, probs, chosen) per block in the forward, finish() once
                                                     (the Allreduce of the counts; the local value), dprobs(key, d)

Legend: N rows of the call, E experts, k top-k, L_moe MoE blocks.
"""
from dataclasses import dataclass

from hsgd.model.backend import array_module

DOMAINS = ("micro-batch", "sequence", "global")


@dataclass
class Domain:
    """The rows of one forward call as the balance loss groups them.
    groups    local row indices (arrays into the call's N rows), one per group the call holds rows of
    sizes     |G| of each: its rows over every rank
    n_groups  the groups of the step
    share     the call's rows / the step's rows (1 in a serial call: the trainer averages over 1/share shards)
    comm      the ranks whose rows fall into the same groups (their counts are summed: an Allreduce), or None"""
    groups: list
    sizes: list
    n_groups: int
    share: float = 1.0
    comm: object = None


def domain(kind, B, T, xp, step_sequences=None, micro_sequences=None, T_step=None, comm=None, global_comm=None):
    """The Domain of a forward call on B sequences of T rows each (rows flattened (B, T) -> B*T, sequence-major).
    step_sequences: the step's sequences (default B: the call is the whole step); micro_sequences: the sequences of
    one micro-batch domain (default B: the call is one micro-batch; serial calls give the layout's B/(dp m) to count
    as that layout does); T_step: the sequence's positions over every rank (default T; T*cp with context
    parallelism); comm: the ranks holding the other positions of the call's sequences (cp_comm), global_comm: every
    rank holding rows of the step at this place of the model (dp_comm, dp x cp ranks)."""
    S = step_sequences or B
    b = micro_sequences or B
    Tg = T_step or T
    seq = lambda j: xp.arange(j * T, (j + 1) * T)                     # the rows of the call's sequence j
    share = (B * T) / (S * Tg)
    if kind == "sequence":
        return Domain([seq(j) for j in range(B)], [Tg] * B, S, share, comm)
    if kind == "micro-batch":
        if B % b:
            raise ValueError(f"a call on {B} sequences is not made of micro-batches of {b}")
        return Domain([xp.arange(j * b * T, (j + 1) * b * T) for j in range(B // b)], [b * Tg] * (B // b), S // b,
                      share, comm)
    if kind == "global":
        return Domain([xp.arange(B * T)], [S * Tg], 1, share, global_comm if S * Tg != B * T else None)
    raise ValueError(f"balance domain {kind!r}: use one of {DOMAINS}")


class Balance:
    """The load-balancing loss of a forward call's MoE blocks (keys) over its Domain. add() in each block's forward,
    finish() once after the last (its one collective), dprobs() in each block's backward."""

    def __init__(self, alpha, E, k, dom, pooled=False):
        self.alpha, self.E, self.k, self.dom, self.pooled = alpha, E, k, dom, pooled
        self.counts, self.psums, self.f = {}, {}, None                # {key: (groups, E)}; f after finish
        self.w_of, self.dtype = None, None                           # (finish: d value / d p per block and group)

    def add(self, key, probs, chosen):
        """Block `key`'s probabilities (N, E) and choices (N, k): its counts and probability sums per group. A
        second add of a key (a block's forward run again, --recompute full) changes nothing."""
        if key in self.counts:
            return
        xp = array_module(probs)
        self.counts[key] = xp.stack([xp.bincount(chosen[G].reshape(-1), minlength=self.E) for G in self.dom.groups])
        self.psums[key] = xp.stack([probs[G].sum(axis=0) for G in self.dom.groups])       # (groups, E)
        self.dtype = probs.dtype

    def finish(self):
        """The counts summed over Domain.comm (one Allreduce of every block's), f, and this call's local value:
        1/share times its share of the loss (see the module docstring)."""
        if not self.counts or not self.alpha:                         # (alpha 0: no loss, nothing to count)
            return 0.0
        keys = list(self.counts)
        xp = array_module(self.counts[keys[0]])
        counts = xp.stack([self.counts[k] for k in keys]).astype(self.dtype)   # (blocks, groups, E)
        if self.dom.comm is not None and self.dom.comm.size > 1:
            counts = self.dom.comm.Allreduce(counts)                  # in place: the groups' counts, whole
        sizes = xp.asarray(self.dom.sizes, dtype=self.dtype)[None, :, None]   # (1, groups, 1) |G|
        if self.pooled:                                               # one count over every block's rows
            counts = xp.broadcast_to(counts.sum(axis=0, keepdims=True), counts.shape)
            per = len(keys)                                           # rows of a group: L_moe |G|
        else:
            per = 1
        f = counts / (per * sizes * self.k)                           # (blocks, groups, E)
        # w[key, G, i]: d balance / d p_n,i for a row n of G in block key, before 1/share
        self.w = self.alpha * self.E * f / (self.dom.n_groups * per * sizes)
        self.f = dict(zip(keys, f))
        psums = xp.stack([self.psums[k] for k in keys])               # (blocks, groups, E)
        self.w_of = dict(zip(keys, self.w))
        return (self.w * psums).sum() / self.dom.share

    def dprobs(self, key, dloss, N):
        """(N, E): dloss times the local value's gradient with respect to block `key`'s probabilities."""
        xp = array_module(self.psums[key])
        out = xp.zeros((N, self.E), dtype=self.dtype)
        if not self.alpha:
            return out
        if self.w_of is None:
            raise RuntimeError("Balance.dprobs before finish(): the model calls finish() (MoEPass.finish) after its "
                               "last block's forward, when the domain's counts are known")
        w = self.w_of[key] * (dloss / self.dom.share)                 # (groups, E)
        for G, wG in zip(self.dom.groups, w):
            out[G] += wG
        return out
