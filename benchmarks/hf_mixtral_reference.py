"""Independent references for the mixture of experts, from Hugging Face transformers' Mixtral in float64 on hsgd's
parameters mapped by name, written to small files that the tests compare with hsgd (transformers is not needed to
run the tests):
  the layer  MixtralSparseMoeBlock and its load_balancing_loss_func: the output, the balance loss and every gradient of
             one small input, tests/data/hf_mixtral/top2.npz, read by tests/test_moe_layer.py (hsgd.model.moe);
  the model  MixtralForCausalLM with its load-balancing loss: the loss and every gradient of one batch,
             tests/data/hf_mixtral/model_{gqa,mha_top1}.npz, read by tests/test_hf_mixtral.py (hsgd.model.serial).

    python benchmarks/hf_mixtral_reference.py            write tests/data/hf_mixtral/{top2,model_gqa,model_mha_top1}.npz
    python benchmarks/hf_mixtral_reference.py --check    regenerate into a temporary folder; compare with the
                                                         committed files and with hsgd (make bench); exit 1 if
                                                         anything differs by more than 1e-12 relative (without
                                                         transformers: hsgd with the committed files only); print
                                                         how far the library's own float32 steps are

Needs torch and transformers (pip install torch transformers).

THE LAYER

The layer: C=8, F=12 (intermediate_size), E=4 experts (num_local_experts), top-2 (num_experts_per_tok), SwiGLU
experts (hidden_act silu), no biases, no router jitter (router_jitter_noise 0), the experts' "eager" implementation
(a loop over the experts hit; the others are faster versions of the same sums); input x (B, T, C) = (2, 6, 8).
Mixtral has no capacity: nothing is dropped. The gates are Mixtral's: the softmax over E, its top-2, renormalized
to sum 1 (hsgd: gates "renormalized").

The scalar differentiated: L = sum(y * dy) + coef * lbl, y the block's output, dy a fixed random (B, T, C) array
(the upstream gradient of y), lbl = load_balancing_loss_func((router_logits,), E, 2), coef = 0.1 (Mixtral's
router_aux_loss_coef is 0.001; larger here so that the balance loss's gradient weighs in the router's). The library's
lbl is E sum_i (slots routed to i / N) P_i, whose counts sum to k, not 1: hsgd's balance loss with alpha = coef * k.

Float64 throughout. The block made float64 with .double() still rounds twice to float32: its router takes the
softmax of router_logits.float(), and load_balancing_loss_func sums the probabilities into float32 accumulators
(routing_weights.float()). So this program replaces the router's forward with the same lines without .float(), and
computes lbl with the same formula in float64 (lbl_float64: the top-k counts and the probability sums of the one
layer); --check prints how far the library's own lbl is from it (float32 rounding, about 1e-8). Everything else is
the library's code: the router's linear and top-k, the renormalization, the fused gate|up weight and its chunk, SiLU,
the experts' loop and index_add_, and torch's autograd for every gradient.

The names (hsgd weights are (in, out), the transpose of a torch Linear's (out, in)):
    moe.router.weight               gate.weight (E, C), transposed
    moe.experts.{e}.gate.weight     experts.gate_up_proj[e, :F, :], transposed  (the first half of the fused weight)
    moe.experts.{e}.up.weight       experts.gate_up_proj[e, F:, :], transposed
    moe.experts.{e}.proj.weight     experts.down_proj[e] (C, F), transposed

The file (numpy.savez; tests read it with hsgd.readers.Npz): meta (a JSON text as uint8 bytes: the sizes, the seed,
coef, the torch and transformers versions), x and dy (B, T, C) float32, y (B, T, C) float64, lbl () and loss ()
float64, param/<hsgd name> float32, grad/<hsgd name> float64 and grad/x (B, T, C) float64.

THE MODEL

The models: tiny (V=32, T=8, C=16, NH=4, hs=4, L=2, expert width F=12, batch B=2), Llama's block (RMSNorm with eps
1e-5, rotary positions with theta 10000, no biases, untied) with every block's MLP replaced by E=4 SwiGLU experts:
    gqa       2 key/value heads, top-2 (Mixtral's own choice of k)
    mha_top1  4 key/value heads, top-1 (the gate renormalized over one expert is 1: the router learns through the
              balance loss alone)
hsgd's ModelConfig: arch "llama", moe_experts 4, moe_top_k k, moe_every 1, moe_gates "renormalized", no capacity,
moe_balance_layers "pooled", moe_balance_domain "global", moe_balance = coef * k, moe_z_loss 0. Hugging Face's
MixtralConfig: num_local_experts 4, num_experts_per_tok k, router_aux_loss_coef coef = 0.1 (Mixtral's is 0.001:
larger here so that the balance loss weighs in the gradients), output_router_logits, router_jitter_noise 0,
sliding_window None, tie_word_embeddings False, rms_norm_eps 1e-5 and rope_theta as hsgd's.

The loss: what MixtralForCausalLM returns given labels, ce + coef * lbl, with ce the mean cross-entropy of
logits[b, t] against targets[b, t] over all B*T positions (hsgd's; the model is given shift_labels=targets, the
library's way to pass labels already shifted: with labels alone it would shift them by one position and average
over B*(T-1), another quantity) and lbl = load_balancing_loss_func(router logits of all L blocks, E, k): the
library sums the top-k counts and the probabilities over the rows of all L blocks before it divides by L*N, so f and
P are counted over all of them at once (hsgd's "pooled" layers; the same as concatenating the blocks' rows) and over
the whole batch (hsgd's "global" domain).

The parameters, drawn here (not hsgd's initialization, which is free to change): every norm's weight
1 + N(0, 0.2^2), W_q and W_k N(0, 0.2^2) (attention logits of order 1, so the rotary positions matter), the router
N(0, 1/C) (router logits of order 1: the choice is far from a tie), every other weight N(0, 0.1^2), all rounded to
float32 (stored in half the bytes; both models compute in float64 from these same numbers). The batch: token ids
drawn uniformly. The seed is one at which every expert of every block receives a row (with top-1 over 16 rows, one
is often left idle, its gradient zero). Each file records the smallest gap, over all rows of all blocks, between a
row's k-th and (k+1)-th router probability: float64 rounding (1e-16) cannot turn a choice there.

Float64 throughout. MixtralForCausalLM made float64 with .double() still computes six things in float32: its
RMSNorm, its rotary tables and its eager softmax (as LlamaForCausalLM, benchmarks/hf_llama_reference.py), the
router's softmax (as the layer above), and the loss: ForCausalLMLoss casts the logits to float32, and
load_balancing_loss_func sums into float32 accumulators. So this program replaces on the model it built the forward
of each MixtralRMSNorm and of the rotary embedding by the same formulas in the input's dtype (those of
hf_llama_reference.float64_throughout), the router's by router_float64, runs the attention with "sdpa", sets the
model's loss_function to ForCausalLMLoss's lines without the cast (cross_entropy_float64), and, while the model
runs, puts in place of modeling_mixtral.load_balancing_loss_func the same formula in float64 on the concatenated
logits (balance_float64, lbl_float64's sums over all L*N rows). --check prints how far the library's own
load_balancing_loss_func is from it on the same logits, and how far the model as shipped is from the file. The rest
is the library's: the attention, the experts, the sum ce + router_aux_loss_coef * lbl in MixtralForCausalLM's
forward, and torch's autograd for every gradient.

The names: those of hf_llama_reference.hf_name for the embedding, the norms, the attention and the head; a block's
experts as the layer's above under model.layers.i.mlp (h.i.moe.router.weight is model.layers.i.mlp.gate.weight
transposed, h.i.moe.experts.e.gate.weight model.layers.i.mlp.experts.gate_up_proj[e, :F] transposed, ...).

Each file (numpy.savez; tests read it with hsgd.readers.Npz): meta (a JSON text as uint8 bytes: the config as
ModelConfig's fields, coef, the seed, the torch and transformers versions, the smallest routing gap, the library's
own lbl, the notes above in short), idx and targets (B, T) int64, loss, ce and lbl () float64, param/<hsgd name>
float32 and grad/<hsgd name> float64, hsgd's names and layout.

Legend: B batch, T sequence, C d_model, E experts, k top-k, F expert width, N = B*T rows, NH query heads, NKV
key/value heads, hs head size, V vocab, L layers.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                                           # the repository: hsgd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/: hf_llama_reference

import hf_llama_reference as llama  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model.llama_layers import RMS_EPS  # noqa: E402
from hsgd.model.moe import MoESettings, moe_backward, moe_forward, moe_param_shapes  # noqa: E402
from hsgd.readers import Npz  # noqa: E402

SIZES = dict(B=2, T=6, C=8, F=12, E=4, k=2)
COEF = 0.1
SEED = 21
TOLERANCE = 1e-12
OUT = os.path.join(ROOT, "tests", "data", "hf_mixtral")
MODEL_SIZES = dict(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=12)
MODEL_MOE = dict(moe_experts=4, moe_every=1, moe_gates="renormalized", moe_balance_layers="pooled",
                 moe_balance_domain="global", moe_z_loss=0.0)
MODELS = {"gqa": dict(n_kv_heads=2, moe_top_k=2), "mha_top1": dict(n_kv_heads=4, moe_top_k=1)}
MODEL_SEED = 23                    # one at which every expert of every block gets a row, top-1 too


def settings(coef=COEF, k=SIZES["k"]):
    """hsgd's settings of the same layer: SwiGLU experts, renormalized gates, no capacity, alpha = coef * k."""
    return MoESettings(experts=SIZES["E"], top_k=k, mlp="swiglu", gates="renormalized", capacity_factor=None,
                       balance_coef=coef * k)


