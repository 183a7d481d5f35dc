"""hsgd.train --dump-step N DIR: step N of an hsgd run written as a crosscheck dump (FORMAT.md), by a step watcher.

    before step N      the whole parameters (HybridTrainer.full_params: every stage's, tp-gathered; ZeRO-3's
                       All-Gathered) and the global batch, kept on rank 0
    after gradients    every rank's averaged gradient shards (HybridTrainer.averaged_grads: ZeRO's chunks
                       All-Gathered; a float16 run's loss scale divided out), the global loss; then, as one set
                       of files of one run (hsgd.crosscheck.manifest): rank 0 removes what an earlier dump left in
                       DIR, each rank writes its grads-rank{r}.npz, rank 0 the layout from every rank's shard
                       descriptions (gathered) and, last, dump.json listing every file's size and sha256

hsgd stores weights (in, out) under the reference's names, so no tensor is transposed or fused. A shard is the
tp split of its parameter (tp_shards: axis, rank tp_rank's equal part; the vocabulary's ceil(V/tp) rows with the
padding past V in the last ranks; with fewer kv heads than tp ranks, attn.k and attn.v's one head a rank reads, the
same slice on tp/NKV ranks), or the whole parameter (replicated, or tp = 1); the dp and cp ranks hold replicas, a
pipeline stage its own layers, and with --ep an expert is on its ep rank's ranks only (hsgd.ep.layout.holds: its
shards are listed where they are). With experts, "parallel" gives ep too, and with auxiliary-loss-free balancing
layout.json's "selection_bias" the biases the step routed with. The run goes on unchanged after the dump.
"""
import numpy as np

from hsgd.grid import launch
from hsgd.tp import shards as tp_shards
from hsgd.grid.process_grid import ProcessGrid
from hsgd.dp.average import global_loss
from hsgd.step.trainer import HybridTrainer
from hsgd.model.backend import to_numpy
from hsgd.errors import ConfigError
from hsgd.tp.layers import vocab_range
from hsgd.run.watchers import StepWatcher
from .manifest import clean, new_run, write_manifest
from .write import shard_entry, write_layout, write_rank


