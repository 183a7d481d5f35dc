"""The pictures the chapters draw: where the PNGs go, how a notebook shows them, and the process grid.

    import pictures
    fig, ax = pictures.figure(6, 3)                       # a matplotlib figure on the Agg backend (no display)
    ...                                                   # draw
    path = pictures.save(fig, "05_column_and_row_split")  # <folder>/05_column_and_row_split.png; shown in a notebook
    pictures.grid(ProcessGrid-like sizes, name)           # the dp x pp x tp grid with its communicators
    pictures.wait_asleep(world)                           # after rank 0 has drawn: every rank, before going on
    pictures.on_rank0(world, draw)                        # the same two steps: draw() on rank 0, the others asleep

Only one rank draws (rank 0 of the chapter's world): a chapter calls these under `if rank == 0:`, and then every
rank calls wait_asleep, so that the others do not spin while rank 0 draws.
The folder is $HSGD_FIGURES when set (the tests set it to a temporary folder and check that every picture a
chapter names was written), else `tutorials/figures/` beside this file (not tracked by git). A picture's name
starts with its chapter's number, so that the folder reads in the course's order.

This is not a chapter (tests/test_tutorials.py runs only the files named NN_*.py and [A-Z]_*.py): it holds only
what several chapters draw.
"""
import os
import time

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
COLORS = {"tp": "#1f77b4", "pp": "#2ca02c", "dp": "#d62728"}   # one colour per communicator, in every chapter


def folder():
    """Where the PNGs go: $HSGD_FIGURES, else tutorials/figures/ (created when missing)."""
    path = os.environ.get("HSGD_FIGURES") or FOLDER
    os.makedirs(path, exist_ok=True)
    return path