def inputs(seed=SEED):
    """(params {hsgd name: float32}, x, dy (B, T, C) float32): the router N(0, 1/C) (logits of order 1), the experts
    N(0, 0.3^2), x and dy N(0, 1)."""
    rng = np.random.default_rng([seed, 1])
    B, T, C, F, E = (SIZES[n] for n in "BTCFE")
    shapes = moe_param_shapes("moe", C, F, E, "swiglu")
    params = {n: rng.normal(0.0, C ** -0.5 if "router" in n else 0.3, s).astype(np.float32) for n, s in shapes.items()}
    x, dy = rng.normal(0.0, 1.0, (2, B, T, C)).astype(np.float32)
    return params, x, dy


# --------------------------------------------------------------------------------------------------------------
# The Hugging Face side

def router_float64(self, hidden_states):
    """MixtralTopKRouter.forward without its .float(): the softmax, top-k and renormalization in the input's dtype."""
    import torch
    import torch.nn.functional as F
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)                        # (N, E)
    router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)    # (N, k)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def lbl_float64(router_logits, num_experts, top_k):
    """load_balancing_loss_func's formula for one layer, in float64: E sum_i (count_i / N) (sum_n p_ni / N), count_i
    the top-k slots of expert i."""
    import torch
    routing_weights = torch.nn.functional.softmax(router_logits, dim=-1)        # (N, E)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)           # (N, k)
    counts = torch.bincount(selected_experts.reshape(-1), minlength=num_experts).to(routing_weights.dtype)
    rows = routing_weights.shape[0]
    return torch.sum(counts / rows * (routing_weights.sum(dim=0) / rows)) * num_experts


