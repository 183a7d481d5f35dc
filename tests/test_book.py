"""The course's website (tutorials/book.py, tutorials/cells.py), its parts that need no run: the parts list of the
lecture's page, a chapter split into cells, a run's output given back to its cells, chapter links made page links;
and cells.py running a small planted chapter (one process, no MPI: about 0.1 s)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))
import book    # noqa: E402
import cells   # noqa: E402

LECTURE = """# The lecture

## How to read the course

Prose first, with a list that is no part's:
- not an entry

### Part I: one process
- [Chapter 1: serial SGD](01_serial_sgd.py): the model (1 process)
- [Chapter 2: collectives](02_collectives.py): what each moves (4 ranks)

### Appendices
- [Appendix A: where the time goes](A_where_the_time_goes.py): FLOPs

## Where each section lives
- [Chapter 9: not a part's](09_x.py): after the section
"""

CHAPTER = """# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Chapter 9: a planted chapter
#
# See [chapter 1](01_serial_sgd.py) and `tutorials/02_collectives.py`.

# %%
x = 6
print("first", x * 7)

# %%
# a code cell with a comment first

print("second")

# %% [markdown]
# ## The end

# %%
raise ValueError("planted at line 25")
"""


def test_parse_parts():
    parts = book.parse_parts(LECTURE)
    assert [p.title for p in parts] == ["Part I: one process", "Appendices"]
    assert [(e.label, e.file) for e in parts[0].entries] == [("Chapter 1: serial SGD", "01_serial_sgd.py"),
                                                             ("Chapter 2: collectives", "02_collectives.py")]
    assert parts[0].entries[1].description == "what each moves (4 ranks)"
    assert [e.file for e in parts[1].entries] == ["A_where_the_time_goes.py"]      # not 09_x.py: another section
    with pytest.raises(ValueError, match="How to read the course"):
        book.parse_parts(LECTURE.replace("How to read", "How to skim"))
    with pytest.raises(ValueError, match="line 10"):
        book.parse_parts(LECTURE.replace("- [Chapter 2: collectives](02_collectives.py)", "- Chapter 2"))


def test_listing_errors():
    parts = book.parse_parts(LECTURE)
    files = ["01_serial_sgd.py", "02_collectives.py", "A_where_the_time_goes.py"]
    assert book.listing_errors(parts, files) == []
    errors = book.listing_errors(parts, ["01_serial_sgd.py", "03_new.py", "A_where_the_time_goes.py"])
    assert len(errors) == 2 and "03_new.py" in errors[0] and "02_collectives.py" in errors[1]


def test_split_cells():
    got = cells.split_cells(CHAPTER)
    assert [(c.kind, c.line) for c in got] == [("markdown", 8), ("code", 13), ("code", 17), ("markdown", 22),
                                                ("code", 25)]
    assert got[0].markdown().split("\n")[:2] == ["# Chapter 9: a planted chapter", ""]
    assert CHAPTER.split("\n")[got[2].line - 1] == "# a code cell with a comment first"
    assert got[2].source.endswith('print("second")')                  # trailing blank lines dropped
    lead = cells.split_cells("import os\n\n# %% [markdown]\n# text\n# %%\nx = 1\n")    # no jupytext header
    assert [(c.kind, c.line) for c in lead] == [("code", 1), ("markdown", 4), ("code", 6)]


def test_split_output():
    out = "@@cell 13@@\nfirst 42\n@@pictures 09_a.png 09_b.png@@\n@@cell 17@@\nsec@@cell 25@@\nlast\n"
    per = cells.split_output(out)
    assert per[13] == ("first 42\n", ["09_a.png", "09_b.png"])
    assert per[17] == ("sec", []) and per[25] == ("last\n", []) and per[0] == ("", [])
    assert cells.strip_markers(out) == "first 42\nseclast\n"


def test_chapter_links_become_page_links():
    md = book.markdown_renderer({"index.html", "01_serial_sgd.html", "02_collectives.html"})
    page = md.render(cells.split_cells(CHAPTER)[0].markdown())
    assert '<a href="01_serial_sgd.html">chapter 1</a>' in page
    assert '<a href="02_collectives.html"><code>tutorials/02_collectives.py</code></a>' in page
    assert '<h1 id="chapter-9-a-planted-chapter">' in page
    assert "09_x.html" not in md.render("[nine](09_x.py)")                       # no such page: left as it is
    assert 'href="index.html#part-i"' in md.render("[the list](00_the_lecture.md#part-i)")


def test_formulas_become_mathml_and_run_numbers_spans():
    md = book.markdown_renderer({"index.html"})
    page = md.render("a sum $2(p-1)/p \\cdot n$ and\n\n$$\\frac{L}{p}$$\n\nno `$HSGD_FIGURES` math")
    assert page.count("<math") == 2 and 'display="block"' in page and "<mfrac>" in page
    assert "<code>$HSGD_FIGURES</code>" in page                                   # code stays code
    marked = book.FROM_RUN.sub(r"[\1]", md.render("the step takes «18.7 s», the mark `«18.7 s»`"))
    assert "[18.7 s]" in marked and "<code>«18.7 s»</code>" in marked


def test_cells_runs_a_chapter_cell_by_cell(tmp_path):
    path = tmp_path / "09_planted.py"
    path.write_text(CHAPTER)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", "cells.py"), str(path)], capture_output=True,
                       text=True, env={**os.environ, "HSGD_FIGURES": str(tmp_path)}, timeout=60)
    assert r.returncode == 1                                                       # the planted error
    assert f'File "{path}", line 25' in r.stderr and "planted at line 25" in r.stderr
    per = cells.split_output(r.stdout)
    assert per[13][0] == "first 42\n" and per[17][0] == "second\n" and per[25][0] == ""


def test_a_kept_run_is_fresh_until_the_chapter_changes(tmp_path):
    path = tmp_path / "09_planted.py"
    path.write_text(CHAPTER)
    (tmp_path / "09_a.png").write_bytes(b"png")
    out = "@@cell 13@@\nfirst 42\n@@pictures 09_a.png@@\n"
    folder = cells.save_run(str(path), out, "", str(tmp_path), 1.0, runs=str(tmp_path / "runs"))
    assert cells.load_run(str(path), runs=str(tmp_path / "runs")) == (folder, out)
    assert os.path.exists(os.path.join(folder, "09_a.png"))
    assert open(os.path.join(folder, "chapter.py")).read() == CHAPTER              # what the book renders
    path.write_text(CHAPTER.replace("x * 7", "x * 8"))
    assert cells.load_run(str(path), runs=str(tmp_path / "runs")) is None          # another version: stale
