"""What the tolerance oracle (hsgd.check.oracle) saw, and how it is shown: the Verdict (per layout and parameter,
the observed differences and their bands), the tables hsgd.verify prints (report) and the picture (plot_tolerance).
The band is the oracle module docstring's: LAMBDA times the error model's rms, plus an allowance for the float32
sums' order; chapter 14 reads a verdict step by step."""
import numpy as np

from hsgd.model.precision import unit_roundoff
from hsgd.run.plots import pyplot

LAMBDA = 4.0                  # the band: LAMBDA times the model's rms difference
FLOAT64_TOLERANCE = 1e-10     # a layout's float64 run against the reference (hsgd.verify's)


def name_of(layout):
    dp, pp, cp, tp = layout
    return f"{dp}x{pp}x{tp}" if cp == 1 else f"{dp}x{pp}x{cp}x{tp}"


class Verdict:
    """What the oracle saw, on rank 0: per layout and parameter (or "loss") the observed differences per seed
    against float64 (`vs64`) and against the first layout (`vsbase`), the model's (`model`: the draws' variance),
    the float64 run's (`exact`), and the bands. rows() lists them; outside() the ones a correct run would not
    give."""

    def __init__(self, layouts, names, compute, tokens):
        self.layouts, self.names, self.compute = layouts, names, compute
        self.scalar = names == ["loss"]                            # --loss-steps: the median is held to the band
        self.reorder32 = LAMBDA * tokens ** 0.5 * unit_roundoff("float32")   # the float32 sums' allowance
        self.tokens = tokens
        self.vs64 = {L: {k: [] for k in names} for L in layouts}
        self.vsbase = {L: {k: [] for k in names} for L in layouts}
        self.model = {L: {k: [] for k in names} for L in layouts}
        self.exact = {L: 0.0 for L in layouts}

    def add(self, L, vs64, vsbase, model, exact):
        for k in self.names:
            self.vs64[L][k].append(vs64[k])
            self.vsbase[L][k].append(vsbase[k])
            self.model[L][k].append(model[k])
        worst = float(np.max(list(exact.values())))
        self.exact[L] = max(self.exact[L], worst if np.isfinite(worst) else float("inf"))

    def rms(self, L, k):
        """m_L: the model's rms error of one draw (`model` holds each seed's variance of the draws)."""
        return float(np.sqrt(np.mean(self.model[L][k])))

    def band(self, L, k, base=False):
        m = self.rms(L, k)
        if base:
            m = float(np.hypot(m, self.rms(self.layouts[0], k)))
        return LAMBDA * m + self.reorder32

    def rows(self):
        """[(layout, name, median vs64, max vs64, band, median vs base, max vs base, band vs base)]."""
        out = []
        for L in self.layouts:
            for k in self.names:
                a, b = self.vs64[L][k], self.vsbase[L][k]
                out.append((L, k, float(np.median(a)), float(np.max(a)), self.band(L, k), float(np.median(b)),
                            float(np.max(b)), self.band(L, k, base=True)))
        return out

    def ratio(self, row):
        """How far a row is into its band: the held statistic (max, or with --loss-steps the median) over the
        band, against float64 and against the base, the larger; inf when the band itself is not finite."""
        L, k, med, mx, band, medb, mxb, bandb = row
        held = (med, medb) if self.scalar else (mx, mxb)
        if not (np.isfinite(band) and np.isfinite(bandb)):
            return float("inf")
        return max(held[0] / band, held[1] / bandb if L != self.layouts[0] else 0.0)

    def outside(self):
        """The rows outside their band, and the layouts whose float64 run is not exact."""
        bad = [r for r in self.rows() if not self.ratio(r) <= 1.0]
        return bad, [L for L in self.layouts if not self.exact[L] <= FLOAT64_TOLERANCE]


