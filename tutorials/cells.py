"""Run a chapter cell by cell, so that one run says what each code cell printed and drew.

    python tutorials/cells.py tutorials/01_serial_sgd.py
    mpirun -n 4 python tutorials/cells.py tutorials/02_collectives.py

The chapter runs as it would as a script: one namespace for all its cells, `__name__ == "__main__"`, `__file__` the
chapter's path, the chapter's folder first on sys.path; each cell is compiled with the chapter's file name and its
own line numbers, so a traceback points at the chapter's line. Rank 0 (MPICH sets PMI_RANK, Open MPI
OMPI_COMM_WORLD_RANK; neither: one process) prints a marker line before each code cell, `@@cell N@@` with N the
cell's first line in the chapter, and after it `@@pictures a.png b.png@@` when the cell wrote pictures into the
pictures folder ($HSGD_FIGURES, else tutorials/figures/). `split_output` turns such an output back into each cell's
text and pictures; `strip_markers` removes the markers (what the chapter alone printed).

A run of a chapter is kept in a cache (build/book/runs/<chapter stem>/: its output, its pictures and the key of what
it ran), written by tests/test_tutorials.py after a passing run and by the book (tutorials/book.py) when no fresh
one is there. The key is a hash of the chapter, of this file and of checks.py and pictures.py: a run of another
version of any of them is stale. Changes to hsgd itself do not make a run stale (`make test` runs every chapter).

This is not a chapter: it holds how the chapters are run.
"""
import builtins
import hashlib
import json
import os
import re
import shutil
import sys
import time
import traceback
import types
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = os.path.join(ROOT, "build", "book", "runs")
CELL = "# %%"
MARKER = re.compile(r"@@(cell|pictures) ?([^@\n]*)@@\n?")
HEADER = re.compile(r"^# mpirun -n (\d+) python", flags=re.M)


@dataclass
class Cell:
    kind: str                   # "code" or "markdown"
    line: int                   # the line of the chapter that holds the cell's first line of source (1-based)
    lines: list                 # the cell's source lines, as in the file (markdown still behind "# ")

    @property
    def source(self):
        return "\n".join(self.lines)

    def markdown(self):
        """A markdown cell's text: each comment line without its "# " (or "#")."""
        return "\n".join(ln[2:] if ln.startswith("# ") else ln[1:] if ln.startswith("#") else ln
                         for ln in self.lines)


def split_cells(text):
    """The cells of a jupytext percent-format chapter, in order. The jupytext header (the commented block between
    two `# ---` lines at the top) is no cell; lines between it and the first `# %%` are a cell of their own (code
    if any line is not a comment); a cell's trailing blank lines are dropped, and so is a cell left empty."""
    lines = text.split("\n")
    cells, kind, start, body = [], "lead", 1, []

    def close():
        while body and not body[-1].strip():
            body.pop()
        if kind == "lead" and body:             # before the first cell: code, or comments (markdown) only
            cells.append(Cell("code" if any(not ln.startswith("#") for ln in body if ln.strip()) else "markdown",
                              start, list(body)))
        elif body:
            cells.append(Cell(kind, start, list(body)))

    header = lines[0].rstrip() == "# ---" and "# ---" in [ln.rstrip() for ln in lines[1:]]
    skip = [ln.rstrip() for ln in lines[1:]].index("# ---") + 2 if header else 0    # the jupytext header's lines

    for i, line in enumerate(lines, 1):
        if i <= skip:
            start = i + 1
            continue
        if line.startswith(CELL):
            close()
            kind = "markdown" if "[markdown]" in line else "code"
            start, body = i + 1, []
        else:
            if not body and not line.strip():
                start = i + 1                   # leading blank lines: the cell starts at its first text
                continue
            body.append(line)
    close()
    return cells


def split_output(out):
    """{cell line: (text, [picture file names])} of a cells.py run's output; text printed before the first marker
    (nothing, normally) is under line 0."""
    result, line, pos = {0: ["", []]}, 0, 0
    for m in MARKER.finditer(out):
        result[line][0] += out[pos:m.start()]
        pos = m.end()
        if m.group(1) == "cell":
            line = int(m.group(2))
            result.setdefault(line, ["", []])
        else:
            result[line][1] += m.group(2).split()
    result[line][0] += out[pos:]
    return {k: (text, pics) for k, (text, pics) in result.items()}


def strip_markers(out):
    """The output without the marker lines: what the chapter itself printed."""
    return MARKER.sub("", out)


