"""The course as a website: `make book` (python tutorials/book.py) writes build/book/.

    index.html          the lecture, section by section (tutorials/00_the_lecture.md)
    <chapter stem>.html  one page per chapter and appendix: its markdown, its code, and under each code cell what
                        that cell printed and the pictures it drew, from a real run of the chapter
    style.css, img/     the pages' style and pictures (no network: nothing is loaded from anywhere else)
    runs/<stem>/        the kept runs (tutorials/cells.py), written by tests/test_tutorials.py after a passing run

Every page has the course's navigation, by part, as 00_the_lecture.md lists it in its section "How to read the
course" (`### Part I: title` headings, then one `- [Chapter 1: title](01_file.py): description` line a chapter):
the build stops if a chapter on disk is not listed there or a listed one is not on disk. A chapter without a fresh
kept run (none, or one of another version of the chapter: cells.key) is run first, with as many ranks as its
`# mpirun -n N` line says, one progress line each. Links to a chapter's file in the markdown (`(13_memory.py)`, or
a code span that names it, `tutorials/13_memory.py`) lead to its page.

This is not a chapter: it builds the course's pages.
"""
import argparse
import glob
import html
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import cells

HERE = cells.HERE
ROOT = cells.ROOT
TIMEOUT_S = 600
HOW_TO_READ = "## How to read the course"
ENTRY = re.compile(r"^- \[([^\]]+)\]\(([^)\s]+)\)\s*:?\s*(.*)$")
CHAPTER_FILE = re.compile(r"^(?:\.\./)?(?:tutorials/)?([0-9][0-9][0-9a-z]*_\w+|[A-Z]_\w+)\.py(#[\w.-]*)?$")
RUN_LINE = re.compile(r"^(mpirun -n \d+ python \S+)$", flags=re.M)      # the header's run line: shown as code
LECTURE_FILE = re.compile(r"^(?:\.\./)?(?:tutorials/)?00_the_lecture\.md(#[\w.-]*)?$")


@dataclass
class Entry:
    label: str          # "Chapter 1: serial SGD"
    file: str           # "01_serial_sgd.py"
    description: str


@dataclass
class Part:
    title: str          # "Part I: one process, the collectives, the grid", or "Appendices"
    entries: list = field(default_factory=list)


def chapter_files(folder=HERE):
    """The chapters on disk, in reading order: NN_*.py by name, then the appendices [A-Z]_*.py by name."""
    return ([os.path.basename(p) for p in sorted(glob.glob(os.path.join(folder, "[0-9][0-9]*_*.py")))]
            + [os.path.basename(p) for p in sorted(glob.glob(os.path.join(folder, "[A-Z]_*.py")))])


def parse_parts(text):
    """The parts of the course as the lecture's page lists them (see the module's docstring). Raises ValueError
    when the section, a part or an entry is missing, or a list line is not an entry."""
    lines = text.split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HOW_TO_READ)
    except StopIteration:
        raise ValueError(f"no section '{HOW_TO_READ}'") from None
    parts = []
    for i, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## ") or line.startswith("# "):
            break
        if line.startswith("### "):
            parts.append(Part(line[4:].strip()))
        elif line.startswith("- ") and parts:
            m = ENTRY.match(line)
            if not m:
                raise ValueError(f"line {i}: a list line of a part that is no '- [label](file.py): ...': {line}")
            parts[-1].entries.append(Entry(m.group(1).strip(), m.group(2), m.group(3).strip()))
    if not parts:
        raise ValueError(f"section '{HOW_TO_READ}' lists no parts ('### Part I: title' headings)")
    empty = [p.title for p in parts if not p.entries]
    if empty:
        raise ValueError(f"parts without chapters: {empty}")
    return parts


def listing_errors(parts, files):
    """What disagrees between the parts' entries and the chapter files on disk, as sentences ([] when nothing)."""
    listed = [e.file for p in parts for e in p.entries]
    errors = []
    unlisted = [f for f in files if f not in listed]
    missing = [f for f in listed if f not in files]
    twice = sorted({f for f in listed if listed.count(f) > 1})
    if unlisted:
        errors.append(f"chapters not listed in '{HOW_TO_READ}': {unlisted}")
    if missing:
        errors.append(f"listed in '{HOW_TO_READ}' but not in tutorials/: {missing}")
    if twice:
        errors.append(f"listed twice: {twice}")
    return errors


