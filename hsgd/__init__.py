"""hsgd: hybrid-parallel SGD for GPT-style Transformers, written out in NumPy/CuPy and mpi4py.

It implements the lecture "Parallel SGD in parallel and distributed systems: the algorithm that combines model
parallelism and data parallelism" (README, References) on P = dp x pp x cp x tp MPI ranks. The modules, in the order
of the algorithm:

  the model, one process
    hsgd.ModelConfig        the model's shape (config.py; config.flag: a field that is also a command-line flag)
    hsgd.backend            the one place that picks NumPy or CuPy, and counts device-to-host copies
    hsgd.layers             every layer as its plain formulas: forward/backward pairs, the reference
    hsgd.kernels            the same layers tuned (pieces, out=, threads, causal blocks), tested equal to them
    hsgd.ops                the one place the models choose their layer functions (the tuned kernels)
    hsgd.threads            CPU threads for the kernels and the batch split; OpenBLAS's thread timeout
    hsgd.serial             the serial reference model (plain layers) and serial.sgd, the run every layout matches
    hsgd.optim              SGD, AdamW, the learning-rate schedule, global-norm clipping
    hsgd.precision          rounding to bfloat16 and float16, emulated exactly; unit roundoff, Higham's gamma_n
    hsgd.loss_scale         dynamic loss scaling for float16 (PyTorch GradScaler's rules)
    hsgd.data               the corpus, the train/validation split and the batch of each step
  the ranks
    hsgd.grid               the dp x pp x cp x tp process grid and its communicators (Split by color)
    hsgd.comm               every collective, recorded (calls, bytes, seconds) and optionally sequence-checked
  tensor parallelism (the lecture's M workers of a group)
    hsgd.tp_layers          f/g, gather_T/scatter_T, column/row linears, all-gather and its adjoint, vocab-parallel
    hsgd.tp_schemes         the schemes as objects: Megatron, Gather (the lecture's), Sequence
    hsgd.tp_model           the GPT on a tensor-parallel group, written once for the three schemes
    hsgd.tp_shards          how each parameter splits over tp: its axis, the shards, the whole again
    hsgd.memory             activation bytes: measured and by formula; Korthikanti et al.'s and ZeRO's formulas
  context parallelism (the sequence split over ranks)
    hsgd.context            the context layout the model asks: a rank's positions and its core attention
    hsgd.cp                 the load-balanced split, the work and bytes of both schemes, make_split
    hsgd.ring_attention     ring attention: (k, v) around cp_comm, merged by the online softmax
    hsgd.gather_attention   the all-gather variant: every key and value gathered, dk, dv reduce-scattered
  pipeline parallelism
    hsgd.pp                 stages (and their model chunks), micro-batches, bytes on pp_comm
    hsgd.schedules          schedules as data: lists of F/B/W actions (GPipe, 1F1B, interleaved, ZB-H1), their
                            static check and simulation
    hsgd.timelines          what a schedule or its timeline says: bubbles, pairs and bytes held, closed forms
    hsgd.wgrad              the weight-gradient half of a backward pass, done at once or kept for a W action
    hsgd.stage              one rank's stage running its schedule (ThreadedStage: the batch split over threads)
  data parallelism (the lecture's G groups)
    hsgd.dp                 batch slices, flat buffers (FlatBuffer), the plain average over dp_comm
    hsgd.exchange           the gradient exchange: one interface; all-reduce, overlapped and stale exchanges
    hsgd.hier               the hierarchical all-reduce and its exchange: node, across nodes, node
    hsgd.zero               ZeRO 1: reduce-scatter, the owned chunk's update, all-gather
    hsgd.sharded            ZeRO 2 and 3 layer by layer (3: the parameters gathered per layer), hybrid sharding
  memory
    hsgd.memtrace           --memory: every array of a step attributed to a category by a real allocation tracker
    hsgd.step_memory        this implementation's bytes per category at the moments the tracker samples
  training
    hsgd.hybrid             one rank's part of a training step: gradients (steps 1-3), update (step 4)
    hsgd.health             a step's one host copy; stop or skip on a non-finite value
    hsgd.settings           TrainConfig: grouped dataclasses that generate the flags of hsgd.train and hsgd.verify
    hsgd.flags              the command lines made from those dataclasses, and reading them (and --config) back
    hsgd.train              mpirun -n 8 python -m hsgd.train --help: setup, loop, summary
    hsgd.progress           progress lines and the --log-json records;  hsgd.faults: --inject-fault
    hsgd.watch              the points of a step where something besides training acts (faults, --dump-step)
    hsgd.report             what rank 0 prints at the end;  hsgd.trace, hsgd.plots: a trace, loss curves, timelines
    hsgd.checkpoint         distributed checkpoints: shards per position, manifest, checksums, atomic, resharding
    hsgd.launch             fail fast: usage errors reported once, exceptions abort the whole job (hsgd.errors)
  tools
    hsgd.verify             mpirun -n 8 python -m hsgd.verify: parallel gradients against serial, per parameter
    hsgd.oracle             the tolerance oracle (verify --dtype bfloat16): rounding or a bug?  hsgd.mutations: bugs
    hsgd.schedule           python -m hsgd.schedule: a schedule drawn, its bubble and memory; --run measures them
    hsgd.sample             python -m hsgd.sample DIR --prompt TEXT: text from any checkpoint (hsgd.generate)
    hsgd.plan               python -m hsgd.plan: which layout, will it fit, how fast (a cost model: costs.py; hsgd's
                            own bytes and memory from sizes: layout.py; the published formulas and Table 1 of
                            Narayanan et al. 2021: paper.py, validate.py; hardware files and --calibrate)
    hsgd.crosscheck         python -m hsgd.crosscheck DIR: another system's (or hsgd's, --dump-step) gradients of one
                            step against the serial reference, per parameter, each wrong one classified (FORMAT.md:
                            the dump; dump.py, read.py, write.py, hsgd_dump.py, classify.py)
"""
# First, before anything imports NumPy: hsgd.threads sets OPENBLAS_THREAD_TIMEOUT if NumPy is not loaded yet, and
# records whether it took effect (threads.openblas_note(); the module's docstring explains the setting).
from . import threads  # noqa: F401
from . import serial
from .config import ModelConfig

__all__ = ["ModelConfig", "serial"]
__version__ = "0.1.0"
