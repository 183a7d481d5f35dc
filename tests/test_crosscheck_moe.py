"""hsgd.crosscheck on dumps of a model with experts written here, in one process: four ranks of dp 4 with the experts
split over ep 2 (expert e on the ranks of ep rank e // (E/ep)), the gradients serial's counted as that layout counts
(tests/mpi/test_moe.py's recipe: its micro-batches as the balance domain, each rank's rows routed together with their
own capacity). Such a dump passes; the same gradients said to be of two micro-batches per rank fail (the counting is
part of the reference); selection biases given in layout.json enter the reference; a layout that cannot hold or count
the experts is refused in one line."""
import json

import numpy as np
import pytest

from hsgd.crosscheck.__main__ import check, main
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck.manifest import new_run, write_manifest
from hsgd.crosscheck.read import load
from hsgd.crosscheck.write import shard_entry, write_layout, write_rank
from hsgd.ep.layout import capacity_groups, holds
from hsgd.model import serial
from hsgd.model.config import ModelConfig
from hsgd.model.moe_pass import serial_pass

CFG = ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=8, arch="llama", moe_experts=4,
                  moe_every=2, moe_capacity_factor=1.0, moe_balance=0.1, moe_z_loss=0.01, moe_bias_rate=0.05)
B, T, E = 8, CFG.seq_len, CFG.moe_experts


def write_moe_dump(path, dp=4, m=1, ep=2, said=None, biases=None, written_biases=None):
    """A dump of dp ranks, expert e on those of ep rank e // (E/ep) (rank r is ep rank r mod ep), the gradients of
    serial counted as dp ranks of m micro-batches count (with the selection biases `biases`); said: the parallel
    sizes layout.json gives (default the true ones); written_biases: its selection_bias (default `biases`)."""
    params = serial.init_params(CFG, seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, CFG.vocab_size, (B, T)), rng.integers(0, CFG.vocab_size, (B, T))
    moe = serial_pass(CFG, B, T, np, B // (dp * m), capacity_groups(B, T, dp, m, 1), biases)
    loss, grads = serial.loss_and_grads(params, idx, targets, CFG, moe=moe)
    tensors = {n: {"shape": list(s), "dtype": "float64", "shards": []} for n, s in CFG.param_shapes().items()}
    run, files = new_run(), {}
    for r in range(dp):
        mine = {n: g for n, g in grads.items() if holds(n, CFG, ep, r % ep)}
        for n in mine:
            tensors[n]["shards"].append(shard_entry(r))
        files.update(write_rank(path, r, mine, run))
    files.update(write_layout(path, system="test", cfg=CFG, dtype="float64", loss=loss, ranks=dp,
                              parallel=said or {"dp": dp, "micro_batches": m, "ep": ep}, tensors=tensors,
                              params=params, idx=idx, targets=targets, run=run,
                              selection_bias=biases if written_biases is None else written_biases))
    write_manifest(path, run, dp, files)


def verdict(path):
    ok, loss_row, rows = check(load(str(path)))
    worst = max(r["error"] for r in rows)
    print(f"{path.name}: loss err {loss_row['error']:.1e}, largest gradient error {worst:.1e}")
    return ok, {r["name"]: r for r in rows}


def test_experts_split_over_ep_ranks_pass(tmp_path, capsys):
    write_moe_dump(tmp_path)
    layout = json.load(open(tmp_path / "layout.json"))
    assert [s["rank"] for s in layout["tensors"]["h.0.moe.experts.3.up.weight"]["shards"]] == [1, 3]
    assert layout["model"]["moe_capacity_factor"] == 1.0 and layout["parallel"]["ep"] == 2
    code = main([str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert code == 0 and "PASS" in out and "(experts over ep 2)" in out


def test_the_reference_counts_as_the_layout_counts(tmp_path):
    """The gradients of dp 4 x 1 micro-batch, said to be of dp 4 x 2 micro-batches: each micro-batch one sequence
    instead of two, the balance domain and the rows routed together are other ones, the reference another."""
    (tmp_path / "true").mkdir()
    (tmp_path / "said").mkdir()
    write_moe_dump(tmp_path / "true")
    write_moe_dump(tmp_path / "said", said={"dp": 4, "micro_batches": 2, "ep": 2})
    assert verdict(tmp_path / "true")[0]
    ok, rows = verdict(tmp_path / "said")
    assert not ok and not rows["h.0.moe.router.weight"]["ok"]


def test_selection_biases_in_layout_json_enter_the_reference(tmp_path):
    biases = {"h.0.moe": np.random.default_rng(3).normal(0, 0.5, E)}
    (tmp_path / "given").mkdir()
    (tmp_path / "left-out").mkdir()
    write_moe_dump(tmp_path / "given", biases=biases)
    write_moe_dump(tmp_path / "left-out", biases=biases, written_biases={})
    assert verdict(tmp_path / "given")[0]
    assert not verdict(tmp_path / "left-out")[0]


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["parallel"].update(ep=3), "parallel.ep = 3 must divide moe_experts = 4 and dp x cp = 4"),
    (lambda m: m["parallel"].update(micro_batches=3), "B must split into dp x micro_batches = 12 micro-batches"),
    (lambda m: m.update(selection_bias={"h.0.moe": [0.0, 1.0]}), "a list of moe_experts = 4 finite numbers"),
    (lambda m: m.update(selection_bias={"h.1.moe": [0.0] * 4}), "selection_bias must map MoE blocks (h.0.moe"),
    (lambda m: m["model"].update(moe_top_k=5), "moe_top_k=5 is above moe_experts=4"),
], ids=["ep", "micro-batches", "bias-length", "bias-block", "top-k"])
def test_a_layout_that_cannot_hold_or_count_the_experts_is_refused(tmp_path, edit, words):
    write_moe_dump(tmp_path)
    meta = json.load(open(tmp_path / "layout.json"))
    edit(meta)
    json.dump(meta, open(tmp_path / "layout.json", "w"))
    with pytest.raises(DumpError) as e:
        load(str(tmp_path))
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)
