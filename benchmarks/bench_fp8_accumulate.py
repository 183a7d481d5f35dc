"""What a short tensor-core accumulator costs an FP8 matrix product, and what promoting its partial sums to float32
every N_c = 128 terms buys back (hsgd.fp8.accumulate; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section
3.3.2): the largest relative error of limited_matmul against the float64 product, for K in 512 ... 4096, 13 and 14
accumulator bits, truncated (what tensor cores do: Fasi, Higham, Mikaitis and Pranesh 2021, "Numerical behavior of
NVIDIA tensor cores") and to nearest, without promotion and promoted every 128.

    python benchmarks/bench_fp8_accumulate.py [--n 32] [--seed 0]

Inputs (accumulate.fp8_inputs): a (n, K) and b (K, n) with entries 1 + N(0, 1), scaled per tensor to e4m3's 448 and
rounded to float8_e4m3fn: positive-mean data, where sums grow like k and truncation's bias shows (DeepSeek does not
state its distribution). "max" is the largest relative error over the n^2 entries of the product; "typical" is
what the module docstring's "estimate" estimates: the mean for truncation (K u / (8 ln 2), N_c for K with
promotion), the rms for nearest (u sqrt(K / (24 ln 2)); N_c u / sqrt(24 ln 2 K) promoted). Writes
benchmarks/results/fp8_accumulate.md and prints it; a second or two. The claims checked (exit 1 otherwise):
promotion lowers every truncated error, by at least a quarter of K / N_c = 32 at K = 4096, and 14 bits truncated
without promotion lose percents at K = 4096 (between 1% and 25%, the ceiling K u / 2 of the module's tests).
"""
import argparse
import sys

from train_families import write_results

from hsgd.fp8.accumulate import accumulation_error

KS = (512, 1024, 2048, 4096)
BITS = (13, 14)
MODES = ("truncate", "nearest")
NC = 128


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32, help="rows of a and columns of b: the table's maxima over n^2 entries")
    p.add_argument("--seed", type=int, default=0, help="the inputs' seed")
    args = p.parse_args()
    lines = ["| K | acc bits | mode | no promotion: max | typical | estimate | every 128: max | typical | estimate "
             "| max less |", "|---|---|---|---|---|---|---|---|---|---|"]
    maxima = {}                                               # (K, bits, mode) -> (max without, max with promotion)
    for K in KS:
        for bits in BITS:
            for mode in MODES:
                typical = "mean_rel" if mode == "truncate" else "rms_rel"     # what the estimate estimates
                plain = accumulation_error(K, bits, None, mode, args.seed, args.n, args.n)
                kept = accumulation_error(K, bits, NC, mode, args.seed, args.n, args.n)
                maxima[K, bits, mode] = plain["max_rel"], kept["max_rel"]
                cells = [K, bits, mode] + [f"{e[key]:.4%}" for e in (plain, kept)
                                           for key in ("max_rel", typical, "predicted")]
                lines.append("| " + " | ".join(map(str, cells)) + f" | {plain['max_rel'] / kept['max_rel']:.0f}x |")
    lowered = all(w > k for (K, bits, mode), (w, k) in maxima.items() if mode == "truncate")
    without, with_ = maxima[4096, 14, "truncate"]
    ok = lowered and without / with_ >= 4096 / NC / 4 and 0.01 < without < 0.25
    run = f"python benchmarks/bench_fp8_accumulate.py --n {args.n} --seed {args.seed}"
    text = "\n".join(lines) + (
        f"\n\nRelative errors over {args.n}x{args.n} entries (typical: mean for truncate, rms for nearest); inputs "
        f"1 + N(0, 1) rounded to float8_e4m3fn (seed {args.seed}). At K = 4096 and 14 bits truncated, promotion "
        f"every {NC} cuts {without:.2%} to {with_:.3%} ({without / with_:.0f}x). Claims {'hold' if ok else 'FAIL'}. "
        f"Run: `{run}`.\n")
    write_results("fp8_accumulate.md", text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
