"""The hsgd model written in PyTorch, for the benchmarks only: what a user would pick instead.

The same specification as hsgd/model/serial.py (pre-LayerNorm GPT-2 block, GELU tanh approximation, causal attention,
untied LM head without bias, mean cross-entropy), in PyTorch eager with its fused CPU kernels
(F.layer_norm, F.gelu, F.scaled_dot_product_attention, F.cross_entropy). Parameters are copied from hsgd's
NumPy parameters, so both start from identical weights and the benchmark first checks that both give the same
loss.
"""
import torch
import torch.nn.functional as F


def to_torch(params, dtype=torch.float32):
    """hsgd's parameter dict (NumPy) -> dict of leaf tensors that require grad."""
    return {n: torch.tensor(p, dtype=dtype, requires_grad=True) for n, p in params.items()}


def loss_fn(p, idx, targets, cfg):
    B, T = idx.shape
    C, NH = cfg.d_model, cfg.n_heads
    x = p["wte"][idx] + p["wpe"][:T]
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        a = F.layer_norm(x, (C,), p[h + "ln1.weight"], p[h + "ln1.bias"], eps=1e-5)
        q = (a @ p[h + "attn.q.weight"] + p[h + "attn.q.bias"]).view(B, T, NH, C // NH).transpose(1, 2)
        k = (a @ p[h + "attn.k.weight"] + p[h + "attn.k.bias"]).view(B, T, NH, C // NH).transpose(1, 2)
        v = (a @ p[h + "attn.v.weight"] + p[h + "attn.v.bias"]).view(B, T, NH, C // NH).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.proj.weight"] + p[h + "attn.proj.bias"]
        m = F.layer_norm(x, (C,), p[h + "ln2.weight"], p[h + "ln2.bias"], eps=1e-5)
        g = F.gelu(m @ p[h + "mlp.fc.weight"] + p[h + "mlp.fc.bias"], approximate="tanh")
        x = x + g @ p[h + "mlp.proj.weight"] + p[h + "mlp.proj.bias"]
    xf = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = xf @ p["lm_head.weight"]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def momentum_sgd(p, lr, momentum):
    """torch.optim.SGD over the parameter dict: v <- momentum v + g; w <- w - lr v (no dampening, no Nesterov),
    hsgd's SGD (hsgd.model.optim.SGD)."""
    return torch.optim.SGD(list(p.values()), lr=lr, momentum=momentum)


def sgd_step(p, lr):
    """Plain SGD, w <- w - lr g, then the gradients dropped (as zero_grad does)."""
    with torch.no_grad():
        for t in p.values():
            t -= lr * t.grad
            t.grad = None
