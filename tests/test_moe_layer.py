"""The mixture-of-experts layer (hsgd.model.moe) alone: its hand-written backward against finite differences through
every parameter and the input, the balance loss's value (alpha under uniform routing; a domain of groups computed by
hand), the drops in token order, the auxiliary-loss-free bias, and Hugging Face's MixtralSparseMoeBlock with its
load-balancing loss, whose output and gradients on one input are committed in tests/data/hf_mixtral (written by
benchmarks/hf_mixtral_reference.py, whose docstring says how; no torch needed here).

Finite differences: float64, N=12 rows, C=5, F=6, E=4, k=2, a central difference of step 1e-5 on every coordinate,
the scalar L = sum(y * R) + balance + z (alpha 0.3, beta 0.05, two groups of 6 rows as the domain). A probe moves the
router's scores by about 1e-5 at most, so each case first checks that every row's k-th selection score is above
its (k+1)-th by more than 100 times the step: no probe crosses a routing boundary (the drops follow from the choice
alone, so they cannot change either).
"""
import json
import math
import os

import numpy as np
import pytest

from hsgd.model.gradcheck import fd_error
from hsgd.model.moe import (MoESettings, dispatch_indices, moe_backward, moe_forward, moe_param_shapes,
                            router_forward, softmax, update_selection_bias)
from hsgd.readers import Npz

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_mixtral", "top2.npz")
TOLERANCE = 1e-12
H = 1e-5


def layer(settings, C=5, F=6, N=12, bias=False, seed=0):
    """(params, x (N, C), R (N, C)) float64: the router N(0, 1), the experts N(0, 0.4^2), x and R N(0, 1)."""
    rng = np.random.default_rng(seed)
    shapes = moe_param_shapes("moe", C, F, settings.experts, settings.mlp, bias)
    params = {n: rng.normal(0.0, 1.0 if "router" in n else 0.4, s) for n, s in shapes.items()}
    return params, rng.normal(0.0, 1.0, (N, C)), rng.normal(0.0, 1.0, (N, C))


def selection_margin(x, params, settings):
    """The smallest gap between a row's k-th and (k+1)-th selection score."""
    _, cache = router_forward(x, params["moe.router.weight"], settings)
    s = -np.sort(-cache[1], axis=1)                                            # (N, E) largest first
    return float((s[:, settings.top_k - 1] - s[:, settings.top_k]).min())


def run(x, params, settings, R, groups=None, bias=None):
    """(L, y, aux, dx, grads) with L = sum(y * R) + balance + z."""
    y, aux, cache = moe_forward(x, params, settings, groups=groups, selection_bias=bias)
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    dx = moe_backward(R, {"balance": 1.0, "z": 1.0}, cache, grads)
    return float((y * R).sum() + aux["balance"] + aux["z"]), y, aux, dx, grads


CASES = [  # (mlp, gates, capacity factor, biases, seed)
    ("gelu", "renormalized", None, True, 0),
    ("swiglu", "renormalized", 0.75, False, 0),
    ("gelu", "probabilities", 0.75, True, 0),
    ("swiglu", "probabilities", None, False, 1),
    ("swiglu", "sigmoid", 0.75, False, 0),
]


@pytest.mark.parametrize("mlp,gates,factor,bias,seed", CASES)
def test_backward_equals_finite_differences(mlp, gates, factor, bias, seed):
    s = MoESettings(experts=4, top_k=2, mlp=mlp, gates=gates, capacity_factor=factor, balance_coef=0.3, z_coef=0.05)
    params, x, R = layer(s, bias=bias, seed=seed)
    groups = [np.arange(0, 6), np.arange(6, 12)]
    margin = selection_margin(x, params, s)
    assert margin > 100 * H, f"seed {seed}: a selection margin of {margin:.1e} is too close for the probes"
    _, _, aux, dx, grads = run(x, params, s, R, groups)
    assert (aux["dropped"] > 0) == (factor is not None)
    names = sorted(params)
    loss = lambda: run(x, params, s, R, groups)[0]
    err = fd_error(loss, [x] + [params[n] for n in names], [dx] + [grads[n] for n in names], h=H, measure="array")
    print(f"{mlp} {gates} capacity factor {factor}: {aux['dropped']} slots dropped, margin {margin:.1e}, "
          f"{len(names)} parameters and x, max error {err:.1e}")
    assert err < 1e-7


