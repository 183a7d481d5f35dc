"""Solutions to the exercises of chapter 8 (tutorials/08_communication_optimizations.py).

    mpirun -n 4 python tutorials/solutions/08_communication_optimizations.py

Each solution checks itself against serial SGD, against hsgd's own formulas or against what CommStats measured;
every check is collective, so a failure stops every rank at the same point.
"""
# mpirun -n 4 python tutorials/solutions/08_communication_optimizations.py
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from hsgd.model.config import ModelConfig  # noqa: E402  (hsgd before NumPy: OpenBLAS's thread timeout)
from hsgd.model import layers, serial

import math  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from hsgd.model.data import Corpus  # noqa: E402
from hsgd.dp.average import FlatBuffer, dp_rows  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.dp.hierarchical import cross_node_bytes, hierarchical_allreduce, node_split  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.model.optim import lr_at  # noqa: E402

from checks import Checks, rel_err, solve, train_config  # noqa: E402

threadpool_limits(1)                    # four ranks share the cores: one BLAS thread each
world = MPI.COMM_WORLD
P = 4
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)   # chapter 8's toy
SEED, B = 0, 8
corpus = Corpus.load(None, cfg.seq_len)


def exercise_1(check):
    """ZeRO-3 by hand: the parameters sharded over dp too, gathered group by group."""
    grid = ProcessGrid(world, dp=P, tp=1)
    dp, r, lr, s = grid.dp_comm.size, grid.dp_comm.rank, 0.1, 8
    shapes = cfg.param_shapes()
    groups = {"embedding": ["wte", "wpe"]}
    groups.update({f"h.{i}": [n for n in shapes if n.startswith(f"h.{i}.")] for i in range(cfg.n_layers)})
    groups["head"] = ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    ref = serial.init_params(cfg, SEED, "float64")               # serial SGD's parameters, on every rank
    sizes = {g: sum(math.prod(shapes[n]) for n in names) for g, names in groups.items()}
    chunk = {g: -(-n // dp) for g, n in sizes.items()}           # ceil(n / dp): the group padded to dp chunks
    mine = {}                                                    # my chunk of every group: all I keep
    for g, names in groups.items():
        flat = np.zeros(dp * chunk[g])
        flat[:sizes[g]] = np.concatenate([ref[n].ravel() for n in names])
        mine[g] = flat[r * chunk[g]:(r + 1) * chunk[g]].copy()   # (chunk,)

    def gather(g):
        """All-Gather group g's parameters from the dp chunks: {name: array}, views of a fresh buffer."""
        full = np.empty((dp, chunk[g]))
        grid.dp_comm.Allgather(mine[g], full)                    # payload: dp * chunk * s
        out, flat, at = {}, full.reshape(-1), 0
        for n in groups[g]:
            out[n] = flat[at:at + math.prod(shapes[n])].reshape(shapes[n])
            at += math.prod(shapes[n])
        return out

    def reduce_scatter_and_update(g, grads):
        """Reduce-Scatter group g's gradient (averaged over dp) and update my chunk of it with SGD."""
        full = np.zeros(dp * chunk[g])
        full[:sizes[g]] = np.concatenate([grads[n].ravel() for n in groups[g]])
        part = np.empty(chunk[g])
        grid.dp_comm.Reduce_scatter_block(full.reshape(dp, chunk[g]), part)   # payload: dp * chunk * s
        mine[g] -= lr * part / dp

    def head_forward(x, p, targets):
        xf, c_lnf = layers.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])
        logits, c_head = layers.linear_forward(xf, p["lm_head.weight"])
        loss, c_ce = layers.cross_entropy_forward(logits, targets)
        return loss, (c_lnf, c_head, c_ce)

    rows = dp_rows(B, dp, r)
    for step in (1, 2):
        idx, targets = corpus.batch(SEED, step, B)
        before = grid.stats.counts()
        # forward: gather a group, run it, drop its parameters; keep only each group's input
        p = gather("embedding")
        x, _ = layers.embedding_forward(idx[rows], p["wte"], p["wpe"])
        inputs = {}
        for i in range(cfg.n_layers):
            inputs[i], p = x, gather(f"h.{i}")
            x, _ = serial.block_forward(x, p, f"h.{i}.", cfg)
        inputs["head"], p = x, gather("head")
        head_forward(x, p, targets[rows])
        del p
        # backward: gather again, recompute the group's forward from its input, backward, Reduce-Scatter
        p = gather("head")
        _, (c_lnf, c_head, c_ce) = head_forward(inputs["head"], p, targets[rows])
        grads = {n: np.zeros(shapes[n]) for n in groups["head"]}
        dxf = layers.linear_backward(layers.cross_entropy_backward(1.0, c_ce), c_head, grads["lm_head.weight"])
        dx = layers.layernorm_backward(dxf, c_lnf, grads["ln_f.weight"], grads["ln_f.bias"])
        reduce_scatter_and_update("head", grads)
        for i in reversed(range(cfg.n_layers)):
            p = gather(f"h.{i}")
            _, cache = serial.block_forward(inputs[i], p, f"h.{i}.", cfg)
            grads = {n: np.zeros(shapes[n]) for n in groups[f"h.{i}"]}
            dx = serial.block_backward(dx, cache, grads, f"h.{i}.", cfg)
            reduce_scatter_and_update(f"h.{i}", grads)
        grads = {"wte": np.zeros(shapes["wte"]), "wpe": np.zeros(shapes["wpe"])}
        layers.embedding_backward(dx, idx[rows], grads["wte"], grads["wpe"])   # needs the token ids only
        reduce_scatter_and_update("embedding", grads)
        traffic = grid.stats.since(before)

        _, grads_ref = serial.loss_and_grads(ref, idx, targets, cfg)           # serial SGD on the global batch
        for n, g in grads_ref.items():
            ref[n] -= lr * g
        everything = {n: a for g in groups for n, a in gather(g).items()}      # (an extra gather, for the check)
        check(f"step {step}: every parameter vs serial SGD", max(rel_err(everything[n], ref[n], floor=0.02)
                                                                 for n in ref), 1e-12)
    phi = sum(dp * c * s for c in chunk.values())                              # padded parameter bytes
    phi_emb = dp * chunk["embedding"] * s
    expected = {("dp", "Allgather"): (2 * len(groups) - 1, 2 * phi - phi_emb),
                ("dp", "Reduce_scatter_block"): (len(groups), phi)}
    ring = (dp - 1) / dp * (expected[("dp", "Allgather")][1] + phi)
    check.say(f"  one step: All-Gather {expected[('dp', 'Allgather')]}, Reduce-Scatter "
              f"{expected[('dp', 'Reduce_scatter_block')]} (calls, payload); a ring sends {ring:,.0f} bytes per rank, "
              f"{ring / (2 * (dp - 1) / dp * phi):.2f}x an All-Reduce of the gradients")
    check.equal("step 2's (calls, payload) == 2 Phi - Phi_embedding gathered, Phi scattered", traffic, expected)
    grid.free()