class DumpStep(StepWatcher):
    def __init__(self, step, path, cfg, tc, say=lambda line: None):
        """Dump step `step` of the run (cfg, tc) into folder `path`; say(line): what the run prints (hsgd.train's
        prints on rank 0 only), called on every rank."""
        self.step, self.path, self.cfg, self.tc, self.say = step, path, cfg, tc, say
        self.params = self.batch = None

    def before_step(self, step, trainer, batch):
        if step == self.step:
            self.params = trainer.full_params()                           # (collective: pickled, small models)
            self.batch = batch

    def after_gradients(self, trainer, step, loss):
        if step != self.step:
            return
        grid, tc = trainer.grid, self.tc
        world, rank = grid.world.comm, grid.world.rank                    # (the mpi4py communicator: pickled)
        scale = trainer.scaler.made_with(0)                               # float16: the gradients were of S x loss
        grads = {n: host(g) for n, g in trainer.averaged_grads().items()}   # unscaled (collective with ZeRO)
        loss = global_loss(float(to_numpy(loss)), grid)                 # (collective)
        mine = {n: shard_of(n, self.cfg, grid.tp_rank, grid.tp, tc.tp_scheme, rank) for n in grads}
        biases = {k: host(b) for k, b in trainer.stage.biases.items()}   # the selection biases of the stage's MoE
        everyone = world.gather((mine, biases))                           # blocks (E,) each, as step N used them
        run = world.bcast(new_run() if rank == 0 else None)               # the id every file is stamped with

        def layout():
            tensors, selection_bias = {}, {k: b for _, d in everyone for k, b in d.items()}
            for name, shape in self.cfg.param_shapes().items():
                shards = [d[name] for d, _ in everyone if name in d]      # its holders: a stage's, an expert's
                tensors[name] = {"shape": list(shape), "dtype": tc.dtype, "shards": shards}
            idx, targets = self.batch
            experts = f", experts over ep {tc.ep}" if tc.ep > 1 else ""
            system = (f"hsgd dp {tc.dp} x pp {tc.pp} x cp {tc.cp} x tp {tc.tp} ({tc.tp_scheme}){experts}, zero "
                      f"{tc.zero}, {tc.micro_batches} micro-batch(es), schedule {tc.schedule}, recompute "
                      f"{tc.recompute}, step {step}")
            return write_layout(self.path, system=system, cfg=self.cfg, dtype=tc.dtype, loss=loss,
                                ranks=world.Get_size(),
                                parallel={"dp": tc.dp, "tp": tc.tp, "pp": tc.pp, "cp": tc.cp,
                                          "micro_batches": tc.micro_batches, "ep": tc.ep},
                                tensors=tensors, params={n: host(a) for n, a in self.params.items()},
                                idx=to_numpy(idx), targets=to_numpy(targets), run=run, selection_bias=selection_bias)

        def finish():                                                     # rank 0, once every rank's file is whole
            if rank == 0:
                entries = layout()
                for f in files:
                    entries.update(f)
                write_manifest(self.path, run, world.Get_size(), entries)   # dump.json, last

        # one set of files (hsgd.crosscheck.manifest): an earlier dump's files removed before any rank writes,
        # dump.json after all; each phase agreed, so that a write error is one line on every rank
        removed = self.agree(world, lambda: clean(self.path) if rank == 0 else [])
        files = world.gather(self.agree(world, lambda: write_rank(self.path, rank, grads, run)))
        self.agree(world, finish)
        again = f"; it replaced an earlier dump's {len(removed)} files there" if removed else ""
        self.say(f"dump of step {step}: {self.path} (check it: python -m hsgd.crosscheck {self.path}){again}")
        if not all(np.isfinite(g).all() for g in grads.values()) and trainer.scaler.dynamic:
            self.say(f"note: step {step}'s gradients overflowed at loss scale {scale:g}: hsgd skips this update and "
                     "halves the scale; the dump holds the overflowed gradients (crosscheck calls them not finite)")
        self.params = self.batch = None

    def agree(self, world, fn):
        """fn() on every rank, agreed (hsgd.grid.launch.agree); an OSError (a full disk, a folder made read-only)
        is one line on every rank."""
        def guarded():
            try:
                return fn()
            except OSError as e:
                raise ConfigError(f"--dump-step: {self.path!r} cannot be written ({e.strerror}); choose another "
                                  "folder") from None
        return launch.agree(world, guarded)


def host(a):
    """A NumPy copy for the .npz files: float64 as it is, the narrower formats as float32 (bfloat16 has no NumPy
    type .npz can hold)."""
    a = np.asarray(to_numpy(a))
    return a.astype(np.float64 if a.dtype == np.float64 else np.float32)


def shard_of(name, cfg, tp_rank, tp, scheme, rank):
    """The shard entry of this rank's piece of `name` (tp_shards' split)."""
    kind, axis = tp_shards.split_of(name, scheme)
    if kind == "rep" or tp == 1:
        return shard_entry(rank)
    n = cfg.param_shapes()[name][axis]
    if kind == "vocab":
        start, size = vocab_range(n, tp, tp_rank)                         # ceil(V/tp) ids, padded past V
        length = max(0, min(size, n - start))
        return shard_entry(rank, axis, min(start, n), length, size - length)
    if tp_shards.kv_shared(name, cfg, tp):                                # NKV < tp: kv head r // (tp/NKV), the
        size = n // cfg.n_kv_heads                                        # same slice on tp/NKV ranks (replicas)
        return shard_entry(rank, axis, tp_rank // (tp // cfg.n_kv_heads) * size, size)
    size = n // tp
    return shard_entry(rank, axis, tp_rank * size, size)


def dump_one_step(cfg, tc, world, path, corpus, say=lambda line: None):
    """Collective over world: step 1 of tc's layout, from tc.seed's weights on corpus's first batch, dumped into
    path, as hsgd.train --dump-step 1 would, without the rest of the run (tests, the chapter)."""
    grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer = None
    try:
        trainer = HybridTrainer(cfg, grid, tc)
        watcher, batch = DumpStep(1, path, cfg, tc, say), corpus.batch(tc.seed, 1, tc.batch_size)
        watcher.before_step(1, trainer, batch)
        watcher.after_gradients(trainer, 1, trainer.gradients(*batch))
    finally:
        if trainer is not None:
            trainer.finish()
            trainer.free()
        grid.free()
