"""PyTorch Distributed Checkpoints read into crosscheck dumps (hsgd.crosscheck.from_dcp, hsgd.crosscheck.dcp) and the
bounded safetensors reader (hsgd.crosscheck.safetensors). What the tests prove:
  * tests/data/dcp/ok, written by PyTorch (benchmarks/make_dcp_fixture.py: DTensors on a (dp 2, tp 2) mesh, boxes
    split on two dims, 37 rows split 19 + 18, replicated chunks DCP saved once; DCP's default torch_save format),
    read through its committed dcp-metadata.json (no pickle, no PyTorch), becomes a dump the crosscheck passes, each
    chunk a shard of the rank whose file holds it; a names file with "{i}" reads the same;
  * tests/data/dcp/bug (DCP's safetensors format, gradients only, one of them doubled; the parameters from ok with
    --params) fails, its class "constant factor";
  * a malformed folder (no .metadata, a truncated .distcp or zip, a chunk declaring more than its bytes, no trust
    flag, a .metadata over the bound, an unknown FQN, no PyTorch) ends with exit 2 and one line;
  * read_safetensors refuses a header length, offsets or a shape the file does not hold before reading, and its
    bfloat16 values are ml_dtypes' (where ml_dtypes is installed);
  * bounds, each one line before anything is written: a stray .distcp file or a chunk beyond the run's ranks
    (hsgd.json's dp x tp), a world over MAX_RANKS, a names file's fused groups 0 or "rotary" off q and k of a rope
    model, a compressed data.pkl, a DCP_SHARDING_INFO whose saved_offsets are no list, a shape with no entries but
    dimensions numpy refuses (a dump's safetensors file, --batch, batch.idx);
  * with PyTorch installed: the committed .metadata read through PyTorch's reader is the committed JSON, and a
    fresh checkpoint (the generator run now) passes.
"""
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from hsgd.crosscheck import dcp, from_dcp
from hsgd.crosscheck.__main__ import main as crosscheck
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck.safetensors import read_safetensors, write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "dcp")
OK, BUG = os.path.join(DATA, "ok"), os.path.join(DATA, "bug")


def convert(capsys, *argv):
    """(exit code, stderr's lines) of python -m hsgd.crosscheck.from_dcp argv, run in this process."""
    capsys.readouterr()
    rc = from_dcp.main([str(a) for a in argv])
    return rc, capsys.readouterr().err.splitlines()


def verdict(tmp_path, dump):
    """(exit code, {parameter: row}) of python -m hsgd.crosscheck DUMP, its --json verdict."""
    out = tmp_path / "verdict.json"
    rc = crosscheck([str(dump), "--json", str(out)])
    with open(out) as f:
        v = json.load(f)
    return rc, {r["name"]: r for r in v["parameters"]}


def same_arrays(a, b):
    """Whether dumps a and b hold the same arrays (params, batch, every rank's gradients) and layouts."""
    layouts = [{k: v for k, v in json.loads((d / "layout.json").read_text()).items() if k != "run"} for d in (a, b)]
    files = sorted(f for f in os.listdir(a) if f.endswith(".npz"))
    if layouts[0] != layouts[1] or files != sorted(f for f in os.listdir(b) if f.endswith(".npz")):
        return False
    for f in files:
        x, y = np.load(a / f), np.load(b / f)
        if sorted(x.files) != sorted(y.files) or not all(np.array_equal(x[k], y[k]) for k in x.files):
            return False
    return True


def copied(tmp_path, src=OK):
    dst = tmp_path / os.path.basename(src)
    shutil.copytree(src, dst)
    return dst


def edited(tmp_path, change):
    """A copy of the ok checkpoint whose dcp-metadata.json `change(description)` altered."""
    d = copied(tmp_path)
    path = d / from_dcp.DCP_JSON
    desc = json.loads(path.read_text())
    change(desc["tensors"])
    path.write_text(json.dumps(desc))
    return d


def refused(capsys, *argv):
    """The one line a refused conversion printed (exit 2)."""
    rc, err = convert(capsys, *argv)
    with capsys.disabled():                         # (shown with -s: the line a user would read)
        print(err)
    assert rc == 2 and len(err) == 1 and err[0].startswith("hsgd: error: ")
    return err[0]


# ------------------------------------------------------------------------------------------------ the fixtures

