"""hsgd's hand-written backward equals an independent autograd of the model spec, to float64 rounding.

tests/autograd_reference.py is a second implementation of the GPT model built on a small reverse-mode autograd
engine; it shares no code with hsgd.model.layers or hsgd.model.serial. These tests prove, in order:
  1. the engine's gradients of each op (and of its GPT loss) match central finite differences, so the
     reference can be trusted;
  2. hsgd.model.serial.loss_and_grads gives the same loss (1e-12 relative) and the same gradient for every parameter
     (1e-10 relative) as the engine, on tiny float64 models with non-trivial biases and LayerNorm weights:
     L=2, NH=2, B=3; and, for shape bugs, NH=4, L=1, B=1 with T=1 (one position) and with T=5;
  3. optionally, when torch is installed, the engine agrees with torch.float64 autograd of the same spec.

Run: python -m pytest -q -s tests/test_autograd_reference.py
"""
import math

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model import serial

from . import autograd_reference as ref
from .autograd_reference import Tensor, where
from .conftest import max_rel_err, noisy_params, random_batch

pytestmark = pytest.mark.timeout(120)


# 1. The engine against central finite differences


def finite_difference_grads(f, arrays, h=1e-6):
    """d f / d arrays[i] for a scalar function f(list of arrays), by central differences."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + h
            fp = f(arrays)
            a[i] = old - h
            fm = f(arrays)
            a[i] = old
            g[i] = (fp - fm) / (2 * h)
        grads.append(g)
    return grads


def _softmax_lse(x):
    """softmax and logsumexp with the detached-max shift, as the GPT spec uses them."""
    m = x.max_detached(-1)
    return ref.softmax(x, axis=-1) * ((x - m).exp().sum(axis=-1, keepdims=True).log() + m)


OP_CASES = {   # name: (function of Tensors, input shapes); inputs of log / sqrt / div are kept positive
    "add_sub_broadcast": (lambda a, b: (a + b) - (b - 2.0) * (1.0 - a), [(2, 3, 4), (3, 1)]),
    "mul_div_broadcast": (lambda a, b: a * b / (b * b + 1.0) - 1.0 / (a * a + 2.0), [(2, 3, 4), (4,)]),
    "batched_matmul": (lambda a, b: a @ b, [(2, 3, 4, 5), (5, 2)]),
    "matmul_batch_broadcast": (lambda a, b: a.swapaxes(-1, -2) @ b, [(2, 1, 4, 3), (5, 4, 2)]),
    "neg_exp_log_tanh": (lambda a, b: -(a.exp() + (b * b + 1.0).log() * a.tanh()), [(3, 4), (3, 4)]),
    "pow_sqrt": (lambda a, b: a ** 3 + (b * b + 0.5).sqrt(), [(3, 4), (4,)]),
    "sum_mean_keepdims": (lambda a, b: a.sum(axis=1, keepdims=True) * a.mean(axis=(0, 2)).reshape(1, 3, 1)
                          + b.mean(), [(2, 3, 4), (5,)]),
    "reshape_transpose": (lambda a, b: a.reshape(3, 2, 4).transpose(2, 0, 1) * b, [(2, 3, 4), (1, 2)]),
    "gather_rows_repeated": (lambda a, b: a[np.array([[0, 2, 2], [1, 0, 0]])] * b[:2], [(4, 3), (5, 3, 3)]),
    "gather_targets": (lambda a, b: a[np.arange(2)[:, None], np.arange(3)[None, :], [[1, 0, 3], [3, 3, 2]]]
                       * b, [(2, 3, 4), (3,)]),
    "where_causal_softmax": (lambda a, b: ref.softmax(where(np.tril(np.ones((4, 4), bool)), a * b, -np.inf)),
                             [(2, 4, 4), (4,)]),
    "softmax_logsumexp": (lambda a, b: _softmax_lse(a + b), [(3, 5), (5,)]),
    "layernorm_gelu": (lambda a, b: ref.gelu(ref.layernorm(a, b, b * b)), [(2, 3, 6), (6,)]),
}


@pytest.mark.parametrize("name", list(OP_CASES))
def test_engine_matches_finite_differences(name):
    """Each op's backward, through a random projection to a scalar, equals central finite differences."""
    fn, shapes = OP_CASES[name]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in shapes]
    out_shape = fn(*[Tensor(a) for a in arrays]).shape
    proj = rng.standard_normal(out_shape)                          # random weights: checks every output entry

    def f(arrs):
        return float((fn(*[Tensor(a) for a in arrs]) * proj).sum().data)

    inputs = [Tensor(a) for a in arrays]
    (fn(*inputs) * proj).sum().backward()
    expected = finite_difference_grads(f, arrays)
    err = max(max_rel_err(t.grad, g) for t, g in zip(inputs, expected))
    print(f"\n  engine op {name}: max rel err vs finite differences {err:.2e}")
    assert err < 1e-7


