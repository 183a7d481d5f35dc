"""hsgd's Llama-family model written in PyTorch, for the benchmarks only: what a user would pick instead.

The same specification as hsgd/model/serial.py with ModelConfig(arch="llama") (pre-norm blocks with RMSNorm, eps
1e-5, no biases; rotary positions in Hugging Face's half order, the cos / sin tables hsgd's own; grouped-query
attention, query head j reading key/value head j // (NH/NKV); SwiGLU; untied LM head; mean cross-entropy over all
B*T positions), in PyTorch eager: plain tensor operations for RMSNorm, the rotation and SwiGLU, and torch's fused
causal attention (F.scaled_dot_product_attention) and F.cross_entropy. Parameters are copied from hsgd's NumPy
parameters (torch_gpt.to_torch), so both start from identical weights; benchmarks/bench_llama.py checks both give
the same loss and gradients before timing them.

Legend: B batch, T sequence, C d_model, NH query heads, NKV key/value heads, hs head size, F d_ff, V vocab.
"""
import torch
import torch.nn.functional as F

RMS_EPS = 1e-5


def rmsnorm(x, w):
    """x / sqrt(mean x^2 + eps) * w over the last axis."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


def rotate(x, cos, sin):
    """x * cos + rotate_half(x) * sin; x (B, H, T, hs), cos and sin (T, hs): pair i is (x[i], x[i + hs/2])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def loss_fn(p, idx, targets, cfg, cos, sin):
    """The mean cross-entropy of the model on idx (B, T) against targets (B, T); cos, sin (T, hs): the rotary
    tables (hsgd.model.serial.rope_tables)."""
    B, T = idx.shape
    C, NH, NKV, hs = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_size
    x = p["wte"][idx]                                                              # (B, T, C)
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        a = rmsnorm(x, p[h + "ln1.weight"])
        q = (a @ p[h + "attn.q.weight"]).view(B, T, NH, hs).transpose(1, 2)        # (B, NH, T, hs)
        k = (a @ p[h + "attn.k.weight"]).view(B, T, NKV, hs).transpose(1, 2)       # (B, NKV, T, hs)
        v = (a @ p[h + "attn.v.weight"]).view(B, T, NKV, hs).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (t.repeat_interleave(NH // NKV, dim=1) for t in (k, v))             # (B, NH, T, hs): j -> j // n_rep
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.proj.weight"]
        m = rmsnorm(x, p[h + "ln2.weight"])
        g = F.silu(m @ p[h + "mlp.gate.weight"]) * (m @ p[h + "mlp.up.weight"])   # (B, T, F)
        x = x + g @ p[h + "mlp.proj.weight"]
    logits = rmsnorm(x, p["ln_f.weight"]) @ p["lm_head.weight"]                    # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
