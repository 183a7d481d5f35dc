"""An independent reference for the Llama family: Hugging Face transformers' LlamaForCausalLM, in float64, on hsgd's
parameters mapped by name, writes the loss and every gradient of one batch to the small files of tests/data/hf_llama,
which tests/test_hf_llama.py compares with hsgd's serial model (transformers is not needed to run the tests).

    python benchmarks/hf_llama_reference.py              write tests/data/hf_llama/{mha,gqa,mqa,gqa_tied}.npz
    python benchmarks/hf_llama_reference.py --check      regenerate into a temporary folder; compare with the
                                                         committed files and with hsgd (make bench); exit 1 if
                                                         anything differs by more than 1e-12 relative (without
                                                         transformers: hsgd with the committed files only)
    python benchmarks/hf_llama_reference.py --as-shipped the error of LlamaForCausalLM as shipped, float32 inside
                                                         (printed only)

Needs torch and transformers (pip install torch transformers).

The models: tiny (V=32, T=8, C=16, NH=4, hs=4, L=2, F=24, batch B=2), arch llama (RMSNorm with eps 1e-5, rotary
positions with theta 10000, SwiGLU, no biases), with 4, 2 and 1 key/value heads (multi-head, grouped-query and
multi-query attention), untied, and grouped-query with the LM head tied to the embedding (tie_word_embeddings: no
lm_head.weight; wte's gradient is the sum of both uses).

The parameters: hsgd.model.serial.init_params(cfg, SEED, "float64"), then changed so that no gradient is trivial
and the attention is not uniform: every norm's weight 1 + N(0, 0.2^2) (they start at ones), W_q and W_k times 10 (so
that the attention logits are of order 1 and the rotary positions matter), all rounded to float32 (stored in half
the bytes; both models compute in float64 from these same numbers). The batch: token ids drawn uniformly.

The names (hsgd weights are (in, out), the transpose of a torch Linear's (out, in)):
    wte                  model.embed_tokens.weight
    h.i.ln1.weight       model.layers.i.input_layernorm.weight
    h.i.attn.q/k/v       model.layers.i.self_attn.q_proj/k_proj/v_proj.weight, transposed
    h.i.attn.proj        model.layers.i.self_attn.o_proj.weight, transposed
    h.i.ln2.weight       model.layers.i.post_attention_layernorm.weight
    h.i.mlp.gate/up      model.layers.i.mlp.gate_proj/up_proj.weight, transposed
    h.i.mlp.proj         model.layers.i.mlp.down_proj.weight, transposed
    ln_f.weight          model.norm.weight
    lm_head.weight       lm_head.weight, transposed (tied: none; Hugging Face's lm_head.weight is embed_tokens')

The rotary convention: Hugging Face's rotate_half, in which pair i of a head is its dimensions (i, i + hs/2),
turned by position * theta^(-2i/hs); hsgd uses the same (hsgd.model.llama_layers.rope_forward). The rotary paper
(Su et al. 2021, "RoFormer") and Meta's original Llama checkpoints pair (2i, 2i + 1) instead; a checkpoint in that
order is converted by permuting each head's output columns of W_q and W_k by rope_half_order (what Hugging Face's
conversion script does to the rows of q_proj and k_proj). tests/test_hf_llama.py checks that the wrong order fails.

The loss: the mean cross-entropy of logits[b, t] against targets[b, t] over all B*T positions, hsgd's loss,
computed here from the model's logits with F.cross_entropy. (LlamaForCausalLM(labels=...) shifts the labels by one
position and averages over B*(T-1): another quantity.)

Float64 throughout. LlamaForCausalLM, made float64 with .double(), still computes three things in float32, whatever
the model's dtype (a choice made for bf16 and fp16 training): LlamaRMSNorm casts its input to float32, the rotary
embedding computes its angles, cos and sin in float32, and the eager attention takes its softmax in float32. Each
rounds at about 6e-8 relative, far above the 1e-12 checked here (--as-shipped prints what that makes: up to 4e-7 in
the gradients, 4e-10 in the loss, with transformers 5.25 and torch 2.13). So this
program replaces, on the model it built, the forward of each LlamaRMSNorm and of the rotary embedding by the same
formula in the input's dtype (float64_throughout), and runs the attention with attn_implementation="sdpa" (torch's
scaled_dot_product_attention, which computes in its inputs' dtype) in place of "eager". Everything else is the
library's own code: the projections and their head layout, apply_rotary_pos_emb and rotate_half, repeat_kv, the
causal mask, SiLU and the MLP, the embedding and the head, and torch's autograd for every gradient.

Each file (numpy.savez; tests read it with hsgd.readers.Npz): meta (a JSON text as uint8 bytes: the config, the
seed, the torch and transformers versions, the notes above in short), idx and targets (B, T) int64, loss () float64,
param/<hsgd name> float32 and grad/<hsgd name> float64, hsgd's names and layout.

Legend: B batch, T sequence, C d_model, NH query heads, NKV key/value heads, hs = C/NH head size, F d_ff,
V vocab, L layers.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                                           # the repository: hsgd

from hsgd.model import serial  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model.llama_layers import RMS_EPS  # noqa: E402
from hsgd.readers import Npz  # noqa: E402

SIZES = dict(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=24)
MODELS = {"mha": dict(n_kv_heads=4), "gqa": dict(n_kv_heads=2), "mqa": dict(n_kv_heads=1),
          "gqa_tied": dict(n_kv_heads=2, tied=True)}
B = 2
SEED = 20
TOLERANCE = 1e-12
OUT = os.path.join(ROOT, "tests", "data", "hf_llama")


def model_config(name):
    return ModelConfig(arch="llama", **SIZES, **MODELS[name])


def parameters(cfg, seed=SEED):
    """hsgd's initial parameters (float64), the norms' weights 1 + N(0, 0.2^2), W_q and W_k times 10, rounded to
    float32: {hsgd name: float32 array}."""
    rng = np.random.default_rng([seed, 1])
    params = serial.init_params(cfg, seed, "float64")
    for name, p in params.items():
        if ".ln" in name or name.startswith("ln_f"):
            p += rng.normal(0.0, 0.2, size=p.shape)
        elif name.endswith(("attn.q.weight", "attn.k.weight")):
            p *= 10.0
    return {name: p.astype(np.float32) for name, p in params.items()}


def batch(cfg, seed=SEED):
    """(idx, targets), (B, T) int64 each, uniform over the vocabulary."""
    rng = np.random.default_rng([seed, 2])
    idx, targets = rng.integers(0, cfg.vocab_size, size=(2, B, cfg.seq_len))
    return idx, targets


def hf_name(name):
    """(Hugging Face's parameter name, transposed?) of hsgd's `name`."""
    if name == "wte":
        return "model.embed_tokens.weight", False
    if name == "ln_f.weight":
        return "model.norm.weight", False
    if name == "lm_head.weight":
        return "lm_head.weight", True
    _, i, rest = name.split(".", 2)                                # h.{i}.rest
    part = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
            "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
            "attn.v.weight": "self_attn.v_proj.weight", "attn.proj.weight": "self_attn.o_proj.weight",
            "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
            "mlp.proj.weight": "mlp.down_proj.weight"}[rest]
    return f"model.layers.{i}.{part}", not rest.startswith("ln")     # the norms' weights are vectors


# --------------------------------------------------------------------------------------------------------------
# The Hugging Face side

def hf_model(cfg, as_shipped=False):
    """LlamaForCausalLM of cfg's shape in float64 (float64_throughout unless as_shipped: then eager attention and
    the library's float32 steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.seq_len,
                         rms_norm_eps=RMS_EPS, rope_theta=cfg.rope_theta, hidden_act="silu", attention_bias=False,
                         mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=cfg.tied, use_cache=False,
                         attn_implementation="eager" if as_shipped else "sdpa")
    model = LlamaForCausalLM(hf_cfg).double()
    return model if as_shipped else float64_throughout(model, cfg)