def title_of(path):
    """The chapter's title: its first markdown heading `# # ...`."""
    for cell in cells.split_cells(open(path).read()):
        if cell.kind == "markdown":
            for line in cell.markdown().split("\n"):
                if line.startswith("# "):
                    return line[2:].strip()
    return os.path.basename(path)


def page_of(file):
    return "index.html" if file.endswith(".md") else os.path.splitext(file)[0] + ".html"


# ---- markdown

def slug(text, used):
    s = re.sub(r"[^\w\s-]", "", text.lower()).strip()
    s = re.sub(r"[\s_]+", "-", s) or "section"
    out, k = s, 2
    while out in used:
        out, k = f"{s}-{k}", k + 1
    used.add(out)
    return out


def site_href(target, pages):
    """The site's address for a link's target when it names a chapter file or the lecture's page, else None."""
    m = CHAPTER_FILE.match(target)
    if m and m.group(1) + ".html" in pages:
        return m.group(1) + ".html" + (m.group(2) or "")
    m = LECTURE_FILE.match(target)
    if m:
        return "index.html" + (m.group(1) or "")
    return None


def mathml(latex, display="inline"):
    """$...$ and $$...$$ as MathML, which the browser lays out itself (no script, nothing fetched); LaTeX that
    latex2mathml cannot read stays as its source, in a <code class="math"> element."""
    from latex2mathml.converter import convert
    try:
        return convert(latex, display=display)
    except Exception:       # noqa: BLE001  (any parse failure of the converter: show the source instead)
        return f'<code class="math">{html.escape(latex)}</code>'


def markdown_renderer(pages):
    """A markdown-it renderer: commonmark with tables, no raw HTML, ids on headings, chapter links to pages."""
    from markdown_it import MarkdownIt
    from mdit_py_plugins.dollarmath import dollarmath_plugin
    md = MarkdownIt("commonmark", {"html": False}).enable("table").use(dollarmath_plugin, double_inline=True)
    md.used_ids = set()

    def heading_open(renderer, tokens, idx, options, env):
        token = tokens[idx]
        token.attrSet("id", slug(tokens[idx + 1].content, md.used_ids))
        return md.renderer.renderToken(tokens, idx, options, env)

    def link_open(renderer, tokens, idx, options, env):
        token = tokens[idx]
        href = site_href(token.attrGet("href") or "", pages)
        if href:
            token.attrSet("href", href)
        return md.renderer.renderToken(tokens, idx, options, env)

    def code_inline(renderer, tokens, idx, options, env):
        code = f"<code>{html.escape(tokens[idx].content)}</code>"
        inside_link = sum((t.type == "link_open") - (t.type == "link_close") for t in tokens[:idx]) > 0
        href = None if inside_link else site_href(tokens[idx].content, pages)
        return f'<a href="{href}">{code}</a>' if href else code

    def math(display):
        def render(renderer, tokens, idx, options, env):
            return mathml(tokens[idx].content, display)
        return render

    md.add_render_rule("math_inline", math("inline"))
    md.add_render_rule("math_block", math("block"))
    md.add_render_rule("heading_open", heading_open)
    md.add_render_rule("link_open", link_open)
    md.add_render_rule("code_inline", code_inline)
    return md


# ---- pages

CSS = """
body { margin: 0; font: 16px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1b1b1b; }
nav.side { position: fixed; top: 0; left: 0; bottom: 0; width: 17rem; overflow-y: auto; padding: 1rem;
  background: #f5f6f8; border-right: 1px solid #dde; font-size: 14px; box-sizing: border-box; }
nav.side h2 { font-size: 13px; text-transform: uppercase; color: #556; margin: 1.2em 0 .3em; }
nav.side ol { list-style: none; margin: 0; padding: 0; }
nav.side li { margin: .15em 0; }
nav.side a { color: #1f4f8f; text-decoration: none; }
nav.side a.here { font-weight: bold; color: #000; }
main { margin-left: 17rem; padding: 1rem 2.5rem 4rem; max-width: 62rem; }
nav.steps { display: flex; justify-content: space-between; font-size: 14px; margin: .5rem 0; }
nav.steps a { color: #1f4f8f; }
pre { overflow-x: auto; padding: .6em .8em; border-radius: 4px; font-size: 13px; line-height: 1.35; }
div.highlight pre { background: #f8f8f8; border: 1px solid #e3e3e3; }
pre.output { background: #fffdf4; border: 1px solid #eadfb6; border-left: 4px solid #d9c27a; margin-top: -.3em; }
div.cell { margin: 1em 0; }
div.cell .label { font-size: 11px; color: #889; margin-bottom: .1em; }
figure { margin: .5em 0 1em; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 12px; color: #667; }
table { border-collapse: collapse; font-size: 14px; margin: 1em 0; display: block; overflow-x: auto; }
th, td { border: 1px solid #d6d6d6; padding: .25em .5em; vertical-align: top; }
th { background: #f0f1f4; }
code { font-size: 90%; background: #f2f2f2; padding: 0 .2em; border-radius: 3px; }
pre code { background: none; padding: 0; }
p.run { font-size: 13px; color: #556; }
span.run { background: #eef6ee; border-bottom: 1px dotted #4a8a4a; padding: 0 .1em; }
"""