def hf_block():
    """MixtralSparseMoeBlock of SIZES in float64 with router_float64."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=SIZES["C"], intermediate_size=SIZES["F"], num_local_experts=SIZES["E"],
                        num_experts_per_tok=SIZES["k"], router_jitter_noise=0.0, hidden_act="silu",
                        router_aux_loss_coef=COEF, experts_implementation="eager")
    block = MixtralSparseMoeBlock(cfg).double()
    block.gate.forward = router_float64.__get__(block.gate)
    return block


def hf_run(params, x, dy):
    """(y, lbl, lbl as shipped, loss, {hsgd name or "x": float64 gradient in hsgd's layout})."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    F, E, k = SIZES["F"], SIZES["E"], SIZES["k"]
    block = hf_block()
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))
    with torch.no_grad():
        block.gate.weight.copy_(t(params["moe.router.weight"]).T)
        for e in range(E):
            ex = f"moe.experts.{e}."
            block.experts.gate_up_proj[e, :F].copy_(t(params[ex + "gate.weight"]).T)
            block.experts.gate_up_proj[e, F:].copy_(t(params[ex + "up.weight"]).T)
            block.experts.down_proj[e].copy_(t(params[ex + "proj.weight"]).T)
    seen = []
    block.gate.register_forward_hook(lambda module, args, out: seen.append(out[0]))   # the router's logits
    xt = t(x).requires_grad_()
    y = block(xt)                                                               # (B, T, C)
    lbl = lbl_float64(seen[0], E, k)
    loss = (y * t(dy)).sum() + COEF * lbl
    loss.backward()
    shipped = float(load_balancing_loss_func((seen[0].detach(),), E, k))
    g_up = block.experts.gate_up_proj.grad.numpy()                              # (E, 2F, C)
    g_down = block.experts.down_proj.grad.numpy()                               # (E, C, F)
    grads = {"x": xt.grad.numpy().copy(), "moe.router.weight": np.ascontiguousarray(block.gate.weight.grad.numpy().T)}
    for e in range(E):
        ex = f"moe.experts.{e}."
        grads[ex + "gate.weight"] = np.ascontiguousarray(g_up[e, :F].T)
        grads[ex + "up.weight"] = np.ascontiguousarray(g_up[e, F:].T)
        grads[ex + "proj.weight"] = np.ascontiguousarray(g_down[e].T)
    return y.detach().numpy(), lbl.item(), shipped, loss.item(), grads