def float64_throughout(model, cfg, norm_class=None):
    """The model with each RMSNorm's (norm_class: LlamaRMSNorm by default; another family's with the same fields) and
    the rotary embedding's forward replaced by the same formula computed in the input's dtype (the library's casts to
    float32 left out):
        RMSNorm:  y = w * x / sqrt(mean(x^2) + eps)
        rotary:   a[t, i] = position_ids[t] * theta^(-2i/hs),  cos and sin of [a, a] (the two halves alike)."""
    import torch
    if norm_class is None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as norm_class

    def rmsnorm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2, dtype=torch.float64) / cfg.head_size)

    def rotary(x, position_ids):
        a = position_ids[..., None].to(torch.float64) * inv_freq                # (1, T, hs/2)
        a = torch.cat((a, a), dim=-1)                                           # (1, T, hs)
        return a.cos().to(x.dtype), a.sin().to(x.dtype)

    for module in model.modules():
        if isinstance(module, norm_class):
            module.forward = rmsnorm.__get__(module)
    model.model.rotary_emb.forward = rotary
    return model


def hf_loss_and_grads(cfg, params, idx, targets, as_shipped=False):
    """(loss, {hsgd name: float64 gradient in hsgd's layout}) of LlamaForCausalLM on hsgd's parameters."""
    import torch
    import torch.nn.functional as F
    model = hf_model(cfg, as_shipped)
    theirs = dict(model.named_parameters())                        # (a tied head appears once, as embed_tokens)
    mine = {hf_name(name)[0]: name for name in params}
    if set(theirs) != set(mine):
        raise SystemExit(f"the names do not map one to one: Hugging Face only {sorted(set(theirs) - set(mine))}, "
                         f"hsgd only {sorted(set(mine) - set(theirs))}")
    with torch.no_grad():
        for hf, name in mine.items():
            p = torch.from_numpy(params[name].astype(np.float64))
            theirs[hf].copy_(p.T if hf_name(name)[1] else p)
    logits = model(input_ids=torch.from_numpy(idx)).logits                      # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.from_numpy(targets).reshape(-1))
    loss.backward()
    grads = {}
    for hf, name in mine.items():
        g = theirs[hf].grad.numpy()
        grads[name] = np.ascontiguousarray(g.T if hf_name(name)[1] else g)
    return loss.item(), grads


