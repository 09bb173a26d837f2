"""``python -m flashlib gpu-check``: the GPU tests, the course's notebooks and the ladder benchmark.

On a CUDA machine, with its own torch and Triton, within a time budget, in two parts that fit
one 15-minute loan of a GPU machine with its start, each a call of under 6 minutes:

    python -m flashlib gpu-check notebooks   every notebook under nbval, --jobs at once (default
                                             300 s; then step 1 alone)
    python -m flashlib gpu-check tests       the GPU tests, then the ladder and decoding benchmarks
                                             (default 320 s; steps 1-3 without the notebooks)
    python -m flashlib gpu-check             all of it in one call (default 480 s)

The GPU tests run under :mod:`flashlib.bench.gpu_tests`: a kernel fault ends its process, naming
the test, and the tests left run in a fresh one (``tests.json`` as they go). Nothing is
installed here (``make gpu-check`` first unpacks the wheels carried in ``.whl/``, for the
notebooks' nbval, kernel, IPython and ipywidgets, where the machine lacks them). In order, so that a run
stopped at any point keeps what matters most:

1. At once, side by side, each within half of the budget:
   ``tests/test_gpu.py`` with pytest in a subprocess (forward and backward against dense
   attention in float32 and against ``scaled_dot_product_attention`` in float16/bfloat16);
   every notebook in course order, each under nbval in a fresh process, its outputs compared
   with the stored ones as CI compares them (:mod:`flashlib.bench.notebooks`);
   and in this process, on the other cores, compiling every kernel the ladder will launch
   (:func:`flashlib.bench.gpu.precompile`; ``--no-precompile`` leaves it out).
   Neither subprocess is timed: the benchmark waits for both.
2. The ladder benchmark (:mod:`flashlib.bench.gpu`) with the time left but the decoding
   benchmark's share, alone on the GPU: every rung, the public op, every paired backward and
   every SDPA backend, the targets (d = 128, N >= 4k) first; after a kernel fault the points
   left run in fresh processes.
3. The decoding benchmark (:mod:`flashlib.bench.decode`) with the time left (at least
   DECODE_SHARE_S when the ladder keeps to its budget), in a process of its own (its kernels
   have not run on a GPU before: a fault there must not cost what the ladder measured):
   split-KV decoding against every SDPA backend, contiguous and paged caches, 4k to 128k keys,
   the targets (L >= 16k) first, then its sweeps.

Writes ``data/bench/gpu-<device>-<date>.json`` (device, versions, source revision, every
figure; a copy under $OUT when that is set) when the tests end, when the notebooks end,
after every grid point, after the decoding benchmark and at the end; the notebooks also write
``notebooks.json`` and the decoding benchmark ``decode.json`` (under $OUT when set) as they go.
Every figure in them was measured in this run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import processes
from .results import device_slug

ROOT = processes.ROOT
BUDGET_S = 480.0
BACKGROUND_SHARE = 0.5  # of the budget, for the tests and the notebooks side by side
FINAL_WRITE_S = 10      # kept back from the ladder for writing the report
NOTEBOOKS_MARGIN_S = 10  # between the notebooks' own budget and the time they are stopped at
# kept back from the ladder for the decoding benchmark: its 24 points take about 15 s on an H200
# by its own estimate (no run yet), its start and compiling about 15 s more; the sweeps use the rest
DECODE_SHARE_S = 45
DECODE_MARGIN_S = 8     # between the decoding benchmark's own budget and the time it is stopped at
MIN_DECODE_S = 20       # below this left, the decoding benchmark is not started


PARTS = ("all", "notebooks", "tests")
# a part's budget by default: each of the two parts is one call of at most 6 minutes on the GPU
# machine, its unpacking of the notebooks' wheels and its start included
PART_BUDGET_S = {"all": BUDGET_S, "notebooks": 300.0, "tests": 320.0}


def default_jobs(cores=None) -> int:
    """Notebooks at once: a core for each notebook's kernel and two for the compilers it starts
    (Triton's ptxas), at most 6 (they share one GPU: more only queue there)."""
    return max(1, min(6, (cores or os.cpu_count() or 1) // 3))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m flashlib gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("part", nargs="?", choices=PARTS, default="all",
                   help="notebooks: every notebook under nbval, several at once; tests: the GPU tests, then the "
                        "ladder and decoding benchmarks; all (default): both, tests and notebooks side by side")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check (default: " +
                        ", ".join(f"{k} {v:.0f}" for k, v in PART_BUDGET_S.items()) + ")")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"notebooks run at once (default: a third of the cores, at most 6; here {default_jobs()})")
    p.add_argument("--skip-tests", action="store_true", help="leave out tests/test_gpu.py")
    p.add_argument("--skip-notebooks", action="store_true", help="leave out the notebooks")
    p.add_argument("--skip-bench", action="store_true", help="leave out the ladder benchmark")
    p.add_argument("--skip-decode", action="store_true", help="leave out the decoding benchmark")
    p.add_argument("--no-precompile", action="store_true",
                   help="do not compile the ladder's kernels on the other cores while the tests run")
    p.add_argument("--out-dir", default=str(ROOT / "data" / "bench"), help="where the JSON goes")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = PART_BUDGET_S[args.part]
    if not (args.budget > 0 and math.isfinite(args.budget)):
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.part == "notebooks":  # the notebooks alone: each has the machine's cores and GPU to share
        args.skip_tests = args.skip_bench = args.skip_decode = True
        args.jobs = args.jobs or default_jobs()
    elif args.part == "tests":
        args.skip_notebooks = True
    args.jobs = args.jobs or 1
    return args


def report_path(out_dir, device, when: time.struct_time) -> Path:
    return Path(out_dir) / f"gpu-{device_slug(device)}-{time.strftime('%Y-%m-%dT%H%MZ', when)}.json"


def write_report(report: dict, out_dir, *, copy_to=None) -> Path:
    """Write the JSON under out_dir (and a copy under copy_to, e.g. $OUT); return its path."""
    when = time.strptime(report["date"], "%Y-%m-%dT%H:%M:%SZ")
    path = report_path(out_dir, report["device"], when)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(copy_to) / path.name)
    return path


