"""The course's static site (`make site`): it builds without a warning, and every page works in
a real browser.

The site is built as `make site` builds it (tools/build_site.py, into build/site) and served
on 127.0.0.1; headless Chromium opens every page: it loads, MathJax typesets all its math
with no error, every image has loaded pixels, every link into the site reaches a page and
the anchor it names, nothing is logged to the console as an error, and no math holds a
control character (a backslash eaten by a Python string: "\\t" of "\\times" as a tab); no line
of code or output runs past its block or the window (long lines wrap, with a hanging indent, and
keep every character); no cell shows an nbval marker line; every figure links to its image and a
click shows it larger than in the column. Each widget of the notebooks shows its stored frame
instead of an empty box.

Scratch sites check the checks: a page with a math error, a missing image, a dead link, a dead
anchor, a cut line of code, a marker line and a figure without a link must be reported, a build
with a warning or a widget without a frame must fail.
Needs Debian's Chromium as tests/test_browser.py does (a failure in CI when it is missing).
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import re
import socketserver
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import nbformat
import pytest

from .browser_support import CHROMIUM, launch_chromium, watch_console, widget_cells
from .test_project import ADDRESS  # a published address's form, under an owner no GitHub account can have

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import build_site  # noqa: E402
from nbval_tags import MARKER_LINE  # noqa: E402

SITE = REPO / "build" / "site"
NOTEBOOKS = REPO / "notebooks"
BUILD_BUDGET_S = 150  # about two minutes on a 2-core machine, with room for a busy one


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"{CHROMIUM} is missing: run `bash tools/ensure_chromium.sh` as root to install it"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


# --- serving and reading a built site -------------------------------------------------

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@functools.lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    """The ids and names an HTML file holds, as a link's #fragment may name them."""
    found = set()

    class Parser(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.update(value for key, value in attrs if key in ("id", "name") and value)

    Parser().feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(found)


_MATH = re.compile(r'<(span|div) class="math[^"]*">(.*?)</\1>', re.S)
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f]")  # all but the newline