def exercise_2(check):
    """The bucket size that lets overlap hide the exchange."""
    p, alpha, beta, phi, t_b = 8, 5e-6, 25e9, 500e6, 0.1   # ranks, s, bytes/s, bytes, s
    rate = phi / t_b                                        # gradient bytes produced per second of backward

    def t(S):
        """One bucket's ring All-Reduce: 2 (p-1) latencies and 2 (p-1)/p of the bucket over the link."""
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * S / beta

    s_star = 2 * (p - 1) * alpha / (1 / rate - 2 * (p - 1) / (p * beta))     # t(S) = S / rate
    n_best = math.floor(phi / s_star)                                        # the most buckets that keep up

    def exposed_formula(n):
        S = phi / n
        if n <= n_best:
            return t(S)                                      # the last bucket alone is exposed
        return S / rate + n * (t(S) - S / rate)              # the exchange falls behind: back to back from bucket 1

    def exposed_simulated(n):
        """Buckets ready at i * S / rate, sent one at a time in order: the end of the last minus the backward's."""
        S, end = phi / n, 0.0
        for i in range(1, n + 1):
            end = max(i * S / rate, end) + t(S)
        return end - t_b

    candidates = sorted(set(range(1, 3001, 97)) | {1, n_best - 2, n_best - 1, n_best, n_best + 1, n_best + 2})
    simulated = {n: exposed_simulated(n) for n in candidates}
    best = min(simulated, key=simulated.get)
    check.say(f"  S* = {s_star / 1e6:.3f} MB, so at most {n_best} buckets keep up; exposed then "
              f"{1e3 * exposed_formula(n_best):.3f} ms, against {1e3 * t(phi):.1f} ms for one All-Reduce after the "
              f"backward pass (n = 1)")
    check.equal("the simulation's best number of buckets == floor(Phi / S*)", best, n_best)
    check("exposed time: formula vs simulation, every candidate n",
          max(abs(exposed_formula(n) - v) / v for n, v in simulated.items()), 1e-9)


