# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 16: experts: routing, balancing, and the all-to-all of expert parallelism
#
# A mixture-of-experts block replaces the MLP by E experts and a router that sends each token to k of them
# (Shazeer et al. 2017, "Outrageously Large Neural Networks"; Lepikhin et al. 2020, "GShard"; Fedus et al. 2021,
# "Switch Transformers"; Jiang et al. 2024, "Mixtral of Experts"). Parameters grow with E, work per token with k:
# Mixtral 8x7B holds eight experts per block and computes two per token. Like context parallelism (chapter 13),
# experts go beyond the lecture but stand on three of its sections: an expert is one of section 3.1's "parameter
# blocks", put on its own ranks; section 3.4's gradient average runs over the ranks that hold *that expert*; and
# section 4.2's balance is decided token by token by a router that learns.
#
# `hsgd/model/moe.py` is the layer (router, top-k, gates, capacity and drops, the permutation by expert, the
# z-loss, the selection bias), `hsgd/model/balance.py` the load-balancing loss over a declared domain of tokens,
# `hsgd/ep/` the expert-parallel layout (parallel folding) and the all-to-all, `hsgd/dp/folded.py` the gradient
# average with experts.
#
# Run it with eight ranks (measured on a 2-core machine loaded to a load average of 8: 20 s; its solutions, one
# process, 2 s). Rank 0 draws four pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/16_experts.py
#
# `mpirun -n 8 python -m hsgd.train --moe-experts 8 --moe-top-k 2 --ep 4` trains with experts (tp 2 x dp 4, ep 4)
# and prints per MoE block the load per expert, the drops, and the all-to-all's bytes over their formula.
#
# Legend: B sequences of the global batch, b = B/(dp m) the sequences of a micro-batch, m micro-batches per DP
# group, T sequence length, C d_model, NH heads (NKV key/value heads), F the experts' width (d_ff), V vocabulary, L
# blocks, L_moe MoE blocks, E experts, k experts per token (top-k), N the rows a rank routes at once (b T/cp), S the
# kept token-slots a rank sends, R the rows its experts receive, c the capacity factor, alpha the balance loss's
# coefficient, beta the z-loss's, gamma the selection bias's rate; tp, pp, cp, dp the grid, D = dp x cp the ranks
# of `dp_comm`, ep the expert-parallel ranks, edp = D/ep the ranks that hold the same experts; s bytes per number.

# %%
import numpy as np

from hsgd.accounting.traffic import step_formula
from hsgd.dp.average import dp_rows, global_loss, micro_batches
from hsgd.ep.dispatch import AllToAll, all_to_all_formula
from hsgd.ep.layout import capacity_groups, check_moe_layout, holds
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.model import gradcheck, layers, serial
from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.model.moe import (MoESettings, dispatch_indices, expert_capacity, moe_backward, moe_forward,
                            moe_param_shapes, softmax, update_selection_bias)
from hsgd.model.moe_pass import serial_pass
from hsgd.model.optim import make_optimizer
from hsgd.step.trainer import HybridTrainer
from hsgd.tp.experts import Experts

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

P = 8                                   # ranks
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
FD_TOL = 1e-7                           # central differences of order 4, h = 1e-5: truncation ~1e-10
H = 1e-5
# one BLAS thread per rank; eight ranks, else a clear exit; check(what, err, tol), check.holds(what, cond),
# check.equal(what, a, b), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=TOL, width=72)


def layer(settings, C, F, N, seed, prefix="moe"):
    """(params, x (N, C), R (N, C)) float64: the router N(0, 1) (an order-1 router: skewed, decided routing), the
    experts N(0, 0.4^2), the rows x and a fixed dL/dy R N(0, 1)."""
    r = np.random.default_rng(seed)
    shapes = moe_param_shapes(prefix, C, F, settings.experts, settings.mlp)
    params = {n: r.normal(0.0, 1.0 if "router" in n else 0.4, s) for n, s in shapes.items()}
    return params, r.normal(0.0, 1.0, (N, C)), r.normal(0.0, 1.0, (N, C))


def margin(x, W, k):
    """The smallest gap, over the rows, between a row's k-th and (k+1)-th softmax score: a probe of a finite
    difference that moves the scores by less cannot change any routing decision."""
    s = -np.sort(-softmax(x @ W), axis=1)                                     # (N, E) largest first
    return float((s[:, k - 1] - s[:, k]).min())


# %% [markdown]
# ## 1. The router and its gradient
#
# For N rows x (N, C) the router computes $p = \mathrm{softmax}(x W_r)$ (N, E); each token takes the k experts of
# largest $p$ (ties to the lower index), and outputs the gated sum of theirs,
#
# $$y_n = \sum_{j=1}^{k} g_{nj}\, \mathrm{Expert}_{e_{nj}}(x_n), \qquad
#   g_{nj} = \frac{p_{n e_{nj}}}{\sum_{j'} p_{n e_{nj'}}} = \mathrm{softmax}_j\big((x W_r)_{n e_{nj}}\big)$$
#
# ("renormalized", Mixtral's gates; "probabilities" keeps $g_{nj} = p_{n e_{nj}}$, Switch's; "sigmoid" is
# DeepSeek-V3's). The top-k choice is piecewise constant: no gradient flows through it. Three paths reach the
# router, the three terms of `router_backward`: the **gates** ($\partial L/\partial g_{nj} = \langle \partial
# L/\partial y_n, \mathrm{Expert}_{e_{nj}}(x_n)\rangle$ through the renormalization and softmax), the **balance
# loss** through P (section 3), and the **z-loss** on the logits. The balance loss $\alpha E \sum_i f_i P_i$
# multiplies a count, the fraction $f_i$ of slots routed to i, by the mean probability $P_i$; f is locally
# constant, so the gradient is $\alpha E f_i\, \partial P_i/\partial p$ alone. Checked on one layer (N = 12, C = 6,
# F = 8, E = 4, k = 2, SwiGLU experts): the backward against central differences of $L = \sum y \odot R +
# \text{balance} + z$ through every parameter and the input, the seed chosen so that every row's k-th score is at
# least $100h$ above its (k+1)-th (no probe changes a choice).

# %%
S1 = MoESettings(experts=4, top_k=2, mlp="swiglu", gates="renormalized", balance_coef=0.3, z_coef=0.05)
seed1 = next(sd for sd in range(100) if margin(layer(S1, 6, 8, 12, sd)[1], layer(S1, 6, 8, 12, sd)[0]
                                                ["moe.router.weight"], 2) > 100 * H)
p1, x1, R1 = layer(S1, 6, 8, 12, seed1)
y1, aux1, c1 = moe_forward(x1, p1, S1)
g1 = {n: np.zeros_like(a) for n, a in p1.items()}
dx1 = moe_backward(R1, {"balance": 1.0, "z": 1.0}, c1, g1)
logits1 = x1 @ p1["moe.router.weight"]                                        # (N, E)
chosen1 = np.argsort(-logits1, axis=1, kind="stable")[:, :2]                  # (N, k) softmax keeps the order
lc = np.take_along_axis(logits1, chosen1, axis=1)                              # (N, k) the chosen logits
check("gates == softmax over the k chosen logits (renormalized)", rel_err(c1[3], softmax(lc)))
names1 = sorted(p1)


def loss1():
    y, aux, _ = moe_forward(x1, p1, S1)
    return float((y * R1).sum() + aux["balance"] + aux["z"])


fd1 = pictures.on_rank0(world, lambda: gradcheck.fd_error(loss1, [x1] + [p1[n] for n in names1],
                                                          [dx1] + [g1[n] for n in names1], h=H, order=4,
                                                          measure="array"), share=True)
say(f"seed {seed1}: selection margin {margin(x1, p1['moe.router.weight'], 2):.1e}; balance {aux1['balance']:.6f}, "
    f"z {aux1['z']:.6f}")
check(f"layer backward (dx, router, {len(names1) - 1} expert weights) vs central differences", fd1, FD_TOL)

# %% [markdown]
# The balance loss alone (dy = 0, no z): the layer's router gradient equals $\alpha E f_i\, \partial P_i /
# \partial \text{logits}$ with f constant ($\partial P_i/\partial l_{nm} = p_{ni}(\delta_{im} - p_{nm})/N$), and its
# finite differences.

