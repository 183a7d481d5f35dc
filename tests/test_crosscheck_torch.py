"""The crosscheck on a real external system: benchmarks/crosscheck_torch.py trains one step of the model with
PyTorch's own tensor parallelism (DTensor's ColwiseParallel and RowwiseParallel, loss_parallel) and data
parallelism (gloo, on the CPU) and writes the dump. hsgd.crosscheck passes it for tp in {1, 2, 4} x dp in {1, 2}
(and with micro-batches and a padded vocabulary); each of the program's bugs fails with its class named. Skipped
where PyTorch is not installed (pip install -e .[bench])."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hsgd.crosscheck.__main__ import check  # noqa: E402
from hsgd.crosscheck.manifest import check_set  # noqa: E402
from hsgd.crosscheck.read import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--d-model", "16", "--n-heads", "4", "--n-layers", "1", "--d-ff", "32", "--seq-len", "8", "--batch", "8"]


def torch_dump(path, *flags):
    r = subprocess.run([sys.executable, "benchmarks/crosscheck_torch.py", "--out", str(path), *SMALL, *flags],
                       capture_output=True, text=True, cwd=ROOT, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stdout[-1000:], r.stderr[-3000:])
    assert r.returncode == 0
    check_set(str(path))                        # dump.json written last, every file of this run
    ok, loss_row, rows = check(load(str(path)))
    return ok, loss_row, {r["name"]: r for r in rows}


@pytest.mark.timeout(600)
def test_pytorch_dtensor_passes_for_tp_1_2_4_and_dp_1_2(tmp_path):
    layouts = [(tp, dp, m, v) for tp in (1, 2, 4) for dp in (1, 2) for m, v in ((1, 256),)] + \
        [(2, 2, 2, 256), (4, 2, 1, 250)]
    for tp, dp, m, v in layouts:
        ok, loss_row, rows = torch_dump(tmp_path / f"{tp}-{dp}-{m}-{v}", "--tp", str(tp), "--dp", str(dp),
                                        "--micro-batches", str(m), "--vocab", str(v))
        worst = max(r["error"] for r in rows.values())
        print(f"tp {tp} dp {dp} m {m} V {v}: loss error {loss_row['error']:.1e}, largest gradient error {worst:.1e}")
        assert ok, (tp, dp, m, v, {n: r for n, r in rows.items() if not r["ok"]})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug, flags, where, expect", [
    ("no-microbatch-scale", ["--tp", "2", "--dp", "1", "--micro-batches", "4"], ["h.0.mlp.fc.weight", "wte"],
     ("constant factor", "= micro-batches:")),
    ("ln-not-reduced", ["--tp", "2", "--dp", "2"], ["h.0.ln1.weight", "ln_f.bias"],
     ("unreduced", "no replica holds the reference, each its own rows' gradient (ranks 0,1: the gradient of dp "
                   "rank 0's rows alone (sequences 0..3); ranks 2,3: the gradient of dp rank 1's rows alone")),
    ("vocab-padding", ["--tp", "4", "--dp", "1", "--vocab", "250"], ["lm_head.weight"],
     ("padding", "the padded entries carry gradient")),
])
def test_each_pytorch_bug_fails_with_its_class(tmp_path, bug, flags, where, expect):
    ok, loss_row, rows = torch_dump(tmp_path, *flags, "--bug", bug)
    print({n: (r["class"], r["detail"]) for n, r in rows.items() if not r["ok"]})
    assert not ok
    for n in where:
        assert rows[n]["class"] == expect[0] and expect[1] in rows[n]["detail"], (n, rows[n])
