"""hsgd.crosscheck on dumps written here, in one process: the format's mappings (shards, replicas, padding, a fused
q|k|v interleaved per head, transposed weights) reassemble the reference exactly; each kind of wrong gradient is
classified; a dump that does not fit together exits 2 with one line; a low-precision dump is held to the rounding
band."""
import json
import os

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model import serial
from hsgd.tp import shards as tp_shards
from hsgd.crosscheck.__main__ import check, main
from hsgd.crosscheck.classify import block_permutation, factor_names, name_factor
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck.manifest import new_run, write_manifest
from hsgd.crosscheck.read import load
from hsgd.crosscheck.write import write_layout, write_one_rank, write_rank
from hsgd.crosscheck.hsgd_dump import shard_of

CFG = ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32)
HS = CFG.d_model // CFG.n_heads


def batch(seed=0, B=4):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab_size, (B, CFG.seq_len)), rng.integers(0, CFG.vocab_size, (B, CFG.seq_len))


def write_tp_dump(path, tp=2, dp=2, change=None, dtype="float64", loss_change=1.0):
    """A dump of the exact gradients split as hsgd splits them over tp (V = 37: the vocabulary padded to 38 at
    tp = 2), replicated over dp; change(name, rank, array) may alter what a rank writes."""
    params = serial.init_params(CFG, seed=1, dtype="float64")
    idx, targets = batch()
    loss, grads = serial.loss_and_grads(params, idx, targets, CFG)
    tensors = {n: {"shape": list(s), "dtype": dtype, "shards": []} for n, s in CFG.param_shapes().items()}
    run, files = new_run(), {}
    for r in range(tp * dp):
        t = r % tp
        mine = {}
        for n, g in grads.items():
            a = tp_shards.shard(g, n, t, tp)
            mine[n] = change(n, r, a) if change else a
            tensors[n]["shards"].append(shard_of(n, CFG, t, tp, "megatron", r))
        files.update(write_rank(path, r, mine, run))
    files.update(write_layout(path, system="test", cfg=CFG, dtype=dtype, loss=loss * loss_change, ranks=tp * dp,
                              parallel={"dp": dp, "tp": tp}, tensors=tensors, params=params, idx=idx,
                              targets=targets, run=run))
    write_manifest(path, run, tp * dp, files)                 # dump.json, last
    return loss, grads


GRADS = {}


def verdict(path):
    ok, loss_row, rows = check(load(str(path)))
    return ok, loss_row, {r["name"]: r for r in rows}


