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
    and the last stage the loss's 32-bit logits, 4 s b V/t.

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
from hsgd.accounting.activations import paper_table2, paper_zero_bytes

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


def activation_bytes(cfg, b, tp, sequence, recompute, cp=1):
    """Korthikanti et al. (2022)'s activation bytes of one layer for one micro-batch of b sequences (16-bit), on a
    rank holding T/cp positions: the Table 2 row of these settings (see the module docstring)."""
    rows = paper_table2(cfg.seq_len // cp, b, cfg.d_model, cfg.n_heads, tp)
    if recompute == "full":
        return rows["full"] / (tp if sequence else 1)
    if recompute == "selective":
        return rows["selective"] if sequence else cfg.seq_len // cp * b * cfg.d_model * (10 + 24 / tp)
    return rows["tp+sp" if sequence else "tp"]


def stage_memory(cfg, lay, numel, n_blocks, held, last, state_bytes=16):
    """{category: bytes} on one device of a stage in a Megatron-style run: numel its parameters (its tp shard),
    n_blocks its blocks, held the micro-batches (chunks) in flight at its peak, last: it has the loss.
    state_bytes per parameter: 16 for mixed-precision Adam (2 + 2 + K, K = 12)."""
    K = state_bytes - 4
    nd = lay.dp * lay.cp
    states = paper_zero_bytes(numel, nd, lay.zero, K)
    weights = numel * 2 / (nd if lay.zero == 3 else 1)
    grads = numel * 2 / (nd if lay.zero >= 2 else 1)
    sequence = lay.tp_scheme == "sequence"
    per_layer = activation_bytes(cfg, lay.b, lay.tp, sequence, lay.recompute, lay.cp)
    acts = held * (n_blocks / lay.v) * per_layer
    out = {"params": weights, "grads": grads, "optimizer": states - weights - grads, "activations": acts}
    if lay.recompute == "full":                             # one layer's whole activations, rebuilt for its backward
        out["recompute"] = activation_bytes(cfg, lay.b, lay.tp, sequence, "none", lay.cp)
    if last:
        out["activations"] += 4 * (cfg.seq_len // lay.cp) * lay.b * -(-cfg.vocab_size // lay.tp)
    return out
