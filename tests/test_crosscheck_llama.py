"""hsgd.crosscheck reads the model family (hsgd/crosscheck/FORMAT.md): layout.json's model section gives the family
(absent fields: gpt2's, so format 1's dumps read as before; bad values refused in one line); Megatron-LM's storage of
a Llama model (hsgd.crosscheck.systems: its names, linear_qkv fused per query group [q heads of g | k_g | v_g],
linear_fc1 fused per rank [gate_i | up_i], transposed weights, no output layer when tied) and Hugging Face's names
reassemble hsgd's serial gradients exactly at tp 1 and 2; and three planted bugs are named: gate and up swapped
("swapped"), the kv heads in another order ("permutation"), a tied wte without the LM head's part ("part
missing")."""
import json

import numpy as np
import pytest

from hsgd.crosscheck.__main__ import check, main
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck.hsgd_dump import shard_of
from hsgd.crosscheck.manifest import new_run, write_manifest
from hsgd.crosscheck.read import load
from hsgd.crosscheck.systems import hf_tensors, megatron_tensors
from hsgd.crosscheck.write import write_layout, write_rank, write_sharded
from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.tp import shards as tp_shards

SIZES = dict(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32)
LLAMA = ModelConfig(**SIZES, arch="llama")                          # NKV = 2: two q heads per kv head
TIED = ModelConfig(**SIZES, arch="llama", tied=True)
QKV, FC1 = "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight"


