"""The serial model with experts (hsgd.model.serial with hsgd.model.moe_pass): its hand-written backward against
finite differences of the whole loss (cross-entropy plus the balance loss over its domain and the z-loss), for each
family of experts, gates, domain, pooling and capacity; the domain's and the capacity groups' effect on the loss.

Finite differences: float64, V=24, T=6, C=8, NH=2, L=2, F=12, E=4, k=2, B=4; fourth-order central differences of
step 1e-5 on 5
coordinates of every parameter, measured relative to each array's largest gradient entry. A probe moves the router's
scores by about 1e-5, so each case first checks that every row's k-th selection score is above its (k+1)-th by more
than 100 times the step in every MoE block, taking the first seed whose draw has that margin: no probe changes a
routing decision (nor, then, a drop).
"""
import numpy as np
import pytest

from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.model.gradcheck import fd_error
from hsgd.model.moe_pass import serial_pass

H = 1e-5
SIZES = dict(vocab_size=24, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=12)
B = 4

CASES = {  # name: (ModelConfig fields, micro_sequences, capacity groups as row ranges)
    "gelu experts, biases, micro-batches of 1, capacity 1.0 per 2 sequences, z-loss":
        (dict(moe_experts=4, moe_capacity_factor=1.0, moe_balance=0.3, moe_z_loss=0.05), 1, 2),
    "llama, swiglu experts, pooled over the blocks, global":
        (dict(arch="llama", moe_experts=4, moe_balance=0.3, moe_balance_layers="pooled",
              moe_balance_domain="global"), None, None),
    "sigmoid gates, per sequence, every other block, top-1":
        (dict(arch="llama", moe_experts=4, moe_top_k=1, moe_every=2, moe_gates="sigmoid", moe_balance=0.3,
              moe_balance_domain="sequence", moe_z_loss=0.02), None, None),
    "probabilities (Switch), capacity 0.75 over all rows":
        (dict(moe_experts=4, moe_top_k=1, moe_gates="probabilities", moe_capacity_factor=0.75, moe_balance=0.3),
         None, None),
}


def model(fields, seed=0):
    cfg = ModelConfig(**SIZES, **fields)
    params = serial.init_params(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    for name in params:                                       # routers of order 1: skewed, well-separated routing
        if "router" in name:
            params[name] = rng.normal(0.0, 1.0, params[name].shape)
    idx = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))
    return cfg, params, idx, rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))


def make_pass(cfg, micro, groups):
    T = cfg.seq_len
    capacity = None if groups is None else [np.arange(j * groups * T, (j + 1) * groups * T) for j in range(B // groups)]
    return serial_pass(cfg, B, T, np, micro_sequences=micro, capacity_groups=capacity)


def margin(params, idx, cfg, moe):
    """The smallest gap between a row's k-th and (k+1)-th selection score, over every MoE block."""
    _, caches = serial.forward(params, idx, cfg, moe=moe)
    gaps = []
    for c in caches[1]:
        if isinstance(c[-1][0], str):                         # ("moe", the layer's cache)
            s = -np.sort(-c[-1][1][1][1], axis=1)             # the router's scores (N, E), largest first
            gaps.append(float((s[:, cfg.moe_top_k - 1] - s[:, cfg.moe_top_k]).min()))
    return min(gaps)


@pytest.mark.parametrize("name", list(CASES))
def test_model_backward_equals_finite_differences(name):
    fields, micro, groups = CASES[name]
    seed = next(s for s in range(50) if margin(*model(fields, s)[1:3], model(fields, s)[0], make_pass(
        model(fields, s)[0], micro, groups)) > 100 * H)        # the first draw whose routing no probe changes
    cfg, params, idx, targets = model(fields, seed)
    moe = make_pass(cfg, micro, groups)
    value, grads = serial.loss_and_grads(params, idx, targets, cfg, moe=moe)
    aux = float(moe.finish())
    loss = lambda: serial.loss_and_grads(params, idx, targets, cfg, moe=make_pass(cfg, micro, groups))[0]
    names = list(params)
    err = fd_error(loss, [params[n] for n in names], [grads[n] for n in names], n=5, order=4, measure="array")
    dropped = sum(int(a["dropped"]) for a in moe.aux.values())
    print(f"{name}: loss {value:.6f} (auxiliary {aux:.6f}), {dropped} slots dropped, max error {err:.1e}")
    assert aux > 0 and err < 1e-6
    if fields.get("moe_capacity_factor"):
        assert dropped > 0                                    # the case exercises the drops


def test_domain_and_capacity_groups_change_the_loss():
    """One batch, the same parameters: the balance loss over micro-batches of one sequence differs from the one over
    the whole batch (a different statistic, not rounding), and a capacity counted per pair of sequences drops other
    slots than one counted over all rows."""
    fields = dict(moe_experts=4, moe_capacity_factor=1.0, moe_balance=0.3)
    cfg, params, idx, targets = model(fields)
    whole = serial.loss_and_grads(params, idx, targets, cfg, moe=make_pass(cfg, None, None))[0]
    micro = serial.loss_and_grads(params, idx, targets, cfg, moe=make_pass(cfg, 1, None))[0]
    moe_a, moe_b = make_pass(cfg, None, None), make_pass(cfg, None, 1)
    serial.forward(params, idx, cfg, moe=moe_a)
    serial.forward(params, idx, cfg, moe=moe_b)
    kept_a = [a["kept"].tolist() for a in moe_a.aux.values()]
    kept_b = [a["kept"].tolist() for a in moe_b.aux.values()]
    print(f"balance over the batch {whole:.6f} vs over micro-batches of 1 sequence {micro:.6f}; kept per expert "
          f"{kept_a} (one capacity group) vs {kept_b} (one per sequence)")
    assert abs(whole - micro) > 1e-4 and kept_a != kept_b
