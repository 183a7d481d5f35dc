"""Published formulas the planner uses for a Megatron-style implementation (mixed precision, Adam), and the
published results it is checked against.

hsgd itself computes in one precision and keeps what hsgd.accounting.step_memory says it keeps; a production system
keeps 16-bit weights and activations and a 32-bit optimizer. For those runs (`python -m hsgd.plan --impl megatron`) the
planner takes memory from the papers:

  * model state per device, Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models" (hsgd.accounting.activations.paper_zero_bytes): (2 + 2 + K) psi with K = 12 for Adam, divided by
    the dp ranks where the ZeRO stage shards it; psi = the parameters of a device's stage and tensor shard;
  * activations per layer and micro-batch, Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
    Transformer Models", Table 2 (hsgd.accounting.activations.paper_table2): s b h (10 + 24/t + 5 a s/(h t)) with tensor
    parallelism, s b h (34/t + 5 a s/(h t)) with sequence parallelism, 34 s b h / t with selective
    recomputation (sequence parallel; without it s b h (10 + 24/t)), 2 s b h with full recomputation (plus one
    layer's whole activations while it is recomputed);
    a stage holds the activations of the micro-batches its schedule keeps in flight (hsgd.pp.timelines.peak_held),
    and the last stage the loss's 32-bit logits, 4 s b V/t. `activation_bytes` writes Table 2 term by term, so
    that the family changes it (grouped-query k and v, SwiGLU, no dropout in Llama's runs) and so that flash
    attention (the planner's default) drops the 5 a s^2 b of the stored scores for the 4 a s b of the log-sum-exp;

and the FLOPs of Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", with full recomputation (hsgd.model.config.gpt_step_flops equals it when F = 4h):
    parameters  P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))           (tied embeddings, no final LayerNorm)
    FLOPs       F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h))                 per iteration of B sequences
Their Table 1 is in narayanan2021.csv (`table1()`).
Left out: the 1-byte dropout masks are in Table 2's constants; the embedding's and the optimizer's temporary
buffers, and the memory allocator's fragmentation, are not.
"""
import csv
import os

from hsgd.model.config import ModelConfig
from hsgd.accounting.activations import paper_zero_bytes
from .experts import kept_bytes
from .family import kv_columns

TABLE1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "narayanan2021.csv")
SEQ, VOCAB, PEAK = 2048, 51200, 312e12                        # Table 1's setting: s, V, A100 bf16/fp16 peak


def paper_params(l, h, V, s):
    """Narayanan et al. (2021), eq. (2)'s parameter count."""
    return 12 * l * h ** 2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def paper_flops(B, s, l, h, V):
    """Narayanan et al. (2021)'s FLOPs of one iteration with activation recomputation."""
    return 96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h))


def hsgd_params_as_paper(cfg):
    """hsgd's parameter count with the LM head tied to wte and no final LayerNorm, the paper's model."""
    return cfg.n_params() - cfg.vocab_size * cfg.d_model - 2 * cfg.d_model


def table1():
    """The rows of Table 1 as dicts of numbers, each with its ModelConfig ("cfg")."""
    with open(TABLE1) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out = []
    for r in rows:
        row = {k: (float(v) if "." in v else int(v)) for k, v in r.items()}
        row["cfg"] = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=row["hidden"], n_heads=row["heads"],
                                 n_layers=row["layers"], d_ff=4 * row["hidden"])
        out.append(row)
    return out


DROPOUT = {"gpt2": True, "llama": False}   # Korthikanti et al.'s GPT runs keep dropout masks; Llama 3 uses none