def nav_html(parts, titles, here):
    first = ' class="here"' if here == "index.html" else ""
    out = ['<nav class="side">', f'<a href="index.html"{first}>The lecture, section by section</a>']
    for part in parts:
        out.append(f"<h2>{html.escape(part.title)}</h2><ol>")
        for e in part.entries:
            page = page_of(e.file)
            cls = ' class="here"' if page == here else ""
            out.append(f'<li><a href="{page}"{cls} title="{html.escape(e.description, quote=True)}">'
                       f"{html.escape(e.label)}</a></li>")
        out.append("</ol>")
    out.append("</nav>")
    return "\n".join(out)


def steps_html(order, titles, here):
    i = order.index(here)
    prev = (f'<a rel="prev" href="{order[i - 1]}">&larr; {html.escape(titles[order[i - 1]])}</a>' if i
            else "<span></span>")
    nxt = (f'<a rel="next" href="{order[i + 1]}">{html.escape(titles[order[i + 1]])} &rarr;</a>'
           if i + 1 < len(order) else "<span></span>")
    return f'<nav class="steps">{prev}{nxt}</nav>'


def page_html(title, body, nav, steps):
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)} - hsgd</title>\n"
            f'<link rel="stylesheet" href="style.css"></head>\n<body>\n{nav}\n<main>\n{steps}\n{body}\n{steps}\n'
            f"</main>\n</body></html>\n")


def highlight(source):
    try:
        from pygments import highlight as pyg
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
        return pyg(source, PythonLexer(), HtmlFormatter())
    except ImportError:
        return f'<div class="highlight"><pre>{html.escape(source)}</pre></div>'


# a number the prose quotes from the chapter's run, «like this» (tutorials/WRITING.md), shown marked but without the
# guillemets (not inside code, where a «...» is the mark's own example)
FROM_RUN = re.compile(r"«([^«»<]*)»(?![^<]*</code>)")


def chapter_body(path, out, run_folder, img_dir, md):
    """The chapter's cells as HTML: markdown rendered, code highlighted, and under each code cell its output and
    pictures (copied into img_dir). The cells are those of the chapter as it ran (run_folder/chapter.py)."""
    per_cell = cells.split_output(out)
    body = []
    before = per_cell.get(0, ("", []))[0].strip()
    if before:
        body.append(f'<pre class="output">{html.escape(before)}</pre>')
    name = os.path.basename(path)
    for cell in cells.split_cells(open(os.path.join(run_folder, "chapter.py")).read()):
        if cell.kind == "markdown":
            body.append(FROM_RUN.sub(r'<span class="run" title="printed by this chapter\'s run">\1</span>',
                                     md.render(RUN_LINE.sub(r"```\n\1\n```", cell.markdown()))))
            continue
        body.append(f'<div class="cell" id="line-{cell.line}"><div class="label">{html.escape(name)}, line '
                    f"{cell.line}</div>{highlight(cell.source)}")
        text, pics = per_cell.get(cell.line, ("", []))
        text = strip_trailing(text)
        if text:
            body.append(f'<pre class="output">{html.escape(text)}</pre>')
        for pic in pics:
            shutil.copy2(os.path.join(run_folder, pic), os.path.join(img_dir, pic))
            body.append(f'<figure><img src="img/{html.escape(pic)}" alt="{html.escape(pic)}">'
                        f"<figcaption>{html.escape(pic)}</figcaption></figure>")
        body.append("</div>")
    return "\n".join(body)


def strip_trailing(text):
    return "\n".join(line.rstrip() for line in text.rstrip().split("\n")).strip("\n")


