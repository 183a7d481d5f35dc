"""The course: every chapter runs to the end (and so passes its own checks against serial), writes the pictures it
names, opens as a notebook, ends with a cross-walk to the production frameworks and with exercises, and the
solutions of those exercises run and pass their own checks.

A chapter (tutorials/NN_*.py, an appendix tutorials/[A-Z]_*.py) or a solutions file (tutorials/solutions/<the
chapter's file name>) that needs several MPI ranks says so in a line `# mpirun -n N python <file>`; it then runs
under mpiexec with that many ranks, inside an outer `timeout` so that nothing can hang the suite. A chapter runs
through tutorials/cells.py, cell by cell, which marks where each code cell's output starts; a passing run is kept in
build/book/runs/<chapter>/ for the course's website (`make book`), which then only renders it.
A number in a chapter's prose that its run computes is marked «like this» (tutorials/WRITING.md); test_chapter_runs
checks that every marked text appears in the output of that same run (the chapter is not run again for it).
The reading order is the same in the parts list of tutorials/00_the_lecture.md, README.md's chapter table and the
chapter files on disk.
The shape of a chapter's ending, checked here without running it:

    # ## Cross-walk: ...        a markdown table, a header row naming Megatron-LM, DeepSpeed and PyTorch, >= 3 rows
    # ## Exercises
    # ### Exercise 1: ...       3 to 5 of them, numbered from 1
    tutorials/solutions/<chapter>.py defines exercise_1 .. exercise_k, one per exercise
"""
import glob
import os
import re
import subprocess
import sys
import time

import pytest

from .test_mpi import YIELD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(ROOT, "tutorials")
sys.path.insert(0, TUTORIALS)
import book    # noqa: E402  (tutorials/book.py: the parts list of the lecture's page)
import cells   # noqa: E402  (tutorials/cells.py: runs a chapter cell by cell and keeps the run)

CHAPTERS = (sorted(glob.glob(os.path.join(TUTORIALS, "[0-9][0-9]*_*.py")))
            + sorted(glob.glob(os.path.join(TUTORIALS, "[A-Z]_*.py"))))
SOLUTIONS = sorted(glob.glob(os.path.join(TUTORIALS, "solutions", "[0-9A-Z]*.py")))
LECTURE = os.path.join(TUTORIALS, "00_the_lecture.md")
README_ROW = re.compile(r"^\| `([0-9A-Z][0-9A-Za-z]*_[^`]*\.py)`", flags=re.M)
TIMEOUT_S = 240
COURSE_WORDS_MAX = 80_400       # the prose of the lecture's page and every chapter (test_course_word_count)
# pictures.save(fig, "name") and pictures.grid(dp, pp, tp, "name"): a picture's name is a literal in the call
# (in single or double quotes)
PICTURE = re.compile(r"""pictures\.(?:save|grid)\([^"'\n]*["']([A-Za-z0-9_]+)["']""")
# a run-computed number in a chapter's prose: «18.7 s», on one markdown (comment) line
MARK = re.compile(r"«([^«»\n]*)»")


ranks_of, mpiexec = cells.ranks_of, cells.mpiexec      # a chapter's ranks; the mpiexec that runs them

def pictures_of(path):
    return PICTURE.findall(open(path).read())


def marked_numbers(text):
    """The marked texts «...» of the comment lines (markdown cells) of a chapter, as (line number, text); a mark
    that is empty, left open or closed without being opened on its line is (line number, None)."""
    out = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.startswith("#"):
            continue
        found = MARK.findall(line)
        out += [(i, m.strip() or None) for m in found]
        rest = MARK.sub("", line)
        if "«" in rest or "»" in rest:
            out.append((i, None))
    return out


def unprinted(marked, output):
    """The (line, text) of `marked` that `output` does not print: the text verbatim, with no digit glued to it on
    either side (a marked 0.08 is not printed by 0.084, nor 5 GB by 2.5 GB); a malformed mark is never printed."""
    return [(i, m) for i, m in marked
            if m is None or not re.search(r"(?<![\d.])" + re.escape(m) + r"(?!\.?\d)", output)]


def run_script(path, figures, by_cells=False):
    """Run a chapter or a solutions file as its header says (with mpiexec when it needs several ranks); by_cells:
    through tutorials/cells.py, whose marker lines are then in r.stdout (cells.strip_markers removes them)."""
    r = subprocess.run(["timeout", "-k", "5", str(TIMEOUT_S)] + cells.command(path, by_cells), capture_output=True,
                       text=True, cwd=ROOT,
                       env={**YIELD, **os.environ, "MPLBACKEND": "Agg", "HSGD_FIGURES": str(figures)})
    print(r.stdout[-3000:])
    assert r.returncode == 0, f"{os.path.basename(path)} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r


