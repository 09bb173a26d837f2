"""Keep every notebook's first two cells in step with the course's one address.

    python tools/notebook_setup.py            # rewrite them where they differ
    python tools/notebook_setup.py --check    # exit 1 and name the notebooks that differ

The first cell of each notebook is a Markdown cell: with the course published, an "Open in Colab" link
for that notebook; unpublished, how to bring the course's package into a runtime that opened the
notebook alone. The second is the setup cell. Where the course's package (``flashlib-course``, which
imports as flashlib) is missing, it installs it: from ``FLASHLIB_SOURCE`` when that is set (any pip
requirement: a path, a git URL, a wheel), else from a ``flashlib_course-*.whl`` in the working folder
(uploaded: ``make wheel`` builds it), else from the published repository; unpublished and given none,
it stops and says how. It installs the course without its dependencies where the runtime has them, so
that the runtime's torch, Triton, numpy, matplotlib and ipywidgets stay as they are (any it lacks are
installed, with those it has held at their versions). Another package importable as flashlib (the
package index's "flashlib" is an unrelated project) is named and never run: the cell stops. Last, it
prints one line on the runtime (flashlib.course.runtime.describe), stored as the CPU of the lock prints
it; the cell is tagged ``device-dependent-output``, so the GPU check reports that line rather than
comparing it.

The address is written once, in pyproject.toml's ``[project.urls] Repository``; a name under the
``.invalid`` domain (which never resolves) means unpublished. This script (run by ``make notebooks``,
checked by tests/test_project.py) derives both cells from it; tools/build_site.py asks it for the
address and stops where there is none. Both cells carry the tag ``flashlib-setup``, by which they are
found and replaced.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
TAG = "flashlib-setup"
DEVICE_TAG = "device-dependent-output"  # flashlib.bench.nbval_results: reported, not compared, on a GPU
BRANCH = "main"
DISTRIBUTION = "flashlib-course"
GITHUB = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+")
UNSET_HELP = ("set [project.urls] Repository in pyproject.toml to the address of your copy of the course on GitHub "
              "(https://github.com/<owner>/<repo>), then run python tools/notebook_setup.py and make notebooks "
              '(README, "Publishing the course")')


def address(pyproject: Path = ROOT / "pyproject.toml") -> str | None:
    """The course's public address, https://github.com/<owner>/<repo>; None while it is unpublished (a
    name under .invalid). Anything else stops with what to write."""
    url = tomllib.loads(Path(pyproject).read_text())["project"]["urls"]["Repository"]
    if (urlsplit(url).hostname or "").endswith(".invalid"):
        return None
    if not GITHUB.fullmatch(url):
        raise SystemExit(f"notebook_setup: [project.urls] Repository is {url!r}: it must be https://github.com/<owner>/<repo> "
                         "(Colab opens notebooks from GitHub), or a name under .invalid while the course is unpublished")
    return url


def repository(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The address, for published material (Colab links, the site): stops, saying what to set, where there is none."""
    url = address(pyproject)
    if url is None:
        raise SystemExit(f"the course has no public address yet: {UNSET_HELP}")
    return url


def colab_url(notebook: str, repo: str | None = None) -> str:
    path = (repo or repository()).removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{path}/blob/{BRANCH}/notebooks/{notebook}"


def badge_source(notebook: str, repo: str | None) -> str:
    # a text link, not the usual badge image: an image fetched from afar fails where the network is
    # closed (a classroom's JupyterLab, CI's browser test), and the link does the same
    if repo is None:
        return ("**This copy of the course is not published**, so it has no Open-in-Colab link. To run this notebook "
                "alone on a GPU runtime (Colab, Kaggle), bring the course's package in: upload the wheel that "
                "`make wheel` builds (`build/wheel/flashlib_course-*.whl`) into the notebook's folder, or set "
                "`FLASHLIB_SOURCE` to a path or a git URL of your copy (`git+URL`). The next cell installs it, keeps "
                "the runtime's own torch, Triton, numpy, matplotlib and ipywidgets, and says in one line what of the "
                "course runs there.")
    return (f"**[Open this notebook in Colab]({colab_url(notebook, repo)})**\n"
            "\n"
            f"On a GPU runtime that opened this notebook alone (Colab, Kaggle), the next cell installs the course's "
            f"package ({DISTRIBUTION}) from {repo}, keeps the runtime's own torch, Triton, numpy, matplotlib and "
            "ipywidgets, and says in one line what of the course runs there.")


