"""The grader: every lab and checked exercise cell of a class's saved notebooks, each in a process of its own.

    python -m flashlib labs grade PATH... [--json FILE] [--csv FILE] [--jobs N] [--timeout S] [--memory MIB]

PATH is a notebook, a student's folder of notebooks, or a class's folder of student folders (one folder
per student, at any depth). A graded cell is a lab's cell (its first line ``# LAB: name``) or an exercise
cell (one that calls ``<module>.check_<name>(...)``). Each runs alone (:mod:`flashlib.labs.gradecell`):
in a fresh Python process, in an empty folder of its own holding a copy of the notebook only, with the
course's own flashlib (never one beside the submission), after the import statements of the notebook's
earlier cells and nothing else of them, stopped at a time limit and a memory limit. What is graded is
what the student saved, never their kernel.

A cell passes only when the checker of the lab or exercise it is graded as reported a pass
(:mod:`flashlib.course.verdicts`): a printed "PASS", a checker of the student's own, or another lab's
checker earns nothing. Each row: the student (the submission's folder), the notebook, the lab, passed or
not, the checker's first line, the named mistake, seconds. The table and the CSV end each student with a
total; ``--json`` writes the rows as a list of objects.
"""
from __future__ import annotations

import ast
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .cells import marked

_EXERCISE = re.compile(r"^[^#\n]*?\b\w+\.check_(\w+)\(", re.M)
SETUP_TAG = "flashlib-setup"  # the first cells that install flashlib on a bare runtime: never graded or replayed
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the folder holding the course's flashlib
TIMEOUT_S = 600
MEMORY_MIB = 4096  # a cell's resident memory at most: a kernel lab in the CPU interpreter takes about 1 GiB
POLL_S = 0.1


@dataclass
class Grade:
    student: str
    notebook: str
    lab: str
    passed: bool
    message: str
    mistake: str | None
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


def submissions(paths) -> list[tuple[str, Path]]:
    """(student, notebook) for every notebook under ``paths``: a notebook's student is its folder, as
    given or below a folder given; checkpoints (.ipynb_checkpoints) are left out."""
    found = []
    for arg in map(Path, paths):
        if arg.is_file():
            found.append((str(arg.parent), arg))
            continue
        for nb in sorted(arg.rglob("*.ipynb")):
            if ".ipynb_checkpoints" not in nb.parts:
                found.append((str(nb.parent), nb))
    return found


def verdict(result: dict, name: str) -> tuple[bool, str, str | None]:
    """(passed, message, mistake) from what a graded cell's process reported, for the lab ``name``."""
    mine = [v for v in result["verdicts"] if v["name"] == name]
    if result.get("raised"):
        return False, f"the cell raised {result['raised']}", None
    if mine:
        last = mine[-1]
        return last["passed"], last["message"], last.get("mistake")
    others = sorted({v["name"] for v in result["verdicts"]})
    if others:
        return False, f"the cell ran the checker of {', '.join(others)}, not of {name}: no credit for {name}", None
    return False, f"no checker of {name} ran (a printed PASS is not a verdict)", None


def _environment() -> dict:
    env = dict(os.environ)
    # a learner's fresh kernel has no TRITON_INTERPRET of ours: flashlib, imported here, may have set it
    env.pop("TRITON_INTERPRET", None)
    env["FLASHLIB_PROGRESS"] = "off"  # grading writes nothing, beside the notebooks or elsewhere
    env.pop("PYTHONPATH", None)  # the job names the package's folder itself
    return env


