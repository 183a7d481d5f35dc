"""A step's numbers on the host, and what happens when one of them is not finite.

On a GPU every host copy stalls the device, so a training step copies back exactly one small vector
(`step_numbers`), from which the trainer reads everything it must decide on the host: the loss, whether any value
is not finite, and the two sums of squares that give the global gradient norm (hsgd.model.optim.norm_from_squares).

`check_finite` applies --on-nan: the ranks first agree on where a non-finite value appeared (a pickled allgather,
so that every rank takes the same branch), then either stop the run (NumericalFault: every rank exits 3 with one
message) or report that this step's update is to be skipped.
"""
import math
from typing import NamedTuple

import numpy as np

from hsgd.model.backend import array_module, to_host
from hsgd.errors import NumericalFault
from hsgd.model.optim import norm_from_squares


class StepNumbers(NamedTuple):
    loss: float            # this DP group's loss (on the last pipeline stage; 0.0 before it)
    bad: bool              # the loss or a value of the checked gradient is not finite
    sq_sharded: float      # sum of squares of the gradient to apply, over tensor-sharded elements
    sq_replicated: float   # ... over the others


def step_numbers(loss, checked, grads, sharded):
    """StepNumbers from one device-to-host copy. grads: the flat gradient to apply, or None (nothing to apply: sums
    0), usually `checked` itself; sharded: a mask of grads' shape, 1 where split over tp, 0 where replicated, a
    fraction for a kv head tp ranks hold alike (HybridTrainer.norm_weight; masks by multiplication: no device
    sync).
    A NaN or an infinity anywhere in `checked` makes its sum of squares non-finite, which is how it is found (so
    does a finite value whose square overflows, |x| > 1e154 in float64 or 1e19 in float32: a gradient no run
    survives either)."""
    xp = array_module(checked)
    zero = xp.zeros((), dtype=checked.dtype)
    if grads is None:
        sq_sharded, sq_replicated = zero, zero
        sq_checked = masked_square_sums(checked)[1]
    else:
        sq_sharded, sq_replicated = masked_square_sums(grads, sharded)
        sq_checked = (sq_sharded + sq_replicated if checked is grads
                      else masked_square_sums(checked)[1])
    host = to_host(xp.stack([xp.asarray(loss, dtype=checked.dtype), sq_checked, sq_sharded, sq_replicated]))
    loss, sq_checked, sq_sharded, sq_replicated = (float(x) for x in host)
    return StepNumbers(loss, not (math.isfinite(loss) and math.isfinite(sq_checked)), sq_sharded, sq_replicated)


def all_finite(x):
    """Whether every element of the flat array x is finite: its sum of squares is (one device-to-host copy)."""
    return math.isfinite(float(to_host(masked_square_sums(x)[1])))


def masked_square_sums(x, mask=None, block=1 << 15):
    """(sum of x^2 where mask is 1, sum of x^2 where mask is 0), as device scalars (no mask: all count as 0):

        ((x * x * mask).sum(), (x * x * (mask == 0)).sum())

    A mask between 0 and 1 weighs an element of the first sum: a key/value head that tp/NKV ranks hold alike
    (hsgd.tp.model.kv_heads) counts NKV/tp on each, once in all when the tp ranks' sums are added.

    Each sum adds its own elements only (the others are exact zeros), so it does not depend on the other part:
    the tp ranks hold bit-identical replicated gradients at the same places, hence bit-identical replicated sums,
    the same global norm to the last bit and the same clipping factor, and their copies of the replicated
    parameters stay identical (tests/mpi/test_hybrid.py). The replicated sum taken as `all - sharded` would carry
    each rank's own rounding of its sharded sum. On the host in blocks of `block` elements, whose temporaries stay
    in the CPU's cache (about 3x faster than whole-array temporaries at 13M elements); on a GPU in one pass."""
    xp = array_module(x)
    if xp is not np:
        block = max(x.size, 1)
    part, rest = xp.zeros((), dtype=x.dtype), xp.zeros((), dtype=x.dtype)
    for lo in range(0, x.size, block):
        sq = x[lo:lo + block] * x[lo:lo + block]                # (block,) squares
        if mask is not None:
            m = mask[lo:lo + block]
            part += (sq * m).sum()                              # the masked elements' squares, weighted
            sq *= m == 0                                        # exact: the unmasked ones alone (NaN stays NaN)
        rest += sq.sum()
    return part, rest


def global_norm(numbers, grid, shard_comm=None, copies=1):
    """The full model's gradient norm from this rank's StepNumbers (sums over tp and pp; over shard_comm too when
    each DP rank holds a different part, as with ZeRO); copies: the stages holding each layer (DualPipe: 2)."""
    return norm_from_squares(numbers.sq_sharded, numbers.sq_replicated, grid.tp_comm if grid.tp > 1 else None,
                             grid.pp_comm if grid.pp > 1 else None, shard_comm, copies)


def check_finite(world, bad, step, on_nan):
    """Collective over world: True if no rank saw a non-finite value; else raise (on_nan "stop") or return False
    (on_nan "skip": the caller skips this step's update)."""
    everyone = world.comm.allgather(bool(bad))                  # every rank learns where it went wrong
    if not any(everyone):
        return True
    ranks = [r for r, b in enumerate(everyone) if b]
    if on_nan == "stop":
        raise NumericalFault(f"non-finite loss or gradient at step {step} on ranks {ranks} (--on-nan stop); "
                             "resume from a checkpoint with a smaller --lr, or use --on-nan skip")
    return False


class Skipping(NumericalFault):
    """The run ends because its updates kept being skipped (--max-skips in a row, the loss scale below its floor,
    or none applied at all): exit code 3. The parameters are still those of the last applied update, so the run
    can save them first (hsgd.train)."""


def stop_after_skips(in_a_row, max_skips, step):
    """--on-nan skip or float16's loss scaling: a run whose every step is non-finite has diverged for good; stop it
    (Skipping, exit code 3) after max_skips steps in a row were skipped, instead of skipping to the end and
    exiting 0."""
    if in_a_row >= max_skips:
        raise Skipping(f"{in_a_row} steps in a row had non-finite values (the last: step {step}); the run has "
                       f"diverged (--max-skips {max_skips})")