# %%
S1b = MoESettings(experts=4, top_k=2, mlp="swiglu", balance_coef=0.3)
_, aux_b, c_b = moe_forward(x1, p1, S1b)
g_b = {n: np.zeros_like(a) for n, a in p1.items()}
moe_backward(np.zeros_like(x1), {"balance": 1.0, "z": 0.0}, c_b, g_b)
N1, E1 = x1.shape[0], 4
pr = softmax(logits1)                                                         # (N, E)
f = np.bincount(chosen1.reshape(-1), minlength=E1) / (N1 * 2)                  # (E,) the count, a constant
dp_ = np.broadcast_to(0.3 * E1 * f / N1, (N1, E1))                             # d balance / d p_ni
dlogits = pr * (dp_ - (dp_ * pr).sum(axis=1, keepdims=True))                  # the softmax's Jacobian
check("balance's router gradient == alpha E f dP/dW with f held constant",
      rel_err(g_b["moe.router.weight"], x1.T @ dlogits))


def balance_only():
    return float(moe_forward(x1, p1, S1b)[1]["balance"])


fd_b = gradcheck.fd_error(balance_only, [p1["moe.router.weight"]], [g_b["moe.router.weight"]], h=H, order=4,
                          measure="array")
check("... and its central differences (f does not move under the probes)", fd_b, FD_TOL)

# %% [markdown]
# With k = 1 and renormalized gates the single gate is $p_e/p_e = 1$ whatever the logits: the task's loss reaches
# the router only through the choice, which has no gradient, so the router would learn only from the auxiliary
# losses. That is why Switch (k = 1) keeps the probability as the gate. Checked: with k = 1, alpha = beta = 0, the
# router's gradient is exactly zero with renormalized gates and not with probabilities.

# %%
for gates in ("renormalized", "probabilities"):
    s_k1 = MoESettings(experts=4, top_k=1, mlp="swiglu", gates=gates)
    _, _, c_k1 = moe_forward(x1, p1, s_k1)
    g_k1 = {n: np.zeros_like(a) for n, a in p1.items()}
    moe_backward(R1, {"balance": 1.0, "z": 1.0}, c_k1, g_k1)
    norm = float(np.abs(g_k1["moe.router.weight"]).max())
    say(f"k = 1, {gates:<13}: max |dL/dW_router| = {norm:.3e}")
    if gates == "renormalized":
        check.holds("k = 1, renormalized gates: the router's gradient is exactly 0", norm == 0.0)
    else:
        check.holds("k = 1, probabilities as gates: the router learns from the task", norm > 1e-3)

# %% [markdown]
# ## 2. Capacity and drops
#
# An expert on a device computes a fixed-size batch: at most $\text{capacity} = \lceil c\, N k / E\rceil$
# token-slots of the N rows routed together (`expert_capacity`). The N k slots (slot $nk + j$: token n's j-th
# choice) queue at their experts in token order (Switch's policy; Megatron-LM's `--moe-token-drop-policy
# position`), and slots past the capacity are **dropped**: they add nothing to their token's output (the residual
# carries the token on), and the other gate is not renormalized. `dispatch_indices` returns the kept slots sorted
# by expert, `perm`, and the inverse `inv` (a dropped slot reads zeros). Checked against a queue written by hand,
# and a token's output against the sum of its kept slots.

# %%
S2 = MoESettings(experts=4, top_k=2, mlp="swiglu", capacity_factor=1.0)
p2, x2, _ = layer(S2, 6, 8, 12, seed=3)
y2, aux2, c2 = moe_forward(x2, p2, S2)
logits2 = x2 @ p2["moe.router.weight"]
chosen2 = np.argsort(-logits2, axis=1, kind="stable")[:, :2]                  # (N, k)
cap = expert_capacity(12, S2)
kept_by_hand, queue = [], {e: 0 for e in range(4)}
for n in range(12):                                                            # tokens in order ...
    for j in range(2):                                                         # ... each choice in order
        e = int(chosen2[n, j])
        if queue[e] < cap:
            kept_by_hand.append(n * 2 + j)
        queue[e] += 1
perm2, inv2, load2, kept2 = dispatch_indices(chosen2, 4, cap)
check.equal(f"capacity = ceil(c N k / E) = ceil(1.0 x 12 x 2 / 4) = {cap}", cap, 6)
check.equal("kept slots == first come, first served in token order", sorted(perm2.tolist()), kept_by_hand)
check.equal("dropped == sum over experts of max(load - capacity, 0)", aux2["dropped"],
            int(np.maximum(load2 - cap, 0).sum()))
say(f"load per expert {load2.tolist()}, capacity {cap}: kept {kept2.tolist()}, {aux2['dropped']} slot(s) dropped")
check.holds("some slots are dropped (the check below is not empty)", aux2["dropped"] > 0)
g2 = c2[3]                                                                     # (N, k) the gates
by_hand = np.zeros_like(x2)
for slot in kept_by_hand:
    n, j = divmod(slot, 2)
    e = int(chosen2[n, j])
    name = f"moe.experts.{e}."                                                 # expert e alone on token n
    h = (x2[n] @ p2[name + "gate.weight"]) * (1 / (1 + np.exp(-(x2[n] @ p2[name + "gate.weight"]))))
    by_hand[n] += g2[n, j] * ((h * (x2[n] @ p2[name + "up.weight"])) @ p2[name + "proj.weight"])
check("y == sum over kept slots of gate x expert(x) (dropped: nothing)", rel_err(y2, by_hand))

# %% [markdown]
# Left, each token's probabilities, its two choices marked, a dropped slot crossed out; right, each expert's queue
# in token order, the capacity a line.

# %%
def draw_routing():
    from matplotlib.patches import Rectangle
    fig, (ax, ax2) = pictures.figure(10, 4.2, ncols=2, gridspec_kw={"width_ratios": [1, 1.5]})
    im = ax.imshow(softmax(logits2), cmap="Blues", aspect="auto", vmin=0, vmax=1)
    dropped = set(range(24)) - set(kept_by_hand)
    for n in range(12):
        for j in range(2):
            e = int(chosen2[n, j])
            ax.text(e, n, "x" if n * 2 + j in dropped else str(j + 1), ha="center", va="center", fontsize=9,
                    color="red" if n * 2 + j in dropped else "black", fontweight="bold")
    ax.set_xticks(range(4))
    ax.set_yticks(range(12))
    ax.set_xlabel("expert", fontsize=8)
    ax.set_ylabel("token n", fontsize=8)
    ax.set_title("router probabilities; 1, 2: first, second choice;\nx: a slot dropped", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.05)
    for e in range(4):
        slots = [n * 2 + j for n in range(12) for j in range(2) if chosen2[n, j] == e]
        for q, slot in enumerate(slots):
            ax2.add_patch(Rectangle((e * 1.3, q), 1.0, 0.9, fc="#f4a6a6" if slot in dropped else "#9ecae1",
                                    ec="black", lw=0.5))
            ax2.text(e * 1.3 + 0.5, q + 0.45, f"token {slot // 2}, #{slot % 2 + 1}", ha="center", va="center",
                     fontsize=6.5)
        ax2.text(e * 1.3 + 0.5, -0.8, f"expert {e}\nload {len(slots)}", ha="center", va="center", fontsize=7)
    ax2.axhline(cap - 0.05, color="black", ls="--", lw=0.8)
    ax2.text(4 * 1.3 - 0.1, cap + 0.1, f"capacity {cap}", ha="right", fontsize=7)
    ax2.set_xlim(-0.2, 4 * 1.3)
    ax2.set_ylim(max(load2) + 0.5, -1.6)
    ax2.axis("off")
    ax2.set_title(f"each expert's queue in token order (N = 12, k = 2, E = 4, c = 1.0): {aux2['dropped']} dropped",
                  fontsize=8)
    return pictures.save(fig, "16_routing")


say(f"picture: {pictures.on_rank0(world, draw_routing)}")

