"""The course's notebooks executed on this machine, in course order (N at once), within a time budget.

    python -m flashlib.bench.notebooks [NOTEBOOK ...] --result FILE [--budget S] [--jobs N]
                                       [--device-dependent compare|report]

Each notebook runs under nbval in a fresh pytest process (a fresh kernel of this interpreter,
its outputs compared as CI compares them, ``notebooks/sanitize.cfg``; a crash or a lost GPU ends
one notebook, not the run), with the environment ``tools/execute_notebooks.py`` writes the stored
outputs in (:func:`fixed_env`) and the repository on the path. FILE holds an entry per notebook
(passed, or which cells failed or differed and how), rewritten as each cell starts and ends
(:mod:`flashlib.bench.nbval_results`); a notebook still running at its time limit is stopped and
its entry says which cell was running, and notebooks the budget leaves out are listed as not run.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import processes
from .nbval_results import write_entry
from .processes import ROOT

NOTEBOOK_DIR = ROOT / "notebooks"
SANITIZE_CFG = NOTEBOOK_DIR / "sanitize.cfg"  # nbval's regexes, as CI runs it
WRITER = ROOT / "tools" / "execute_notebooks.py"  # writes the stored outputs, in its FIXED_ENV
NOTEBOOK_TIMEOUT_S = 180.0  # one notebook at most: a hung cell must not take the others' time
MIN_START_S = 20.0          # below this left, a notebook is not started


def course() -> list[Path]:
    """The notebooks in course order: the numbered ones, then the appendices (A_...)."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")) + sorted(NOTEBOOK_DIR.glob("A_*.ipynb"))


def fixed_env(writer=WRITER) -> dict:
    """The environment variables the stored outputs were written with: the ``FIXED_ENV`` of
    tools/execute_notebooks.py, read from its source (it imports Jupyter, which may be missing here)."""
    tree = ast.parse(Path(writer).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FIXED_ENV" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"fixed_env: argument 'writer' ({writer}) assigns no FIXED_ENV; name the script that "
                     "writes the stored outputs")


def _child_env() -> dict:
    env = dict(os.environ, **fixed_env(), IPYTHONDIR=tempfile.mkdtemp(prefix="flashlib-ipython-"))
    return processes.with_root_on_path(env)


def nbval_command(path: Path, result_path: Path, order: int, device_dependent: str, timeout_s: float) -> list:
    """pytest with nbval on one notebook, in a kernel of this interpreter, writing its entry."""
    return [sys.executable, "-m", "pytest", str(path), "--nbval", "--nbval-current-env",
            "--nbval-sanitize-with", str(SANITIZE_CFG), "--nbval-cell-timeout", f"{max(timeout_s, 1):.0f}",
            "-p", "flashlib.bench.nbval_results", "--flashlib-result", str(result_path),
            "--flashlib-order", str(order), "--flashlib-device-dependent", device_dependent,
            "-p", "no:cacheprovider", "-q", "--color=no"]


def _mark_stopped(entry: dict, note: str) -> None:
    """A notebook whose process ended before it finished: it failed, as did the cell that ran."""
    for cell in entry["cells"]:
        if cell["status"] == "running":
            cell.update(status="failed", error=note)
    entry.update(status="failed", error=note)


def _close_entry(result_path: Path, name: str, order: int, note: str, seconds: float) -> None:
    """After a notebook's process ended without finishing its entry: say why, for the cells too."""
    results = json.loads(result_path.read_text()) if result_path.exists() else {"notebooks": []}
    entry = next((e for e in results["notebooks"] if e.get("notebook") == name),
                 dict(notebook=name, order=order, cells=[]))
    if entry.get("status") not in ("running", None):
        return
    _mark_stopped(entry, note)
    entry["seconds"] = round(seconds, 1)
    write_entry(result_path, entry)


def close_results(results: dict, paths, note: str) -> dict:
    """Results of a job that was stopped: an entry still running says note (so does its running
    cell), and every notebook of paths without an entry is listed as not run."""
    entries = {e["notebook"]: e for e in results.get("notebooks", [])}
    for entry in entries.values():
        if entry.get("status") == "running":
            _mark_stopped(entry, note)
    for order, path in enumerate(paths):
        entries.setdefault(Path(path).name, dict(notebook=Path(path).name, order=order, status="not run", cells=[],
                                                 error=note))
    return dict(results, notebooks=sorted(entries.values(), key=lambda e: e.get("order", 0)))