def test_there_are_chapters():
    assert CHAPTERS, "no tutorials/NN_*.py found"


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_runs(path, tmp_path):
    source, t0 = open(path).read(), time.perf_counter()
    r = run_script(path, tmp_path, by_cells=True)
    seconds = time.perf_counter() - t0
    stale = unprinted(marked_numbers(open(path).read()), cells.strip_markers(r.stdout))
    assert not stale, (f"{os.path.basename(path)}: numbers marked «...» in the prose that the run did not print "
                       f"(line, text; None: a malformed mark): {stale}")
    written = {p.stem for p in tmp_path.glob("*.png") if p.stat().st_size > 0}
    missing = [name for name in pictures_of(path) if name not in written]
    print("pictures written:", sorted(written))
    assert not missing, f"{os.path.basename(path)} names pictures it did not write (or wrote empty): {missing}"
    cells.save_run(path, r.stdout, r.stderr, tmp_path, seconds, source)   # the book renders this run (make book)


def test_prose_numbers_checker_catches_a_mismatch():
    """The check of test_chapter_runs on a planted chapter and output: a marked number the output prints passes, one
    it does not (a stale prose number, one inside a longer number, a malformed mark) is reported by line."""
    text = ("# %% [markdown]\n# the step takes «18.7 s», «2.0 x» the other; errors up to «-8.2%»\n"
            "x = 1  # «9.9 s» on a code line is not prose\n")
    output = "step 18.7 s, 2.0 x the whole step at t = 8; largest error -8.2% (529.6 B)\n"
    assert marked_numbers(text) == [(2, "18.7 s"), (2, "2.0 x"), (2, "-8.2%")]
    assert unprinted(marked_numbers(text), output) == []
    assert unprinted(marked_numbers(text), output.replace("18.7 s", "18.8 s")) == [(2, "18.7 s")]   # planted
    assert unprinted(marked_numbers("# a ratio of «0.08», «5 GB»"), "0.084; 2.5 GB") == [(1, "0.08"), (1, "5 GB")]
    assert unprinted(marked_numbers("# «1.5 s of a step\n# «» and 3 »"), "1.5 s of a step") == [(1, None),
                                                                                                (2, None), (2, None)]


def test_the_course_draws_pictures():
    """At least 8 pictures, written by the chapters (each checked to exist by test_chapter_runs)."""
    names = [n for p in CHAPTERS for n in pictures_of(p)]
    print(f"{len(set(names))} pictures: {sorted(set(names))}")
    assert len(names) == len(set(names)), "two pictures share a name"
    assert len(set(names)) >= 8, f"only {len(set(names))} pictures in the course"