# %% [markdown]
# ## 3. Balancing: Switch's loss, its domains, the z-loss, and the selection bias
#
# Nothing in the task's loss asks the router to spread its tokens. Switch's loss (Fedus et al. 2021, eq. 4)
#
# $$\text{balance} = \alpha E \sum_{i=1}^{E} f_i P_i, \qquad f_i = \frac{\#\text{slots routed to } i}{N k},
#   \qquad P_i = \frac{1}{N}\sum_n p_{ni},$$
#
# equals $\alpha$ whenever P is uniform, whatever f: its value measures how f and P align, and its gradient lowers
# the busy experts' probabilities. (Hugging Face counts f per token, summing to k: its coefficient c is hsgd's
# alpha = c k.)
#
# **Over which tokens?** f and P are counted over a **domain** (`--moe-balance-domain`): each *micro-batch* of b
# sequences (Megatron-LM's `aux_loss`, the usual default), each *sequence* (`seq_aux_loss`, DeepSeek-V3's) or the
# *global* batch (`global_aux_loss`). hsgd averages the groups' losses, $\alpha E\, \mathrm{mean}_G \sum_i f_{Gi}
# P_{Gi}$, each layout summing a group's counts over the ranks that hold its rows (`hsgd.model.balance`).
#
# A question from databricks/megablocks issue #85: the same trained model, loaded with more pipeline stages,
# reported a slightly larger load-balancing loss; rounding, or a bug? A micro-batch domain is a mean of products
# over groups of b = B/(dp m) sequences, and b is set by the layout. Its difference from the global loss is exactly
# a covariance over the groups,
#
# $$\text{micro-batch} - \text{global} = \alpha E \sum_{\text{blocks}} \mathrm{mean}_G
#   \sum_i (f_{Gi} - \bar f_i)(P_{Gi} - \bar P_i),$$
#
# ($\bar f$, $\bar P$ the global batch's), positive when a group that sends more slots to an expert also gives it
# more probability, and larger for smaller groups. The run: one batch, the initial parameters, no capacity, each
# layout's loss less the cross-entropy. Layouts with the same b, whatever their pp, ep or m, agree to rounding
# with serial counted over micro-batches of b; another b gives another value, far beyond rounding; the global
# domain one value everywhere. So a layout change that changes the tokens counted together changes the statistic,
# neither rounding nor a bug; one that keeps them (Megatron-LM fixes the micro-batch size by a flag) must agree to
# rounding. (hsgd refuses the global domain with m > 1: its counts must be complete before the first backward.)

# %%
SIZES = dict(vocab_size=256, seq_len=16, d_model=16, n_heads=2, n_layers=2, d_ff=16, arch="llama")
B, SEED = 16, 0
corpus = Corpus.load(None, SIZES["seq_len"])                  # the built-in corpus, as hsgd.train
idx, targets = corpus.batch(SEED, 1, B)
cfg3 = {dom: ModelConfig(**SIZES, moe_experts=8, moe_top_k=2, moe_balance=0.1, moe_balance_domain=dom)
        for dom in ("micro-batch", "global")}
params0 = serial.init_params(cfg3["global"], seed=SEED, dtype="float64")
ce0 = serial.loss(params0, idx, targets, cfg3["global"])       # the cross-entropy alone


def serial_balance(dom, b):
    """(balance, the MoEPass) of serial counted over micro-batches of b sequences (or the global batch)."""
    moe = serial_pass(cfg3[dom], B, SIZES["seq_len"], np, micro_sequences=b)
    serial.loss_and_grads(params0, idx, targets, cfg3[dom], moe=moe)
    return float(moe.finish()), moe


serial_bal = {b: serial_balance("micro-batch", b) for b in (1, 2, 4, 8, 16)}
glob, moe_glob = serial_balance("global", None)
LAYOUTS3 = [  # (dp, pp, tp, ep, m)
    (4, 1, 2, 4, 1), (2, 2, 2, 2, 2), (4, 1, 2, 4, 2), (2, 2, 2, 2, 4), (8, 1, 1, 8, 1), (8, 1, 1, 8, 2)]


def layout_balance(dom, dp, pp, tp, ep, m):
    """The balance loss of one step of a layout on the batch at the initial parameters: its loss less the
    cross-entropy (no capacity: the cross-entropy does not depend on the layout)."""
    tc = train_config(dp=dp, pp=pp, tp=tp, ep=ep, micro_batches=m, steps=1, batch_size=B, seed=SEED)
    check_moe_layout(cfg3[dom], tc)
    grid = ProcessGrid(world, dp=dp, pp=pp, tp=tp, ep=ep)
    trainer = HybridTrainer(cfg3[dom], grid, tc)
    loss = trainer.step(idx, targets, 1).loss
    trainer.free()
    grid.free()
    return loss - ce0


say(f"cross-entropy {ce0:.6f}; balance loss (alpha = 0.1) over micro-batches of b sequences, serial and layouts:")
say(f"{'dp x pp x tp, ep, m':<24}{'b':>4}{'layout':>14}{'serial (b)':>14}{'difference':>12}")
for dp, pp, tp, ep, m in LAYOUTS3:
    b = B // (dp * m)
    got = layout_balance("micro-batch", dp, pp, tp, ep, m)
    err = abs(got - serial_bal[b][0]) / serial_bal[b][0]
    say(f"{f'{dp} x {pp} x {tp}, ep {ep}, m {m}':<24}{b:>4}{got:>14.10f}{serial_bal[b][0]:>14.10f}{err:>12.1e}")
    check(f"micro-batch domain, dp {dp} pp {pp} tp {tp} ep {ep} m {m}: == serial over b = {b}", err, 1e-12)
for dp, pp, tp, ep, m in ((4, 1, 2, 4, 1), (2, 2, 2, 2, 1), (8, 1, 1, 8, 1)):
    got = layout_balance("global", dp, pp, tp, ep, m)
    check(f"global domain, dp {dp} pp {pp} tp {tp} ep {ep}: == serial's global", abs(got - glob) / glob, 1e-12)
try:
    check_moe_layout(cfg3["global"], train_config(dp=4, tp=2, ep=4, micro_batches=2, batch_size=B))
    refused = ""
except ConfigError as e:
    refused = str(e)
say(f"global with m = 2 refused: {refused}")
check.holds("global domain with m > 1: refused, in one line", "--micro-batches 1" in refused)

# %% [markdown]
# The values against b (b = B: the global loss), and the covariance identity from the serial counts.

# %%
sizes_b = sorted(serial_bal)
say(f"{'b':>4}{'balance':>14}{'- global':>12}{'covariance':>12}")
worst_cov, diffs = 0.0, {}
for b in sizes_b:
    val, moe = serial_bal[b]
    cov = 0.0
    for key, fG in moe.balance.f.items():                                     # (groups, E) per block
        PG = moe.balance.psums[key] / (b * SIZES["seq_len"])                  # (groups, E) mean probabilities
        cov += 0.1 * 8 * ((fG - fG.mean(0)) * (PG - PG.mean(0))).sum(1).mean()
    diffs[b] = val - glob
    worst_cov = max(worst_cov, abs(diffs[b] - cov) / glob)
    say(f"{b:>4}{val:>14.10f}{diffs[b]:>12.2e}{cov:>12.2e}")
check("micro-batch - global == alpha E sum mean_G cov(f_G, P_G), every b", worst_cov, 1e-12)
check("b = B (one micro-batch): == the global domain", abs(serial_bal[B][0] - glob) / glob, 1e-13)
check.holds("the covariance is positive here and grows as b shrinks (far above rounding)",
            all(diffs[a] > diffs[b] > 1e-6 for a, b in zip(sizes_b[:-2], sizes_b[1:-1])))

# %% [markdown]
# The loss grows as b shrinks, and its gradient changes: a micro-batch domain asks each micro-batch to be
# balanced, the global domain only the batch (exercise 1).
#
# **The z-loss** (Zoph et al. 2022, "ST-MoE"): $z = \beta\, \mathrm{mean}_n (\log\sum_i e^{l_{ni}})^2$ keeps the
# router's logits small, which matters in bfloat16 (chapter 14: a large logit rounds small probabilities away);
# its gradient $2\beta\, \mathrm{lse}_n\, p_{ni}/N$ was inside section 1's finite differences. Its value against
# the formula:

# %%
lse = np.log(np.exp(logits1).sum(axis=1))
check("z-loss == beta mean_n logsumexp(logits_n)^2", abs(aux1["z"] - 0.05 * (lse ** 2).mean()) / aux1["z"], 1e-14)

# %% [markdown]
# **Balancing without a loss** (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
# Mixture-of-Experts"; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"): each expert gets a bias $b_i$ added to
# the scores for the *choice* only, never to a gate, and after every step
# $b_i \leftarrow b_i + \gamma\, \mathrm{sign}(\overline{\text{load}} - \text{load}_i)$. It is state, not a
# parameter: no gradient. Checked: with a bias the gates are still the renormalized probabilities of what was
# chosen; and on a fixed router whose 256 inputs share a common direction, 60 updates at two rates. A token changes
# its choice when the bias moves by more than the gap between its k-th and (k+1)-th score: a rate below the typical
# gap moves a few tokens per update and the load falls smoothly; a rate above it moves most tokens near the
# boundary at once, past the even share, and the load swings. A control loop whose gain is gamma: section 9 meets
# it in training, exercise 3 sweeps the gain.