def generate():
    """The arrays of top2.npz."""
    import torch
    import transformers
    params, x, dy = inputs()
    y, lbl, shipped, loss, grads = hf_run(params, x, dy)
    meta = dict(sizes=SIZES, seed=SEED, coef=COEF, torch=torch.__version__, transformers=transformers.__version__,
                model="MixtralSparseMoeBlock, float64, eager experts, router softmax in float64; lbl: "
                "load_balancing_loss_func's formula in float64 (benchmarks/hf_mixtral_reference.py)",
                loss="sum(y * dy) + coef * lbl; hsgd: balance_coef = coef * k", lbl_as_shipped=shipped)
    arrays = {"meta": np.frombuffer(json.dumps(meta, indent=1).encode(), np.uint8), "x": x, "dy": dy, "y": y,
              "lbl": np.float64(lbl), "loss": np.float64(loss)}
    arrays.update({f"param/{n}": p for n, p in params.items()})
    arrays.update({f"grad/{n}": g for n, g in grads.items()})
    return arrays


# --------------------------------------------------------------------------------------------------------------
# Reading and comparing (tests/test_moe_layer.py does the same without torch)

def read(path):
    """(meta, params float64, x, dy, y, lbl, grads) of a reference file."""
    with Npz(path, "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {name: z[name] for name in z.files}
    params = {n[6:]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[5:]: a for n, a in arrays.items() if n.startswith("grad/")}
    return meta, params, arrays["x"].astype(np.float64), arrays["dy"].astype(np.float64), arrays["y"], \
        float(arrays["lbl"]), grads


def hsgd_run(params, x, dy, s):
    """(y, balance, {name or "x": gradient}) of hsgd.model.moe with settings s on the same scalar."""
    y, aux, cache = moe_forward(x, params, s)
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    grads["x"] = moe_backward(dy, {"balance": 1.0, "z": 0.0}, cache, grads)
    return y, float(aux["balance"]), grads


def relative_errors(y, balance, grads, ref_y, ref_balance, ref_grads):
    """{"y": max|y - ref| / max|ref|, "balance": relative, name: max|g - ref| / max|ref| for each gradient}."""
    errors = {"y": float(np.abs(y - ref_y).max() / np.abs(ref_y).max()),
              "balance": abs(balance - ref_balance) / abs(ref_balance)}
    for name, ref in ref_grads.items():
        errors[name] = float(np.abs(grads[name] - ref).max() / np.abs(ref).max())
    return errors


def report(what, errors):
    """Print the largest error with its name; True if within TOLERANCE."""
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= TOLERANCE
    print(f"{what}: y {errors['y']:.1e}, balance {errors['balance']:.1e}, largest {errors[worst]:.1e} ({worst})"
          f"{'' if ok else f' > {TOLERANCE:.0e}: MISMATCH'}")
    return ok


def compare_hsgd(meta, params, x, dy, y, lbl, grads):
    """hsgd's layer against one reference (its balance loss against coef * lbl); True if within TOLERANCE."""
    return report("hsgd.model.moe vs Hugging Face", relative_errors(*hsgd_run(params, x, dy, settings(meta["coef"])),
                                                                     y, meta["coef"] * lbl, grads))


def check_layer(committed):
    """Regenerate top2.npz into a temporary folder; compare with the committed file and with hsgd (without transformers:
    hsgd with the committed file only). True if all agree."""
    path = os.path.join(committed, "top2.npz")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is not installed (pip install torch transformers): hsgd compared with the committed file "
              "only, nothing regenerated")
        return compare_hsgd(*read(path))
    with tempfile.TemporaryDirectory() as folder:
        np.savez(os.path.join(folder, "top2.npz"), **generate())
        new = read(os.path.join(folder, "top2.npz"))
    meta, params, x, dy, y, lbl, grads = new
    print(f"load_balancing_loss_func as shipped (float32 sums) vs in float64: "
          f"{abs(meta['lbl_as_shipped'] - lbl) / lbl:.1e} relative")
    if not os.path.exists(path):
        print(f"{path} is missing; run python benchmarks/hf_mixtral_reference.py to write it")
        return False
    meta0, params0, x0, dy0, y0, lbl0, grads0 = read(path)
    if not ((x0 == x).all() and (dy0 == dy).all() and set(params0) == set(params) and set(grads0) == set(grads)
            and all((params0[n] == p).all() for n, p in params.items())):
        print("the committed file has other inputs or names than this program makes; rewrite it with "
              "python benchmarks/hf_mixtral_reference.py")
        return False
    ok = report("this transformers vs the committed file", relative_errors(y, lbl, grads, y0, lbl0, grads0))
    return compare_hsgd(*new) and ok