def section(text, heading):
    """The markdown lines of `# ## heading...` up to the next `# ## ` heading or code cell."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("# ## " + heading)]
    if not starts:
        return None
    out = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("# ## ") or line.startswith("# %%"):
            break
        out.append(line)
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_ends_with_crosswalk_and_exercises(path):
    text = open(path).read()
    name = os.path.basename(path)
    walk = section(text, "Cross-walk")
    assert walk is not None, f"{name}: no '# ## Cross-walk' section"
    rows = [line for line in walk if line.startswith("# |") and not set(line[2:]) <= set("|-: ")]
    assert rows and all(fw in rows[0] for fw in ("Megatron-LM", "DeepSpeed", "PyTorch")), \
        f"{name}: the cross-walk's header row must name Megatron-LM, DeepSpeed and PyTorch: {rows[:1]}"
    assert len(rows) - 1 >= 3, f"{name}: the cross-walk has {len(rows) - 1} rows; at least 3"
    exercises = re.findall(r"^# ### Exercise (\d+)", text, flags=re.M)
    assert section(text, "Exercises") is not None, f"{name}: no '# ## Exercises' section"
    assert 3 <= len(exercises) <= 5 and exercises == [str(i) for i in range(1, len(exercises) + 1)], \
        f"{name}: exercises numbered {exercises}; 3 to 5, numbered from 1"
    solutions = os.path.join(TUTORIALS, "solutions", name)
    assert os.path.exists(solutions), f"{name}: no tutorials/solutions/{name}"
    solved = re.findall(r"^def exercise_(\d+)\(", open(solutions).read(), flags=re.M)
    assert solved == exercises, f"solutions/{name} solves exercises {solved}; the chapter has {exercises}"


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_lines_fit(path):
    """120 characters a line, as the linter holds the rest of the code; only markdown table rows may be longer
    (the Makefile's lint lets the chapters' long lines through for their sake)."""
    long = [i for i, line in enumerate(open(path).read().split("\n"), 1)
            if len(line) > 120 and not line.startswith("# |")]
    assert not long, f"{os.path.basename(path)}: lines over 120 characters: {long}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=[os.path.basename(p) for p in SOLUTIONS])
def test_solutions_run(path, tmp_path):
    r = run_script(path, tmp_path)
    k = len(re.findall(r"^def exercise_(\d+)\(", open(path).read(), flags=re.M))
    assert f"exercises: all {k} solved" in r.stdout, "the solutions file did not report every exercise solved"


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p) for p in CHAPTERS])
def test_chapter_is_a_notebook(path):
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(path)
    kinds = {cell.cell_type for cell in nb.cells}
    assert kinds == {"markdown", "code"}, kinds


def reading_orders(lecture=LECTURE, readme=os.path.join(ROOT, "README.md"), folder=TUTORIALS):
    """The course's chapter files in three orders: the parts list of the lecture's page, README.md's chapter table
    and the files on disk (by name, the appendices last)."""
    listed = [e.file for part in book.parse_parts(open(lecture).read()) for e in part.entries]
    table = README_ROW.findall(open(readme).read())
    return listed, table, book.chapter_files(folder)


def order_errors(name, listed, files):
    """How `listed` (the chapters as `name` lists them) differs from the files on disk, in one sentence; None if not."""
    if listed == files:
        return None
    missing, extra = [f for f in files if f not in listed], [f for f in listed if f not in files]
    if missing or extra:
        return " and ".join([f"{name} leaves out {missing}"] * bool(missing)
                            + [f"{name} lists {extra}, which tutorials/ does not hold"] * bool(extra))
    i = next(i for i, (a, b) in enumerate(zip(listed, files)) if a != b)
    return f"{name} lists {listed[i]} where the file order has {files[i]} (position {i + 1})"


def test_reading_order_agrees():
    """00_the_lecture.md's parts, README.md's chapter table and tutorials/ name the same chapters in the same order."""
    listed, table, files = reading_orders()
    errors = [e for e in (order_errors("00_the_lecture.md's parts list", listed, files),
                          order_errors("README.md's chapter table", table, files)) if e]
    assert not errors, "; ".join(errors)


def test_reading_list_says_how_each_chapter_runs():
    """Each entry of the lecture's parts list ends with how its chapter runs, "(1 process)" or "(N ranks)", and that
    is what the chapter's header says (its mpirun line, or none)."""
    wrong = []
    for part in book.parse_parts(open(LECTURE).read()):
        for e in part.entries:
            m = re.search(r"\((1 process|(\d+) ranks)\)$", e.description)
            n = ranks_of(os.path.join(TUTORIALS, e.file))
            if not m or (int(m.group(2)) if m.group(2) else 1) != n:
                wrong.append(f"{e.file}: the list says {m.group(0) if m else 'nothing'}, the header {n}")
    assert not wrong, wrong


def prose_words(path):
    """The words of a chapter's prose: its markdown cells (the comment lines of `# %% [markdown]` cells, without
    the "#"); the whole file for a markdown file (.md)."""
    text = open(path).read()
    if path.endswith(".md"):
        return len(text.split())
    return sum(len(cell.markdown().split()) for cell in cells.split_cells(text) if cell.kind == "markdown")


def test_prose_words_counts_markdown_cells_only():
    text = "# ---\n# jupyter: x\n# ---\n\n# %% [markdown]\n# # Title here\n# two words\n\n# %%\nx = 1  # not prose\n"
    assert sum(len(c.markdown().split()) for c in cells.split_cells(text) if c.kind == "markdown") == 5
    assert prose_words(LECTURE) > 0


def test_course_word_count():
    """The course's prose, counted: every chapter has some, and the whole stays within COURSE_WORDS_MAX."""
    counts = {os.path.basename(p): prose_words(p) for p in [LECTURE] + CHAPTERS}
    for name, n in counts.items():
        print(f"{n:7,d}  {name}")
    print(f"{sum(counts.values()):7,d}  words of prose in the course ({len(counts)} files)")
    assert all(counts.values()), f"files without prose: {[k for k, n in counts.items() if not n]}"
    assert sum(counts.values()) <= COURSE_WORDS_MAX, \
        f"the course's prose is {sum(counts.values()):,d} words; its budget is {COURSE_WORDS_MAX:,d}"
