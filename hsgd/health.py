"""A step's numbers on the host, and what happens when one of them is not finite.

On a GPU every host copy stalls the device, so a training step copies back exactly one small vector
(`step_numbers`), from which the trainer reads everything it must decide on the host: the loss, whether any value
is not finite, and the two sums of squares that give the global gradient norm (hsgd.optim.norm_from_squares).

`check_finite` applies --on-nan: the ranks first agree on where a non-finite value appeared (a pickled allgather,
so that every rank takes the same branch), then either stop the run (NumericalFault: every rank exits 3 with one
message) or report that this step's update is to be skipped.
"""
import math
from typing import NamedTuple

from .backend import array_module, to_host
from .errors import NumericalFault
from .optim import norm_from_squares


class StepNumbers(NamedTuple):
    loss: float            # this DP group's loss (on the last pipeline stage; 0.0 before it)
    bad: bool              # the loss or a value of the checked gradient is not finite
    sq_sharded: float      # sum of squares of the gradient to apply, over tensor-sharded elements
    sq_replicated: float   # ... over the others


def step_numbers(loss, checked, grads, sharded):
    """StepNumbers from one device-to-host copy. grads: the flat gradient to apply, or None (nothing to apply: sums
    0), usually `checked` itself; sharded: a 0/1 mask of grads' shape (masks by multiplication: no device sync).
    A NaN or an infinity anywhere in `checked` makes its sum of squares non-finite, which is how it is found (so
    does a finite value whose square overflows, |x| > 1e154 in float64 or 1e19 in float32: a gradient no run
    survives either). NumPy's sums, not BLAS dot products: those can round differently with the arrays' alignment
    in memory, and a resumed run must repeat the uninterrupted one bit for bit."""
    xp = array_module(checked)
    zero = xp.zeros((), dtype=checked.dtype)
    if grads is None:
        sq_checked, sq_all, sq_sharded = (checked * checked).sum(), zero, zero
    else:
        sq = grads * grads                                      # (owned,) the one temporary
        sq_all = sq.sum()
        sq_checked = sq_all if checked is grads else (checked * checked).sum()
        sq *= sharded                                           # only the tensor-sharded elements
        sq_sharded = sq.sum()
    host = to_host(xp.stack([xp.asarray(loss, dtype=checked.dtype), sq_checked, sq_sharded, sq_all]))
    loss, sq_checked, sq_sharded, sq_all = (float(x) for x in host)
    return StepNumbers(loss, not (math.isfinite(loss) and math.isfinite(sq_checked)), sq_sharded,
                       sq_all - sq_sharded)


def global_norm(numbers, grid, shard_comm=None):
    """The full model's gradient norm from this rank's StepNumbers (sums over tp and pp; over shard_comm too when
    each DP rank holds a different part, as with ZeRO)."""
    return norm_from_squares(numbers.sq_sharded, numbers.sq_replicated, grid.tp_comm if grid.tp > 1 else None,
                             grid.pp_comm if grid.pp > 1 else None, shard_comm)


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