# --------------------------------------------------------------------------------------------------------------
# The model: MixtralForCausalLM against hsgd.model.serial

def model_config(name):
    """hsgd's ModelConfig of the model `name`: alpha = COEF * k (Hugging Face counts f summing to k)."""
    k = MODELS[name]["moe_top_k"]
    return ModelConfig(arch="llama", **MODEL_SIZES, **MODEL_MOE, **MODELS[name], moe_balance=COEF * k)


def model_parameters(cfg, seed=MODEL_SEED):
    """{hsgd name: float32 array} (the module docstring's draws), each from its own stream (seed, its index in the
    sorted names)."""
    params = {}
    for i, (name, shape) in enumerate(sorted(cfg.param_shapes().items())):
        rng = np.random.default_rng([seed, 1, i])
        if ".ln" in name or name.startswith("ln_f"):
            p = 1.0 + rng.normal(0.0, 0.2, shape)
        elif name.endswith(("attn.q.weight", "attn.k.weight")):
            p = rng.normal(0.0, 0.2, shape)
        elif name.endswith("router.weight"):
            p = rng.normal(0.0, cfg.d_model ** -0.5, shape)
        else:
            p = rng.normal(0.0, 0.1, shape)
        params[name] = p.astype(np.float32)
    return params


def model_batch(cfg, seed=MODEL_SEED):
    """(idx, targets), (B, T) int64 each, uniform over the vocabulary."""
    idx, targets = np.random.default_rng([seed, 2]).integers(0, cfg.vocab_size, size=(2, llama.B, cfg.seq_len))
    return idx, targets


