"""Solutions to the exercises of chapter 17 (tutorials/17_choosing_a_layout.py).

    python tutorials/solutions/17_choosing_a_layout.py

One process: every exercise prices layouts with the planner (no arrays, no messages) and checks its numbers
against formulas written by hand.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, solve  # noqa: E402

from hsgd.plan.__main__ import presets  # noqa: E402
from hsgd.plan.costs import makespan  # noqa: E402
from hsgd.plan.hardware import load  # noqa: E402
from hsgd.plan.search import HEADROOM, Layout, evaluate  # noqa: E402

HW = load("a100-80g")
GB = 1e9


def rel(a, b):
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------------------------------- exercise 1

def exercise_1(check):
    """A layer's tensor-parallel traffic by hand (145.6 B, t = 8, Megatron's scheme)."""
    cfg = presets()["narayanan-145.6b"]
    T, C, s, t, m, L, p = cfg.seq_len, cfg.d_model, 2, 8, 96, cfg.n_layers, 8
    n = 1 * T * C * s                                           # one All-Reduce's payload: (b T, C) in 16 bits
    per_layer = 4 * n                                           # 2 in the forward (g), 2 in the backward (f)
    check.say(f"  one layer, one micro-batch: 4 All-Reduces of {n / 1e6:.1f} MB = {per_layer / 1e6:.1f} MB payload, "
              f"{2 * (t - 1) / t * per_layer / 1e6:.1f} MB on the ring per rank")
    for rc, per in (("none", 4), ("full", 6)):                  # full recomputation repeats the forward's 2
        lay = Layout(dp=24, pp=p, tp=t, m=m, b=1, tp_scheme="megatron", recompute=rc)
        got = evaluate(cfg, 2304, lay, HW).bytes[p // 2][("tp", "Allreduce")]      # a middle stage: blocks only
        want = (per * (L // p) * m, per * (L // p) * m * n)
        check.say(f"  recompute {rc}: {want[0]} All-Reduces, {want[1] / GB:.1f} GB payload and "
                  f"{2 * (t - 1) / t * want[1] / GB:.1f} GB on the ring per rank and step")
        check.equal(f"recompute {rc}: the planner's tp bytes of a middle stage = {per} L/p m b T C s", got, want)


# ---------------------------------------------------------------------------------------------------- exercise 2

def exercise_2(check):
    """The smallest pp that fits (310.1 B on 1920 GPUs, t = 8)."""
    cfg = presets()["narayanan-310.1b"]
    L, C, T, V, B, N, t = cfg.n_layers, cfg.d_model, cfg.seq_len, cfg.vocab_size, 2160, 1920, 8
    # p divides N/t = 240, the tensor-parallel groups (so that dp = N/(t p) is whole), and the L layers; dp divides B
    cands = [p for p in range(1, L + 1) if (N // t) % p == 0 and L % p == 0 and B % (N // t // p) == 0]
    by_hand, planned, worst = {}, {}, 0.0
    for p in cands:
        psi = L // p * ((12 * C * C + 7 * C) / t + 6 * C) + V * C / t + T * C + (V * C / t + 2 * C if p == 1 else 0)
        acts = L * 34 * T * C / t + (4 * T * -(-V // t) if p == 1 else 0)        # b = 1; p = 1 also the logits
        by_hand[p] = 16 * psi + acts
        dp = N // (t * p)
        e = evaluate(cfg, B, Layout(dp=dp, pp=p, tp=t, m=B // dp, tp_scheme="sequence", recompute="selective"), HW)
        planned[p] = e.fits
        if e.stage == 0:
            worst = max(worst, rel(sum(e.memory.values()), by_hand[p]))
    check.say("  p: stage 0 by hand (GB) " + ", ".join(f"{p}: {by_hand[p] / GB:.0f}" for p in cands))
    check("stage 0's memory by hand = the planner's (16 Psi_0 + L 34 T b C / t)", worst, 1e-12)
    hand_p = min(p for p in cands if by_hand[p] <= HW.memory_bytes * (1 - HEADROOM))   # 10% kept free
    plan_p = min(p for p in cands if planned[p])
    check.say(f"  the smallest p that fits, selective recomputation: {hand_p} by hand, {plan_p} by the planner")
    check.equal("the smallest p that fits: by hand = the planner", hand_p, plan_p)
    full = [p for p in cands if evaluate(cfg, B, Layout(dp=N // (t * p), pp=p, tp=t, m=B // (N // (t * p)),
                                                        tp_scheme="sequence", recompute="full"), HW).fits]
    check.say(f"  with full recomputation: {min(full)} (Table 1 ran this model at p = 16)")
    check.holds("full recomputation fits at a p no larger than selective's", min(full) <= plan_p)


# ---------------------------------------------------------------------------------------------------- exercise 3

def exercise_3(check):
    """Where a bigger micro-batch starts and stops paying: a roofline for each product.

    The 145.6 B model's shapes at t = 8, p = 8, short sequences of T = 64 tokens, 96 sequences per replica, bfloat16
    on an A100."""
    cfg = presets()["narayanan-145.6b"]
    C, F, t, p, L, T, per_replica, s = cfg.d_model, 4 * cfg.d_model, 8, 8, cfg.n_layers, 64, 96, 2
    peak, bw = HW.peak_flops["bfloat16"], HW.memory_bandwidth
    ridge = peak / bw                                            # FLOPs per byte where the roofline bends
    products = ((C, 3 * C // t), (C // t, C), (C, F // t), (F // t, C))     # (K, N) of qkv, proj, fc1, fc2

    def intensity(M, K, N):                                      # 2 M K N FLOPs over s (M K + K N + M N) bytes
        return 2 * M * K * N / (s * (M * K + K * N + M * N))

    def stage_time(b):                                           # one micro-batch, forward + backward (3 products)
        M = b * T
        return 3 * (L // p) * sum(max(2 * M * K * N / peak, s * (M * K + K * N + M * N) / bw) for K, N in products)

    K, N = products[0]
    cross = ridge * K * N / (K * N - ridge * (K + N))            # intensity(M) = ridge, solved for M
    check("the qkv product's intensity at M = the crossing equals the ridge", rel(intensity(cross, K, N), ridge), 1e-12)
    check.holds("small M: intensity ~ M (the weights' bytes dominate)", abs(intensity(T, K, N) / T - 1) < 0.05)
    rows = {}
    for b in (1, 2, 4, 8, 16):
        m = per_replica // b
        one = stage_time(b)
        useful = 3 * (L // p) * sum(2 * b * T * K_ * N_ for K_, N_ in products) / peak
        rows[b] = (m + p - 1) * one                              # 1F1B: m micro-batches plus p - 1 in the bubble
        check.say(f"  b {b:>2} (M = {b * T:>4} tokens): rate {useful / one:5.1%} of peak, step {rows[b]:7.3f} s")
    best = min(rows, key=rows.get)
    check.say(f"  ridge {ridge:.0f} FLOP/byte; the products turn compute-bound at M = {cross:.0f} tokens, b = "
              f"{cross / T:.1f}; fastest b = {best}")
    check.holds("the step shrinks while the products are memory-bound (b T below the crossing)",
                all(rows[2 * b] < rows[b] for b in (1, 2, 4, 8) if 2 * b * T <= cross))
    check.holds("and grows once they are compute-bound (the bubble's share grows with b)",
                all(rows[2 * b] > rows[b] for b in (1, 2, 4, 8) if b * T >= cross))
    check.holds("the fastest b is the one where b T first passes the crossing, or the one before it",
                best in {b for b in rows if b * T >= cross and b * T / 2 < cross} | {b for b in rows
                                                                                    if b * T < cross <= 2 * b * T})


# ---------------------------------------------------------------------------------------------------- exercise 4

def exercise_4(check):
    """The bubble of a schedule from the simulator."""
    p, m, f, b, w = 8, 16, 1.0, 2.0, 0.0                         # a micro-batch's costs on one stage
    worst = 0.0
    for kind, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        span = makespan(kind, m, p, v, f / v, b / v, w / v)        # per chunk: a stage's costs / v
        busy = m * (f + b + w)
        worst = max(worst, rel((span - busy) / busy, (p - 1) / (v * m)))
        check.say(f"  {kind:<11} v {v}: makespan {span:.2f}, busy {busy:.0f}, bubble / busy {(span - busy) / busy:.4f}"
                  f" = (p - 1)/(v m) = {(p - 1) / (v * m):.4f}")
    check("bubble / busy = (p - 1)/(v m): 1F1B, GPipe, interleaved", worst, 1e-12)
    f, b, w = 1.0, 1.0, 1.0                                      # split backward: B and W apart
    zb, one = makespan("zb-h1", m, p, 1, f, b, w), makespan("1f1b", m, p, 1, f, b, w)
    check.say(f"  with B = W = F: 1F1B's bubble {one - 3 * m:.1f}, zero-bubble H1's {zb - 3 * m:.1f} "
              f"(the W's fill part of it)")
    check.holds("zero-bubble H1's bubble is smaller than 1F1B's", zb < one)
    check("1F1B's makespan = (m + p - 1)(F + B + W)", rel(one, (m + p - 1) * (f + b + w)), 1e-12)


if __name__ == "__main__":
    solve(Checks(tol=1e-12, width=84), [exercise_1, exercise_2, exercise_3, exercise_4])
