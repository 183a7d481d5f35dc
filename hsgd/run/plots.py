"""PNG pictures of a run (--plot DIR): the loss curves, and a per-rank timeline of one training step; and a
pipeline's schedule as a Gantt chart (draw_pipeline, on axes the caller made: the tutorials use it).

Needs matplotlib (installed by `pip install -e '.[dev]'`, which `make train` does); the Agg backend, no display.
"""
import os

from hsgd.errors import UsageError
from hsgd.pp.schedules import KIND_NAMES

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "weight gradients": "#8DBF5A", "forward and backward": "#4F8D8C",
          "optimizer": "#8172B2",
          "dp sync": "#CCB974",
          "straggler delay": "#C44E52", "Allreduce": "#DD8452", "Iallreduce": "#C44E52", "Allgather": "#64B5CD",
          "Reduce_scatter_block": "#937860", "Bcast": "#DA8BC3"}
def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')") from None
    return plt


def plot_losses(losses, val_points, path, title="", first_step=1):
    """Training loss per step (losses[0] is step first_step: a resumed run starts later) and validation loss at
    its evaluation steps."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(first_step, first_step + len(losses)), losses, lw=0.8, label="training loss (global batch)")
    if val_points:
        ax.plot([s for s, _ in val_points], [v for _, v in val_points], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(events, path, title="", t_range=None):
    """One row per rank and track (compute, comm, async): every span as a bar, collectives colored by operation;
    non-blocking calls in flight at the same time are drawn translucent on top of each other."""
    plt = pyplot()
    xs = [e for e in events if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in xs})
    if t_range is None:
        t_range = (min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs))
    t0 = t_range[0]
    fig, ax = plt.subplots(figsize=(11, 0.5 * 3 * len(ranks) + 1.2))
    labels, seen = [], set()
    for i, rank in enumerate(ranks):
        for tid, track in ((0, "compute"), (1, "comm"), (2, "async")):
            y = 3 * (len(ranks) - 1 - i) + (2 - tid)
            labels.append((y, f"rank {rank} {track}"))
            for e in xs:
                if e["pid"] != rank or e["tid"] != tid or e["ts"] + e["dur"] < t_range[0] or e["ts"] > t_range[1]:
                    continue
                if e["name"].startswith("step "):
                    continue
                name = e["name"]
                action = name[1:].isdigit() and {"F": "forward", "B": "backward"}.get(name[:1])  # pipeline F3, B3
                color = COLORS.get(name) or COLORS.get(action) or "#999999"
                kw = {"label": e["name"]} if e["name"] not in seen else {}
                seen.add(e["name"])
                ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)], (y + 0.1, 0.8), color=color,
                               alpha=0.35 if tid == 2 else 1.0, edgecolor="black" if tid == 2 else None,
                               linewidth=0.4, **kw)
    ax.set_yticks([y + 0.5 for y, _ in labels])
    ax.set_yticklabels([lab for _, lab in labels], fontsize=7)
    ax.set_xlabel("milliseconds")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pipeline_spans(events, ranks):
    """The pipeline actions of each rank in `ranks` from a trace (hsgd.grid.trace's Chrome events): [[("F3", start s,
    end s), ...] per rank, in time order]. hsgd.pp.stage names a forward span "forward" and a backward "backward", with
    the micro-batch in its args; "F3" is the forward of micro-batch 3, as in hsgd.pp.chunks's schedules."""
    out = []
    for rank in ranks:
        mine = [e for e in events if e.get("ph") == "X" and e["pid"] == rank and e["name"] in KIND_NAMES.values()]
        one = lambda kind, j, c: f"{kind}{j}" + (f".{c}" if c else "")                   # noqa: E731
        kind = lambda e: "W" if e["name"][0] == "w" else e["name"][0].upper()            # noqa: E731
        label = lambda e, a: one(kind(e), a["micro_batch"], a.get("chunk")) + (           # noqa: E731
            "&" + one("B", a["b_micro_batch"], a.get("b_chunk")) if "b_micro_batch" in a else "")   # (F&B: a pair)
        out.append(sorted(((label(e, e["args"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in mine),
                          key=lambda span: span[1]))
    return out


def draw_pipeline(ax, timeline, title="", unit=1.0, xlabel="time", legend=True):
    """A pipeline schedule as a Gantt chart on `ax`: one row per stage (stage 0 on top), each action a bar over its
    duration, forward and backward in their colours and labelled with the micro-batch; blank where the stage is idle.
    timeline: [[(name, start, end), ...] per stage] with names "F j" / "B j" (hsgd.pp.chunks.simulate, pipeline_spans);
    times are drawn from the earliest start, divided by `unit`. legend: a key to the colours, right of the axes."""
    from matplotlib.patches import Patch
    t0 = min(a for stage in timeline for _, a, _ in stage)
    span = (max(b for stage in timeline for _, _, b in stage) - t0) / unit
    p = len(timeline)
    for s, stage in enumerate(timeline):
        y = p - 1 - s                                                    # stage 0 on top
        for name, a, b in stage:
            name = str(name)                                             # "F3", "B3.1" (an Action, or its text)
            x, w = (a - t0) / unit, (b - a) / unit
            if "&" in name:                                              # an overlapped pair: F over B
                ax.broken_barh([(x, w)], (y + 0.5, 0.4), facecolor=COLORS["forward"], edgecolor="white", linewidth=0.6)
                ax.broken_barh([(x, w)], (y + 0.1, 0.4), facecolor=COLORS["backward"], edgecolor="white",
                               linewidth=0.6)
                if w > span / 45:
                    f_part, b_part = name.split("&")
                    ax.text(x + w / 2, y + 0.5, f"{f_part[1:]}&{b_part[1:]}", ha="center", va="center", fontsize=5,
                            color="white")
                continue
            ax.broken_barh([(x, w)], (y + 0.1, 0.8), facecolor=COLORS[KIND_NAMES.get(name[0], "backward")],
                           edgecolor="white", linewidth=0.6)
            if w > span / 45:                                            # a label only where it fits
                ax.text(x + w / 2, y + 0.5, name[1:], ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, span)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 1 - s + 0.5 for s in range(p)])
    ax.set_yticklabels([f"stage {s}" for s in range(p)], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel(xlabel, fontsize=7)
    ax.set_title(title, fontsize=8)
    if legend:
        kinds = sorted({str(n)[0] for stage in timeline for n, _, _ in stage} | ({"F", "B"} if any(
            "&" in str(n) for stage in timeline for n, _, _ in stage) else set()), key="FBW".find)
        ax.legend(handles=[Patch(color=COLORS[KIND_NAMES[k]], label=f"{KIND_NAMES[k]} {k} j") for k in kinds],
                  loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=6, frameon=False)
    return ax


MEMORY_COLORS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#8172B2", "activations": "#DD8452",
                 "comm": "#64B5CD", "recompute": "#C44E52", "other": "#999999", "device": "#937860"}


def plot_memory(per_rank, path, title=""):
    """Memory over one step, one panel per rank, stacked by category. per_rank: [(rank, [(label, seconds,
    {category: bytes}), ...])] (hsgd.accounting.allocations's samples); the x axis is the sample's order, labelled F j /
    B j."""
    plt = pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    n = len(per_rank)
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.9 * n + 0.8), squeeze=False)
    for ax, (rank, samples) in zip(axes[:, 0], per_rank):
        cats = [c for c in MEMORY_COLORS if any(s[2].get(c, 0) for s in samples)]
        xs = range(len(samples))
        ax.stackplot(xs, *[[s[2].get(c, 0) / 2**20 for s in samples] for c in cats], labels=cats,
                     colors=[MEMORY_COLORS[c] for c in cats], step="mid")
        ax.set_ylabel(f"rank {rank}\nMiB", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([s[0] for s in samples], rotation=90, fontsize=5)
        ax.tick_params(axis="y", labelsize=7)
        ax.margins(x=0)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(directory, losses, val_points, events, step_range, title, first_step=1):
    """Both pictures into `directory`; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, "loss.png"), os.path.join(directory, "timeline.png")]
    plot_losses(losses, val_points, paths[0], title, first_step)
    if events:
        plot_timeline(events, paths[1], f"{title}: one training step", step_range)
    else:
        paths = paths[:1]
    return paths
