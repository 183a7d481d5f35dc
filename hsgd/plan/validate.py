"""The planner against published results: Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Table 1 (hsgd.plan.paper.table1: ten GPT models from 1.7 B to 1 T parameters
on 32 to 3072 A100 80GB GPUs of Selene, with their tensor- and pipeline-parallel sizes t and p, the global batch,
and the teraFLOP/s per GPU they achieved).

    python -m hsgd.plan.validate            # the table (benchmarks/plan_narayanan.py writes it for the README)

The runs of the paper, in the planner's terms: --impl megatron (16-bit, Adam), full recomputation, no sequence
parallelism and no ZeRO (neither was in Megatron-LM then), the 1F1B or interleaved schedule (v = 2), and
micro-batches of 1, 2, 4 or 8 sequences (the paper tuned them; the table does not say which), the attention scores
stored (Layout's default; FlashAttention came a year later), and the 80 GiB less search.HEADROOM. TFLOP/s per GPU are
counted as the paper counts them, its FLOPs with recomputation (hsgd.model.config.gpt_step_flops equals them) over the
step time and the GPUs.

One number is fitted: the fraction of the A100's 312 TFLOP/s peak that matmuls reach, on one row (`fit`), so
that the predicted TFLOP/s of that row equal the paper's. Every other row is then a prediction. The layout check:
over every (t, p) the model allows on the row's GPUs (t up to 16, every p that divides), each priced at its best
micro-batch and schedule, the rank of the paper's (t, p) and its time against the best's.
"""
import sys

from hsgd import cli
from .hardware import load
from .paper import table1
from .search import evaluate, layouts

PAPER_SPACE = {"zero": [0], "tp_scheme": ["megatron"], "recompute": ["full"], "b": [1, 2, 4, 8],
               "schedule": ["1f1b", "interleaved"], "v": [2]}


def best_of(cfg, batch, n, hw, efficiency, tp=None, pp=None, simulated=False):
    """{(t, p): the fastest fitting evaluation of that (t, p)} over PAPER_SPACE (optionally one t, one p). The
    pipeline by the closed form the simulator equals for 1F1B and interleaved schedules of equal stages
    (costs.makespan; tests/test_plan.py), unless simulated."""
    space = dict(PAPER_SPACE, tp=[tp] if tp else [t for t in (1, 2, 4, 8, 16) if n % t == 0],
                 pp=[pp] if pp else None)
    out = {}
    for lay in layouts(cfg, batch, n, space):
        e = evaluate(cfg, batch, lay, hw, "megatron", "bfloat16", efficiency, simulated=simulated)
        key = (lay.tp, lay.pp)
        if e.fits and (key not in out or e.time.total < out[key].time.total):
            out[key] = e
    return out


def predicted_tflops(row, hw, efficiency):
    """The planner's TFLOP/s per GPU for the paper's own (t, p) on that row, its best micro-batch and schedule."""
    got = best_of(row["cfg"], row["batch"], row["gpus"], hw, efficiency, row["t"], row["p"])
    return got[(row["t"], row["p"])].tflops if got else float("nan")


def fit_efficiency(row, hw, guess=0.5):
    """The matmul efficiency at which the planner's TFLOP/s for `row` equal the paper's (fixed-point iteration:
    the step's compute scales with 1/efficiency, its communication does not)."""
    eff = guess
    for _ in range(30):
        new = min(1.0, eff * row["tflops_per_gpu"] / predicted_tflops(row, hw, eff))
        if abs(new - eff) < 1e-6:
            break
        eff = new
    return eff


def table1_validation(fit="145.6", hw=None):
    """(the fitted efficiency, rows): per row of Table 1 its numbers, the predicted TFLOP/s per GPU ("error":
    predicted / paper - 1), the paper's (t, p) rank among the planner's (t, p) ("paper_rank", 1 = fastest),
    the planner's best (t, p) and "within": the paper layout's predicted time / the best's."""
    hw = hw or load("a100-80g")
    rows = table1()
    fit_row = next(r for r in rows if f"{r['params_billion']:g}" == str(fit))
    eff = fit_efficiency(fit_row, hw)
    out = []
    for r in rows:
        pred = predicted_tflops(r, hw, eff)
        ranked = sorted(best_of(r["cfg"], r["batch"], r["gpus"], hw, eff).items(), key=lambda kv: kv[1].time.total)
        keys = [k for k, _ in ranked]
        paper = (r["t"], r["p"])
        mine = dict(ranked).get(paper)
        out.append({"params_billion": r["params_billion"], "t": r["t"], "p": r["p"], "gpus": r["gpus"],
                    "batch": r["batch"], "paper_tflops": r["tflops_per_gpu"], "predicted_tflops": pred,
                    "error": pred / r["tflops_per_gpu"] - 1, "fitted": r is fit_row,
                    "paper_rank": keys.index(paper) + 1 if paper in keys else None, "best": keys[0] if keys else None,
                    "layouts": len(keys),
                    "within": mine.time.total / ranked[0][1].time.total if mine is not None else float("inf")})
    return eff, out


def markdown(eff, rows, hw_name="a100-80g"):
    """The validation as a markdown table."""
    lines = [f"Narayanan et al. 2021, Table 1, against `python -m hsgd.plan` on `{hw_name}`: matmul efficiency "
             f"{eff:.3f} of peak fitted on the row marked *, every other row predicted.", "",
             "| parameters | GPUs | batch | paper t, p | paper TFLOP/s/GPU | predicted | error | paper's (t, p) "
             "rank | planner's best (t, p) | paper's time / best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['params_billion']:g} B{' *' if r['fitted'] else ''} | {r['gpus']} | {r['batch']} | "
                     f"{r['t']}, {r['p']} | {r['paper_tflops']:g} | {r['predicted_tflops']:.1f} | "
                     f"{r['error']:+.1%} | {r['paper_rank']} of {r['layouts']} | {r['best'][0]}, {r['best'][1]} | "
                     f"{r['within']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    """The exit code of python -m hsgd.plan.validate [FIT]: 0 when the predictions and layouts are within their aims,
    1 when not, 2 with one line for a usage error (hsgd.cli)."""
    sizes = [f"{r['params_billion']:g}" for r in table1()]
    ap = cli.Parser(prog="python -m hsgd.plan.validate", description="The planner against Narayanan et al. (2021) "
                    "Table 1: the matmul efficiency fitted on one row, every other row predicted.")
    ap.add_argument("fit", nargs="?", default="145.6", choices=sizes, metavar="FIT",
                    help=f"the row (billions of parameters) the efficiency is fitted on, one of {', '.join(sizes)} "
                         "(145.6)")
    return cli.run(lambda: validate(ap.parse_args(argv).fit))


def validate(fit):
    eff, rows = table1_validation(fit)
    print(markdown(eff, rows))
    worst = max(abs(r["error"]) for r in rows if not r["fitted"])
    layouts_ok = all(r["paper_rank"] is not None and (r["paper_rank"] <= 3 or r["within"] <= 1.10) for r in rows)
    print(f"\nworst |error| of the predicted rows: {worst:.1%} (aim: within 15%); the paper's (t, p) among the "
          f"planner's three best or within 10% of the best on every row: {layouts_ok}")
    return 0 if worst <= 0.15 and layouts_ok else 1


if __name__ == "__main__":
    sys.exit(main())
