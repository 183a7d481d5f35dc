"""The crosscheck on a second real external system: benchmarks/crosscheck_fsdp2.py trains one step with PyTorch's
FSDP2 (fully_shard over "dp") and tensor parallelism (over "tp") of one 2-D DeviceMesh on the CPU with gloo, in
torchtitan's llama3 names, and saves it with torch.distributed.checkpoint; hsgd.crosscheck.from_dcp turns the
checkpoint into a dump. What the tests prove:
  * the llama block on dp 3 x tp 2 (6 processes) passes the crosscheck in float64, and so does its own --self-check
    against hsgd.model.serial;
  * GPT-2's block (LayerNorm with biases, learned positions, biases on the linears) on dp 3 x tp 2 passes;
  * each of the program's bugs fails with its class named on the parameters it breaks, and only there:
    no-divide "constant factor" (= dp), wrong-mesh-dim "unreduced" (one dp rank's rows), missing-norm-grad
    "missing"; and --crosscheck --expect CLASS, what `make bench` runs, exits 0 for a bug named so;
  * a bad flag (tp not dividing the kv heads) ends with exit 2 and one line, before any process starts.
Skipped where PyTorch is not installed (pip install -e .[bench]); each test starts at most 6 processes."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hsgd.crosscheck import from_dcp  # noqa: E402
from hsgd.crosscheck.__main__ import check  # noqa: E402
from hsgd.crosscheck.manifest import check_set  # noqa: E402
from hsgd.crosscheck.read import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join("benchmarks", "crosscheck_fsdp2.py")
LAYOUT = ["--dp", "3", "--tp", "2"]


def run_program(*flags, timeout=240):
    r = subprocess.run([sys.executable, PROGRAM, *flags], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stdout[-3000:], r.stderr[-3000:])
    return r


def fsdp2_check(tmp_path, *flags):
    """Run the program into tmp_path/dcp, convert, check: (ok, loss row, {parameter: row}, the program's stdout)."""
    r = run_program("--out", str(tmp_path / "dcp"), *LAYOUT, *flags)
    assert r.returncode == 0
    assert from_dcp.main([str(tmp_path / "dcp"), "--out", str(tmp_path / "dump"), "--trust-pickled-metadata"]) == 0
    check_set(str(tmp_path / "dump"))
    ok, loss_row, rows = check(load(str(tmp_path / "dump")))
    return ok, loss_row, {row["name"]: row for row in rows}, r.stdout


@pytest.mark.timeout(240)
def test_llama_on_dp_3_by_tp_2_passes(tmp_path):
    ok, loss_row, rows, out = fsdp2_check(tmp_path, "--self-check")
    worst = max(rows.values(), key=lambda row: row["error"])
    print(f"llama dp 3 x tp 2: loss error {loss_row['error']:.1e}, largest gradient error {worst['error']:.1e} "
          f"({worst['name']}), {len(rows)} parameters")
    assert ok, {n: (row["class"], row["detail"]) for n, row in rows.items() if not row["ok"]}
    assert {"h.0.attn.k.weight", "h.1.mlp.gate.weight", "lm_head.weight"} <= set(rows)   # the llama block's
    assert "0 of 21 over 1e-10" in out                                                    # --self-check's line


@pytest.mark.timeout(240)
def test_gpt2_on_dp_3_by_tp_2_passes(tmp_path):
    ok, loss_row, rows, _ = fsdp2_check(tmp_path, "--arch", "gpt2")
    worst = max(rows.values(), key=lambda row: row["error"])
    print(f"gpt2 dp 3 x tp 2: loss error {loss_row['error']:.1e}, largest gradient error {worst['error']:.1e} "
          f"({worst['name']}), {len(rows)} parameters")
    assert ok, {n: (row["class"], row["detail"]) for n, row in rows.items() if not row["ok"]}
    assert {"wpe", "h.0.mlp.fc.bias", "h.1.attn.proj.bias", "ln_f.bias"} <= set(rows)    # GPT-2's block's


NORMS = {"h.0.ln1.weight", "h.0.ln2.weight", "h.1.ln1.weight", "h.1.ln2.weight", "ln_f.weight"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bug, broken, expect", [
    ("no-divide", "all but the norms", ("constant factor", "= dp")),
    ("wrong-mesh-dim", NORMS, ("unreduced", "gradient of dp rank")),
    ("missing-norm-grad", {"ln_f.weight"}, ("missing", "never arrived")),
])
def test_each_bug_fails_with_its_class_where_it_breaks(tmp_path, bug, broken, expect):
    ok, _, rows, _ = fsdp2_check(tmp_path, "--bug", bug)
    if broken == "all but the norms":
        broken = set(rows) - NORMS
    print({n: (row["class"], row["detail"]) for n, row in rows.items() if not row["ok"]})
    assert not ok
    assert {n for n, row in rows.items() if not row["ok"]} == broken
    for n in broken:
        assert rows[n]["class"] == expect[0] and expect[1] in rows[n]["detail"], (n, rows[n])


@pytest.mark.timeout(240)
def test_crosscheck_flag_with_expect_passes_for_a_bug_named_so(tmp_path):
    r = run_program("--out", str(tmp_path / "dcp"), *LAYOUT, "--bug", "missing-norm-grad", "--crosscheck",
                    "--expect", "missing")
    assert r.returncode == 0
    assert "the crosscheck named 'missing'" in r.stdout
    assert "FAIL: 1 of 21 parameters over tolerance: missing (1)" in r.stdout


def test_tp_not_dividing_the_kv_heads_is_one_line_exit_2(tmp_path):
    r = run_program("--out", str(tmp_path / "dcp"), "--dp", "1", "--tp", "4", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--tp 4 does not divide n_kv_heads = 2" in lines[0]
    assert not os.path.exists(tmp_path / "dcp" / "hsgd.json")