def cross_entropy_float64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                          **kwargs):
    """transformers' ForCausalLMLoss without its logits.float(): the mean cross-entropy of the logits against
    shift_labels (given: the targets as they are), else against labels shifted by one position."""
    import torch.nn.functional as F
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    assert num_items_in_batch is None, "the mean over the batch's positions, as hsgd's"
    return F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index)


def balance_float64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """load_balancing_loss_func in float64: lbl_float64 on the L blocks' router logits concatenated (L*N rows), the
    library's sums over all blocks' rows at once."""
    import torch
    assert attention_mask is None, "no padding: every row counts"
    return lbl_float64(torch.cat(gate_logits), num_experts, top_k)


def mixtral_float64_throughout(model, cfg):
    """hf_llama_reference.float64_throughout for Mixtral's classes (its RMSNorm and rotary embedding in the input's
    dtype), each router's forward replaced by router_float64, and its loss_function by cross_entropy_float64."""
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm, MixtralTopKRouter
    llama.float64_throughout(model, cfg, MixtralRMSNorm)
    for module in model.modules():
        if isinstance(module, MixtralTopKRouter):
            module.forward = router_float64.__get__(module)
    model.loss_function = cross_entropy_float64
    return model


def hf_model(cfg, as_shipped=False):
    """MixtralForCausalLM of cfg's shape in float64 (float64 throughout unless as_shipped: then eager attention and
    the library's float32 steps), router_aux_loss_coef = alpha / k."""
    from transformers import MixtralConfig, MixtralForCausalLM
    hf_cfg = MixtralConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                           num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                           num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.seq_len,
                           rms_norm_eps=RMS_EPS, rope_theta=cfg.rope_theta, hidden_act="silu",
                           num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                           router_aux_loss_coef=cfg.moe_balance / cfg.moe_top_k, output_router_logits=True,
                           router_jitter_noise=0.0, sliding_window=None, tie_word_embeddings=False, use_cache=False,
                           attention_dropout=0.0, experts_implementation="eager",
                           attn_implementation="eager" if as_shipped else "sdpa")
    model = MixtralForCausalLM(hf_cfg).double()
    return model if as_shipped else mixtral_float64_throughout(model, cfg)


def model_hf_names(cfg):
    """{hsgd name: (Hugging Face's parameter, index into it or None, transposed?)}."""
    F = cfg.d_ff
    names = {}
    for name in cfg.param_shapes():
        if ".moe." not in name:
            hf, transposed = llama.hf_name(name)
            names[name] = (hf, None, transposed)
            continue
        _, i, _, rest = name.split(".", 3)                                      # h.{i}.moe.rest
        mlp = f"model.layers.{i}.mlp."
        if rest == "router.weight":
            names[name] = (mlp + "gate.weight", None, True)
            continue
        _, e, part, _ = rest.split(".")                                         # experts.{e}.part.weight
        e = int(e)
        names[name] = {"gate": (mlp + "experts.gate_up_proj", (e, slice(0, F)), True),
                       "up": (mlp + "experts.gate_up_proj", (e, slice(F, 2 * F)), True),
                       "proj": (mlp + "experts.down_proj", e, True)}[part]
    return names


