"""Scaling recipes: how an FP8 matrix product picks the scale of each operand.

An 8-bit format holds few values over a narrow range (E4M3: 448 at most, nothing below 2^-9; E5M2: 57344 and 2^-16;
hsgd.model.precision), so a tensor is cast with a scale s that puts its largest magnitude near the format's top:

    amax = max |x| over a tile                  (the whole tensor, a row, a 1 x b or b x b block)
    s    = fmax / amax / 2^margin               (amax = 0: s = 1)
    q(x) = round(x s, fmt, saturating) / s      (the value the product reads: an FP8 number times 1/s)

and the product Y = X W is computed on q(X) and q(W), the sum accumulated in float32 (hsgd.fp8.linear; a tensor
core multiplies the FP8 numbers exactly and applies 1/s after the sum, the emulation multiplies the values q/s, which
differs by the compute type's rounding). The recipes differ in the tile, and in when the amax is taken:

    recipe       tile                                        amax from                       who uses it
    delayed      the tensor                                  the last `history` steps' amax  TransformerEngine's
                                                             (their maximum), not this one   DelayedScaling;
                                                                                             Micikevicius et al. 2022
    tensorwise   the tensor                                  this tensor, now ("current")    Float8CurrentScaling;
                                                                                             torchao's tensorwise
    rowwise      one row along the contraction axis          this tensor, now                torchao's rowwise
    blockwise    1 x b tiles of activations and gradients    this tensor, now                DeepSeek-V3 (2024), 3.3;
                 along the contraction axis, b x b blocks                                    Float8BlockScaling
                 of weights (b = 128)

A tile along the contraction axis K of Y = X W keeps the scale out of the sum: y_ij = sum_k x_ik w_kj with x's scale
constant over k (a row of X, or a 1 x b tile, its scale applied to each block's partial sum: what DeepSeek-V3's
promotion every 128 elements does with its scales). The weight gradient dW = X^T dY contracts over the tokens, so
there X and dY are cast again along the token axis (DeepSeek-V3 turns its 1 x 128 activation tiles into 128 x 1
ones for that product).

Delayed scaling takes the scale from history: the step's amax is recorded (the maximum over the step's uses, reduced
over every rank that holds a piece of the tensor, hsgd.fp8.domains) and pushed at the end of the step; the scale of
step s comes from the amaxes of steps s - history .. s - 1 (the first step, with none: s = 1, as TransformerEngine
starts). A value larger than any recent one overflows: saturated at fmax, and counted.
"""
import math

import numpy as np

from hsgd.errors import ConfigError
from hsgd.model.backend import array_module

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")
FP8_FORMATS = {                                 # --fp8: the format of each operand role
    "hybrid": {"x": "float8_e4m3fn", "w": "float8_e4m3fn", "dy": "float8_e5m2"},   # E4M3 forward, E5M2 backward
    "e4m3": {"x": "float8_e4m3fn", "w": "float8_e4m3fn", "dy": "float8_e4m3fn"},   # one format for all
}


class Recipe:
    """A scaling recipe: tile(role) says which elements share a scale; per_tensor: one scale for the whole tensor
    (its amax reduced over every rank that holds a piece); delayed: the scale from the amax history."""
    name, per_tensor, delayed, block = "recipe", True, False, None

    def __init__(self, margin=0):
        self.margin = margin

    def amax(self, x, axis, role):
        """The amax of each tile of x (2-D, (rows, cols)), shaped to broadcast against x (keepdims)."""
        return array_module(x).abs(x).max(keepdims=True)

    def scale(self, amax, fmax):
        """s = fmax / amax / 2^margin for each tile (amax 0, or not finite: 1; at most the type's largest finite
        number, as TransformerEngine clamps it: an amax below fmax / that would make s infinite, and 0 s NaN)."""
        xp = array_module(amax)
        ok = (amax > 0) & xp.isfinite(amax)
        with np.errstate(over="ignore"):
            s = xp.where(ok, fmax / xp.where(ok, amax, 1.0) / 2.0 ** self.margin, 1.0)
        return xp.minimum(s, np.finfo(s.dtype).max)

    def expand(self, s, shape, axis, role):
        """The scales of the tiles as an array that broadcasts against an operand of `shape`."""
        return s

    def describe(self):
        return self.name


class Tensorwise(Recipe):
    """One scale per tensor, from the tensor itself (current scaling)."""
    name = "tensorwise"


class Delayed(Recipe):
    """One scale per tensor, from the maximum of the last `history` steps' amaxes (and a margin of 2^margin)."""
    name, delayed = "delayed", True

    def __init__(self, history=16, margin=0):
        super().__init__(margin)
        self.history = history

    def describe(self):
        return f"delayed (history {self.history}, margin {self.margin})"


class Rowwise(Recipe):
    """One scale per row along the contraction axis: x (N, K) along K, one per token; W (K, M) along K, one per
    output column; for dW = X^T dY, one per column of X and of dY (along the tokens)."""
    name, per_tensor = "rowwise", False

    def amax(self, x, axis, role):
        return array_module(x).abs(x).max(axis=axis, keepdims=True)


class Blockwise(Recipe):
    """1 x b tiles of activations and gradients along the contraction axis, b x b blocks of weights (DeepSeek-V3
    section 3.3: b = 128). Each dimension a tile runs along must be a multiple of b (check_block)."""
    name, per_tensor = "blockwise", False

    def __init__(self, block=128, margin=0):
        super().__init__(margin)
        self.block = block

    def describe(self):
        return f"blockwise ({self.block})"

    def tiles(self, shape, axis, role):
        """(the operand reshaped so that each tile has axes of its own, those axes): b x b blocks of a weight
        (n/b, b, m/b, b) over (1, 3); 1 x b tiles along the columns (n, m/b, b) over 2; b x 1 along the rows
        (n/b, b, m) over 1."""
        b, (n, m) = self.block, shape
        if role == "w":
            return (n // b, b, m // b, b), (1, 3)
        return ((n, m // b, b), 2) if axis in (1, -1) else ((n // b, b, m), 1)

    def amax(self, x, axis, role):
        tiled, inside = self.tiles(x.shape, axis, role)
        return array_module(x).abs(x).reshape(tiled).max(axis=inside, keepdims=True)

    def expand(self, s, shape, axis, role):
        tiled, _ = self.tiles(shape, axis, role)
        return array_module(s).broadcast_to(s, tiled).reshape(shape)


def make_recipe(name, history=16, margin=0, block=128):
    """The Recipe object of --fp8-recipe NAME (history: --fp8-history, margin: --fp8-margin, block: --fp8-block)."""
    if name == "delayed":
        return Delayed(history, margin)
    if name == "tensorwise":
        return Tensorwise(margin)
    if name == "rowwise":
        return Rowwise(margin)
    if name == "blockwise":
        return Blockwise(block, margin)
    raise ConfigError(f"fp8_recipe={name!r} is not known; use one of {', '.join(RECIPES)}")


def check_block(what, size, block):
    """A dimension of `size` that 1 x b tiles run along must be a multiple of b; ConfigError saying which and what
    would work otherwise."""
    if size % block:
        ok = [b for b in (16, 32, 64, 128) if size % b == 0]
        raise ConfigError(f"fp8_block={block} does not divide {what} ({size}): blockwise scaling needs tiles that "
                          f"end where the dimension ends; use --fp8-block {max(ok) if ok else math.gcd(size, block)}"
                          f" or another --fp8-recipe")