GPU_TESTS = [ROOT / "tests" / "test_gpu.py"]


def tests_result_path() -> Path:
    """Where the GPU tests write each test's outcome as they go: under $OUT when set, else in a
    temporary folder."""
    out = os.environ.get("OUT")
    return Path(out) / "tests.json" if out else Path(tempfile.mkdtemp(prefix="flashlib-tests-")) / "tests.json"


def start_tests(timeout_s: float, tests=None) -> dict:
    """Start the GPU tests (:func:`flashlib.bench.gpu_tests.run_tests`: a kernel fault ends its
    process and the tests left go on in a fresh one) on a thread of their own, and return at once;
    the thread only waits on the test processes, so this process can compile meanwhile."""
    from .gpu_tests import run_tests

    started = dict(result=None, error=None, result_path=tests_result_path())

    def run():
        try:
            started["result"] = run_tests(tests or GPU_TESTS, started["result_path"], budget_s=timeout_s,
                                          log=lambda *_: None)
        except Exception as exc:  # noqa: BLE001  reported as the tests' result
            started["error"] = f"{type(exc).__name__}: {exc}"

    started["thread"] = threading.Thread(target=run, name="gpu-tests", daemon=True)
    started["thread"].start()
    return started


def finish_tests(started: dict, log=print) -> dict:
    """Wait for the tests; their result: exit status 0 when every test passed, a summary line,
    each test's row, the tests that faulted and each process's exit status and output tail."""
    started["thread"].join()
    if started["error"] or not started["result"]:
        return dict(returncode=2, summary=f"the tests did not run: {started['error']}", seconds=0.0, tail="")
    result = started["result"]
    jobs = result.get("jobs", [])
    for job in jobs:
        log(job["tail"])
    counts = ", ".join(f"{n} {status}" for status, n in sorted(result["counts"].items()))
    summary = f"{counts} in {len(jobs)} process{'es' if len(jobs) != 1 else ''}"
    if result["faults"]:
        summary += f"; kernel faults in {', '.join(result['faults'])}"
    log(summary)
    return dict(returncode=0 if result["all_passed"] else 1, summary=summary, seconds=result["seconds"],
                tail=jobs[-1]["tail"] if jobs else "", tests=result["tests"], faults=result["faults"],
                jobs=[{k: j[k] for k in ("returncode", "seconds", "summary")} for j in jobs])


def notebooks_result_path() -> Path:
    """Where the notebooks write their results as they go: under $OUT when set (it comes back
    even if this process is stopped), else in a temporary folder."""
    out = os.environ.get("OUT")
    return Path(out) / "notebooks.json" if out else Path(tempfile.mkdtemp(prefix="flashlib-nb-")) / "notebooks.json"