def test_engine_gpt_loss_matches_finite_differences():
    """The engine's GPT loss gradient, at two entries of every parameter, equals central finite differences.

    The loss is ~2, so central differences with h = 1e-5 are accurate to ~1e-10 absolute (rounding ~eps/h,
    truncation ~h^2); the error is the absolute difference, the gradients themselves are ~1e-4 to ~1e-1."""
    cfg = ModelConfig(vocab_size=7, seq_len=3, d_model=4, n_heads=2, n_layers=1, d_ff=5)
    params = noisy_params(cfg, seed=3)
    idx, targets = random_batch(cfg, 2, seed=3)
    _, grads = ref.loss_and_grads(params, idx, targets, cfg)

    def loss_at(i, p, value):
        old, p[i] = p[i], value
        out = float(ref.gpt_loss({n: Tensor(a) for n, a in params.items()}, idx, targets, cfg).data)
        p[i] = old
        return out

    rng = np.random.default_rng(3)
    h, errs = 1e-5, {}
    for name, p in params.items():
        for _ in range(2):                                         # two random entries per parameter
            i = tuple(int(rng.integers(n)) for n in p.shape)
            fd = (loss_at(i, p, p[i] + h) - loss_at(i, p, p[i] - h)) / (2 * h)
            errs[name] = max(errs.get(name, 0.0), abs(fd - grads[name][i]))
    worst = max(errs, key=errs.get)
    print(f"\n  engine GPT loss: max abs err vs finite differences {errs[worst]:.2e} ({worst})")
    assert errs[worst] < 1e-8


# 2. hsgd's hand-written gradients against the engine


def small_cfg(V, T, C, NH, L, F):
    return ModelConfig(vocab_size=V, seq_len=T, d_model=C, n_heads=NH, n_layers=L, d_ff=F)


CONFIGS = {   # name: (ModelConfig, batch size B)
    "V13_T6_C8_NH2_L2_F12_B3": (small_cfg(V=13, T=6, C=8, NH=2, L=2, F=12), 3),
    "V5_T1_C8_NH4_L1_F3_B1": (small_cfg(V=5, T=1, C=8, NH=4, L=1, F=3), 1),      # one position, one key
    "V11_T5_C12_NH4_L1_F7_B1": (small_cfg(V=11, T=5, C=12, NH=4, L=1, F=7), 1),
}

# Some gradients are zero in exact arithmetic. The attention k-bias: q . bk is the same for every key in a
# query's row, and softmax ignores a shift shared by a row. With T = 1 also q and k entirely: the one key gets
# attention weight 1 whatever the scores. Both sides compute rounding noise (~1e-18) for these, so their error
# is measured against a floor of 1e-6 (the other gradients are ~1e-4 to ~1e-1) and they are checked to be ~0.
GRAD_FLOOR = 1e-6


