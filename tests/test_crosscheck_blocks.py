"""hsgd.crosscheck's searches across a tensor and across replicas, on dumps written here in one process: a fused
gradient searched as one (a k/v exchange named, blocks that moved listed, near-zero k-bias blocks never taken for a
reordering), a gradient that is another layer's, replicas that say which side holds the reference (a stale buffer,
a rank's own rows' gradient: unreduced), and tensors sharded along two axes (FSDP x TP) read back, or refused when
their boxes overlap or leave a hole. (Dumps from a producer written from FORMAT.md alone: test_crosscheck_foreign.)"""
import io
import json

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model import serial
from hsgd.crosscheck.__main__ import check, report
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck import fused
from hsgd.crosscheck.manifest import new_run, write_manifest
from hsgd.crosscheck.read import load
from hsgd.crosscheck.write import pytorch_tensors, write_layout, write_one_rank, write_rank

CFG = ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=32)
HS = CFG.head_size


def model(seed=1, B=4):
    params = serial.init_params(CFG, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    idx, targets = (rng.integers(0, CFG.vocab_size, (B, CFG.seq_len)) for _ in range(2))
    loss, grads = serial.loss_and_grads(params, idx, targets, CFG)
    return params, idx, targets, loss, grads


def verdict(path):
    ok, _, rows = check(load(str(path)))
    bad = {r["name"]: (r["class"], r["detail"]) for r in rows if not r["ok"]}
    print(bad)
    return ok, {r["name"]: r for r in rows}


def one_rank(path, grads):
    params, idx, targets, loss, _ = model()
    write_one_rank(path, CFG, params, grads, loss=loss, idx=idx, targets=targets, system="test")


def test_k_and_v_exchanged_in_a_fused_qkv_are_named_and_the_zero_k_bias_too(tmp_path):
    """[q_h k_h v_h ...] per head with k and v exchanged: each holds the other's gradient, weight and bias (the k
    bias's gradient is exactly 0: the v bias now holds those zeros)."""
    grads = model()[4]
    assert np.abs(grads["h.0.attn.k.bias"]).max() < 1e-15 * np.abs(grads["h.0.attn.v.bias"]).max()   # 0, rounded
    swap = {f"h.0.attn.{a}.{w}": grads[f"h.0.attn.{b}.{w}"] for a, b in ("kv", "vk") for w in ("weight", "bias")}
    one_rank(tmp_path, {**grads, **swap})
    ok, rows = verdict(tmp_path)
    for a, b in ("kv", "vk"):
        for w in ("weight", "bias"):
            r = rows[f"h.0.attn.{a}.{w}"]
            assert r["class"] == "swapped" and r["detail"].startswith(f"h.0.attn.{a}.{w} holds h.0.attn.{b}.{w}'s")
    assert not ok and rows["h.0.attn.q.weight"]["ok"] and rows["h.1.attn.k.weight"]["ok"]


def test_one_head_of_k_and_v_exchanged_lists_the_moved_blocks(tmp_path):
    grads = model()[4]
    k, v = grads["h.0.attn.k.weight"].copy(), grads["h.0.attn.v.weight"].copy()
    head1 = slice(HS, 2 * HS)
    k[:, head1], v[:, head1] = grads["h.0.attn.v.weight"][:, head1], grads["h.0.attn.k.weight"][:, head1]
    one_rank(tmp_path, {**grads, "h.0.attn.k.weight": k, "h.0.attn.v.weight": v})
    ok, rows = verdict(tmp_path)
    r = rows["h.0.attn.k.weight"]
    assert r["class"] == "permutation" and "(heads;" in r["detail"] and \
        "h.0.attn.k.weight 1 <- h.0.attn.v.weight 1" in r["detail"], r
    assert rows["h.0.attn.v.weight"]["class"] == "permutation" and rows["h.0.attn.q.weight"]["ok"]


def test_near_zero_blocks_never_make_a_reordering_of_a_correct_copy():
    """The k-bias blocks are all zero (and with rounding noise all near zero): equal to one another. The identity is
    kept first, so a correct copy, or one whose only fault is elsewhere (q doubled), is no reordering."""
    grads = model()[4]
    t = pytorch_tensors(CFG)["h.0.attn.qkv.bias"]
    t.shape = (3 * CFG.d_model,)
    R = t.from_reference(grads)
    noisy = R + 1e-17 * np.random.default_rng(0).standard_normal(R.shape)
    doubled = t.from_reference({**grads, "h.0.attn.q.bias": 2 * grads["h.0.attn.q.bias"]})
    assert fused.moves(t, R, R, 1e-8) is None and fused.moves(t, noisy, R, 1e-8) is None
    assert fused.moves(t, doubled, R, 1e-8) is None
    assert fused.moves(t, R[::-1].copy(), R, 1e-8) is None          # rows reversed within heads: no block order


def test_a_gradient_written_under_another_layers_name_is_named(tmp_path):
    grads = model()[4]
    one_rank(tmp_path, {**grads, "h.0.mlp.proj.weight": grads["h.1.mlp.proj.weight"],
                        "h.1.mlp.proj.weight": grads["h.0.mlp.proj.weight"]})
    ok, rows = verdict(tmp_path)
    r = rows["h.0.mlp.proj.weight"]
    assert r["class"] == "swapped" and r["detail"].startswith("h.0.mlp.proj.weight holds h.1.mlp.proj.weight's"), r


# ------------------------------------------------------------------------------------------------ replicas

def replicated_dump(path, write):
    """A dump of dp = 4 ranks (tp 1), every parameter whole on each; write(name, rank, grads, local) gives the
    array a rank writes (local: each dp rank's own rows' gradient, {name: array} per rank)."""
    params, idx, targets, loss, grads = model(B=8)
    local = [serial.loss_and_grads(params, idx[2 * d:2 * d + 2], targets[2 * d:2 * d + 2], CFG)[1] for d in range(4)]
    tensors = {n: {"shape": list(s), "dtype": "float64", "shards": [{"rank": r} for r in range(4)]}
               for n, s in CFG.param_shapes().items()}
    run, files = new_run(), {}
    for r in range(4):
        files.update(write_rank(path, r, {n: write(n, r, grads, local) for n in grads}, run))
    files.update(write_layout(path, system="test", cfg=CFG, dtype="float64", loss=loss, ranks=4,
                              parallel={"dp": 4}, tensors=tensors, params=params, idx=idx, targets=targets, run=run))
    write_manifest(path, run, 4, files)


@pytest.mark.parametrize("write, cls, words", [
    (lambda n, r, g, local: g[n] + (r == 3) * np.cos(np.arange(g[n].size)).reshape(g[n].shape) if n == "ln_f.weight"
     else g[n], "stale replica", "ranks 0 | 1 | 2 hold the reference; ranks 3 hold another value"),
    (lambda n, r, g, local: local[r][n] if n == "ln_f.weight" and r >= 2 else g[n],
     "unreduced", "ranks 0 | 1 hold the reference; ranks 2 | 3 hold their own rows' gradient (ranks 2: the "
                  "gradient of dp rank 2"),
    (lambda n, r, g, local: local[r][n] / 4 if n == "ln_f.weight" else g[n],
     "unreduced", "no replica holds the reference, each its own rows' gradient (ranks 0: 1/dp x the gradient of dp "
                  "rank 0's rows alone (sequences 0..1)"),
    (lambda n, r, g, local: local[0][n] if n == "ln_f.weight" else g[n],
     "unreduced", "G is the gradient of dp rank 0's rows alone (sequences 0..1): the reduction over dp is missing"),
    (lambda n, r, g, local: (local[r % 2][n] + local[r % 2 + 2][n]) / 2 if n == "ln_f.weight" else g[n],
     "partial sum", "mean is the reference"),
    (lambda n, r, g, local: g[n] * (1.1 + 0.1 * r) if n == "ln_f.weight" else g[n],
     "replicas differ", "none of them the reference"),
], ids=["stale", "unreduced-some", "unreduced-all", "unreduced-one-copy", "wrong-pairs", "differ"])
def test_replicas_say_which_ranks_hold_the_reference(tmp_path, write, cls, words):
    replicated_dump(tmp_path, write)
    ok, rows = verdict(tmp_path)
    r = rows["ln_f.weight"]
    assert not ok and r["class"] == cls and words in r["detail"], r
    assert rows["ln_f.bias"]["ok"]


# ------------------------------------------------------------------------------------------------ 2-D shards

def two_d_dump(path, boxes, change=None):
    """wte (37, 16) cut into `boxes` [(rank, rows (offset, length, padding), columns (offset, length, padding))],
    every other tensor whole on rank 0: FSDP x TP's layout of a weight (rows over dp, columns over tp)."""
    params, idx, targets, loss, grads = model()
    ranks = 1 + max(b[0] for b in boxes)
    tensors = {n: {"shape": list(s), "dtype": "float64", "shards": [{"rank": 0}]}
               for n, s in CFG.param_shapes().items()}
    tensors["wte"]["shards"] = []
    arrays = [{} for _ in range(ranks)]
    for n in grads:
        if n != "wte":
            arrays[0][n] = grads[n]
    for rank, (o0, n0, p0), (o1, n1, p1) in boxes:
        key = f"wte.{o0}.{o1}"
        piece = np.zeros((n0 + p0, n1 + p1))
        piece[:n0, :n1] = grads["wte"][o0:o0 + n0, o1:o1 + n1]
        arrays[rank][key] = change(rank, piece) if change else piece
        tensors["wte"]["shards"].append({"rank": rank, "key": key, "slices": [
            {"axis": 0, "offset": o0, "length": n0, "padding": p0}, {"axis": 1, "offset": o1, "length": n1,
                                                                     "padding": p1}]})
    run, files = new_run(), {}
    for r in range(ranks):
        files.update(write_rank(path, r, arrays[r], run))
    files.update(write_layout(path, system="test", cfg=CFG, dtype="float64", loss=loss, ranks=ranks,
                              parallel={"dp": 2, "tp": 2}, tensors=tensors, params=params, idx=idx, targets=targets,
                              run=run))
    write_manifest(path, run, ranks, files)


# rows over dp 2 (19 + 18, the second padded by one: an uneven dimension 0), columns over tp 2
FSDP_TP = [(d * 2 + t, (19 * d, 19 - d, d), (8 * t, 8, 0)) for d in range(2) for t in range(2)]


def test_a_tensor_sharded_along_two_axes_reads_back_exactly(tmp_path, capsys):
    two_d_dump(tmp_path, FSDP_TP)
    ok, rows = verdict(tmp_path)
    print(rows["wte"]["split"], rows["wte"]["error"])
    assert ok and rows["wte"]["split"] == "axis 0 / 2 x axis 1 / 2 +pad" and rows["wte"]["error"] < 1e-14


def test_padding_of_a_two_axis_shard_must_be_zero(tmp_path):
    def pad(rank, piece):
        if rank == 3:
            piece[-1, :] = 1e-3                                       # the padded row of rank 3's box
        return piece
    two_d_dump(tmp_path, FSDP_TP, pad)
    ok, rows = verdict(tmp_path)
    assert not ok and rows["wte"]["class"] == "padding"


@pytest.mark.parametrize("boxes, words", [
    ([(0, (0, 20, 0), (0, 16, 0)), (1, (19, 18, 0), (0, 16, 0))], "overlap without being the same slice"),
    ([(0, (0, 19, 0), (0, 8, 0)), (1, (19, 18, 0), (0, 8, 0)), (2, (0, 37, 0), (9, 7, 0))],
     "no shard holds entry (0, 8) of shape [37, 16]"),
])
def test_two_axis_boxes_that_overlap_or_leave_a_hole_are_refused(tmp_path, boxes, words):
    two_d_dump(tmp_path, boxes)
    with pytest.raises(DumpError, match=None) as e:
        load(str(tmp_path))
    print(e.value)
    assert words in str(e.value)


# ------------------------------------------------------------------------------------------------ safetensors

def test_safetensors_files_beside_npz_read_the_same(tmp_path):
    """grads-rank{r} and params as .safetensors (hsgd.crosscheck.safetensors), batch as .npz: the same verdict;
    both forms of one file are refused, and the set check lists the .safetensors names."""
    from hsgd.crosscheck.manifest import check_set, seal
    from hsgd.crosscheck.safetensors import write_safetensors
    two_d_dump(tmp_path, FSDP_TP)
    for stem in ["params"] + [f"grads-rank{r}" for r in range(4)]:
        with np.load(tmp_path / f"{stem}.npz") as z:
            write_safetensors(str(tmp_path / f"{stem}.safetensors"), {k: z[k] for k in z.files})
    with pytest.raises(DumpError, match="both .npz and .safetensors"):
        load(str(tmp_path))
    for stem in ["params"] + [f"grads-rank{r}" for r in range(4)]:
        (tmp_path / f"{stem}.npz").unlink()
    seal(str(tmp_path), "safetensors-test", 4)
    assert "grads-rank3.safetensors" in check_set(str(tmp_path))["files"]
    ok, rows = verdict(tmp_path)
    assert ok and rows["wte"]["error"] < 1e-14


# ------------------------------------------------------------------------------------------------ rotary pairs

LLAMA = ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32, arch="llama")


