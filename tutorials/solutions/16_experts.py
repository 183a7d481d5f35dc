"""Solutions to the exercises of chapter 16 (tutorials/16_experts.py).

    python tutorials/solutions/16_experts.py

One process, float64, tiny arrays (exercise 4 only counts, from shapes and a routing histogram). Every check
compares with hsgd, a hand computation or a formula, and stops (non-zero exit) at the first one that fails.
"""
import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

from hsgd.ep.dispatch import all_to_all_formula
from hsgd.ep.layout import expert_of, holds
from hsgd.model.balance import Balance, Domain
from hsgd.model.moe import (MoESettings, dispatch_indices, expert_capacity, moe_forward, moe_param_shapes, softmax,
                            update_selection_bias)
from hsgd.plan.models import MIXTRAL

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks
from checks import Checks, rel_err, solve  # noqa: E402

threadpool_limits(1)


# ------------------------------------------------------------------------------------------------------------ 1
def switch_loss(probs, chosen, groups, alpha, E, k):
    """alpha E mean_G sum_i f_Gi P_Gi by hand: f_Gi the share of G's slots routed to i, P_Gi G's mean probability."""
    total = 0.0
    for G in groups:
        f = np.bincount(chosen[G].reshape(-1), minlength=E) / (len(G) * k)    # (E,)
        P = probs[G].mean(axis=0)                                             # (E,)
        total += alpha * E * float(f @ P)
    return total / len(groups)


def exercise_1(check):
    """Balanced globally, not per micro-batch."""
    E, k, n, alpha = 4, 1, 16, 0.1
    chosen = np.repeat(np.arange(E), n)[:, None]                              # (N, 1) micro-batch j -> expert j
    probs = np.full((E * n, E), 0.1)
    probs[np.arange(E * n), chosen[:, 0]] = 0.7                               # (N, E) rows sum to 1
    micro = [np.arange(j * n, (j + 1) * n) for j in range(E)]
    whole = [np.arange(E * n)]
    by_hand = {"global": switch_loss(probs, chosen, whole, alpha, E, k),
               "micro-batch": switch_loss(probs, chosen, micro, alpha, E, k)}
    domains = {"global": Domain(whole, [E * n], 1), "micro-batch": Domain(micro, [n] * E, E)}
    bal = {}
    for name, dom in domains.items():
        bal[name] = Balance(alpha, E, k, dom)
        bal[name].add("block", probs, chosen)
        value = float(bal[name].finish())
        check(f"{name}: Balance == the loss by hand", abs(value - by_hand[name]) / by_hand[name], 1e-14)
    check("global: the loss is alpha (f = P = 1/E)", abs(by_hand["global"] - alpha) / alpha, 1e-14)
    check("micro-batch: the loss is 2.8 alpha (alpha E x 0.7)", abs(by_hand["micro-batch"] - 2.8 * alpha) / alpha,
          1e-14)
    # the gradient on the logits: the softmax's Jacobian applied to dbalance/dp
    dlog = {}
    for name, b in bal.items():
        dp = b.dprobs("block", 1.0, E * n)                                    # (N, E)
        dlog[name] = probs * (dp - (dp * probs).sum(axis=1, keepdims=True))   # (N, E)
    check("global: uniform f pushes every probability alike, the logits' gradient is 0",
          float(np.abs(dlog["global"]).max()), 1e-15)
    check.holds("micro-batch: the logits' gradient asks each micro-batch to spread its tokens",
                float(np.abs(dlog["micro-batch"]).max()) > 1e-3)
    check.say(f"  global {by_hand['global']:.4f}, micro-batch {by_hand['micro-batch']:.4f}; max |d/dlogits|: "
              f"global {np.abs(dlog['global']).max():.1e}, micro-batch {np.abs(dlog['micro-batch']).max():.1e}")


# ------------------------------------------------------------------------------------------------------------ 2
def queue_by_hand(chosen, E, capacity):
    """The kept slots n k + j, first come first served: tokens in order, each token's choices in order."""
    N, k = chosen.shape
    taken, kept = [0] * E, []
    for n in range(N):
        for j in range(k):
            e = int(chosen[n, j])
            if taken[e] < capacity:
                kept.append(n * k + j)
            taken[e] += 1
    return kept


def exercise_2(check):
    """The drops by hand, and the capacity factor that drops nothing."""
    N, E, k = 40, 8, 2
    rng = np.random.default_rng(2)
    chosen = np.argsort(-rng.normal(size=(N, E)) - np.linspace(0, 1.5, E), axis=1)[:, :k]   # skewed toward 0
    load = np.bincount(chosen.reshape(-1), minlength=E)
    same, counts = True, True
    for c in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0):
        cap = expert_capacity(N, MoESettings(experts=E, top_k=k, capacity_factor=c))
        perm, _, _, kept = dispatch_indices(chosen, E, cap)
        same &= sorted(perm.tolist()) == queue_by_hand(chosen, E, cap)
        counts &= N * k - len(perm) == int(np.maximum(load - cap, 0).sum())
    check.holds("dispatch_indices == the queue by hand, 8 capacity factors", same)
    check.holds("dropped == sum max(load - capacity, 0), every factor", counts)
    enough = E * load.max() / (N * k)
    short = 0.999 * E * (load.max() - 1) / (N * k)
    drops = {}
    for name, c in (("enough", enough), ("short", short)):
        cap = expert_capacity(N, MoESettings(experts=E, top_k=k, capacity_factor=c))
        drops[name] = N * k - len(dispatch_indices(chosen, E, cap)[0])
    check.say(f"  load {load.tolist()} (max {load.max()}, mean {load.mean():.0f}): c = {enough:.2f} drops "
              f"{drops['enough']}, c = {short:.3f} drops {drops['short']}")
    check.equal("c = E max(load) / (N k): nothing dropped", drops["enough"], 0)
    check.holds("c just under E (max(load) - 1) / (N k): something dropped", drops["short"] >= 1)