def test_switch_loss_is_alpha_under_uniform_routing():
    """P_i = 1/E (a zero router: every probability exactly 1/4, every token's top-2 experts 0 and 1 by the tie rule)
    gives alpha E sum_i f_i / E = alpha whatever f; and f_i = 1/E (each token's top-2 the other half of the experts,
    in turn) gives alpha as well."""
    s = MoESettings(experts=4, top_k=2, balance_coef=0.37)
    params, x, R = layer(s, N=8)
    params["moe.router.weight"][:] = 0.0
    _, aux, _ = moe_forward(x, params, s)
    print(f"zero router: balance {float(aux['balance'])!r}, alpha {s.balance_coef!r}, load {aux['load']}")
    assert aux["balance"] == s.balance_coef and list(aux["load"]) == [8, 8, 0, 0]
    x2 = np.zeros((8, 5))
    x2[0::2, 0], x2[1::2, 1] = 1.0, 1.0                        # even rows prefer experts 0, 1; odd rows 2, 3
    params["moe.router.weight"][:2] = [[2.0, 1.5, -1.0, -1.0], [-1.0, -1.0, 2.0, 1.5]]
    _, aux, _ = moe_forward(x2, params, s)
    print(f"balanced choice: load {aux['load']}, balance {float(aux['balance'])!r}, error {aux['balance'] - 0.37:.1e}")
    assert list(aux["load"]) == [4, 4, 4, 4] and abs(aux["balance"] - 0.37) < 1e-15


def by_hand(x, W, groups, alpha, k):
    """alpha E mean_G sum_i f_Gi P_Gi with plain loops."""
    E = W.shape[1]
    values = []
    for G in groups:
        f, P = [0.0] * E, [0.0] * E
        for n in G:
            z = [sum(x[n, c] * W[c, i] for c in range(W.shape[0])) for i in range(E)]
            p = [math.exp(v) / sum(math.exp(u) for u in z) for v in z]
            for i in sorted(range(E), key=lambda i: -p[i])[:k]:
                f[i] += 1.0 / (len(G) * k)
            for i in range(E):
                P[i] += p[i] / len(G)
        values.append(sum(f[i] * P[i] for i in range(E)))
    return alpha * E * sum(values) / len(values)


def test_the_domain_matters():
    """A skewed batch: the first micro-batch's 6 tokens prefer experts 0 and 1, the second's 2 and 3. Over the global
    batch the load is even; over each micro-batch it is not: the two domains give different values, each equal to
    the formula computed by hand."""
    s = MoESettings(experts=4, top_k=2, balance_coef=0.01)
    params, x, R = layer(s)
    params["moe.router.weight"][:2] = [[1.5, 1.0, -1.0, -1.5], [-1.5, -1.0, 1.0, 1.5]]
    x = np.abs(x)
    x[:6, 1], x[6:, 0] = 0.0, 0.0
    W = params["moe.router.weight"]
    values = {}
    for domain, groups in (("global", [np.arange(12)]), ("micro-batch", [np.arange(6), np.arange(6, 12)]),
                           ("sequence", [np.arange(i, i + 3) for i in range(0, 12, 3)])):
        _, aux, _ = moe_forward(x, params, s, groups=groups)
        hand = by_hand(x, W, groups, s.balance_coef, s.top_k)
        print(f"{domain}: balance {aux['balance']:.6f}, by hand {hand:.6f}, difference {aux['balance'] - hand:.1e}")
        assert abs(aux["balance"] - hand) < 1e-15
        values[domain] = aux["balance"]
    assert values["micro-batch"] - values["global"] > 1e-3


