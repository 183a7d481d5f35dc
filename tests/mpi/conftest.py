"""Helpers for tests that run on every rank of `mpiexec -n 8` (see tests/test_mpi.py).

Rule: a test computes its local verdict, then `check(ok, msg)` agrees on it over COMM_WORLD before asserting,
so that every rank fails together and nobody is left waiting in a collective.
"""
import pytest
from mpi4py import MPI
from threadpoolctl import threadpool_limits

WORLD = MPI.COMM_WORLD

threadpool_limits(1)                                  # eight ranks share the cores


def pytest_collection_modifyitems(items):
    """pytest-timeout's thread method for every test here, however the file is run: a rank stuck in a blocking MPI
    call (another rank raised before a collective) never returns to Python, so a signal cannot end it; the thread
    method dumps the stacks and exits the process, and mpiexec then ends the other ranks."""
    for item in items:
        item.add_marker(pytest.mark.timeout(180, method="thread"))


def check(ok, msg=""):
    """Collective assertion: passes on every rank iff `ok` holds on every rank."""
    oks = WORLD.allgather(bool(ok))
    bad = [r for r, o in enumerate(oks) if not o]
    assert not bad, f"failed on ranks {bad}: {msg}"


def say(*args):
    """Print on world rank 0 only."""
    if WORLD.Get_rank() == 0:
        print(*args, flush=True)


def world_max(x):
    return WORLD.allreduce(float(x), op=MPI.MAX)


def float64_config(**kw):
    """The settings of a float64 test run (SGD with momentum 0.9 at lr 0.05, seed 3, 2 steps of 16 sequences),
    kw changing any field: the one place the MPI tests build a TrainConfig."""
    from hsgd.step.settings import TrainConfig
    return TrainConfig(**{**dict(steps=2, batch_size=16, lr=0.05, momentum=0.9, dtype="float64", seed=3), **kw})


SERIAL = {}


def serial_params(cfg, corpus, tc, delayed=False):
    """Serial SGD's parameters after tc.steps steps on `corpus`'s batches: what every layout must end with. They
    depend on the model, the batches and the optimizer's settings, not on the layout, the micro-batches, the
    schedule, recomputation or ZeRO (hsgd.model.serial.sgd), so the tests that share these share one serial run,
    computed once per process on rank 0 alone and broadcast (the same bits on every rank, without eight ranks
    repeating it on the machine's cores). Read it, never write it."""
    from hsgd.model import serial
    key = (cfg, id(corpus), tc.steps, tc.batch_size, tc.seed, tc.optimizer, tc.lr, tc.momentum, tc.weight_decay,
           tc.clip, tc.warmup, delayed)
    if key not in SERIAL:
        mine = (serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size), delayed=delayed)[0]
                if WORLD.Get_rank() == 0 else None)
        SERIAL[key] = WORLD.bcast(mine, root=0)
    return SERIAL[key]


@pytest.fixture
def world():
    return WORLD


def train_steps(cfg, corpus, tc, tracer=None):
    """tc.steps training steps on a new (dp, pp, tp) grid over COMM_WORLD. Returns (grid, trainer, whether the DP
    replicas were bit-identical after every step, the communication of step 2 {(comm, op): (calls, bytes)})."""
    from hsgd.dp.average import params_digest
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    grid = ProcessGrid(WORLD, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp)
    trainer = HybridTrainer(cfg, grid, tc, tracer)
    if tracer:
        for c in (grid.tp_comm, grid.cp_comm, grid.dp_comm, grid.pp_comm):
            c.tracer = tracer
    identical, per_step = True, None
    for step in range(1, tc.steps + 1):
        before = grid.stats.counts()
        trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
        if step == 2:
            per_step = grid.stats.since(before)
        identical &= len(set(grid.dp_comm.allgather_obj(params_digest(trainer.params)))) == 1
    trainer.finish()
    return grid, trainer, identical, per_step