# ---- runs

def run_chapter(path):
    """Run the chapter through cells.py as its header says, keep the run (cells.save_run) and return its folder;
    exits with the chapter's error when it fails."""
    n, cmd = cells.ranks_of(path), cells.command(path)
    name = os.path.basename(path)
    print(f"  run {name} ({n} {'ranks' if n > 1 else 'process'}) ...", end="", flush=True)
    source = open(path).read()
    with tempfile.TemporaryDirectory() as figures:
        env = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", **os.environ, "MPLBACKEND": "Agg", "HSGD_FIGURES": figures,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        r = subprocess.run(["timeout", "-k", "5", str(TIMEOUT_S)] + cmd, capture_output=True, text=True, cwd=ROOT,
                           env=env)
        seconds = time.perf_counter() - t0
        print(f" {seconds:.1f} s", flush=True)
        if r.returncode != 0:
            raise SystemExit(f"book: {name} exited {r.returncode}:\n{r.stderr[-4000:]}")
        return cells.save_run(path, r.stdout, r.stderr, figures, seconds, source)


# ---- the site

def build(out, lecture, folder=HERE, run=True):
    parts = parse_parts(open(lecture).read())
    files = chapter_files(folder)
    errors = listing_errors(parts, files)
    if errors:
        raise SystemExit(f"book: {os.path.relpath(lecture, ROOT)} and the chapters on disk disagree:\n  "
                         + "\n  ".join(errors))
    order = ["index.html"] + [page_of(e.file) for p in parts for e in p.entries]
    paths = {page_of(e.file): os.path.join(folder, e.file) for p in parts for e in p.entries}
    titles = {"index.html": "The lecture"}
    titles.update({page_of(e.file): e.label for p in parts for e in p.entries})
    kept, ran = {}, 0
    if not run:
        stale = [os.path.basename(path) for path in paths.values() if cells.load_run(path) is None]
        if stale:
            raise SystemExit(f"book: no fresh run of {stale} in build/book/runs/ (make test keeps them)")
    for page, path in paths.items():
        kept[page] = cells.load_run(path)
        if kept[page] is None:                  # no run of this version of the chapter: run it now
            if not ran:
                print("book: running the chapters without a fresh run in build/book/runs/", flush=True)
            run_chapter(path)
            ran += 1
            kept[page] = cells.load_run(path)
    for old in glob.glob(os.path.join(out, "*.html")):     # pages of chapters gone or renamed go too
        os.remove(old)
    shutil.rmtree(os.path.join(out, "img"), ignore_errors=True)
    os.makedirs(os.path.join(out, "img"))
    css = CSS
    try:
        from pygments.formatters import HtmlFormatter
        css += HtmlFormatter().get_style_defs(".highlight")
    except ImportError:
        pass
    with open(os.path.join(out, "style.css"), "w") as f:
        f.write(css)
    pages = set(order)
    for page in order:
        md = markdown_renderer(pages)
        if page == "index.html":
            body = md.render(open(lecture).read())
        else:
            folder_run, output = kept[page]
            body = chapter_body(paths[page], output, folder_run, os.path.join(out, "img"), md)
            body += (f'\n<p class="run">Output and pictures from a run of '
                     f"<code>{html.escape(os.path.basename(paths[page]))}</code> with "
                     f"{cells.ranks_of(paths[page])} rank(s) through <code>tutorials/cells.py</code>.</p>")
        nav = nav_html(parts, titles, page)
        with open(os.path.join(out, page), "w") as f:
            f.write(page_html(titles[page], body, nav, steps_html(order, titles, page)))
    return order


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "book"))
    ap.add_argument("--lecture", default=os.path.join(HERE, "00_the_lecture.md"),
                    help="the page that lists the parts (default: tutorials/00_the_lecture.md)")
    ap.add_argument("--tutorials", default=HERE, help="the folder of the chapters (default: tutorials/)")
    ap.add_argument("--no-run", action="store_true", help="fail instead of running chapters without a fresh run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        parts_text = open(args.lecture).read()
        parse_parts(parts_text)
    except ValueError as e:
        raise SystemExit(f"book: {args.lecture}: {e}") from None
    order = build(args.out, args.lecture, folder=args.tutorials, run=not args.no_run)
    print(f"book: {len(order)} pages in {os.path.relpath(args.out, ROOT)}/ ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
