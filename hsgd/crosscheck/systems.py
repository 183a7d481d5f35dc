"""Other systems' storage of the reference model, as a dump's tensors (FORMAT.md "Other systems' names"): the
names, the transposes, the fused tensors and the axis tensor parallelism splits, so that a dump written in a
system's own names reads back as hsgd's parameters.

    megatron_tensors(cfg, tp)   {Megatron-LM name: (Tensor, split axis or None)}: megatron-core's GPT model with the
                                Transformer Engine layer spec (the norms fused into linear_qkv and linear_fc1)
    hf_tensors(cfg)             {Hugging Face name: (Tensor, None)}: LlamaForCausalLM's state_dict, nothing fused

Megatron-LM's two fused linears, per tp rank i (weights stored (out, in), so the fused axis is 0):
    linear_qkv   its NKV/tp query groups, each [the n_rep = NH/NKV q heads of group g | k_g | v_g] (hs rows each;
                 SelfAttention.get_query_key_value_tensors views the output as (ng, (np/ng + 2) hn) and splits it
                 so). The ranks' shards concatenated: the same per group over all NKV groups, i.e. q, k and v each
                 cut into NKV pieces, a piece of each in turn: interleave "groups", groups = NKV. With NKV = NH this
                 is the "head" interleave [q_0 k_0 v_0 q_1 ...]; Megatron-LM needs tp to divide NKV.
    linear_fc1   with SwiGLU (--swiglu) [gate_i | up_i] (F/tp rows each; the MLP chunks its output in two halves),
                 so the concatenated tensor is [g_0 u_0 g_1 u_1 ...]: interleave "groups", groups = tp.
A tied model (share_embeddings_and_output_weights) has no output_layer.weight. Neither table covers what the
systems' own checkpoints add (Megatron-LM's padded vocabulary beyond tp's, optimizer state, _extra_state).
"""
from .dump import Tensor


def tensor(name, parts, cfg, transposed, interleave="block", groups=1):
    """The Tensor `name` holding the reference parameters `parts` (fused along the stored axis 0 when several),
    with its full stored shape."""
    ref = cfg.param_shapes()
    t = Tensor(name, (), transposed, list(parts), 0, interleave, cfg.head_size, [], (), groups)
    if len(parts) > 1:
        t.lengths = tuple(s[0] for s in t.part_shapes(ref))
    t.shape = tuple(t.stored_shape(ref))
    return t


class Renames:
    """A table of tensors that are each one reference parameter under another name (out: {name: (Tensor, None)}):
    add one, a linear's weight (stored (out, in): transposed) and its bias when the family has biases, a norm's
    weight and its bias with LayerNorm."""

    def __init__(self, cfg):
        self.cfg, self.out = cfg, {}

    def add(self, name, param, transposed=False):
        self.out[name] = (tensor(name, [param], self.cfg, transposed), None)

    def linear(self, name, prefix):
        self.add(name + ".weight", prefix + ".weight", True)
        if self.cfg.bias:
            self.add(name + ".bias", prefix + ".bias")

    def norm(self, name, prefix):
        self.add(name + ".weight", prefix + ".weight")
        if self.cfg.norm == "layernorm":
            self.add(name + ".bias", prefix + ".bias")