def report(verdict, tc, cfg, world_size, out, loss_steps=0, resume_after=0):
    """The oracle's tables, on rank 0; returns True when every difference is inside its band."""
    u, n = unit_roundoff(verdict.compute), len(verdict.vs64[verdict.layouts[0]][verdict.names[0]])
    base = name_of(verdict.layouts[0])
    what = (f"the loss after {loss_steps} steps" if verdict.names == ["loss"] else "one step's gradients" + (
        f" after {resume_after} steps and a resume" if resume_after else ""))
    print(f"hsgd.verify, the tolerance oracle | {world_size} ranks | {verdict.compute} (u = {u:.1e}), reduce "
          f"{tc.reduce_dtype} | {what}, {n} seeds | batch {tc.batch_size} x {cfg.seq_len}, {tc.micro_batches} "
          f"micro-batch(es) | {tc.tp_scheme}", file=out)
    print(f"band = {LAMBDA:g} x the error model's rms (between layouts: of both, in quadrature) + {LAMBDA:g} "
          f"sqrt(N) u_float32 = {verdict.reorder32:.1e} (N = {verdict.tokens} tokens); differences relative to the "
          f"float64 {'loss' if verdict.scalar else 'gradient norm'}"
          f"{'; the median over seeds is held to the band' if verdict.scalar else ''}", file=out)
    rows = verdict.rows()
    for L in verdict.layouts:
        dp, pp, cp, tp = L
        print(f"\nlayout {name_of(L)} (dp {dp} x pp {pp}{f' x cp {cp}' if cp > 1 else ''} x tp {tp}): in float64 "
              f"{verdict.exact[L]:.1e} from the reference (exact: <= {FLOAT64_TOLERANCE:.0e})"
              f"{'' if verdict.exact[L] <= FLOAT64_TOLERANCE else '   <- NOT EXACT: a bug, not rounding'}", file=out)
        print(f"{'':<24}{'vs float64':>30}{'vs ' + base:>32}", file=out)
        print(f"{'parameter':<24}{'median':>10}{'max':>10}{'band':>10}  {'median':>10}{'max':>10}{'band':>10}",
              file=out)
        for row in rows:
            L2, k, med, mx, band, medb, mxb, bandb = row
            if L2 == L:
                flag = "" if verdict.ratio(row) <= 1 else "   <- outside the band" + (
                    "" if np.isfinite(mx) else " (not finite: an overflow, a NaN)")
                other = f"{medb:>10.1e}{mxb:>10.1e}{bandb:>10.1e}" if L != verdict.layouts[0] else f"{'-':>10}" * 3
                print(f"{k:<24}{med:>10.1e}{mx:>10.1e}{band:>10.1e}  {other}{flag}", file=out)
        worst = max((r for r in rows if r[0] == L), key=verdict.ratio)
        print(f"largest observed / band: {verdict.ratio(worst):.2f} ({worst[1]})", file=out)
    bad, inexact = verdict.outside()
    ok = not bad and not inexact
    if ok:
        print(f"PASS: every difference of {', '.join(name_of(L) for L in verdict.layouts)} is inside its band: "
              f"what rounding to {verdict.compute} explains", file=out)
    else:
        names = sorted({f"{name_of(r[0])} {r[1]}" for r in bad}) + [f"{name_of(L)} (float64)" for L in inexact]
        print(f"FAIL: {len(names)} outside what rounding explains: {', '.join(names[:8])}"
              f"{' ...' if len(names) > 8 else ''}", file=out)
    return ok


def plot_tolerance(verdict, path=None):
    """The tolerance oracle's verdict (hsgd.check.oracle.Verdict): for each layout, per parameter, the differences
    observed over the seeds (dots: each seed; against float64 and against the first layout) under their bands
    (lines), on a log scale; a dot above its line is outside what rounding explains. Saved to `path` (and closed),
    or, without a path, the figure is returned."""
    plt = pyplot()
    layouts, names = verdict.layouts, verdict.names
    fig, axes = plt.subplots(len(layouts), 1, figsize=(max(7, 0.28 * len(names) + 2), 2.6 * len(layouts) + 0.6),
                             squeeze=False, sharex=True)
    x = list(range(len(names)))
    for ax, L in zip(axes[:, 0], layouts):
        for series, base, color, label in ((verdict.vs64, False, "#4C72B0", "vs float64"),
                                           (verdict.vsbase, True, "#DD8452", f"vs {name_of(layouts[0])}")):
            if base and L == layouts[0]:
                continue
            for i, k in enumerate(names):
                seen = series[L][k]
                ax.scatter([i + (0.15 if base else -0.15)] * len(seen), seen, s=8, color=color,
                           label=label if i == 0 else None)
            ax.step([i - 0.5 for i in x] + [len(x) - 0.5], [verdict.band(L, k, base) for k in names] +
                    [verdict.band(L, names[-1], base)], where="post", color=color, lw=1, alpha=0.8,
                    label=f"band ({label})")
        ax.set_yscale("log")
        ax.set_title(f"layout {name_of(L)}: {verdict.compute} differences (dots, one per seed) and their bands",
                     fontsize=9)
        ax.set_ylabel("relative difference")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xticks(x)
    axes[-1, 0].set_xticklabels(names, rotation=90, fontsize=7)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
