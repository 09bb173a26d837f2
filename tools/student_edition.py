"""Write the student edition of the course: the notebooks and the package, with no worked solution.

    python tools/student_edition.py [OUT] [--hints N]     (make student: OUT = build/student, N = 2)

OUT gets what a student needs to run the course (`make lab` there): the notebooks, the package,
the recorded runs, pyproject.toml, constraints.txt, environment.yml, the Makefile and a README of
its own. Left out: flashlib/labs/solutions/ (the labs' worked solutions, and its entry in
pyproject.toml's packages) and flashlib/course/answers.py (the exercises' worked answers), so that labs.solution,
labs.reveal and the exercises' solution() say this edition has none; in the notebooks, each lab's "After the
lab" cells, which print the course's own code once the lab passes, and the sentences that promise them; in
notebook 06, the course's loop of notebook 03 (its lab's answer), replaced by the student's own (labs.yours).
Each lab's task says only that labs.hint gives hints; its code cell is the stub. Labs and exercises give at
most N hints (flashlib/edition.py's HINTS), and the package's files hold no more (a lab's and an exercise's
later hints are emptied there): the last of a lab's three is close to code, so 2 by default stops before it;
the teacher chooses. The package is the grader's own edition copy (flashlib.labs.sandbox.package_copy).
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

import notebook_setup  # noqa: E402
from flashlib.labs import cells  # noqa: E402
from flashlib.labs.sandbox import package_copy  # noqa: E402

FILES = ("pyproject.toml", "constraints.txt", "environment.yml", "Makefile", "README.md", "LICENSE")
FOLDERS = ("notebooks", "data")
LEFT_OUT = ("__pycache__", "*.egg-info", ".ipynb_checkpoints", ".flashlib-progress.json")
HINTS = 2  # by default: a lab's third hint is close to code
# the edition's own address (its badges and setup cells install it, never the full course): unpublished
# until the teacher gives one (--address https://github.com/<owner>/<repo>)
UNPUBLISHED = "https://unpublished.invalid/flashlib-course-student-edition"
# sentences of the full edition that promise what the edition leaves out ("After the lab" cells): each
# must be found, so that a rewording of the notebook is noticed here
PROSE = {"06_fused_forward": [("so its code is printed after the lab.", "so its code is yours to write."),
                              ("What the loop has to do is notebook 03's inner loop, one key tile per trip, whose tile "
                               "update is `_online_update`:", "What the loop has to do is notebook 03's inner loop, one "
                               "key tile per trip: the one you wrote in its lab, as you saved notebook 03 beside this "
                               "one:")],
         "07_backward_kernels": [("so its code is printed after the lab:", "so its code is yours to write:"),
                                 ("so it too is printed after the lab; here is the program around it:",
                                  "so it is not shown either; here is the program around it:")]}
README = """# FlashAttention, tile by tile: the student edition

A Jupyter course that takes you from dense attention through online softmax and tiling to a fused
Triton FlashAttention kernel, forward and backward, and on to what practice needs. This edition is the
one your teacher handed out: it has the notebooks and the `flashlib` package they import, and no worked
solutions.

## Start

```sh
make lab
```

sets up a virtual environment in `.venv` (Python 3.11 or newer) and starts JupyterLab on `notebooks/`.
Open `01_dense_attention.ipynb` and run the cells in order. Notebooks 01–04 and 11 need only PyTorch;
05–10, 12–14 and A need Triton (Linux, or WSL2 on Windows); without a GPU its kernels run on the CPU
through Triton's interpreter.

## Labs and exercises

Each lab is a cell whose first line is `# LAB: name`: write the function it names, run the cell, and
`labs.check` says whether it is right or which mistake it sees. `labs.hint(name)` gives a hint, one at a
time ({hints} per lab in this edition); an exercise's checker gives the next hint after each wrong try.
`labs.progress()` lists the labs you have passed. The checker compares your function with the
definitions, never with the course's own code: handing in the course's functions is refused.

## Handing in

