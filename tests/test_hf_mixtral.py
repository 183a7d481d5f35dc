"""hsgd's serial mixture-of-experts model equals an independent implementation: Hugging Face transformers'
MixtralForCausalLM in float64 with its load-balancing loss, whose loss and gradients on one batch are committed in
tests/data/hf_mixtral/model_*.npz (written by benchmarks/hf_mixtral_reference.py, whose docstring says how: the names
mapped, the float32 steps replaced, the loss; make bench regenerates them and compares again where transformers is
installed). No torch needed here.

The models: Llama blocks whose MLPs are 4 SwiGLU experts, grouped-query attention with top-2 (Mixtral's k) and
multi-head attention with top-1. hsgd runs them with moe_balance_layers "pooled" and moe_balance_domain "global"
(Hugging Face's load_balancing_loss_func counts f and P over the rows of all blocks of the whole batch at once) and
alpha = coef * k (the library's f sums to k over the experts, hsgd's to 1). The loss within 1e-12 of the reference
relative to it, and each gradient within 1e-12 relative to its reference's largest entry:
max|g - g_ref| / max|g_ref| <= 1e-12; and the balance term alone (hsgd's loss less its loss with alpha = 0) within
1e-12 of coef * lbl, the library's. And the check can fail: alpha = coef (without k), a loss per block summed
("each"), or f and P per sequence ("sequence") differ by 1e-3 or more.
"""
import dataclasses
import json
import os

import numpy as np
import pytest

from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.readers import Npz
from tests.test_hf_llama import assert_serial_equals, relative_errors

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_mixtral")
MODELS = ("gqa", "mha_top1")
TOLERANCE = 1e-12


def read(name):
    """(cfg, params float64, idx, targets, loss, grads, meta, ce, lbl) of the reference file model_`name`.npz."""
    with Npz(os.path.join(DATA, f"model_{name}.npz"), "Hugging Face reference file", ValueError,
             max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {member: z[member] for member in z.files}
    cfg = ModelConfig(**meta["config"])
    params = {n[len("param/"):]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[len("grad/"):]: a for n, a in arrays.items() if n.startswith("grad/")}
    return (cfg, params, arrays["idx"], arrays["targets"], float(arrays["loss"]), grads, meta, float(arrays["ce"]),
            float(arrays["lbl"]))


@pytest.mark.parametrize("name", MODELS)
def test_files_hold_every_parameter_of_their_config(name):
    cfg, params, idx, targets, loss, grads, meta, ce, lbl = read(name)
    shapes = cfg.param_shapes()
    print(f"{name}: {cfg.n_kv_heads} kv heads of {cfg.n_heads}, {cfg.moe_experts} experts top-{cfg.moe_top_k} in "
          f"blocks {cfg.moe_layers()}, {len(shapes)} parameters; loss {loss:.6f} = ce {ce:.6f} + {meta['coef']} * "
          f"lbl {lbl:.6f}; smallest routing gap {meta['routing_gap']:.1e}")
    assert (cfg.arch, cfg.norm, cfg.positions, cfg.mlp, cfg.bias, cfg.tied) == ("llama", "rmsnorm", "rope", "swiglu",
                                                                                  False, False)
    assert (cfg.moe_gates, cfg.moe_capacity_factor, cfg.moe_balance_layers, cfg.moe_balance_domain,
            cfg.moe_z_loss) == ("renormalized", None, "pooled", "global", 0.0)
    assert cfg.moe_layers() == list(range(cfg.n_layers)) and cfg.moe_balance == meta["coef"] * cfg.moe_top_k
    assert set(grads) == set(shapes) == set(params)
    assert all(grads[n].shape == params[n].shape == shapes[n] and grads[n].dtype == np.float64 for n in shapes)
    assert idx.shape == targets.shape == (idx.shape[0], cfg.seq_len) and 0 < ce < 10 and lbl > 0
    assert abs(loss - (ce + meta["coef"] * lbl)) <= 1e-15 * loss
    assert min(np.abs(g).max() for g in grads.values()) > 1e-5            # every gradient non-trivial: every expert hit
    assert meta["routing_gap"] > 1e-6                                    # no top-k choice within rounding of a tie


@pytest.mark.parametrize("name", MODELS)
def test_serial_moe_equals_hugging_face(name):
    cfg, params, idx, targets, ref_loss, ref_grads, *_ = read(name)
    assert_serial_equals(name, cfg, params, idx, targets, ref_loss, ref_grads)


@pytest.mark.parametrize("name", MODELS)
def test_balance_term_alone_equals_hugging_face(name):
    """hsgd's loss less its loss with alpha = 0 is its balance term: coef * lbl, the library's."""
    cfg, params, idx, targets, _, _, meta, ce, lbl = read(name)
    loss = serial.loss_and_grads(params, idx, targets, cfg)[0]
    loss0 = serial.loss_and_grads(params, idx, targets, dataclasses.replace(cfg, moe_balance=0.0))[0]
    ref = meta["coef"] * lbl
    print(f"{name}: cross-entropy {loss0:.6f}, error {abs(loss0 - ce) / ce:.1e}; balance {loss - loss0:.6f} vs "
          f"coef * lbl {ref:.6f}, error {abs(loss - loss0 - ref) / ref:.1e}")
    assert abs(loss0 - ce) <= TOLERANCE * ce and abs(loss - loss0 - ref) <= TOLERANCE * ref


CHANGES = {  # a balance loss other than the library's
    "alpha = coef, not coef * k": lambda cfg: dataclasses.replace(cfg, moe_balance=cfg.moe_balance / cfg.moe_top_k),
    "a loss per block, summed": lambda cfg: dataclasses.replace(cfg, moe_balance_layers="each"),
    "f and P per sequence": lambda cfg: dataclasses.replace(cfg, moe_balance_domain="sequence"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_another_balance_loss_fails(change):
    cfg, params, idx, targets, ref_loss, ref_grads, *_ = read("gqa")
    loss, grads = serial.loss_and_grads(params, idx, targets, CHANGES[change](cfg))
    errors = relative_errors(loss, grads, ref_loss, ref_grads)
    worst = max(errors, key=errors.get)
    print(f"{change}: loss error {errors['loss']:.1e}, largest gradient error {errors[worst]:.1e} ({worst})")
    assert errors[worst] > 1e-3