# %%
S3 = MoESettings(experts=4, top_k=2, mlp="swiglu")
p3, x3, _ = layer(S3, 6, 8, 256, seed=3)
x3 = x3 + 2.0 * np.random.default_rng(0).normal(size=6)                    # a common direction: skewed routing
srt = -np.sort(-softmax(x3 @ p3["moe.router.weight"]), axis=1)                # (N, E) scores, largest first
gap3 = float(np.median(srt[:, 1] - srt[:, 2]))                                # a token's k-th over its (k+1)-th
traj = {}
for gamma in (0.003, 0.05):
    bias, traj[gamma] = np.zeros(4), []
    for it in range(60):
        _, aux3, c3 = moe_forward(x3, p3, S3, selection_bias=bias)
        traj[gamma].append(float(aux3["load"].max() / aux3["load"].mean()))
        bias = update_selection_bias(bias, aux3["load"], gamma)              # after the "step", by its load
    shown = " ".join(f"{r:.2f}" for r in traj[gamma][-8:])
    say(f"gamma {gamma}: max/even load of 256 tokens (at most E/k = 2) from {traj[gamma][0]:.2f}; the last 8 "
        f"updates: {shown}")
say(f"median gap between a token's 2nd and 3rd score: {gap3:.4f}")
pr3 = softmax(x3 @ p3["moe.router.weight"])
chosen3 = c3[1][3]                                                            # the choice made with the bias
pc = np.take_along_axis(pr3, chosen3, axis=1)
check("with a bias: gates == the chosen probabilities renormalized (no bias)",
      rel_err(c3[3], pc / pc.sum(axis=1, keepdims=True)))
swing = {g: float(np.ptp(t[-20:])) for g, t in traj.items()}                # max - min over the last 20 updates
check.holds("gamma 0.003 < the gap: the load falls smoothly (by > 0.1, the last 20 within 0.1)",
            traj[0.003][-1] < traj[0.003][0] - 0.1 and swing[0.003] < 0.1)
check.holds("gamma 0.05 > the gap: the load swings (the last 20 updates span > 0.3)", swing[0.05] > 0.3)
check.holds("the gap lies between the two gammas", 0.003 < gap3 < 0.05)

# %% [markdown]
# ## 4. The all-to-all: dispatch, combine, and the backward as the same calls with the counts swapped
#
# With expert parallelism the E experts are split over the ep ranks of `ep_comm`, E/ep each (expert e on ep rank
# e // (E/ep)). A rank's kept slots, sorted by expert, are contiguous runs per ep rank. `hsgd.ep.dispatch.AllToAll`
# (chapter 2's exercise 5, grown up) makes four calls per MoE block and micro-batch:
#
# | step | call | counts (send, recv) | what moves |
# |---|---|---|---|
# | forward: dispatch | `Alltoall` of the E counts, then `Alltoallv` of the rows | (row of M, column of M) | the S kept slots to their experts' ranks, R arrive |
# | forward: combine | `Alltoallv` | (column, row): swapped | the R outputs back, in the order they were sent |
# | backward of the combine | `Alltoallv` | (row, column): the dispatch's | the outputs' gradients to the experts |
# | backward of the dispatch | `Alltoallv` | (column, row): the combine's | the inputs' gradients back to their tokens |
#
# Each map only moves rows, so its adjoint is its inverse: the call with the counts swapped (chapter 2, section 7).
# The counts, integers, need no backward. Checked on 8 ranks, dp 8
# with ep 4: the MoE block of `hsgd.tp.experts` (N = 16 rows of C = 8 per rank, E = 8, k = 2, capacity factor 1.0)
# against the whole layer on each rank's rows, the adjoints as $\langle A x, y\rangle = \langle x, A^T y\rangle$
# summed over `ep_comm`, and the bytes against `all_to_all_formula`.

# %%
E4, C4, F4, N4 = 8, 8, 8, 16
cfg4 = ModelConfig(vocab_size=16, seq_len=N4, d_model=C4, n_heads=2, n_layers=1, d_ff=F4, arch="llama",
                   moe_experts=E4, moe_top_k=2, moe_capacity_factor=1.0, moe_balance=0.0)
S4 = cfg4.moe_settings()
p4, _, _ = layer(S4, C4, F4, N4, seed=4, prefix="h.0.moe")                  # the same on every rank
x4 = np.random.default_rng(100 + rank).normal(size=(N4, C4))                 # my rows
dy4 = np.random.default_rng(200 + rank).normal(size=(N4, C4))                # their output's gradient
g4 = ProcessGrid(world, dp=8, ep=4)
ep_comm = g4.ep_comm
y_ref, aux_ref, c_ref = moe_forward(x4, p4, S4, prefix="h.0.moe")            # every expert here, my rows
gr_ref = {n: np.zeros_like(a) for n, a in p4.items()}
dx_ref = moe_backward(dy4, {"balance": 1.0, "z": 1.0}, c_ref, gr_ref)

block = Experts(cfg4, g4.tp_comm, dispatcher=AllToAll(ep_comm, E4))          # the MoE block with the all-to-all
mine4 = {n: a for n, a in p4.items() if holds(n, cfg4, 4, g4.ep_rank)}       # the router and my E/ep experts
before = g4.stats.counts()
moe4 = block.new_pass(1, N4, np)
y4, cache4 = block.forward(x4[None], mine4, "h.0.moe", moe4, layers)   # (the plain layer functions)
moe4.finish()
gr4 = {n: np.zeros_like(a) for n, a in mine4.items()}
dm4, dx_router = block.backward(dy4[None], cache4, gr4, 1.0)
sent4 = {key: v for key, v in g4.stats.since(before).items() if key[0] == "ep"}
check("forward with the all-to-all == the whole layer on my rows", rel_err(y4[0], y_ref))
check("backward: dx == the whole layer's", rel_err((dm4 + dx_router)[0], dx_ref))
every = [n for n in sorted(p4) if ".experts." in n]                          # the same order on every rank
flat = ep_comm.Allreduce(np.concatenate([gr_ref[n].ravel() for n in every]))  # every expert: the group's shares
summed = dict(zip(every, np.split(flat, np.cumsum([gr_ref[n].size for n in every])[:-1])))
owned = [n for n in mine4 if ".experts." in n]
summed = {n: summed[n].reshape(gr_ref[n].shape) for n in owned}
check("my experts' gradients == the sum of the ep group's shares", max(rel_err(gr4[n], summed[n]) for n in owned))
check("the router's gradient == the whole layer's (my rows only)",
      rel_err(gr4["h.0.moe.router.weight"], gr_ref["h.0.moe.router.weight"]))

# %% [markdown]
# The adjoints on the dispatcher alone (`send` / `send_backward`, `receive` / `receive_backward`),
# inner products summed over `ep_comm`.

# %%
a2a = AllToAll(ep_comm, E4)
kept4 = moe4.aux["h.0.moe"]["kept"]                                          # (E,) my kept slots per expert
xs = np.random.default_rng(300 + rank).normal(size=(int(kept4.sum()), C4))   # (S, C) my slots, by expert
rows, got, plan = a2a.send(xs, kept4)                                         # (R, C) at my experts
u = np.random.default_rng(400 + rank).normal(size=rows.shape)               # (R, C)
w = np.random.default_rng(500 + rank).normal(size=xs.shape)                 # (S, C)
dots = np.array([np.vdot(rows, u), np.vdot(xs, a2a.send_backward(u, plan)),
                 np.vdot(a2a.receive(u, plan), w), np.vdot(u, a2a.receive_backward(w, plan))])
ep_comm.Allreduce(dots)                                                       # the sums over the ep group
check("dispatch: <A x, u> == <x, A^T u>, summed over ep_comm", abs(dots[0] - dots[1]) / abs(dots[0]))
check("combine:  <B u, w> == <u, B^T w>, summed over ep_comm", abs(dots[2] - dots[3]) / abs(dots[2]))
check.holds("the combine undoes the dispatch, bit for bit", np.array_equal(a2a.receive(rows, plan), xs))

# %% [markdown]
# The bytes on `ep_comm` against `all_to_all_formula` from the routing histogram: one `Alltoall` of the E int64
# counts and four `Alltoallv`, whose payload is the send buffer, own rows included: $(S + R) C s$ forward and as
# much backward. A pairwise all-to-all (MPICH's for long messages, chapter 2) keeps a rank's own rows: it sends
# $(S - S_{\text{own}}) C s$ in the dispatch and $(R - S_{\text{own}}) C s$ in the combine, as many again backward,
# plus (ep - 1)/ep of the counts.

# %%
hist = np.stack(ep_comm.allgather_obj(np.asarray(kept4)))                    # (ep, E) kept slots of each rank
check.equal("ep_comm calls and bytes == all_to_all_formula", sent4,
            all_to_all_formula(hist, g4.ep_rank, 4, E4, C4, 8, calls=1))