def megatron_tensors(cfg, tp):
    """{name: (Tensor, split axis)} of megatron-core's GPT model (Transformer Engine spec) of cfg's family on tp
    ranks: column-parallel linears split along their stored axis 0 (out), row-parallel ones along axis 1 (in), the
    vocabulary along axis 0 (padded to tp ceil(V/tp) rows), the rest replicated (None)."""
    if cfg.n_kv_heads % tp:
        raise ValueError(f"Megatron-LM splits the {cfg.n_kv_heads} query groups over tp = {tp} ranks: tp must divide "
                         "n_kv_heads")
    out = {}

    def add(name, parts, axis, transposed=False, **fused):
        out[name] = (tensor(name, parts, cfg, transposed, **fused), axis)

    def norm(name, prefix):
        add(name + "weight", [prefix + ".weight"], None)
        if cfg.norm == "layernorm":
            add(name + "bias", [prefix + ".bias"], None)

    def linear(name, parts, axis, bias_axis, **fused):
        add(name + ".weight", [p + ".weight" for p in parts], axis, True, **fused)
        if cfg.bias:
            add(name + ".bias", [p + ".bias" for p in parts], bias_axis, **fused)

    add("embedding.word_embeddings.weight", ["wte"], 0)
    if cfg.positions == "learned":
        add("embedding.position_embeddings.weight", ["wpe"], None)
    for i in range(cfg.n_layers):
        h, m = f"h.{i}.", f"decoder.layers.{i}."
        norm(m + "self_attention.linear_qkv.layer_norm_", h + "ln1")
        linear(m + "self_attention.linear_qkv", [h + "attn.q", h + "attn.k", h + "attn.v"], 0, 0,
               interleave="groups", groups=cfg.n_kv_heads)
        linear(m + "self_attention.linear_proj", [h + "attn.proj"], 1, None)
        norm(m + "mlp.linear_fc1.layer_norm_", h + "ln2")
        mlp = [h + "mlp.fc"] if cfg.mlp == "gelu" else [h + "mlp.gate", h + "mlp.up"]
        linear(m + "mlp.linear_fc1", mlp, 0, 0, interleave="groups", groups=tp)
        linear(m + "mlp.linear_fc2", [h + "mlp.proj"], 1, None)
    norm("decoder.final_layernorm.", "ln_f")
    if not cfg.tied:
        add("output_layer.weight", ["lm_head.weight"], 0, True)
    return out


def hf_tensors(cfg):
    """{name: (Tensor, None)} of Hugging Face's LlamaForCausalLM (its state_dict's names; nn.Linear weights (out,
    in), so transposed; attention_bias / mlp_bias give the linears' biases): Llama's block only (RMSNorm, rotary
    positions, SwiGLU); a tied model has no lm_head.weight."""
    if (cfg.norm, cfg.positions, cfg.mlp) != ("rmsnorm", "rope", "swiglu"):
        raise ValueError(f"Hugging Face's LlamaForCausalLM is rmsnorm, rope and swiglu, not {cfg.norm}, "
                         f"{cfg.positions} and {cfg.mlp}")
    t = Renames(cfg)
    t.add("model.embed_tokens.weight", "wte")
    for i in range(cfg.n_layers):
        h, m = f"h.{i}.", f"model.layers.{i}."
        t.add(m + "input_layernorm.weight", h + "ln1.weight")
        for mine, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("proj", "o_proj")):
            t.linear(m + "self_attn." + theirs, h + "attn." + mine)
        t.add(m + "post_attention_layernorm.weight", h + "ln2.weight")
        for mine, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            t.linear(m + "mlp." + theirs, h + "mlp." + mine)
    t.add("model.norm.weight", "ln_f.weight")
    if not cfg.tied:
        t.add("lm_head.weight", "lm_head.weight", True)
    return t.out


# in the state dict of older torchtitan versions (a persistent buffer) but no parameter: the rotary table
TORCHTITAN_BUFFERS = ("freqs_cis",)