def zero_in_exact_arithmetic(name, cfg):
    if name.endswith("attn.k.bias"):
        return True
    return cfg.seq_len == 1 and any(name.endswith(f"attn.{m}.{w}") for m in "qk" for w in ("weight", "bias"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_serial_grads_match_autograd(name):
    """serial.loss_and_grads: loss to 1e-12 and every parameter's gradient to 1e-10 (relative) vs autograd."""
    cfg, B = CONFIGS[name]
    params = noisy_params(cfg, seed=7)
    idx, targets = random_batch(cfg, B, seed=7)
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    ref_loss, ref_grads = ref.loss_and_grads(params, idx, targets, cfg)

    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    assert set(grads) == set(ref_grads) == set(cfg.param_shapes())
    zero = {n for n in cfg.param_shapes() if zero_in_exact_arithmetic(n, cfg)}
    errs = {n: max_rel_err(grads[n], ref_grads[n], floor=GRAD_FLOOR if n in zero else 1e-300)
            for n in cfg.param_shapes()}
    worst = max(errs, key=errs.get)
    print(f"\n  {name}: loss {loss:.15f}, rel err {loss_err:.2e}")
    for n, e in errs.items():
        scale = np.abs(ref_grads[n]).max()
        print(f"    {n:24s} max|grad| {scale:.1e}  max rel err {e:.2e}")
    worst_nonzero = max((n for n in errs if n not in zero), key=errs.get)
    print(f"  worst gradient: {worst} {errs[worst]:.2e}; "
          f"worst of the non-zero ones: {worst_nonzero} {errs[worst_nonzero]:.2e}")
    assert loss_err < 1e-12
    for n in cfg.param_shapes():
        assert grads[n].shape == ref_grads[n].shape == params[n].shape, n
        assert np.isfinite(ref_grads[n]).all(), n
        if n in zero:
            assert np.abs(ref_grads[n]).max() < 1e-14 and np.abs(grads[n]).max() < 1e-14, n
        else:                                                      # a ~0 reference: a vacuous test
            assert np.abs(ref_grads[n]).max() > 1e-6, f"{n}: reference gradient is ~0"
    assert errs[worst] < 1e-10, f"{worst}: {errs[worst]:.2e}"


# 3. Optional: the engine against torch.float64 autograd


def torch_gpt_loss(torch, params, idx, targets, cfg):
    """The same spec in torch, with torch's own layer_norm, gelu and cross_entropy."""
    F = torch.nn.functional
    p = params
    B, T = idx.shape
    C, NH = cfg.d_model, cfg.n_heads
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:T]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        a = F.layer_norm(x, (C,), p[h + "ln1.weight"], p[h + "ln1.bias"], eps=1e-5)
        q, k, v = [(a @ p[h + f"attn.{m}.weight"] + p[h + f"attn.{m}.bias"]).reshape(B, T, NH, hs)
                   .transpose(1, 2) for m in ("q", "k", "v")]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(~causal, float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.proj.weight"] + p[h + "attn.proj.bias"]
        m = F.layer_norm(x, (C,), p[h + "ln2.weight"], p[h + "ln2.bias"], eps=1e-5)
        u = F.gelu(m @ p[h + "mlp.fc.weight"] + p[h + "mlp.fc.bias"], approximate="tanh")
        x = x + u @ p[h + "mlp.proj.weight"] + p[h + "mlp.proj.bias"]
    logits = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5) @ p["lm_head.weight"]
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_autograd_matches_torch(name):
    """The engine's loss and gradients equal torch.float64 autograd (skipped when torch is not installed)."""
    torch = pytest.importorskip("torch")
    cfg, B = CONFIGS[name]
    params = noisy_params(cfg, seed=11)
    idx, targets = random_batch(cfg, B, seed=11)
    ref_loss, ref_grads = ref.loss_and_grads(params, idx, targets, cfg)
    tparams = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True) for n, p in params.items()}
    tloss = torch_gpt_loss(torch, tparams, torch.as_tensor(idx), torch.as_tensor(targets), cfg)
    tloss.backward()
    loss_err = abs(tloss.item() - ref_loss) / abs(ref_loss)
    errs = {n: max_rel_err(ref_grads[n], tparams[n].grad.numpy(),
                           floor=GRAD_FLOOR if zero_in_exact_arithmetic(n, cfg) else 1e-300) for n in params}
    worst = max(errs, key=errs.get)
    print(f"\n  {name} vs torch: loss rel err {loss_err:.2e}, worst gradient {worst} {errs[worst]:.2e}")
    assert loss_err < 1e-12
    assert errs[worst] < 1e-10