def test_drops_follow_token_order():
    """Every token's first choice is expert 0 (a large router column): with capacity ceil(0.5 * 12 * 2 / 4) = 3, expert
    0 keeps tokens 0, 1, 2 and drops the rest; a dropped slot adds nothing: y equals the kept slots' gated outputs;
    the balance loss is the one without a capacity (f counts the choice before the drops)."""
    s = MoESettings(experts=4, top_k=2, mlp="gelu", capacity_factor=0.5, balance_coef=0.1)
    params, x, R = layer(s, bias=True)
    x[:, 0] = 1.0
    params["moe.router.weight"][0] = [10.0, 0.0, 0.0, 0.0]
    y, aux, _ = moe_forward(x, params, s)
    (chosen, gates, _, _), _ = router_forward(x, params["moe.router.weight"], s)
    perm, inv, load, kept = dispatch_indices(chosen, 4, 3)
    assert aux["capacity"] == 3 and (chosen[:, 0] == 0).all()
    assert list(perm[:3] // 2) == [0, 1, 2] and kept[0] == 3 and load[0] == 12
    assert aux["dropped"] == int((load - np.minimum(load, 3)).sum())
    assert ((chosen.reshape(-1)[perm])[:-1] <= (chosen.reshape(-1)[perm])[1:]).all()        # sorted by expert
    expected = np.zeros_like(y)
    for s_ in range(24):
        if inv[s_] < len(perm):                                # a kept slot
            n, j = divmod(s_, 2)
            e = chosen[n, j]
            ex = f"moe.experts.{e}."
            f = x[n] @ params[ex + "fc.weight"] + params[ex + "fc.bias"]
            gl = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f ** 3)))
            expected[n] += gates[n, j] * (gl @ params[ex + "proj.weight"] + params[ex + "proj.bias"])
    _, no_drops, _ = moe_forward(x, params, MoESettings(experts=4, top_k=2, mlp="gelu", balance_coef=0.1))
    print(f"capacity 3: load {load}, kept {kept}, dropped {aux['dropped']}, y error {np.abs(y - expected).max():.1e}; "
          f"balance {float(aux['balance']):.6f}, without a capacity {float(no_drops['balance']):.6f}")
    assert np.abs(y - expected).max() < 1e-14
    assert aux["balance"] == no_drops["balance"]                # f counts the choice before the drops


def test_selection_bias_balances_without_touching_gates():
    """DeepSeek-V3's bias: a skewed router (soft probabilities: a bias in probability units moves few tokens at a
    time), the bias moved by gamma sign(mean load - load) after each step: the load's spread falls to a quarter or
    less; the gates stay the chosen experts' renormalized probabilities (the bias only chooses)."""
    s = MoESettings(experts=4, top_k=2)
    params, x, R = layer(s, N=64, seed=3)
    params["moe.router.weight"] *= 0.3
    params["moe.router.weight"][0] += [0.3, 0.15, -0.15, -0.3]
    x[:, 0] += 1.0
    bias = np.zeros(4)
    spreads = []
    for step in range(60):
        _, aux, _ = moe_forward(x, params, s, selection_bias=bias)
        spreads.append(int(aux["load"].max() - aux["load"].min()))
        (chosen, gates, probs, _), _ = router_forward(x, params["moe.router.weight"], s, bias)
        picked = np.take_along_axis(softmax(x @ params["moe.router.weight"]), chosen, axis=1)
        assert np.abs(gates - picked / picked.sum(axis=1, keepdims=True)).max() < 1e-15
        bias = update_selection_bias(bias, aux["load"], 0.005)
    print(f"load spread (max - min slots) every 10 steps: {spreads[::10]}, last {spreads[-1]}, bias {bias}")
    assert spreads[0] >= 30 and max(spreads[-10:]) <= 0.25 * spreads[0]