def model_hf_run(cfg, params, idx, targets, as_shipped=False):
    """(loss, ce, lbl, the library's own lbl on the same router logits, the smallest routing gap, {hsgd name: float64
    gradient in hsgd's layout}) of MixtralForCausalLM on hsgd's parameters."""
    import torch
    from transformers.models.mixtral import modeling_mixtral
    shipped_balance = modeling_mixtral.load_balancing_loss_func
    model = hf_model(cfg, as_shipped)
    theirs = dict(model.named_parameters())
    names = model_hf_names(cfg)
    if {hf for hf, _, _ in names.values()} != set(theirs):
        raise SystemExit(f"the names do not map onto Hugging Face's {sorted(theirs)}")
    with torch.no_grad():
        for name, (hf, at, transposed) in names.items():
            p = torch.from_numpy(params[name].astype(np.float64))
            (theirs[hf] if at is None else theirs[hf][at]).copy_(p.T if transposed else p)
    targets_t = torch.from_numpy(targets)
    if not as_shipped:
        modeling_mixtral.load_balancing_loss_func = balance_float64
    try:
        out = model(input_ids=torch.from_numpy(idx), labels=targets_t, shift_labels=targets_t)
    finally:
        modeling_mixtral.load_balancing_loss_func = shipped_balance
    out.loss.backward()
    logits = torch.cat(out.router_logits).detach()                              # (L*N, E)
    probs = -torch.sort(-torch.softmax(logits, dim=-1), dim=-1).values          # largest first
    k = cfg.moe_top_k
    gap = float((probs[:, k - 1] - probs[:, k]).min())
    lbl = out.aux_loss.item()
    ce = out.loss.item() - model.router_aux_loss_coef * lbl
    own = float(shipped_balance(tuple(r.detach() for r in out.router_logits), cfg.moe_experts, k))
    grads = {}
    for name, (hf, at, transposed) in names.items():
        g = theirs[hf].grad if at is None else theirs[hf].grad[at]
        grads[name] = np.ascontiguousarray(g.T.numpy() if transposed else g.numpy())
    return out.loss.item(), ce, lbl, own, gap, grads


def model_generate(name):
    """The arrays of the file model_`name`.npz."""
    import torch
    import transformers
    cfg = model_config(name)
    params, (idx, targets) = model_parameters(cfg), model_batch(cfg)
    loss, ce, lbl, own, gap, grads = model_hf_run(cfg, params, idx, targets)
    idle = [n for n, g in grads.items() if not g.any()]
    if idle:
        raise SystemExit(f"model_{name}: zero gradients {idle} (an expert no row reached); choose another MODEL_SEED")
    config = dict(arch=cfg.arch, **MODEL_SIZES, **MODEL_MOE, **MODELS[name], moe_balance=cfg.moe_balance)
    meta = dict(config=config, coef=COEF, batch=llama.B, seed=MODEL_SEED, torch=torch.__version__,
                transformers=transformers.__version__, routing_gap=gap, lbl_as_shipped=own,
                model="MixtralForCausalLM, float64, sdpa attention, eager experts, RMSNorm, rotary tables, router "
                "softmax, cross-entropy and load_balancing_loss_func in float64 (benchmarks/hf_mixtral_reference.py)",
                loss="ce + coef * lbl: ce the mean cross-entropy of logits[b, t] vs targets[b, t] over all B*T "
                "positions (shift_labels=targets), lbl load_balancing_loss_func over all blocks' router logits; "
                "hsgd: moe_balance = coef * k, pooled layers, global domain")
    arrays = {"meta": np.frombuffer(json.dumps(meta, indent=1).encode(), np.uint8), "idx": idx, "targets": targets,
              "loss": np.float64(loss), "ce": np.float64(ce), "lbl": np.float64(lbl)}
    arrays.update({f"param/{n}": p for n, p in params.items()})
    arrays.update({f"grad/{n}": g for n, g in grads.items()})
    return arrays