def setup_source(repo: str | None) -> str:
    default = f'"git+{repo}"' if repo else "None"
    return f"""# The course's package where this runtime lacks it, and nothing else: the runtime's own torch, Triton, numpy,
# matplotlib and ipywidgets stay as they are. Then one line on what of the course runs here.
def _flashlib_setup(course="{DISTRIBUTION}", published={default}):
    import importlib, importlib.metadata as md, importlib.util, os, pathlib, re, subprocess, sys

    def other():  # None: no flashlib at all; "": this course's; else what the other one is, and what to do
        spec = importlib.util.find_spec("flashlib")
        if spec is None:
            return None
        init = pathlib.Path(spec.origin or "")
        if init.name == "__init__.py" and f'__course__ = "{{course}}"' in init.read_text(errors="replace"):
            return ""
        names = md.packages_distributions().get("flashlib", [])
        if not names:
            return f"the folder {{init.parent}}: take it off sys.path"
        found = " and ".join(f"{{name}} {{md.version(name)}}" for name in names)
        return f"{{found}} at {{init.parent}}: uninstall it (pip uninstall -y {{' '.join(names)}})"

    def pip(*args):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"pip install {{' '.join(args)}} failed:\\n{{done.stderr[-3000:]}}")
        importlib.invalidate_caches()

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    found = other()
    if found is None:
        wheels = sorted(pathlib.Path.cwd().glob(course.replace("-", "_") + "-*.whl"))
        given = os.environ.get("FLASHLIB_SOURCE")
        source = given or (str(wheels[-1]) if wheels else published)
        if source is None:
            raise RuntimeError(f"{{course}} is not installed here and this copy of the course is not published: upload "
                               f"the wheel that `make wheel` builds (build/wheel/{{course.replace('-', '_')}}-*.whl) into "
                               f"{{pathlib.Path.cwd()}}, or set FLASHLIB_SOURCE to a path or a git URL of your copy "
                               '(os.environ["FLASHLIB_SOURCE"] = "git+URL"), then run this cell again')
        pip("--no-deps", source)
        needs = {{re.match(r"[\\w.-]+", r)[0]: r for r in md.requires(course) or [] if "extra ==" not in r}}
        kept = [name for name in needs if version(name)]
        missing = [name for name in needs if name not in kept]
        if missing:  # only what the runtime lacks; what it has is held at its version
            pip(*(needs[name] for name in missing), *(f"{{name}}=={{version(name)}}" for name in kept))
        found, added = other(), [name for name in missing if version(name)]
        origin = "FLASHLIB_SOURCE" if given else wheels[-1].name if wheels else source
        print(f"installed {{course}} from {{origin}}; kept this runtime's {{', '.join(kept) or 'nothing'}}"
              + (f"; added {{', '.join(added)}}" if added else ""))
    if found:
        raise RuntimeError(f"another package is importable as flashlib here, not this course's ({{course}}): {{found}}, "
                           "restart the runtime, then run this cell again")
    from flashlib.course import runtime
    print(runtime.describe())


_flashlib_setup()"""


def wanted_cells(notebook: str, repo: str | None) -> list:
    badge = nbformat.v4.new_markdown_cell(badge_source(notebook, repo), metadata={"tags": [TAG]})
    setup = nbformat.v4.new_code_cell(setup_source(repo), metadata={"tags": [TAG, DEVICE_TAG]})
    return [badge, setup]


def _tagged(cell) -> bool:
    return TAG in cell.get("metadata", {}).get("tags", [])


def _shape(cell) -> tuple:
    return cell.cell_type, cell.source, cell.get("metadata", {}).get("tags", [])


def in_step(nb, notebook: str, repo: str | None) -> bool:
    first = nb.cells[:2]
    wanted = wanted_cells(notebook, repo)
    return (len(first) == 2 and all(_tagged(c) for c in first)
            and [_shape(c) for c in first] == [_shape(c) for c in wanted]
            and not any(_tagged(c) for c in nb.cells[2:]))


def update(path: Path, repo: str | None) -> bool:
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
    repo = address()
    paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if args.check:
        stale = [p.name for p in paths if not in_step(nbformat.read(p, as_version=4), p.name, repo)]
        for name in stale:
            print(f"notebook_setup: {name}: its badge and setup cells are not in step with {repo or 'no address'} "
                  "(run python tools/notebook_setup.py, then make notebooks)")
        return 1 if stale else 0
    for path in paths:
        if update(path, repo):
            print(f"notebook_setup: {path.name} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
