"""Build the course as a static HTML site from the stored notebooks (`make site`).

    python tools/build_site.py [--out build/site]

1. Lays out the sources in build/site-src: docs/'s pages and every notebook as stored,
   never executed, without its badge and setup cells (each page has a launch button) and
   without nbval's comment markers (`# NBVAL_SKIP` and the like: for nbval, not the reader;
   tools/nbval_tags.py turns them into cell tags); a widget view (which needs a kernel) is
   replaced by the frame the widget stored beside it as image/png, with a note. A widget
   without a stored frame stops the build: re-execute its notebook (`make notebooks`).
2. Runs Sphinx with myst-nb (docs/conf.py): the notebooks in course order, math by MathJax
   (served from the site itself), the API pages from the package's docstrings, the labs.
   Any warning fails the build, except those docs/conf.py allows by name.

The site is published material: each notebook page has a button to the course's repository and one
that opens the notebook in Colab, both from the course's one address (pyproject.toml's
``[project.urls] Repository``, read by tools/notebook_setup.py). With the address unset the build stops
before it starts, saying what to set.

Open build/site/index.html. tests/test_site.py builds it and opens every page in Chromium.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import notebook_setup
from nbval_tags import strip_markers

ROOT = Path(__file__).resolve().parent.parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SETUP_TAG = notebook_setup.TAG  # tools/notebook_setup.py's cells
REPOSITORY_VARIABLE = "FLASHLIB_SITE_REPOSITORY"  # how build() hands docs/conf.py the address
STILL_NOTE = ('<p class="flashlib-still-note">A still of the widget above, as it opens: run this '
              "notebook in JupyterLab to move its controls.</p>")


def still_frames(notebook) -> list[str]:
    """Replace each widget view by its stored frame and a note, in place; the cells that
    have no frame to show, as messages."""
    missing = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW not in data:
                outputs.append(output)
                continue
            if "image/png" not in data:
                missing.append(f"cell {index}: a widget view with no image/png frame stored beside it")
            del data[WIDGET_VIEW]
            outputs += [output, nbformat.v4.new_output("display_data", data={"text/html": STILL_NOTE})]
        cell.outputs = outputs
    return missing


def _write_if_changed(path: Path, text: str) -> None:
    # unchanged files keep their times, so a second build reads only what changed
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def lay_out(docs: Path, notebooks: Path, source: Path) -> list[str]:
    """Fill `source` with the pages of `docs` and the notebooks; the problems found."""
    problems, wanted = [], set()
    for page in sorted(docs.glob("*.md")):
        # pages link notebooks as GitHub shows them (docs/ -> ../notebooks/); the site holds them in notebooks/
        text = page.read_text(encoding="utf-8").replace("](../notebooks/", "](notebooks/")
        _write_if_changed(source / page.name, text)
        wanted.add(source / page.name)
    for path in sorted(notebooks.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        # the badge and setup cells are for a runtime that opened the notebook alone; a page has
        # the theme's launch button instead (and the badge's image would be fetched from afar)
        notebook.cells = [c for c in notebook.cells if SETUP_TAG not in c.get("metadata", {}).get("tags", [])]
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.source = strip_markers(cell.source)[0]
        problems += [f"notebooks/{path.name} {m}" for m in still_frames(notebook)]
        target = source / "notebooks" / path.name
        _write_if_changed(target, nbformat.writes(notebook) + "\n")
        wanted.add(target)
    for stale in source.glob("notebooks/*.ipynb"):
        if stale not in wanted:
            stale.unlink()
    return problems


def build(out: Path, source: Path, docs: Path = ROOT / "docs", notebooks: Path = ROOT / "notebooks",
          quiet: bool = True, repository: str | None = None) -> subprocess.CompletedProcess:
    """Lay out the sources, then run Sphinx; raises SystemExit on a missing frame. ``repository``: the
    course's address for the pages' buttons (default: the course's own, which must be set)."""
    repository = repository or notebook_setup.repository()
    problems = lay_out(docs, notebooks, source)
    if problems:
        raise SystemExit("build_site: widgets without a still frame (re-execute their notebooks "
                         "with `make notebooks`):\n  " + "\n  ".join(problems))
    # the source pages of a module since renamed would stay, linking to anchors no page has:
    # viewcode writes every page of this folder again on each build
    shutil.rmtree(out / "_modules", ignore_errors=True)
    warnings = out.parent / f"{out.name}-warnings.log"
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-c", str(docs),
               "-d", str(out.parent / f"{out.name}-doctrees"), "-w", str(warnings),
               str(source), str(out)]
    if quiet:
        command.insert(3, "-q")
    return subprocess.run(command, cwd=ROOT, text=True, capture_output=quiet,
                          env=dict(os.environ, **{REPOSITORY_VARIABLE: repository}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    parser.add_argument("--source", type=Path, default=ROOT / "build" / "site-src",
                        help="where the sources are laid out")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks",
                        help="the stored notebooks to show (default: notebooks/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = build(args.out.resolve(), args.source.resolve(), notebooks=args.notebooks.resolve(),
                   quiet=False)
    pages = len(list(args.out.glob("**/*.html")))
    print(f"build_site: {'built' if result.returncode == 0 else 'FAILED'} {args.out} "
          f"({pages} pages) in {time.perf_counter() - start:.0f} s")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
