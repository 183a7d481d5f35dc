"""An independent reference for the mixture-of-experts layer: Hugging Face transformers' MixtralSparseMoeBlock and
its load_balancing_loss_func, in float64, on hsgd's parameters mapped by name, write the layer's output, the balance
loss and every gradient of one small input to tests/data/hf_mixtral/top2.npz, which tests/test_moe_layer.py compares
with hsgd.model.moe (transformers is not needed to run the tests).

    python benchmarks/hf_mixtral_reference.py            write tests/data/hf_mixtral/top2.npz
    python benchmarks/hf_mixtral_reference.py --check    regenerate into a temporary folder; compare with the
                                                         committed file and with hsgd; exit 1 if anything differs by
                                                         more than 1e-12 relative (without transformers: hsgd with
                                                         the committed file only)

Needs torch and transformers (pip install torch transformers).

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

Legend: B batch, T sequence, C d_model, E experts, k top-k, F expert width, N = B*T rows.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                                           # the repository: hsgd

from hsgd.model.moe import MoESettings, moe_backward, moe_forward, moe_param_shapes  # noqa: E402
from hsgd.readers import Npz  # noqa: E402

SIZES = dict(B=2, T=6, C=8, F=12, E=4, k=2)
COEF = 0.1
SEED = 21
TOLERANCE = 1e-12
OUT = os.path.join(ROOT, "tests", "data", "hf_mixtral")


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


def check(committed):
    """Regenerate into a temporary folder; compare with the committed file and with hsgd (without transformers:
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="the folder of the reference file (default tests/data/hf_mixtral)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary folder, compare with --out's "
                    "file and with hsgd; exit 1 on a difference above 1e-12 relative")
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check(args.out) else 1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "top2.npz")
    np.savez(path, **generate())
    print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path)} bytes)")
    compare_hsgd(*read(path))


if __name__ == "__main__":
    main()
