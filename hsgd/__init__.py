"""hsgd: hybrid-parallel SGD for GPT-style Transformers, written out in NumPy/CuPy and mpi4py.

It implements the lecture "Parallel SGD in parallel and distributed systems: the algorithm that combines model
parallelism and data parallelism" (README, References) on P = dp x pp x cp x tp MPI ranks. The modules, in the order
of the algorithm:

  the model, one process
    hsgd.ModelConfig        the model's shape (config.py; config.flag: a field that is also a command-line flag)
    hsgd.model.backend            the one place that picks NumPy or CuPy, and counts device-to-host copies
    hsgd.model.layers             every layer as its plain formulas: forward/backward pairs, the reference
    hsgd.model.kernels            the same layers tuned (pieces, out=, threads, causal blocks), tested equal to them
    hsgd.model.ops                the one place the models choose their layer functions (the tuned kernels)
    hsgd.model.threads            CPU threads for the kernels and the batch split; OpenBLAS's thread timeout
    hsgd.model.serial             the serial reference model (plain layers) and serial.sgd, the run every layout matches
    hsgd.model.optim              SGD, AdamW, the learning-rate schedule, global-norm clipping
    hsgd.model.precision          rounding to bfloat16 and float16, emulated exactly; unit roundoff, Higham's gamma_n
    hsgd.step.loss_scale         dynamic loss scaling for float16 (PyTorch GradScaler's rules)
    hsgd.model.data               the corpus, the train/validation split and the batch of each step
  the ranks
    hsgd.grid.process_grid               the dp x pp x cp x tp process grid and its communicators (Split by color)
    hsgd.grid.comm               every collective, recorded (calls, bytes, seconds) and optionally sequence-checked
  tensor parallelism (the lecture's M workers of a group)
    hsgd.tp.layers          f/g, gather_T/scatter_T, column/row linears, all-gather and its adjoint, vocab-parallel
    hsgd.tp.schemes         the schemes as objects: Megatron, Gather (the lecture's), Sequence
    hsgd.tp.model           the GPT on a tensor-parallel group, written once for the three schemes
    hsgd.tp.shards          how each parameter splits over tp: its axis, the shards, the whole again
    hsgd.accounting.activations             activation bytes: measured and by formula; Korthikanti et al.'s and ZeRO's
    formulas
  context parallelism (the sequence split over ranks)
    hsgd.cp.layouts            the context layout the model asks: a rank's positions and its core attention
    hsgd.cp.split                 the load-balanced split, the work and bytes of both schemes, make_split
    hsgd.cp.ring     ring attention: (k, v) around cp_comm, merged by the online softmax
    hsgd.cp.allgather   the all-gather variant: every key and value gathered, dk, dv reduce-scattered
  pipeline parallelism
    hsgd.pp.chunks                 stages (and their model chunks), micro-batches, bytes on pp_comm
    hsgd.pp.schedules          schedules as data: lists of F/B/W actions (GPipe, 1F1B, interleaved, ZB-H1), their
                            static check and simulation
    hsgd.pp.timelines          what a schedule or its timeline says: bubbles, pairs and bytes held, closed forms
    hsgd.tp.wgrad              the weight-gradient half of a backward pass, done at once or kept for a W action
    hsgd.pp.stage              one rank's stage running its schedule (ThreadedStage: the batch split over threads)
  data parallelism (the lecture's G groups)
    hsgd.dp.average                 batch slices, flat buffers (FlatBuffer), the plain average over dp_comm
    hsgd.dp.exchange           the gradient exchange: one interface; all-reduce, overlapped and stale exchanges
    hsgd.dp.hierarchical               the hierarchical all-reduce and its exchange: node, across nodes, node
    hsgd.dp.zero1               ZeRO 1: reduce-scatter, the owned chunk's update, all-gather
    hsgd.dp.sharded            ZeRO 2 and 3 layer by layer (3: the parameters gathered per layer), hybrid sharding
  memory
    hsgd.accounting.allocations           --memory: every array of a step attributed to a category by a real allocation
    tracker hsgd.accounting.step_memory        this implementation's bytes per category at the moments the tracker samples
  training
    hsgd.step.trainer             one rank's part of a training step: gradients (steps 1-3), update (step 4)
    hsgd.step.health             a step's one host copy; stop or skip on a non-finite value
    hsgd.run.settings           TrainConfig: grouped dataclasses that generate the flags of hsgd.train and hsgd.verify
    hsgd.run.flags              the command lines made from those dataclasses, and reading them (and --config) back
    hsgd.train              mpirun -n 8 python -m hsgd.train --help: setup, loop, summary
    hsgd.run.progress           progress lines and the --log-json records;  hsgd.run.faults: --inject-fault
    hsgd.run.watchers              the points of a step where something besides training acts (faults, --dump-step)
    hsgd.run.report             what rank 0 prints at the end;  hsgd.grid.trace, hsgd.run.plots: a trace, loss curves,
    timelines hsgd.checkpoint.store         distributed checkpoints: shards per position, manifest, checksums, atomic,
    resharding hsgd.grid.launch             fail fast: usage errors reported once, exceptions abort the whole job
    (hsgd.errors)
  tools
    hsgd.verify             mpirun -n 8 python -m hsgd.verify: parallel gradients against serial, per parameter
    hsgd.check.oracle             the tolerance oracle (verify --dtype bfloat16): rounding or a bug?
    hsgd.check.mutations: bugs hsgd.schedule           python -m hsgd.schedule: a schedule drawn, its bubble and memory;
    --run measures them hsgd.sample             python -m hsgd.sample DIR --prompt TEXT: text from any checkpoint
    (hsgd.model.generate) hsgd.plan               python -m hsgd.plan: which layout, will it fit, how fast (a cost
    model: costs.py; hsgd's
                            own bytes and memory from sizes: layout.py; the published formulas and Table 1 of
                            Narayanan et al. 2021: paper.py, validate.py; hardware files and --calibrate)
    hsgd.crosscheck         python -m hsgd.crosscheck DIR: another system's (or hsgd's, --dump-step) gradients of one
                            step against the serial reference, per parameter, each wrong one classified (FORMAT.md:
                            the dump; dump.py, read.py, write.py, hsgd_dump.py, classify.py)
"""
# First, before anything imports NumPy: hsgd.model.threads sets OPENBLAS_THREAD_TIMEOUT if NumPy is not loaded yet, and
# records whether it took effect (threads.openblas_note(); the module's docstring explains the setting).
from hsgd.model import threads  # noqa: F401
__version__ = "0.1.0"
