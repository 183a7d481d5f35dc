"""The layers of the Llama block (hsgd.model.llama_layers): every hand-written backward against central finite
differences (float64), and the identities each layer is built on.

The probe is tests/test_layers_fd.py's: L = sum(f(x) * R) with a fixed random R, so dL/dout = R; the fourth-order
central difference of L must match *_backward(R, cache) as  max_j |fd_j - an_j| / max_j |an_j|  over the sampled
coordinates. The identities are exact up to float64 rounding: the rotation keeps norms, its backward undoes it,
rotated scores depend on the distance of positions only, the kv repeat's backward is its adjoint, RMSNorm ignores
the scale of x, SwiGLU's gate opens fully for a large pre-activation and shuts for a very negative one.
"""
import numpy as np
import pytest

from hsgd.model import gradcheck
from hsgd.model import llama_layers as ll

from .conftest import max_rel_err

H = 1e-4
TOL = 1e-6
EXACT = 1e-13


def fd_error(f, args, grads, n=24, seed=0):
    """Worst error over the arguments in `grads` (index -> analytic gradient), n sampled coordinates each, by
    4th-order central differences of f(*args) (the measure of conftest.max_rel_err)."""
    return gradcheck.fd_error(lambda: f(*args), [args[i] for i in grads], list(grads.values()), n=n, h=H,
                              floor=1e-8, order=4, measure="array", rng=np.random.default_rng(seed))


def probe(forward, R):
    return lambda *args: float(np.sum(forward(*args)[0] * R))


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_rmsnorm(rng):
    """dx and dw by finite differences; dw accumulates (+=) onto what the caller's array held."""
    x, w = rng.normal(size=(2, 3, 7)), rng.normal(size=7)
    out, cache = ll.rmsnorm_forward(x, w)
    R = rng.normal(size=out.shape)
    dw0 = rng.normal(size=7)
    dw = dw0.copy()
    dx = ll.rmsnorm_backward(R, cache, dw)
    err = fd_error(probe(ll.rmsnorm_forward, R), [x, w], {0: dx, 1: dw - dw0})
    naive = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + ll.RMS_EPS) * w
    print(f"rmsnorm: max rel err {err:.2e}, forward vs naive {max_rel_err(out, naive):.1e}")
    assert err < TOL and max_rel_err(out, naive) < EXACT


def test_rmsnorm_ignores_the_scale_of_x(rng):
    """With eps = 0, RMSNorm(c x) = RMSNorm(x) for every c > 0 (eps only matters where mean(x^2) is near eps)."""
    x, w = rng.normal(size=(4, 9)), rng.normal(size=9)
    y = ll.rmsnorm_forward(x, w, eps=0.0)[0]
    err = max(max_rel_err(ll.rmsnorm_forward(c * x, w, eps=0.0)[0], y) for c in (1e-3, 0.5, 7.0, 1e4))
    print(f"rmsnorm of c x against of x: max rel err {err:.1e}")
    assert err < EXACT


def test_rope_frequencies_and_angles():
    """theta_i = base^(-2i/hs): 1 for i = 0, base^(-(hs-2)/hs) for the last; position 0 is no rotation; an odd head
    size is refused with a message that says why."""
    theta = ll.rope_frequencies(8, base=500000.0)
    expected = 1.0 / 500000.0 ** (np.arange(0, 8, 2) / 8)                   # Hugging Face's inv_freq, in float64
    cos, sin = ll.rope_angles(np.array([0, 3, 1000]), 8)
    assert theta.shape == (4,) and max_rel_err(theta, expected) < EXACT
    assert cos.shape == sin.shape == (3, 8) and np.all(cos[0] == 1.0) and np.all(sin[0] == 0.0)
    assert np.allclose(np.arctan2(sin[1, :4], cos[1, :4]), 3 * ll.rope_frequencies(8), rtol=0, atol=EXACT)
    assert np.array_equal(cos[:, :4], cos[:, 4:]) and np.array_equal(sin[:, :4], sin[:, 4:])
    for call in (lambda: ll.rope_frequencies(7), lambda: ll.rope_angles(np.arange(4), 5),
                 lambda: ll.rope_half_order(3)):
        with pytest.raises(ValueError, match="head size must be even; got head size"):
            call()


def test_rope_backward(rng):
    """Finite differences of the rotation, at positions that do not start at 0 (a context-parallel rank's)."""
    B, NH, T, hs = 2, 3, 5, 8
    x = rng.normal(size=(B, NH, T, hs))
    cos, sin = ll.rope_angles(np.arange(11, 11 + T), hs)
    out, cache = ll.rope_forward(x, cos, sin)
    R = rng.normal(size=out.shape)
    dx = ll.rope_backward(R, cache)
    err = fd_error(lambda x: float(np.sum(ll.rope_forward(x, cos, sin)[0] * R)), [x], {0: dx})
    print(f"rope: max rel err {err:.2e}")
    assert err < TOL