Save each notebook (File > Save) and hand in the `notebooks/` folder as your teacher asks. Your teacher
grades the saved files: every lab and checked exercise cell is run again on its own, after only the
import lines of the cells before it, so a cell must define everything it checks.
"""


# cells that show another lab's answer, by notebook and cell id: what the edition shows there instead
CELLS = {"06_fused_forward": {"ad35e1d4-07": 'from flashlib import labs\n\nlabs.yours("tiled_forward")  # notebook 03\'s lab'}}


def _copy(out: Path, hints: int) -> None:
    for name in FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, out / name)
    for name in FOLDERS:
        shutil.copytree(ROOT / name, out / name, ignore=shutil.ignore_patterns(*LEFT_OUT))
    package_copy(out, ROOT / "flashlib", hints=hints, compiled=False)


def _pyproject(out: Path) -> None:
    path = out / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    package = re.compile(r'\s*"flashlib\.labs\.solutions",')
    if not package.search(text):
        raise SystemExit("pyproject.toml no longer lists flashlib.labs.solutions: update tools/student_edition.py")
    path.write_text(package.sub("", text, count=1), encoding="utf-8")


def _readme(out: Path, hints: int) -> None:
    (out / "README.md").write_text(README.format(hints=hints), encoding="utf-8")


def _edition(out: Path, hints: int) -> None:
    """The edition's own flashlib/edition.py: at most ``hints`` hints per lab and exercise."""
    path = out / "flashlib" / "edition.py"
    text = path.read_text(encoding="utf-8")
    line = re.compile(r"^HINTS: int \| None = None(.*)$", re.M)
    if not line.search(text):
        raise SystemExit("flashlib/edition.py no longer sets HINTS = None: update tools/student_edition.py")
    path.write_text(line.sub(f"HINTS: int | None = {hints}\\1", text, count=1), encoding="utf-8")


def _address(out: Path, address: str) -> str | None:
    """Write the edition's own address into its pyproject.toml; the address as notebook_setup reads it."""
    path = out / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    line = re.compile(r'^Repository = ".*"$', re.M)
    if not line.search(text):
        raise SystemExit("pyproject.toml no longer has [project.urls] Repository: update tools/student_edition.py")
    path.write_text(line.sub(f'Repository = "{address}"', text, count=1), encoding="utf-8")
    return notebook_setup.address(path)  # stops, saying what to write, on an address it cannot use


def _prose(name: str, nb) -> None:
    for old, new in PROSE.get(name, ()):
        found = [c for c in nb.cells if c.cell_type == "markdown" and old in c.source]
        if not found:
            raise SystemExit(f"notebooks/{name}.ipynb no longer says {old!r}: update tools/student_edition.py's PROSE")
        for cell in found:
            cell.source = cell.source.replace(old, new)


def _cells(name: str, nb) -> None:
    for cell_id, source in CELLS.get(name, {}).items():
        found = [c for c in nb.cells if c.get("id") == cell_id]
        if not found:
            raise SystemExit(f"notebooks/{name}.ipynb has no cell {cell_id}: update tools/student_edition.py's CELLS")
        found[0].source, found[0].outputs, found[0].execution_count = source, [], None


def _is_reveal(cell) -> bool:
    return "-reveal" in (cell.get("id") or "") or (cell.cell_type == "code" and "labs.reveal(" in cell.source)


def student_notebook(nb, name: str = "", hints: int = HINTS):
    """The notebook as a student gets it: no "After the lab" cells nor sentences promising them, each lab's
    task without a solution."""
    nb.cells = [c for c in nb.cells if not _is_reveal(c)]
    _prose(name, nb)
    _cells(name, nb)
    for cell in nb.cells:
        name = cells.marked(cell.source)
        if name is None:
            continue
        if cell.cell_type == "markdown":
            cell.source = cells.markdown_cell(name, solutions=False, hints=hints)
        elif cell.source != cells.code_cell(name):
            raise SystemExit(f"the cell of lab {name} is not its stub: run python tools/insert_lab_cells.py")
    return nb


def build(out: Path, hints: int = HINTS, address: str = UNPUBLISHED) -> Path:
    """Write the student edition into ``out`` (replacing what is there), giving at most ``hints`` hints per
    lab and exercise, its badges and setup cells pointing at ``address`` (its own); return it."""
    if isinstance(hints, bool) or not isinstance(hints, int) or not 0 <= hints <= 3:
        raise SystemExit(f"argument --hints is {hints!r}; expected a number of hints from 0 to 3")
    out = Path(out)
    if out.resolve() in (ROOT, *ROOT.parents):
        raise SystemExit(f"argument OUT is {out}, which holds the course itself: choose a new folder")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _copy(out, hints)
    _pyproject(out)
    _readme(out, hints)
    _edition(out, hints)
    repo = _address(out, address)
    for path in sorted((out / "notebooks").glob("*.ipynb")):
        notebook_setup.update(path, repo)  # the edition's badge and setup cell: they install the edition
        nb = student_notebook(nbformat.read(path, as_version=4), path.stem, hints)
        nbformat.validate(nb)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            nbformat.write(nb, f)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "build" / "student",
                        help="the folder to write (default build/student)")
    parser.add_argument("--hints", type=int, default=HINTS,
                        help=f"hints a lab or exercise gives at most, 0 to 3 (default {HINTS}: a lab's third is "
                             "close to code)")
    parser.add_argument("--address", default=UNPUBLISHED,
                        help="the edition's own public address, https://github.com/<owner>/<repo> (default: "
                             "unpublished; its notebooks then say how to bring the edition's wheel in)")
    args = parser.parse_args(argv)
    print(f"student edition written to {build(args.out, args.hints, args.address)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