def test_q_and_k_stored_in_rotary_pair_order_read_back_exactly(tmp_path):
    """torchtitan 0.3's storage (hsgd.crosscheck.systems.torchtitan_03_tensors): q|k|v fused per kv group, q's and k's
    features in rotary-pair order ("rotary": "interleaved"): the dump passes; the same arrays under a layout.json
    that leaves "rotary" out fail everywhere: the parameters are misread too, so the reference is another model,
    and the verdict's loss line says where to look."""
    from hsgd.crosscheck.systems import torchtitan_03_tensors
    from hsgd.crosscheck.write import write_sharded
    params = serial.init_params(LLAMA, seed=3, dtype="float64")
    rng = np.random.default_rng(3)
    idx, targets = (rng.integers(0, LLAMA.vocab_size, (4, LLAMA.seq_len)) for _ in range(2))
    loss, grads = serial.loss_and_grads(params, idx, targets, LLAMA)
    tensors = torchtitan_03_tensors(LLAMA)
    t = tensors["layers.0.attention.qkv_linear.wqkv.weight"][0]
    hs = LLAMA.head_size
    stored = t.from_reference(grads)                       # rows: [q heads of g0 | k_0 | v_0 | ...], (out, in)
    assert np.array_equal(stored[1], grads["h.0.attn.q.weight"][:, hs // 2])      # feature 1 = pair 0's second
    write_sharded(tmp_path, LLAMA, tensors, params, grads, tp=1, loss=loss, idx=idx, targets=targets, system="tt")
    ok, rows = verdict(tmp_path)
    assert ok and max(r["error"] for r in rows.values()) < 1e-13
    layout = json.load(open(tmp_path / "layout.json"))
    assert layout["tensors"]["layers.0.attention.qkv_linear.wqkv.weight"]["rotary"] == "interleaved"
    del layout["tensors"]["layers.0.attention.qkv_linear.wqkv.weight"]["rotary"]
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    dump = load(str(tmp_path))                             # (load alone: the set check would refuse the edit)
    ok, loss_row, rows = check(dump)
    out = io.StringIO()
    report(dump, ok, loss_row, rows, out)
    print(out.getvalue())
    assert not ok and not loss_row["ok"] and '"rotary": "interleaved"' in out.getvalue()


def test_rotary_interleaved_is_refused_where_there_is_no_rope_or_no_q_or_k(tmp_path):
    two_d_dump(tmp_path, FSDP_TP)
    layout = json.load(open(tmp_path / "layout.json"))
    layout["tensors"]["h.0.attn.q.weight"]["rotary"] = "interleaved"           # a gpt2 model: learned positions
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    with pytest.raises(DumpError, match="rotary \"interleaved\" is for the q and k weights"):
        load(str(tmp_path))


def test_rounding_just_over_tolerance_is_no_permutation_of_entries():
    """A vector off everywhere by a little more than the tolerance (a norm's gradient in another system's rounding):
    each entry finds some other entry within tol ||R||, but no reordering brings the whole error down, so none is
    named; a real reordering still is."""
    from hsgd.crosscheck.classify import block_permutation
    rng = np.random.default_rng(0)
    R = 1 + 0.05 * rng.standard_normal(256)                         # entries close together, as a norm's are
    G = R * (1 + 2e-4 * rng.standard_normal(256))
    print(float(np.linalg.norm(G - R) / np.linalg.norm(R)))
    assert block_permutation(G, R, 0, 1, 1e-4) is None
    order = np.arange(256)
    order[[3, 7]] = [7, 3]
    assert block_permutation(R[order], R, 0, 1, 1e-4) == list(order)


def split_replicas(path, order, change):
    """ln_f.weight (16,) cut in two along axis 0 over tp, each half on the 2 dp ranks (rank 2 d + t), its shards
    listed in `order` (of ranks); change(rank, piece, own) gives the piece a rank writes (own: its dp rank's own
    rows' gradient of that half). Every other parameter whole on rank 0."""
    params, idx, targets, loss, grads = model(B=4)
    local = [serial.loss_and_grads(params, idx[2 * d:2 * d + 2], targets[2 * d:2 * d + 2], CFG)[1] for d in range(2)]
    tensors = {n: {"shape": list(s), "dtype": "float64", "shards": [{"rank": 0}]}
               for n, s in CFG.param_shapes().items()}
    arrays = [{n: g for n, g in grads.items() if n != "ln_f.weight"}, {}, {}, {}]
    tensors["ln_f.weight"]["shards"] = []
    for r in order:
        t, half = r % 2, slice(8 * (r % 2), 8 * (r % 2) + 8)
        arrays[r][f"ln_f.{t}"] = change(r, grads["ln_f.weight"][half].copy(), local[r // 2]["ln_f.weight"][half])
        tensors["ln_f.weight"]["shards"].append({"rank": r, "key": f"ln_f.{t}", "axis": 0, "offset": 8 * t,
                                                 "length": 8})
    run, files = new_run(), {}
    for r in range(4):
        files.update(write_rank(path, r, arrays[r], run))
    files.update(write_layout(path, system="test", cfg=CFG, dtype="float64", loss=loss, ranks=4,
                              parallel={"dp": 2, "tp": 2}, tensors=tensors, params=params, idx=idx, targets=targets,
                              run=run))
    write_manifest(path, run, 4, files)


OFF = 0.3 * np.cos(np.arange(8))


@pytest.mark.parametrize("order, change, cls, words", [
    ([0, 1, 2, 3], lambda r, p, own: 0 * p if r == 1 else p, "missing", "zero on ranks 1:"),
    ([0, 1, 2, 3], lambda r, p, own: p + OFF if r in (1, 2) else p, "stale replica",
     "ranks 0 | 3 hold the reference; ranks 1 | 2 hold another value"),
    ([0, 3, 2, 1], lambda r, p, own: p + OFF if r == 3 else p, "stale replica",
     "ranks 0 | 1 | 2 hold the reference; ranks 3 hold another value"),
    ([0, 3, 2, 1], lambda r, p, own: own, "unreduced",
     "no replica holds the reference, each its own rows' gradient (ranks 0,1: the gradient of dp rank 0's rows"),
    ([0, 3, 2, 1], lambda r, p, own: own if r >= 2 else p, "unreduced",
     "ranks 0 | 1 hold the reference; ranks 2 | 3 hold their own rows' gradient"),
], ids=["missing-on-one", "stale-two", "stale-other-order", "unreduced-other-order", "unreduced-one-dp-rank"])
def test_a_split_tensors_replicas_are_judged_shard_by_shard(tmp_path, order, change, cls, words):
    """A copy of a split tensor mixes the shards of several ranks, in the order layout.json lists them: the verdict
    names the ranks whose shards hold each value, whatever that order (hsgd.crosscheck.replicas)."""
    split_replicas(tmp_path, order, change)
    ok, rows = verdict(tmp_path)
    r = rows["ln_f.weight"]
    assert not ok and r["class"] == cls and words in r["detail"], r


def test_one_head_exchanged_in_a_block_layout_qkv_is_found():
    """[q | k | v] one after the other (interleave "block"): the pieces are whole parts, C entries each, but a block
    is still one head (the gcd with hs), so one head of k and v exchanged is named."""
    grads = model()[4]
    t = pytorch_tensors(CFG, "block")["h.0.attn.qkv.weight"]
    t.shape = (3 * CFG.d_model, CFG.d_model)
    k, v = grads["h.0.attn.k.weight"].copy(), grads["h.0.attn.v.weight"].copy()
    k[:, :HS], v[:, :HS] = grads["h.0.attn.v.weight"][:, :HS], grads["h.0.attn.k.weight"][:, :HS]
    G = t.from_reference({**grads, "h.0.attn.k.weight": k, "h.0.attn.v.weight": v})
    moved = fused.moves(t, G, t.from_reference(grads), 1e-8, HS)
    assert fused.unit(t, HS) == HS and fused.unit(t) == CFG.d_model
    text = fused.describe(t, moved, "heads", HS)["h.0.attn.k.weight"]
    print(text)
    assert text[0] == "permutation" and "h.0.attn.k.weight 0 <- h.0.attn.v.weight 0" in text[1]


@pytest.mark.parametrize("boxes, words", [
    ([(0, (0, 0, 37), (0, 16, 0))], "hold padding only"),
])
def test_shards_of_padding_alone_are_refused(tmp_path, boxes, words):
    two_d_dump(tmp_path, boxes)
    with pytest.raises(DumpError, match=words):
        load(str(tmp_path))


def test_the_same_box_written_two_ways_is_one_box(tmp_path):
    """Rows 0..36 of a 37-row tensor, all of them, written as a slice or left out: the same box, replicas of each
    other, not an overlap."""
    whole_rows = [(0, (0, 37, 0), (0, 8, 0)), (1, (0, 37, 0), (8, 8, 0))]
    two_d_dump(tmp_path, whole_rows)
    layout = json.load(open(tmp_path / "layout.json"))
    shards = layout["tensors"]["wte"]["shards"]
    extra = dict(shards[0], rank=1, key="wte.0.0", slices=[dict(shards[0]["slices"][1])])   # columns only
    layout["tensors"]["wte"]["shards"].append(extra)
    with np.load(tmp_path / "grads-rank1.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["wte.0.0"] = np.load(tmp_path / "grads-rank0.npz")["wte.0.0"]
    np.savez(tmp_path / "grads-rank1.npz", **arrays)
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    dump = load(str(tmp_path))
    assert len({s.box() for s in dump.tensors["wte"].shards}) == 2
    ok, _, rows = check(dump)
    assert ok and [r for r in rows if r["name"] == "wte"][0]["split"].startswith("axis 1 / 2")
