"""Measurements with provenance: CPU memory and time of dense against tiled attention.

Each (method, N) point runs in its own process so one run's peak cannot hide in
another's. Two memory figures are recorded:
  peak_alloc_bytes  the most bytes torch had allocated at once during the call
                    (from the profiler's allocation events: exact and repeatable);
  peak_rss_bytes    the growth of the process's peak resident set during the call
                    (what the operating system saw; includes allocator slack).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from .records import BENCH_DIR

DATA_DIR = BENCH_DIR  # where a measurement is written: beside the recorded runs it joins
CPU_SIZES = (1024, 2048, 4096, 8192, 16384)
CPU_BLOCK = 512  # tiled block_q = block_k on CPU: large enough to amortise Python overhead


def peak_allocated_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes held at once by what torch allocates on the CPU while ``fn(*args, **kwargs)`` runs.

    Every allocation and free of the call is read in order from the profiler (its
    allocation events carry their addresses), so the figure is exact and the same on every
    run, unlike the process's resident size. What was allocated before the call (its
    inputs, gradients left from an earlier step) is not counted, and freeing it inside the
    call does not lower the count: the peak is that of the memory the call itself holds,
    everything it allocated and still holds at that moment, gradients included.
    """
    from torch.profiler import ProfilerActivity, profile

    with _profiler_quiet():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(*args, **kwargs)
        allocations = _allocations(prof)
    held: dict[int, int] = {}  # address -> bytes, for blocks allocated inside the call
    current = peak = 0
    for ptr, size in allocations:
        if size > 0:
            held[ptr] = size
            current += size
        elif ptr in held:  # a free of a block allocated before the call is not the call's saving
            current -= held.pop(ptr)
        peak = max(peak, current)
    return peak


def _allocations(prof):
    """(address, bytes) of every allocation (+) and free (-) the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            found.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    return [(ptr, size) for _, ptr, size in sorted(found, key=lambda f: f[0])]


@contextlib.contextmanager
def _profiler_quiet():
    """The profiler's own output, which differs between torch versions, kept out of stored
    notebook outputs: its Python warnings and what its native library writes to stderr.

    torch 2.10 and 2.11 warn "Profiler clears events at the end of each cycle" whenever a
    profile starts (2.13 only when a schedule's cycle drops events); Jupyter shows Python
    warnings on sys.stderr, which is not file descriptor 2. ``acc_events=True`` would avoid
    it but makes the profiler parse every event on exit (seconds for one tiled training
    step). Warnings that the measured call itself raises still show.
    """
    with warnings.catch_warnings(), _native_stderr_silenced():
        warnings.filterwarnings("ignore", message=r"(Warning: )?Profiler clears events at the end of each cycle")
        warnings.filterwarnings("ignore", module=r"torch\.(autograd\.)?profiler")
        yield


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native library logs start/stop lines with timestamps to file
    descriptor 2; hide them so notebook outputs stay reproducible."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def provenance() -> dict:
    """Where and with what a figure was measured."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.system() + "-" + platform.machine(),
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _run_point(method: str, n: int, d: int, repeats: int) -> dict:
    """One measurement, meant to run in a fresh process (see :func:`run_cpu_bench`)."""
    from ..dense import dense_attention
    from ..tiled import tiled_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, d, generator=gen) for _ in range(3))  # (B, H, N, D)
    if method == "dense":
        def call():
            return dense_attention(q, k, v)
    else:
        def call():
            return tiled_forward(q, k, v, block_q=CPU_BLOCK, block_k=CPU_BLOCK)[0]
    with torch.no_grad():
        rss_before = _max_rss_bytes()
        call()  # first call: its peak resident growth is the memory figure
        peak_rss = _max_rss_bytes() - rss_before
        peak_alloc = peak_allocated_bytes(call)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return {"method": method, "n": n, "d": d, "peak_alloc_bytes": peak_alloc,
            "peak_rss_bytes": peak_rss, "seconds": statistics.median(times), "repeats": repeats}


def run_cpu_bench(sizes=CPU_SIZES, d: int = 64, repeats: int = 5, out_dir: Path | None = None,
                  log=print) -> Path:
    """Dense vs tiled forward on this CPU, one process per point; writes and returns a JSON path."""
    points = []
    for n in sizes:
        for method in ("dense", "tiled"):
            log(f"  {method:5s} N={n:6d} ...", end="", flush=True)
            cmd = [sys.executable, "-m", "flashlib.bench.cpu", "_point", method, str(n), str(d), str(repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            point = json.loads(done.stdout.strip().splitlines()[-1])
            points.append(point)
            log(f" {point['seconds']:.3f} s, peak alloc {point['peak_alloc_bytes'] / 2**20:.1f} MiB, "
                f"peak RSS growth {point['peak_rss_bytes'] / 2**20:.1f} MiB")
    result = {"kind": "cpu-dense-vs-tiled", "provenance": provenance(),
              "config": {"batch": 1, "heads": 1, "d": d, "dtype": "float32", "block_q": CPU_BLOCK,
                         "block_k": CPU_BLOCK, "repeats": repeats, "timing": "median wall seconds"},
              "points": points, "ratios": cpu_ratios(points)}
    return write_result(result, f"cpu-{result['provenance']['date']}", out_dir)


def write_result(result: dict, stem: str, out_dir=None) -> Path:
    """result as ``stem.json`` under out_dir (default :data:`DATA_DIR`); its path."""
    out_dir = Path(out_dir) if out_dir is not None else DATA_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def cpu_ratios(points) -> list[dict]:
    """Tiled over dense, per N: memory (lower is better) and time (lower is better)."""
    by = {(p["method"], p["n"]): p for p in points}
    rows = []
    for n in sorted({p["n"] for p in points}):
        dense, tiled = by.get(("dense", n)), by.get(("tiled", n))
        if dense and tiled:
            rows.append({"n": n,
                         "alloc_ratio": tiled["peak_alloc_bytes"] / dense["peak_alloc_bytes"],
                         "rss_ratio": tiled["peak_rss_bytes"] / max(dense["peak_rss_bytes"], 1),
                         "time_ratio": tiled["seconds"] / dense["seconds"]})
    return rows


def format_ratios(rows) -> str:
    lines = [f"{'N':>6} {'tiled/dense alloc':>18} {'tiled/dense RSS':>16} {'tiled/dense time':>17}"]
    for r in rows:
        lines.append(f"{r['n']:>6} {r['alloc_ratio']:>18.4f} {r['rss_ratio']:>16.4f} {r['time_ratio']:>17.3f}")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["_point"]:
    method, n, d, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if method not in ("dense", "tiled"):
        raise SystemExit(f"bench: method must be 'dense' or 'tiled', got {method!r}")
    print(json.dumps(_run_point(method, n, d, repeats)))
