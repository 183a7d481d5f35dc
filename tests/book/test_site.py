"""The course's website in a real browser (headless Chromium, driven by selenium): every page of build/book/ opens,
every chapter's page has the chapter's title as its h1, the navigation and the style sheet, every picture loads,
every link inside the site leads to a page and an id that exist, and nothing is loaded from outside the folder.

    make book-test          (builds the book when needed, then this with HSGD_BOOK_TEST=1)

Chromium and its driver: /usr/bin/chromium and /usr/bin/chromedriver (Debian's chromium and chromium-driver), or
$CHROME and $CHROMEDRIVER; selenium is told the driver's path, so it downloads nothing.
"""
import os
import sys
from urllib.parse import unquote, urlsplit

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tutorials"))
import book    # noqa: E402

SITE = os.environ.get("HSGD_BOOK_DIR") or os.path.join(ROOT, "build", "book")
CHROME = os.environ.get("CHROME", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
CHAPTERS = book.chapter_files()
PAGES = ["index.html"] + [book.page_of(f) for f in CHAPTERS]

# what a page holds, read by the browser after it has loaded
SURVEY = """
const side = document.querySelector('nav.side');
return {
  h1: [...document.querySelectorAll('h1')].map(h => h.textContent.trim()),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
  nav: side ? [...side.querySelectorAll('a[href]')].map(a => a.getAttribute('href')) : null,
  steps: [...document.querySelectorAll('nav.steps a[rel]')].map(a => a.getAttribute('rel') + ' ' +
                                                                     a.getAttribute('href')),
  outputs: document.querySelectorAll('pre.output').length,
  maths: document.querySelectorAll('math').length,
  flat: [...document.querySelectorAll('math')].filter(m => m.getBoundingClientRect().height === 0)
                                              .map(m => m.textContent).slice(0, 5),
  raw: document.querySelectorAll('code.math').length,
  images: [...document.images].map(i => [i.getAttribute('src'), i.complete, i.naturalWidth]),
  styled: side ? getComputedStyle(side).position : null,
  loaded: performance.getEntriesByType('resource').map(r => r.name),
};
"""


@pytest.fixture(scope="module")
def survey():
    """{page: what SURVEY found on it}, every page of the site opened once in one headless Chromium."""
    for what, path in (("Chromium", CHROME), ("chromedriver", CHROMEDRIVER)):
        assert os.path.exists(path), f"no {what} at {path} (apt-get install chromium chromium-driver)"
    assert os.path.exists(os.path.join(SITE, "index.html")), f"no book in {SITE}: make book"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROME
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        found = {}
        for page in sorted(p for p in os.listdir(SITE) if p.endswith(".html")):
            driver.get("file://" + os.path.join(SITE, page))
            found[page] = driver.execute_script(SURVEY)
        return found
    finally:
        driver.quit()


def plain(title):
    """A markdown title as the browser shows it: without code and emphasis marks."""
    return title.replace("`", "").replace("*", "")


def test_every_chapter_has_a_page(survey):
    assert sorted(survey) == sorted(PAGES), (f"pages without a chapter {sorted(set(survey) - set(PAGES))}, "
                                             f"chapters without a page {sorted(set(PAGES) - set(survey))}")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_page_renders(survey, chapter):
    page = survey[book.page_of(chapter)]
    title = plain(book.title_of(os.path.join(book.HERE, chapter)))
    assert page["h1"] == [title], f"{chapter}: h1 {page['h1']}, the chapter's title is {title!r}"
    assert page["styled"] == "fixed", "style.css did not apply (the navigation is not fixed at the side)"
    assert page["nav"] is not None and set(PAGES) <= set(page["nav"]), "the navigation misses pages"
    assert page["outputs"] > 0, f"{chapter}: no cell's output on the page"
    steps = dict(s.split(" ") for s in page["steps"])
    i = PAGES.index(book.page_of(chapter))
    assert steps.get("prev") == PAGES[i - 1] and steps.get("next") == (PAGES[i + 1] if i + 1 < len(PAGES) else None)


@pytest.mark.parametrize("page", PAGES)
def test_pictures_load(survey, page):
    broken = [src for src, complete, width in survey[page]["images"] if not (complete and width > 0)]
    assert not broken, f"{page}: pictures that did not load: {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_links_inside_the_site_resolve(survey, page):
    broken = []
    for href in survey[page]["links"]:
        url = urlsplit(href)
        if url.scheme or url.netloc:
            continue                                      # http(s), mailto: outside the site, not followed
        target = unquote(url.path) or page
        if target not in survey:
            broken.append(href)
        elif url.fragment and unquote(url.fragment) not in survey[target]["ids"]:
            broken.append(href)
    assert not broken, f"{page}: links to no page or no id: {broken}"


def test_nothing_loaded_from_outside(survey):
    outside = sorted({u for page in survey.values() for u in page["loaded"] if not u.startswith("file://")})
    assert not outside, f"loaded from outside the book's folder: {outside}"


def test_chapters_show_their_runs(survey):
    """Pictures appear in the chapters' pages (the course draws more than 8), all from build/book/img/."""
    srcs = [src for page in survey.values() for src, _, _ in page["images"]]
    assert len(srcs) >= 8 and all(s.startswith("img/") for s in srcs), srcs[:10]


def test_formulas_are_laid_out(survey):
    """The chapters' $...$ and $$...$$ became MathML that the browser lays out (every <math> has a height), none was
    left as LaTeX source, and the chapters that write formulas show them (at least 200 over the course)."""
    flat = {p: v["flat"] for p, v in survey.items() if v["flat"]}
    raw = {p: v["raw"] for p, v in survey.items() if v["raw"]}
    assert not flat and not raw, f"formulas not laid out: {flat}; left as LaTeX: {raw}"
    assert sum(v["maths"] for v in survey.values()) >= 200