def ranks_of(path):
    """N of the chapter's `# mpirun -n N python ...` line; 1 without one."""
    m = HEADER.search(open(path).read())
    return int(m.group(1)) if m else 1


def mpiexec():
    """mpiexec next to this Python first (the venv's mpich wheel), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def command(path, by_cells=True):
    """The command that runs a chapter (or a solutions file) as its header says: through this file when by_cells,
    under mpiexec with its N ranks when it names more than one."""
    cmd = [sys.executable] + ([os.path.join(HERE, "cells.py")] if by_cells else []) + [path]
    n = ranks_of(path)
    return [mpiexec(), "-n", str(n)] + cmd if n > 1 else cmd


def key(path, source=None):
    """The hash of what a run of the chapter depends on in the course (see the module's docstring); source: the
    chapter's text as it was run (default: as it is now)."""
    h = hashlib.sha256((open(path).read() if source is None else source).encode())
    for p in (__file__, os.path.join(HERE, "checks.py"), os.path.join(HERE, "pictures.py")):
        h.update(open(p, "rb").read())
    return h.hexdigest()[:16]


def save_run(path, stdout, stderr, figures, seconds, source=None, runs=RUNS):
    """Keep a passing run of the chapter `path` in runs/<stem>/ (output.txt, stderr.txt, run.json, chapter.py: the
    chapter as it was run, `source`, default as it is now; and the PNGs named by its markers, copied from
    `figures`), replacing any earlier one whole. The book renders chapter.py, whose lines the output's markers
    name, even when the chapter has changed since."""
    source = open(path).read() if source is None else source
    stem = os.path.splitext(os.path.basename(path))[0]
    final = os.path.join(runs, stem)
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    names = [n for _, (_, pics) in sorted(split_output(stdout).items()) for n in pics]
    for name in names:
        shutil.copy2(os.path.join(figures, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "output.txt"), "w") as f:
        f.write(stdout)
    with open(os.path.join(tmp, "stderr.txt"), "w") as f:
        f.write(stderr)
    with open(os.path.join(tmp, "chapter.py"), "w") as f:
        f.write(source)
    with open(os.path.join(tmp, "run.json"), "w") as f:
        json.dump({"key": key(path, source), "ranks": ranks_of(path), "seconds": round(seconds, 1),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "pictures": names}, f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:                             # another run of the chapter kept its own at the same moment
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_run(path, runs=RUNS):
    """(folder, output) of the kept run of the chapter when it is fresh (its key matches), else None. The
    chapter's text as it ran is folder/chapter.py."""
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(runs, stem)
    try:
        meta = json.load(open(os.path.join(folder, "run.json")))
        out = open(os.path.join(folder, "output.txt")).read()
    except (OSError, ValueError):
        return None
    kept = [os.path.join(folder, n) for n in meta.get("pictures", []) + ["chapter.py"]]
    if meta.get("key") != key(path) or not all(os.path.exists(p) for p in kept):
        return None
    return folder, out


def rank():
    return int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


def pictures_now(folder):
    """{file name: (mtime, size)} of the PNGs in folder."""
    try:
        return {e.name: (e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(folder)
                if e.name.endswith(".png")}
    except OSError:
        return {}


def run(path):
    """Run the chapter at `path` cell by cell (see the module's docstring); returns the exit status."""
    path = os.path.abspath(path)
    folder = os.environ.get("HSGD_FIGURES") or os.path.join(HERE, "figures")
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main              # pickle and dataclasses find the chapter's classes in __main__
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    talk = rank() == 0
    for cell in split_cells(open(path).read()):
        if cell.kind != "code":
            continue
        if talk:
            before = pictures_now(folder)
            sys.stdout.flush()
            print(f"@@cell {cell.line}@@", flush=True)
        code = compile("\n" * (cell.line - 1) + cell.source + "\n", path, "exec")
        try:
            exec(code, main.__dict__)
        except SystemExit:
            raise
        except BaseException:
            kind, value, tb = sys.exc_info()
            sys.stdout.flush()
            traceback.print_exception(kind, value, tb.tb_next)     # from the chapter's frame on, as Python would
            sys.stderr.flush()
            return 1
        finally:
            sys.stdout.flush()
        if talk:
            after = pictures_now(folder)
            new = sorted(n for n, st in after.items() if before.get(n) != st)
            if new:
                print(f"@@pictures {' '.join(new)}@@", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: [mpirun -n N] python tutorials/cells.py tutorials/NN_chapter.py")
    sys.exit(run(sys.argv[1]))
