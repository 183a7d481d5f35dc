"""The block's family as the planner prices it (hsgd.model.config.ModelConfig: norm, positions, mlp, n_kv_heads,
bias, tied): its parameter count as a formula, and what one tensor-parallel rank of a Megatron-style run holds.

Parameters (ModelConfig.param_shapes; K = NKV hs the columns of k and v, m = 2 with GELU, 3 with SwiGLU; n = 2 with
LayerNorm (weight and bias), 1 with RMSNorm; b = 1 with biases on the linears, else 0):

    P = L (2 C^2 + 2 C K + m C F  +  b (2 C + 2 K + (m - 1) F + C)  +  2 n C)     the blocks
        + V C                                   wte
        + T C                                   wpe, with learned positions only (RoPE has no table)
        + n C                                   the final norm
        + C V                                   lm_head, unless tied to wte

For Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: rmsnorm, rope, swiglu, NKV = 8, no biases,
untied): 8.03 B, 70.6 B and 405.9 B parameters (tests/test_plan_llama.py, with sympy).

A Megatron-style tensor-parallel rank (`megatron_numel`) holds 1/tp of q, the MLP's column matrices (fc, or gate
and up) and the row-parallel projections, the vocabulary rows of wte and columns of lm_head padded to tp ceil(V/tp),
every norm and wpe whole, and of k and v its NKV/tp key/value heads; when tp > NKV (tp a multiple of NKV) each rank
holds the one key/value head its query heads read, the same head on tp/NKV ranks (as Megatron-LM's attention does).
"""
from hsgd.errors import ConfigError
from hsgd.model.config import ModelConfig


def is_gpt2(cfg):
    """Whether the block is today's GPT-2 one (the family arch gpt2 gives a model of its heads and width)."""
    return cfg.family() == ModelConfig(n_heads=cfg.n_heads, d_model=cfg.d_model).family()


def param_formula(L, C, F, V, T, K, m=2, n=2, b=1, learned=1, untied=1):
    """The module docstring's P: plain arithmetic, so that it also takes sympy symbols (tests/test_plan_llama.py).
    m: the MLP's C x F matrices (2 GELU, 3 SwiGLU); n: a norm's vectors (2 LayerNorm, 1 RMSNorm); b, learned,
    untied: 1 or 0 for biases on the linears, a position table, an lm_head of its own."""
    block = 2 * C ** 2 + 2 * C * K + m * C * F + b * (2 * C + 2 * K + (m - 1) * F + C) + 2 * n * C
    return L * block + V * C + learned * T * C + n * C + untied * C * V


def params_of(cfg):
    """param_formula of a ModelConfig's sizes and family (equal to cfg.n_params(): tests/test_plan_llama.py), every
    block dense (with experts: hsgd.plan.experts.param_counts)."""
    return param_formula(cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len, cfg.kv_width,
                         m=2 if cfg.mlp == "gelu" else 3, n=2 if cfg.norm == "layernorm" else 1, b=int(cfg.bias),
                         learned=int(cfg.positions == "learned"), untied=int(not cfg.tied))


def kv_columns(cfg, tp):
    """Columns of k (and of v) on one tensor-parallel rank: NKV hs / tp, or one head's hs when tp > NKV."""
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ConfigError(f"n_kv_heads={cfg.n_kv_heads} and tp={tp}: one must divide the other (each rank holds "
                          f"NKV/tp key/value heads, or one head shared by tp/NKV ranks)")
    return cfg.head_size * max(cfg.n_kv_heads // tp, 1)


def megatron_numel(cfg, tp, tied_copy=False):
    """{"embedding", "h", "head": elements one tensor-parallel rank holds of wte (and wpe), of one block, of the
    final norm and lm_head} (see the module docstring). Tied: no lm_head, unless tied_copy (the last of several
    pipeline stages keeps a copy of wte for the head, its gradient added to the first stage's, as Megatron-LM does)."""
    C, F, Vp, K = cfg.d_model, cfg.d_ff, -(-cfg.vocab_size // tp), kv_columns(cfg, tp)
    norm = C * (2 if cfg.norm == "layernorm" else 1)
    mats = 2 if cfg.mlp == "gelu" else 3                               # fc, proj | gate, up, proj
    block = 2 * C * C // tp + 2 * C * K + mats * C * F // tp + 2 * norm
    if cfg.bias:                                                     # q, k, v, fc | gate, up: split; proj: whole
        block += C // tp + 2 * K + (mats - 1) * F // tp + 2 * C
    embedding = Vp * C + (cfg.seq_len * C if cfg.positions == "learned" else 0)
    return {"embedding": embedding, "h": block, "head": norm + (0 if cfg.tied and not tied_copy else C * Vp)}
