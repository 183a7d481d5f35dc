"""Activation memory of both model families and both core attentions on one process (tp = 1), counted against the
formulas: hsgd.accounting.activations.activation_bytes of a real forward's caches equals activation_formula (one
block and the whole model) and step_memory.pieces (what a block keeps under --recompute none | selective | full,
and what its backward computes again) for GPT-2 and Llama (grouped-query attention with n_rep = 2 and 1, a tied
head), materialized and flash attention; flash's block grows linearly in T where the materialized one grows by
its B NH T^2 probabilities; the preflight memory check's estimate follows --attention."""
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.accounting.activations import activation_bytes, activation_formula
from hsgd.accounting.step_memory import pieces
from hsgd.grid.process_grid import ProcessGrid
from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.run.preflight import memory_estimate
from hsgd.step.settings import TrainConfig
from hsgd.tp import model as tp_model
from hsgd.tp.attention import FLASH, WHOLE

B, S = 3, 8                                                            # sequences, bytes per float64
SHAPE = dict(vocab_size=64, seq_len=32, d_model=16, n_heads=4, n_layers=2, d_ff=40)
GPT2 = ModelConfig(**SHAPE)
LLAMA = ModelConfig(**SHAPE, arch="llama")                             # NKV = 2: two query heads per kv head
FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "llama-mha": replace(LLAMA, n_kv_heads=4),
            "llama-tied": replace(LLAMA, tied=True)}
CONTEXTS = {"materialized": WHOLE, "flash": FLASH}




def test_the_families_are_what_they_say():
    """(dataclasses.replace(gpt2_config, arch="llama") would keep GPT-2's fields: the presets fill only what was
    not given.)"""
    assert (GPT2.mlp, GPT2.norm, GPT2.positions, GPT2.n_kv_heads) == ("gelu", "layernorm", "learned", 4)
    for name in ("llama", "llama-mha", "llama-tied"):
        cfg = FAMILIES[name]
        assert (cfg.mlp, cfg.norm, cfg.positions, cfg.bias) == ("swiglu", "rmsnorm", "rope", False)
    assert (LLAMA.n_kv_heads, FAMILIES["llama-mha"].n_kv_heads, FAMILIES["llama-tied"].tied) == (2, 4, True)


@pytest.fixture(scope="module")
def tp_comm():
    grid = ProcessGrid(MPI.COMM_SELF)
    yield grid.tp_comm
    grid.free()


def forward(cfg, attention, recompute, tp_comm, batch=B):
    """(parameters, setup, caches) of one forward of the whole model on `batch` random sequences."""
    params = serial.init_params(cfg, 0, np.float64)
    idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    setup = tp_model.TPSetup(cfg, tp_comm, "megatron", recompute, CONTEXTS[attention])
    _, caches = tp_model.forward(params, idx, idx, setup)
    return params, setup, caches


@pytest.mark.parametrize("attention", CONTEXTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_forwards_caches_equal_the_formula(family, attention, tp_comm):
    cfg = FAMILIES[family]
    params, _, caches = forward(cfg, attention, "none", tp_comm)
    measured = {"block": activation_bytes(caches.blocks[0][1], params), "model": activation_bytes(caches, params)}
    formula = activation_formula(cfg, B, S, 1, "megatron", attention=attention)
    print(f"{family} {attention}: measured {measured}, formula {formula}")
    assert measured == formula


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("attention", CONTEXTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_what_recomputation_keeps_and_rebuilds_equals_the_formula(family, attention, recompute, tp_comm):
    """K, a block's cache under --recompute, and R, what its backward computes again (selective: the attention's
    cache from q, k, v; full: the whole block's cache from its input): flash keeps no probabilities, so selective
    keeps everything and computes nothing again; Llama with NKV = NH keeps q and k turned by RoPE and v as a view
    of the whole fused q|k|v product (step_memory.selective_kept)."""
    cfg = FAMILIES[family]
    params, setup, caches = forward(cfg, attention, recompute, tp_comm)
    block = caches.blocks[0][1]
    if recompute == "full":
        rebuilt = activation_bytes(tp_model.recompute_block(block[1], params, "h.0.", setup), params)
    elif isinstance(block[2][0], str):                                  # the probabilities were dropped
        rebuilt = activation_bytes(tp_model.recompute_attention(*block[2][1:], setup), params)
    else:
        rebuilt = 0
    measured = {"K": activation_bytes(block, params), "R": rebuilt}
    pc = pieces(cfg, B, S, 1, "megatron", recompute, attention=attention)
    print(f"{family} {attention} {recompute}: measured {measured}, formula K {pc['K']} R {pc['R']}")
    assert measured == {"K": pc["K"], "R": pc["R"]} and pc["recomputes"] == (rebuilt > 0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flash_blocks_grow_linearly_in_T_the_materialized_by_T_squared(family, tp_comm):
    """One block's cache at T = 256 and 512 (B = 1): flash's doubles exactly (every term is O(B NH T) or O(N C)),
    the materialized one doubles plus the probabilities' B NH (512^2 - 2 256^2) s; each equals the formula."""
    got = {}
    for T in (256, 512):
        cfg = replace(FAMILIES[family], seq_len=T)
        for attention in CONTEXTS:
            params, _, caches = forward(cfg, attention, "none", tp_comm, batch=1)
            got[attention, T] = activation_bytes(caches.blocks[0][1], params)
            assert got[attention, T] == activation_formula(cfg, 1, S, 1, "megatron", attention=attention)["block"]
    NH = FAMILIES[family].n_heads
    grow = {a: got[a, 512] - 2 * got[a, 256] for a in CONTEXTS}
    print(f"{family}: block bytes {got}; beyond doubling: {grow} (B NH T^2 term: {NH * (512**2 - 2 * 256**2) * S})")
    assert grow == {"materialized": NH * (512**2 - 2 * 256**2) * S, "flash": 0}
    assert got["flash", 512] < got["materialized", 512] / 5


@pytest.mark.parametrize("attention", CONTEXTS)
def test_the_preflight_estimate_follows_attention(attention):
    """hsgd.run.preflight.memory_estimate's activations: the formula's whole model for --attention, less the
    probabilities with --recompute selective only where they are kept (materialized)."""
    got = {}
    for recompute in ("none", "selective"):
        tc = TrainConfig(batch_size=B, dtype="float64", attention=attention, recompute=recompute)
        tc.validate()
        tc.resolve_layout(1)
        got[recompute] = memory_estimate(LLAMA, tc)[1]
    model = activation_formula(LLAMA, B, S, 1, "megatron", attention=attention)["model"]
    dropped = LLAMA.n_layers * (pieces(LLAMA, B, S, 1, "megatron", "none", attention=attention)["K"]
                                - pieces(LLAMA, B, S, 1, "megatron", "selective", attention=attention)["K"])
    print(f"{attention}: preflight activations {got}, formula {model}, selective drops {dropped}")
    assert got == {"none": model, "selective": model - dropped}
    assert (dropped > 0) == (attention == "materialized")