def run_one(path: Path, order: int, result_path: Path, timeout_s: float, device_dependent: str) -> None:
    """One notebook in a fresh process, stopped after timeout_s."""
    cmd = nbval_command(path, result_path, order, device_dependent, timeout_s)
    done = processes.finish(processes.start(cmd, timeout_s, env=_child_env(), cwd=path.parent), log=lambda *_: None)
    if done["returncode"] == -1:
        note = f"stopped at the time limit of {timeout_s:.0f} s"
    else:
        note = f"the notebook's process ended with exit status {done['returncode']}: {done['tail'][-500:]}"
    _close_entry(result_path, path.name, order, note, done["seconds"])


def run_course(paths, result_path, *, budget_s: float, device_dependent: str = "compare", jobs: int = 1,
               clock=time.perf_counter, run=run_one, log=print) -> dict:
    """Every notebook of paths, each within NOTEBOOK_TIMEOUT_S and all within budget_s, ``jobs``
    at a time (each in its own process; started in course order); returns the results (also in
    result_path). A notebook is started only while MIN_START_S are left, and never past the budget."""
    result_path = Path(result_path)
    start, lock = clock(), threading.Lock()
    pending = list(enumerate(paths))

    def worker():
        while True:
            with lock:  # one notebook per worker at a time, each taken once, in course order
                if not pending:
                    return
                order, path = pending.pop(0)
                left = budget_s - (clock() - start)
                if left >= MIN_START_S:
                    log(f"notebook {path.name}")
            if left < MIN_START_S:
                write_entry(result_path, dict(notebook=path.name, order=order, status="not run", cells=[],
                                              error=f"the time budget ({budget_s:.0f} s) was spent"))
                continue
            run(path, order, result_path, min(NOTEBOOK_TIMEOUT_S, left), device_dependent)

    if jobs <= 1:
        worker()
    else:  # threads only wait on their notebook's process: the work is in the processes
        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(worker) for _ in range(jobs)]:
                future.result()
    result_path.with_name(result_path.name + ".lock").unlink(missing_ok=True)  # every writer has ended
    results = json.loads(result_path.read_text()) if result_path.exists() else {"notebooks": []}
    results.update(seconds=round(clock() - start, 1), jobs=jobs)
    result_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def format_results(results: dict) -> str:
    """One line per notebook, then one per cell that failed, differed or was not compared."""
    lines = []
    for entry in results.get("notebooks", []):
        cells = entry.get("cells", [])
        seconds = f", {entry['seconds']} s" if entry.get("seconds") is not None else ""
        lines.append(f"{entry['notebook']}: {entry['status']} ({len(cells)} cells{seconds})"
                     + (f": {entry['error']}" if entry.get("error") else ""))
        for cell in cells:
            if cell["status"] in ("failed", "differed", "not compared", "running"):
                why = cell.get("error") or cell.get("difference") or cell.get("would_differ") or ""
                lines.append(f"  Cell {cell['cell']} (cell {cell['index']}, {cell['line']!r}): {cell['status']}"
                             + (f": {str(why)[:300]}" if why else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.notebooks", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebooks to run (default: all, in course order)")
    parser.add_argument("--result", required=True, help="JSON file for the results (rewritten after every cell)")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for all notebooks (default 600)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once, each in its own process (default 1)")
    parser.add_argument("--device-dependent", choices=("compare", "report"), default="compare",
                        help="compare cells marked DEVICE_DEPENDENT_OUTPUT (as CI does), or only report them")
    args = parser.parse_args(argv)
    paths = [Path(p).resolve() for p in args.notebooks] or course()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).unlink(missing_ok=True)  # results of an earlier run would read as this one's
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    results = run_course(paths, args.result, budget_s=args.budget, device_dependent=args.device_dependent,
                         jobs=args.jobs)
    print(format_results(results))
    return 0 if all(e["status"] == "passed" for e in results["notebooks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
