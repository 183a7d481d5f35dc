"""What a run with experts reports (hsgd.model.moe, hsgd.ep): each MoE block's routing, step by step and at the end.

After every step each stage's first tp rank hands its routing (hsgd.pp.stage.Stage.routing: the token-slots per
expert before drops, kept after them, and the dropped, summed over the step's micro-batches) to a pickled allgather
over the world (metadata, outside the step's counted traffic); rank 0 sums the dp x cp ranks' rows of each block.
The end of the run prints, per MoE block, the load per expert over the run (min, max, their ratio to an even share),
the slots dropped, and the all-to-all bytes on ep_comm of the measured step against their formula (from that
step's routing histogram: hsgd.ep.dispatch.all_to_all_formula); --plot draws the load per expert over the steps.
"""
import os

import numpy as np

from hsgd.model.backend import to_numpy


class RoutingLog:
    """Each step's {block: {"load", "kept" (E,), "dropped"}} summed over the ranks (on world rank 0)."""

    def __init__(self, cfg, world):
        self.cfg, self.world, self.steps = cfg, world, []

    def record(self, trainer):
        """Collective over the world: this step's routing of every stage's blocks, summed over the ranks that
        route other rows (every rank of tp rank 0)."""
        mine = {}
        if trainer.grid.tp_rank == 0:
            mine = {k: {n: to_numpy(v).copy() for n, v in r.items()} for k, r in trainer.stage.routing.items()}
        parts = self.world.gather(mine, root=0)
        if parts is None:
            return
        total = {}
        for part in parts:
            for k, r in part.items():
                old = total.setdefault(k, {n: 0 for n in r})
                for n, v in r.items():
                    old[n] = old[n] + v
        self.steps.append(dict(sorted(total.items(), key=lambda kv: int(kv[0].split(".")[1]))))

    def summary(self):
        """Lines of the end-of-run report (rank 0)."""
        if not self.steps:
            return []
        E, k = self.cfg.moe_experts, self.cfg.moe_top_k
        lines = [f"experts: {E} per MoE block, top-{k}, {len(self.steps)} steps"
                 + (f", capacity factor {self.cfg.moe_capacity_factor:g}" if self.cfg.moe_capacity_factor else
                    ", no capacity (nothing dropped)")]
        for block in self.steps[-1]:
            load = sum(np.asarray(s[block]["load"]) for s in self.steps)         # (E,) over the run
            dropped = sum(int(s[block]["dropped"]) for s in self.steps)
            even = load.sum() / E
            lines.append(f"  {block}: token-slots per expert min {int(load.min()):,} max {int(load.max()):,} "
                         f"(even share {even:,.0f}: max/even {load.max() / even:.2f}), dropped {dropped:,} of "
                         f"{int(load.sum()):,} ({dropped / max(load.sum(), 1):.1%})")
        return lines

    def plot(self, directory):
        """load.png: each expert's share of its block's token-slots over the steps, one panel per MoE block."""
        from hsgd.run.plots import pyplot
        plt = pyplot()
        os.makedirs(directory, exist_ok=True)
        blocks = list(self.steps[-1])
        fig, axes = plt.subplots(len(blocks), 1, figsize=(8, 2.2 * len(blocks) + 0.6), squeeze=False, sharex=True)
        for ax, block in zip(axes[:, 0], blocks):
            load = np.array([np.asarray(s[block]["load"], dtype=float) for s in self.steps])   # (steps, E)
            share = load / load.sum(axis=1, keepdims=True)
            for e in range(share.shape[1]):
                ax.plot(range(1, len(share) + 1), share[:, e], lw=0.8, label=f"expert {e}")
            ax.axhline(1.0 / share.shape[1], color="black", lw=0.6, ls="--", label="even share")
            ax.set_ylabel(f"{block}\nshare", fontsize=7)
            ax.grid(alpha=0.3)
        axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=6)
        axes[-1, 0].set_xlabel("step")
        axes[0, 0].set_title("token-slots routed to each expert (before drops), share of its block's", fontsize=9)
        fig.tight_layout()
        path = os.path.join(directory, "load.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def all_to_all_ratio(per_step, formula):
    """measured / formula bytes of the step's all-to-all on ep_comm (Alltoall and Alltoallv together), or None."""
    keys = [key for key in formula if key[0] == "ep"]
    if not keys:
        return None
    return sum(per_step.get(key, (0, 0))[1] for key in keys) / max(sum(formula[key][1] for key in keys), 1)
