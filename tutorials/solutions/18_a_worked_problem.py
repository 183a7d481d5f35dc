"""Solutions to the exercises of chapter 18 (tutorials/18_a_worked_problem.py).

    python tutorials/solutions/18_a_worked_problem.py

One process: every exercise prices layouts with the planner (no arrays, no messages) and checks its numbers
against formulas written by hand.
"""
import functools
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, solve  # noqa: E402

from hsgd.plan.__main__ import build_parser, plan  # noqa: E402
from hsgd.plan.hardware import load  # noqa: E402
from hsgd.plan.models import parse_model, presets  # noqa: E402
from hsgd.plan.search import Layout, evaluate  # noqa: E402

HW = load("h100-80g")
EFF = HW.efficiency or 0.5                  # what python -m hsgd.plan takes when the file names none
GiB = 2 ** 30


def rel(a, b):
    return abs(a - b) / abs(b)


@functools.lru_cache(maxsize=None)
def best_of(model, batch, devices, zero):
    """The planner's fastest layout (its --json entry) for the model on `devices` H100s, ZeRO stages `zero`."""
    argv = ["--model", model, "--batch", str(batch), "--devices", str(devices), "--hw", "h100-80g", "--zero", zero,
            "--top", "1"]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "plan.json")
        plan(build_parser().parse_args(argv + ["--json", path]), say=lambda *a, **k: None)
        with open(path) as f:
            return json.load(f)["layouts"][0]


# ---------------------------------------------------------------------------------------------------- exercise 1

def exercise_1(check):
    """The same tokens at half the length (T = 4096, B = 1024)."""
    shares, flops = {}, {}
    for T, B in ((8192, 512), (4096, 1024)):
        cfg = parse_model(f"llama3-70b,T={T}")
        L, C, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
        tokens = B * T
        dense = 6 * (cfg.n_params() - V * C - (2 * L + 1) * C) * tokens
        att = 12 * L * T * C * tokens
        check(f"T = {T}: 6 N_mm BT + 12 L T C BT = step_flops", rel(dense + att, cfg.step_flops(B)), 1e-12)
        shares[T], flops[T] = att / (dense + att), cfg.step_flops(B)
        check.say(f"  T = {T}, B = {B}: {tokens:,} tokens, attention {shares[T]:.1%} of {flops[T]:.3e} FLOPs")
    saved = flops[8192] - flops[4096]
    att8 = shares[8192] * flops[8192]
    check("step_flops(8192) - step_flops(4096) = half the attention of T = 8192", rel(saved, att8 / 2), 1e-12)
    long, short = best_of("llama3-70b", 512, 512, "0,1"), best_of("llama3-70b,T=4096", 1024, 512, "0,1")
    for T, e in ((8192, long), (4096, short)):
        check.say(f"  T = {T}: {e['layout']['name']}, {e['time']['total']:.2f} s, MFU {e['mfu']:.1%}")
    check.holds("at T = 4096 the planner's best step is faster (fewer FLOPs for the same tokens)",
                short["time"]["total"] < long["time"]["total"])
    check.holds("at T = 4096 too, tp stays inside a node", short["layout"]["tp"] <= HW.devices_per_node)
    check.say("  The shorter sequence saves most of the attention's FLOPs and halves a micro-batch's activations, "
              "which changes which layouts fit and their order; tp still stays inside a node and dp crosses.")


# ---------------------------------------------------------------------------------------------------- exercise 2

def exercise_2(check):
    """Tensor parallelism across two nodes (tp 16 against tp 8)."""
    cfg = presets()["llama3-70b"]
    L, C, T = cfg.n_layers, cfg.d_model, cfg.seq_len
    opts = dict(tp_scheme="sequence", recompute="selective", schedule="1f1b", b=1, attention="flash", zero=1)
    terms = {}
    for tp in (8, 16):
        dp = 512 // tp
        m = 512 // dp
        e = evaluate(cfg, 512, Layout(dp=dp, pp=1, tp=tp, m=m, **opts), HW, efficiency=EFF)
        counts = e.bytes[0]
        planned = counts[("tp", "Allgather")][1] + counts[("tp", "Reduce_scatter_block")][1]
        blocks = 10 * L * m * (1 * T * C * 2)          # 6 All-Gathers + 4 Reduce-Scatters of (bT, C) in 16 bits
        check.say(f"  tp {tp:>2} (dp {dp}, m {m}): blocks' payload {blocks / 1e9:.1f} GB by hand, the planner's "
                  f"All-Gathers and Reduce-Scatters {planned / 1e9:.1f} GB (the rest: the vocabulary's); tp term "
                  f"{e.time.parts()['tp']:.2f} s of {e.time.total:.2f} s; fits: {e.fits}")
        check(f"tp {tp}: the blocks' payload by hand vs the planner's (1%: the head's)", rel(planned, blocks), 0.01)
        terms[tp] = (e.time.parts()["tp"], m)
    (t8, m8), (t16, m16) = terms[8], terms[16]
    predicted = (m16 / m8) * (15 / 16) / (7 / 8) * HW.intra.bandwidth / HW.inter.bandwidth
    check.say(f"  tp term 16 / 8: {t16 / t8:.1f} by the planner; by section 2.5: twice the micro-batches x "
              f"(15/16)/(7/8) x the links' ratio {HW.intra.bandwidth / HW.inter.bandwidth:.0f} = {predicted:.1f}")
    check("the tp term's ratio vs the bytes x the links' ratio (10%)", rel(t16 / t8, predicted), 0.10)


# ---------------------------------------------------------------------------------------------------- exercise 3

def exercise_3(check):
    """ZeRO 2 and 3 allowed."""
    narrow, wide = best_of("llama3-70b", 512, 512, "0,1"), best_of("llama3-70b", 512, 512, "0,1,2,3")
    mem = wide["memory"]
    zero, dp = wide["layout"]["zero"], wide["layout"]["dp"]
    check.say(f"  ZeRO 0,1: {narrow['layout']['name']}, {narrow['time']['total']:.2f} s")
    check.say(f"  ZeRO 0-3: {wide['layout']['name']}, {wide['time']['total']:.2f} s "
              f"({1 - wide['time']['total'] / narrow['time']['total']:.1%} faster by the model); "
              f"{sum(mem.values()) / GiB:.2f} GiB")
    check.holds("the wider search is at least as fast", wide["time"]["total"] <= narrow["time"]["total"])
    if zero == 2:
        psi = mem["params"] / 2                        # ZeRO-2 keeps the 16-bit weights whole
        check("ZeRO-2: gradients + optimizer = 14 Psi / dp", rel(mem["grads"] + mem["optimizer"], 14 * psi / dp), 1e-9)
    elif zero == 3:
        psi = mem["optimizer"] * dp / 12
        check("ZeRO-3: weights = 2 Psi / dp", rel(mem["params"], 2 * psi / dp), 1e-9)
        check("ZeRO-3: gradients + optimizer = 14 Psi / dp", rel(mem["grads"] + mem["optimizer"], 14 * psi / dp), 1e-9)
    else:
        check.note("ZeRO 0 or 1 won again: nothing more to check", zero in (0, 1))
    check.say("  Left out by the model: ZeRO-2 reduce-scatters every micro-batch's gradients (m of them a step, not "
              "one), each priced as hidden behind the backward; in a real run they share the NICs and the SMs with "
              "the tensor-parallel traffic and the matmuls.")


if __name__ == "__main__":
    solve(Checks(tol=1e-12, width=84), [exercise_1, exercise_2, exercise_3])