# ------------------------------------------------------------------------------------------------------------ 3
def skewed_layer():
    """Chapter 16's section 3 layer: (params, x (256, 6)) with a common direction in x."""
    settings = MoESettings(experts=4, top_k=2, mlp="swiglu")
    r = np.random.default_rng(3)
    shapes = moe_param_shapes("moe", 6, 8, 4, "swiglu")
    params = {n: r.normal(0.0, 1.0 if "router" in n else 0.4, s) for n, s in shapes.items()}
    x = r.normal(0.0, 1.0, (256, 6))
    return settings, params, x + 2.0 * np.random.default_rng(0).normal(size=6)


def exercise_3(check):
    """The bias as a control loop."""
    settings, params, x = skewed_layer()
    probs = softmax(x @ params["moe.router.weight"])                          # (N, E), no bias
    srt = -np.sort(-probs, axis=1)
    gap = float(np.median(srt[:, 1] - srt[:, 2]))
    gates_ok, swings = True, {}
    for gamma in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3):
        bias, ratios = np.zeros(4), []
        for _ in range(80):
            _, aux, cache = moe_forward(x, params, settings, selection_bias=bias)
            chosen, gates = cache[1][3], cache[3]                             # the choice (with the bias), gates
            pc = np.take_along_axis(probs, chosen, axis=1)
            gates_ok &= rel_err(gates, pc / pc.sum(axis=1, keepdims=True)) < 1e-14
            ratios.append(float(aux["load"].max() / aux["load"].mean()))
            bias = update_selection_bias(bias, aux["load"], gamma)
        swings[gamma] = float(np.ptp(ratios[-20:]))
        check.say(f"  gamma {gamma:<6}: max/even from {ratios[0]:.2f}, last 20 between {min(ratios[-20:]):.2f} and "
                  f"{max(ratios[-20:]):.2f}")
    check.say(f"  median gap between a token's 2nd and 3rd score: {gap:.4f}")
    check.holds("the gates never see the bias (the chosen probabilities, renormalized)", gates_ok)
    small = [g for g in swings if g < gap / 3]
    large = [g for g in swings if g > 2 * gap]
    check.holds(f"gamma < gap/3 ({small}): smooth, the last 20 within 0.1", small and all(swings[g] < 0.1
                                                                                           for g in small))
    check.holds(f"gamma > 2 gap ({large}): swings, the last 20 span > 0.3", large and all(swings[g] > 0.3
                                                                                          for g in large))


# ------------------------------------------------------------------------------------------------------------ 4
def exercise_4(check):
    """Mixtral's all-to-all."""
    cfg, ep, s, T, m = MIXTRAL, 8, 2, 4096, 8                                 # bfloat16: 2 bytes
    E, k, C = cfg.moe_experts, cfg.moe_top_k, cfg.d_model
    N = T                                                                     # one sequence per micro-batch
    kept = np.full((ep, E), N * k // E)                                       # (ep, E) uniform routing
    f = all_to_all_formula(kept, 0, ep, E, C, s, calls=1)
    S = R = N * k                                                             # sent, received rows of rank 0
    own = N * k // ep                                                         # kept at home (its E/ep experts)
    check.equal("all_to_all_formula == 1 x 8E counts, 4 x 2 (S + R) C s rows", f,
                {("ep", "Alltoall"): (1, 8 * E), ("ep", "Alltoallv"): (4, 2 * (S + R) * C * s)})
    rows = 2 * (S + R) * C * s
    pairwise = 2 * (S + R - 2 * own) * C * s
    check.equal("pairwise: 7/8 of the rows' bytes leave the rank", pairwise * 8, rows * 7)
    blocks = len(cfg.moe_layers())
    step = m * blocks * (rows + 8 * E)
    experts = sum(int(np.prod(shape)) for name, shape in cfg.param_shapes().items()
                  if expert_of(name) is not None and holds(name, cfg, ep, 0)) * s
    check.equal("the rank's experts: 32 blocks x 1 expert x 3 C F bf16", experts, blocks * 3 * C * cfg.d_ff * s)
    check.say(f"  per MoE block and micro-batch: payload {rows / 2**20:.0f} MiB of rows (+ {8 * E} B of counts), "
              f"{pairwise / 2**20:.0f} MiB sent by a pairwise all-to-all; per step ({m} micro-batches, {blocks} "
              f"blocks) {step / 2**30:.1f} GiB, against {experts / 2**30:.1f} GiB of the rank's experts "
              f"({step / experts:.1f}x)")
    check.holds("per step the all-to-all moves more than the rank's expert weights", step > experts)


if __name__ == "__main__":
    check = Checks(tol=1e-12, width=72)
    solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
