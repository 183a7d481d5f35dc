"""Activation memory: the bytes a forward pass caches for the backward, counted and predicted.

activation_bytes counts the distinct arrays held by the caches of a forward pass (hsgd.tp.model.forward);
activation_formula predicts them for each tensor-parallel scheme, model family (GPT-2, Llama) and core attention
(materialized, flash), per block and for the whole model;
paper_activation_bytes is Korthikanti et al. (2022)'s Table 2, to compare what sequence parallelism buys.

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, Vp = ceil(V/tp), N = B*T, s bytes per element,
tp ranks.
"""
from hsgd.cp.split import attention_cache_bytes
from hsgd.tp.kv import kv_columns
from hsgd.tp.schemes import make_scheme


def activation_bytes(caches, params):
    """Bytes of the distinct array buffers held by `caches` (any nesting of tuples and lists), each counted once
    through the array that owns the memory (a view counts as its base); parameters (caches hold W) do not count."""
    def owner(a):                                                      # a, or the base a view was made from
        while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
            a = a.base
        return a
    skip = {id(owner(p)) for p in params.values()}
    seen, todo = {}, [caches]
    while todo:
        x = todo.pop()
        if isinstance(x, (tuple, list)):
            todo.extend(x)
        elif hasattr(x, "nbytes") and getattr(x, "ndim", 0) > 0 and id(owner(x)) not in skip:
            seen[id(owner(x))] = owner(x).nbytes
    return sum(seen.values())


