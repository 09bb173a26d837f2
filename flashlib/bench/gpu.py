"""The ladder benchmark: every rung and every SDPA backend, side by side, in one GPU run.

For each head dim d, sequence length N, dtype, causal flag and pass (forward, or forward
and backward) it times every method of :mod:`flashlib.bench.methods` (``rung:<name>``,
``flashlib``, ``ladder:<backward>``, ``sdpa:<backend>``) with ``triton.testing.do_bench``
medians and spreads, records the peak memory of one call, and checks each rung's output
against SDPA (:mod:`flashlib.bench.point`). The device's bf16 matmul rate and copy
bandwidth, measured in the same run, are the ceilings. The grid is measured targets first
within a time budget (:mod:`flashlib.bench.grid`); its kernels are compiled ahead on all
cores (:func:`precompile`), so first points mostly autotune; a kernel fault stops the run and
the points left are measured in fresh processes (:mod:`flashlib.bench.fresh`).

    python -m flashlib.bench.gpu [--budget S] [--points FILE --exclude METHOD --result FILE]

Imported and run only on a CUDA machine (or on a CPU with stand-in timers, for the tests);
``run_ladder_bench`` returns a dict that the GPU check merges into its JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .fresh import continue_after_device_lost, run_fresh_process  # noqa: F401  (the check's steps, here too)
from .grid import CAUSALS, DS, DTYPES, MODES, NS, plan, run_plan
from .methods import PUBLIC_OP, four_warp_backward, is_ours, methods, sdpa  # noqa: F401
from .point import REP_MS, WARMUP_MS, DeviceLost, device_usable, matmul_ceiling, measure_ceilings, measure_point, shape
from .records import VOCABULARY
from .results import autotuned_choices, format_ladder, memory_ratios, target_ratios, write_result  # noqa: F401

# The names tests/test_gpu.py and tests/ahead_probe.py reach through this module.
_sdpa, _methods, _device_usable, _measure_point = sdpa, methods, device_usable, measure_point
__all__ = ["DeviceLost", "continue_after_device_lost", "format_ladder", "four_warp_backward", "plan", "precompile",
           "run_fresh_process", "run_ladder_bench", "write_result"]


def _record_launches(p, device, tokens, hidden, noted_errors) -> None:
    """Call every flashlib method once at point p's shape, as the benchmark will (nothing runs
    under :func:`flashlib.bench.ahead.recording`: the launches are noted)."""
    # the public op launches the kernels of the ladder row it runs (op.path_for: "tma" + "tuned"),
    # recorded with that row
    ours = {name: fn for name, fn in methods(p["mode"]).items() if is_ours(name) and name != PUBLIC_OP}
    batch, heads = shape(p["n"], p["d"], tokens, hidden)
    q, k, v, dout = (torch.empty(batch, heads, p["n"], p["d"], device=device, dtype=getattr(torch, p["dtype"]))
                     for _ in range(4))  # (B, H, N, D); never read: nothing runs
    for name, fn in ours.items():
        try:
            if p["mode"] == "fwd":
                fn(q, k, v, p["causal"])
            else:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                fn(qg, kg, vg, p["causal"]).backward(dout)
        except Exception as exc:  # it will fail again, and be reported, when measured
            noted_errors.append(f"{name} at {p}: {type(exc).__name__}: {exc}"[:300])


def precompile(grid, *, threads: int | None = None, device="cuda", tokens=16384, hidden=2048, log=print) -> dict:
    """Compile every flashlib kernel the grid will launch, on ``threads`` threads, launching
    nothing (:mod:`flashlib.bench.ahead`): each method is recorded once per head dim, dtype,
    mask and pass, at the first point of the grid with them (every N of the grid binds the
    same arguments alike, multiples of 16, so the binaries are the same).
    Returns the counts and seconds for the JSON."""
    from .ahead import compile_notes, recording

    start = time.perf_counter()
    firsts = {}
    for p in grid:
        firsts.setdefault((p["d"], p["dtype"], p["causal"], p["mode"]), p)
    notes, errors = [], []
    for p in firsts.values():
        with recording() as noted:
            _record_launches(p, device, tokens, hidden, errors)
        notes.extend(noted)
    recorded = time.perf_counter() - start
    result = compile_notes(notes, threads)
    result.update(keys=len(firsts), launches_noted=len(notes), record_seconds=round(recorded, 2),
                  record_errors=errors[:5])
    log(f"  compiled ahead: {result['kernels']} kernels ({result['failed']} failed) for {len(firsts)} keys "
        f"in {result['seconds']:.0f} s on {result['threads']} threads")
    return result


def provenance(device="cuda") -> dict:
    """Device, versions and date of a ladder run."""
    from importlib.metadata import version

    gpu = device == "cuda"
    return {"device": torch.cuda.get_device_name() if gpu else str(device),
            "capability": list(torch.cuda.get_device_capability()) if gpu else None,
            "torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def _compile_ahead(grid, device, tokens, hidden, log) -> dict:
    try:
        return precompile(grid, device=device, tokens=tokens, hidden=hidden, log=log)
    except Exception as exc:  # the points then compile as they go
        compiled = dict(error=f"{type(exc).__name__}: {exc}"[:500])
        log(f"  compiling ahead failed ({compiled['error']}); compiling at first launch instead")
        return compiled


def _autotuned(ds, dtypes, causals, ns) -> tuple[dict, dict]:
    try:  # read from the autotuners' caches in this process; nothing runs on the device
        return autotuned_choices(ds, dtypes, causals, ns)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}, {}


def run_ladder_bench(budget_s: float = 200.0, *, ds=DS, ns=NS, dtypes=DTYPES, causals=CAUSALS, modes=MODES,
                     log=print, progress=None, compile_ahead: bool = True, points=None, exclude=(),
                     ceilings: bool = True, device="cuda", tokens=16384, hidden=2048, bench=None,
                     peak=None) -> dict:
    """Measure the grid within ``budget_s`` seconds; returns {"ladder": {...}} for the JSON.
    progress(points) is called after each grid point (to save a run that may be cut short).
    compile_ahead: first compile every kernel the grid launches on all cores (:func:`precompile`;
    what this process compiled before is not compiled again). points: measure these grid
    points instead of the whole grid, in their order; exclude: method names left out;
    ceilings: measure the matmul rate and copy bandwidth first. When a method leaves the device
    unusable the run stops there: ``device_lost`` names it and lists the points still to
    measure (:func:`continue_after_device_lost` measures them in a fresh process).
    device, tokens, hidden, bench and peak: as for one point; another device than "cuda" (with
    stand-in timers) runs the same steps on a CPU, for the tests."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run_ladder_bench: no CUDA device; the ladder benchmark runs on a GPU "
                           "(recorded results are in data/bench/)")
    start = time.perf_counter()
    info = provenance(device)
    log(f"ladder benchmark on {info['device']} (budget {budget_s:.0f} s)")
    measured = measure_ceilings(device) if ceilings else None
    if measured:
        rate, kind = matmul_ceiling(measured)
        log(f"  ceilings: {kind} matmul {rate:.0f} TFLOP/s, copy {measured['copy_gbps']:.0f} GB/s")
    chosen = {mode: {name: fn for name, fn in methods(mode).items() if name not in exclude} for mode in modes}
    grid = plan(ds, ns, dtypes, causals, modes) if points is None else [dict(p) for p in points]
    compiled = _compile_ahead(grid, device, tokens, hidden, log) if compile_ahead else None
    timeline, lost = [], []
    rows, skipped = run_plan(grid, lambda p: measure_point(p, chosen[p["mode"]], log, device=device, tokens=tokens,
                                                           hidden=hidden, bench=bench, peak=peak),
                             budget_s - (time.perf_counter() - start), progress=progress, timeline=timeline,
                             lost=lost)
    autotuned, autotuned_by_n = _autotuned(ds, dtypes, causals, ns)
    if skipped:
        log(f"  time budget reached: {len(skipped)} grid points skipped (listed in the JSON)")
    matmul = matmul_ceiling(measured)[0] if measured else None
    return {"ladder": {
        "provenance": info, "vocabulary": VOCABULARY,
        "config": {"tokens": tokens, "hidden": hidden, "ds": list(ds), "ns": list(ns), "dtypes": list(dtypes),
                   "causals": list(causals), "modes": list(modes),
                   "timing": f"triton.testing.do_bench median ms (ms_p20, ms_p80: 20th and 80th percentiles), "
                             f"warmup {WARMUP_MS} ms, rep {REP_MS} ms",
                   "flops": "4*B*H*N*N*d forward, halved if causal; fwd_bwd = 3.5 x forward",
                   "budget_s": budget_s, "excluded": list(exclude)},
        "ceilings": measured, "points": rows, "skipped": skipped, "elapsed_s": time.perf_counter() - start,
        "timeline": timeline, "precompile": compiled, "device_lost": lost[0] if lost else None,
        "autotuned": autotuned, "autotuned_by_n": autotuned_by_n, "target_ratios": target_ratios(rows, matmul),
        "memory_ratios": memory_ratios(rows)}}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.gpu",
                                     description="The ladder benchmark alone (the GPU check runs it too).")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run (default 200)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default data/bench/)")
    parser.add_argument("--no-precompile", action="store_true", help="compile each kernel at its first launch")
    parser.add_argument("--points", default=None,
                        help="JSON file with a list of grid points to measure instead of the whole grid")
    parser.add_argument("--exclude", action="append", default=[], metavar="METHOD",
                        help="leave this method out (repeatable), e.g. ladder:bulk")
    parser.add_argument("--result", default=None,
                        help="write the result to this file (after every point, then in full) instead of --out")
    parser.add_argument("--no-ceilings", action="store_true", help="do not measure the matmul rate and bandwidth")
    args = parser.parse_args(argv)
    args.grid = None
    if args.points is not None:
        args.grid = json.loads(Path(args.points).read_text())
        if not isinstance(args.grid, list) or not all(isinstance(p, dict) for p in args.grid):
            parser.error(f"--points must name a JSON file holding a list of grid points, got {args.points}")
    return args


def main(argv=None):
    args = parse_args(argv)

    def save_partial(rows):  # the rows so far, for a caller that may have to stop this process
        Path(args.result).write_text(json.dumps({"points": rows}) + "\n")
    result = run_ladder_bench(args.budget, compile_ahead=not args.no_precompile, points=args.grid,
                              exclude=tuple(args.exclude), ceilings=not args.no_ceilings,
                              progress=save_partial if args.result is not None else None)
    if result["ladder"]["target_ratios"]:
        print(format_ladder(result))
    if args.result is not None:
        Path(args.result).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.result}")
    else:
        print(f"wrote {write_result(result, args.out)}")


if __name__ == "__main__":
    main()