def start_notebooks(budget_s: float, result_path: Path, jobs: int = 1) -> dict:
    """Start the notebooks in course order, jobs at a time, in a subprocess (``python -m
    flashlib.bench.notebooks``), to end within budget_s: the job keeps to a budget a little
    shorter (it stops its last notebook itself), and is stopped at budget_s if it does not."""
    cmd = [sys.executable, "-m", "flashlib.bench.notebooks", "--budget", f"{max(budget_s - NOTEBOOKS_MARGIN_S, 1):.0f}",
           "--result", str(result_path), "--device-dependent", "report", "--jobs", str(jobs)]
    started = processes.start(cmd, budget_s)
    started["result_path"] = result_path
    return started


def finish_notebooks(started: dict) -> dict:
    """Wait for the notebooks; their per-notebook results (what they wrote, even if stopped). The
    job's own output (the same results as text) is kept in ``job["tail"]``, not logged again."""
    from .notebooks import close_results, course

    job = processes.finish(started, log=lambda *_: None)
    path = Path(started["result_path"])
    result = json.loads(path.read_text()) if path.exists() else {"notebooks": []}
    if job["returncode"] == -1:
        result = close_results(result, course(), f"the notebooks were stopped at their time limit "
                                                 f"({started['timeout_s']:.0f} s)")
    result["job"] = {k: job[k] for k in ("returncode", "seconds", "summary", "tail")}
    return result