def generate(name):
    """The arrays of the file `name`.npz."""
    import torch
    import transformers
    cfg = model_config(name)
    params, (idx, targets) = parameters(cfg), batch(cfg)
    loss, grads = hf_loss_and_grads(cfg, params, idx, targets)
    meta = dict(config=dict(arch=cfg.arch, **SIZES, **MODELS[name]), batch=B, seed=SEED, torch=torch.__version__,
                transformers=transformers.__version__, model="LlamaForCausalLM, float64, sdpa attention, "
                "RMSNorm and rotary tables in float64 (benchmarks/hf_llama_reference.py)",
                rope="rotate_half: pair i of a head is (i, i + hs/2)",
                loss="mean cross-entropy of logits[b, t] vs targets[b, t] over all B*T positions, no shift")
    arrays = {"meta": np.frombuffer(json.dumps(meta, indent=1).encode(), np.uint8), "idx": idx, "targets": targets,
              "loss": np.float64(loss)}
    arrays.update({f"param/{n}": p for n, p in params.items()})
    arrays.update({f"grad/{n}": g for n, g in grads.items()})
    return arrays


def write_all(folder):
    os.makedirs(folder, exist_ok=True)
    for name in MODELS:
        np.savez(os.path.join(folder, f"{name}.npz"), **generate(name))


# --------------------------------------------------------------------------------------------------------------
# Reading and comparing (tests/test_hf_llama.py does the same without torch)

