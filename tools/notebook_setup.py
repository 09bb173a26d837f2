"""Keep every notebook's first two cells in step with the repository's one URL.

    python tools/notebook_setup.py            # rewrite them where they differ
    python tools/notebook_setup.py --check    # exit 1 and name the notebooks that differ

The first cell of each notebook is a Markdown cell with an "Open in Colab" link for that
notebook; the second is a code cell that installs flashlib where it cannot be imported (a GPU
runtime that opened the notebook alone) and does nothing, printing nothing, where it can (a
clone, `make lab`, CI). It installs from the environment variable ``FLASHLIB_SOURCE`` when that is
set (any pip requirement: a path, a git URL, a wheel), else from the repository. flashlib
declares version ranges (pyproject.toml), so the runtime's own torch and Triton stay as they are.

The repository's URL is written once, in pyproject.toml's ``[project.urls] Repository``; this
script (run by ``make notebooks``, checked by tests/test_project.py) derives both cells from it.
Both cells carry the tag ``flashlib-setup``, by which they are found and replaced.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
TAG = "flashlib-setup"
BRANCH = "main"


def repository() -> str:
    """https://github.com/OWNER/REPO, from pyproject.toml."""
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise SystemExit(f"notebook_setup: [project.urls] Repository must be https://github.com/OWNER/REPO, got {url!r}")
    return url


def colab_url(notebook: str, repo: str | None = None) -> str:
    path = (repo or repository()).removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{path}/blob/{BRANCH}/notebooks/{notebook}"


def badge_source(notebook: str, repo: str) -> str:
    # a text link, not the usual badge image: an image fetched from afar fails where the network is
    # closed (a classroom's JupyterLab, CI's browser test), and the link does the same
    return (f"**[Open this notebook in Colab]({colab_url(notebook, repo)})**\n"
            "\n"
            "On a GPU runtime that opened this notebook alone (Colab, Kaggle), the next cell installs flashlib and "
            "keeps the runtime's own torch and Triton; where flashlib is already importable it does nothing.")


def setup_source(repo: str) -> str:
    return f'''import importlib, importlib.util, os, subprocess, sys

if importlib.util.find_spec("flashlib") is None:  # a runtime without the course: install it, once
    source = os.environ.get("FLASHLIB_SOURCE", "git+{repo}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", source], check=True)
    importlib.invalidate_caches()
    print("installed flashlib from", "FLASHLIB_SOURCE" if "FLASHLIB_SOURCE" in os.environ else "the course's repository")'''


def wanted_cells(notebook: str, repo: str) -> list:
    badge = nbformat.v4.new_markdown_cell(badge_source(notebook, repo), metadata={"tags": [TAG]})
    setup = nbformat.v4.new_code_cell(setup_source(repo), metadata={"tags": [TAG]})
    return [badge, setup]


def _tagged(cell) -> bool:
    return TAG in cell.get("metadata", {}).get("tags", [])


def in_step(nb, notebook: str, repo: str) -> bool:
    first = nb.cells[:2]
    wanted = wanted_cells(notebook, repo)
    return (len(first) == 2 and all(_tagged(c) for c in first)
            and [(c.cell_type, c.source) for c in first] == [(c.cell_type, c.source) for c in wanted]
            and not any(_tagged(c) for c in nb.cells[2:]))


def update(path: Path, repo: str) -> bool:
    """Rewrite path's setup cells if they differ; True if it changed. A setup cell that was executed
    keeps its execution count and outputs when its source is unchanged."""
    nb = nbformat.read(path, as_version=4)
    if in_step(nb, path.name, repo):
        return False
    old = {c.cell_type: c for c in nb.cells if _tagged(c)}
    new = wanted_cells(path.name, repo)
    for cell in new:
        kept = old.get(cell.cell_type)
        if kept is not None and kept.get("id"):
            cell["id"] = kept["id"]
        if kept is not None and cell.cell_type == "code" and kept.source == cell.source:
            cell.execution_count, cell.outputs = kept.execution_count, kept.outputs  # as it ran
    nb.cells = new + [c for c in nb.cells if not _tagged(c)]
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        nbformat.write(nb, f)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which notebooks differ")
    args = parser.parse_args(argv)
    repo = repository()
    paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if args.check:
        stale = [p.name for p in paths if not in_step(nbformat.read(p, as_version=4), p.name, repo)]
        for name in stale:
            print(f"notebook_setup: {name}: its badge and setup cells are not in step with {repo} "
                  "(run python tools/notebook_setup.py, then make notebooks)")
        return 1 if stale else 0
    for path in paths:
        if update(path, repo):
            print(f"notebook_setup: {path.name} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