def figure(width=6.0, height=3.0, nrows=1, ncols=1, **subplots):
    """(fig, ax) of a new figure, width x height inches, drawn without a display (the Agg canvas); with nrows or
    ncols > 1, ax is the array of axes (matplotlib's `Figure.subplots`, which takes sharex= and the like)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots)


def save(fig, name):
    """Write fig as <folder>/<name>.png (150 dpi), show it when running in a notebook, and return the path."""
    path = os.path.join(folder(), name + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    try:                                          # in Jupyter the picture appears under the cell
        get_ipython()                             # noqa: F821 (defined only inside IPython)
        from IPython.display import Image, display
        display(Image(filename=path))
    except NameError:
        pass
    return path


def wait_asleep(comm, poll_s=0.002):
    """Every rank of comm waits here until all have arrived, asleep between tests of a non-blocking barrier.
    Why: while rank 0 draws, the other ranks would wait inside their next collective, where MPICH busy-polls; with
    more ranks than cores (8 ranks on 2 cores in CI) rank 0 then draws at a fraction of one core."""
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(poll_s)


def on_rank0(comm, work, share=False):
    """work() on rank 0 of comm (a picture, a serial reference): its result there, None elsewhere (share: on every
    rank, broadcast); the other ranks wait for it asleep (wait_asleep). If work() raises, every rank raises (rank 0
    its own exception, the others a RuntimeError naming it): nobody waits for a rank that has failed."""
    result, error = None, None
    if comm.Get_rank() == 0:
        try:
            result = work()
        except Exception as e:                                          # told to every rank below, then raised
            error = e
    wait_asleep(comm)
    failed = comm.bcast(None if error is None else f"{type(error).__name__}: {error}", root=0)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank 0 failed in on_rank0: {failed}")
    return comm.bcast(result, root=0) if share else result


def grid(dp, pp, tp, name, title=None, hosts=None):
    """Draw the dp x pp x tp grid of hsgd.grid.process_grid.ProcessGrid and save it as `name`; return the path.

    Ranks are numbered tp fastest, then pp, then dp: rank = (dp_rank * pp + pp_rank) * tp + tp_rank. Each box is a
    rank; replica d is a column of pp x tp boxes (stage p one row, its tp ranks side by side). A blue bar joins the
    ranks of one tp_comm, a green line the stages of one pp_comm, and a red dashed line the replicas of one dp_comm
    (the ranks that hold the same parameter shard). `hosts`, when given, is a list of rank -> node names: each
    node's ranks get a grey background."""
    from matplotlib.patches import FancyBboxPatch, Rectangle
    w, h, gx, gy = 1.0, 0.6, 0.25, 0.45                   # box size and gaps (data units)
    col_w = tp * w + (tp - 1) * gx                        # one replica's width
    sep = 0.9                                             # gap between replicas
    fig, ax = figure(max(4.0, 1.1 * dp * (col_w + sep)), max(2.2, 0.9 * pp * (h + gy) + 1.2))  # inches

    def xy(d, p, t):                                      # lower-left corner of rank (d, p, t)'s box
        return d * (col_w + sep) + t * (w + gx), (pp - 1 - p) * (h + gy)

    def centre(d, p, t):
        x, y = xy(d, p, t)
        return x + w / 2, y + h / 2

    if hosts is not None:                                 # nodes first, under everything else
        for d in range(dp):
            for p in range(pp):
                for t in range(tp):
                    r = (d * pp + p) * tp + t
                    x, y = xy(d, p, t)
                    shade = 0.93 - 0.08 * (sorted(set(hosts)).index(hosts[r]) % 2)
                    ax.add_patch(Rectangle((x - gx / 2, y - gy / 2), w + gx, h + gy, color=str(shade), zorder=0))
    for d in range(dp):
        for p in range(pp):
            if tp > 1:                                    # tp_comm: one bar under the tp ranks of (d, p)
                x0, y0 = xy(d, p, 0)
                ax.plot([x0 + w / 2, x0 + col_w - w / 2], [y0 + h / 2] * 2, color=COLORS["tp"], lw=6,
                        solid_capstyle="round", zorder=1)
            for t in range(tp):
                r = (d * pp + p) * tp + t
                x, y = xy(d, p, t)
                ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc="white", ec="black",
                                            zorder=2))
                ax.text(x + w / 2, y + h * 0.62, f"rank {r}", ha="center", va="center", fontsize=8, zorder=3)
                ax.text(x + w / 2, y + h * 0.25, f"({d},{p},{t})", ha="center", va="center", fontsize=6.5,
                        color="0.35", zorder=3)
    for d in range(dp):                                   # pp_comm: the stages of one pipeline, top to bottom
        for t in range(tp):
            for p in range(pp - 1):
                (x0, y0), (x1, y1) = centre(d, p, t), centre(d, p + 1, t)
                ax.annotate("", (x1, y1 + h / 2), (x0, y0 - h / 2),
                            arrowprops=dict(arrowstyle="->", color=COLORS["pp"], lw=1.5), zorder=1)
    for p in range(pp):                                   # dp_comm: the same (p, t) in every replica
        for t in range(tp):
            if dp > 1:
                (x0, y0), (x1, _) = centre(0, p, t), centre(dp - 1, p, t)
                yy = y0 - h / 2 - 0.08 - 0.05 * t
                ax.plot([x0, x1], [yy, yy], color=COLORS["dp"], lw=1.2, ls="--", zorder=1)
                for d in range(dp):
                    ax.plot([centre(d, p, t)[0]], [yy], "o", color=COLORS["dp"], ms=3, zorder=1)
    for d in range(dp):
        x, _ = xy(d, 0, 0)
        ax.text(x + col_w / 2, pp * (h + gy) - gy / 2 + 0.05, f"replica dp={d}", ha="center", fontsize=8)
    handles = [ax.plot([], [], color=COLORS[c], lw=lw, ls=ls, label=label)[0] for c, lw, ls, label in
               (("tp", 6, "-", "tp_comm (one stage's tp ranks)"), ("pp", 1.5, "-", "pp_comm (the stages, ->)"),
                ("dp", 1.2, "--", "dp_comm (same shard, every replica)"))]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=7, frameon=False)
    ax.set_xlim(-0.3, dp * (col_w + sep) - sep + 0.3)
    ax.set_ylim(-0.6, pp * (h + gy) + 0.25)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"dp={dp} x pp={pp} x tp={tp}: rank = (dp_rank*pp + pp_rank)*tp + tp_rank, "
                          "(d,p,t) = (dp_rank, pp_rank, tp_rank)", fontsize=8)
    return save(fig, name)
