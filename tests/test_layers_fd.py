"""Every layer's hand-written backward, and the whole model's, against central finite differences (float64), for
the plain layers (hsgd.model.layers) and the tuned kernels (hsgd.model.kernels) alike.

For a layer f, the scalar probe is  L = sum(f(x) * R)  with a fixed random R, so dL/dout = R; the analytic
gradient from *_backward(R, cache) must match the central difference coordinate by coordinate. The stencil is
the fourth-order one, (-L(x+2h) + 8 L(x+h) - 8 L(x-h) + L(x-2h)) / 12h, whose truncation error (~h^4) stays
far below the tolerance even for coordinates with small gradients.
The error of one argument is max |fd - an| / max |an| over its sampled coordinates, with a floor for gradients
that are exactly zero (the attention k-bias gradient is zero by symmetry: softmax ignores a shift shared by all
scores of a row).
"""
import numpy as np
import pytest

from hsgd.model import gradcheck, kernels, layers, ops, serial

from .conftest import max_rel_err, noisy_params, random_batch

H = 1e-4
TOL = 1e-6


def fd_error(f, args, grads, n=12, seed=0, h=H, floor=1e-8):
    """Worst error over the arguments in `grads` (index -> analytic gradient), each measured on n sampled
    coordinates by 4th-order central differences of f(*args) as  max_j |fd_j - an_j| / max(max_j |an_j|, floor)
    (the measure of conftest.max_rel_err)."""
    return gradcheck.fd_error(lambda: f(*args), [args[i] for i in grads], list(grads.values()), n=n, h=h,
                              floor=floor, order=4, measure="array", rng=np.random.default_rng(seed))


@pytest.fixture
def rng():
    return np.random.default_rng(42)


def probe(forward, R):
    return lambda *args: float(np.sum(forward(*args)[0] * R))


both_modules = pytest.mark.parametrize("m", [layers, kernels], ids=["layers", "kernels"])


@both_modules
def test_linear(rng, m):
    x, W, b = rng.normal(size=(3, 5, 4)), rng.normal(size=(4, 6)), rng.normal(size=6)
    out, cache = m.linear_forward(x, W, b)
    R = rng.normal(size=out.shape)
    dW, db = np.zeros_like(W), np.zeros_like(b)
    dx = m.linear_backward(R, cache, dW, db)
    err = fd_error(probe(m.linear_forward, R), [x, W, b], {0: dx, 1: dW, 2: db})
    print(f"{m.__name__} linear: max rel err {err:.2e}")
    assert err < TOL


@both_modules
def test_layernorm(rng, m):
    x, w, b = rng.normal(size=(2, 3, 7)), rng.normal(size=7), rng.normal(size=7)
    out, cache = m.layernorm_forward(x, w, b)
    R = rng.normal(size=out.shape)
    dw, db = np.zeros_like(w), np.zeros_like(b)
    dx = m.layernorm_backward(R, cache, dw, db)
    err = fd_error(probe(m.layernorm_forward, R), [x, w, b], {0: dx, 1: dw, 2: db})
    print(f"{m.__name__} layernorm: max rel err {err:.2e}")
    assert err < TOL


@both_modules
def test_gelu(rng, m):
    x = rng.normal(scale=2.0, size=(4, 9))
    out, cache = m.gelu_forward(x.copy())
    R = rng.normal(size=out.shape)
    dx = m.gelu_backward(R, cache)
    err = fd_error(probe(m.gelu_forward, R), [x], {0: dx}, n=36)
    print(f"{m.__name__} gelu: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("m, T, blocks", [(layers, 5, None), (kernels, 5, None), (kernels, 7, [0, 1, 2, 4, 7])],
                         ids=["layers", "kernels", "kernels-smallest-blocks"])
def test_attention(rng, monkeypatch, m, T, blocks):
    """Finite differences; for the kernels with the default blocks and with the smallest ones (one query row each at
    the start): the block edges are exact."""
    if blocks:
        monkeypatch.setattr(kernels, "causal_blocks", lambda T: blocks)
    B, C, NH = 2, 6, 3
    q, k, v = (rng.normal(size=(B, T, C)) for _ in range(3))
    out, cache = m.attention_forward(q, k, v, NH)
    R = rng.normal(size=out.shape)
    dq, dk, dv = m.attention_backward(R, cache)
    f = lambda q, k, v: float(np.sum(m.attention_forward(q, k, v, NH)[0] * R))
    err = fd_error(f, [q, k, v], {0: dq, 1: dk, 2: dv}, n=30)
    shown = "none (dense)" if m is layers else blocks or kernels.causal_blocks(T)
    print(f"{m.__name__} attention, blocks {shown}: max rel err {err:.2e}")
    assert err < TOL


def dense_attention(q, k, v, n_heads, dy):
    """y and (dq, dk, dv) of causal attention written the plain way: whole (T, T) matrices, no blocks."""
    B, T, C = q.shape
    hs = C // n_heads
    qh, kh, vh, dyh = (a.reshape(B, T, n_heads, hs).transpose(0, 2, 1, 3) for a in (q, k, v, dy))
    S = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(hs) + np.triu(np.full((T, T), -np.inf), k=1)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    P /= P.sum(axis=-1, keepdims=True)
    dP = dyh @ vh.transpose(0, 1, 3, 2)
    dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, C)
    return merge(P @ vh), (merge(dS @ kh / np.sqrt(hs)), merge(dS.transpose(0, 1, 3, 2) @ qh / np.sqrt(hs)),
                           merge(P.transpose(0, 1, 3, 2) @ dyh)), P


