"""The models the planner knows by name, and --model's text: a preset, KEY=VALUE pairs, or a preset changed by pairs.

    --model llama3-405b                                   a preset (presets())
    --model llama3-70b,T=4096                             a preset with some keys changed
    --model arch=llama,L=80,C=8192,NH=64,NKV=8,F=28672,V=128256,T=8192
    --model L=24,C=2048,NH=16,mlp=swiglu,pos=rope,norm=rmsnorm,bias=no

Keys (KEYS): L layers, C width, NH heads, NKV key/value heads, F the MLP's hidden width, V vocabulary, T sequence;
arch (gpt2 | llama: a preset of the rest), norm (layernorm | rmsnorm), pos (learned | rope), mlp (gelu | swiglu),
bias and tied (yes | no), theta (RoPE's base; it prices nothing). A bad value, or n_heads not a multiple of
n_kv_heads, is one line (ModelError, exit 2).
"""
from hsgd.errors import ConfigError, UsageError
from hsgd.model.config import ModelConfig
from .paper import table1


class ModelError(UsageError):
    """A --model the planner cannot use; the message says what to change."""


SIZE_KEYS = {"L": "n_layers", "C": "d_model", "NH": "n_heads", "NKV": "n_kv_heads", "F": "d_ff", "V": "vocab_size",
             "T": "seq_len"}
WORD_KEYS = {"arch": ("arch", ("gpt2", "llama")), "norm": ("norm", ("layernorm", "rmsnorm")),
             "pos": ("positions", ("learned", "rope")), "mlp": ("mlp", ("gelu", "swiglu")),
             "bias": ("bias", ("yes", "no")), "tied": ("tied", ("yes", "no"))}
KEYS = list(SIZE_KEYS) + list(WORD_KEYS) + ["theta"]

GPT2 = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
        "gpt2-xl": (48, 1600, 25)}
# Dubey et al. (2024), Table 3: layers, model dimension, FFN dimension, attention heads, key/value heads; vocabulary
# 128,000 + 256 reserved = 128,256 tokens; RoPE base 500,000; pre-trained at sequence length 8,192.
LLAMA3 = {"llama3-8b": (32, 4096, 14336, 32), "llama3-70b": (80, 8192, 28672, 64),
          "llama3-405b": (126, 16384, 53248, 128)}
# Jiang et al. (2024), "Mixtral of Experts", Table 1: dim 4096, n_layers 32, head_dim 128, hidden_dim 14336, n_heads
# 32, n_kv_heads 8, context_len 32768, vocab_size 32000, num_experts 8, top_k_experts 2 (RoPE base 1e6: the released
# configuration's); "47B parameters", "13B active parameters" per token (hsgd.plan.experts).
MIXTRAL = ModelConfig(vocab_size=32000, seq_len=32768, d_model=4096, n_heads=32, n_layers=32, d_ff=14336,
                      arch="llama", n_kv_heads=8, rope_theta=1e6, moe_experts=8, moe_top_k=2)


def llama3(L, C, F, NH, T=8192):
    return ModelConfig(vocab_size=128256, seq_len=T, d_model=C, n_heads=NH, n_layers=L, d_ff=F, arch="llama",
                       n_kv_heads=8, rope_theta=500000.0)


def presets():
    """{name: ModelConfig}: the GPT models of Narayanan et al. 2021 Table 1, GPT-2's four, Llama 3's three (Dubey
    et al. 2024, Table 3), Mixtral 8x7B (Jiang et al. 2024), hsgd's own (hsgd.train's default and a small one) in
    each arch."""
    out = {f"narayanan-{r['params_billion']:g}b": r["cfg"] for r in table1()}
    for name, (L, C, NH) in GPT2.items():
        out[name] = ModelConfig(vocab_size=50257, seq_len=1024, d_model=C, n_heads=NH, n_layers=L, d_ff=4 * C)
    for name, sizes in LLAMA3.items():
        out[name] = llama3(*sizes)
    out["mixtral-8x7b"] = MIXTRAL
    small = dict(seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    out["hsgd-default"] = ModelConfig()                                   # hsgd.train's default model
    out["hsgd-small"] = ModelConfig(**small)
    out["llama-default"] = ModelConfig(arch="llama")                      # hsgd.train --arch llama
    out["llama-small"] = ModelConfig(arch="llama", **small)
    return out


def parse_model(text):
    """A preset name, KEY=VALUE pairs (KEYS; L, C and NH needed; F defaults to 4C, V to 256, T to 64), or a preset
    followed by pairs that change it (llama3-70b,T=4096). Raises ModelError with one line."""
    table = presets()
    head, _, rest = text.partition(",")
    base = table.get(head.strip()) if "=" not in head else None
    if text in table:
        return table[text]
    if "=" not in text or (base is None and "=" not in head):
        raise ModelError(f"unknown model {text!r}; give a preset ({', '.join(table)}), one followed by keys "
                         "(llama3-70b,T=4096) or keys such as L=96,C=12288,NH=96,F=49152,V=51200,T=2048 "
                         f"(keys: {', '.join(KEYS)})")
    fields = {}
    for part in (rest if base is not None else text).split(","):
        k, _, v = (x.strip() for x in part.partition("="))
        fields.update(parse_key(text, part, k, v))
    if base is None:
        missing = [k for k in ("L", "C", "NH") if SIZE_KEYS[k] not in fields]
        if missing:
            raise ModelError(f"--model {text!r} has no {', '.join(missing)}; L (layers), C (width) and NH (heads) "
                             "are needed, e.g. L=24,C=2048,NH=16")
        fields.setdefault("d_ff", 4 * fields["d_model"])
    else:
        given = {f: getattr(base, f) for f in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff",
                                               "arch", "rope_theta", "moe_top_k", "moe_capacity_factor")}
        if "arch" not in fields:
            given.update(base.family())                                  # (a changed arch: its own preset)
        fields = given | fields
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ModelError(f"--model {text!r}: {e}") from None


def parse_key(text, part, k, v):
    """{ModelConfig field: value} of one KEY=VALUE of --model."""
    if k in SIZE_KEYS and v.isascii() and v.isdigit():
        return {SIZE_KEYS[k]: int(v)}
    if k in WORD_KEYS and v in WORD_KEYS[k][1]:
        name = WORD_KEYS[k][0]
        return {name: v == "yes"} if name in ("bias", "tied") else {name: v}
    if k == "theta":
        try:
            return {"rope_theta": float(v)}
        except ValueError:
            pass
    if k in WORD_KEYS:
        raise ModelError(f"--model {text!r}: {part!r}: {k} takes one of {', '.join(WORD_KEYS[k][1])}")
    raise ModelError(f"--model {text!r}: {part!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)} (sizes "
                     f"{', '.join(SIZE_KEYS)} are integers, e.g. NKV=8; theta a number)")