def reference(cfg, seed=1):
    """(params, idx, targets, loss, grads) of hsgd's serial model in float64."""
    params = serial.init_params(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    idx, targets = (rng.integers(0, cfg.vocab_size, (3, cfg.seq_len)) for _ in range(2))
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    return params, idx, targets, loss, grads


def megatron_dump(path, cfg, tp, dp=1, change=None, grads=None, tensors=None):
    params, idx, targets, loss, ref = reference(cfg)
    write_sharded(path, cfg, tensors or megatron_tensors(cfg, tp), params, grads or ref, tp=tp, dp=dp, loss=loss,
                  idx=idx, targets=targets, system=f"Megatron-LM's names, tp {tp}", change=change)
    return ref


def verdict(path):
    ok, _, rows = check(load(str(path)))
    print({r["name"]: (r["error"], r["class"], r["detail"]) for r in rows if not r["ok"]})
    return ok, {r["name"]: r for r in rows}


@pytest.mark.parametrize("cfg, tp", [(LLAMA, 1), (LLAMA, 2), (TIED, 2), (ModelConfig(**SIZES, n_kv_heads=2), 2)],
                         ids=["llama-tp1", "llama-tp2", "tied-tp2", "gpt2-gqa-tp2"])
def test_megatron_storage_of_the_family_reassembles_the_reference_exactly(tmp_path, cfg, tp, capsys):
    """tp 2 x dp 2 ranks in Megatron-LM's names: every gradient of the serial model back exactly, the vocabulary's
    padding dropped (37 rows on 2 ranks), the whole set checked by the command (exit 0)."""
    megatron_dump(tmp_path, cfg, tp, dp=2)
    meta = json.load(open(tmp_path / "layout.json"))
    assert meta["model"]["arch"] == cfg.arch and meta["model"]["tied"] is cfg.tied
    assert ("output_layer.weight" in meta["tensors"]) is not cfg.tied
    ok, rows = verdict(tmp_path)
    print(f"largest error {max(r['error'] for r in rows.values()):.1e}")
    assert ok and max(r["error"] for r in rows.values()) < 1e-14
    assert set(rows) == set(cfg.param_shapes())
    assert main([str(tmp_path)]) == 0 and "PASS" in capsys.readouterr().out


def test_the_fused_layouts_are_megatrons():
    """linear_qkv's rows per query group g: [q heads 2g, 2g+1 | k_g | v_g] (hs rows each, NKV = 2 groups);
    linear_fc1's rows [gate_0 | up_0 | gate_1 | up_1] at tp 2 (F/2 rows each): rank i's half holds its gate_i, up_i."""
    params = serial.init_params(LLAMA, seed=3, dtype="float64")
    hs, F = LLAMA.head_size, LLAMA.d_ff
    t = megatron_tensors(LLAMA, 2)
    qkv, fc1 = t[QKV][0].from_reference(params), t[FC1][0].from_reference(params)
    q, k, v = (params[f"h.0.attn.{m}.weight"].T for m in "qkv")             # (out, in) as Megatron-LM stores
    assert np.array_equal(qkv, np.concatenate([q[:2 * hs], k[:hs], v[:hs], q[2 * hs:], k[hs:], v[hs:]]))
    gate, up = params["h.0.mlp.gate.weight"].T, params["h.0.mlp.up.weight"].T
    h = F // 2
    assert np.array_equal(fc1, np.concatenate([gate[:h], up[:h], gate[h:], up[h:]]))
    assert t[FC1][1] == 0 and t["decoder.layers.0.self_attention.linear_proj.weight"][1] == 1
    with pytest.raises(ValueError, match="tp must divide n_kv_heads"):
        megatron_tensors(LLAMA, 4)


def test_a_rank_blocked_qkv_and_hugging_face_names_read_back(tmp_path):
    """A fused qkv of [q_i | k_i | v_i] per rank (interleave groups, groups = tp) and Hugging Face's one-rank
    LlamaForCausalLM names (q_proj, gate_proj, down_proj, ...: each a parameter under another name)."""
    tensors = megatron_tensors(LLAMA, 2)
    tensors[QKV][0].groups = 2
    megatron_dump(tmp_path / "blocked", LLAMA, 2, tensors=tensors)
    assert verdict(tmp_path / "blocked")[0]
    megatron_dump(tmp_path / "hf", TIED, 1, tensors=hf_tensors(TIED))
    names = json.load(open(tmp_path / "hf" / "layout.json"))["tensors"]
    assert names["model.layers.0.mlp.down_proj.weight"]["fused"] == {"parts": ["h.0.mlp.proj.weight"]}
    assert verdict(tmp_path / "hf")[0]


def swap_halves(name, rank, a):
    """The system's bug: it writes its [gate_i | up_i] as [up_i | gate_i]."""
    return np.concatenate([a[len(a) // 2:], a[:len(a) // 2]]) if name == FC1 else a


@pytest.mark.parametrize("tp", [1, 2])
def test_gate_and_up_swapped_is_named(tmp_path, tp):
    megatron_dump(tmp_path, LLAMA, tp, change=swap_halves)
    ok, rows = verdict(tmp_path)
    for name, other in (("h.0.mlp.gate.weight", "h.0.mlp.up.weight"), ("h.0.mlp.up.weight", "h.0.mlp.gate.weight")):
        assert rows[name]["class"] == "swapped" and rows[name]["detail"].startswith(f"{name} holds {other}'s gradient")
    assert not ok and rows["h.0.attn.q.weight"]["ok"]


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_groups_in_another_order_are_a_permutation_of_heads(tmp_path, tp):
    """The system's k and v heads in another order than its q heads' groups (kv head 1 where 0 belongs): the fused
    q|k|v searched as one shows k's and v's heads moved, q is right."""
    _, _, _, _, ref = reference(LLAMA)
    hs = LLAMA.head_size
    swapped = np.r_[hs:2 * hs, 0:hs]                                          # kv head 1, then 0
    bad = {**ref, **{f"h.0.attn.{m}.weight": ref[f"h.0.attn.{m}.weight"][:, swapped] for m in "kv"}}
    megatron_dump(tmp_path, LLAMA, tp, grads=bad)
    ok, rows = verdict(tmp_path)
    for m in "kv":
        r = rows[f"h.0.attn.{m}.weight"]
        moved = f"h.0.attn.{m}.weight 0 <- h.0.attn.{m}.weight 1, h.0.attn.{m}.weight 1 <- h.0.attn.{m}.weight 0"
        assert r["class"] == "permutation" and "(heads;" in r["detail"] and moved in r["detail"], r
    assert not ok and rows["h.0.attn.q.weight"]["ok"]


def test_a_tied_wte_without_the_heads_part_is_named(tmp_path, capsys):
    """Tied embeddings: wte's gradient is the lookup's + the LM head's (logits = x wte^T); the dump has no
    output_layer. A system that adds only the lookup's is named "part missing", and so is one with only the
    head's."""
    params, idx, targets, loss, ref = reference(TIED)
    untied = ModelConfig(**SIZES, arch="llama", tied=False)
    _, parts = serial.loss_and_grads({**params, "lm_head.weight": params["wte"].T.copy()}, idx, targets, untied)
    assert np.allclose(parts["wte"] + parts["lm_head.weight"].T, ref["wte"], rtol=0, atol=1e-15)
    for only, words in ((parts["wte"], "the embedding lookup's part alone"),
                        (parts["lm_head.weight"].T, "the LM head's part alone")):
        megatron_dump(tmp_path, TIED, 2, grads={**ref, "wte": only})
        ok, rows = verdict(tmp_path)
        assert not ok and rows["wte"]["class"] == "part missing" and words in rows["wte"]["detail"]
    assert main([str(tmp_path)]) == 1 and "look first at: part missing (wte)" in capsys.readouterr().out


def edit_model(path, change):
    meta = json.load(open(path / "layout.json"))
    change(meta["model"])
    json.dump(meta, open(path / "layout.json", "w"))


def test_a_model_section_without_the_family_is_gpt2(tmp_path):
    """Format 1's dumps name only the six sizes: they read as the GPT-2 block (LayerNorm, learned positions, GELU,
    biases, untied), and a gpt2 dump with its family written reads the same."""
    cfg = ModelConfig(**SIZES)
    megatron_dump(tmp_path, cfg, 2)
    edit_model(tmp_path, lambda m: [m.pop(k) for k in list(m) if k not in SIZES])
    assert load(str(tmp_path)).cfg == cfg


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(arch="llama3"), "arch='llama3' is not a model family hsgd has; use one of ['gpt2', 'llama']"),
    (lambda m: m.update(arch=["llama"]), "arch=['llama'] must be a string"),
    (lambda m: m.update(norm="batchnorm"), "norm='batchnorm' is not one hsgd has"),
    (lambda m: m.update(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    (lambda m: m.update(n_kv_heads=2.0), "n_kv_heads=2.0 must be a positive integer"),
    (lambda m: m.update(rope_theta=float("inf")), "rope_theta=inf must be a number above 1"),
    (lambda m: m.update(tied="yes"), "tied='yes' must be true or false"),
    (lambda m: m.update(d_model=12), "head size d_model/n_heads = 12/4 = 3 is odd"),
    (lambda m: m.update(rope=True), "model: 'rope' is not a field of the model"),
    (lambda m: m.pop("d_ff"), "\"model\" must give vocab_size, seq_len, d_model, n_heads, n_layers, d_ff"),
    (lambda m: m.update(mlp="\n" + "x" * 100000), "xxx...' is not one hsgd has; use one of ['gelu', 'swiglu']"),
], ids=["arch", "arch-list", "norm", "kv-heads", "kv-float", "theta-inf", "tied-string", "odd-head", "unknown",
        "no-d_ff", "long-text"])
def test_a_bad_family_is_refused_in_one_line(tmp_path, change, words):
    megatron_dump(tmp_path, LLAMA, 1)
    edit_model(tmp_path, change)
    with pytest.raises(DumpError) as e:
        load(str(tmp_path))
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 600


def test_a_family_whose_parameters_the_tensors_do_not_give_is_refused(tmp_path):
    """A dump that says tied (no lm_head) but holds output_layer.weight, and one that says untied but holds none."""
    megatron_dump(tmp_path, LLAMA, 1)
    edit_model(tmp_path, lambda m: m.update(tied=True))
    with pytest.raises(DumpError, match="'lm_head.weight' is not a parameter of the model"):
        load(str(tmp_path))
    megatron_dump(tmp_path, TIED, 1)
    edit_model(tmp_path, lambda m: m.update(tied=False))
    with pytest.raises(DumpError, match="no tensor holds lm_head.weight"):
        load(str(tmp_path))


@pytest.mark.parametrize("fused, words", [
    ({"interleave": "groups"}, "interleave groups needs \"groups\""),
    ({"interleave": "groups", "groups": 3}, "groups = 3 pieces, but the parts' lengths along axis 0 are [16, 8, 8]"),
    ({"interleave": "head", "group": 4}, "parts of other lengths (grouped k, v) take interleave groups"),
    ({"interleave": "rows"}, "fused.interleave 'rows' must be one of block, head, groups"),
], ids=["no-groups", "groups-3", "head-gqa", "unknown"])
def test_a_fused_qkv_that_cannot_be_cut_so_is_refused(tmp_path, fused, words):
    megatron_dump(tmp_path, LLAMA, 1)
    meta = json.load(open(tmp_path / "layout.json"))
    f = meta["tensors"][QKV]["fused"]
    f.pop("groups")
    f.update(fused)
    json.dump(meta, open(tmp_path / "layout.json", "w"))
    with pytest.raises(DumpError, match=None) as e:
        load(str(tmp_path))
    print(e.value)
    assert words in str(e.value)


def test_a_layout_json_that_says_another_qkv_layout_is_named(tmp_path):
    """The system stores its fused qkv [q | k | v] while layout.json says Megatron-LM's per query group (groups =
    NKV = 2): q, k and v each "fused layout", naming the layout that reads them right."""
    params, idx, targets, loss, ref = reference(LLAMA)
    blocked = megatron_tensors(LLAMA, 1)[QKV][0]
    blocked.groups = 1
    wrote = blocked.from_reference(ref)
    megatron_dump(tmp_path, LLAMA, 1, change=lambda n, r, a: wrote if n == QKV else a)
    ok, rows = verdict(tmp_path)
    for m in "qkv":
        r = rows[f"h.0.attn.{m}.weight"]
        assert r["class"] == "fused layout" and "as [p0 | p1 | ...] (interleave block), not as layout.json says " \
            "(groups, 2 pieces per part)" in r["detail"], r
    assert not ok and rows["h.0.mlp.gate.weight"]["ok"]


@pytest.mark.parametrize("n_kv_heads, tp", [(2, 2), (1, 4), (2, 4)], ids=["kv-split", "kv-1-of-4", "kv-2-of-4"])
def test_hsgd_own_shards_of_a_llama_model_in_its_names(tmp_path, n_kv_heads, tp):
    """hsgd's own dump (hsgd_dump.shard_of, the descriptions --dump-step writes) of its tp shards (hsgd.tp.shards):
    k and v split by kv heads when tp divides NKV, else each rank's one kv head, the same slice on tp/NKV ranks
    (replicas); reassembled exactly."""
    cfg = ModelConfig(**SIZES, arch="llama", n_kv_heads=n_kv_heads)
    params, idx, targets, loss, grads = reference(cfg)
    tensors = {n: {"shape": list(s), "dtype": "float64", "shards": []} for n, s in cfg.param_shapes().items()}
    run, files = new_run(), {}
    for r in range(tp):
        for n in grads:
            tensors[n]["shards"].append(shard_of(n, cfg, r, tp, "megatron", r))
        files.update(write_rank(tmp_path, r, {n: tp_shards.shard(g, n, r, tp, cfg=cfg) for n, g in grads.items()},
                                run))
    files.update(write_layout(tmp_path, system="hsgd", cfg=cfg, dtype="float64", loss=loss, ranks=tp,
                              parallel={"tp": tp}, tensors=tensors, params=params, idx=idx, targets=targets, run=run))
    write_manifest(tmp_path, run, tp, files)
    k = tensors["h.0.attn.k.weight"]["shards"]
    print([(s["offset"], s["length"]) for s in k])
    assert len({(s["offset"], s["length"]) for s in k}) == min(tp, n_kv_heads)
    ok, rows = verdict(tmp_path)
    assert ok and max(r["error"] for r in rows.values()) < 1e-14
