"""The mixture-of-experts block as the planner prices it (hsgd.model.moe, the layer; hsgd.ep.layout, where its
experts live): its parameters, what one rank holds of them, what it keeps for the backward pass and what it sends.

Legend: E experts, k top-k, ep expert-parallel ranks, D = dp cp the ranks of dp_comm, edp = D/ep the ranks that hold
the same experts; X = m C F + b ((m - 1) F + C) one expert's parameters (the dense MLP's: m = 2 GELU, 3 SwiGLU; b = 1
with biases); L_moe the MoE blocks (0, n, 2n, ... with moe_every n); N = T/cp x the micro-batch's sequences, the
rows a rank routes per micro-batch; S the token-slots it sends, R the rows its experts receive; s bytes per element.

Parameters. A MoE block has the router (C, E) and E experts in place of the MLP; a token reads k of them:

    P        = P_dense + L_moe (C E + (E - 1) X)        P_dense: every block dense (hsgd.plan.family.param_formula)
    P_active = P_dense + L_moe (C E + (k - 1) X)

equal to ModelConfig.n_params() and n_active_params() (tests/test_plan_moe.py). Mixtral 8x7B (Jiang et al. 2024,
"Mixtral of Experts": 47 B parameters, 13 B active) is the preset mixtral-8x7b.

One rank (`rank_numel`). Of a MoE block it holds what a dense block holds less the MLP, plus the router whole on every
tp rank ("moe", averaged over dp_comm with the dense groups), and its E/ep experts, each split over tp as the dense MLP
(fc or gate and up by columns F/tp with their biases, proj by rows, proj's bias whole), X_t = m C F/tp + b ((m - 1)
F/tp + C) each ("experts", averaged over edp_comm: their own exchange, `FoldedExchange`; with ep = 1, edp_comm is
dp_comm and they join the dense groups' exchange, `in_backward_order`). The model states of a
Megatron-style run are then ZeRO's 16 psi over D for the dense elements and over edp for the experts' (ZeRO's
sharding is over the ranks that hold the same elements: a rank's E/ep X_t expert elements are sharded edp ways).

Assumptions, under which the formulas below hold: uniform routing and nothing dropped (every expert gets N k/E of
each rank's slots, so S = R = N k whatever ep is; a capacity factor below 1 would drop some, and is priced as if it
did not); the router is replicated over tp (each tp rank computes it whole) and runs in 32-bit (Fedus et al. 2021,
"Switch Transformers": selective precision); the tp collectives of a MoE block are the dense block's (each tp rank's
partial expert outputs are combined and then reduced over tp as the dense MLP's output is) and those
hsgd.tp.experts.experts_formula adds (the gates' gradient's Allreduce, the balance loss's counts: in
hsgd.accounting.traffic.rank_bytes); the all-to-all moves every row whole on each tp rank.

Activations a MoE block keeps per micro-batch, in place of the dense MLP's (4 or 6) N F (paper.activation_bytes):

    router       4 N E               the softmax probabilities, 32-bit (the N x k gates and indices left out)
    dispatched   s S C               the rows its experts take in (R = S)
    hidden       (4 | 6) S F/tp      each expert's hidden rows, as the dense MLP's (GELU: its input and output;
                                     SwiGLU: gate and up, and their product)
    outputs      s S C               the experts' rows sent back, kept for the gates' gradient

Time. FLOPs per micro-batch and MoE block on a rank: the k experts of its N rows, 2 N k m C F/tp, and the router's
2 N C E (costs.micro_batch_flops). The all-to-all (hsgd.ep.dispatch, with ep > 1) per MoE block and micro-batch
(`alltoall_calls`), payload = the send buffer, own rows included:

    forward     Alltoall of the counts 8 ep,  Alltoallv dispatch S C s,  Alltoallv combine R C s
    backward    Alltoallv S C s,  Alltoallv R C s           (the adjoints: combine's, then dispatch's)

4 N k C s + 8 ep bytes with uniform routing; --recompute full runs the forward's again. Priced on the link the ep
group crosses (costs.group_links, costs.ep_span) and not hidden: each is in the F or the B of its micro-batch.
"""
from .family import megatron_numel, params_of


def expert_formula(C, F, m=2, b=1):
    """X: one expert's parameters, plain arithmetic (takes sympy symbols): m C F + b ((m - 1) F + C)."""
    return m * C * F + b * ((m - 1) * F + C)


def moe_formula(P_dense, L_moe, C, E, k, X):
    """(P, P_active) of the module docstring: the dense model's P with L_moe MLPs made MoE blocks."""
    return P_dense + L_moe * (C * E + (E - 1) * X), P_dense + L_moe * (C * E + (k - 1) * X)


