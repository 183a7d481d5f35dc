"""hsgd: hybrid-parallel SGD for GPT-style Transformers, written out in NumPy/CuPy and mpi4py.

    hsgd.ModelConfig        the model's shape (config.py)
    hsgd.backend            the one place that picks NumPy or CuPy
    hsgd.layers             forward/backward pairs of every layer
    hsgd.serial             the serial reference model: init_params, loss_and_grads
    hsgd.data               the corpus, the train/validation split and the batch of each step
    hsgd.grid               the dp x pp x tp process grid and its communicators (Split by color)
    hsgd.comm               every collective, recorded (calls, bytes, seconds) and optionally sequence-checked
    hsgd.tp_layers          tensor-parallel layers: f/g, column/row linears, all-gather/reduce-scatter, vocab-parallel
    hsgd.tp_model           the GPT split over a tensor-parallel group (Megatron, the lecture's gather scheme)
    hsgd.tp_sequence        sequence parallelism: the third tensor-parallel scheme, activations sharded along T
    hsgd.dp                 data parallelism: batch slices, flat gradient buffers, the average over dp_comm, buckets
    hsgd.zero               reduce-scatter + sharded optimizer + all-gather over dp_comm (ZeRO 1 and 2)
    hsgd.hier               hierarchical all-reduce: inside the node, across nodes, inside the node
    hsgd.pp                 pipeline parallelism: stages, micro-batches, GPipe and 1F1B schedules, bubbles
    hsgd.trace              a Chrome/Perfetto trace of every rank;  hsgd.plots: loss curves and per-rank timelines
    hsgd.optim              SGD, AdamW, the learning-rate schedule, global-norm clipping
    hsgd.hybrid             one rank's part of a training step on the dp x pp x tp grid
    hsgd.checkpoint         distributed checkpoints: shards per position, manifest, checksums, atomic, resharding
    hsgd.sample             python -m hsgd.sample DIR --prompt TEXT: text from any checkpoint
    hsgd.launch             fail fast: usage errors reported once, exceptions abort the whole job
    hsgd.settings           TrainConfig, the flags and TOML files;  hsgd.report: what rank 0 prints at the end
    hsgd.train              mpirun -n 8 python -m hsgd.train --help
    hsgd.verify             mpirun -n 8 python -m hsgd.verify: parallel gradients against serial, per parameter
"""
# First, before anything imports NumPy: hsgd.threads sets OPENBLAS_THREAD_TIMEOUT if NumPy is not loaded yet, and
# records whether it took effect (threads.openblas_note(); the module's docstring explains the setting).
from . import threads  # noqa: F401
from . import serial
from .config import ModelConfig

__all__ = ["ModelConfig", "serial"]
__version__ = "0.1.0"