def read(path):
    """(cfg, params float64, idx, targets, loss, grads) of a reference file."""
    with Npz(path, "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {name: z[name] for name in z.files}
    cfg = ModelConfig(**meta["config"])
    params = {n[6:]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[5:]: a for n, a in arrays.items() if n.startswith("grad/")}
    return cfg, params, arrays["idx"], arrays["targets"], float(arrays["loss"]), grads


def relative_errors(loss, grads, ref_loss, ref_grads):
    """{"loss": |loss - ref| / |ref|, name: max|g - ref| / max|ref| for each gradient}: each gradient's error is
    relative to the largest entry of its reference."""
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errors[name] = float(np.abs(grads[name] - ref).max() / np.abs(ref).max())
    return errors


def report(what, errors, verdict=True):
    """Print the loss's error and the largest gradient error, with its name (and, with verdict, MISMATCH where it is
    above TOLERANCE); True if every error is within TOLERANCE."""
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= TOLERANCE
    print(f"{what}: loss {errors['loss']:.1e}, largest {errors[worst]:.1e} ({worst})"
          f"{f' > {TOLERANCE:.0e}: MISMATCH' if verdict and not ok else ''}")
    return ok


def check(committed):
    """Regenerate into a temporary folder; compare with the committed files (parameters and batch equal, loss and
    gradients within TOLERANCE) and with hsgd's serial model. Without transformers, compare hsgd with the committed
    files only. True if all agree."""
    try:
        import transformers  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is not installed (pip install torch transformers): hsgd compared with the committed files "
              "only, nothing regenerated")
        return all([compare_hsgd(name, *read(os.path.join(committed, f"{name}.npz"))) for name in MODELS])
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        write_all(folder)
        for name in MODELS:
            cfg, params, idx, targets, loss, grads = read(os.path.join(folder, f"{name}.npz"))
            path = os.path.join(committed, f"{name}.npz")
            if not os.path.exists(path):
                print(f"{name}: {path} is missing; run python benchmarks/hf_llama_reference.py to write it")
                ok = False
                continue
            cfg0, params0, idx0, targets0, loss0, grads0 = read(path)
            same = cfg0 == cfg and (idx0 == idx).all() and (targets0 == targets).all() and \
                all((params0[n] == p).all() for n, p in params.items()) and set(grads0) == set(grads)
            if not same:
                print(f"{name}: the committed file has other parameters, batch or names than this program makes "
                      "(hsgd's initialization changed?); rewrite it with python benchmarks/hf_llama_reference.py")
                ok = False
                continue
            ok &= report(f"{name}: this transformers vs the committed file", relative_errors(loss, grads, loss0,
                                                                                           grads0))
            ok &= compare_hsgd(name, cfg, params, idx, targets, loss, grads)
    return ok


def compare_hsgd(name, cfg, params, idx, targets, loss, grads):
    """hsgd's serial model against one reference; True if within TOLERANCE."""
    hsgd_loss, hsgd_grads = serial.loss_and_grads(params, idx, targets, cfg)
    if set(hsgd_grads) != set(grads):
        print(f"{name}: hsgd's parameters {sorted(hsgd_grads)} are not the reference's {sorted(grads)}")
        return False
    return report(f"{name}: hsgd serial vs Hugging Face", relative_errors(hsgd_loss, hsgd_grads, loss, grads))


def as_shipped(committed):
    """Print the error of LlamaForCausalLM as shipped (eager attention, float32 inside) against the files."""
    for name in MODELS:
        cfg, params, idx, targets, loss, grads = read(os.path.join(committed, f"{name}.npz"))
        report(f"{name}: as shipped vs the file", relative_errors(*hf_loss_and_grads(cfg, params, idx, targets, True),
                                                                  loss, grads), verdict=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="the folder of the reference files (default tests/data/hf_llama)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary folder, compare with --out's "
                    "files and with hsgd; exit 1 on a difference above 1e-12 relative")
    ap.add_argument("--as-shipped", action="store_true", help="print the error of the model as shipped (float32 "
                    "RMSNorm, rotary tables and softmax) against --out's files")
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check(args.out) else 1)
    if args.as_shipped:
        as_shipped(args.out)
        return
    write_all(args.out)
    for name in MODELS:
        path = os.path.join(args.out, f"{name}.npz")
        print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