def mats(cfg):
    """m: the MLP's C x F matrices, 2 (fc, proj) with GELU, 3 (gate, up, proj) with SwiGLU."""
    return 2 if cfg.mlp == "gelu" else 3


def param_counts(cfg):
    """(total, active) parameters of cfg (moe_formula of its sizes; a dense cfg: params_of twice)."""
    P = params_of(cfg)
    if not cfg.moe_experts:
        return P, P
    X = expert_formula(cfg.d_model, cfg.d_ff, mats(cfg), int(cfg.bias))
    return moe_formula(P, len(cfg.moe_layers()), cfg.d_model, cfg.moe_experts, cfg.moe_top_k, X)


def rank_numel(cfg, tp, ep):
    """{"moe": elements one tp rank holds of a MoE block's attention, norms and router, "experts": of its E/ep
    experts} (the module docstring); {} for a dense cfg."""
    if not cfg.moe_experts:
        return {}
    C, F = cfg.d_model, cfg.d_ff
    X_t = mats(cfg) * C * F // tp + int(cfg.bias) * ((mats(cfg) - 1) * F // tp + C)
    return {"moe": megatron_numel(cfg, tp)["h"] - X_t + C * cfg.moe_experts, "experts": cfg.moe_experts // ep * X_t}


def expert_groups(cfg, layers, tp, ep):
    """{"h.{i}.experts": elements}: the expert gradient groups of a stage's blocks, in backward order."""
    per = rank_numel(cfg, tp, ep)
    return {f"h.{i}.experts": per["experts"] for i in reversed(layers) if cfg.is_moe(i)}


def in_backward_order(numel, experts):
    """The gradient groups numel {group: elements} with each block's experts just before it (an expert's backward
    finishes before its block's attention's): the one exchange of ep = 1, where every rank holds every expert."""
    out = {}
    for g, n in numel.items():
        out.update({g + ".experts": experts[g + ".experts"]} if g + ".experts" in experts else {})
        out[g] = n
    return out


def kept_bytes(cfg, N, tp, itemsize=2):
    """Bytes a MoE block keeps for its backward pass on one rank routing N rows (the module docstring's table)."""
    S, C, F = N * cfg.moe_top_k, cfg.d_model, cfg.d_ff
    return 4 * N * cfg.moe_experts + 2 * itemsize * S * C + (2 if cfg.mlp == "gelu" else 3) * itemsize * S * F / tp


def alltoall_calls(cfg, b, cp, ep, itemsize):
    """([(op, payload bytes)] of a MoE block's forward, [...] of its backward) for one micro-batch of b sequences
    on one rank (the module docstring), uniform routing: S = R = N k."""
    S = R = b * cfg.seq_len // cp * cfg.moe_top_k
    row = cfg.d_model * itemsize
    forward = [("Alltoall", 8 * ep), ("Alltoallv", S * row), ("Alltoallv", R * row)]
    return forward, [("Alltoallv", S * row), ("Alltoallv", R * row)]


def alltoall_formula(cfg, lay, n_moe):
    """{("ep", op): (calls, payload bytes)} of one step of a stage with n_moe MoE blocks (lay: .b .cp .ep .m
    .itemsize .recompute); {} without experts or with ep = 1 (every token's experts on its own rank)."""
    if not n_moe or lay.ep == 1:
        return {}
    forward, backward = alltoall_calls(cfg, lay.b, lay.cp, lay.ep, lay.itemsize)
    out = {}
    for op, nbytes in forward * (2 if lay.recompute == "full" else 1) + backward:
        calls, total = out.get(("ep", op), (0, 0))
        out[("ep", op)] = (calls + lay.m * n_moe, total + lay.m * n_moe * nbytes)
    return out


class FoldedExchange:
    """A MoE stage's two gradient exchanges as the one sizes object the planner reads (hsgd.dp.exchange's interface:
    itemsize, hidden_by, formula, when, comms, owned_numel): the dense groups over dp_comm ("dp", D ranks), the
    experts over edp_comm ("edp", D/ep ranks). experts: the exchange of the same settings on edp ranks, flat (the
    hierarchical exchange and hybrid sharding are left to the dense groups), its "dp" read as "edp"."""

    def __init__(self, dense, experts):
        self.dense, self.experts = dense, experts
        self.itemsize, self.hidden_by = dense.itemsize, dense.hidden_by

    def formula(self):
        return self.dense.formula() | {("edp", op): v for (_, op), v in self.experts.formula().items()}

    def when(self, key):
        return self.experts.when(("dp", key[1])) if key[0] == "edp" else self.dense.when(key)

    def comms(self):
        return self.dense.comms() | {"edp": self.experts.dp_size}

    def owned_numel(self):
        return self.dense.owned_numel() + self.experts.owned_numel()
