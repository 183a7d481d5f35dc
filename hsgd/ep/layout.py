"""Where a mixture-of-experts model's experts live on the grid, and what a layout can compute of it.

Parallel folding (Liu et al. 2025, "MoE Parallel Folding", Megatron-Core): the attention and the dense blocks see the
dp x pp x cp x tp grid; a MoE block's experts see the same ranks folded another way. Of the D = dp x cp ranks that
hold the same dense shard (dp_comm, hsgd.grid.process_grid), ep consecutive ones form an ep_comm and split the E
experts between them, E/ep each (expert e on ep rank e // (E/ep)); the D/ep ranks at the same place of every ep
group hold the same experts (edp_comm) and average their gradients there, as dp_comm averages the dense ones. With
tp > 1 each expert is split over tp like the dense MLP (its fc or gate|up by columns, its proj by rows), and the
ep_comm of each tp rank moves whole token rows (every tp rank routes the same rows), its experts' outputs being
partial sums over tp that the block's exit completes.

    dp_comm ranks (key dp_rank * cp + cp_rank):  0 1 2 3 | 4 5 6 7      (D = 8, ep = 4: two ep groups)
    ep_comm: {0 1 2 3}, {4 5 6 7};  edp_comm: {0 4}, {1 5}, {2 6}, {3 7}

The load-balancing loss is a statistic over a declared domain of tokens (hsgd.model.balance); a layout can compute
the domain when the ranks that hold its tokens can sum their counts before the backward pass needs them:
"micro-batch" and "sequence" over cp_comm, "global" over dp_comm when each step is one micro-batch, "pooled" over
the blocks of one stage only (pp = 1).
"""
import numpy as np

from hsgd.cp.split import positions
from hsgd.errors import ConfigError
from hsgd.model.config import divisors


def check_moe_layout(cfg, tc, dp=None):
    """Raise ConfigError (one line: what is wrong, what would work) unless the layout tc can train cfg's experts.
    dp: the grid's, where tc's is not resolved yet (a TrainConfig built in code)."""
    if not cfg.moe_experts:
        if tc.ep > 1:
            raise ConfigError(f"--ep {tc.ep} splits experts, but the model has none; add --moe-experts E (a multiple "
                              f"of ep) or drop --ep")
        return
    dp = dp or tc.dp
    D = dp * tc.cp
    if D % tc.ep:
        raise ConfigError(f"--ep {tc.ep} does not divide dp x cp = {dp} x {tc.cp} = {D}: the expert-parallel ranks "
                          f"are folded out of the data- and context-parallel ones; use ep in {divisors(D)}")
    if cfg.moe_experts % tc.ep:
        raise ConfigError(f"--moe-experts {cfg.moe_experts} cannot be split over --ep {tc.ep} ranks; use ep in "
                          f"{[d for d in divisors(cfg.moe_experts) if D % d == 0]} or a multiple of {tc.ep} experts")
    if getattr(tc, "memory", False):
        raise ConfigError("--memory predicts a step's bytes with formulas that do not count experts yet; measure a "
                          "model without --moe-experts, or drop --memory")
    if tc.ep > 1:
        if tc.hierarchical and tc.ranks_per_node and tc.ranks_per_node % tc.ep:
            raise ConfigError(f"--ep {tc.ep} with --hierarchical --ranks-per-node {tc.ranks_per_node}: the experts' "
                              f"ranks (edp_comm, every ep-th rank of dp_comm) split into nodes of ranks_per_node/ep; "
                              f"use --ranks-per-node a multiple of {tc.ep}, or leave it to MPI's shared-memory split")
    if cfg.moe_balance_domain == "global" and cfg.moe_balance and tc.micro_batches > 1:
        raise ConfigError(f"--moe-balance-domain global needs the whole batch's expert counts before any backward "
                          f"pass, but the step runs {tc.micro_batches} micro-batches one after another; use "
                          f"--micro-batches 1, or the domain micro-batch or sequence")
    if cfg.moe_balance_layers == "pooled" and cfg.moe_balance and tc.pp > 1:
        raise ConfigError(f"--moe-balance-layers pooled counts over every MoE block at once, but --pp {tc.pp} puts "
                          f"them on different stages; use --moe-balance-layers each, or --pp 1")


def counts_by_layout(cfg):
    """Whether what cfg's experts count depends on the layout (a capacity: each rank's rows routed together; the
    micro-batch balance domain: a DP group's micro-batch): then one reference cannot stand for every layout."""
    return bool(cfg.moe_experts) and bool(cfg.moe_capacity_factor or cfg.moe_balance
                                          and cfg.moe_balance_domain == "micro-batch")


def capacity_groups(B, T, dp, m, cp, xp=np):
    """The rows each rank routes together, as global row indices of a step's B sequences of T positions (row
    s T + t), in the order the rank holds them: for DP rank d, micro-batch j and context-parallel rank c, the
    micro-batch's b = B/(dp m) sequences (hsgd.dp.average.micro_batches), each at c's positions (hsgd.cp.split:
    the load-balanced chunks). Serial calls route with these groups to drop the tokens a layout drops
    (hsgd.model.moe_pass.serial_pass)."""
    b = B // (dp * m)
    out = []
    for d in range(dp):
        for j in range(m):
            seqs = xp.arange(d * B // dp + j * b, d * B // dp + (j + 1) * b)
            for c in range(cp):
                pos = xp.asarray(positions(T, cp, c)) if cp > 1 else xp.arange(T)
                out.append((seqs[:, None] * T + pos[None, :]).reshape(-1))
    return out


def expert_of(name):
    """The expert index of a parameter name "h.{i}.moe.experts.{e}....", or None for any other parameter."""
    parts = name.split(".")
    return int(parts[4]) if len(parts) > 4 and parts[2:4] == ["moe", "experts"] else None


def holds(name, cfg, ep, ep_rank):
    """Whether ep rank ep_rank holds parameter `name`: every parameter but the other ranks' experts (expert e on ep
    rank e // (E/ep))."""
    e = expert_of(name)
    return e is None or e // (cfg.moe_experts // ep) == ep_rank
