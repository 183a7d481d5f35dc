"""Every tutorial chapter runs to the end (and so passes its own check against serial), and opens as a notebook.

A chapter that needs several MPI ranks says so in a line `# mpirun -n N python tutorials/<file>`; it then runs
under mpiexec with that many ranks, inside an outer `timeout` so that nothing can hang the suite.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]_*.py")))
TIMEOUT_S = 240


def ranks_of(path):
    m = re.search(r"^# mpirun -n (\d+) python", open(path).read(), flags=re.M)
    return int(m.group(1)) if m else 1


def mpiexec():
    """mpiexec next to this Python first (the venv's mpich wheel), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def test_there_are_chapters():
    assert CHAPTERS, "no tutorials/NN_*.py found"


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_runs(path):
    n = ranks_of(path)
    cmd = [sys.executable, path]
    if n > 1:
        cmd = [mpiexec(), "-n", str(n)] + cmd
    r = subprocess.run(["timeout", "-k", "5", str(TIMEOUT_S)] + cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, MPLBACKEND="Agg"))
    print(r.stdout[-3000:])
    assert r.returncode == 0, f"{os.path.basename(path)} exited {r.returncode}:\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_is_a_notebook(path):
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(path)
    kinds = {cell.cell_type for cell in nb.cells}
    assert kinds == {"markdown", "code"}, kinds