def test_exact_shards_pass_and_the_padding_is_dropped(tmp_path, capsys):
    write_tp_dump(tmp_path)
    assert json.load(open(tmp_path / "layout.json"))["tensors"]["wte"]["shards"][1]["padding"] == 1
    code = main([str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert code == 0 and "PASS" in out and "+pad" in out


def test_fused_qkv_interleaved_per_head_and_transposed_weights_map_back_exactly(tmp_path):
    """A PyTorch-style dump: nn.Linear weights stored (out, in), q|k|v fused as [q_h0 k_h0 v_h0 q_h1 ...]."""
    params = serial.init_params(CFG, seed=2, dtype="float64")
    idx, targets = batch(1)
    loss, grads = serial.loss_and_grads(params, idx, targets, CFG)
    stored = write_one_rank(tmp_path, CFG, params, grads, loss=loss, idx=idx, targets=targets, system="test")
    # the fused tensor's rows are [q_h0 k_h0 v_h0 q_h1 ...]: rows 4..7 are head 0 of k, i.e. column 0..3 of k
    assert np.array_equal(stored["h.0.attn.qkv.weight"][HS:2 * HS], params["h.0.attn.k.weight"][:, :HS].T)
    assert json.load(open(tmp_path / "layout.json"))["tensors"]["h.0.attn.qkv.weight"]["transposed"] is True
    ok, _, rows = verdict(tmp_path)
    print(max(r["error"] for r in rows.values()))
    assert ok and max(r["error"] for r in rows.values()) < 1e-14


@pytest.mark.parametrize("bug, name, expect", [
    (lambda n, r, a: 2 * a, "h.0.mlp.fc.weight", ("constant factor", "= dp or tp")),
    (lambda n, r, a: a / 3 if "ln" in n else a, "h.0.ln1.weight", ("constant factor", "(not a size")),
    (lambda n, r, a: a * (0.5 if r < 2 else 1.5) if n == "ln_f.bias" else a, "ln_f.bias",
     ("partial sum", "mean is the reference: an average over 2 ranks is missing")),
    (lambda n, r, a: 0 * a if n == "wpe" else a, "wpe", ("missing", "never arrived")),
    (lambda n, r, a: a + np.nan if n == "wpe" else a, "wpe", ("not finite", "NaN")),
    (lambda n, r, a: a.T.copy() if n == "h.0.attn.k.weight" and a.shape[0] == a.shape[1] else a,
     "h.0.attn.proj.weight", None),
    (lambda n, r, a: a[::-1].copy() if n == "wpe" else a, "wpe", ("permutation", "rows along axis 0")),
    (lambda n, r, a: np.concatenate([a[:-1], np.ones_like(a[-1:])]) if n == "wte" and r % 2 else a, "wte",
     ("padding", "padded entries carry gradient")),
    (lambda n, r, a: 0 * a if n == "wpe" and r == 2 else a, "wpe", ("missing", "zero on ranks 2:")),
    (lambda n, r, a: a + 1e-9 * (np.arange(len(a)) >= 18)[:, None] if n == "wte" and r % 2 else a, "wte",
     ("padding", "padded entries carry gradient")),
    (lambda n, r, a: tp_shards.shard(GRADS[n], n, 1 - r % 2, 2) if n == "h.0.mlp.proj.weight" else a,
     "h.0.mlp.proj.weight", ("permutation", "shards along axis 0 in another order: [1, 0]")),
], ids=["factor-2", "factor-1/3", "partial-mean", "missing", "nan", "untouched", "rows", "padding", "one-replica-zero",
        "tiny-padding", "shards-swapped"])
def test_each_kind_of_wrong_gradient_is_named(tmp_path, bug, name, expect):
    GRADS.update(write_tp_dump(tmp_path)[1])                 # (the shards-swapped case writes the other rank's)
    write_tp_dump(tmp_path, change=bug)
    ok, _, rows = verdict(tmp_path)
    print({n: (r["class"], r["detail"]) for n, r in rows.items() if not r["ok"]})
    if expect is None:
        assert rows[name]["ok"]
        return
    assert not ok and rows[name]["class"] == expect[0] and expect[1] in rows[name]["detail"], rows[name]


def test_a_square_weight_transposed_and_a_head_permutation():
    R = np.random.default_rng(0).normal(size=(16, 16))
    from hsgd.crosscheck.classify import classify
    names = factor_names({"tp": 2, "dp": 4}, 64)
    assert classify("h.0.attn.proj.weight", [R.T], R, 1e-8, names, HS)[0] == "transposed"
    G = R.reshape(16, 4, 4)[:, [2, 0, 1, 3]].reshape(16, 16)
    cls, detail = classify("h.0.attn.v.weight", [G], R, 1e-8, names, HS)
    print(detail)
    assert cls == "permutation" and "heads along axis 1 in another order: [2, 0, 1, 3]" in detail
    assert block_permutation(R, R, 1, 4, 1e-8) is None                  # the identity is no permutation


def test_a_permutation_of_many_rows_is_found_in_little_memory():
    """wte of a 4096-token vocabulary (rows of absent tokens exactly zero) with two rows swapped: found through
    k x k distances (128 MiB here), not a (k, k, C) array; above MAX_BLOCKS blocks it is not tried."""
    from hsgd.crosscheck.classify import MAX_BLOCKS, classify
    R = np.random.default_rng(0).normal(size=(4096, 4)) * (np.arange(4096) % 3 > 0)[:, None]
    G = R.copy()
    G[[1, 2]] = G[[2, 1]]
    cls, detail = classify("wte", [G], R, 1e-8, factor_names({}, 64), HS)
    assert cls == "permutation" and detail.startswith("rows along axis 0 in another order: [0, 2, 1, 3, 4")
    big = np.ones((MAX_BLOCKS + 1, 2))
    assert block_permutation(big[::-1], big, 0, 1, 1e-8) is None


def test_a_factor_is_named_within_1_percent_at_most():
    names = factor_names({"tp": 4, "dp": 2, "micro_batches": 8}, 64)
    assert name_factor(2.0, names, 0.05) == ["dp"]
    assert name_factor(1.15, names, 0.1) == [] and name_factor(2.1, names, 0.1) == []


def test_factor_names_prefer_one_size_and_say_when_two_fit():
    names = factor_names({"tp": 2, "dp": 4, "micro_batches": 3}, 128)
    assert name_factor(3.0, names, 1e-10) == ["micro-batches"]
    assert name_factor(1 / 4, names, 1e-10) == ["1/dp"]
    assert name_factor(8.0, names, 1e-10) == ["tp x dp"]
    assert name_factor(128.0, names, 1e-10) == ["tokens"]
    assert name_factor(32.0, names, 1e-10) == ["tokens per dp rank"]
    assert sorted(name_factor(2.0, factor_names({"tp": 2, "dp": 2}, 64), 1e-10)) == ["dp", "tp"]
    assert name_factor(1.7, names, 1e-10) == []


def test_a_wrong_loss_fails_alone(tmp_path, capsys):
    write_tp_dump(tmp_path, loss_change=1.01)
    assert main([str(tmp_path)]) == 1
    assert "the loss the system reports is not the mean" in capsys.readouterr().out


def bad(path, edit):
    write_tp_dump(path)
    edit(path)
    with pytest.raises(DumpError) as e:
        load(str(path))
    print(e.value)
    return str(e.value)


def edit_layout(change):
    def edit(path):
        meta = json.load(open(path / "layout.json"))
        change(meta)
        json.dump(meta, open(path / "layout.json", "w"))
    return edit


@pytest.mark.parametrize("edit, words", [
    (lambda p: os.remove(p / "layout.json"), "layout.json: no such file"),
    (lambda p: open(p / "layout.json", "w").write("{"), "not valid JSON"),
    (lambda p: os.remove(p / "grads-rank3.npz"), "grads-rank3.npz: no such file"),
    (lambda p: np.savez(p / "batch.npz", idx=np.array([object()]), targets=np.zeros(3)), "without pickle"),
    (lambda p: open(p / "params.npz", "w").write("not a zip"), "not an .npz file NumPy can read"),
    (edit_layout(lambda m: m.update(format="other")), "\"format\" must be"),
    (edit_layout(lambda m: m.update(version=7)), "this hsgd reads version 1"),
    (edit_layout(lambda m: m.update(dtype="float8")), "dtype 'float8'"),
    (edit_layout(lambda m: m["tensors"].pop("wpe")), "no tensor holds wpe"),
    (edit_layout(lambda m: m["tensors"]["wpe"].update(shape=[3, 3])), "shape [3, 3], but its parameters give"),
    (edit_layout(lambda m: m["tensors"]["wte"]["shards"][1].update(offset=30)), "runs past 37 entries"),
    (edit_layout(lambda m: m["tensors"]["wte"].update(shards=[m["tensors"]["wte"]["shards"][0]])),
     "no shard holds entry 19 of axis 0"),
    (edit_layout(lambda m: m["tensors"]["wte"]["shards"][0].update(rank=9)), "rank 9, but the dump has ranks 0..3"),
    (edit_layout(lambda m: m["tensors"]["wte"]["shards"][0].update(padding=1)), "has shape (19, 16), its shard"),
    (edit_layout(lambda m: m["tensors"].update(extra={"shape": [1], "shards": [{"rank": 0}]})),
     "'extra' is not a parameter of the model"),
    (edit_layout(lambda m: m["model"].update(n_heads=5)), "not divisible by n_heads=5"),
], ids=["no-layout", "json", "no-rank-file", "pickle", "not-npz", "format", "version", "dtype", "missing-param",
        "shape", "past-end", "uncovered", "rank", "grad-shape", "unknown-tensor", "model"])
def test_a_dump_that_does_not_fit_together_is_refused_in_one_line(tmp_path, edit, words):
    assert words in bad(tmp_path, edit)


def test_refusals_exit_2_with_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("hsgd: error:") == 1 and "not a folder" in err


def test_a_bfloat16_dump_is_held_to_the_rounding_band(tmp_path):
    """Exact gradients pass a bfloat16 band (orders of magnitude wider than float64's 1e-10, far below 1); one
    parameter's gradient 1.5 x too large is outside it, and named a constant factor."""
    write_tp_dump(tmp_path, dtype="bfloat16")
    ok, _, rows = verdict(tmp_path)
    band = rows["h.0.mlp.fc.weight"]["tolerance"]
    print("band", band)
    assert ok and 1e-4 < band < 0.2
    assert rows["h.0.mlp.fc.weight"]["class"] == ""                     # exact: no rounding to speak of
    write_tp_dump(tmp_path, dtype="bfloat16", change=lambda n, r, a: a * 1.5 if n == "h.0.mlp.fc.weight" else a)
    ok, _, rows = verdict(tmp_path)
    assert not ok and not rows["h.0.mlp.fc.weight"]["ok"] and rows["h.0.mlp.fc.weight"]["class"] == \
        "constant factor"


@pytest.mark.parametrize("edit, words", [
    (edit_layout(lambda m: m["tensors"]["wpe"].update(fused={"axis": 0, "parts": [["wpe"]]})),
     "must be the reference parameters' names"),
    (edit_layout(lambda m: m["tensors"]["wpe"].update(transposed="false")), "transposed 'false' must be true or"),
    (edit_layout(lambda m: m["tensors"]["wpe"].update(dtype=["x"])), "dtype ['x'] must be one of"),
    (edit_layout(lambda m: m.update(version=True)), "this hsgd reads version 1"),
    (edit_layout(lambda m: m["tensors"]["wte"]["shards"][1].update(offset=10)), "overlap without being the same"),
    (lambda p: os.replace(p / "params.npz", p / "x.npy") or np.save(p / "params.npy", np.zeros(3)) or
     os.replace(p / "params.npy", p / "params.npz"), "one array (.npy), not an .npz archive"),
    (lambda p: __import__("zipfile").ZipFile(p / "batch.npz", "w").writestr("idx", b"raw"), "not a .npy array"),
    (lambda p: np.savez(p / "params.npz", **{k: v + np.nan for k, v in np.load(p / "params.npz").items()}),
     "holds inf or NaN"),
    (lambda p: (os.remove(p / "layout.json"), os.mkdir(p / "layout.json")), "a folder, not a file"),
], ids=["parts-not-strings", "transposed-string", "dtype-list", "version-bool", "overlap", "npy", "not-npy-member",
        "nan-params", "layout-folder"])
def test_more_malformed_dumps_are_refused(tmp_path, edit, words):
    assert words in bad(tmp_path, edit)


def test_fused_parts_that_do_not_line_up_are_refused_and_unequal_blocks_map_back(tmp_path):
    """Fused "block" parts may differ in length along the axis (q|k|v with fewer k, v heads would), not across."""
    from hsgd.crosscheck.read import _tensors
    fused = {"h.0.attn.qf.weight": {"shape": [16, 48], "fused": {"axis": 1, "parts": ["h.0.attn.q.weight",
             "h.0.mlp.fc.weight"]}, "shards": [{"rank": 0}]}}
    rest = {n: {"shape": list(s), "shards": [{"rank": 0}]} for n, s in CFG.param_shapes().items()
            if n not in ("h.0.attn.q.weight", "h.0.mlp.fc.weight")}
    t = _tensors({**fused, **rest}, CFG, 1)["h.0.attn.qf.weight"]
    q, fc = np.arange(256.0).reshape(16, 16), -np.arange(512.0).reshape(16, 32)
    back = t.to_reference(t.from_reference({"h.0.attn.q.weight": q, "h.0.mlp.fc.weight": fc}))
    assert np.array_equal(back["h.0.attn.q.weight"], q) and np.array_equal(back["h.0.mlp.fc.weight"], fc)
    fused["h.0.attn.qf.weight"]["fused"]["axis"] = 0
    fused["h.0.attn.qf.weight"]["shape"] = [32, 16]
    with pytest.raises(DumpError, match="do not line up"):
        _tensors({**fused, **rest}, CFG, 1)


def test_a_loss_that_is_not_finite_is_said_so(tmp_path, capsys):
    write_tp_dump(tmp_path, loss_change=float("nan"))
    assert main([str(tmp_path)]) == 1
    assert "the loss the system reports is not finite" in capsys.readouterr().out


def test_the_verdict_as_json(tmp_path):
    write_tp_dump(tmp_path / "d", change=lambda n, r, a: 2 * a if n == "wpe" else a)
    assert main([str(tmp_path / "d"), "--json", str(tmp_path / "v.json")]) == 1
    v = json.load(open(tmp_path / "v.json"))
    rows = {r["name"]: r for r in v["parameters"]}
    assert v["ok"] is False and v["loss"]["ok"] and rows["wpe"]["class"] == "constant factor" and rows["wte"]["ok"]
    assert main([str(tmp_path / "d"), "--json", str(tmp_path / "no" / "v.json")]) == 2
