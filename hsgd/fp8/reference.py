"""The serial FP8 reference: hsgd.model.serial.sgd with the block linears cast as a layout casts them, the run every
FP8 layout's exact mode (--dtype float64) must reproduce (tests/mpi/test_fp8.py, chapter 15).

A layout casts one micro-batch of one data-parallel replica at a time (current scaling takes its amax over that
tensor), and each replica differentiates the mean loss of its own rows and positions, so the output gradients it
casts are dp cp times the global batch's (a fixed scale, delayed scaling's first step, sees the difference). The
reference therefore computes the batch B/(dp m) sequences at a time (serial.sgd's sliced micro_sequences), each
slice's backward seeded as a replica's (replicas = dp cp), and moves the amax histories on after every step.
"""
from hsgd.fp8.linear import Fp8Ops
from hsgd.fp8.scaling import make_fp8
from hsgd.model import layers, serial


def serial_fp8_sgd(cfg, tc, batch, replicas=None):
    """tc.steps steps of the serial FP8 reference of layout tc (its dp, cp, micro-batches and FP8 settings) on the
    global batches batch(step), from the float64 weights of tc.seed. replicas: dp cp unless given. Returns
    (params, losses, the amax histories {operand: [amax, ...]})."""
    fp8 = make_fp8(tc.fp8_settings())
    params = serial.init_params(cfg, seed=tc.seed, dtype="float64")
    ops = Fp8Ops(layers, fp8)
    ops.bind(params)
    params, losses = serial.sgd(cfg, tc, batch, params, micro_sequences=tc.batch_size // (tc.dp * tc.micro_batches),
                                ops=ops, after_step=fp8.end_step, sliced=True,
                                replicas=tc.dp * tc.cp if replicas is None else replicas)
    return params, losses, fp8.histories
