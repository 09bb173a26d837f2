"""The grader: every lab and checked exercise of a class's saved notebooks, judged apart from the students' code.

    python -m flashlib labs grade PATH... [--out DIR] [--csv FILE] [--json FILE] [--wide FILE] [--feedback DIR]
                                  [--roster FILE] [--assignment NOTEBOOK...] [--jobs N] [--timeout S] [--memory MIB]

PATH is a notebook, a student's folder of notebooks, or a class's folder of student folders (at any depth): a
student is a folder, named by its path below the PATH given (or its own name). The assignment is the graded
cells of the course's notebooks of those names (``--assignment`` names them), each worth its points
(:mod:`.gradebook`); a student's first cell for each is graded, in a sandboxed process of its own
(:mod:`.judge`, :mod:`.zygote`, :mod:`.sandbox`), after the import statements of the notebook's earlier cells
and nothing else of them, stopped at a time and a memory limit. What is graded is what the student saved.

The first line says whether the cells ran sandboxed. A row is printed as each cell finishes (and appended to
``--csv``); the table, the totals and the files follow. The exit status is 1 when any cell could not be graded,
2 on bad input, 0 otherwise.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import re
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import gradebook
from .cells import marked
from .gradebook import Gradebook, Item, Row
from .judge import Cell, Outcome, Worker
from .sandbox import PACKAGE, Sandbox, find, package_copy
from .zygote import CHECKER_MODULES

_EXERCISE = re.compile(r"^[^#\n]*?\b(\w+)\.check_(\w+)\(", re.M)
SETUP_TAG = "flashlib-setup"  # the first cells that install flashlib on a bare runtime: never graded or replayed
NOTEBOOKS = PACKAGE.parent / "notebooks"  # the course's notebooks: what an assignment's items are
TIMEOUT_S = 600
MEMORY_MIB = 4096  # private memory of a cell's processes together: a kernel lab in the CPU interpreter takes ~1 GiB


@dataclass(frozen=True)
class Found:
    """A graded cell of a notebook: the item it is, its source, the imports of the cells before it."""

    name: str
    kind: str
    source: str
    imports: str
    module: str | None = None  # an exercise's checker module, as the notebook's imports name it
    arity: tuple[int, tuple[str, ...]] | None = None  # the checker call's (positional arguments, keywords)


def graded_cells(nb) -> list[Found]:
    """Every graded cell of notebook ``nb``, in order."""
    found, imports = [], []
    for cell in nb.cells:
        if cell.cell_type != "code" or SETUP_TAG in cell.metadata.get("tags", []):
            continue
        name, exercise = marked(cell.source), _EXERCISE.search(cell.source)
        if name is not None:
            found.append(Found(name, "lab", cell.source, "\n".join(imports)))
        elif exercise is not None:
            alias, check = exercise.groups()
            module = _aliases("\n".join(imports + _imports(cell.source))).get(alias)
            found.append(Found(check, "exercise", cell.source, "\n".join(imports),
                               module if module in CHECKER_MODULES else None, _arity(cell.source, check)))
        imports += _imports(cell.source)
    return found


def _code(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _imports(source: str) -> list[str]:
    """The top-level import statements of a cell (IPython's % lines left out)."""
    code = _code(source)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    return [ast.get_source_segment(code, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def _aliases(imports: str) -> dict[str, str]:
    """{name bound: the module it is} for the import statements given."""
    found = {}
    for node in ast.parse(imports or "").body:
        for alias in getattr(node, "names", ()):
            if isinstance(node, ast.Import):
                found[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
            elif node.level == 0 and node.module:
                found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def _arity(source: str, name: str):
    try:
        tree = ast.parse(_code(source))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == f"check_{name}":
            return len(node.args), tuple(k.arg for k in node.keywords if k.arg)
    return None


def submissions(paths) -> dict[str, tuple[str, list[Path]]]:
    """{student: (their folder, their notebooks)} under ``paths``; checkpoints (.ipynb_checkpoints) left out."""
    found: dict[str, tuple[str, list[Path]]] = {}
    for arg in map(Path, paths):
        notebooks = [arg] if arg.is_file() else sorted(p for p in arg.rglob("*.ipynb")
                                                       if ".ipynb_checkpoints" not in p.parts)
        for nb in notebooks:
            below = nb.parent.relative_to(arg) if arg.is_dir() else Path(".")
            student = str(below) if str(below) != "." else nb.parent.resolve().name
            found.setdefault(student, (str(nb.parent), []))[1].append(nb)
    return found


def _read(path: Path):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001  a file the student broke: no cell of it can be graded
        return None


def assignment(students: dict, names=None, course: Path = NOTEBOOKS) -> tuple[list[Item], dict[str, Found]]:
    """The items of the assignment (the course's notebooks named, else those handed in) and, for each, the
    course's own cell where there is one."""
    stems = list(dict.fromkeys(Path(n).stem for n in names)) if names else \
        sorted({nb.stem for _, notebooks in students.values() for nb in notebooks})
    items, course_cells = [], {}
    for stem in stems:
        own = course / f"{stem}.ipynb"
        sources = [own] if own.is_file() else [nb for _, nbs in students.values() for nb in nbs if nb.stem == stem]
        for path in sources:
            for cell in graded_cells(_read(path) or _empty()):
                item = Item(stem, cell.name, cell.kind, gradebook.points(cell.kind, cell.name))
                if item.id not in course_cells and _known(cell):
                    items.append(item)
                    course_cells[item.id] = cell
    return items, course_cells


def _known(cell: Found) -> bool:
    from .catalog import LABS

    return cell.kind == "exercise" or cell.name in LABS


def _empty():
    import nbformat

    return nbformat.v4.new_notebook()


@dataclass
class Task:
    row: Row
    cell: Cell | None  # None: nothing to run (the row is final)


def tasks(students: dict, roster, items, course_cells, sandboxed: bool) -> list[Task]:
    """One task per student and item (and per extra cell of an item, a duplicate): in roster order."""
    order = list(dict.fromkeys([*(roster or ()), *sorted(students)]))
    out = []
    for student in order:
        folder, notebooks = students.get(student, ("", []))
        by_stem = {}
        for nb in notebooks:
            by_stem.setdefault(nb.stem, nb)
        read = {stem: _read(path) for stem, path in by_stem.items()}
        for item in items:
            base = Row(student, item.id, item.notebook, item.name, item.kind, 0, item.points, False, "missing", "",
                       folder=folder, sandboxed=sandboxed)
            out += _item_tasks(base, item, by_stem.get(item.notebook), read.get(item.notebook), course_cells,
                               student in students)
    return out


def _item_tasks(base: Row, item: Item, path, nb, course_cells, submitted: bool) -> list[Task]:
    if not submitted:
        return [Task(replace(base, status="no submission", message="no folder of notebooks handed in"), None)]
    if path is None:
        return [Task(replace(base, message=f"{item.notebook}.ipynb was not handed in"), None)]
    if nb is None:
        return [Task(replace(base, status="graded", message=f"{path.name} could not be read as a notebook"), None)]
    mine = [c for c in graded_cells(nb) if (c.name, c.kind) == (item.name, item.kind)]
    if not mine:
        return [Task(replace(base, message=f"no cell of {item.name} in {path.name} (a deleted cell scores 0)"), None)]
    course = course_cells.get(item.id)
    text = path.read_text(encoding="utf-8", errors="replace")
    first = mine[0]
    cell = Cell(item.kind, item.name, first.source, first.imports, path.name, text,
                course.module if course else None, course.arity if course else None)
    digest = hashlib.sha256(first.source.encode()).hexdigest()
    out = [Task(replace(base, status="graded", source_sha256=digest), cell)]
    for extra in mine[1:]:
        out.append(Task(replace(base, possible=0, status="duplicate", source_sha256=hashlib.sha256(
            extra.source.encode()).hexdigest(), message=f"another cell of {item.name}: only the first is graded"),
            None))
    return out


def preload(course_cells: dict) -> list[str]:
    """The modules the assignment's cells import (what a worker imports once, before its forks)."""
    names = []
    for cell in course_cells.values():
        for node in ast.parse(cell.imports or "").body:
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return list(dict.fromkeys(n for n in names if n.split(".")[0] not in ("IPython", "google")))


@contextlib.contextmanager
def course_copy(excluded=()):
    """(the folder holding the student edition's package, the sandbox) for one grading run."""
    with tempfile.TemporaryDirectory(prefix="flashlib-grade-") as scratch:
        package_copy(Path(scratch))
        yield Path(scratch), find(Path(scratch), excluded)


def _finished(task: Task, outcome: Outcome) -> Row:
    return replace(task.row, passed=outcome.passed, points=task.row.possible if outcome.passed else 0,
                   status=outcome.status, message=outcome.message, mistake=outcome.mistake,
                   seconds=round(outcome.seconds, 2), graded_at=gradebook.now())


def judged(task: Task, worker: Worker, timeout: float, memory_mib: float) -> Row:
    """The task's row once ``worker`` has run its cell and the judge has checked it (a task with no cell: its
    row as it is)."""
    if task.cell is None:
        return task.row
    try:
        outcome = worker.grade(task.cell, timeout, memory_mib)
    except RuntimeError as error:  # the worker could not start
        outcome = Outcome(False, f"not graded: {error}", status="error")
    return _finished(task, outcome)


def run(work: list[Task], sandbox: Sandbox, package_dir: Path, modules, *, jobs: int, timeout: float,
        memory_mib: float, done=None) -> list[Row]:
    """Grade the tasks' cells, ``jobs`` at a time; ``done(row)`` as each finishes; the rows in task order."""
    local, workers, lock = threading.local(), [], threading.Lock()

    def one(task: Task) -> Row:
        worker = getattr(local, "worker", None)
        if worker is None:
            worker = local.worker = Worker(sandbox, package_dir, modules)
            with lock:
                workers.append(worker)
        return judged(task, worker, timeout, memory_mib)

    rows = [task.row for task in work]
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(one, task): i for i, task in enumerate(work) if task.cell is not None}
            for future in as_completed(futures):
                rows[futures[future]] = future.result()
                if done is not None:
                    done(rows[futures[future]])
    finally:
        for worker in workers:
            worker.stop()
    return rows


def grade(paths, *, timeout: float = TIMEOUT_S, memory_mib: float = MEMORY_MIB, jobs: int = 1, roster=None,
          names=None, done=None, sandbox: Sandbox | None = None, package_dir: Path | None = None) -> Gradebook:
    """Grade the class under ``paths``; ``roster`` (ids) adds students with no folder, ``names`` fixes the
    assignment's notebooks."""
    if sandbox is None or package_dir is None:
        with course_copy(paths) as (package_dir, sandbox):
            return grade(paths, timeout=timeout, memory_mib=memory_mib, jobs=jobs, roster=roster, names=names,
                         done=done, sandbox=sandbox, package_dir=package_dir)
    students = submissions(paths)
    items, course_cells = assignment(students, names)
    work = tasks(students, roster, items, course_cells, sandbox.sandboxed)
    rows = run(work, sandbox, package_dir, preload(course_cells), jobs=jobs, timeout=timeout, memory_mib=memory_mib,
               done=done)
    return Gradebook(items, rows, list(dict.fromkeys([*(roster or ()), *sorted(students)])), sandbox.why,
                     sandbox.sandboxed)


def _bad_input(paths, jobs: int, roster_path) -> str | None:
    for path in paths:
        p = Path(path)
        if not (p.is_dir() or (p.is_file() and p.suffix == ".ipynb")):
            return f"argument PATH {str(path)!r} is neither a notebook file (.ipynb) nor a folder"
    if jobs < 1:
        return f"--jobs must be at least 1, got {jobs}"
    if roster_path is not None and not Path(roster_path).is_file():
        return f"--roster {str(roster_path)!r} is not a file"
    return None


class Progress:
    """A progress bar on a terminal (a line per cell elsewhere), and each finished row appended to the long CSV."""

    def __init__(self, total: int, csv_path=None):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="cell", file=sys.stderr, disable=None, dynamic_ncols=True)
        self.count, self.total, self.file, self.writer = 0, total, None, None
        if csv_path is not None:
            import csv

            self.file = open(csv_path, "w", newline="", encoding="utf-8")
            self.writer = csv.DictWriter(self.file, fieldnames=gradebook.LONG_FIELDS)
            self.writer.writeheader()

    def __call__(self, row: Row) -> None:
        self.count += 1
        self.bar.update(1)
        if self.bar.disable:
            print(f"[{self.count}/{self.total}] {row.student} {row.item}: {row.points:g}/{row.possible} "
                  f"({row.status}, {row.seconds} s)", file=sys.stderr, flush=True)
        if self.writer is not None:
            self.writer.writerow(asdict(row))
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def main(paths, json_path=None, timeout: int = TIMEOUT_S, *, csv_path=None, jobs: int = 1,
         memory_mib: float = MEMORY_MIB, wide_path=None, feedback_dir=None, out_dir=None, roster_path=None,
         names=None) -> int:
    """The command line's ``labs grade``: 0 once every cell was graded, 1 if any could not be, 2 on bad input."""
    problem = _bad_input(paths, jobs, roster_path)
    if problem is not None:
        print(f"labs grade: {problem}", file=sys.stderr)
        return 2
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        csv_path, json_path = csv_path or out / "rows.csv", json_path or out / "grades.json"
        wide_path, feedback_dir = wide_path or out / "grades.csv", feedback_dir or out / "feedback"
    outputs = [p for p in (json_path, csv_path, wide_path, feedback_dir, out_dir) if p is not None]
    roster = gradebook.read_roster(roster_path) if roster_path is not None else None
    students = submissions(paths)
    with course_copy([*paths, *outputs, *([roster_path] if roster_path else [])]) as (package_dir, sandbox):
        print(f"labs grade: {sandbox.why}", flush=True)
        items, course_cells = assignment(students, names)
        work = tasks(students, roster, items, course_cells, sandbox.sandboxed)
        progress = Progress(sum(t.cell is not None for t in work), csv_path)
        try:
            rows = run(work, sandbox, package_dir, preload(course_cells), jobs=jobs, timeout=timeout,
                       memory_mib=memory_mib, done=progress)
        finally:
            progress.close()
    book = Gradebook(items, rows, list(dict.fromkeys([*(roster or ()), *sorted(students)])), sandbox.why,
                     sandbox.sandboxed)
    if not items:
        print("labs grade: no graded cell (no lab or checked exercise) in the notebooks given", file=sys.stderr)
    print(gradebook.table(book))
    for path, write in ((csv_path, gradebook.write_long_csv), (json_path, gradebook.write_json),
                        (wide_path, gradebook.write_wide_csv), (feedback_dir, gradebook.write_feedback)):
        if path is not None:
            write(book, path)
    return 1 if book.ungraded() else 0
