"""hsgd's serial Llama model equals an independent implementation: Hugging Face transformers' LlamaForCausalLM in
float64, whose loss and gradients on one batch are committed in tests/data/hf_llama (written by
benchmarks/hf_llama_reference.py, whose docstring says how: the names mapped, the rotary convention, the loss; make
bench regenerates them and compares again where transformers is installed). No torch needed here.

For multi-head, grouped-query and multi-query attention (4, 2 and 1 key/value heads of 4), and grouped-query with a
tied LM head: the loss within 1e-12 of the reference relative to it, and each gradient within 1e-12 relative to its
reference's largest entry: max|g - g_ref| / max|g_ref| <= 1e-12. And the check can fail: the same weights read in the
other rotary order (pairs (2i, 2i + 1), Meta's original checkpoints) differ at 1e-3 or more.
"""
import json
import os

import numpy as np
import pytest

from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.model.llama_layers import rope_half_order
from hsgd.readers import Npz

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_llama")
MODELS = ("mha", "gqa", "mqa", "gqa_tied")
TOLERANCE = 1e-12


def read(name):
    """(cfg, params float64, idx, targets, loss, grads) of the reference file `name`.npz."""
    with Npz(os.path.join(DATA, f"{name}.npz"), "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {member: z[member] for member in z.files}
    cfg = ModelConfig(**meta["config"])
    params = {n[len("param/"):]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[len("grad/"):]: a for n, a in arrays.items() if n.startswith("grad/")}
    return cfg, params, arrays["idx"], arrays["targets"], float(arrays["loss"]), grads


def relative_errors(loss, grads, ref_loss, ref_grads):
    """{"loss": |loss - ref| / |ref|, name: max|g - ref| / max|ref| for each gradient}."""
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errors[name] = float(np.abs(grads[name] - ref).max() / np.abs(ref).max())
    return errors


@pytest.mark.parametrize("name", MODELS)
def test_files_hold_every_parameter_of_their_config(name):
    cfg, params, idx, targets, loss, grads = read(name)
    shapes = cfg.param_shapes()
    print(f"{name}: {cfg.n_kv_heads} kv heads of {cfg.n_heads}, tied {cfg.tied}, {len(shapes)} parameters")
    assert (cfg.arch, cfg.norm, cfg.positions, cfg.mlp, cfg.bias) == ("llama", "rmsnorm", "rope", "swiglu", False)
    assert set(grads) == set(shapes) == set(params)
    assert all(grads[n].shape == params[n].shape == shapes[n] and grads[n].dtype == np.float64 for n in shapes)
    assert idx.shape == targets.shape == (idx.shape[0], cfg.seq_len) and 0 < loss < 10
    assert min(np.abs(g).max() for g in grads.values()) > 1e-5                 # every gradient non-trivial


@pytest.mark.parametrize("name", MODELS)
def test_serial_llama_equals_hugging_face(name):
    cfg, params, idx, targets, ref_loss, ref_grads = read(name)
    assert_serial_equals(name, cfg, params, idx, targets, ref_loss, ref_grads)


def assert_serial_equals(name, cfg, params, idx, targets, ref_loss, ref_grads):
    """hsgd's serial loss and every gradient within TOLERANCE (relative) of a reference file's; prints the worst."""
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    assert set(grads) == set(ref_grads)
    errors = relative_errors(loss, grads, ref_loss, ref_grads)
    worst = max(errors, key=errors.get)
    print(f"{name}: loss {ref_loss:.6f}, error {errors['loss']:.1e}; largest gradient error {errors[worst]:.1e} "
          f"({worst})")
    assert all(e <= TOLERANCE for e in errors.values()), {n: e for n, e in errors.items() if e > TOLERANCE}


def test_the_other_rotary_order_fails():
    """W_q and W_k with each head's columns permuted by rope_half_order: the model then pairs what the interleaved
    convention pairs, (2i, 2i + 1), on the file's weights. The gradients, permuted back, must differ."""
    cfg, params, idx, targets, ref_loss, ref_grads = read("gqa")
    hs = cfg.head_size

    def per_head(width):                                       # rope_half_order within each head of a width
        return (np.arange(0, width, hs)[:, None] + rope_half_order(hs)).reshape(-1)

    order = {"q": per_head(cfg.d_model), "k": per_head(cfg.kv_width)}
    swapped = dict(params)
    for i in range(cfg.n_layers):
        for m, o in order.items():
            swapped[f"h.{i}.attn.{m}.weight"] = params[f"h.{i}.attn.{m}.weight"][:, o]
    loss, grads = serial.loss_and_grads(swapped, idx, targets, cfg)
    for i in range(cfg.n_layers):
        for m, o in order.items():
            back = np.empty_like(grads[f"h.{i}.attn.{m}.weight"])
            back[:, o] = grads[f"h.{i}.attn.{m}.weight"]
            grads[f"h.{i}.attn.{m}.weight"] = back
    errors = relative_errors(loss, grads, ref_loss, ref_grads)
    worst = max(errors, key=errors.get)
    print(f"interleaved pairs: loss error {errors['loss']:.1e}, largest gradient error {errors[worst]:.1e} ({worst})")
    assert errors[worst] > 1e-3
