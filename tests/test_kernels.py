"""The tuned kernels (hsgd.model.kernels, what hsgd.model.ops gives the models) against the plain layers
(hsgd.model.layers), float64.

For every layer, both modules' forward outputs and backward gradients on the same inputs must agree to ~1e-12
(relative, conftest.max_rel_err), on one CPU thread and on two, on shapes from tiny to long enough for 2 and 4
causal blocks (T = 130, 256) and wide enough for every threaded layer to split its rows. The weight gradients start
from the same random values, so both must accumulate (+=). The plain layers are checked against finite
differences in test_layers_fd.py; this file carries that check over to the kernels at every shape.
"""
import threading

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model import kernels, layers, llama_layers, ops, serial

from .conftest import max_rel_err

TOL = 1e-12

#        B    T    C  NH     F
CASES = [(2, 5, 8, 2, 12),                # one causal block, tiny
         (3, 130, 16, 2, 64),             # 2 causal blocks, uneven
         (2, 256, 32, 4, 128),            # 4 causal blocks
         (4, 256, 512, 8, 2048)]          # wide: LayerNorm and GELU split their rows over 2 threads
IDS = [f"B{c[0]}-T{c[1]}-C{c[2]}" for c in CASES]


def run_embedding(m, rng, B, T, C, NH, F):
    V = 50
    idx = rng.integers(0, V, (B, T))
    wte, wpe, dout = rng.normal(size=(V, C)), rng.normal(size=(T + 3, C)), rng.normal(size=(B, T, C))
    dwte, dwpe = rng.normal(size=wte.shape), rng.normal(size=wpe.shape)              # accumulated into (+=)
    out, cache = m.embedding_forward(idx, wte, wpe)
    m.embedding_backward(dout, cache, dwte, dwpe)
    return out, dwte, dwpe


def run_linear(m, rng, B, T, C, NH, F):
    x, W, b, dy = rng.normal(size=(B, T, C)), rng.normal(size=(C, F)), rng.normal(size=F), rng.normal(size=(B, T, F))
    dW, db = rng.normal(size=W.shape), rng.normal(size=b.shape)
    y, cache = m.linear_forward(x, W, b)
    dx = m.linear_backward(dy, cache, dW, db)
    y0, cache = m.linear_forward(x, W)                                                # without a bias
    dx0 = m.linear_backward(dy, cache, dW)
    return y, dx, dW, db, y0, dx0


def run_layernorm(m, rng, B, T, C, NH, F):
    x, w, b, dout = rng.normal(size=(B, T, C)), rng.normal(size=C), rng.normal(size=C), rng.normal(size=(B, T, C))
    dw, db = rng.normal(size=C), rng.normal(size=C)
    y, cache = m.layernorm_forward(3.0 * x + 1.0, w, b)
    dx = m.layernorm_backward(dout, cache, dw, db)
    return y, dx, dw, db


def run_gelu(m, rng, B, T, C, NH, F):
    x, dout = 3.0 * rng.normal(size=(B, T, F)), rng.normal(size=(B, T, F))           # well into both tails
    y, cache = m.gelu_forward(x)
    return y, m.gelu_backward(dout, cache)


def run_attention(m, rng, B, T, C, NH, F):
    C = min(C, 8 * NH)             # heads of 8: the kernel's pieces and causal blocks depend on B, NH and T alone
    q, k, v, dy = (rng.normal(size=(B, T, C)) for _ in range(4))
    y, cache = m.attention_forward(q, k, v, NH)
    dq, dk, dv = m.attention_backward(dy, cache)
    return y, cache[3], dq, dk, dv                                                    # cache[3]: P in both


def run_cross_entropy(m, rng, B, T, C, NH, F):
    V = 50
    logits, targets = 2.0 * rng.normal(size=(B, T, V)), rng.integers(0, V, (B, T))
    loss, cache = m.cross_entropy_forward(logits, targets)
    return np.asarray(loss), m.cross_entropy_backward(0.7, cache)


def run_swiglu(m, rng, B, T, C, NH, F):
    m = llama_layers if m is layers else m                                           # the plain one is Llama's
    F = min(F, 256)                                                                  # (its sigmoid is slow)
    g, u, dh = 3.0 * rng.normal(size=(B, T, F)), rng.normal(size=(B, T, F)), rng.normal(size=(B, T, F))
    h, cache = m.swiglu_forward(g, u)
    return (h, *m.swiglu_backward(dh, cache))


LAYERS = {"embedding": run_embedding, "linear": run_linear, "layernorm": run_layernorm, "gelu": run_gelu,
          "attention": run_attention, "cross_entropy": run_cross_entropy, "swiglu": run_swiglu}