def test_settings_refuse_what_cannot_work():
    bad = (dict(top_k=5), dict(top_k=0), dict(capacity_factor=0.0), dict(capacity_factor=float("nan")),
           dict(capacity_factor=float("inf")), dict(gates="softmax"), dict(mlp="relu"))
    for change in bad:
        with pytest.raises(ValueError, match="moe"):
            MoESettings(**{**dict(experts=4, top_k=2), **change})


# --------------------------------------------------------------------------------------------------------------
# Hugging Face's Mixtral block

def read():
    """(meta, params float64, x, dy, y, lbl, grads) of the reference file."""
    with Npz(DATA, "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {member: z[member] for member in z.files}
    params = {n[len("param/"):]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[len("grad/"):]: a for n, a in arrays.items() if n.startswith("grad/")}
    return meta, params, arrays["x"].astype(np.float64), arrays["dy"].astype(np.float64), arrays["y"], \
        float(arrays["lbl"]), grads


def hsgd_errors(gates="renormalized", alpha_per_k=True):
    """{"y", "balance", each gradient: relative error} of hsgd's layer against the file; alpha = coef * k (Hugging
    Face counts f per token), or coef alone with alpha_per_k False."""
    meta, params, x, dy, ref_y, lbl, ref_grads = read()
    k = meta["sizes"]["k"]
    s = MoESettings(experts=meta["sizes"]["E"], top_k=k, mlp="swiglu", gates=gates,
                    balance_coef=meta["coef"] * (k if alpha_per_k else 1))
    y, aux, cache = moe_forward(x, params, s)
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    grads["x"] = moe_backward(dy, {"balance": 1.0, "z": 0.0}, cache, grads)
    errors = {"y": float(np.abs(y - ref_y).max() / np.abs(ref_y).max()),
              "balance": abs(aux["balance"] - meta["coef"] * lbl) / (meta["coef"] * lbl)}
    errors.update({n: float(np.abs(grads[n] - g).max() / np.abs(g).max()) for n, g in ref_grads.items()})
    return errors


def test_reference_file_is_complete():
    meta, params, x, dy, y, lbl, grads = read()
    sizes = meta["sizes"]
    shapes = moe_param_shapes("moe", sizes["C"], sizes["F"], sizes["E"], "swiglu")
    print(f"transformers {meta['transformers']}, torch {meta['torch']}: {len(shapes)} parameters, lbl {lbl:.6f}")
    assert set(grads) == set(shapes) | {"x"} and set(params) == set(shapes)
    assert all(params[n].shape == grads[n].shape == shapes[n] for n in shapes) and grads["x"].shape == x.shape
    assert min(np.abs(g).max() for g in grads.values()) > 1e-4                 # every gradient non-trivial
    s = MoESettings(experts=sizes["E"], top_k=sizes["k"])
    assert selection_margin(x.reshape(-1, sizes["C"]), params, s) > 1e-6      # the top-2 is unambiguous


def test_layer_equals_hugging_face_mixtral():
    errors = hsgd_errors()
    worst = max(errors, key=errors.get)
    print(f"y {errors['y']:.1e}, balance {errors['balance']:.1e}, largest {errors[worst]:.1e} ({worst})")
    assert all(e <= TOLERANCE for e in errors.values()), {n: e for n, e in errors.items() if e > TOLERANCE}


@pytest.mark.parametrize("wrong", ["probabilities", "alpha without k"])
def test_another_convention_fails(wrong):
    """Gates not renormalized (Switch's convention on Mixtral's weights), or the balance loss's alpha taken as
    Hugging Face's coefficient without the factor k: each differs from the file far above rounding."""
    errors = hsgd_errors(gates="probabilities") if wrong == "probabilities" else hsgd_errors(alpha_per_k=False)
    worst = max(errors, key=errors.get)
    print(f"{wrong}: largest error {errors[worst]:.1e} ({worst})")
    assert errors[worst] > 1e-3
