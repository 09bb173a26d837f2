"""The grader: every lab and checked exercise cell of saved notebooks, each run in a fresh kernel.

    python -m flashlib labs grade NOTEBOOK... [--json FILE] [--timeout SECONDS]

A graded cell is a lab's cell (its first line ``# LAB: name``) or an exercise cell (one that calls
``<module>.check_<name>(...)``). Each runs alone in a fresh Jupyter kernel of this Python, started in
the notebook's folder, after the import statements of the notebook's earlier cells (and nothing else
of them): what is graded is what the student saved, never their kernel. A cell passes when the first
verdict it prints says PASS; a cell that prints NOT YET, prints no verdict or raises does not. The
table has one row per cell: notebook, lab, passed or not, the checker's first line, seconds.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..course.exercises import PASS, RETRY
from .cells import marked

_EXERCISE = re.compile(r"^[^#\n]*?\b\w+\.check_(\w+)\(", re.M)
SETUP_TAG = "flashlib-setup"  # the first cells that install flashlib on a bare runtime: never graded or replayed


@dataclass
class Grade:
    notebook: str
    lab: str
    passed: bool
    message: str
    seconds: float


def graded_cells(nb) -> list[tuple[str, str, str]]:
    """(name, the imports of the cells before it, its source) of every graded cell of notebook ``nb``."""
    found, imports = [], []
    for cell in nb.cells:
        if cell.cell_type != "code" or SETUP_TAG in cell.metadata.get("tags", []):
            continue
        name = marked(cell.source)
        exercise = _EXERCISE.search(cell.source)
        if name is not None or exercise is not None:
            found.append((name or exercise.group(1), "\n".join(imports), cell.source))
        imports += _imports(cell.source)
    return found


def _imports(source: str) -> list[str]:
    """The top-level import statements of a cell (IPython's % lines left out)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    return [ast.get_source_segment(code, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def verdict(outputs) -> tuple[bool, str]:
    """(passed, message) from a cell's outputs: the first PASS / NOT YET line it printed, or what it raised."""
    text = []
    for output in outputs:
        if output.output_type == "error":
            said = str(output.evalue).strip().splitlines()
            return False, f"the cell raised {output.ename}: {said[0] if said else ''}"
        if output.output_type == "stream" and output.name == "stdout":
            text.append(output.text)
        elif output.output_type == "execute_result":
            text.append(output.get("data", {}).get("text/plain", "") + "\n")
    for line in "".join(text).splitlines():
        if line.startswith(PASS) or line.startswith(RETRY):
            return line.startswith(PASS), line.strip()
    return False, "the cell printed no verdict (PASS or NOT YET)"


def _kernel_manager():
    """A kernel manager whose 'python3' is this Python (not whatever a user registered under that name)."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3 (ipykernel)", language="python", resource_dir="")

    class Manager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _this_python(self):
            return ThisPython(data_dir=self.data_dir)

    return Manager


def _environment() -> dict:
    env = dict(os.environ)
    # a learner's fresh kernel has no TRITON_INTERPRET of ours: flashlib, imported here, may have set it
    env.pop("TRITON_INTERPRET", None)
    env["FLASHLIB_PROGRESS"] = "off"  # grading writes nothing beside the student's notebooks
    return env


def run_cell(source: str, imports: str, folder: Path, timeout: int) -> tuple[bool, str, float]:
    """(passed, message, seconds) of ``source`` run after ``imports`` in a fresh kernel started in ``folder``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    cells = ([nbformat.v4.new_code_cell(imports)] if imports else []) + [nbformat.v4.new_code_cell(source)]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            kernel_manager_class=_kernel_manager())
    start = time.perf_counter()
    try:
        client.execute(env=_environment(), cwd=str(folder))
    except CellTimeoutError:
        return False, f"the cell ran past {timeout} s", time.perf_counter() - start
    except DeadKernelError as error:
        return False, f"the kernel died: {error}", time.perf_counter() - start
    return (*verdict(nb.cells[-1].outputs), time.perf_counter() - start)


def grade(paths, *, timeout: int = 600, log=None) -> list[Grade]:
    """Grade every lab and checked exercise cell of the notebooks at ``paths``, in order."""
    import nbformat

    grades = []
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        for name, imports, source in graded_cells(nb):
            passed, message, seconds = run_cell(source, imports, path.resolve().parent, timeout)
            grades.append(Grade(path.name, name, passed, message, round(seconds, 1)))
            if log is not None:
                log(grades[-1])
    return grades


def table(grades: list[Grade]) -> str:
    """The grades as a text table, with a count of the cells passed."""
    width = max([len(g.notebook) for g in grades] + [len("notebook")])
    lab_width = max([len(g.lab) for g in grades] + [len("lab")])
    lines = [f"{'notebook':<{width}}  {'lab':<{lab_width}}  {'passed':<6}  {'seconds':>7}  message"]
    for g in grades:
        lines.append(f"{g.notebook:<{width}}  {g.lab:<{lab_width}}  {'yes' if g.passed else 'no':<6}  "
                     f"{g.seconds:>7.1f}  {g.message}")
    lines.append(f"{sum(g.passed for g in grades)} of {len(grades)} graded cells passed.")
    return "\n".join(lines)


def main(notebooks, json_path=None, timeout: int = 600) -> int:
    """The command line's ``labs grade``: 0 once every cell was graded, whatever the grades; 2 on bad input."""
    for path in notebooks:
        if not Path(path).is_file() or not str(path).endswith(".ipynb"):
            print(f"labs grade: argument NOTEBOOK {str(path)!r} is not a notebook file (.ipynb)", file=sys.stderr)
            return 2
    grades = grade(notebooks, timeout=timeout)
    print(table(grades))
    if json_path is not None:
        Path(json_path).write_text(json.dumps([asdict(g) for g in grades], indent=1) + "\n", encoding="utf-8")
    return 0
