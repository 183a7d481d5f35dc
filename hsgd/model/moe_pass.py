"""What the MoE blocks of one forward call share: the balance loss's domain and its counts (hsgd.model.balance),
the rows routed together (each with its own capacity), the selection biases of auxiliary-loss-free balancing, and
each block's routing statistics (load, kept, dropped) for the reports and for the biases' update after the step.

    moe = MoEPass(cfg, dom, capacity_groups, biases)
    y, cache = moe.forward(x, p, "h.3.moe")          in block 3's forward (hsgd.model.moe.moe_forward)
    aux = moe.finish()                               after the last block: the balance loss (its one collective)
                                                     plus every block's z-loss, this call's local value
    dx = moe.backward(dy, cache, grads, daux)        in block 3's backward; daux: the upstream gradient of aux

serial_pass(cfg, B, T, xp, ...) is the pass of a serial call that counts as a layout does (its micro-batches, each
rank's rows routed together): the reference every layout is compared with.
"""
from hsgd.model.balance import Balance, domain
from hsgd.model.moe import moe_backward, moe_forward


class MoEPass:
    def __init__(self, cfg, dom, capacity_groups=None, biases=None):
        """cfg: the ModelConfig; dom: the Domain of the call's rows; capacity_groups: row-index arrays routed
        together (None: all rows); biases: {prefix: (E,) selection bias} (auxiliary-loss-free balancing)."""
        self.settings = cfg.moe_settings()
        self.balance = Balance(cfg.moe_balance, cfg.moe_experts, cfg.moe_top_k, dom, cfg.moe_balance_layers == "pooled")
        self.capacity_groups, self.biases = capacity_groups, biases or {}
        self.aux = {}                                              # {prefix: moe_forward's aux}
        self.value = None

    def forward(self, x, p, prefix):
        """The MoE layer of block `prefix` ("h.{i}.moe"): (y, cache)."""
        y, aux, cache = moe_forward(x, p, self.settings, prefix, selection_bias=self.biases.get(prefix),
                                    capacity_groups=self.capacity_groups, balance=self.balance)
        self.aux.setdefault(prefix, aux)                           # (a forward run again keeps the first's)
        return y, cache

    def finish(self):
        """This call's auxiliary losses (local value): the balance loss over its domain plus the blocks' z-losses."""
        if self.value is None:
            self.value = self.balance.finish() + sum(a["z"] for a in self.aux.values())
        return self.value

    @staticmethod
    def backward(dy, cache, grads, daux):
        """moe_backward with the balance and z losses' upstream gradient daux (the loss's own: 1, or S/m)."""
        return moe_backward(dy, {"balance": daux, "z": daux}, cache, grads)

    def loads(self):
        """{prefix: (E,) token-slots routed to each expert before drops} of this call's rows."""
        return {k: a["load"] for k, a in self.aux.items()}


def serial_pass(cfg, B, T, xp, micro_sequences=None, capacity_groups=None, biases=None):
    """The pass of a serial call on the whole step's B sequences of T rows: micro_sequences, the sequences of one
    micro-batch of the layout being reproduced (B / (dp m); default B); capacity_groups, each of its ranks' rows
    (hsgd.ep.layout.capacity_groups; default: all rows routed together)."""
    dom = domain(cfg.moe_balance_domain, B, T, xp, micro_sequences=micro_sequences)
    return MoEPass(cfg, dom, capacity_groups, biases)
