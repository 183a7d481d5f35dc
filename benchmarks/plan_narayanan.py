"""The planner against Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1: one matmul efficiency fitted on one row, the TFLOP/s per GPU of the nine others predicted,
and the rank of the paper's (t, p) among the planner's layouts (hsgd.plan.validate).

    python benchmarks/plan_narayanan.py [ROW]        # ROW: the row to fit on, by its parameters (default 145.6)

Writes benchmarks/results/plan_narayanan.md and prints it. About 5 s; one process.
"""
import os
import sys

from hsgd.plan.validate import markdown, table1_validation

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    fit = sys.argv[1] if len(sys.argv) > 1 else "145.6"
    eff, rows = table1_validation(fit)
    text = markdown(eff, rows)
    worst = max(abs(r["error"]) for r in rows if not r["fitted"])
    text += (f"\n\nWorst |error| of the nine predicted rows: {worst:.1%}. Run: `python benchmarks/plan_narayanan.py "
             f"{fit}`.\n")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "plan_narayanan.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