def model_write_all(folder):
    os.makedirs(folder, exist_ok=True)
    for name in MODELS:
        np.savez(os.path.join(folder, f"model_{name}.npz"), **model_generate(name))


def model_extras(path):
    """(meta, ce, lbl) of a model file (hf_llama_reference.read gives the rest)."""
    with Npz(path, "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        return json.loads(bytes(z["meta"]).decode()), float(z["ce"]), float(z["lbl"])


def check_model(committed):
    """Regenerate the model files into a temporary folder; compare with the committed ones (parameters and batch
    equal, loss and gradients within TOLERANCE) and with hsgd's serial model; print how far the library's own
    load_balancing_loss_func and the model as shipped are. Without transformers, compare hsgd with the committed
    files only. True if all agree."""
    paths = {name: os.path.join(committed, f"model_{name}.npz") for name in MODELS}
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is not installed (pip install torch transformers): hsgd compared with the committed model "
              "files only, nothing regenerated")
        return all([llama.compare_hsgd(f"model_{name}", *llama.read(path)) for name, path in paths.items()])
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        model_write_all(folder)
        for name, path in paths.items():
            new = os.path.join(folder, f"model_{name}.npz")
            cfg, params, idx, targets, loss, grads = llama.read(new)
            meta, _, lbl = model_extras(new)
            print(f"model_{name}: smallest gap between a row's k-th and (k+1)-th router probability "
                  f"{meta['routing_gap']:.1e}; load_balancing_loss_func as shipped (float32 sums) vs in float64: "
                  f"{abs(meta['lbl_as_shipped'] - lbl) / lbl:.1e} relative")
            shipped = model_hf_run(cfg, params, idx, targets, as_shipped=True)
            llama.report(f"model_{name}: MixtralForCausalLM as shipped (float32 inside) vs float64",
                         llama.relative_errors(shipped[0], shipped[5], loss, grads), verdict=False)
            if not os.path.exists(path):
                print(f"model_{name}: {path} is missing; run python benchmarks/hf_mixtral_reference.py to write it")
                ok = False
                continue
            cfg0, params0, idx0, targets0, loss0, grads0 = llama.read(path)
            same = cfg0 == cfg and (idx0 == idx).all() and (targets0 == targets).all() and \
                all((params0[n] == p).all() for n, p in params.items()) and set(grads0) == set(grads)
            if not same:
                print(f"model_{name}: the committed file has other parameters, batch or names than this program "
                      "makes; rewrite it with python benchmarks/hf_mixtral_reference.py")
                ok = False
                continue
            ok &= llama.report(f"model_{name}: this transformers vs the committed file",
                               llama.relative_errors(loss, grads, loss0, grads0))
            ok &= llama.compare_hsgd(f"model_{name}", cfg, params, idx, targets, loss, grads)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="the folder of the reference files (default tests/data/hf_mixtral)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary folder, compare with --out's "
                    "files and with hsgd; exit 1 on a difference above 1e-12 relative")
    args = ap.parse_args()
    if args.check:
        layer_ok = check_layer(args.out)
        sys.exit(0 if check_model(args.out) and layer_ok else 1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "top2.npz")
    np.savez(path, **generate())
    model_write_all(args.out)
    for name in ["top2"] + [f"model_{name}" for name in MODELS]:
        written = os.path.join(args.out, f"{name}.npz")
        print(f"wrote {os.path.relpath(written)} ({os.path.getsize(written)} bytes)")
    compare_hsgd(*read(path))
    for name in MODELS:
        llama.compare_hsgd(f"model_{name}", *llama.read(os.path.join(args.out, f"model_{name}.npz")))


if __name__ == "__main__":
    main()
