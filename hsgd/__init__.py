"""hsgd: hybrid-parallel SGD for GPT-style Transformers, written out in NumPy/CuPy and mpi4py.

It implements the lecture "Parallel SGD in parallel and distributed systems: the algorithm that combines model
parallelism and data parallelism" (README, References) on P = dp x pp x cp x tp MPI ranks. The map: one package per
part of the algorithm, in the course's order; a part imports only the parts above it in this list (tests/
test_package_map.py holds that), and each package's docstring lists its modules and the chapter that teaches them.

    hsgd.errors        the exceptions every part raises, and the exit codes they end a job with
    hsgd.files         files read and written, checked first: regular inputs, writable outputs, optional modules
    hsgd.readers       bounded readers of JSON, TOML and .npz (size and nesting checked before parsing), and
                       printable() for text from a file
    hsgd.cli           the parser of every command: a usage error is one line and exit code 2, --help is full
    hsgd.model         the model on one process: layers as forward/backward pairs, the serial reference, the
                       optimizer, the number formats, the data (chapter 1; appendix A)
    hsgd.grid          the ranks: the process grid, its communicators, every collective counted (chapters 2, 3)
    hsgd.fp8           FP8 matrix products emulated exactly: scaling recipes, the amax and the ranks it is
                       reduced over, limited accumulation (chapter 15)
    hsgd.tp            tensor parallelism, the lecture's M workers of a group: split linears, heads, vocabulary,
                       the model written once for three schemes (chapters 5, 6)
    hsgd.cp            context parallelism: the sequence split over ranks, ring and all-gather attention (chapter 13)
    hsgd.ep            expert parallelism: a MoE block's experts split over ranks folded out of dp x cp, tokens
                       sent to them by all-to-all (chapter 16)
    hsgd.pp            pipeline parallelism: stages, micro-batches, schedules as data (chapters 9, 12)
    hsgd.dp            data parallelism, the lecture's G groups: the gradient exchange and its ways, ZeRO 1-3
                       (chapters 4, 8)
    hsgd.step          one training step, the lecture's steps 1 to 4: the trainer, its settings, health and loss
                       scale (chapters 10, 14)
    hsgd.accounting    bytes per communicator and memory per category, by formula and measured (chapter 11)
    hsgd.checkpoint    distributed checkpoints that reshard (chapter 19)
    hsgd.run           a training run around the steps: flags, checks, progress, reports, faults, signals
    hsgd.check         the tolerance oracle and bugs on purpose (chapter 14)
    hsgd.plan          python -m hsgd.plan: which layout, will it fit, how fast (chapter 17)
    hsgd.crosscheck    python -m hsgd.crosscheck DIR: another system's gradients against the reference (chapter 20)

The commands, at the top:

    hsgd.train         mpirun -n 8 python -m hsgd.train: setup, the loop, the summary
    hsgd.verify        mpirun -n 8 python -m hsgd.verify: every parallel gradient against serial, per parameter
    hsgd.schedule      python -m hsgd.schedule: a pipeline schedule drawn, its bubble and memory; --run measures them
    hsgd.sample        python -m hsgd.sample DIR --prompt TEXT: text from any checkpoint
    (and python -m hsgd.grid, python -m hsgd.checkpoint, python -m hsgd.plan, python -m hsgd.crosscheck)
"""
# First, before anything imports NumPy: hsgd.model.threads sets OPENBLAS_THREAD_TIMEOUT if NumPy is not loaded yet, and
# records whether it took effect (threads.openblas_note(); the module's docstring explains the setting).
from hsgd.model import threads  # noqa: F401

__version__ = "0.1.0"