El = E4 // 4
S_r = hist.sum(axis=1)                                                        # (ep,) slots each rank sends
R_r = np.array([hist[:, j * El:(j + 1) * El].sum() for j in range(4)])       # (ep,) rows its experts receive
own = np.array([hist[j, j * El:(j + 1) * El].sum() for j in range(4)])       # (ep,) kept at home
say(f"ep group of rank 0, one block, forward + backward, C = {C4}, float64:")
say(f"{'ep rank':>8}{'S':>5}{'R':>5}{'own':>5}{'payload':>10}{'pairwise, sent':>16}")
for j in range(4):
    pay = 2 * (S_r[j] + R_r[j]) * C4 * 8 + E4 * 8
    pw = 2 * (S_r[j] + R_r[j] - 2 * own[j]) * C4 * 8 + (4 - 1) * E4 * 8 // 4
    say(f"{j:>8}{S_r[j]:>5}{R_r[j]:>5}{own[j]:>5}{pay:>10,}{pw:>16,}")
check.equal("every rank's payload == 2 (S + R) C s + E 8, from the histogram",
            sent4[("ep", "Alltoallv")][1] + sent4[("ep", "Alltoall")][1],
            int(2 * (S_r[g4.ep_rank] + R_r[g4.ep_rank]) * C4 * 8 + E4 * 8))
g4.free()

# %% [markdown]
# ## 5. Folding ep out of dp x cp
#
# Megatron-Core's parallel folding (Liu et al. 2025, "MoE Parallel Folding") takes the expert ranks from those
# that hold the same dense shard: of the D = dp x cp ranks of `dp_comm` (ordered dp_rank x cp + cp_rank), each ep
# consecutive ones form an `ep_comm` and split the experts; the ranks at the same place of every ep group hold the
# same experts and form an `edp_comm` of edp = D/ep ranks, which averages their gradients. Every expert is still
# split over tp as the dense MLP is. The picture: tp 2 x dp 4 with ep 2, and dp 4 x cp 2 with ep 4; each box a
# world rank, its colour its `ep_comm`, its label its experts of E = 8, a dotted line joining an `edp_comm`.
# Checked: `ProcessGrid`'s communicators hold exactly the ranks of that rule.

# %%
FOLDS = [dict(dp=4, tp=2, cp=1, ep=2), dict(dp=4, tp=1, cp=2, ep=4)]
folds = []
for lay in FOLDS:
    g = ProcessGrid(world, dp=lay["dp"], tp=lay["tp"], cp=lay["cp"], ep=lay["ep"])
    made = (sorted(g.ep_comm.allgather_obj(rank)), sorted(g.edp_comm.allgather_obj(rank)), g.ep_rank)
    by_rule_ep, by_rule_edp = [], []
    for t in range(lay["tp"]):
        dpc = [((d * lay["cp"] + c) * lay["tp"]) + t for d in range(lay["dp"]) for c in range(lay["cp"])]   # key order
        by_rule_ep += [dpc[i:i + lay["ep"]] for i in range(0, len(dpc), lay["ep"])]
        by_rule_edp += [dpc[i::lay["ep"]] for i in range(lay["ep"])]
    mine_ep = next(grp for grp in by_rule_ep if rank in grp)
    mine_edp = next(grp for grp in by_rule_edp if rank in grp)
    name = f"dp {lay['dp']} x cp {lay['cp']} x tp {lay['tp']}, ep {lay['ep']}"
    check.equal(f"{name}: ep_comm, edp_comm, ep_rank == the folding rule", made,
                (mine_ep, mine_edp, mine_ep.index(rank)))
    folds.append((lay, by_rule_ep, by_rule_edp))
    g.free()