def test_rope_is_a_rotation(rng):
    """The rotation keeps every head vector's length; its backward (the rotation by -angle) undoes it; it is the
    complex product (x[i] + i x[i + hs/2]) e^{i p theta_i}, written independently here."""
    hs, T = 16, 9
    x = rng.normal(size=(2, 4, T, hs))
    positions = rng.integers(0, 100000, T)
    cos, sin = ll.rope_angles(positions, hs, base=500000.0)
    y, cache = ll.rope_forward(x, cos, sin)
    norms = max_rel_err(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
    back = max_rel_err(ll.rope_backward(y, cache), x)
    z = (x[..., :hs // 2] + 1j * x[..., hs // 2:]) * np.exp(1j * positions[:, None] * ll.rope_frequencies(hs, 500000.0))
    complex_form = max_rel_err(y, np.concatenate([z.real, z.imag], axis=-1))
    print(f"rope: norms {norms:.1e}, backward(forward(x)) - x {back:.1e}, against the complex form {complex_form:.1e}")
    assert max(norms, back, complex_form) < EXACT


def test_rope_scores_depend_on_the_distance_only(rng):
    """<R(m) q, R(n) k> is the same for every (m, n) with the same m - n."""
    hs = 12
    q, k = rng.normal(size=hs), rng.normal(size=hs)

    def score(m, n):
        cos, sin = ll.rope_angles(np.array([m, n]), hs)
        qm, kn = ll.rope_forward(np.stack([q, k]), cos, sin)[0]
        return qm @ kn

    for d in (0, 3, -5):
        scores = np.array([score(m, m - d) for m in (7, 40, 1234, 99999)])
        err = float(np.max(np.abs(scores - scores[0])) / np.abs(scores[0]))
        print(f"rope, m - n = {d}: scores {scores[0]:+.6f}, max rel spread {err:.1e}")
        assert err < 1e-10                                     # (angles of 1e5 radians: cos and sin lose ~1e-11)
    assert abs(score(5, 5) - q @ k) < EXACT * abs(q @ k) * 10


def test_rope_interleaved_convention_is_a_permutation(rng):
    """The original LLaMA's rotation (pairs (2i, 2i+1), as complex numbers) equals Hugging Face's after permuting
    each head's coordinates by rope_half_order; scores q . k are the same in both orders."""
    hs, T = 10, 6
    q, k = rng.normal(size=(1, 2, T, hs)), rng.normal(size=(1, 2, T, hs))
    positions = np.arange(T) + 3
    order = ll.rope_half_order(hs)
    angle = positions[:, None] * ll.rope_frequencies(hs)
    interleaved = lambda x: (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)   # Meta's complex pairs
    cos, sin = ll.rope_angles(positions, hs)
    errs = []
    for x in (q, k):
        z = interleaved(x)
        errs.append(max_rel_err(ll.rope_forward(x[..., order], cos, sin)[0],
                                np.concatenate([z.real, z.imag], axis=-1)))
    s_meta = np.sum(interleaved(q) * np.conj(interleaved(k))).real
    s_hf = np.sum(ll.rope_forward(q[..., order], cos, sin)[0] * ll.rope_forward(k[..., order], cos, sin)[0])
    print(f"rope, interleaved vs half order: max rel err {max(errs):.1e}, score difference {abs(s_meta - s_hf):.1e}")
    assert sorted(order) == list(range(hs)) and max(errs) < EXACT and abs(s_meta - s_hf) < EXACT * abs(s_meta) * 10


def test_silu_and_swiglu(rng):
    """silu and the gated product by finite differences, including the tails (|x| up to 12)."""
    x = rng.normal(scale=4.0, size=(3, 8))
    out, cache = ll.silu_forward(x)
    R = rng.normal(size=out.shape)
    err_silu = fd_error(probe(ll.silu_forward, R), [x], {0: ll.silu_backward(R, cache)})
    gate, up = rng.normal(scale=3.0, size=(2, 5, 6)), rng.normal(size=(2, 5, 6))
    h, cache = ll.swiglu_forward(gate, up)
    R = rng.normal(size=h.shape)
    dgate, dup = ll.swiglu_backward(R, cache)
    err_swiglu = fd_error(probe(ll.swiglu_forward, R), [gate, up], {0: dgate, 1: dup})
    print(f"silu: max rel err {err_silu:.2e}; swiglu: max rel err {err_swiglu:.2e}")
    assert err_silu < TOL and err_swiglu < TOL


def test_swiglu_mlp(rng):
    """The whole MLP, every weight and x, by finite differences; the weight gradients accumulate (+=)."""
    C, F = 4, 6
    x = rng.normal(size=(2, 3, C))
    W_gate, W_up, W_down = rng.normal(size=(C, F)), rng.normal(size=(C, F)), rng.normal(size=(F, C))
    out, cache = ll.swiglu_mlp_forward(x, W_gate, W_up, W_down)
    R = rng.normal(size=out.shape)
    grads = [np.zeros_like(W) for W in (W_gate, W_up, W_down)]
    dx = ll.swiglu_mlp_backward(R, cache, *grads)
    again = [g.copy() for g in grads]
    ll.swiglu_mlp_backward(R, cache, *again)
    err = fd_error(probe(ll.swiglu_mlp_forward, R), [x, W_gate, W_up, W_down],
                   {0: dx, 1: grads[0], 2: grads[1], 3: grads[2]})
    acc = max(max_rel_err(a, 2 * g) for a, g in zip(again, grads))
    print(f"swiglu mlp: max rel err {err:.2e}; two backwards against twice one {acc:.1e}")
    assert err < TOL and acc < EXACT


def test_swiglu_gate_limits(rng):
    """silu(z) = z sigmoid(z): a large positive gate lets z * up through (sigmoid(40) is 1 in float64), a very
    negative one shuts it (|h| < 1e-15 |up|), and exp never overflows, even at -1000."""
    up = rng.normal(size=(3, 5))
    h_open = ll.swiglu_forward(np.full_like(up, 40.0), up)[0]
    with np.errstate(over="raise"):
        h_shut = ll.swiglu_forward(np.full_like(up, -40.0), up)[0]
        tail = ll.silu_forward(np.array([-1000.0, 1000.0]))[0]
    err = max_rel_err(h_open / 40.0, up)
    print(f"swiglu, gate 40: h/40 against up {err:.1e}; gate -40: max |h| {np.abs(h_shut).max():.1e}")
    assert err < EXACT and np.abs(h_shut).max() < 1e-15 * np.abs(up).max()
    assert tail[0] == 0.0 and tail[1] == 1000.0


def test_repeat_kv(rng):
    """Hugging Face's order (query head j reads kv head j // n_rep, which is expand-then-reshape), the backward by
    finite differences and as the adjoint: <repeat(k), g> = <k, repeat_backward(g)>."""
    B, NKV, n_rep, T, hs = 2, 3, 4, 5, 2
    k = rng.normal(size=(B, NKV, T, hs))
    out, cache = ll.repeat_kv_forward(k, n_rep)
    hf = np.broadcast_to(k[:, :, None], (B, NKV, n_rep, T, hs)).reshape(B, NKV * n_rep, T, hs)
    assert out.shape == (B, NKV * n_rep, T, hs) and np.array_equal(out, hf)
    assert all(np.array_equal(out[:, j], k[:, j // n_rep]) for j in range(NKV * n_rep))
    g = rng.normal(size=out.shape)
    dk = ll.repeat_kv_backward(g, cache)
    adjoint = abs(np.sum(out * g) - np.sum(k * dk)) / abs(np.sum(out * g))
    err = fd_error(lambda k: float(np.sum(ll.repeat_kv_forward(k, n_rep)[0] * g)), [k], {0: dk})
    print(f"repeat_kv: max rel err {err:.2e}, adjoint identity {adjoint:.1e}")
    assert err < TOL and adjoint < EXACT


def test_float32_stays_float32(rng):
    """Every layer keeps float32 inputs float32 (the rotary tables rounded to float32 by rope_angles)."""
    x = rng.normal(size=(1, 2, 3, 4)).astype(np.float32)
    cos, sin = ll.rope_angles(np.arange(3), 4, dtype=np.float32)
    w, W = np.ones(4, np.float32), rng.normal(size=(4, 4)).astype(np.float32)
    outs = [ll.rmsnorm_forward(x, w)[0], ll.rope_forward(x, cos, sin)[0], ll.rope_backward(x, (cos, sin)),
            ll.swiglu_mlp_forward(x, W, W, W)[0], *ll.swiglu_backward(x, (x, x)), ll.silu_backward(x, x),
            ll.repeat_kv_forward(x, 2)[0], ll.repeat_kv_backward(x, 2)]
    assert [o.dtype for o in outs] == [np.float32] * len(outs)