def test_committed_checkpoint_converts_and_passes(tmp_path, capsys):
    dump = tmp_path / "dump"
    rc, err = convert(capsys, OK, "--out", dump, "--metadata-json")
    assert rc == 0, err
    layout = json.loads((dump / "layout.json").read_text())
    wte = layout["tensors"]["tok_embeddings.weight"]["shards"]       # (Shard(0), Shard(1)): a 2-D box per rank
    assert sorted(s["rank"] for s in wte) == [0, 1, 2, 3]
    assert {tuple((c["axis"], c["offset"], c["length"]) for c in s["slices"]) for s in wte} == \
        {((0, 0, 19), (1, 0, 8)), ((0, 0, 19), (1, 8, 8)), ((0, 19, 18), (1, 0, 8)), ((0, 19, 18), (1, 8, 8))}
    assert layout["tensors"]["layers.0.ffn_norm.weight"]["shards"] == [{"rank": 3, "axis": None}]  # saved once
    assert layout["tensors"]["output.weight"]["shards"][1]["length"] == 18
    rc, rows = verdict(tmp_path, dump)
    worst = max(r["error"] for r in rows.values())
    print(f"{len(rows)} parameters, max relative error {worst:.1e}")
    assert rc == 0 and len(rows) == 12 and worst < 1e-6


def test_bug_checkpoint_fails_with_a_constant_factor(tmp_path, capsys):
    dump = tmp_path / "dump"
    rc, err = convert(capsys, BUG, "--out", dump, "--metadata-json", "--params", OK)
    assert rc == 0, err
    rc, rows = verdict(tmp_path, dump)
    wrong = {n: r["class"] for n, r in rows.items() if not r["ok"]}
    print(wrong, rows["h.0.mlp.proj.weight"]["error"])
    assert rc == 1 and wrong == {"h.0.mlp.proj.weight": "constant factor"}


def names_file(tmp_path, **changes):
    """A names file of torchtitan's llama3 names with "{i}" for the block number (wq and wk in rotary-pair order,
    as torchtitan stores them), its entries replaced by `changes` {FQN: entry}."""
    t = {"tok_embeddings.weight": ["wte"], "norm.weight": ["ln_f.weight"], "output.weight": ["lm_head.weight"],
         "layers.{i}.attention_norm.weight": ["h.{i}.ln1.weight"], "layers.{i}.ffn_norm.weight": ["h.{i}.ln2.weight"],
         **{f"layers.{{i}}.attention.{a}.weight": [f"h.{{i}}.attn.{b}.weight"] for a, b in
            (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "proj"))},
         **{f"layers.{{i}}.feed_forward.{a}.weight": [f"h.{{i}}.mlp.{b}.weight"] for a, b in
            (("w1", "gate"), ("w3", "up"), ("w2", "proj"))}}
    table = {k: {"parts": v, "transposed": "attention." in k or "forward" in k or k == "output.weight",
                 **({"rotary": "interleaved"} if ".wq." in k or ".wk." in k else {})} for k, v in t.items()}
    path = tmp_path / "names.json"
    path.write_text(json.dumps({**table, **changes}))
    return path


def test_names_file_with_block_numbers_reads_as_torchtitan(tmp_path, capsys):
    names = names_file(tmp_path)
    rc, err = convert(capsys, OK, "--out", tmp_path / "a", "--metadata-json", "--names", names)
    assert rc == 0, err
    rc, err = convert(capsys, OK, "--out", tmp_path / "b", "--metadata-json")
    assert rc == 0, err
    assert same_arrays(tmp_path / "a", tmp_path / "b")


def test_batch_and_loss_from_elsewhere(tmp_path, capsys):
    rc, err = convert(capsys, OK, "--out", tmp_path / "a", "--metadata-json")
    assert rc == 0, err
    b = np.load(tmp_path / "a" / "batch.npz")
    write_safetensors(tmp_path / "batch.safetensors", {"idx": b["idx"], "targets": b["targets"]})
    loss = json.loads((tmp_path / "a" / "layout.json").read_text())["loss"]
    rc, err = convert(capsys, OK, "--out", tmp_path / "b", "--metadata-json", "--batch",
                      tmp_path / "batch.safetensors", "--loss", repr(loss))
    assert rc == 0, err
    assert same_arrays(tmp_path / "a", tmp_path / "b")


# ------------------------------------------------------------------------------------------------ malformed

def test_no_metadata(tmp_path, capsys):
    d = copied(tmp_path)
    os.remove(d / ".metadata")
    assert ".metadata: no such file" in refused(capsys, d, "--out", tmp_path / "dump", "--trust-pickled-metadata")


