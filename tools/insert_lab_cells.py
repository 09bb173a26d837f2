"""Put each lab's two cells (the task, the stub) at the end of its notebook, before the summary.

    python tools/insert_lab_cells.py                       every notebook that has a lab
    python tools/insert_lab_cells.py notebooks/03_tiled_attention.ipynb [...]

The cells come from ``flashlib.labs.cells``; each starts with a marker naming its lab. A lab
whose cells are already in the notebook has them replaced where they are; otherwise they go
just before the markdown cell that starts with "## Summary" (at the end when there is none), in
the order of ``flashlib.labs.LABS``. Running it twice changes nothing. The stub cell's stored
output is what its check prints ("NOT YET: no answer yet; ..."), computed here, so that nbval
passes without re-executing the notebook.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashlib.kernels  # noqa: E402,F401  chooses Triton's interpreter before anything imports triton
from flashlib.labs import LABS, cells  # noqa: E402

SUMMARY = "## Summary"


def lab_cells(name: str) -> list:
    """The markdown and code cells of lab ``name``, the code cell with its stored output."""
    code = cells.code_cell(name)
    output = nbformat.v4.new_output("stream", name="stdout", text=cells.run_cell(code, name))
    return [nbformat.v4.new_markdown_cell(cells.markdown_cell(name), id=f"lab-{name}-task"),
            nbformat.v4.new_code_cell(code, id=f"lab-{name}-code", outputs=[output])]


def _place(nb, name: str, new: list) -> str:
    at = [i for i, cell in enumerate(nb.cells) if cells.marked(cell.source) == name]
    if at:
        start, stop, done = at[0], at[-1] + 1, "replaced"
    else:
        start = stop = next((i for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
                             and cell.source.lstrip().startswith(SUMMARY)), len(nb.cells))
        done = "inserted before the summary" if start < len(nb.cells) else "appended"
    # nbval refuses a stored output without an execution count: give the one a run in order would
    new[1].execution_count = 1 + max((c.execution_count or 0 for c in nb.cells[:start] if c.cell_type == "code"),
                                     default=0)
    nb.cells[start:stop] = new
    return done


def insert(path: Path) -> list[str]:
    """Insert or refresh the lab cells of the notebook at ``path``; return what was done, one line a lab."""
    names = cells.lab_names(path.stem)
    if not names:
        return [f"{path.name}: no lab ends this notebook"]
    nb = nbformat.read(path, as_version=4)
    done = [f"{path.name}: {name} {_place(nb, name, lab_cells(name))}" for name in names]
    nbformat.validate(nb)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        nbformat.write(nb, f)
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to change (default: every notebook of notebooks/ that has a lab)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted({ROOT / "notebooks" / f"{spec.notebook}.ipynb" for spec in LABS.values()})
    for path in paths:
        if not path.exists():
            print(f"{path}: no such notebook", file=sys.stderr)
            return 2
        print("\n".join(insert(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
