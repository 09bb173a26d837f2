"""``python -m flashlib gpu-check``: the GPU tests, then a short benchmark, on a CUDA machine.

Runs with the machine's own torch and Triton and installs nothing. In order, each part
within its share of a time budget (default 450 s, so the whole check ends within 8 minutes
on an H200):

1. ``tests/test_gpu.py`` with pytest in a subprocess (at most half of the budget; kernels it
   compiles stay in Triton's on-disk cache, and the benchmark reuses those whose arguments
   specialise alike): forward and backward against dense
   attention in float32 and against ``scaled_dot_product_attention`` in float16/bfloat16.
   Meanwhile the main process compiles every kernel the ladder (part 3) will launch, on the
   other cores (:func:`flashlib.perf_bench.precompile`; ``--no-precompile`` leaves it out).
2. Only with ``--sdpa-table`` (or without the ladder): forward and backward time
   (``triton.testing.do_bench``, median) and peak memory of the shipped ``flash_attention``
   and of each SDPA backend (flash, efficient, cuDNN; math where its N x N matrices fit),
   B*H*N fixed, N from 1k to 16k, d 64 and 128, float16 and bfloat16, causal and not.
3. The optimisation ladder (:mod:`flashlib.perf_bench`) with the time left: every rung and
   every SDPA backend, forward and forward+backward, with the ceilings measured in the run.

Writes ``data/bench/gpu-<device>-<date>.json`` (device, versions, date, every figure; a copy
under $OUT when that is set) and prints a table. Every figure in it was measured in this run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SEQS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
TOKENS = 16 * 16384          # B * H * N, held fixed so every point does the same row count
HEADS = 16
IMPLS = ("flashlib", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "sdpa:math")
MATH_MAX_SEQ = 4096          # the math backend materialises N x N scores and probabilities


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m flashlib gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sequence lengths, shorter timing")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    p.add_argument("--skip-tests", action="store_true", help="benchmark only")
    p.add_argument("--skip-bench", action="store_true", help="tests only")
    p.add_argument("--no-ladder", action="store_true", help="leave out the optimisation-ladder benchmark")
    p.add_argument("--no-precompile", action="store_true",
                   help="do not compile the ladder's kernels on the other cores while the tests run")
    p.add_argument("--sdpa-table", action="store_true",
                   help="also time the shipped op against every SDPA backend at B*H*N fixed (part 2)")
    p.add_argument("--out-dir", default=str(ROOT / "data" / "bench"), help="where the JSON goes")
    args = p.parse_args(argv)
    if not (args.budget > 0 and math.isfinite(args.budget)):
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    return args


def plan(quick: bool):
    """The benchmark's points in priority order: d = 128 and long sequences first."""
    seqs = QUICK_SEQS if quick else SEQS
    points = [dict(dtype=dt, head_dim=d, causal=c, seq=n, heads=HEADS, batch=max(1, TOKENS // (HEADS * n)))
              for d in HEAD_DIMS for dt in DTYPES for c in (False, True) for n in seqs]
    return sorted(points, key=lambda p: (p["head_dim"] != 128, p["seq"] < 4096, p["dtype"], p["causal"], p["seq"]))


def attention_flops(p, backward=False) -> float:
    """Matmul FLOPs: 2 matmuls of 2*N*N*d forward, 5 backward; half of them when causal."""
    flops = 4.0 * p["batch"] * p["heads"] * p["seq"] ** 2 * p["head_dim"] * (2.5 if backward else 1.0)
    return flops / 2 if p["causal"] else flops


def tflops(flops: float, ms) -> float | None:
    return None if ms is None or not ms > 0 else flops / (ms * 1e-3) / 1e12


def run_benchmark(points, measure, budget_s: float, log=print):
    """measure(point, impl) -> dict(fwd_ms, bwd_ms, peak_mb) or raises; rows for every pair."""
    start, rows = time.perf_counter(), []
    for p in points:
        for impl in IMPLS:
            row = dict(p, impl=impl, fwd_ms=None, bwd_ms=None, peak_mb=None, error=None)
            if time.perf_counter() - start > budget_s:
                row["error"] = "skipped: time budget"
            elif impl == "sdpa:math" and p["seq"] > MATH_MAX_SEQ:
                row["error"] = f"skipped: math backend above N = {MATH_MAX_SEQ} (N x N matrices)"
            else:
                try:
                    row.update(measure(p, impl))
                except Exception as exc:  # one backend's failure must not end the run
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row["fwd_tflops"] = tflops(attention_flops(p), row["fwd_ms"])
            row["bwd_tflops"] = tflops(attention_flops(p, backward=True), row["bwd_ms"])
            rows.append(row)
        done = [r for r in rows[-len(IMPLS):] if r["error"] is None]
        log(f"  {p['dtype']:>8} d={p['head_dim']:<3} causal={int(p['causal'])} N={p['seq']:>5}: "
            f"{len(done)}/{len(IMPLS)} measured")
    return rows


def _best_sdpa(rows, key):
    vals = [(r[key], r["impl"]) for r in rows if r["impl"].startswith("sdpa") and r[key] is not None]
    return max(vals) if vals else (None, None)


def format_table(rows) -> str:
    """One line per point: our forward/backward TFLOP/s against the best SDPA backend's."""
    head = (f"{'dtype':>8} {'d':>4} {'causal':>6} {'N':>6} | {'fwd':>6} {'best sdpa':>20} {'ratio':>5} | "
            f"{'bwd':>6} {'best sdpa':>20} {'ratio':>5} | {'peak MB':>8}")
    lines = [head, "-" * len(head)]
    keys = sorted({(r["dtype"], r["head_dim"], r["causal"], r["seq"]) for r in rows})
    for dtype, d, causal, n in keys:
        group = [r for r in rows if (r["dtype"], r["head_dim"], r["causal"], r["seq"]) == (dtype, d, causal, n)]
        ours = next((r for r in group if r["impl"] == "flashlib"), None)
        cells = []
        for key in ("fwd_tflops", "bwd_tflops"):
            best, name = _best_sdpa(group, key)
            mine = ours[key] if ours else None
            ratio = f"{mine / best:5.2f}" if mine and best else "    -"
            cells.append(f"{_num(mine):>6} {(_num(best) + ' ' + name) if best else '-':>20} {ratio}")
        peak = _num(ours["peak_mb"], 0) if ours else "-"
        lines.append(f"{dtype:>8} {d:>4} {int(causal):>6} {n:>6} | {cells[0]} | {cells[1]} | {peak:>8}")
    return "\n".join(lines)


def _num(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def report_path(out_dir, device, when: time.struct_time) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", str(device or "unknown").lower()).strip("-")
    return Path(out_dir) / f"gpu-{slug}-{time.strftime('%Y-%m-%dT%H%MZ', when)}.json"


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


def start_tests(timeout_s: float, cmd=None) -> dict:
    """Start tests/test_gpu.py (or cmd) in a subprocess and return at once (see finish_tests).
    Its output goes to a file: a pipe nobody reads while the benchmark compiles could fill up
    and stall the tests."""
    import tempfile

    # --durations: the slowest tests (mostly compiling and autotuning) are listed in the report
    cmd = cmd or [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_gpu.py"), "-q", "-p",
                  "no:cacheprovider", "--durations=12"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    output = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    return dict(proc=proc, output=output, start=time.perf_counter(), timeout_s=timeout_s)


def finish_tests(started: dict, log=print) -> dict:
    """Wait for the tests (until their timeout, counted from their start); their result."""
    proc, output = started["proc"], started["output"]
    try:
        proc.wait(timeout=max(0.0, started["timeout_s"] - (time.perf_counter() - started["start"])))
        code, note = proc.returncode, ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code, note = -1, f"\ntimed out after {started['timeout_s']:.0f} s"
    output.seek(0)
    out = output.read() + note
    output.close()
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    log(out[-6000:])
    return dict(returncode=code, summary=summary, seconds=round(time.perf_counter() - started["start"], 1),
                tail=out[-6000:])


def run_tests(timeout_s: float, log=print) -> dict:
    """tests/test_gpu.py with pytest in a subprocess, waited for."""
    return finish_tests(start_tests(timeout_s), log=log)


def _cuda_measure(quick: bool):
    """The real measurement: returns measure(point, impl) for run_benchmark."""
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import flash_attention

    backends = {"sdpa:flash": SDPBackend.FLASH_ATTENTION, "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION,
                "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa:math": SDPBackend.MATH}
    warmup, rep = (5, 20) if quick else (10, 50)

    def measure(p, impl):
        torch.manual_seed(0)
        shape = (p["batch"], p["heads"], p["seq"], p["head_dim"])
        dtype = getattr(torch, p["dtype"])
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(shape, device="cuda", dtype=dtype)
        if impl == "flashlib":
            def forward():
                return flash_attention(q, k, v, causal=p["causal"])
        else:
            def forward():
                with sdpa_kernel([backends[impl]]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p["causal"])
        try:
            out = forward()  # also compiles, and fails here if the backend cannot run this point
            fwd_ms = triton.testing.do_bench(forward, warmup=warmup, rep=rep, return_mode="median")
            bwd_ms = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=warmup,
                                             rep=rep, grad_to_none=[q, k, v], return_mode="median")
            del out
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward().backward(dout)
            torch.cuda.synchronize()
            peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        finally:
            del q, k, v, dout
            torch.cuda.empty_cache()
        return dict(fwd_ms=float(fwd_ms), bwd_ms=float(bwd_ms), peak_mb=float(peak_mb))

    return measure


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
    return info


def main(argv=None, *, measure=None, log=print) -> int:
    """Exit status 0 when the tests pass and the benchmark ran; measure is for testing."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    report = provenance()
    if measure is None and report["device"] is None:
        log("gpu-check needs a CUDA device and none is visible here; the CPU tests are `make test`, "
            "recorded GPU results are in data/bench/")
        return 2
    report.update(command=["gpu-check", *(argv or [])], budget_s=args.budget)
    log(f"flashlib gpu-check on {report['device']}: torch {report['torch']}, Triton {report['triton']}, "
        f"CUDA {report['cuda']}")
    status = 0
    tests = None if args.skip_tests else start_tests(timeout_s=0.5 * args.budget)
    ladder = not args.no_ladder and _has_ladder()
    if tests is not None and not args.skip_bench and ladder and measure is None and not args.no_precompile:
        # while the tests run on the GPU, the other cores compile what the ladder will launch
        try:
            from .gpu import plan as ladder_plan
            from .gpu import precompile

            report["precompile"] = precompile(ladder_plan(), log=log)
        except Exception as exc:  # the ladder then compiles as it goes, as without this step
            report["precompile"] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
            log(f"  compiling ahead failed ({report['precompile']['error']}); the ladder compiles as it goes")
    if tests is not None:
        report["tests"] = finish_tests(tests, log=log)
        status = 0 if report["tests"]["returncode"] == 0 else 1
        write_report(report, args.out_dir, copy_to=os.environ.get("OUT"))  # kept if the benchmark dies
    if not args.skip_bench and (args.sdpa_table or not ladder):
        left = args.budget - (time.perf_counter() - start)
        share = left * (0.5 if ladder else 0.9)
        log(f"benchmark (B*H*N = {TOKENS}, H = {HEADS}, budget {share:.0f} s)")
        rows = run_benchmark(plan(args.quick), measure or _cuda_measure(args.quick), share, log=log)
        report["bench"] = dict(tokens=TOKENS, heads=HEADS, timing="triton.testing.do_bench median, ms",
                               flops="4*B*H*N^2*d forward, x2.5 backward, halved if causal", rows=rows)
        log(format_table(rows))
        write_report(report, args.out_dir, copy_to=os.environ.get("OUT"))
    if not args.skip_bench and ladder and measure is None:
        left = args.budget - (time.perf_counter() - start) - 10
        if left > 30:
            try:
                from .gpu import continue_after_device_lost, format_ladder, run_ladder_bench

                def save(points):  # a run cut short still returns what it measured
                    write_report(dict(report, ladder_partial=points), args.out_dir, copy_to=os.environ.get("OUT"))

                report.update(run_ladder_bench(budget_s=left, log=log, progress=save,
                                               compile_ahead=not args.no_precompile))
                if report["ladder"].get("device_lost"):
                    write_report(report, args.out_dir, copy_to=os.environ.get("OUT"))
                    continue_after_device_lost(report, start + args.budget - 10, log=log, run_fresh=_fresh_runner())
                log(format_ladder(report))
            except Exception as exc:  # the parts above are already measured: keep them
                report["ladder_error"] = f"{type(exc).__name__}: {exc}"
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    path = write_report(report, args.out_dir, copy_to=os.environ.get("OUT"))
    log(f"wrote {path} ({report['elapsed_s']} s)")
    return status


def _fresh_runner():
    """run_fresh for continue_after_device_lost: each fresh process writes its result as it
    goes under $OUT when set (so it comes back even if this process is stopped), else in a
    temporary folder."""
    from .gpu import run_fresh_process

    out, count = os.environ.get("OUT"), [0]

    def run(points, exclude, budget_s):
        count[0] += 1
        path = Path(out) / f"ladder-fresh-{count[0]}.json" if out else None
        return run_fresh_process(points, exclude, budget_s, out_path=path)
    return run


def _has_ladder() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashlib.bench.gpu") is not None


if __name__ == "__main__":
    sys.exit(main())