def torchtitan_tensors(cfg):
    """{name: (Tensor, None)} of torchtitan's llama3 Transformer (its model's state_dict names, as its Distributed
    Checkpoints hold them), nothing fused, nn.Linear weights (out, in) so transposed:

        tok_embeddings.weight (V, C)          wte               layers.{i}.attention_norm.weight    h.{i}.ln1.weight
        layers.{i}.attention.wq/wk/wv.weight  h.{i}.attn.q/k/v  layers.{i}.attention.wo.weight      h.{i}.attn.proj
        layers.{i}.ffn_norm.weight            h.{i}.ln2.weight  layers.{i}.feed_forward.w1.weight   h.{i}.mlp.gate
        layers.{i}.feed_forward.w3.weight     h.{i}.mlp.up      layers.{i}.feed_forward.w2.weight   h.{i}.mlp.proj
        norm.weight                           ln_f.weight       output.weight (V, C)                lm_head.weight

    extended the same way to the GPT-2 family: pos_embeddings.weight for wpe, the norms' and the linears' .bias,
    feed_forward.w1 for fc (GELU; no w3). A tied model has no output.weight; experts are not named here.

    Rotary positions differ: torchtitan's llama3 turns the interleaved pairs (2i, 2i+1) of a head (its
    apply_rotary_emb views q and k as complex numbers of adjacent entries), hsgd's reference Hugging Face's halves
    (i, i + hs/2). The same model in torchtitan therefore has wq's and wk's rows in another order within each head:
    torchtitan's row h hs + 2i + j is hsgd's h hs + j hs/2 + i (torchtitan's state-dict adapter to Hugging Face
    permutes them so). With rotary positions the table gives wq and wk (weights and biases) "rotary": "interleaved",
    so that a real torchtitan checkpoint reads as the reference's model (dump.Tensor.pair_order);
    benchmarks/crosscheck_fsdp2.py turns its pairs so too."""
    t = Renames(cfg)
    t.add("tok_embeddings.weight", "wte")
    if cfg.positions == "learned":
        t.add("pos_embeddings.weight", "wpe")
    for i in range(cfg.n_layers):
        h, m = f"h.{i}.", f"layers.{i}."
        t.norm(m + "attention_norm", h + "ln1")
        for mine, theirs in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("proj", "wo")):
            t.linear(m + "attention." + theirs, h + "attn." + mine)
        t.norm(m + "ffn_norm", h + "ln2")
        mlp = (("fc", "w1"),) if cfg.mlp == "gelu" else (("gate", "w1"), ("up", "w3"))
        for mine, theirs in mlp + (("proj", "w2"),):
            t.linear(m + "feed_forward." + theirs, h + "mlp." + mine)
    t.norm("norm", "ln_f")
    if not cfg.tied:
        t.add("output.weight", "lm_head.weight", True)
    if cfg.positions == "rope":
        for name, (tt, _) in t.out.items():
            if ".attention.wq." in name or ".attention.wk." in name:
                tt.rotary = cfg.head_size                     # torchtitan's rotary pairs (2i, 2i + 1)
    return t.out


def torchtitan_03_tensors(cfg):
    """{name: (Tensor, None)} of torchtitan 0.3's llama3 Transformer, which renamed two of torchtitan_tensors' and
    fused q, k and v, as its model's state_dict (and so its Distributed Checkpoints) names them:

        layers.{i}.attention.qkv_linear.wqkv.weight   h.{i}.attn.q, .k, .v fused per kv group: [the NH/NKV q heads
                                                      of group g | k_g | v_g] (interleave "groups", groups = NKV),
                                                      stored (out, in), q and k in rotary-pair order
        lm_head.weight (V, C)                         lm_head.weight (output.weight before)

    the rest as torchtitan_tensors. Its rotary embedding turns the adjacent pairs (2i, 2i + 1) of a head, so q's and
    k's output features are given "rotary": "interleaved" (dump.Tensor.pair_order maps them to the reference's
    halves). Its debug model uses Llama 3.1's rescaled rotary frequencies by default (rope scaling "llama"), which
    hsgd's reference does not have: a checkpoint of it differs in each block's attention gradients (measured at T =
    16: q's and k's by ~3e-3, v's, wo's and attention_norm's by 1e-4 to 2e-4); with scaling "none" it is the
    reference's model (benchmarks/crosscheck_torchtitan.py)."""
    if cfg.positions != "rope":
        raise ValueError("torchtitan 0.3's llama3 has rotary positions (--names torchtitan for the older names and "
                         "the GPT-2 family)")
    out = {n: (t, a) for n, (t, a) in torchtitan_tensors(cfg).items()
           if ".attention.w" not in n or ".attention.wo." in n}
    for i in range(cfg.n_layers):
        h = f"h.{i}.attn."
        name = f"layers.{i}.attention.qkv_linear.wqkv.weight"
        t = tensor(name, [h + "q.weight", h + "k.weight", h + "v.weight"], cfg, True, "groups", cfg.n_kv_heads)
        t.rotary = cfg.head_size
        out[name] = (t, None)
    if "output.weight" in out:
        out["lm_head.weight"] = (out.pop("output.weight")[0], None)
        out["lm_head.weight"][0].name = "lm_head.weight"
    return out