@pytest.mark.parametrize("T", [64, 130, 256])
def test_attention_blocks_equal_the_dense_computation(rng, T):
    """The causal block skipping (kernels.causal_blocks: 1, 2 and 4 row blocks here, uneven for T = 130) gives the
    dense result: y, P (zeros above the diagonal included) and every gradient."""
    B, C, NH = 2, 8, 2
    q, k, v, dy = (rng.normal(size=(B, T, C)) for _ in range(4))
    y, cache = kernels.attention_forward(q, k, v, NH)
    grads = kernels.attention_backward(dy, cache)
    y_ref, grads_ref, P_ref = dense_attention(q, k, v, NH, dy)
    err = max(max_rel_err(a, b, floor=1e-30) for a, b in zip((y, cache[3], *grads), (y_ref, P_ref, *grads_ref)))
    print(f"attention, T = {T}, blocks {kernels.causal_blocks(T)}: max rel err against dense {err:.1e}")
    assert len(kernels.causal_blocks(T)) == {64: 2, 130: 3, 256: 5}[T]
    assert err < 1e-12


@both_modules
def test_attention_is_causal(rng, m):
    """Changing a future position leaves every earlier output unchanged."""
    q, k, v = (rng.normal(size=(1, 6, 4)) for _ in range(3))
    y0, _ = m.attention_forward(q, k, v, 2)
    k2, v2 = k.copy(), v.copy()
    k2[0, 4:] += 1.0
    v2[0, 4:] -= 1.0
    y1, _ = m.attention_forward(q, k2, v2, 2)
    err = float(np.max(np.abs(y0[0, :4] - y1[0, :4])))
    print(f"{m.__name__} attention: max change of past outputs {err:.1e}")
    assert err == 0.0


@pytest.mark.parametrize("V, N", [(50, 7), (5, 40), (3, 0)])
def test_scatter_add_both_ways(rng, V, N):
    """backend.scatter_add adds every row, repeats included: row by row when indices are few, sorted and summed
    in runs when they repeat a lot (more positions than vocabulary), and nothing for no indices."""
    from hsgd.model.backend import scatter_add
    index, values = rng.integers(0, V, N), rng.normal(size=(N, 4))
    target = rng.normal(size=(V, 4))
    expected = target.copy()
    for i, row in zip(index, values):
        expected[i] += row
    scatter_add(target, index, values)
    err = max_rel_err(target, expected)
    print(f"scatter_add, V = {V}, N = {N}: max rel err {err:.1e}")
    assert err < 1e-14


@both_modules
def test_embedding(rng, m):
    V, T, C = 7, 5, 3
    idx = rng.integers(0, V, size=(4, T))
    wte, wpe = rng.normal(size=(V, C)), rng.normal(size=(T + 2, C))
    out, cache = m.embedding_forward(idx, wte, wpe)
    R = rng.normal(size=out.shape)
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    m.embedding_backward(R, cache, dwte, dwpe)
    f = lambda wte, wpe: float(np.sum(m.embedding_forward(idx, wte, wpe)[0] * R))
    err = fd_error(f, [wte, wpe], {0: dwte, 1: dwpe}, n=21)
    print(f"{m.__name__} embedding: max rel err {err:.2e}")
    assert err < TOL


@both_modules
def test_cross_entropy(rng, m):
    logits, targets = rng.normal(size=(3, 4, 11)), rng.integers(0, 11, size=(3, 4))
    loss, cache = m.cross_entropy_forward(logits, targets)
    dlogits = m.cross_entropy_backward(1.0, cache)
    f = lambda z: float(m.cross_entropy_forward(z, targets)[0])
    err = fd_error(f, [logits], {0: dlogits}, n=40)
    # the loss itself, written the naive way
    z = logits.reshape(-1, 11)
    naive = np.mean(-np.log(np.exp(z[np.arange(12), targets.reshape(-1)]) / np.exp(z).sum(1)))
    print(f"{m.__name__} cross-entropy: max rel err {err:.2e}, loss vs naive {abs(loss - naive):.1e}")
    assert err < TOL and abs(loss - naive) < 1e-12


@pytest.mark.parametrize("model_ops", [layers, ops], ids=["layers", "ops"])
def test_whole_model(tiny_cfg, model_ops):
    """Every parameter of the serial model, on the plain layers and on hsgd.model.ops' kernels: a few coordinates each,
    by central differences of the loss (computed by the plain layers).

    The loss is O(1) while single-coordinate gradients are O(1e-4), so the step is larger (h = 1e-3: rounding
    error ~1e-16 / h stays far below the gradients) and the floor is 1e-6.
    """
    params = noisy_params(tiny_cfg)
    idx, targets = random_batch(tiny_cfg, 3)
    _, grads = serial.loss_and_grads(params, idx, targets, tiny_cfg, ops=model_ops)
    names = list(params)
    f = lambda *arrays: serial.loss(dict(zip(names, arrays)), idx, targets, tiny_cfg)
    worst = {}
    for i, name in enumerate(names):
        worst[name] = fd_error(f, [params[n] for n in names], {i: grads[name]}, n=4, seed=i,
                               h=1e-3, floor=1e-6)
    name = max(worst, key=worst.get)
    print(f"whole model on {model_ops.__name__}: max rel err {worst[name]:.2e} ({name}) over {len(names)} parameters")
    assert worst[name] < TOL