def math_with_control_characters(path: Path) -> list[str]:
    """Math whose TeX holds a control character: '\\t' of '\\times' read as a tab, '\\f' of '\\frac'."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [html.unescape(m.group(2))[:80] for m in _MATH.finditer(text) if _CONTROL.search(html.unescape(m.group(2)))]


class Site:
    """A built site served on 127.0.0.1 from a thread, for as long as the fixture lives."""

    def __init__(self, root: Path):
        self.root = root
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def pages(self) -> list[str]:
        """Every HTML page of the site (theme fragments under _static/ are not pages)."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.glob("**/*.html")
                      if p.relative_to(self.root).parts[0] != "_static")

    def resolve(self, url: str) -> str | None:
        """Why a link into the site is dead, or None when it reaches a file and its anchor."""
        parts = urllib.parse.urlsplit(url)
        path = self.root / urllib.parse.unquote(parts.path.lstrip("/"))
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            return f"no file {path.relative_to(self.root)}"
        fragment = urllib.parse.unquote(parts.fragment)
        if fragment and path.suffix == ".html" and fragment not in _anchors(path):
            return f"no anchor #{fragment} in {path.relative_to(self.root)}"
        return None

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


# Run in the page once it has loaded: wait for MathJax's first typesetting, load every image
# (lazy ones too), and report what a reader would see broken.
_INSPECT_JS = """async () => {
  const MARKER = new RegExp(%r);
  if (document.querySelector('.math')) {
    const start = performance.now();
    while (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) {
      if (performance.now() - start > 20000) return {noMathJax: true};
      await new Promise(r => setTimeout(r, 50));
    }
    await MathJax.startup.promise;
  }
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = 'eager'; });
  await Promise.all(images.map(img => img.decode().catch(() => null)));
  return {
    math: document.querySelectorAll('.math').length,
    untypeset: Array.from(document.querySelectorAll('.math'))
      .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80)),
    // MathJax's MathML copy of each formula (assistive-mml) carries its errors as text
    mathErrors: Array.from(document.querySelectorAll('mjx-merror'))
      .map(el => el.getAttribute('data-mjx-error') || el.textContent.slice(0, 80)),
    undefinedMacros: Array.from(document.querySelectorAll('mjx-assistive-mml mtext[mathcolor="red"]'))
      .map(el => el.textContent.slice(0, 80)),
    brokenImages: images.filter(img => !(img.complete && img.naturalWidth > 0))
      .map(img => img.getAttribute('src')),
    images: images.length,
    links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
    // a line of code or output running past its block's edge or the window's, hidden until scrolled to
    cutCode: Array.from(document.querySelectorAll('pre'))
      .filter(pre => pre.offsetParent !== null && (pre.scrollWidth > pre.clientWidth + 1
                     || pre.getBoundingClientRect().right > document.documentElement.clientWidth + 1))
      .map(pre => `${pre.scrollWidth} px in ${pre.clientWidth} px: ` + pre.textContent.trim().split('\\n')[0].slice(0, 60)),
    // a cell's code as shown: any nbval marker line in it is for nbval, not the reader
    markerLines: Array.from(document.querySelectorAll('.cell_input pre'))
      .flatMap(pre => pre.textContent.split('\\n')).filter(line => MARKER.test(line)),
    // a figure in the text that a click cannot enlarge (docs/_ext/figure_zoom.py)
    unlinkedFigures: images.filter(img => img.closest('article, .body, [role=main]')
                                   && !new URL(img.src).pathname.includes('/_static/'))  // the theme's icons
      .filter(img => { const a = img.closest('a.flashlib-zoom'); return !a || a.href !== img.src; })
      .map(img => img.getAttribute('src')),
    // lines too long for their block, shown wrapped (_static/code_wrap.js)
    wrappedLines: Array.from(document.querySelectorAll('pre')).map(pre => {
      const heights = Array.from(pre.querySelectorAll('.flashlib-line')).map(l => l.getBoundingClientRect().height)
        .filter(h => h > 0);
      const one = Math.min(...heights);
      return heights.filter(h => h > 1.5 * one).length;
    }).reduce((a, b) => a + b, 0),
  };
}""" % MARKER_LINE.pattern


def inspect_page(page, site: Site, relative: str) -> tuple[list[str], dict]:
    """Open one page of `site`; (what is wrong with it, what was counted)."""
    errors_before = len(page.console_errors)
    response = page.goto(site.base + relative, wait_until="load")
    problems = [] if response is not None and response.ok else [f"HTTP {response and response.status}"]
    found = page.evaluate(_INSPECT_JS)
    if found.get("noMathJax"):
        return problems + ["the page has math but MathJax never started"], {}
    problems += [f"math not typeset: {t!r}" for t in found["untypeset"]]
    problems += [f"math error: {t!r}" for t in found["mathErrors"]]
    problems += [f"undefined TeX macro: {t!r}" for t in found["undefinedMacros"]]
    problems += [f"image without pixels: {src}" for src in found["brokenImages"]]
    problems += [f"control character in math: {t!r}" for t in math_with_control_characters(site.root / relative)]
    problems += [f"code cut at the block's edge: {t!r}" for t in found["cutCode"]]
    problems += [f"nbval marker shown in a cell: {t.strip()!r}" for t in found["markerLines"]]
    problems += [f"figure without a click to enlarge: {src}" for src in found["unlinkedFigures"]]
    for link in dict.fromkeys(found["links"]):
        if link.startswith(site.base):
            dead = site.resolve(link[len(site.base) - 1:])
            if dead:
                problems.append(f"dead link {link[len(site.base):]}: {dead}")
    problems += page.console_errors[errors_before:]
    counts = {"math": found["math"], "images": found["images"], "wrapped": found["wrappedLines"],
              "links": sum(1 for link in found["links"] if link.startswith(site.base))}
    return problems, counts


@pytest.fixture(scope="module")
def browser():
    _require_chromium()
    from playwright.sync_api import sync_playwright

    import tempfile

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
        context = launch_chromium(playwright, Path(profile))
        try:
            yield context
        finally:
            context.close()


def _new_page(browser):
    page = browser.new_page()
    page.set_default_timeout(60_000)
    page.console_errors = watch_console(page)
    # the console says a resource failed, not which: name it
    page.on("response", lambda r: page.console_errors.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400 else None)
    return page


@pytest.fixture
def page(browser):
    page = _new_page(browser)
    yield page
    page.close()


# --- the course's site ------------------------------------------------------------------

@pytest.fixture(scope="module")
def course_site():
    """The site as `make site` builds it: built here, served from build/site."""
    start = time.perf_counter()
    result = build_site.build(SITE, REPO / "build" / "site-src", notebooks=NOTEBOOKS, repository=ADDRESS)
    seconds = time.perf_counter() - start
    warnings = (SITE.parent / "site-warnings.log").read_text(errors="replace") \
        if (SITE.parent / "site-warnings.log").exists() else ""
    assert result.returncode == 0, f"the site did not build:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert not warnings.strip(), f"the build warned:\n{warnings}"
    print(f"site built in {seconds:.0f} s")
    site = Site(SITE)
    yield site, seconds
    site.stop()


def test_site_builds_within_its_budget(course_site):
    _, seconds = course_site
    assert seconds < BUILD_BUDGET_S, f"the site took {seconds:.0f} s to build (budget {BUILD_BUDGET_S} s)"


def test_site_has_every_notebook_in_course_order(course_site):
    site, _ = course_site
    notebooks = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    index = (site.root / "index.html").read_text(encoding="utf-8")
    positions = [index.find(f'href="notebooks/{stem}.html"') for stem in notebooks]
    assert all(p >= 0 for p in positions), dict(zip(notebooks, positions))
    assert positions == sorted(positions), "the notebooks are not listed in course order"
    for stem in notebooks:  # each page links to the next, as a reader turns the page
        assert (site.root / "notebooks" / f"{stem}.html").is_file()
    api = {p.stem for p in (site.root / "api").glob("*.html")}
    assert {"index", "reference", "ops", "kernels", "ladder", "course", "labs", "bench"} <= api


def test_each_notebook_page_opens_in_colab_from_the_courses_address(course_site):
    site, _ = course_site
    owner_repo = ADDRESS.removeprefix("https://github.com/")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        page = (site.root / "notebooks" / f"{path.stem}.html").read_text(encoding="utf-8")
        colab = f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/{path.name}"
        assert colab in page and f'href="{ADDRESS}"' in page, path.name


def _widget_frames(page, name: str, indices: list[int]) -> list[str]:
    """Each widget cell of the open notebook page shows its stored frame, not an empty box."""
    problems = []
    cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
    for index in indices:
        code_position = sum(1 for c in cells[:index] if c.cell_type == "code"  # the pages drop the setup cell
                            and build_site.SETUP_TAG not in c.get("metadata", {}).get("tags", []))
        output = page.locator("div.cell").nth(code_position).locator(".cell_output")
        image = output.locator("img").first
        image.wait_for(state="visible")
        if not image.evaluate("img => img.decode().then(() => img.naturalWidth)") > 0:
            problems.append(f"{name} cell {index}: the frame has no pixels")
        if "A still of the widget" not in output.inner_text():
            problems.append(f"{name} cell {index}: no note that the image is a still")
        if output.locator(".jupyter-widgets").count():
            problems.append(f"{name} cell {index}: an empty widget box")
    return problems


class _PreText(html.parser.HTMLParser):
    """The text of every <pre> of a page as the HTML file holds it, before any script ran."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.texts, self.depth = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self.depth += 1
            if self.depth == 1:
                self.texts.append("")

    def handle_endtag(self, tag):
        if tag == "pre":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.texts[-1] += data


def _shown_code(page, site: Site, relative: str) -> tuple[list[str], int]:
    """The open page's code blocks against the HTML file's: (what differs, blocks compared)."""
    parser = _PreText()
    parser.feed((site.root / relative).read_text(encoding="utf-8"))
    shown = page.evaluate("() => Array.from(document.querySelectorAll('pre'))"
                          ".map(pre => [pre.textContent, pre.classList.contains('flashlib-wrapped')])")
    problems = []
    if [t.rstrip("\n") for t, _ in shown] != [t.rstrip("\n") for t in parser.texts]:
        problems.append(f"{relative}: the code shown is not the code the page holds")
    if not all(wrapped for _, wrapped in shown):
        problems.append(f"{relative}: a block of code was not wrapped")
    return problems, len(shown)


def _zoom_each_figure(page, relative: str) -> tuple[list[str], int]:
    """Click each figure of the open page: (what did not enlarge or close, figures opened)."""
    report, opened = [], 0
    links = page.locator("a.flashlib-zoom")
    for i in range(links.count()):
        link = links.nth(i)
        link.scroll_into_view_if_needed()
        column = link.locator("img").evaluate("img => img.decode().then(() => img.getBoundingClientRect().width)")
        link.click()
        view = page.locator(".flashlib-zoom-view img")
        view.wait_for(state="visible")
        large = view.evaluate("img => img.decode().then(() => [img.getBoundingClientRect().width,"
                              " img.getBoundingClientRect().height])")
        window = page.evaluate("() => [innerWidth, innerHeight]")
        # larger by half at least, or as large as the window lets it be
        if not (large[0] >= 1.5 * column or large[0] >= 0.9 * window[0] or large[1] >= 0.9 * window[1]):
            report.append(f"{relative} figure {i}: {column:.0f} px in the column, {large[0]:.0f} px enlarged")
        page.keyboard.press("Escape")
        if page.locator(".flashlib-zoom-view").count():
            return report + [f"{relative}: Escape left the figure open"], opened + 1
        opened += 1
    return report, opened


def _each_check(checks: dict, name: str, run) -> None:
    """Run one check on the open page into checks[name]; an exception is that check's failure alone."""
    try:
        problems, count = run()
    except Exception as error:  # noqa: BLE001  reported by the test of that check
        problems, count = [f"{type(error).__name__}: {str(error)[:2000]}"], 0
    checks[name][0].extend(problems)
    checks[name][1] += count


@pytest.fixture(scope="module")
def visited(course_site, browser):
    """Every page of the course's site opened once, in one tab, with each check below run on it while
    it is open (opening the pages is most of the time): by check, (what it found wrong, what it counted)."""
    site, _ = course_site
    widgets: dict[str, list[int]] = {}
    for name, index in widget_cells(NOTEBOOKS):
        widgets.setdefault(f"notebooks/{Path(name).stem}.html", []).append(index)
    checks = {"pages": [{}, {"math": 0, "images": 0, "links": 0, "wrapped": 0}], "code": [[], 0],
              "widgets": [[], 0], "zoom": [[], 0]}
    page = _new_page(browser)
    try:
        for relative in site.pages():
            problems, counts = inspect_page(page, site, relative)
            if problems:
                checks["pages"][0][relative] = problems
            for key in checks["pages"][1]:
                checks["pages"][1][key] += counts.get(key, 0)
            if not relative.startswith("notebooks/"):
                continue
            _each_check(checks, "code", lambda: _shown_code(page, site, relative))
            for_widgets = widgets.get(relative, [])
            _each_check(checks, "widgets",
                        lambda: (_widget_frames(page, Path(relative).stem + ".ipynb", for_widgets), len(for_widgets)))
            _each_check(checks, "zoom", lambda: _zoom_each_figure(page, relative))  # last: it scrolls and clicks
    finally:
        page.close()
    checks["widget cells"] = sum(len(v) for v in widgets.values())
    return checks


def test_every_page_works_in_the_browser(course_site, visited):
    """Every page loads with its math typeset, its images drawn and its links alive."""
    report, totals = visited["pages"]
    print(f"{len(course_site[0].pages())} pages: {totals['math']} math elements, {totals['images']} images, "
          f"{totals['links']} links into the site, {totals['wrapped']} long lines wrapped")
    assert not report, "\n".join(f"{p}:\n  " + "\n  ".join(v[:20]) for p, v in report.items())
    assert totals["math"] > 500 and totals["images"] > 30  # the pages were really read
    assert totals["wrapped"] > 20  # the kernels' long lines are there, and wrapped: not cut


def test_every_widget_shows_its_frame(visited):
    problems, checked = visited["widgets"]
    assert visited["widget cells"]
    assert not problems, "\n".join(problems)
    assert checked == visited["widget cells"]  # each widget cell was looked at


def test_wrapped_code_keeps_every_character(visited):
    """Wrapping (_static/code_wrap.js) changes how a line is shown, never its text."""
    problems, checked = visited["code"]
    assert not problems, "\n".join(problems)
    assert checked > 200


def test_a_click_enlarges_every_figure(visited):
    """Each notebook page's figures open over the page, larger than in the column, and close again."""
    report, opened = visited["zoom"]
    assert not report, "\n".join(report)
    assert opened > 30


# --- the checks themselves --------------------------------------------------------------

HARNESS_CONF = '''
extensions = ["myst_nb", "sphinx.ext.mathjax", "sphinx-mathjax-offline"]
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath"]
nb_mime_priority_overrides = [("*", "application/vnd.jupyter.widget-view+json", None)]
html_theme = "basic"
html_favicon = "favicon.svg"  # else the browser asks for /favicon.ico, a 404 on every page
'''
HARNESS_PAGES = {
    "index.md": "# Scratch\n\n```{toctree}\n\ngood\nbroken\nnotebooks/01_a\n```\n",  # 01_a: its widget's frame
    "good.md": "# Good\n\nInline $a^2 + b^2$ and a [link](broken.md).\n\n$$\\frac{1}{2}$$\n",
    "broken.md": ("# Broken\n\n## Here\n\nA math error $\\frac{1}$, a macro $\\notamacro x$, a tab $N \times N$.\n\n"
                  '<img src="missing.png" alt="missing">\n\n<a href="nowhere.html">dead</a>\n\n'
                  '<a href="good.html#no-such-anchor">dead anchor</a> <a href="#here">live anchor</a>\n\n'
                  "```python\nx = [" + ", ".join(["1.0"] * 120) + "]\n```\n\n"
                  '<div class="cell_input"><pre># NBVAL_IGNORE_OUTPUT\nx = 1</pre></div>\n'),
}


def _harness_docs(folder: Path, pages: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "conf.py").write_text(HARNESS_CONF)
    (folder / "favicon.svg").write_text((REPO / "docs" / "_static" / "favicon.svg").read_text())
    for name, text in pages.items():
        (folder / name).write_text(text)
    return folder


def _notebook_with_widget(path: Path, frame: bool) -> None:
    data = {"text/plain": "Stepper(step=0)",
            build_site.WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": "x"}}
    if frame:
        data["image/png"] = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYPj/HwADAgH/"
                             "eLJbVQAAAABJRU5ErkJggg==")
    cell = nbformat.v4.new_code_cell("stepper", outputs=[nbformat.v4.new_output("display_data", data=data)])
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A notebook"), cell])
    notebook.metadata.update(kernelspec={"name": "python3", "display_name": "Python 3", "language": "python"},
                             language_info={"name": "python", "pygments_lexer": "ipython3"})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


@pytest.fixture(scope="module")
def scratch_site(tmp_path_factory):
    """One scratch site for the checks' tests: a page that breaks every check, a page that breaks none
    and a notebook whose widget stored its frame beside it. (where it is, what Sphinx returned)"""
    folder = tmp_path_factory.mktemp("scratch")
    docs = _harness_docs(folder / "docs", HARNESS_PAGES)
    _notebook_with_widget(folder / "notebooks" / "01_a.ipynb", frame=True)
    result = build_site.build(folder / "out", folder / "src", docs=docs, notebooks=folder / "notebooks",
                              repository=ADDRESS)
    return folder / "out", result


def test_checks_find_a_broken_page(page, scratch_site):
    out, result = scratch_site
    assert result.returncode == 0, result.stderr  # nothing Sphinx sees: the browser must
    site = Site(out)
    try:
        good, _ = inspect_page(page, site, "good.html")
        broken, _ = inspect_page(page, site, "broken.html")
    finally:
        site.stop()
    assert good == [], good
    found = "\n".join(broken)
    for expected in ("math error", "undefined TeX macro", "control character in math",
                     "image without pixels: missing.png", "dead link nowhere.html: no file",
                     "dead link good.html#no-such-anchor: no anchor", "code cut at the block's edge", "px: x = [1.0",
                     "nbval marker shown in a cell: '# NBVAL_IGNORE_OUTPUT'",
                     "figure without a click to enlarge: missing.png"):
        assert expected in found, f"{expected!r} not reported:\n{found}"
    assert "#here" not in found, found
    assert any("404" in p or "Failed to load resource" in p for p in broken), found  # the console's


def test_a_build_warning_fails_the_build(tmp_path):
    docs = _harness_docs(tmp_path / "docs", {"index.md": "# Scratch\n\nA [link](missing.md) to nothing.\n"})
    (tmp_path / "notebooks").mkdir()
    result = build_site.build(tmp_path / "out", tmp_path / "src", docs=docs, notebooks=tmp_path / "notebooks",
                              repository=ADDRESS)
    assert result.returncode != 0
    assert "missing.md" in (tmp_path / "out-warnings.log").read_text()


def test_a_widget_without_its_frame_stops_the_build(tmp_path, scratch_site):
    docs = _harness_docs(tmp_path / "docs", {"index.md": "# Scratch\n\n```{toctree}\n:glob:\n\nnotebooks/*\n```\n"})
    _notebook_with_widget(tmp_path / "notebooks" / "01_a.ipynb", frame=False)
    with pytest.raises(SystemExit, match="notebooks/01_a.ipynb cell 1: a widget view with no image/png"):
        build_site.build(tmp_path / "out", tmp_path / "src", docs=docs, notebooks=tmp_path / "notebooks",
                              repository=ADDRESS)
    assert not (tmp_path / "out").exists()  # stopped before Sphinx
    # the same notebook with its frame (the scratch site's): built, the frame shown in the widget's place
    out, result = scratch_site
    assert result.returncode == 0, result.stderr
    page = (out / "notebooks" / "01_a.html").read_text()
    assert "<img" in page and "A still of the widget" in page and "widget-view" not in page