def _resident_mib(pid: int) -> float:
    """A process's resident memory (Linux's /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_cell(name: str, source: str, imports: str, notebook: Path, *, timeout: float = TIMEOUT_S,
             memory_mib: float = MEMORY_MIB) -> tuple[bool, str, str | None, float]:
    """(passed, message, mistake, seconds) of one graded cell, in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="flashlib-grade-") as scratch:
        work, own = Path(scratch) / "work", Path(scratch) / "job"
        work.mkdir()
        own.mkdir()
        shutil.copy(notebook, work / notebook.name)  # the notebook alone: nothing else of the submission
        job = dict(name=name, source=source, imports=imports, package_root=str(PACKAGE_ROOT),
                   result=str(own / "result.json"))
        (own / "job.json").write_text(json.dumps(job), encoding="utf-8")
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flashlib.labs.gradecell", str(own / "job.json")],
                                cwd=work, env=_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        stopped = None
        while proc.poll() is None:
            if time.perf_counter() - start > timeout:
                stopped = f"the cell ran past {timeout:.0f} s"
            elif _resident_mib(proc.pid) > memory_mib:
                stopped = f"the cell used more than {memory_mib:.0f} MiB of memory"
            if stopped:
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            time.sleep(POLL_S)
        seconds = time.perf_counter() - start
        if stopped:
            return False, stopped, None, seconds
        try:
            result = json.loads((own / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False, f"the cell's process ended (exit status {proc.returncode}) without a result", None, seconds
        if Path(result["flashlib"]).resolve().parent.parent != PACKAGE_ROOT:
            return False, f"the cell ran with another flashlib ({result['flashlib']}): not graded", None, seconds
        return (*verdict(result, name), seconds)


def grade(paths, *, timeout: float = TIMEOUT_S, memory_mib: float = MEMORY_MIB, jobs: int = 1,
          log=None) -> list[Grade]:
    """Grade every lab and checked exercise cell of the notebooks under ``paths``, ``jobs`` cells at a time;
    the rows in the order of the notebooks and their cells."""
    import nbformat

    tasks = []
    for student, path in submissions(paths):
        for name, imports, source in graded_cells(nbformat.read(path, as_version=4)):
            tasks.append((student, path, name, imports, source))

    def one(task):
        student, path, name, imports, source = task
        passed, message, mistake, seconds = run_cell(name, source, imports, path, timeout=timeout,
                                                     memory_mib=memory_mib)
        row = Grade(student, path.name, name, passed, message, mistake, round(seconds, 1))
        if log is not None:
            log(row)
        return row

    with ThreadPoolExecutor(max(1, jobs)) as pool:  # threads wait on the cells' processes
        return list(pool.map(one, tasks))


def totals(grades: list[Grade]) -> dict[str, tuple[int, int]]:
    """Each student's (cells passed, cells graded), in the order the rows name them."""
    out: dict[str, tuple[int, int]] = {}
    for g in grades:
        passed, count = out.get(g.student, (0, 0))
        out[g.student] = (passed + g.passed, count + 1)
    return out


def table(grades: list[Grade]) -> str:
    """The grades as a text table, each student's rows followed by their total, then the class's."""
    width = {k: max([len(str(getattr(g, k))) for g in grades] + [len(k)]) for k in ("student", "notebook", "lab")}
    head = (f"{'student':<{width['student']}}  {'notebook':<{width['notebook']}}  {'lab':<{width['lab']}}  "
            f"{'passed':<6}  {'seconds':>7}  message")
    lines, sums = [head], totals(grades)
    for i, g in enumerate(grades):
        lines.append(f"{g.student:<{width['student']}}  {g.notebook:<{width['notebook']}}  {g.lab:<{width['lab']}}  "
                     f"{'yes' if g.passed else 'no':<6}  {g.seconds:>7.1f}  {g.message}"
                     + (f" [mistake: {g.mistake}]" if g.mistake else ""))
        if i + 1 == len(grades) or grades[i + 1].student != g.student:
            passed, count = sums[g.student]
            lines.append(f"{g.student:<{width['student']}}  total: {passed} of {count} passed")
    lines.append(f"{sum(g.passed for g in grades)} of {len(grades)} graded cells passed.")
    return "\n".join(lines)


def write_csv(grades: list[Grade], path) -> None:
    """One row per student and graded cell, then a row per student with their total (lab "total")."""
    fields = ["student", "notebook", "lab", "passed", "message", "mistake", "seconds"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for g in grades:
            writer.writerow(asdict(g))
        for student, (passed, count) in totals(grades).items():
            writer.writerow(dict(student=student, notebook="", lab="total", passed=passed,
                                 message=f"{passed} of {count} passed", mistake="", seconds=""))


def main(paths, json_path=None, timeout: int = TIMEOUT_S, *, csv_path=None, jobs: int = 1,
         memory_mib: float = MEMORY_MIB) -> int:
    """The command line's ``labs grade``: 0 once every cell was graded, whatever the grades; 2 on bad input."""
    for path in paths:
        p = Path(path)
        if not (p.is_dir() or (p.is_file() and p.suffix == ".ipynb")):
            print(f"labs grade: argument PATH {str(path)!r} is neither a notebook file (.ipynb) nor a folder",
                  file=sys.stderr)
            return 2
    if jobs < 1:
        print(f"labs grade: --jobs must be at least 1, got {jobs}", file=sys.stderr)
        return 2
    grades = grade(paths, timeout=timeout, memory_mib=memory_mib, jobs=jobs)
    if not grades:
        print("labs grade: no graded cell (no lab or checked exercise) in the notebooks given", file=sys.stderr)
    print(table(grades))
    if json_path is not None:
        Path(json_path).write_text(json.dumps([asdict(g) for g in grades], indent=1) + "\n", encoding="utf-8")
    if csv_path is not None:
        write_csv(grades, csv_path)
    return 0
