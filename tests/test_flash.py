"""Attention that stores no scores (hsgd.model.flash) against the materialized attention (hsgd.model.layers).

Proves, in float64: (1) the forward's y and the backward's dq, dk, dv equal layers.attention_forward / backward
within 1e-12 relative, for lengths T that are not multiples of the block and blocks of 1, 7, 64 and T (the last
block shorter, the diagonal blocks masked, the blocks above them skipped); (2) the gradients equal central finite
differences of the loss itself (hsgd.model.gradcheck); (3) neither pass allocates a (T, T) array: at T = 512 the
peak tracemalloc sees is below half of one head's T x T scores, where the materialized forward holds them all.
"""
import tracemalloc

import numpy as np
import pytest

from hsgd.model import flash, gradcheck, layers

from .conftest import max_rel_err

TOL = 1e-12


def inputs(B, T, C, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, C)) for _ in range(4)]        # q, k, v, dy: (B, T, C) each


@pytest.mark.parametrize("T", [13, 70])
def test_flash_equals_the_materialized_attention(T):
    B, NH, hs = 2, 3, 4
    q, k, v, dy = inputs(B, T, NH * hs)
    y0, cache0 = layers.attention_forward(q, k, v, NH)
    grads0 = layers.attention_backward(dy, cache0)
    worst = {}
    for block in (1, 7, 64, T):
        y, cache = flash.attention_forward(q, k, v, NH, block=block)
        assert len(cache) == 5 and cache[4].shape == (B, NH, T)          # (q, k, v, y, lse): no scores kept
        out = np.full((B, T, 3 * NH * hs), np.nan)                       # every entry must be written
        grads = flash.attention_backward(dy, cache, out=out, block=block)
        assert all(np.shares_memory(g, out) for g in grads)
        errs = [max_rel_err(a, b) for a, b in zip((y, *grads), (y0, *grads0))]
        worst[block] = max(errs)
        print(f"T={T} block={block}: max rel err y {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, "
              f"dv {errs[3]:.1e}")
    y, cache = flash.attention_forward(q, k, v, NH, block=7)
    err = max(max_rel_err(a, b) for a, b in zip(flash.attention_backward(dy, cache, block=5), grads0))
    print(f"T={T} forward block 7, backward block 5: max rel err {err:.1e}")
    assert max(worst.values()) < TOL and err < TOL


def test_flash_gradients_equal_finite_differences():
    """L = sum(y * R): dL/dq, dL/dk, dL/dv against 4th-order central differences on every coordinate."""
    B, T, NH, hs, block = 2, 9, 2, 3, 4
    q, k, v, R = inputs(B, T, NH * hs, seed=1)
    dq, dk, dv = (g.copy() for g in flash.attention_backward(R, flash.attention_forward(q, k, v, NH, block)[1],
                                                             block=block))
    loss = lambda: float(np.sum(flash.attention_forward(q, k, v, NH, block)[0] * R))
    err = gradcheck.fd_error(loss, [q, k, v], [dq, dk, dv], h=1e-4, order=4, measure="array")
    print(f"flash attention (T={T}, block={block}) vs finite differences: max rel err {err:.1e}")
    assert err < 1e-8


def peak_bytes(f):
    """The most bytes f() held at once beyond what was allocated before it (tracemalloc sees NumPy's arrays)."""
    tracemalloc.start()
    out = f()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return peak


def test_flash_allocates_no_T_by_T_array():
    B, NH, hs, T, block = 1, 2, 8, 512, 16
    q, k, v, dy = inputs(B, T, NH * hs, seed=2)
    one_head = T * T * 8                                                # one (T, T) float64 matrix: 2 MiB
    flash_fwd = peak_bytes(lambda: flash.attention_forward(q, k, v, NH, block))
    cache = flash.attention_forward(q, k, v, NH, block)[1]
    flash_bwd = peak_bytes(lambda: flash.attention_backward(dy, cache, block=block))
    dense_fwd = peak_bytes(lambda: layers.attention_forward(q, k, v, NH))
    cache_bytes = sum(a.nbytes for a in cache)
    print(f"T={T}, B={B}, NH={NH}, hs={hs}, block={block}: peak bytes forward flash {flash_fwd / 2**10:.0f} KiB "
          f"(cache {cache_bytes / 2**10:.0f} KiB), backward flash {flash_bwd / 2**10:.0f} KiB, forward "
          f"materialized {dense_fwd / 2**10:.0f} KiB; B NH T^2 8 = {B * NH * one_head / 2**10:.0f} KiB")
    assert flash_fwd < one_head / 2 and flash_bwd < one_head / 2 and dense_fwd >= B * NH * one_head