def exercise_3(check):
    """The bytes that leave a node: flat ring vs hierarchical, by formula and measured."""
    s, N = 8, 1_000_003                                      # float64; a size most node widths do not divide
    phi = N * s
    worst = 0.0
    for total in (4, 8, 16, 64):
        for n in (d for d in range(1, total + 1) if total % d == 0):
            k = total // n
            m = -(-N // n)                                   # the chunk each rank sends across, padded
            flat = {"payload": phi, "ring": 2 * (total - 1) / total * phi} if k > 1 else {"payload": 0, "ring": 0}
            hier = {"payload": m * s if k > 1 else 0, "ring": 2 * (k - 1) / k * m * s}   # one node: stays in
            x = cross_node_bytes(phi, n, k, s)
            worst = max(worst, abs(x["flat_ring"] - flat["ring"]) / phi, abs(x["hier"] - hier["ring"]) / phi)
            if total == 64 and n in (1, 8, 64):
                check.say(f"  {k:>2} x {n:>2} (nodes x ranks): flat ring's busiest link {flat['ring']:>12,.0f} B "
                          f"(payload {flat['payload']:,}), hierarchical per link {hier['ring']:>12,.0f} B "
                          f"(payload {hier['payload']:,})")
    check("my ring bytes vs cross_node_bytes, every n x k of 4, 8, 16, 64", worst, 1e-15)

    grid = ProcessGrid(world, dp=P, tp=1)                    # measured: 4 ranks as 2 nodes x 2
    node, cross = node_split(grid.dp_comm, ranks_per_node=2)
    n_small = 1001
    x = np.random.default_rng(grid.rank).standard_normal(n_small)
    total = sum(np.random.default_rng(q).standard_normal(n_small) for q in range(P))
    before = grid.stats.counts()
    hierarchical_allreduce(x, node, cross)
    measured = grid.stats.since(before)[("dp-cross", "Allreduce")][1]
    mine = -(-n_small // 2) * s
    check("hierarchical_allreduce vs the sum of all four inputs", rel_err(x, total), 1e-12)
    check.equal("dp-cross payload measured == ceil(N/n) * s", measured, mine)
    check.equal("2 (k-1)/k x measured == cross_node_bytes(...)['hier']", 2 * (2 - 1) / 2 * measured,
                cross_node_bytes(n_small * s, 2, 2, s)["hier"])
    node.free()
    cross.free()
    grid.free()


def exercise_4(check):
    """Staleness 1 by hand, against delayed serial SGD and HybridTrainer(dp_staleness=1)."""
    steps, lr, warmup = 5, 0.1, 2
    grid = ProcessGrid(world, dp=P, tp=1)
    dp, rows = grid.dp_comm.size, dp_rows(B, grid.dp_comm.size, grid.dp_comm.rank)
    mine = serial.init_params(cfg, SEED, "float64")          # the whole model on every rank (tp = 1)
    ref = serial.init_params(cfg, SEED, "float64")           # delayed serial SGD
    in_flight, pending_ref = None, None                      # (request, buffer) of the last step; serial's pending
    for step in range(1, steps + 1):
        idx, targets = corpus.batch(SEED, step, B)
        rate = lr_at(step, lr, warmup, steps)
        buf = FlatBuffer(mine)                               # a fresh buffer: the one in flight stays untouched
        serial.loss_and_grads(mine, idx[rows], targets[rows], cfg, grads=buf.views)
        started = (grid.dp_comm.comm.Iallreduce(MPI.IN_PLACE, buf.flat), buf)   # this step's sum: starts now
        if in_flight is not None:                            # apply the average started one step ago
            in_flight[0].Wait()
            for n, g in in_flight[1].views.items():
                mine[n] -= rate * g / dp
        in_flight = started
        _, g = serial.loss_and_grads(ref, idx, targets, cfg)
        if pending_ref is not None:
            for n in ref:
                ref[n] -= rate * pending_ref[n]
        pending_ref = g
    in_flight[0].Wait()                                      # the last exchange completes; it is not applied

    tc = train_config(tp=1, dp=dp, steps=steps, batch_size=B, lr=lr, warmup=warmup, momentum=0.0, dp_staleness=1,
                      seed=SEED)
    trainer = HybridTrainer(cfg, grid, tc)
    for step in range(1, steps + 1):
        trainer.step(*corpus.batch(SEED, step, B), step)
    trainer.finish()
    delayed, _ = serial.sgd(cfg, tc, lambda st: corpus.batch(SEED, st, B), delayed=True)

    def err(a, b):
        return max(rel_err(a[n], b[n], floor=0.02) for n in b)

    check(f"{steps} steps by hand vs delayed serial SGD (by hand)", err(mine, ref), 1e-12)
    check(f"{steps} steps by hand vs HybridTrainer(dp_staleness=1)", err(mine, trainer.params), 1e-12)
    check("delayed serial SGD (by hand) vs serial.sgd(delayed=True)", err(ref, delayed), 1e-12)
    trainer.free()
    grid.free()


if __name__ == "__main__":
    if world.Get_size() != P:
        raise SystemExit(f"run on {P} ranks: mpirun -n {P} python tutorials/solutions/08_communication_optimizations.py"
                         if world.Get_rank() == 0 else 1)
    solve(Checks(world, tol=1e-12, width=66), [exercise_1, exercise_2, exercise_3, exercise_4])