def draw_folding():
    from matplotlib.patches import Rectangle
    fig, axes = pictures.figure(12, 3.4, ncols=2)
    for ax, (lay, eps, edps) in zip(axes, folds):
        D, tp_, epn, cp_ = lay["dp"] * lay["cp"], lay["tp"], lay["ep"], lay["cp"]
        pos = {}                                                   # world rank -> lower-left corner of its box
        for t in range(tp_):
            for q in range(D):                                     # q = dp_rank x cp + cp_rank: dp_comm's order
                pos[(q * tp_) + t] = (q * 1.4 + (q // epn) * 0.5, (tp_ - 1 - t) * 1.6)
        for gi, grp in enumerate(eps):
            for j, r in enumerate(grp):                            # j: the ep rank
                x0, y0 = pos[r]
                q = r // tp_
                ax.add_patch(Rectangle((x0, y0), 1.1, 1.0, fc=f"C{gi}", alpha=0.35, ec="black", lw=0.7))
                ax.text(x0 + 0.55, y0 + 0.74, f"rank {r}", ha="center", fontsize=7)
                if cp_ > 1:
                    ax.text(x0 + 0.55, y0 + 0.46, f"dp {q // cp_}, cp {q % cp_}", ha="center", fontsize=6)
                ax.text(x0 + 0.55, y0 + 0.16, f"experts {j * (8 // epn)}-{(j + 1) * (8 // epn) - 1}", ha="center",
                        fontsize=6)
        for grp in edps:
            if len(grp) > 1:
                j = next(g.index(grp[0]) for g in eps if grp[0] in g)       # the ep rank they share
                ax.plot([pos[r][0] + 0.3 + 0.5 * j / epn for r in grp], [pos[r][1] - 0.15 - 0.12 * j for r in grp],
                        ":", color="black", lw=1.0, marker=".")
        for t in range(tp_):
            ax.text(-0.3, (tp_ - 1 - t) * 1.6 + 0.5, f"tp rank {t}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-1.6, D * 1.4 + D // epn * 0.5)
        ax.set_ylim(-0.7, tp_ * 1.6)
        ax.axis("off")
        ax.set_title(f"dp {lay['dp']} x cp {cp_} x tp {tp_}, ep {epn}: boxes in dp_comm's order, colour: one ep_comm;"
                     f"\ndotted: one edp_comm ({D // epn} ranks holding the same experts)", fontsize=8)
    return pictures.save(fig, "16_folding")


say(f"picture: {pictures.on_rank0(world, draw_folding)}")

# %% [markdown]
# Left, each tp rank's four ranks of `dp_comm` form two `ep_comm` of two, and ranks 0 and 4 (and 2 and 6, and so
# for tp rank 1) hold the same four experts: an `edp_comm` of 2. Right, an `ep_comm` is two dp ranks times two cp
# ranks, and each `edp_comm` again has 8/4 = 2. With tp 2 x dp 4 and ep 4 (the CLI's `--ep 4`) each `edp_comm` is
# one rank: the all-to-all already brought every expert every token's share, and no average is needed.
#
# ## 6. Training with experts against serial SGD
#
# Llama blocks (C = 16, NH = 2, NKV = 1, L = 2, T = 16) whose MLPs are 8 SwiGLU experts (F = 16), top-2, capacity
# factor 1.0 (slots dropped), balance loss over micro-batches (alpha 0.1), z-loss (beta 0.01). Three layouts of 8
# ranks run three steps of SGD with momentum in float64: tp 2 x dp 4, ep 4, 2 micro-batches; dp 2 x cp 2 x tp 2,
# ep 4; pp 2 x tp 2 x dp 2, ep 2, 2 micro-batches. The reference is `serial.sgd` counted as each layout counts:
# balance over micro-batches of b = B/(dp m), and each rank's rows dropping with their own capacity
# (`hsgd.ep.layout.capacity_groups`). Checked: parameters and losses, the kept slots per expert in every step, and
# every communicator's calls and bytes against `step_formula`.

# %%
cfg = ModelConfig(**SIZES, moe_experts=8, moe_top_k=2, moe_capacity_factor=1.0, moe_balance=0.1, moe_z_loss=0.01)
STEPS = 3
LAYOUTS6 = [dict(dp=4, pp=1, cp=1, tp=2, ep=4, m=2), dict(dp=2, pp=1, cp=2, tp=2, ep=4, m=1),
            dict(dp=2, pp=2, cp=1, tp=2, ep=2, m=2)]


def config6(lay):
    return train_config(dp=lay["dp"], pp=lay["pp"], cp=lay["cp"], tp=lay["tp"], ep=lay["ep"],
                        micro_batches=lay["m"], steps=STEPS, batch_size=B, seed=SEED)


def serial_run(lay):
    """serial.sgd counted as the layout counts: (params, losses, routing per step)."""
    tc, state = config6(lay), {}
    groups = capacity_groups(B, SIZES["seq_len"], lay["dp"], lay["m"], lay["cp"])
    p, losses = serial.sgd(cfg, tc, lambda step: corpus.batch(SEED, step, B),
                           micro_sequences=B // (lay["dp"] * lay["m"]), capacity_groups=groups, moe_state=state)
    return p, losses, state["routing"]


def kept_total(trainer, grid):
    """{block: (E,) kept slots of the last step, summed over the ranks that route other rows (tp rank 0)}."""
    mine = {k: np.asarray(r["kept"]) for k, r in trainer.stage.routing.items()} if grid.tp_rank == 0 else {}
    total = {}
    for part in world.allgather(mine):
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


say(f"{'layout':<38}{'params':>9}{'losses':>9}{'dropped':>9}  rank 0's ep_comm payload, last step")
load6 = None
for lay in LAYOUTS6:
    ref, ref_losses, routing = pictures.on_rank0(world, lambda: serial_run(lay), share=True)
    tc = config6(lay)
    grid = ProcessGrid(world, dp=lay["dp"], pp=lay["pp"], tp=lay["tp"], cp=lay["cp"], ep=lay["ep"])
    trainer = HybridTrainer(cfg, grid, tc)
    losses, same_routing = [], True
    for step in range(1, STEPS + 1):
        before = grid.stats.counts()
        losses.append(trainer.step(*corpus.batch(SEED, step, B), step).loss)
        kept = kept_total(trainer, grid)
        same_routing &= all(np.array_equal(kept[k], routing[step - 1][k]["kept"]) for k in routing[step - 1])
    sent = grid.stats.since(before)
    trainer.finish()
    full = trainer.full_params()
    name = f"dp {lay['dp']} x pp {lay['pp']} x cp {lay['cp']} x tp {lay['tp']}, ep {lay['ep']}, m {lay['m']}"
    err = max(rel_err(full[n], ref[n], floor=0.02) for n in ref)
    loss_err = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    check(f"{name}: parameters vs serial", err)
    check(f"{name}: losses vs serial", loss_err)
    check.holds(f"{name}: kept slots per expert == serial's, every step", same_routing)
    check.equal(f"{name}: the step's calls and bytes, every comm == step_formula", sent,
                step_formula(cfg, tc, trainer))
    dropped = sum(int(r[k]["dropped"]) for r in routing for k in r)
    check.holds(f"{name}: slots were dropped ({dropped} in {STEPS} steps)", dropped > 0)
    on_ep = {key: v for key, v in sent.items() if key[0] == "ep"}
    if lay is LAYOUTS6[0]:                                   # the CLI's layout: its load, for section 8
        mine = {k: np.asarray(r["kept"]) for k, r in trainer.stage.routing.items()}
        load6 = (world.allgather((grid.dp_rank, grid.tp_rank, grid.ep_rank, mine)), on_ep)
    say(f"{name:<38}{err:>9.1e}{loss_err:>9.1e}{dropped:>9}  {sum(b for _, b in on_ep.values()):>8,} B")
    trainer.free()
    grid.free()

# %% [markdown]
# ## 7. The experts' gradient: 1/(dp cp), not 1/edp
#
# The step's loss is the mean of the D = dp x cp shards', so each gradient is 1/D times the sum of D contributions.
# A dense parameter gets one per rank of `dp_comm`: sum there, divide by D. An expert's owner already holds its ep
# group's sum, brought by the all-to-all; the sum over `edp_comm` completes the D contributions, and the factor is
# still 1/D. Dividing by edp, the size of the communicator summed over, as a generic data-parallel wrapper does,
# leaves every expert's gradient D/edp = ep times too large (`hsgd.dp.folded` cites the reports of this bug in
# PyTorch and Megatron-LM), and the step's loss, computed before any average, does not show it. Checked on dp 8
# with ep 4 (edp 2), averaged by hand both ways.

# %%
dp7, ep7 = 8, 4
tc7 = train_config(dp=dp7, ep=ep7, steps=1, batch_size=B, seed=SEED)
g7 = ProcessGrid(world, dp=dp7, ep=ep7)
tr7 = HybridTrainer(cfg, g7, tc7)
idx1, tg1 = corpus.batch(SEED, 1, B)
weights = tr7.exchange.model_weights()                                      # my shard: dense + my E/ep experts
local_g = {n: np.zeros_like(a) for n, a in weights.items()}
rows7, ctx = dp_rows(B, dp7, g7.dp_rank), tr7.stage.ctx
tr7.stage.run(weights, local_g, [(ctx.local(idx1[mb]), ctx.local(tg1[mb])) for mb in micro_batches(rows7, 1)])
right, wrong = {}, {}
for n, a in local_g.items():
    comm = g7.edp_comm if ".experts." in n else g7.dp_comm
    total = comm.Allreduce(a.copy())                                           # the contributions held alike
    right[n], wrong[n] = total / dp7, total / comm.size                        # 1/D, and a generic 1/(its size)


def serial_grads():
    moe = serial_pass(cfg, B, SIZES["seq_len"], np, micro_sequences=B // dp7,
                      capacity_groups=capacity_groups(B, SIZES["seq_len"], dp7, 1, 1))
    return serial.loss_and_grads(serial.init_params(cfg, seed=SEED, dtype="float64"), idx1, tg1, cfg, moe=moe)[1]


ref7 = pictures.on_rank0(world, serial_grads, share=True)
experts7 = [n for n in right if ".experts." in n]
check("1/D over dp_comm and edp_comm: every gradient == serial's", max(rel_err(right[n], ref7[n]) for n in right))
check("1/edp on the experts: == ep x serial's (the factor ep)", max(rel_err(wrong[n], ep7 * ref7[n]) for n in experts7))
check("1/edp only on edp_comm: the dense gradients (1/D over dp_comm) stay right",
      max(rel_err(wrong[n], ref7[n]) for n in right if n not in experts7))
loss7 = global_loss(tr7.gradients(idx1, tg1), g7)                          # steps 1-3 of the trainer's step
check("the trainer's own exchange (hsgd.dp.folded) == 1/D", max(rel_err(tr7.grads[n], right[n]) for n in right))
say(f"the step's loss {loss7:.6f} is computed before any average: the same with either; edp = "
    f"{g7.edp_comm.size}, so 1/edp = {dp7 // g7.edp_comm.size} x 1/D")

# %% [markdown]
# Why the bug hides: with Adam a constant factor nearly cancels ($m/\sqrt{v}$ is scale-free but for epsilon: the
# first step $\eta\, g/(|g| + \epsilon)$ changes by about $\frac{3}{4}\epsilon/|g|$ relative for a factor 4), so the
# run looks healthy while the gradient norm, the clipping and the weight decay's balance are off. One AdamW step
# from the right and the wrong gradient:

# %%
upd = {}
for which, grads in (("right", right), ("wrong", wrong)):
    pw = {n: weights[n].copy() for n in experts7}
    opt = make_optimizer("adamw", 1e-3)
    opt.step(pw, {n: grads[n].copy() for n in experts7})
    upd[which] = {n: pw[n] - weights[n] for n in experts7}
g_all = np.concatenate([right[n].ravel() for n in experts7])                  # (the right gradients)
u_r = np.concatenate([upd["right"][n].ravel() for n in experts7])
u_w = np.concatenate([upd["wrong"][n].ravel() for n in experts7])
big = np.abs(g_all) >= 1e-6                                                    # 100 x AdamW's eps
adam_gap = float(np.max(np.abs(u_w - u_r)[big] / np.abs(u_r[big])))
say(f"AdamW, one step: where |g| >= 1e-6 ({big.mean():.0%} of the experts' entries) the updates from the right "
    f"and the {ep7} times too large gradients differ by {adam_gap:.1e} relative at most; SGD's by a factor {ep7}")
check.holds("AdamW nearly hides the factor ep: within 1% wherever |g| >= 100 eps", adam_gap < 1e-2)
tr7.free()
g7.free()

# %% [markdown]
# ## 8. The load per expert and per rank, and the bytes on `ep_comm`
#
# The last step of section 6's first layout (`ep_comm` = the four dp ranks of one tp rank, experts 2j and 2j + 1 on
# ep rank j): each rank's kept slots per expert in block 0, over its two micro-batches. A row sums to what the rank
# sends, S; its experts' column block to what it receives, R; diagonal blocks stay home. A cell holds at most twice
# the capacity (printed below). The busiest rank sets the all-to-all's time (chapter 2: about $(p-1)\alpha + \beta
# \max_r \max(\text{out}_r, \text{in}_r)$), and its experts' matmuls too. The table gives each rank's payload and
# what a pairwise all-to-all sends from it.

# %%
parts, on_ep0 = load6


def histogram(t):
    """{block: (ep, E) kept slots of each rank of tp rank t's ep group}, and (S, R, own) (ep,) over both blocks."""
    ranks = sorted((p for p in parts if p[1] == t), key=lambda q: q[2])      # (dp_rank, tp_rank, ep_rank, kept)
    hist = {blk: np.stack([q[3][blk] for q in ranks]) for blk in ranks[0][3]}
    S = sum(h.sum(axis=1) for h in hist.values())                           # (ep,) slots each rank sends
    R = sum(np.array([h[:, 2 * j:2 * j + 2].sum() for j in range(4)]) for h in hist.values())   # its experts get
    own = sum(np.array([h[j, 2 * j:2 * j + 2].sum() for j in range(4)]) for h in hist.values())  # stay home
    return hist, S, R, own


hist6, S6, R6, own6 = histogram(0)
H6 = hist6["h.0.moe"]                                                        # (ep rank, expert), block 0
C6, itemsize, calls = SIZES["d_model"], 8, 2 * len(hist6)                    # 2 micro-batches x 2 blocks
say(f"step {STEPS}, both MoE blocks, tp rank 0's ep group (C = {C6}, float64):")
say(f"{'ep rank':>8}{'S':>6}{'R':>6}{'own':>6}{'payload':>11}{'pairwise, sent':>16}")
for j in range(4):
    pay = 2 * (S6[j] + R6[j]) * C6 * itemsize + calls * 8 * 8
    pw = 2 * (S6[j] + R6[j] - 2 * own6[j]) * C6 * itemsize + calls * 8 * 8 * 3 // 4
    say(f"{j:>8}{S6[j]:>6}{R6[j]:>6}{own6[j]:>6}{pay:>11,}{pw:>16,}")
_, S_t, R_t, _ = histogram(rank % 2)                                         # my tp rank's group (tp fastest)
me = [q for q in parts if q[0] == rank // 2 and q[1] == rank % 2][0][2]      # my ep rank
check.equal("every rank's measured ep_comm step == 2 (S + R) C s + calls E 8 from the histogram",
            sum(b for _, b in on_ep0.values()), int(2 * (S_t[me] + R_t[me]) * C6 * itemsize + calls * 8 * 8))
cap6 = expert_capacity(B // (4 * 2) * SIZES["seq_len"], cfg.moe_settings())   # of one micro-batch's N = b T rows
say(f"capacity {cap6} slots per expert and micro-batch: a cell of {2 * cap6} is an expert full in both micro-batches "
    f"({int((H6 == 2 * cap6).sum())} of {H6.size} cells in block 0)")
check.holds("no cell above the step's capacity (2 micro-batches x capacity)", int(H6.max()) <= 2 * cap6)
busiest = int(np.argmax(np.maximum(S6 - own6, R6 - own6)))
say(f"busiest rank: ep rank {busiest}, {max(S6[busiest] - own6[busiest], R6[busiest] - own6[busiest])} rows out "
    f"or in, against {(S6 - own6).mean():.1f} on average")


def draw_load():
    from matplotlib.patches import Rectangle
    fig, (ax, ax2) = pictures.figure(10, 3.4, ncols=2, gridspec_kw={"width_ratios": [1.4, 1]})
    im = ax.imshow(H6, cmap="Oranges", aspect="auto")
    for j in range(4):
        for e in range(8):
            ax.text(e, j, str(H6[j, e]), ha="center", va="center", fontsize=8)
        ax.add_patch(Rectangle((2 * j - 0.5, j - 0.5), 2, 1, fill=False, ec="black", lw=1.5))
    for e in range(1, 4):
        ax.axvline(2 * e - 0.5, color="0.4", lw=0.6)
    ax.set_xticks(range(8), [f"{e}\n(r{e // 2})" for e in range(8)], fontsize=7)
    ax.set_yticks(range(4), [f"ep rank {j}" for j in range(4)], fontsize=7)
    ax.set_xlabel("expert (its ep rank)", fontsize=8)
    ax.set_title(f"block 0, step {STEPS}: slots kept per sending rank and expert;\nboxed: kept at home", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.04)
    xx = np.arange(4)
    ax2.bar(xx - 0.2, S6 - own6, 0.4, label="sent away (S - own)")
    ax2.bar(xx + 0.2, R6 - own6, 0.4, label="received (R - own)")
    ax2.bar(xx - 0.2, own6, 0.4, bottom=S6 - own6, color="0.8", label="own (stays home)")
    ax2.bar(xx + 0.2, own6, 0.4, bottom=R6 - own6, color="0.8")
    ax2.set_xticks(xx, [f"ep rank {j}" for j in range(4)], fontsize=7)
    ax2.set_ylabel("rows, both blocks, fwd", fontsize=8)
    ax2.set_title("each rank's dispatch: rows out and in", fontsize=8)
    ax2.legend(fontsize=7, frameon=False)
    return pictures.save(fig, "16_load")


say(f"picture: {pictures.on_rank0(world, draw_load)}")

# %% [markdown]
# ## 9. Routing over a run
#
# A 20-step run of the CLI above (alpha 0.01, SGD at lr 0.05, momentum 0.9) reports a load far from even: for
# stretches of steps two experts take nearly every token of a block, then two more. The runs here are serial
# SGD, which every layout reproduces (section 6):
# 60 steps at the CLI's schedule (warm-up to 0.05 over 20 steps, cosine decay to a tenth), no capacity, four
# settings: alpha 0.01 (the CLI's), alpha 0.1, and the selection bias alone at gamma 0.001 (DeepSeek-V3's rate) and
# 0.01. The measure per step and block: the busiest expert's slots over an even share, max/even, from 1 to E/k = 4.

# %%
SETTINGS9 = {"alpha 0.01 (the CLI's)": (0.01, 0.0), "alpha 0.1": (0.1, 0.0), "bias 0.001": (0.0, 0.001),
             "bias 0.01": (0.0, 0.01)}
STEPS9, LR9, WARM9 = 60, 0.05, 20


def run9():
    """{setting: (steps, blocks) max/even}, and the median gap between a token's 2nd and 3rd score at step 1 (the
    mean over the blocks)."""
    out = {}
    for name, (alpha, gamma) in SETTINGS9.items():
        c9 = ModelConfig(**SIZES, moe_experts=8, moe_top_k=2, moe_balance=alpha, moe_bias_rate=gamma)
        tc9 = train_config(steps=STEPS9, batch_size=B, lr=LR9, warmup=WARM9, seed=SEED)
        state = {}
        serial.sgd(c9, tc9, lambda step: corpus.batch(SEED, step, B), moe_state=state)
        out[name] = np.array([[r[k]["load"].max() / r[k]["load"].mean() for k in sorted(r)] for r in state["routing"]])
    c9 = ModelConfig(**SIZES, moe_experts=8, moe_top_k=2)
    _, caches = serial.forward(serial.init_params(c9, seed=SEED, dtype="float64"), idx, c9)
    gaps = []
    for c in caches[1]:
        srt = -np.sort(-c[-1][1][1][1], axis=1)                              # (N, E) block's router scores, sorted
        gaps.append(float(np.median(srt[:, 1] - srt[:, 2])))                 # a token's 2nd over its 3rd
    return out, float(np.mean(gaps))


ratio9, gap9 = pictures.on_rank0(world, run9, share=True)
say(f"{'max/even, steps 21-60':<24}{'block 0: mean, max':>20}{'block 1: mean, max':>20}")
mean9 = {}
for name, r in ratio9.items():
    tail = r[WARM9:]
    mean9[name] = tail.mean(axis=0)                                           # (blocks,)
    say(f"{name:<24}{tail[:, 0].mean():>12.2f}{tail[:, 0].max():>8.2f}{tail[:, 1].mean():>12.2f}"
        f"{tail[:, 1].max():>8.2f}")
say(f"at the initial parameters the median gap between a token's 2nd and 3rd score is {gap9:.4f} (mean over "
    f"the blocks)")
cli = ratio9["alpha 0.01 (the CLI's)"]
check.holds("the CLI's settings: a block reaches max/even >= 3.5 (one expert in nearly every token's top 2)",
            cli.max() >= 3.5)
check.holds("alpha 0.1 does not prevent it: a block reaches max/even >= 3.5", ratio9["alpha 0.1"].max() >= 3.5)
check.holds("bias 0.001: the lowest mean max/even of the four, steps 21-60, each block",
            all(mean9["bias 0.001"][b] == min(m[b] for m in mean9.values()) for b in range(2)))
check.holds("bias 0.01: the highest mean max/even of the four, steps 21-60, each block",
            all(mean9["bias 0.01"][b] == max(m[b] for m in mean9.values()) for b in range(2)))
check.holds("the median gap at the top-2 boundary lies between gamma 0.001 and gamma 0.01", 0.001 < gap9 < 0.01)
peak, late = cli[10:30].mean(axis=0), cli[45:].mean(axis=0)                  # steps 11-30 and 46-60
say(f"the CLI's settings, mean max/even per block: steps 11-30 (lr near its peak) {peak.round(2).tolist()}, steps "
    f"46-60 (lr decayed) {late.round(2).tolist()}")
check.holds("the CLI's settings: the load is further from even near the peak lr than late, each block",
            all(peak > late))


def draw_collapse():
    from hsgd.model.optim import lr_at
    fig, axes = pictures.figure(11, 3.6, ncols=2, sharey=True)
    for b, ax in enumerate(axes):
        for name, r in ratio9.items():
            ax.plot(range(1, STEPS9 + 1), r[:, b], lw=1.0, label=name)
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        ax.axhline(4.0, color="black", lw=0.6, ls=":")
        lr_ax = ax.twinx()
        lr_ax.fill_between(range(1, STEPS9 + 1), [lr_at(t, LR9, WARM9, STEPS9) for t in range(1, STEPS9 + 1)],
                           color="0.85", zorder=0, lw=0)
        lr_ax.set_ylim(0, 3 * LR9)
        lr_ax.set_yticks([0, LR9], ["0", f"lr {LR9}"], fontsize=7)
        ax.set_zorder(lr_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.set_xlabel("step", fontsize=8)
        ax.set_title(f"block {b}: busiest expert / even share (1: even, 4: in every token's top 2);\ngrey: the "
                     f"learning rate", fontsize=8)
    axes[0].set_ylabel("max / even", fontsize=8)
    axes[0].legend(fontsize=7, frameon=False, loc="upper left", ncol=2)
    axes[0].set_ylim(0.8, 4.6)
    return pictures.save(fig, "16_collapse")


say(f"picture: {pictures.on_rank0(world, draw_collapse)}")

# %% [markdown]
# At the CLI's settings the load drifts to one expert per block (max/even near 4), mostly while the learning rate
# is near its peak, easing as it decays; a ten times larger alpha does not prevent it. The selection bias shows the
# mechanism of section 3: at gamma 0.01, above the typical gap between a token's 2nd and 3rd score (printed above),
# the tokens jump together and the load at the worst expert swings for the whole run; at gamma 0.001, below it, the load
# stays closest to even of the four, though not near 1. The router's own SGD step moves all alike-looking tokens
# the same way, so the drift follows the learning rate. Balancing is a control loop whose gain (alpha, gamma) must
# match how fast the router moves: a 60-step run of a tiny model shows the mechanism, not a large run's settings.

# %%
worst, err = check.worst()
say(f"\nchapter 16: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error "
    f"{err:.1e} ({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Megatron-LM's flags (megatron/training/arguments.py) and `megatron/core/transformer/moe/`; DeepSpeed-MoE's
# `deepspeed.moe.layer.MoE` and `deepspeed/moe/sharded_moe.py`; torchtitan's configuration and its MoE layer
# (`MoE.Config`, formerly `MoEArgs`, in torchtitan/models/common/moe.py).
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch (torchtitan) | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `--moe-experts E`, `--moe-top-k k`, `--moe-every n` | `--num-experts`, `--moe-router-topk`, `--moe-layer-freq` | `MoE(num_experts=..., k=...)` | `num_experts`, the router's `top_k` | experts replace the MLP of blocks 0, n, 2n, ...; no shared experts |
# | `--ep` (`ep_comm`, `edp_comm` folded out of dp x cp: `hsgd.ep.layout`, `ProcessGrid`) | `--expert-model-parallel-size` (and `--expert-tensor-parallel-size`: parallel folding) | `MoE(ep_size=...)`: expert-parallel groups carved out of the data-parallel ranks | `parallelism.expert_parallel_degree` (EP borrows ranks from FSDP and TP) | each expert split over the dense tp, never its own tp size |
# | `--moe-capacity-factor c`, drops in token order (`dispatch_indices`) | `--moe-expert-capacity-factor`, `--moe-token-drop-policy probs` (default) or `position`, `--moe-pad-expert-input-to-capacity` | `capacity_factor`, `eval_capacity_factor`, `min_capacity`, `drop_tokens` | dropless (no capacity) | position only; no padding, no minimum |
# | `--moe-balance alpha`, `--moe-balance-domain micro-batch \| sequence \| global`, `--moe-balance-layers each \| pooled` | `--moe-aux-loss-coeff`, `--moe-router-load-balancing-type aux_loss \| seq_aux_loss \| global_aux_loss` | the gate's `l_aux` (per forward call, a micro-batch), which the caller scales and adds | no balance loss; its `load_balance_coeff` is the selection bias's rate | the domain is a flag, exact in every layout that can count it; "pooled" is Hugging Face's Mixtral |
# | `--moe-z-loss beta` | `--moe-z-loss-coeff` | none | none | |
# | `--moe-bias-rate gamma` (`update_selection_bias` after each step, by the load summed over `dp_comm`) | `--moe-router-enable-expert-bias --moe-router-bias-update-rate` | none | `load_balance_coeff` (the expert bias, updated by the sign of the load's error, then centred) | the plain sign update, not centred; the bias never enters a gate, in all three |
# | `hsgd.ep.dispatch.AllToAll`: `Alltoall` of counts, `Alltoallv` of rows, explicit permutation | `--moe-token-dispatcher-type alltoall` (or `allgather`, `flex`) | `_AllToAll` in `sharded_moe.py` (padded to the capacity) | all-to-all token dispatch for expert parallelism | uneven rows (`Alltoallv`), no padding; the adjoints written out |
# | `hsgd.dp.folded`: experts averaged over `edp_comm` with 1/(dp cp) | expert gradients reduced over the expert data-parallel group | expert parameters all-reduced over the expert data-parallel group | FSDP over the expert data-parallel mesh | the factor stated and checked (section 7) |
#
# ## Exercises
#
# ### Exercise 1: balanced globally, not per micro-batch
# Route 4 micro-batches of 16 tokens over E = 4 experts (top-1), micro-batch j all to expert j (probability 0.7
# there, 0.1 elsewhere). Compute the Switch loss by hand over the global batch and over micro-batches, check both
# against `hsgd.model.balance.Balance` with the right `Domain`, and that the global loss is alpha while the
# micro-batch loss is 2.8 alpha. Which one's gradient asks for a change?
# (solution: `tutorials/solutions/16_experts.py`, `exercise_1`)
#
# ### Exercise 2: the drops by hand, and the capacity factor that drops nothing
# Write section 2's queue as a loop, compare it with `dispatch_indices` on random choices (N = 40, E = 8, k = 2)
# for capacity factors from 0.5 to 4, and check that the drops are sum max(load - capacity, 0). Then check that
# c = E max_i(load_i) / (N k) drops nothing and a factor just under E (max_i(load_i) - 1) / (N k) drops a slot:
# the capacity follows the busiest expert, not the average.
# (solution: `tutorials/solutions/16_experts.py`, `exercise_2`)
#
# ### Exercise 3: the bias as a control loop
# On section 3's fixed router, iterate the selection-bias update 80 times for six gammas from 0.001 to 0.3. Check
# that the bias changes the gates only through the choice, and, against the median gap between a token's 2nd and
# 3rd score, that every gamma below a third of it ends smoothly (the last 20 updates' max/even within 0.1) and
# every gamma above twice it swings (spanning more than 0.3).
# (solution: `tutorials/solutions/16_experts.py`, `exercise_3`)
#
# ### Exercise 4: Mixtral's all-to-all
# Mixtral 8x7B (`hsgd.plan.models.MIXTRAL`: C = 4096, F = 14336, E = 8, k = 2, 32 MoE blocks), one sequence of
# 4096 tokens per rank and micro-batch, bfloat16, ep = 8, uniform routing: compute one rank's all-to-all payload
# per MoE block and micro-batch with `all_to_all_formula`, check it against 2 (S + R) C s + 8 E by hand and that a
# pairwise all-to-all sends 7/8 of the rows' bytes. Per step of 8 micro-batches, compare it with the bytes of the
# experts the rank holds (`hsgd.ep.layout.holds`).
# (solution: `tutorials/solutions/16_experts.py`, `exercise_4`)
