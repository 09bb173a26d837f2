"""Seconds the grader takes per cell: a class of six students handing in the student edition's notebooks 02
and 03, three as handed out (every lab and exercise untouched) and three with every cell answered.

    python tools/bench_grade.py [--course ROOT] [--python EXE] [--jobs 1 2] [--out data/bench/grade-DATE.json]

Builds the student edition of this course (tools/student_edition.py), writes the class into a temporary
folder, and runs ``python -m flashlib labs grade CLASS --jobs N`` of the course at ``--course`` (default: this
one) with ``--python`` (default: this interpreter), once per ``--jobs``. A run's wall time over its cells is
its seconds per cell; each row's own seconds, where the grader's JSON gives them, are averaged per kind of
cell (untouched: the stub or ``answer = None``; graded: an answer the checker runs). Prints one line per run
and, with ``--out``, writes them as JSON (the machine, its load, the versions, the command).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import student_edition  # noqa: E402
from flashlib.labs import cells  # noqa: E402

NOTEBOOKS = ("02_online_softmax", "03_tiled_attention")
STUDENTS = 6
# right answers of the exercises of 02 and 03 (the benchmark's class; not what a checker compares with)
ANSWERS = {"online_state": f"(7.0, {sum(math.exp(x - 7.0) for x in (2.0, 5.0, 1.0, 7.0))!r})",
           "new_denominator": repr(2.5 * math.exp(5.0 - 7.0) + 1.0),
           "tile_count": "12", "causal_tiles": "10", "key_major_traffic": "64"}


def _answered(nb) -> None:
    """Every lab cell given its worked solution, every exercise its right answer."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        name = cells.marked(cell.source)
        if name is not None:
            cell.source = cells.code_cell(name, solved=True)
            continue
        for exercise, answer in ANSWERS.items():
            if f".check_{exercise}(" in cell.source:
                cell.source = cell.source.replace("answer = None", f"answer = {answer}", 1)


def write_class(edition: Path, folder: Path) -> dict[str, str]:
    """The class's folders; {student: "untouched" or "answered"}."""
    kinds = {}
    for i in range(STUDENTS):
        kind = "untouched" if i % 2 == 0 else "answered"
        student = folder / f"student{i + 1}"
        student.mkdir(parents=True)
        for name in NOTEBOOKS:
            nb = nbformat.read(edition / "notebooks" / f"{name}.ipynb", as_version=4)
            if kind == "answered":
                _answered(nb)
            nbformat.write(nb, student / f"{name}.ipynb")
        kinds[student.name] = kind
    return kinds


def _rows(data) -> list[dict]:
    return data if isinstance(data, list) else data.get("rows", [])


def _kind_of(row: dict, kinds: dict) -> str:
    student = Path(str(row.get("folder") or row["student"])).name
    return kinds.get(student, "?")


def run(course: Path, python: str, folder: Path, kinds: dict, jobs: int) -> dict:
    out = folder.parent / f"grades-{jobs}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(course), OMP_NUM_THREADS="1")
    command = [python, "-m", "flashlib", "labs", "grade", str(folder), "--jobs", str(jobs), "--json", str(out)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=course, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rows = _rows(json.loads(out.read_text())) if out.exists() else []
    graded = [r for r in rows if r.get("status", "graded") in ("graded", None)]
    per_kind = {}
    for kind in ("untouched", "answered"):
        seconds = [r["seconds"] for r in graded if _kind_of(r, kinds) == kind and r.get("seconds") is not None]
        per_kind[kind] = dict(cells=len(seconds), mean_row_seconds=round(sum(seconds) / len(seconds), 2)
                              if seconds else None)
    passed = sum(bool(r.get("passed")) for r in graded)
    return dict(jobs=jobs, exit_status=done.returncode, cells=len(graded), passed=passed, wall_seconds=round(wall, 1),
                seconds_per_cell=round(wall / max(1, len(graded)), 2), load_before=round(load, 2), rows=per_kind,
                first_line=done.stdout.splitlines()[0] if done.stdout else "", stderr_tail=done.stderr[-600:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--course", type=Path, default=ROOT, help="the course whose grader runs (default: this one)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs it")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--label", default="", help="a name for the grader measured (e.g. before, after)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-grade-") as scratch:
        edition = student_edition.build(Path(scratch) / "edition")
        kinds = write_class(edition, Path(scratch) / "class")
        runs = []
        for jobs in args.jobs:
            runs.append(run(args.course.resolve(), args.python, Path(scratch) / "class", kinds, jobs))
            r = runs[-1]
            print(f"{args.label or args.course}: --jobs {jobs}: {r['cells']} cells ({r['passed']} passed) in "
                  f"{r['wall_seconds']} s, {r['seconds_per_cell']} s per cell; rows: {r['rows']}; exit {r['exit_status']}",
                  flush=True)
    record = dict(benchmark="grade", label=args.label, date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), machine=platform.machine(), cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(), python=platform.python_version(), course=str(args.course), students=STUDENTS,
        notebooks=list(NOTEBOOKS), kinds=kinds, runs=runs,
        command=" ".join(["python", "tools/bench_grade.py", *(argv if argv is not None else sys.argv[1:])]))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