def test_no_trust_flag_reads_nothing(tmp_path, capsys):
    line = refused(capsys, OK, "--out", tmp_path / "dump")
    assert "pickle" in line and "--trust-pickled-metadata" in line and "nothing was read" in line
    assert not (tmp_path / "dump").exists()


def test_metadata_over_the_bound(tmp_path, capsys):
    d = copied(tmp_path)
    os.truncate(d / ".metadata", dcp.MAX_METADATA + 1)                  # sparse: nothing written
    line = refused(capsys, d, "--out", tmp_path / "dump", "--trust-pickled-metadata")
    assert f"more than the {dcp.MAX_METADATA}" in line


def test_no_pytorch(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)                      # import torch raises ImportError
    assert "pip install torch" in refused(capsys, OK, "--out", tmp_path / "dump", "--trust-pickled-metadata")


def test_truncated_distcp(tmp_path, capsys):
    d = copied(tmp_path)
    os.truncate(d / "__3_0.distcp", os.path.getsize(d / "__3_0.distcp") // 2)
    assert "shorter than its declared chunks" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


def test_truncated_zip(tmp_path, capsys):
    def cut(t):
        t["grads.norm.weight"]["chunks"][0]["length"] -= 100             # the zip's central directory cut off
    d = edited(tmp_path, cut)
    assert "truncated or corrupt zip" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


def test_chunk_declaring_a_huge_shape(tmp_path, capsys):
    def huge(t):
        t["batch.idx"]["size"] = [10 ** 9, 8]
        t["batch.idx"]["chunks"][0]["sizes"] = [10 ** 9, 8]
    d = edited(tmp_path, huge)
    assert "its file holds for it" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


def test_chunk_outside_its_tensor(tmp_path, capsys):
    def outside(t):
        t["grads.norm.weight"]["chunks"][1]["offsets"] = [9]
    d = edited(tmp_path, outside)
    assert "runs outside the tensor" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


def test_overlapping_chunks(tmp_path, capsys):
    def overlap(t):
        t["grads.output.weight"]["chunks"][1]["offsets"] = [18, 0]        # rows 18..35 and 0..18: 37 rows in all
        t["grads.output.weight"]["chunks"][1]["sizes"] = [18, 16]
    d = edited(tmp_path, overlap)
    assert "overlaps another" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


def test_unknown_fqn(tmp_path, capsys):
    def rename(t):
        t["grads.final_norm.weight"] = t.pop("grads.norm.weight")
    d = edited(tmp_path, rename)
    line = refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    assert "final_norm.weight: no mapping in torchtitan's names" in line


def test_gradient_missing(tmp_path, capsys):
    def drop(t):
        del t["grads.norm.weight"]
    d = edited(tmp_path, drop)
    assert "no grads.norm.weight" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


class Runs:
    """An object whose pickle calls os.system: what a crafted chunk would hold."""

    def __reduce__(self):
        return os.system, ("echo pwned",)


def rezipped(raw, change):
    """A torch.save zip's bytes with change(name, bytes) -> bytes applied to each member (stored, as torch writes)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in z.infolist():
            w.writestr(info.filename, change(info.filename, z.read(info)))
    return out.getvalue()


def test_chunk_pickles_are_parsed_not_run(tmp_path):
    with open(os.path.join(OK, from_dcp.DCP_JSON)) as f:
        c = json.load(f)["tensors"]["grads.tok_embeddings.weight"]["chunks"][0]
    with open(os.path.join(OK, c["file"]), "rb") as f:
        f.seek(c["offset"])
        raw = f.read(c["length"])
    sizes = tuple(c["sizes"])
    a = dcp.torch_chunk(raw, "float32", sizes, "chunk")
    assert a.shape == sizes and a.dtype == np.float32 and np.isfinite(a).all()
    evil = rezipped(raw, lambda n, b: pickle.dumps(Runs(), protocol=2) if n.endswith("data.pkl") else b)
    with pytest.raises(DumpError, match="not a plain tensor's pickle"):
        dcp.torch_chunk(evil, "float32", sizes, "chunk")
    short = rezipped(raw, lambda n, b: b[:-4] if n.endswith("data/0") else b)
    with pytest.raises(DumpError, match="x 4 bytes"):
        dcp.torch_chunk(short, "float32", sizes, "chunk")
    with pytest.raises(DumpError, match="holds float32"):
        dcp.torch_chunk(raw, "float64", sizes, "chunk")
    with pytest.raises(DumpError, match="holds float32"):                  # another shape: refused before a view
        dcp.torch_chunk(raw, "float32", (10 ** 9, 8), "chunk")


# ------------------------------------------------------------------------------------------------ safetensors

def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"f64": rng.normal(size=(3, 4)), "f32": rng.normal(size=(5,)).astype(np.float32),
              "f16": rng.normal(size=(2, 2)).astype(np.float16), "i64": np.arange(6).reshape(2, 3),
              "i32": np.arange(4, dtype=np.int32), "empty": np.zeros((0, 3), np.float32)}
    write_safetensors(tmp_path / "a.safetensors", arrays, {"run": "x"})
    back = read_safetensors(tmp_path / "a.safetensors", "test file", DumpError)
    assert sorted(back) == sorted(arrays)
    worst = max(float(np.max(np.abs(back[k] - a), initial=0)) for k, a in arrays.items())
    print(f"max difference after a round trip: {worst}")
    assert worst == 0 and all(back[k].dtype == a.dtype for k, a in arrays.items())


def crafted(tmp_path, header, data=b"", length=None):
    """A safetensors file of this header (JSON) and data; length: the header length it declares."""
    text = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(int(len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize("header, data, length, words", [
    ({}, b"", 1 << 40, "declares a header of"),                                             # length past the file
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "data_offsets"),   # past it
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "12 bytes"),   # shape vs bytes
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0", None, "dtype"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8, None, "overlap"),
])
def test_safetensors_refuses_before_reading(tmp_path, header, data, length, words):
    with pytest.raises(DumpError) as e:
        read_safetensors(crafted(tmp_path, header, data, length), "test file", DumpError)
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_safetensors_bounds_shapes_and_bytes(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"a": np.zeros((4, 4))})
    with pytest.raises(DumpError, match=r"\[4, 3\] expected"):
        read_safetensors(tmp_path / "a.safetensors", "test file", DumpError, shapes={"a": (4, 3)})
    with pytest.raises(DumpError, match="more than the 100"):
        read_safetensors(tmp_path / "a.safetensors", "test file", DumpError, max_bytes=100)


def test_bfloat16_values_are_ml_dtypes(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(1).normal(size=(7, 5)).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "b.safetensors", {"x": x})
    got = read_safetensors(tmp_path / "b.safetensors", "test file", DumpError)["x"]
    print(f"max difference from ml_dtypes' bfloat16 -> float32: {np.max(np.abs(got - x.astype(np.float32)))}")
    assert got.dtype == np.float32 and np.array_equal(got, x.astype(np.float32))


# ------------------------------------------------------------------------------------------------ bounds

def test_stray_distcp_file_sets_no_rank_count(tmp_path, capsys):
    """A .distcp file of a rank beyond the run (hsgd.json's dp x tp, or without it the ranks the chunks are on) is
    refused before anything is written; the ranks of the dump are the run's, not the highest file name's."""
    d = copied(tmp_path)
    (d / "__3000_0.distcp").touch()                 # no chunk is in it, and hsgd.json's world is dp x tp = 4 ranks
    line = refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    assert "__3000_0.distcp" in line and "4 ranks" in line
    assert not (tmp_path / "dump").exists()
    meta = json.loads((d / "hsgd.json").read_text())
    del meta["parallel"]                            # no world given: the ranks the chunks are on
    (d / "hsgd.json").write_text(json.dumps(meta))
    assert "__3000_0.distcp" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    os.remove(d / "__3000_0.distcp")
    rc, err = convert(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    assert rc == 0, err
    assert sorted(f for f in os.listdir(tmp_path / "dump") if f.startswith("grads")) == \
        [f"grads-rank{r}.npz" for r in range(4)]


@pytest.mark.parametrize("parallel, words", [({"dp": 1, "tp": 2}, "rank 3"),       # a chunk beyond the world
                                             ({"dp": 2 ** 20, "tp": 2 ** 20}, "at most")])   # over MAX_RANKS
def test_world_of_hsgd_json_bounds_the_ranks(tmp_path, capsys, parallel, words):
    """hsgd.json's world must hold every chunk's rank and be one a job can have; else one line, nothing written."""
    d = copied(tmp_path)
    meta = json.loads((d / "hsgd.json").read_text())
    (d / "hsgd.json").write_text(json.dumps({**meta, "parallel": parallel}))
    assert words in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    assert not (tmp_path / "dump").exists()


@pytest.mark.parametrize("fused, words", [({"interleave": "groups", "groups": 0}, "groups"),
                                          ({"interleave": "head", "group": 0}, "group"),
                                          ({"axis": -1}, "axis")])
def test_names_file_fused_numbers_at_least_one(tmp_path, capsys, fused, words):
    """A names file's fused groups and group are >= 1 (groups 0 divided by zero), its axis >= 0: one line."""
    names = names_file(tmp_path, **{"layers.{i}.feed_forward.w1.weight": {
        "parts": ["h.{i}.mlp.gate.weight", "h.{i}.mlp.up.weight"], "transposed": True, "fused": fused},
        "layers.{i}.feed_forward.w3.weight": None})
    line = refused(capsys, OK, "--out", tmp_path / "dump", "--metadata-json", "--names", names)
    assert "fused" in line and words in line


@pytest.mark.parametrize("fqn, model", [("norm.weight", {}),                             # a norm
                                        ("layers.{i}.attention.wq.weight", {"positions": "learned"})])  # no rope
def test_names_file_rotary_only_on_q_and_k_of_rope(tmp_path, capsys, fqn, model):
    """"rotary": "interleaved" in a names file only on q or k of a rope model (the crosscheck refuses a dump with it
    elsewhere): refused by from_dcp, before a dump is written."""
    names = names_file(tmp_path, **{fqn: {"parts": [("h.{i}.attn.q.weight" if "wq" in fqn else "ln_f.weight")],
                                          "transposed": "wq" in fqn, "rotary": "interleaved"}})
    d = copied(tmp_path)
    meta = json.loads((d / "hsgd.json").read_text())
    (d / "hsgd.json").write_text(json.dumps({**meta, "model": {**meta["model"], **model}}))
    line = refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json", "--names", names)
    assert "rotary" in line and "interleaved" in line
    assert not (tmp_path / "dump").exists()


def test_not_a_description_says_its_form(tmp_path, capsys):
    """A dcp-metadata.json of another form is named with the form it must have (braces as written, not doubled)."""
    d = copied(tmp_path)
    (d / from_dcp.DCP_JSON).write_text(json.dumps({"format": "something else"}))
    line = refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")
    assert '"tensors": ...} (hsgd.crosscheck.dcp.describe)' in line and "}}" not in line


def compression_set(raw, member, method):
    """A zip's bytes with the compression method of `member` set to `method` in its local header and its central
    directory entry (the bytes as they are: what a crafted or damaged file says)."""
    out = bytearray(raw)
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        info = z.getinfo(member)
    out[info.header_offset + 8:info.header_offset + 10] = method.to_bytes(2, "little")
    at = out.find(b"PK\x01\x02")                      # each central directory entry
    while at >= 0:
        name_len = int.from_bytes(out[at + 28:at + 30], "little")
        if out[at + 46:at + 46 + name_len].decode() == member:
            out[at + 10:at + 12] = method.to_bytes(2, "little")
        at = out.find(b"PK\x01\x02", at + 46)
    return bytes(out)


def chunk_bytes(fqn="grads.tok_embeddings.weight"):
    """(bytes, sizes) of the ok checkpoint's first chunk of fqn: one torch.save zip."""
    with open(os.path.join(OK, from_dcp.DCP_JSON)) as f:
        c = json.load(f)["tensors"][fqn]["chunks"][0]
    with open(os.path.join(OK, c["file"]), "rb") as f:
        f.seek(c["offset"])
        return f.read(c["length"]), tuple(c["sizes"])


@pytest.mark.parametrize("method", [1, 8, 99])        # shrink, deflate, AES: data.pkl must be stored
def test_compressed_data_pkl_refused(method):
    """A chunk whose data.pkl says it is compressed (torch.save stores it) is one DumpError, whatever the method
    (zipfile has no shrink or AES: NotImplementedError; deflate over stored bytes: zlib.error)."""
    raw, sizes = chunk_bytes()
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
    with pytest.raises(DumpError) as e:
        dcp.torch_chunk(compression_set(raw, pkl, method), "float32", sizes, "chunk")
    print(e.value)
    assert "data.pkl" in str(e.value) and "stored" in str(e.value)


def safetensors_blob_edited(path, change):
    """Rewrite the safetensors blob that is the whole file `path` with change(header) applied (data unchanged)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.mark.parametrize("saved", [5, 2.5, "0, 0", [0, -1], [0, 0, 0]])
def test_sharding_info_offsets_a_list_of_counts(tmp_path, capsys, saved):
    """A safetensors blob's DCP_SHARDING_INFO saved_offsets must be the chunk's offsets, a list of integers >= 0."""
    d = copied(tmp_path, BUG)

    def change(header):
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        info["grads.tok_embeddings.weight"]["saved_offsets"] = saved
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    safetensors_blob_edited(d / "__0_0.distcp", change)
    line = refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json", "--params", OK)
    assert "DCP_SHARDING_INFO" in line


HUGE = [0, 2 ** 40, 2 ** 40]                          # no entries, so no bytes: only its dimensions are wrong


def test_safetensors_refuses_huge_dimensions(tmp_path):
    """A shape with no entries passes every byte count: its dimensions are bounded (each below 2^31, the non-zero
    ones' product at most 2^48) before numpy is asked to make it."""
    for shape in (HUGE, [2 ** 31, 0], [0, 2 ** 30, 2 ** 30, 2 ** 30]):
        with pytest.raises(DumpError) as e:
            read_safetensors(crafted(tmp_path, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}),
                             "test file", DumpError)
        print(e.value)
        assert "shape" in str(e.value) and "\n" not in str(e.value)


def test_dump_file_with_huge_dimensions_is_one_line(tmp_path, capsys):
    """The crosscheck of a sealed dump whose grads-rank1.safetensors holds such a shape ends with one line, exit 2."""
    from hsgd.crosscheck.manifest import MANIFEST, seal
    dump = tmp_path / "dump"
    rc, err = convert(capsys, OK, "--out", dump, "--metadata-json")
    assert rc == 0, err
    g = dict(np.load(dump / "grads-rank1.npz"))
    write_safetensors(dump / "grads-rank1.safetensors", g)
    safetensors_blob_edited(dump / "grads-rank1.safetensors", lambda h: h.update(
        x={"dtype": "F32", "shape": HUGE, "data_offsets": [0, 0]}))
    os.remove(dump / "grads-rank1.npz")
    man = json.loads((dump / MANIFEST).read_text())
    seal(str(dump), man["run"], man["ranks"])
    capsys.readouterr()
    rc = crosscheck([str(dump)])
    err = capsys.readouterr().err.splitlines()
    print(err)
    assert rc == 2 and len(err) == 1 and "grads-rank1.safetensors" in err[0]


def test_batch_with_huge_dimensions(tmp_path, capsys):
    """from_dcp --batch of such shapes, and a checkpoint's batch.idx of size [0, 2^62] with no chunks: one line."""
    path = crafted(tmp_path, {"idx": {"dtype": "I64", "shape": HUGE, "data_offsets": [0, 0]},
                              "targets": {"dtype": "I64", "shape": HUGE, "data_offsets": [0, 0]}})
    os.rename(path, tmp_path / "b.safetensors")
    assert "shape" in refused(capsys, OK, "--out", tmp_path / "dump", "--metadata-json", "--batch",
                              tmp_path / "b.safetensors")

    def empty(t):
        t["batch.idx"]["size"] = [0, 2 ** 62]
        t["batch.idx"]["chunks"] = []
    d = edited(tmp_path / "x", empty)
    assert "batch.idx" in refused(capsys, d, "--out", tmp_path / "dump", "--metadata-json")


# ------------------------------------------------------------------------------------------------ with PyTorch

def test_pytorch_reads_the_committed_metadata_as_its_json():
    pytest.importorskip("torch")
    with open(os.path.join(OK, from_dcp.DCP_JSON)) as f:
        assert dcp.read_metadata(OK) == json.load(f)


@pytest.mark.timeout(600)
def test_fresh_checkpoint_from_pytorch_passes(tmp_path, capsys):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "benchmarks/make_dcp_fixture.py", str(tmp_path / "ckpt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stdout[-500:], r.stderr[-2000:])
    assert r.returncode == 0
    rc, err = convert(capsys, tmp_path / "ckpt", "--out", tmp_path / "dump", "--trust-pickled-metadata",
                      "--save-metadata-json")
    assert rc == 0, err
    rc, err = convert(capsys, tmp_path / "ckpt", "--out", tmp_path / "again", "--metadata-json")   # its JSON copy
    assert rc == 0, err
    assert same_arrays(tmp_path / "dump", tmp_path / "again")
    rc, rows = verdict(tmp_path, tmp_path / "dump")
    worst = max(r["error"] for r in rows.values())
    print(f"fresh checkpoint: {len(rows)} parameters, max relative error {worst:.1e}")
    assert rc == 0 and worst < 1e-6