def activation_bytes(cfg, b, tp, sequence, recompute, cp=1, attention="materialized", moe=False):
    """Korthikanti et al. (2022)'s activation bytes of one layer for one micro-batch of b sequences (16-bit), on a
    rank holding s = T/cp positions, term by term so that the family changes them (K_t = kv_columns: the columns of
    k and v on one of the t tensor-parallel ranks; mlp 4 s b F with GELU (its input and output), 6 s b F with SwiGLU
    (the fused kernel's 2F-wide input of gate and up, and the product, the projection's input)):

        replicated   s b h (8 + 2 dropout)        the two norms' inputs 4, the inputs of qkv and of the MLP 4, the
                                                  two 1-byte dropout masks 2 (gpt2's runs; none in Llama 3's)
        split by t   4 s b h + 4 s b K_t t + mlp  q 2, the attention's output 2, k and v 2 K_t t / h each
        scores       materialized: (5 with dropout, else 2) a s^2 b / t   the scores, softmax, dropout mask and
                                                  output (2 + 2 + 1) of Table 2; without dropout the softmax only
                     flash: 4 a s b / t           FlashAttention (Dao et al. 2022) stores no scores: of the
                                                  attention it keeps the output (counted above) and each row's
                                                  32-bit log-sum-exp; the scores are recomputed in the backward

    rows: none = replicated (/t with sequence parallelism) + split/t + scores; selective = the same without the
    scores; full = the layer's input, 2 s b h (/t with sequence parallelism). For gpt2 with F = 4h (K = h, dropout,
    materialized) this is Table 2: s b h (10 + 24/t + 5 a s/(h t)), s b h (34/t + 5 a s/(h t)), 34 s b h/t, 2 s b h.
    moe: a MoE block's, whose experts keep hsgd.plan.experts.kept_bytes of N = s b rows in place of the mlp term
    (the rows whole on every tp rank, sequence parallelism or not)."""
    s, h, a, t = cfg.seq_len // cp, cfg.d_model, cfg.n_heads, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sequence else 1)
    drop = DROPOUT[cfg.arch]
    rep = 8 + 2 * drop
    split = 4 + 4 * (kv_columns(cfg, t) * t) / h + (4 if cfg.mlp == "gelu" else 6) * cfg.d_ff / h
    score = 0 if recompute == "selective" else (
        4 * a / h if attention == "flash" else (5 if drop else 2) * a * s / h)
    experts = kept_bytes(cfg, s * b, t) - s * b * (4 if cfg.mlp == "gelu" else 6) * cfg.d_ff / t if moe else 0
    if sequence:
        return s * b * h * ((rep + split) / t + score / t) + experts
    return s * b * h * (rep + split / t + score / t) + experts


def model_states(numel, nd, zero, K):
    """(weights, grads, optimizer) bytes of numel parameters ZeRO-sharded over nd ranks: 2, 2 and K bytes each."""
    states = paper_zero_bytes(numel, nd, zero, K)
    weights = numel * 2 / (nd if zero == 3 else 1)
    grads = numel * 2 / (nd if zero >= 2 else 1)
    return weights, grads, states - weights - grads


def stage_memory(cfg, lay, numel, n_blocks, held, last, state_bytes=16, experts=0, n_moe=0):
    """{category: bytes} on one device of a stage in a Megatron-style run: numel its parameters (its tp shard),
    n_blocks its blocks, held the micro-batches (chunks) in flight at its peak, last: it has the loss.
    state_bytes per parameter: 16 for mixed-precision Adam (2 + 2 + K, K = 12). experts: its expert elements,
    ZeRO-sharded over edp = dp cp / ep (hsgd.plan.experts), in categories of their own; n_moe of its blocks MoE."""
    K = state_bytes - 4
    nd = lay.dp * lay.cp
    weights, grads, optimizer = model_states(numel, nd, lay.zero, K)
    sequence = lay.tp_scheme == "sequence"
    per_layer = activation_bytes(cfg, lay.b, lay.tp, sequence, lay.recompute, lay.cp, lay.attention)
    per_moe = activation_bytes(cfg, lay.b, lay.tp, sequence, lay.recompute, lay.cp, lay.attention, True) if n_moe \
        else 0.0
    acts = held * ((n_blocks - n_moe) / lay.v) * per_layer + held * (n_moe / lay.v) * per_moe
    out = {"params": weights, "grads": grads, "optimizer": optimizer, "activations": acts}
    if experts:
        out["expert params"], out["expert grads"], out["expert optimizer"] = model_states(experts, nd // lay.ep,
                                                                                          lay.zero, K)
    if lay.recompute == "full":                             # one layer's whole activations, rebuilt for its backward
        kinds = [moe for moe, n in ((False, n_blocks - n_moe), (True, n_moe)) if n]      # (the larger kind's)
        out["recompute"] = max(activation_bytes(cfg, lay.b, lay.tp, sequence, "none", lay.cp, lay.attention, moe)
                               for moe in kinds)
    if last:
        out["activations"] += 4 * (cfg.seq_len // lay.cp) * lay.b * -(-cfg.vocab_size // lay.tp)
    return out
