"""Write the student edition of the course: the notebooks and the package, with no worked solution.

    python tools/student_edition.py [OUT]          (make student: OUT = build/student)

OUT gets what a student needs to run the course (`make lab` there): the notebooks, the package,
the recorded runs, pyproject.toml, constraints.txt, environment.yml, the Makefile and the README.
Left out: flashlib/labs/solutions/ (and its entry in pyproject.toml's packages), so that
labs.solution and labs.reveal say this edition has none; in the notebooks, each lab's "After the lab"
cells, which print the course's own code once the lab passes. Each lab's task says only that
labs.hint gives hints; its code cell is the stub; its checker and hints are the full edition's.
Running it twice gives the same tree.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashlib.labs import cells  # noqa: E402

FILES = ("pyproject.toml", "constraints.txt", "environment.yml", "Makefile", "README.md", "LICENSE")
FOLDERS = ("flashlib", "notebooks", "data")
LEFT_OUT = ("__pycache__", "*.egg-info", ".ipynb_checkpoints", ".flashlib-progress.json")
SOLUTIONS = Path("flashlib") / "labs" / "solutions"
README_NOTE = ("> **Student edition.** This copy of the course has no worked solutions: `labs.hint(name)` gives "
               "a lab's hints, one at a time, and `labs.check(name, fn)` says what is wrong.\n\n")


def _copy(out: Path) -> None:
    for name in FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, out / name)
    for name in FOLDERS:
        shutil.copytree(ROOT / name, out / name, ignore=shutil.ignore_patterns(*LEFT_OUT))
    shutil.rmtree(out / SOLUTIONS)


def _pyproject(out: Path) -> None:
    path = out / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    package = re.compile(r'\s*"flashlib\.labs\.solutions",')
    if not package.search(text):
        raise SystemExit("pyproject.toml no longer lists flashlib.labs.solutions: update tools/student_edition.py")
    path.write_text(package.sub("", text, count=1), encoding="utf-8")


def _readme(out: Path) -> None:
    path = out / "README.md"
    text = path.read_text(encoding="utf-8")
    title, _, rest = text.partition("\n\n")
    path.write_text(f"{title}\n\n{README_NOTE}{rest}", encoding="utf-8")


def _is_reveal(cell) -> bool:
    return "-reveal" in (cell.get("id") or "") or (cell.cell_type == "code" and "labs.reveal(" in cell.source)


def student_notebook(nb):
    """The notebook as a student gets it: no "After the lab" cells, each lab's task without a solution."""
    nb.cells = [c for c in nb.cells if not _is_reveal(c)]
    for cell in nb.cells:
        name = cells.marked(cell.source)
        if name is None:
            continue
        if cell.cell_type == "markdown":
            cell.source = cells.markdown_cell(name, solutions=False)
        elif cell.source != cells.code_cell(name):
            raise SystemExit(f"the cell of lab {name} is not its stub: run python tools/insert_lab_cells.py")
    return nb


def build(out: Path) -> Path:
    """Write the student edition into ``out`` (replacing what is there); return it."""
    out = Path(out)
    if out.resolve() in (ROOT, *ROOT.parents):
        raise SystemExit(f"argument OUT is {out}, which holds the course itself: choose a new folder")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _copy(out)
    _pyproject(out)
    _readme(out)
    for path in sorted((out / "notebooks").glob("*.ipynb")):
        nb = student_notebook(nbformat.read(path, as_version=4))
        nbformat.validate(nb)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            nbformat.write(nb, f)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "build" / "student",
                        help="the folder to write (default build/student)")
    args = parser.parse_args(argv)
    print(f"student edition written to {build(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
