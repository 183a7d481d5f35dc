"""The layers of the Llama block as plain formulas, each a hand-written forward/backward pair (hsgd.model.layers'
conventions: *_forward(...) -> (out, cache), *_backward(dout, cache, dparams...) -> dinputs, weight gradients
accumulated with `+=`).

The Llama block (Touvron et al. 2023, "LLaMA"; Dubey et al. 2024, "The Llama 3 Herd of Models") is GPT-2's block
with four pieces exchanged:

    LayerNorm             ->  RMSNorm (Zhang and Sennrich 2019): no mean subtracted, no bias
    learned positions wpe ->  rotary position embedding of q and k (Su et al. 2021, "RoFormer")
    GELU MLP              ->  SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"), no biases
    NH key/value heads    ->  NKV <= NH of them, each shared by n_rep = NH/NKV query heads (Ainslie et al. 2023, "GQA")

The conventions are Hugging Face's LlamaForCausalLM (the reference the model will be checked against): rotary
pairs are a head's two halves (rotate_half), and repeat_kv repeats each key/value head n_rep times in a row.
Weights are stored (in, out) as in hsgd.model.layers, the transpose of a torch Linear's (out, in).

Left out here: the wiring into the model and the parallel layouts, Llama 3.1's rescaled rotary frequencies for long
contexts (rope_type "llama3"), a key/value cache for generation, a fused gate|up weight (swiglu_forward takes the
two pre-activations, however they were computed).

Legend: B batch, T sequence, C d_model, NH query heads, NKV key/value heads, n_rep = NH/NKV, hs head size,
F d_ff (Hugging Face's intermediate_size), N = B*T rows.

Arrays may be NumPy or CuPy; each function computes with the module its inputs belong to.
"""
import numpy as np

from hsgd.model.backend import array_module
from hsgd.model.layers import linear_backward, linear_forward

RMS_EPS = 1e-5          # Llama 2 and 3 (rms_norm_eps); the first LLaMA used 1e-6
ROPE_BASE = 10000.0     # LLaMA and Llama 2 (rope_theta); Llama 3 uses 500000.0


# --------------------------------------------------------------------------------------------------------------
# RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w

def rmsnorm_forward(x, w, eps=RMS_EPS):
    """xhat = x * rrms, rrms = 1 / sqrt(mean(x^2) + eps), over the last axis;  y = xhat * w.

    LayerNorm without the mean subtracted and without a bias. Hugging Face's LlamaRMSNorm computes xhat in float32
    whatever the input's dtype, casts it back to the input's dtype, then multiplies by w (initialized to ones).
    """
    xp = array_module(x)
    rrms = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)          # (..., 1)
    xhat = x * rrms                                           # (..., C)
    return xhat * w, (xhat, rrms, w)


def rmsnorm_backward(dout, cache, dw):
    """dw += sum over rows of dout * xhat;  with g = dout * w (= dL/dxhat):
        dx = rrms * (g - xhat * mean(g * xhat)).

    (From xhat_i = x_i rrms and d rrms / dx_j = -rrms^3 x_j / C:  dx_j = rrms g_j - rrms^3 x_j mean_i(g_i x_i).
    The normalization ignores the length of x, so the backward removes from g its component along xhat, nearly: as
    mean(xhat^2) = mean(x^2) / (mean(x^2) + eps) is just below 1; LayerNorm's also removes the all-ones direction.)
    """
    xhat, rrms, w = cache                                     # (..., C), (..., 1), (C,)
    C = xhat.shape[-1]
    dw += (dout * xhat).reshape(-1, C).sum(axis=0)            # (C,)
    g = dout * w                                              # (..., C)
    return rrms * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------------------------------
# Rotary position embedding: the pair i of a head's coordinates at position p is rotated by the angle p * theta_i

def rope_pairs(hs):
    """hs/2, the number of pairs a head's coordinates are rotated in; an odd head size is refused."""
    if hs % 2:
        raise ValueError(f"rotary position embedding rotates a head's coordinates in pairs, so the head size must be "
                         f"even; got head size {hs}")
    return hs // 2


def rope_frequencies(hs, base=ROPE_BASE, xp=np):
    """theta_i = base^(-2i/hs), i = 0 .. hs/2 - 1: (hs/2,) float64, from 1 down to nearly 1/base radians per
    position."""
    return base ** (-2.0 * xp.arange(rope_pairs(hs), dtype=xp.float64) / hs)  # (hs/2,)