def source_revision(root: Path = ROOT) -> dict:
    """Which code measured: the git commit (with a flag for uncommitted changes) where the
    checkout has its history, and always a SHA-256 over the package's own source files."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((root / "flashlib").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    out = dict(source_sha256=digest.hexdigest(), git_commit=None, git_modified=None)
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            out.update(git_commit=commit.stdout.strip(), git_modified=bool(status.stdout.strip()))
    except (OSError, subprocess.SubprocessError):  # no git on the machine: the digest still identifies the code
        pass
    declared = os.environ.get("FLASHLIB_GIT_COMMIT")
    if declared and declared != out["git_commit"]:
        # a copy of the tree (as a GPU machine gets it) without its history, or with a stale one: the
        # commit it was copied from, as the sender declared it, wins; the digest tells whether it matches
        out.update(git_commit=declared, git_commit_declared=True, git_commit_seen=out["git_commit"])
    return out


def provenance() -> dict:
    import torch

    info = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), python=platform.python_version(),
                torch=torch.__version__, cuda=torch.version.cuda, device=None, capability=None, triton=None,
                source=source_revision())
    try:  # from the metadata: importing Triton here would fix its interpreter mode too early
        from importlib.metadata import version

        info["triton"] = version("triton")
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
    from ..course.runtime import installed

    info["packages"] = installed()  # numpy, matplotlib, ipywidgets too: the README's tested versions
    return info


def _compile_ahead(report: dict, threads: int | None, log) -> None:
    """While the tests and notebooks run on the GPU, compile what the ladder will launch."""
    try:
        from .gpu import plan as ladder_plan
        from .gpu import precompile

        report["precompile"] = precompile(ladder_plan(), threads=threads, log=log)
    except Exception as exc:  # the ladder then compiles as it goes, as without this step
        report["precompile"] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
        log(f"  compiling ahead failed ({report['precompile']['error']}); the ladder compiles as it goes")


def _background(args, report: dict, save, log) -> int:
    """Step 1: tests and notebooks side by side (or either alone), compiling the ladder meanwhile;
    the exit status: 1 when a test failed or faulted (or, with the notebooks alone, a notebook failed)."""
    alone = args.skip_tests and args.skip_bench and args.skip_decode  # the notebooks: all but the writing
    share = args.budget - FINAL_WRITE_S if alone else BACKGROUND_SHARE * args.budget
    tests = None if args.skip_tests else start_tests(timeout_s=share)
    notebooks = None if args.skip_notebooks else start_notebooks(share, notebooks_result_path(), args.jobs)
    if not args.skip_bench and not args.no_precompile and (tests is not None or notebooks is not None):
        # leave a core each to pytest, the notebooks and the compilers they start themselves
        _compile_ahead(report, max(1, (os.cpu_count() or 4) - 4), log)
    status = 0
    if tests is not None:
        report["tests"] = finish_tests(tests, log=log)
        status = 0 if report["tests"]["returncode"] == 0 else 1
        save(report)
    if notebooks is not None:
        from .notebooks import format_results

        report["notebooks"] = finish_notebooks(notebooks)
        log(format_results(report["notebooks"]))
        save(report)
        if args.part == "notebooks":
            status = 0 if all(e["status"] == "passed" for e in report["notebooks"]["notebooks"]) else 1
    return status


def _ladder(args, report: dict, start: float, save, log) -> None:
    """Step 2: the ladder benchmark with the time left; fresh processes after a kernel fault."""
    left = args.budget - (time.perf_counter() - start) - FINAL_WRITE_S - (0 if args.skip_decode else DECODE_SHARE_S)
    if left <= 30:
        report["ladder_error"] = f"no time left for the ladder benchmark ({left:.0f} s)"
        return
    try:
        from .gpu import continue_after_device_lost, format_ladder, run_ladder_bench

        def save_points(points):  # a run cut short still returns what it measured
            save(dict(report, ladder_partial=points))

        report.update(run_ladder_bench(budget_s=left, log=log, progress=save_points,
                                       compile_ahead=not args.no_precompile))
        if report["ladder"].get("device_lost"):
            save(report)
            continue_after_device_lost(report, start + args.budget - FINAL_WRITE_S, log=log,
                                       run_fresh=_fresh_runner())
        log(format_ladder(report))
    except Exception as exc:  # the parts above are already measured: keep them
        report["ladder_error"] = f"{type(exc).__name__}: {exc}"


def decode_result_path() -> Path:
    """Where the decoding benchmark writes its result as it goes: under $OUT when set, else in a
    temporary folder."""
    out = os.environ.get("OUT")
    return Path(out) / "decode.json" if out else Path(tempfile.mkdtemp(prefix="flashlib-decode-")) / "decode.json"


def start_decode(budget_s: float, result_path: Path) -> dict:
    """Start the decoding benchmark in its own process, to end within budget_s (it keeps to a
    budget a little shorter, and is stopped at budget_s if it does not)."""
    cmd = [sys.executable, "-m", "flashlib.bench.decode", "--budget", f"{max(budget_s - DECODE_MARGIN_S, 1):.0f}",
           "--result", str(result_path)]
    started = processes.start(cmd, budget_s)
    started["result_path"] = result_path
    return started


def finish_decode(started: dict, log=print) -> dict:
    """Wait for the decoding benchmark; its result (what it wrote, even if stopped) with its job."""
    job = processes.finish(started, log=log)
    path = Path(started["result_path"])
    try:
        result = json.loads(path.read_text()).get("decode", {}) if path.exists() else {}
    except ValueError as exc:  # stopped while writing: what it measured before is in the job's output
        result = {"error": f"unreadable result ({exc})"}
    result["job"] = {k: job[k] for k in ("returncode", "seconds", "summary")}
    return result


def _decode(args, report: dict, start: float, save, log) -> None:
    """Step 3: the decoding benchmark with the time left."""
    left = args.budget - (time.perf_counter() - start) - FINAL_WRITE_S
    if left < MIN_DECODE_S:
        report["decode_error"] = f"no time left for the decoding benchmark ({left:.0f} s)"
        return
    report["decode"] = finish_decode(start_decode(left, decode_result_path()), log=log)
    save(report)


def main(argv=None, *, log=print) -> int:
    """Exit status 0 when the GPU tests pass (with the notebooks alone: when every notebook passes;
    2 without a CUDA device); the notebooks' and the benchmark's results are in the JSON."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    report = provenance()
    if report["device"] is None:
        log("gpu-check needs a CUDA device and none is visible here; the CPU tests are `make test`, "
            "recorded GPU results are in data/bench/")
        return 2
    report.update(command=["gpu-check", *(argv if argv is not None else sys.argv[1:])], part=args.part,
                  budget_s=args.budget)
    log(f"flashlib gpu-check on {report['device']}: torch {report['torch']}, Triton {report['triton']}, "
        f"CUDA {report['cuda']}")

    def save(what):
        return write_report(what, args.out_dir, copy_to=os.environ.get("OUT"))

    status = _background(args, report, save, log)
    if not args.skip_bench:
        _ladder(args, report, start, save, log)
    if not args.skip_decode:
        _decode(args, report, start, save, log)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    log(f"wrote {save(report)} ({report['elapsed_s']} s)")
    return status


def _fresh_runner():
    """run_fresh for continue_after_device_lost: each fresh process writes its result as it
    goes under $OUT when set (so it comes back even if this process is stopped), else in a
    temporary folder."""
    from .fresh import run_fresh_process

    out, count = os.environ.get("OUT"), [0]

    def run(points, exclude, budget_s):
        count[0] += 1
        path = Path(out) / f"ladder-fresh-{count[0]}.json" if out else None
        return run_fresh_process(points, exclude, budget_s, out_path=path)
    return run


if __name__ == "__main__":
    sys.exit(main())