def plain_and_tuned(run, *case):
    """The arrays `run` returns with hsgd.model.layers and with hsgd.model.kernels, on the same random inputs."""
    return run(layers, np.random.default_rng(0), *case), run(kernels, np.random.default_rng(0), *case)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_kernel_equals_plain_layer(set_threads, name, case, threads):
    set_threads(threads)
    plain, tuned = plain_and_tuned(LAYERS[name], *case)
    err = max(max_rel_err(t, p) for t, p in zip(tuned, plain))
    print(f"{name}, B,T,C,NH,F = {case}, {threads} thread(s): kernels vs layers, max rel err {err:.1e}")
    assert len(tuned) == len(plain) and err < TOL


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES[1:3], ids=IDS[1:3])
def test_fused_qkv_equals_three_linears(set_threads, case, threads):
    """kernels.qkv_forward/qkv_backward (one GEMM on [Wq Wk Wv]; the backward takes attention_backward's
    [dq | dk | dv] buffer, out=) against three plain linears and their summed input gradients. (The k-bias gradient
    is zero in exact arithmetic; what is added to its random start is rounding noise, ~1e-15 of it.)"""
    set_threads(threads)
    B, T, C, NH, F = case
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, C))
    Wb = [a for _ in range(3) for a in (rng.normal(size=(C, C)) / C ** 0.5, rng.normal(size=C))]  # Wq bq Wk bk Wv bv
    dWb = [rng.normal(size=a.shape) for a in Wb]
    dWb_plain = [a.copy() for a in dWb]
    *qkv, c_qkv = kernels.qkv_forward(x, *Wb)
    y, c_att = kernels.attention_forward(*qkv, NH)
    dqkv = np.empty((B, T, 3 * C))
    grads = kernels.attention_backward(dy, c_att, out=dqkv)                            # views of dqkv
    dx = kernels.qkv_backward(dqkv, c_qkv, *dWb)
    outs = [layers.linear_forward(x, Wb[2 * i], Wb[2 * i + 1]) for i in range(3)]     # q, k, v
    y_plain, c_plain = layers.attention_forward(*(o for o, _ in outs), NH)
    dx_plain = sum(layers.linear_backward(d, c, dWb_plain[2 * i], dWb_plain[2 * i + 1])
                   for i, (d, (_, c)) in enumerate(zip(layers.attention_backward(dy, c_plain), outs)))
    err = max(max_rel_err(a, b) for a, b in zip((*qkv, y, dx, *dWb), (*(o for o, _ in outs), y_plain, dx_plain,
                                                                         *dWb_plain)))
    print(f"qkv, B,T,C = {B, T, C}, {threads} thread(s): fused vs three linears, max rel err {err:.1e}")
    assert all(np.shares_memory(g, dqkv) for g in grads) and err < TOL


def test_every_threaded_kernel_splits_on_the_wide_case(set_threads, monkeypatch):
    """With 2 threads the wide case really runs the threaded paths: a wrapper on kernels.parallel_rows notes which
    threads ran each layer's pieces (so the 2-thread results above are not the 1-thread code again)."""
    used, parallel_rows = {}, kernels.parallel_rows

    def noting(fn, n_rows, *args, **kwargs):
        layer = fn.__qualname__.split(".")[0]

        def noted(lo, hi):
            used.setdefault(layer, set()).add(threading.get_ident())
            return fn(lo, hi)
        return parallel_rows(noted, n_rows, *args, **kwargs)

    monkeypatch.setattr(kernels, "parallel_rows", noting)
    set_threads(2)
    for name in ("layernorm", "gelu", "attention", "swiglu"):
        LAYERS[name](kernels, np.random.default_rng(0), *CASES[-1])
    print("threads that ran each kernel's pieces: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(used.items())))
    assert sorted(used) == ["attention_backward", "attention_forward", "gelu_backward", "gelu_forward",
                            "layernorm_backward", "layernorm_forward", "swiglu_backward", "swiglu_forward"]
    assert all(len(ids) == 2 for ids in used.values())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("threads", [1, 2])
def test_serial_model_on_kernels_equals_plain(set_threads, threads, arch):
    """The whole serial model, run on hsgd.model.ops (the kernels) and on hsgd.model.layers (its default): same loss and
    gradients, with sequences long enough for 3 causal blocks. Floor 1e-6: the k-bias gradients are zero in exact
    arithmetic (softmax ignores a shift shared by a row of scores), rounding noise of ~1e-17 in both."""
    set_threads(threads)
    cfg = ModelConfig(vocab_size=31, seq_len=192, d_model=32, n_heads=4, n_layers=2, d_ff=64, arch=arch)
    params = serial.init_params(cfg, seed=3, dtype="float64")
    idx, targets = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 3, cfg.seq_len))
    loss_plain, g_plain = serial.loss_and_grads(params, idx, targets, cfg)
    loss_tuned, g_tuned = serial.loss_and_grads(params, idx, targets, cfg, ops=ops)
    err = max(max_rel_err(g_tuned[n], g_plain[n], floor=1e-6) for n in params)
    print(f"serial {arch} model, {threads} thread(s): loss {loss_tuned!r} vs {loss_plain!r}, "
          f"max rel grad err {err:.1e}")
    assert abs(loss_tuned - loss_plain) <= 1e-14 * abs(loss_plain) and err < TOL