def rope_angles(positions, hs, base=ROPE_BASE, dtype="float64"):
    """cos and sin of the angles a[t, i] = positions[t] * theta_i, each written twice, (T, hs) = [cos a, cos a]:
    the tables rope_forward multiplies by. positions: (T,) integers, the global positions of the rows held here
    (arange(T) on one process; a context-parallel rank passes its own). The angles are computed in float64 and the
    tables then rounded to dtype; Hugging Face computes the angles in float32, whose error of some 6e-8 of the angle
    grows with the position (about 1e-3 radians at position 16000)."""
    xp = array_module(positions)
    theta = rope_frequencies(hs, base, xp)                                     # (hs/2,)
    a = xp.asarray(positions, dtype=xp.float64)[..., None] * theta             # (T, hs/2)
    a = xp.concatenate([a, a], axis=-1)                                        # (T, hs) pair i at i and i + hs/2
    return xp.cos(a).astype(dtype, copy=False), xp.sin(a).astype(dtype, copy=False)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1], x1 and x2 a head's first and second halves: each pair (x[i], x[i + hs/2]) turned by
    90 degrees. (Hugging Face's rotate_half; as a matrix J, J^T = -J.)"""
    xp = array_module(x)
    half = x.shape[-1] // 2
    return xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_forward(x, cos, sin):
    """y = x * cos + rotate_half(x) * sin: for each pair i = (x[i], x[i + hs/2]) of a head and its angle a_i,
        y[i]        = x[i] cos a_i - x[i + hs/2] sin a_i
        y[i + hs/2] = x[i + hs/2] cos a_i + x[i] sin a_i
    a rotation of the plane of the pair by a_i (the complex number x[i] + i x[i + hs/2] times e^{i a_i}).
    x: (B, NH, T, hs), q or k (v is not rotated); cos, sin: (T, hs) from rope_angles.

    Why it encodes positions: with q at position m and k at position n, <R(m) q, R(n) k> = <q, R(n - m) k>, a
    function of m - n alone (rotations compose by adding angles; R(m)^T = R(-m)).

    The convention is Hugging Face's: pair i is (x[i], x[i + hs/2]). The original LLaMA code (and GPT-J) pairs
    (x[2i], x[2i + 1]) instead; the two agree after permuting each head's coordinates by rope_half_order, and as
    q . k is unchanged when q and k are permuted alike, converting a checkpoint permutes, within each head, the
    output columns of W_q and W_k (the rows of torch's weights), and nothing else.
    """
    return x * cos + rotate_half(x) * sin, (cos, sin)          # (B, NH, T, hs)


def rope_backward(dy, cache):
    """dx = R^T dy, the rotation by -a (R is orthogonal):  dx = dy * cos - rotate_half(dy) * sin.
    (R = cos + sin J with cos and sin equal on both halves, so they commute with J, and J^T = -J.)"""
    cos, sin = cache                                          # (T, hs) each
    return dy * cos - rotate_half(dy) * sin                   # (B, NH, T, hs)


def rope_half_order(hs):
    """The index array taking a head's coordinates from the interleaved order (pairs (2i, 2i+1): the original
    LLaMA's, GPT-J's) to Hugging Face's half order (pairs (i, i + hs/2)): x_half = x_interleaved[..., order],
    order = [0, 2, 4, .., hs-2, 1, 3, .., hs-1] (Hugging Face's convert_llama_weights_to_hf `permute`)."""
    rope_pairs(hs)
    return np.concatenate([np.arange(0, hs, 2), np.arange(1, hs, 2)])         # (hs,)


# --------------------------------------------------------------------------------------------------------------
# SwiGLU: h = silu(x W_gate) * (x W_up),  out = h W_down

def sigmoid(x):
    """1 / (1 + exp(-x)), as e / (1 + e) for x < 0 with e = exp(-|x|), so that exp never overflows."""
    xp = array_module(x)
    e = xp.exp(-xp.abs(x))
    s = 1.0 / (1.0 + e)
    return xp.where(x >= 0, s, e * s)


def silu_forward(x):
    """y = x * sigmoid(x) (Swish with beta = 1), elementwise. The cache is x."""
    return x * sigmoid(x), x


def silu_backward(dout, cache):
    """dx = dout * dy/dx, with s = sigmoid(x), ds/dx = s (1 - s):  dy/dx = s + x s (1 - s) = s (1 + x (1 - s))."""
    x = cache
    s = sigmoid(x)
    return dout * s * (1 + x * (1 - s))


def swiglu_forward(gate_pre, up_pre):
    """h = silu(gate_pre) * up_pre, elementwise: the gate's pre-activation (x W_gate) through SiLU times the up
    projection (x W_up). gate_pre, up_pre: (..., F), from two products or from halves of one fused product."""
    return silu_forward(gate_pre)[0] * up_pre, (gate_pre, up_pre)               # (..., F)


def swiglu_backward(dh, cache):
    """(dgate_pre, dup_pre), by the product rule:  dup_pre = dh * silu(gate_pre);
    dgate_pre = (dh * up_pre) * silu'(gate_pre)  (silu_backward)."""
    gate_pre, up_pre = cache                                  # (..., F) each
    return silu_backward(dh * up_pre, gate_pre), dh * silu_forward(gate_pre)[0]


def swiglu_mlp_forward(x, W_gate, W_up, W_down):
    """out = (silu(x W_gate) * (x W_up)) W_down, no biases. x: (..., C); W_gate, W_up: (C, F); W_down: (F, C).
    (Llama's F is about 8C/3, rounded up to a multiple: three matrices cost what GPT-2's two with F = 4C do.)"""
    gate_pre, gate_cache = linear_forward(x, W_gate)          # (..., F)
    up_pre, up_cache = linear_forward(x, W_up)                # (..., F)
    h, swiglu_cache = swiglu_forward(gate_pre, up_pre)        # (..., F)
    out, down_cache = linear_forward(h, W_down)               # (..., C)
    return out, (gate_cache, up_cache, swiglu_cache, down_cache)


def swiglu_mlp_backward(dout, cache, dW_gate, dW_up, dW_down):
    """The forward upside down; x feeds both the gate and the up projection, so dx is the sum of both paths:
        dx = dgate_pre W_gate^T + dup_pre W_up^T."""
    gate_cache, up_cache, swiglu_cache, down_cache = cache
    dh = linear_backward(dout, down_cache, dW_down)           # (..., F)
    dgate_pre, dup_pre = swiglu_backward(dh, swiglu_cache)    # (..., F) each
    dx = linear_backward(dup_pre, up_cache, dW_up)            # (..., C)
    return dx + linear_backward(dgate_pre, gate_cache, dW_gate)


# --------------------------------------------------------------------------------------------------------------
# Grouped-query attention: NKV key/value heads, each repeated for the n_rep = NH/NKV query heads that share it

def repeat_kv_forward(k, n_rep):
    """(B, NKV, T, hs) -> (B, NKV*n_rep, T, hs): each key/value head repeated n_rep times in a row, so that query
    head j reads key/value head j // n_rep (Hugging Face's repeat_kv; n_rep = NH is multi-query attention, n_rep = 1
    plain multi-head attention: k itself, no copy). The cache is n_rep."""
    if n_rep == 1:
        return k, 1
    xp = array_module(k)
    return xp.repeat(k, n_rep, axis=1), n_rep                 # (B, NH, T, hs)


def repeat_kv_backward(dout, cache):
    """The adjoint of the repeat: a key/value head was read by n_rep query heads, so its gradient is the sum of
    theirs, dk[:, g] = sum_{r < n_rep} dout[:, g*n_rep + r] (dout itself for n_rep = 1)."""
    n_rep = cache
    if n_rep == 1:
        return dout
    B, NH, T, hs = dout.shape
    return dout.reshape(B, NH // n_rep, n_rep, T, hs).sum(axis=2)             # (B, NKV, T, hs)


# --------------------------------------------------------------------------------------------------------------
# The same two layers on the model's layout: (B, T, NH*hs), a position's heads side by side (layers.split_heads)

def rope_rows_forward(x, n_heads, cos, sin):
    """rope_forward on every head of x (B, T, NH*hs), heads side by side as the linears give them: the same
    rotation, with no transpose (cos, sin: (T, hs), broadcast over the heads)."""
    B, T, C = x.shape
    y, _ = rope_forward(x.reshape(B, T, n_heads, C // n_heads), cos[:, None], sin[:, None])   # (B, T, NH, hs)
    return y.reshape(B, T, C), (cos, sin, n_heads)


def rope_rows_backward(dy, cache):
    """rope_backward on every head of dy (B, T, NH*hs): the rotation by -a."""
    cos, sin, n_heads = cache
    B, T, C = dy.shape
    return rope_backward(dy.reshape(B, T, n_heads, C // n_heads), (cos[:, None], sin[:, None])).reshape(B, T, C)


def repeat_kv_rows_forward(k, n_kv_heads, n_rep):
    """repeat_kv_forward on k (B, T, NKV*hs) -> (B, T, NKV*n_rep*hs): head g's columns n_rep times in a row, so that
    query head j reads key/value head j // n_rep. n_rep = 1 hands k itself on. The cache is (NKV, n_rep)."""
    if n_rep == 1:
        return k, (n_kv_heads, 1)
    B, T, K = k.shape
    xp = array_module(k)
    return xp.repeat(k.reshape(B, T, n_kv_heads, K // n_kv_heads), n_rep, axis=2).reshape(B, T, K * n_rep), \
        (n_kv_heads, n_rep)


def repeat_kv_rows_backward(dout, cache):
    """The sum over each group of n_rep query heads (repeat_kv_backward): (B, T, NH*hs) -> (B, T, NKV*hs)."""
    n_kv_heads, n_rep = cache
    if n_rep == 1:
        return dout
    B, T, C = dout.shape
    return dout.reshape(B, T, n_kv_heads, n_rep, C // (n_kv_heads * n_rep)).sum(axis=3).reshape(B, T, C // n_rep)