def activation_formula(cfg, batch_size, itemsize, tp, scheme, cp=1, cp_scheme="ring", attention="materialized"):
    """{"block": bytes cached by one block's forward, "model": by the whole forward} in this implementation.
    scheme: a name or a scheme object (hsgd.tp.schemes); attention: --attention, "materialized" or "flash" (cp = 1).

    What a block caches, in elements of s bytes (megatron / gather / sequence):
        LN1, LN2: xhat (N, C) and rstd (N, 1), each        N(C + 1)        N(C + 1)    N(C + 1)/tp
          (RMSNorm: xhat and rrms, the same sizes)
        the inputs of q,k,v and of the MLP (a, m)           2NC             2NC         2NC/tp  (the T-shards)
        the core attention A (below)                        A               A           A
        the MLP's cache: GELU's, or SwiGLU's gate and       G NF/tp         G NF/tp     G NF/tp
          up pre-activations (views of one fused product)
        the projections' inputs: heads, MLP output          (NC + NF)/tp    NC + NF     (NC + NF)/tp
          (GELU(u), or silu(g) * u)
    with G = 1 (GELU) or 2 (SwiGLU), and A, the core attention's cache (hsgd.cp.split.attention_cache_bytes):
        materialized   q, k, v by heads and the probabilities (B, NH/tp, T, T)    (3NC + B NH T^2)/tp
        flash          q, k, v by heads and the log-sum-exp (B, NH/tp, T)           (3NC + B NH T)/tp
      (and y, the array the projection keeps as its input; where the gather scheme's projection keeps its
      All-Gathered input instead, y's NC/tp more; ring attention's cache holds y the same way)
    k and v are counted at C/tp columns whatever NKV is: a rank holding the whole sequence repeats them to its NH/tp
    query heads for the core attention, whose cache holds the repeated ones (with cp, the ring's, all-gather's and
    Ulysses' caches hold the kv heads themselves: hsgd.cp.split.attention_cache_bytes). In all:
      megatron: s (4NC + 2N) + s (NC + (1 + G) NF)/tp + s A;   sequence: s (5NC + 2N + (1 + G) NF)/tp + s A;
      gather:   s (5NC + 2N + NF) + G s NF/tp + s A  (its projections cache their All-Gathered input).
    GPT-2 (G = 1, materialized) is megatron s (4NC + 2N + (4NC + B NH T^2 + 2NF)/tp). The materialized A grows with
    T^2, flash's with T: the probabilities outgrow an (N, C) array once T > hs (B NH T^2 > B T C).
    Outside the blocks: LN_f (xhat, rstd) and the LM head input, N(2C + 1) s (/tp for sequence); the loss's softmax
    (N, Vp) s; the token ids and owner masks of the embedding and the loss, int64 and bool, 2 (8 + 1) N bytes, and
    the loss's row numbers, 8N. Neither the rotary positions (no wpe; their tables belong to the setup) nor a tied
    head (its weight is wte's transposed view) cache anything more.
    With context parallelism (cp > 1) every term is of the rank's N = B T/cp rows, and the attention's cache is
    the cp scheme's in place of A (hsgd.cp.split.attention_cache_bytes; --attention does not apply). Only the ring's
    cache holds y; the all-gather's and Ulysses' hand on y without keeping it (Ulysses' y is its second all-to-all's
    result, which the projection keeps as its input); a2a+p2p's cache holds its group's y, another array than the
    one handed on (its second all-to-all's), counted in its A.
    """
    S = make_scheme(scheme)
    B, C, F, NH, V = batch_size, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size
    s, Vp, N = itemsize, -(-V // tp), batch_size * (cfg.seq_len // cp)
    G = 1 if cfg.mlp == "gelu" else 2                                 # GELU's cache, or SwiGLU's gate and up
    between = tp if S.splits_T else 1                                 # between the split matmuls: T or T/tp rows
    proj_in = 1 if S.gathers_proj_inputs else tp                      # the projections' inputs: whole or my share
    A, _ = attention_cache_bytes(cp, cp_scheme, B, cfg.seq_len, C, NH, tp, s, attention, kv_columns(cfg, tp))
    keeps_y = (cp == 1 and attention == "flash") or (cp > 1 and cp_scheme == "ring")   # flash's and the ring's
    if keeps_y and S.gathers_proj_inputs:                             # caches hold y, which the gather scheme's
        A += N * C * s // tp                                          # projection does not (its input is gathered)
    block = ((4 * N * C + 2 * N) * s // between + (N * C + N * F) * s // proj_in + G * N * F * s // tp + A)
    outside = N * (2 * C + 1) * s // between
    return {"block": block, "model": cfg.n_layers * block + outside + N * Vp * s + 26 * N}


def paper_activation_bytes(s, b, h, a, t, sequence):
    """Activation bytes per layer of the paper's Table 2 (16-bit activations, 1-byte dropout masks, F = 4h):
    tensor parallel s b h (10 + 24/t + 5 a s / (h t)); tensor + sequence parallel s b h (34/t + 5 a s / (h t)).

    hsgd's (activation_formula with s = T, b = B, h = C, a = NH), counted in 16-bit units to compare, F = 4h:
        megatron s b h (8 + 24/t + 2 a s / (h t)),  sequence s b h (32/t + 2 a s / (h t))  (+ rstd 4sb, /t in SP)
    The ratio megatron / sequence differs: for GPT-3 175B's shape (s = 2048, h = 12288, a = 96, t = 8) hsgd's is
    1.88, the paper's 1.61; for the test model (T = 8, C = F = 16, NH = 8, B = 3, t = 8, float64) 3.04 and 2.30.
      * no dropout: the paper's replicated 10 is LN inputs 4 + inputs of q,k,v and fc 4 + dropout masks 2;
        hsgd's replicated 8 is LN xhat 4 + the same linear inputs 4 (plus LN's rstd);
      * per attention entry the paper (its section 4.1) keeps the softmax's output and the dropout's output (2 bytes
        each) and the dropout mask (1), never the raw scores: 5; hsgd keeps the softmax only (2). This term is
        split by t in both schemes, and it is what is left after sequence parallelism (the paper's 10 of 14.25 for
        GPT-3): the larger it is, the smaller the ratio;
      * hsgd caches q, k, v, the merged heads, and for GELU its derivative and output: 24/t, as the paper's
        terms split by t (where the paper keeps GELU's input, hsgd keeps its derivative);
      * hsgd's elements are 8 bytes (float64) or 4 (float32), not 2; only ratios compare.
    In both, sequence parallelism leaves nothing replicated: every term is divided by t.
    """
    return s * b * h * ((34 / t if sequence else 10 + 24 / t) + 5 * a * s / (h * t))


def paper_table2(s, b, h, a, t):
    """Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", Table 2: the
    activation bytes of one transformer layer in their setting (16-bit activations, 1-byte dropout masks, F = 4h):
        "none"       no parallelism                      s b h (34 + 5 a s / h)
        "tp"         tensor parallel                     s b h (10 + 24/t + 5 a s / (h t))
        "tp+sp"      tensor + sequence parallel          s b h (34/t + 5 a s / (h t))
        "selective"  tensor + sequence parallel, selective recomputation      34 s b h / t
        "full"       full recomputation (the layer's input only)              2 s b h
    s sequence, b batch, h hidden, a heads, t tensor-parallel ranks.

    hsgd's rows (hsgd.accounting.step_memory.pieces: K per block, with --recompute none | selective | full), in bytes at
    2 per element to compare, F = 4h: megatron s b h (8 + 24/t) + 4 s b + 2 a s^2 b / t; sequence (32 s b h + 4 s b
    + 2 a s^2 b) / t; selective drops the 2 a s^2 b / t of the probabilities; full keeps x, 2 s b h (sequence /t).
    Where they differ, and why:
      * bytes per element: hsgd's are 8 (float64) or 4 (float32), not 2; dropout masks (1 byte in the paper) do
        not exist in hsgd (no dropout): the paper's 10 replicated terms are LN inputs 4 + q,k,v and fc inputs 4 +
        the two dropout masks 2; hsgd keeps LN's xhat and rstd (4 + the 2 s b of rstd) and the same linear inputs;
      * per attention score the paper keeps the scores, softmax and dropout output (2 + 2 + 1 bytes with the
        mask: 5 a s^2 b); hsgd keeps the softmax only (one element);
      * the terms split by t: the paper keeps q, k (4), v (2), the attention output (2), fc's output (8, GELU's
        input), GELU's output (8): 24; hsgd keeps the head-split q, k, v (3), the merged heads (1), GELU's
        derivative (4, in place of its input) and GELU's output (4): 12 elements, 24 in 2-byte units;
      * selective recomputation: the paper drops the scores, softmax, dropout mask and output, hsgd the softmax;
        its recompute buffers (q, k, v copies and the probabilities, R) are alive while one block's backward runs;
      * full recomputation: the paper's 2 s b h is one 2-byte input; hsgd's input is one element per number, and
        the sequence scheme caches only its T-shard (1/t); the whole block's cache is rebuilt for one block at a
        time in the backward pass (R = the "none" block cache).
    """
    per_score = 5 * a * s / h
    return {"none": s * b * h * (34 + per_score), "tp": s * b * h * (10 + 24 / t + per_score / t),
            "tp+sp": s * b * h * (34 / t + per_score / t), "selective": 34 * s * b * h / t, "full": 2 * s * b * h}


def paper_zero_bytes(psi, nd, stage, K=12):
    """Model-state bytes per data-parallel rank in Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward
    Training Trillion Parameter Models": mixed-precision Adam keeps 2 bytes of fp16 parameters and 2 of fp16
    gradients per parameter, and K = 12 of optimizer state (an fp32 copy of the parameters, momentum, variance):
        stage 0 (plain data parallel)     (2 + 2 + K) psi
        stage 1 (optimizer states, P_os)  4 psi + K psi / Nd
        stage 2 (+ gradients, P_os+g)     2 psi + (2 + K) psi / Nd
        stage 3 (+ parameters, P_os+g+p)  (2 + 2 + K) psi / Nd

    hsgd (hsgd.accounting.step_memory, the exchanges' memory_formula), s bytes per element, k optimizer copies (0 SGD,
    1 momentum, 2 AdamW), psi' the flat layout padded to Nd chunks (per group in hsgd.dp.sharded):
        stage 0   s psi (params) + s psi (grads) + (k + 2) s psi (state, and two per-element masks)
        stage 1   s psi + s psi + s psi'/Nd (the averaged chunk) + s psi'/Nd (the Allgather's send chunk)
                  + (k + 2) s psi'/Nd (state, and the two masks of the owned chunk)
        stage 2   s psi + s psi'/Nd (parameters whole, and the owned chunk) + s psi'/Nd + two groups' gradient
                  buckets in flight + (k + 2) s psi'/Nd
        stage 3   s psi'/Nd + the largest gathered group + the same gradients and state as stage 2
    The differences: no fp16 copies and no fp32 master (hsgd computes and keeps one precision), so K is k s
    and the 2 + 2 are s + s; two masks ride with the optimizer state; every stage keeps the flat layout padded to
    Nd equal chunks; stage 2 reduce-scatters layer by layer, so two whole buckets (the group being filled and the
    one in flight), not zero, are the full-size gradient at the peak; stage 3 holds one gathered group's
    parameters in flight; and the receive and send chunks of the collectives are counted (comm).
    """
    full = (2 + 2 + K) * psi
    return {0: full, 1: 4 * psi + K * psi / nd, 2: 2 * psi + (2 + K) * psi / nd, 3: full / nd}[stage]
