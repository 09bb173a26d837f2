"""The notebook cells of each lab: a markdown cell with the task, and a code cell with the stub.

Both cells start with a marker naming the lab (``<!-- LAB: name -->`` and ``# LAB: name``), so
that ``tools/insert_lab_cells.py`` can put them at the end of their notebook (before the summary)
or replace them there, and the notebook test can find the stub and put the worked solution in
its place. The stub is made from the solution: its imports, its signature and docstring, and
``...`` for a body; it ends by calling ``labs.check``. A kernel lab's cell imports flashlib before
triton, so that it also runs as the first cell of a fresh kernel.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import linecache
from pathlib import Path

from .catalog import LABS
from .. import edition
from .core import has_solutions, lab, solution_source

MARKER = "# LAB: "
MARKDOWN_MARKER = "<!-- LAB: {name} -->"


_COUNT = ("no", "one", "two", "three")


def markdown_cell(name: str, *, solutions: bool | None = None, hints: int | None = None) -> str:
    """The lab's task; ``solutions`` (default: whether this edition has them) adds where the worked one is,
    ``hints`` (default: as many as this edition gives) how many hints there are."""
    spec = lab(name, "labs.cells.markdown_cell")
    solutions = has_solutions() if solutions is None else solutions
    hints = len(edition.given(spec.hints)) if hints is None else min(hints, len(spec.hints))
    where = f'; `labs.solution("{name}")` shows a worked solution.' if solutions else "."
    offer = (f'`labs.hint("{name}")` gives a hint ({_COUNT[hints]}, one at a time){where}' if hints else
             "This edition gives no hints: the checker's message says what is wrong.")
    return "\n".join([
        MARKDOWN_MARKER.format(name=name),
        f"## Lab: {spec.title}",
        "",
        spec.task,
        "",
        "```python",
        spec.signature,
        "```",
        "",
        f"The checker tries {', '.join(spec.tries)}, and names the mistake when it recognises one. {offer}",
    ])


def _parts(source: str):
    """(imports, the function with its decorators, the function's head down to its docstring) of a solution."""
    tree = ast.parse(source)
    lines = source.splitlines()
    imports = [ast.get_source_segment(source, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    start = min([d.lineno for d in fn.decorator_list] + [fn.lineno]) - 1
    head = lines[start:fn.body[0].end_lineno]  # decorators, def and the docstring
    return imports, "\n".join(lines[start:fn.end_lineno]), "\n".join(head)


def code_cell(name: str, *, solved: bool = False) -> str:
    """The lab's code cell: the stub, or with ``solved`` the worked solution, then the check."""
    spec = lab(name, "labs.cells.code_cell")
    imports, function, head = _parts(solution_source(name))
    body = function if solved else head + "\n    ...  # your code here"
    third_party = [i for i in imports if "flashlib" not in i]
    ours = sorted({i for i in imports if "flashlib" in i} | {"from flashlib import labs"})
    if spec.triton:  # flashlib first: it chooses how kernels run here before triton is imported
        ours[0] += "  # before triton: without a GPU, it switches on Triton's CPU interpreter"
        top = [*ours, "", *third_party]
    else:
        top = [*third_party, "", *ours]
    return "\n".join([MARKER + spec.name, *top, "", "", body, "", "", f'passed = labs.check("{name}", {name})'])


def lab_names(notebook: str) -> list[str]:
    """The labs at the end of ``notebook`` (its file name without .ipynb), in order."""
    return [spec.name for spec in LABS.values() if spec.notebook == notebook]


def marked(source: str) -> str | None:
    """The lab a cell belongs to, read from its marker, or None."""
    first = source.lstrip().split("\n", 1)[0].strip()
    if first.startswith(MARKER):
        return first[len(MARKER):].strip()
    if first.startswith("<!-- LAB: ") and first.endswith("-->"):
        return first[len("<!-- LAB: "):-len("-->")].strip()
    return None


def run_source(source: str, name: str, namespace: dict) -> None:
    """Run a cell's code in ``namespace`` as a notebook kernel would: its source findable (as IPython
    makes it), which Triton needs to compile a kernel the cell defines."""
    filename = f"<lab-cell-{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def run_cell(source: str, name: str = "lab") -> str:
    """Run a cell's code here as a notebook kernel would and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_source(source, name, {"__name__": "__main__"})
    return out.getvalue()


def yours(name: str) -> None:
    """Print the function you wrote in lab ``name``'s cell, read from its notebook as saved in this folder (the
    student edition shows it where the full edition shows the course's own)."""
    spec = lab(name, "labs.yours")
    path = Path(f"{spec.notebook}.ipynb")
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        print(f"{path} is not in this folder: your {name} is printed here once notebook {spec.notebook[:2]} is saved "
              "beside this one.")
        return
    sources = ["".join(c.get("source", "")) for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
    source = next((s for s in sources if marked(s) == name), "")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = ast.parse("")
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    body = found[0].body[1:] if found and ast.get_docstring(found[0]) is not None else (found[0].body if found else [])
    if not body or all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                       for s in body):
        print(f"The lab cell of {name} in {path} has no answer yet: write your {name} there, save the notebook, and "
              "run this cell again.")
        return
    print(ast.get_source_segment(source, found[0]))
