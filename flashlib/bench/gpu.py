"""The ladder benchmark: every rung and every SDPA backend, side by side, in one GPU run.

For each head dim d, sequence length N, dtype, causal flag and pass (forward, or forward
and backward) it times, with ``triton.testing.do_bench`` medians:

    rung:<name>        each forward of :mod:`flashlib.kernels.ladder` (forward only)
    flashlib           ``flash_attention`` as shipped (teaching forward + teaching backward)
    flashlib:4-warp-backward  the same with the backward on 64 x 64 tiles and 4 warps
    flashlib:tuned     rung 3's forward + the tuned backward (``backward="tuned"``)
    flashlib:lean      rung 4's forward + ``backward="lean"``
    flashlib:bulk      rung 4's forward + ``backward="bulk"`` (dQ by bulk reductions)
    sdpa:<backend>     torch's scaled_dot_product_attention forced to one backend
                       (flash, efficient, cudnn; math only where its N x N matrices fit)

with the peak memory of one call, and checks each rung's output against SDPA. The device's
bf16 matmul rate and copy bandwidth, measured in the same run, are the ceilings. Batch x
N is held at ``tokens`` and heads x d at ``hidden`` (as FlashAttention's own benchmarks),
so every point moves the same number of tokens.

A time budget bounds the run: points are measured in priority order (the performance
targets first: d = 128, N >= 4k); a point starts only if the longest point of its kind so
far (the first of a head dim, dtype, mask and pass, or a later one) would still fit, and
whatever the budget leaves out is listed as skipped. The GPU check compiles the kernels
ahead (:func:`precompile`), so that first points mostly autotune. A kernel fault (an
illegal address, say) leaves a process unable to use the GPU at all: the run then stops,
records which method did it, and the GPU check measures the points left in a fresh process
without that method (:func:`continue_after_device_lost`).
Imported and run only on a CUDA machine; ``run_ladder_bench`` returns a dict that the GPU
check merges into its JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from ..roofline import attention_flops, tflops

DS = (64, 128)
NS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("float16", "bfloat16")
CAUSALS = (False, True)
MODES = ("fwd", "fwd_bwd")
# backward step -> the forward rung it is timed with in "flashlib:<step>" rows. "atomic" is
# not in the default grid: it lost to "tuned" at every point of the run that measured it.
BACKWARD_PAIRS = {"tuned": "tma", "lean": "lean", "bulk": "lean"}
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
TARGET_D, TARGET_N = 128, 4096


def plan(ds=DS, ns=NS, dtypes=DTYPES, causals=CAUSALS, modes=MODES) -> list[dict]:
    """Every point of the grid once, the performance targets (d = 128, N >= 4k) first."""
    points = [dict(d=d, n=n, dtype=dtype, causal=causal, mode=mode)
              for d in ds for n in ns for dtype in dtypes for causal in causals for mode in modes]

    def priority(p):
        target = p["d"] == TARGET_D and p["n"] >= TARGET_N
        return (not target, p["d"] != TARGET_D, -p["n"] if target else p["n"], p["mode"] != "fwd")

    return sorted(points, key=priority)


def shape(n: int, d: int, tokens: int = 16384, hidden: int = 2048) -> tuple[int, int]:
    """(batch, heads) with batch * N = tokens and heads * d = hidden (at least 1 each)."""
    return max(1, tokens // n), max(1, hidden // d)


# ----- GPU side ---------------------------------------------------------------------------

# do_bench's warm-up and repetition windows, in milliseconds: short enough that the whole grid
# fits the GPU check's budget, long enough for hundreds of repetitions of a short kernel (a
# long one repeats only a few times, but each of its runs is long)
WARMUP_MS, REP_MS = 5, 25


def _bench_ms(fn, warmup: int = WARMUP_MS, rep: int = REP_MS) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _bench_spread(fn, warmup: int = WARMUP_MS, rep: int = REP_MS) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) of the times in ms: the spread says how far apart two
    medians must be before their order means anything."""
    import triton

    median, low, high = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return float(median), float(low), float(high)


def _peak_bytes(fn) -> int:
    """Bytes allocated at the peak of one call, beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def measure_ceilings(device="cuda") -> dict:
    """The device's bf16 matmul rate (8192³) and copy bandwidth (1 GiB), measured now."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_ms = _bench_ms(lambda: a @ b, warmup=25, rep=100)
    del a, b
    x = torch.empty(2**28, device=device, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = _bench_ms(lambda: y.copy_(x), warmup=25, rep=100)
    nbytes = 2 * x.numel() * x.element_size()  # read once, write once
    del x, y
    return {"bf16_matmul_tflops": tflops(2.0 * n ** 3, matmul_ms), "matmul_shape": [n, n, n],
            "copy_gbps": nbytes / (copy_ms * 1e-3) / 1e9, "copy_bytes": nbytes}


def _sdpa(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel([which]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


class DeviceLost(RuntimeError):
    """A method left the GPU unusable for this process (a sticky CUDA error, such as an illegal
    address): nothing more can run here. ``row`` is the method's error row at ``point``."""

    def __init__(self, method: str, point: dict, row: dict):
        super().__init__(f"{method} left the device unusable at {point}: {row.get('error')}")
        self.method, self.point, self.row = method, point, row


def _device_usable(device="cuda") -> bool:
    """After an error: can this process still run anything on the device? An out-of-memory
    error leaves it usable; a kernel fault does not (every later CUDA call fails too)."""
    if torch.device(device).type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


def four_warp_backward(q):
    """The shipped configuration for q with the teaching backward on 64 x 64 tiles and 4 warps
    (2 pipeline stages at head dim 64, 1 above: more spills at 128)."""
    from dataclasses import replace

    from ..kernels.config import default_config, head_dim_pad

    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    stages = 2 if head_dim_pad(q.shape[-1]) <= 64 else 1
    return replace(default_config(q.shape[-1], q.dtype, capability), bwd_block_q=64, bwd_block_k=64,
                   bwd_num_warps=4, bwd_num_stages=stages)


def _methods(mode: str):
    """{name: f(q, k, v, causal) -> out} for one pass."""
    from ..ladder import attention
    from ..ladder.forward import forward
    from ..ladder.rungs import LADDER

    methods = {}
    if mode == "fwd":
        for rung in LADDER:
            methods[f"rung:{rung.name}"] = (lambda r: lambda q, k, v, c: forward(q, k, v, causal=c, rung=r)[0])(
                rung.name)
    else:
        methods["flashlib"] = lambda q, k, v, c: attention(q, k, v, causal=c, forward="teaching",
                                                           backward="teaching")
        # the same, with backward tiles that hold each score once on Hopper (the shipped 64 x 64
        # on 8 warps hold them twice: compile.exponentials_per_score), to time against it
        methods["flashlib:4-warp-backward"] = lambda q, k, v, c: attention(
            q, k, v, causal=c, forward="teaching", backward="teaching", config=four_warp_backward(q))
        for bwd, fwd in BACKWARD_PAIRS.items():
            methods[f"flashlib:{bwd}"] = (lambda f, b: lambda q, k, v, c: attention(
                q, k, v, causal=c, forward=f, backward=b))(fwd, bwd)
    for backend in SDPA_BACKENDS:
        methods[f"sdpa:{backend}"] = _sdpa(backend)
    return methods


def _math_fits(batch, heads, n, mode, device="cuda") -> bool:
    """The math backend keeps N x N scores and probabilities (float32 inside): does it fit?"""
    if torch.device(device).type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    # float32 N x N buffers alive at the peak (an H200 measured ~2.3 forward), with margin
    need = batch * heads * n * n * 4 * (3 if mode == "fwd" else 5)
    return need < 0.8 * free


def _measure_point(p, methods, log, *, device="cuda", tokens=16384, hidden=2048, bench=None, peak=None,
                   usable=None) -> list[dict]:
    """Every method at one grid point; bench and peak default to the GPU timers. Raises
    DeviceLost when a method's error leaves the device unusable (``usable(device)`` false)."""
    bench, peak, usable = bench or _bench_spread, peak or _peak_bytes, usable or _device_usable
    if device == "cuda":
        torch.cuda.empty_cache()  # the previous point's cached blocks would hide free memory from _math_fits
    dtype = getattr(torch, p["dtype"])
    batch, heads = shape(p["n"], p["d"], tokens, hidden)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, p["n"], p["d"], device=device, dtype=dtype, generator=gen)
               for _ in range(3))  # (B, H, N, D)
    flops = attention_flops(batch, heads, p["n"], p["n"], p["d"], causal=p["causal"], mode=p["mode"])
    rows = []
    reference = None
    if p["mode"] == "fwd":
        for backend in ("flash", "efficient", "cudnn"):
            try:
                reference = _sdpa(backend)(q, k, v, p["causal"]).float()
                break
            except RuntimeError:
                continue
    for name, fn in methods.items():
        row = dict(p, method=name, batch=batch, heads=heads, flops=flops)
        if name == "sdpa:math" and not _math_fits(batch, heads, p["n"], p["mode"], device):
            rows.append(dict(row, error="skipped: the N x N matrices would not fit in memory"))
            continue
        try:
            if p["mode"] == "fwd":
                def call():
                    return fn(q, k, v, p["causal"])
            else:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                dout = torch.randn_like(q)

                def call():
                    qg.grad = kg.grad = vg.grad = None  # each call allocates its own gradients
                    fn(qg, kg, vg, p["causal"]).backward(dout)
            with torch.no_grad() if p["mode"] == "fwd" else torch.enable_grad():
                out = call()
                if reference is not None and name.startswith("rung:"):
                    row["max_abs_err_vs_sdpa"] = float((out.float() - reference).abs().max())
                del out
                row["peak_bytes"] = peak(call)
                timed = bench(call)  # a median, or (median, 20th, 80th percentile)
                if isinstance(timed, (tuple, list)):
                    row["ms"], row["ms_p20"], row["ms_p80"] = (float(t) for t in timed)
                else:
                    row["ms"] = float(timed)
            row["tflops"] = tflops(flops, row["ms"])
        except Exception as exc:  # an unsupported backend or an OOM is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if not usable(device):
                log(f"  {name} left the device unusable at {p}: {row['error']}")
                raise DeviceLost(name, p, row) from exc
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    done = [r for r in rows if "tflops" in r]
    best = max(done, key=lambda r: r["tflops"]) if done else None
    log(f"  d={p['d']:3d} N={p['n']:5d} {p['dtype']:8s} causal={int(p['causal'])} {p['mode']:7s} "
        + (f"best {best['method']} {best['tflops']:.0f} TFLOP/s" if best else "no result"))
    return rows


def precompile(grid, *, threads: int | None = None, device="cuda", tokens=16384, hidden=2048, log=print) -> dict:
    """Compile every flashlib kernel the grid will launch, on ``threads`` threads, launching
    nothing (:mod:`flashlib.kernels.ahead`): each method is recorded once per head dim,
    dtype, mask and pass, at the first point of the grid with them (every N of the grid
    binds the same arguments alike, multiples of 16, so the binaries are the same).
    Returns the counts and seconds for the JSON."""
    from .ahead import compile_notes, recording

    start = time.perf_counter()
    firsts = {}
    for p in grid:
        firsts.setdefault((p["d"], p["dtype"], p["causal"], p["mode"]), p)
    notes, errors = [], []
    for p in firsts.values():
        methods = {name: fn for name, fn in _methods(p["mode"]).items() if not name.startswith("sdpa:")}
        batch, heads = shape(p["n"], p["d"], tokens, hidden)
        q, k, v, dout = (torch.empty(batch, heads, p["n"], p["d"], device=device, dtype=getattr(torch, p["dtype"]))
                         for _ in range(4))  # (B, H, N, D); never read: nothing runs
        with recording() as noted:
            for name, fn in methods.items():
                try:
                    if p["mode"] == "fwd":
                        fn(q, k, v, p["causal"])
                    else:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                        fn(qg, kg, vg, p["causal"]).backward(dout)
                except Exception as exc:  # it will fail again, and be reported, when measured
                    errors.append(f"{name} at {p}: {type(exc).__name__}: {exc}"[:300])
        notes.extend(noted)
        del q, k, v, dout
    recorded = time.perf_counter() - start
    result = compile_notes(notes, threads)
    result.update(keys=len(firsts), launches_noted=len(notes), record_seconds=round(recorded, 2),
                  record_errors=errors[:5])
    log(f"  compiled ahead: {result['kernels']} kernels ({result['failed']} failed) for {len(firsts)} keys "
        f"in {result['seconds']:.0f} s on {result['threads']} threads")
    return result


def _compile_key(p):
    """Points with one head dim, dtype, mask and pass launch the same kernels: the first of
    them compiles and autotunes (unless compiled ahead), the others only time."""
    return tuple(p.get(k) for k in ("d", "dtype", "causal", "mode")) if isinstance(p, dict) else None


def run_plan(grid, measure, budget_s: float, clock=time.perf_counter, progress=None,
             timeline=None, lost=None) -> tuple[list[dict], list[dict]]:
    """(rows measured, grid points skipped): a point starts only if the longest point of its
    kind so far would still end within budget_s. Two kinds: the first point of a head dim,
    dtype, mask and pass (it compiles and autotunes) and the others; before a kind's first
    measurement, the longest point of any kind stands in. progress(rows) is called after
    each point; timeline, a list, gets each measured point with the seconds it took
    (compiling and autotuning included) and whether it was the first of its kind. lost, a list,
    makes a DeviceLost stop the plan instead of raising: it gets {method, point, error, pending}
    (pending: that point and every later one, for a fresh process to measure)."""
    start, rows, skipped, seen = clock(), [], [], set()
    longest = {True: None, False: None}
    for i, p in enumerate(grid):
        first = _compile_key(p) not in seen
        known = [t for t in longest.values() if t is not None]
        estimate = longest[first] if longest[first] is not None else max(known, default=0.0)
        began = clock()
        if began - start + estimate > budget_s:
            skipped.append(p)
            continue
        try:
            rows.extend(measure(p))
        except DeviceLost as exc:
            if lost is None:
                raise
            rows.append(exc.row)
            lost.append(dict(method=exc.method, point=p, error=exc.row.get("error"), pending=list(grid[i:])))
            if progress is not None:
                progress(rows)
            break
        took = clock() - began
        seen.add(_compile_key(p))
        longest[first] = max(longest[first] or 0.0, took)
        if timeline is not None:
            timeline.append(dict(p, seconds=round(took, 2), first_of_kind=first))
        if progress is not None:
            progress(rows)
    return rows, skipped


def target_ratios(points, matmul_tflops: float | None = None) -> list[dict]:
    """At d = 128, N >= 4k: the best flashlib method over the best SDPA backend, per point
    (from medians); where both were timed with their spread, also ``ratio_range``: the ratio
    with ours at its 80th percentile time and theirs at its 20th, and the other way round.
    With the measured matmul rate, the fraction of it reached (stretch goal: 0.6 forward)."""
    out = []
    keys = sorted({(p["n"], p["dtype"], p["causal"], p["mode"]) for p in points
                   if p["d"] == TARGET_D and p["n"] >= TARGET_N})
    for n, dtype, causal, mode in keys:
        same = [p for p in points if p["d"] == TARGET_D and (p["n"], p["dtype"], p["causal"], p["mode"])
                == (n, dtype, causal, mode) and p.get("tflops")]
        ours = [p for p in same if not p["method"].startswith("sdpa:")]
        theirs = [p for p in same if p["method"].startswith("sdpa:")]
        if ours and theirs:
            a, b = max(ours, key=lambda p: p["tflops"]), max(theirs, key=lambda p: p["tflops"])
            spread = all(key in p for p in (a, b) for key in ("ms_p20", "ms_p80"))
            out.append(dict(n=n, dtype=dtype, causal=causal, mode=mode, ours=a["method"], sdpa=b["method"],
                            ratio=a["tflops"] / b["tflops"], target=1.0 if mode == "fwd" else 0.8,
                            # the same FLOPs on both sides: the ratio of rates is theirs / our time
                            ratio_range=[b["ms_p20"] / a["ms_p80"], b["ms_p80"] / a["ms_p20"]] if spread else None,
                            matmul_fraction=a["tflops"] / matmul_tflops if matmul_tflops else None))
    return out


def memory_ratios(points, ns=(4096, 16384)) -> list[dict]:
    """Peak memory of flash_attention (forward and backward) against dense attention: the math
    backend where it was measured, else the bytes of one N x N matrix of scores."""
    out = []
    for p in points:
        if p["method"] != "flashlib" or p["n"] not in ns or "peak_bytes" not in p:
            continue
        dense = [m for m in points if m["method"] == "sdpa:math" and "peak_bytes" in m
                 and all(m[key] == p[key] for key in ("d", "n", "dtype", "causal", "mode"))]
        element_size = torch.empty(0, dtype=getattr(torch, p["dtype"])).element_size()
        scores = p["batch"] * p["heads"] * p["n"] ** 2 * element_size
        out.append(dict(d=p["d"], n=p["n"], dtype=p["dtype"], causal=p["causal"], flashlib_bytes=p["peak_bytes"],
                        dense_bytes=dense[0]["peak_bytes"] if dense else None, scores_bytes=scores,
                        ratio=p["peak_bytes"] / dense[0]["peak_bytes"] if dense else None,
                        ratio_to_scores=p["peak_bytes"] / scores))
    return out


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
    from importlib.metadata import version

    start = time.perf_counter()
    gpu = device == "cuda"
    info = {"device": torch.cuda.get_device_name() if gpu else str(device),
            "capability": list(torch.cuda.get_device_capability()) if gpu else None,
            "torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    log(f"ladder benchmark on {info['device']} (budget {budget_s:.0f} s)")
    measured = measure_ceilings(device) if ceilings else None
    if measured:
        log(f"  ceilings: bf16 matmul {measured['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"copy {measured['copy_gbps']:.0f} GB/s")
    methods = {mode: {name: fn for name, fn in _methods(mode).items() if name not in exclude} for mode in modes}
    grid = plan(ds, ns, dtypes, causals, modes) if points is None else [dict(p) for p in points]
    compiled = None
    if compile_ahead:
        try:
            compiled = precompile(grid, device=device, tokens=tokens, hidden=hidden, log=log)
        except Exception as exc:  # the points then compile as they go
            compiled = dict(error=f"{type(exc).__name__}: {exc}"[:500])
            log(f"  compiling ahead failed ({compiled['error']}); compiling at first launch instead")
    timeline, lost = [], []
    rows, skipped = run_plan(grid, lambda p: _measure_point(p, methods[p["mode"]], log, device=device, tokens=tokens,
                                                            hidden=hidden, bench=bench, peak=peak),
                             budget_s - (time.perf_counter() - start), progress=progress, timeline=timeline,
                             lost=lost)
    try:  # read from the autotuners' caches in this process; nothing runs on the device
        chosen, chosen_by_n = autotuned_choices(ds, dtypes, causals, ns)
    except Exception as exc:
        chosen, chosen_by_n = {"error": f"{type(exc).__name__}: {exc}"[:300]}, {}
    elapsed = time.perf_counter() - start
    if skipped:
        log(f"  time budget reached: {len(skipped)} grid points skipped (listed in the JSON)")
    matmul = measured["bf16_matmul_tflops"] if measured else None
    return {"ladder": {
        "provenance": info,
        "config": {"tokens": tokens, "hidden": hidden, "ds": list(ds), "ns": list(ns), "dtypes": list(dtypes),
                   "causals": list(causals), "modes": list(modes), "timing": f"triton.testing.do_bench median ms (ms_p20, ms_p80: 20th and 80th percentiles), warmup {WARMUP_MS} ms, rep {REP_MS} ms",
                   "flops": "4*B*H*N*N*d forward, halved if causal; fwd_bwd = 3.5 x forward",
                   "budget_s": budget_s, "excluded": list(exclude)},
        "ceilings": measured, "points": rows, "skipped": skipped, "elapsed_s": elapsed, "timeline": timeline,
        "precompile": compiled, "device_lost": lost[0] if lost else None,
        "autotuned": chosen, "autotuned_by_n": chosen_by_n, "target_ratios": target_ratios(rows, matmul),
        "memory_ratios": memory_ratios(rows)}}


def continue_after_device_lost(result: dict, deadline: float, *, run_fresh=None, clock=time.perf_counter,
                               log=print, restarts: int = 3) -> dict:
    """After a method left the device unusable (``result["ladder"]["device_lost"]``), measure
    the points it left pending in fresh processes without that method (nor any other that
    did the same), until none is pending, ``deadline`` (a ``clock()`` time) is near, or after
    ``restarts`` processes. run_fresh(points, exclude, budget_s) returns the fresh process's
    {"ladder": ...} or None (it died); by default :func:`run_fresh_process`. Merges into
    result, which it returns, with every loss listed in ``devices_lost``."""
    ladder = result["ladder"]
    run_fresh = run_fresh or run_fresh_process
    losses = [ladder["device_lost"]] if ladder.get("device_lost") else []
    pending = losses[0]["pending"] if losses else []
    while pending:
        left = deadline - clock()
        if restarts <= 0 or left < 60:
            log(f"  {len(pending)} grid points not measured: " + ("no time left" if left < 60 else "too many faults"))
            ladder["skipped"] = ladder.get("skipped", []) + pending
            break
        restarts -= 1
        exclude = sorted({loss["method"] for loss in losses})
        log(f"  measuring the {len(pending)} points left in a fresh process, without {', '.join(exclude)}")
        part = run_fresh(pending, exclude, left - 15)
        if part is None:
            log("  the fresh process returned nothing")
            ladder["skipped"] = ladder.get("skipped", []) + pending
            break
        fresh = part["ladder"]
        ladder["points"] = ladder.get("points", []) + fresh.get("points", [])
        ladder["timeline"] = ladder.get("timeline", []) + fresh.get("timeline", [])
        # one choice per key and sequence bucket: each process tuned the buckets it measured
        by_n = ladder.get("autotuned_by_n") or {}
        for key, buckets in (fresh.get("autotuned_by_n") or {}).items():
            by_n[key] = {**by_n.get(key, {}), **buckets}
        ladder["autotuned_by_n"] = by_n
        ladder["autotuned"] = {key: buckets[max(buckets, key=int)] for key, buckets in by_n.items()}
        pending = []
        if fresh.get("device_lost"):
            losses.append(fresh["device_lost"])
            pending = fresh["device_lost"]["pending"]
        # what the fresh process neither measured nor left pending: skipped by its budget, or
        # never reached when it was stopped
        ladder["skipped"] = ladder.get("skipped", []) + fresh.get("skipped", []) + part.get("unreached", [])
    if losses:
        ladder["devices_lost"] = [{k: v for k, v in loss.items() if k != "pending"} for loss in losses]
        ladder["device_lost"] = ladder["devices_lost"][0]
        matmul = (ladder.get("ceilings") or {}).get("bf16_matmul_tflops")
        ladder["target_ratios"] = target_ratios(ladder["points"], matmul)
        ladder["memory_ratios"] = memory_ratios(ladder["points"])
    return result


def _point_key(p) -> tuple:
    return tuple(p.get(k) for k in ("d", "n", "dtype", "causal", "mode"))


def run_fresh_process(points, exclude, budget_s: float, *, out_path=None, python=None) -> dict | None:
    """Run ``python -m flashlib.bench.gpu`` on points without the methods in exclude, in a new
    process (a new CUDA context), and return its result; None if it wrote none. Its result file
    is written after every point, so a process stopped on time still returns what it measured
    (the points it never reached are returned as ``unreached``)."""
    import os
    import subprocess
    import sys
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="flashlib-ladder-"))
    points_file = work / "points.json"
    points_file.write_text(json.dumps(points))
    out_path = Path(out_path) if out_path is not None else work / "result.json"
    cmd = [python or sys.executable, "-m", "flashlib.bench.gpu", "--points", str(points_file),
           "--budget", f"{max(budget_s, 1.0):.0f}", "--result", str(out_path), "--no-precompile", "--no-ceilings"]
    for name in exclude:
        cmd += ["--exclude", name]
    root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    try:
        subprocess.run(cmd, env=env, timeout=budget_s + 30, check=False)
    except subprocess.TimeoutExpired:
        pass
    if not out_path.exists():
        return None
    result = json.loads(out_path.read_text())
    if "ladder" not in result:  # a partial result: the rows of the points done so far
        done = {_point_key(r) for r in result.get("points", [])}
        result = {"ladder": {"points": result.get("points", [])},
                  "unreached": [p for p in points if _point_key(p) not in done]}
    return result


def autotuned_choices(ds, dtypes, causals, ns=NS) -> tuple[dict, dict]:
    """What the autotuners kept in this process, as ({"d=128 bfloat16 causal=True": {"tma":
    tiles, ..., "bwd_dkdv": tiles, "bwd_lean_dq": tiles}}, the same per sequence bucket:
    {"d=128 ...": {"16384": {...}}}). The first is the longest bucket's choice."""
    from ..ladder.backward import autotuned_choices as backward_choices
    from ..kernels.config import seq_bucket
    from ..ladder.forward import autotuned_choice
    from ..ladder.rungs import LADDER

    rungs = [rung.name for rung in LADDER if rung.name != "teaching"]
    by_n = {}
    for d in ds:
        for dtype in dtypes:
            for causal in causals:
                q = torch.empty(1, 1, 1, d, dtype=getattr(torch, dtype))
                buckets = {}
                for n in ns:
                    found = {rung: autotuned_choice(q, causal, rung, seq=n) for rung in rungs}
                    for bwd in BACKWARD_PAIRS:
                        prefix = "bwd_" if bwd == "tuned" else f"bwd_{bwd}_"
                        found.update({prefix + k: t for k, t in backward_choices(d, q.dtype, causal, bwd, seq=n).items()})
                    found = {k: t for k, t in found.items() if t}
                    if found:
                        buckets[str(seq_bucket(n, n))] = found
                if buckets:
                    by_n[f"d={d} {dtype} causal={causal}"] = buckets
    longest = {key: buckets[max(buckets, key=int)] for key, buckets in by_n.items()}
    return longest, by_n


def format_ladder(result: dict) -> str:
    """A plain table of the target ratios for the GPU check's printout."""
    rows = result["ladder"]["target_ratios"]
    lines = [f"{'N':>6} {'dtype':>9} {'causal':>6} {'pass':>7} {'ours':>16} {'best SDPA':>16} "
             f"{'ratio':>6} {'target':>6} {'of matmul':>9} {'range':>9}"]
    for r in rows:
        fraction = f"{r['matmul_fraction']:.2f}" if r.get("matmul_fraction") else "-"
        spread = "{:.2f}-{:.2f}".format(*r["ratio_range"]) if r.get("ratio_range") else "-"
        lines.append(f"{r['n']:>6} {r['dtype']:>9} {int(r['causal']):>6} {r['mode']:>7} {r['ours']:>16} "
                     f"{r['sdpa']:>16} {r['ratio']:>6.2f} {r['target']:>6.1f} {fraction:>9} {spread:>9}")
    lost = result["ladder"].get("devices_lost") or ([result["ladder"]["device_lost"]]
                                                    if result["ladder"].get("device_lost") else [])
    for loss in lost:
        p = loss["point"]
        lines.append(f"{loss['method']} left the device unusable at d={p['d']} N={p['n']} {p['dtype']} "
                     f"causal={int(p['causal'])} {p['mode']} ({loss['error']}); later points ran without it")
    return "\n".join(lines)


def write_result(result: dict, out_dir: Path | str | None = None) -> Path:
    """Write a standalone run as data/bench/gpu-ladder-<device>-<date>.json; returns the path."""
    from .records import BENCH_DIR

    info = result["ladder"]["provenance"]
    slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
    out_dir = Path(out_dir) if out_dir is not None else BENCH_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu-ladder-{slug}-{info['date']}.json"
    path.write_text(json.dumps(dict(result, provenance=info), indent=1) + "\n")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.gpu",
                                     description="The ladder benchmark alone (the GPU check runs it too).")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run (default 200)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default data/bench/)")
    parser.add_argument("--no-precompile", action="store_true", help="compile each kernel at its first launch")
    parser.add_argument("--points", default=None,
                        help="JSON file with a list of grid points to measure instead of the whole grid")
    parser.add_argument("--exclude", action="append", default=[], metavar="METHOD",
                        help="leave this method out (repeatable), e.g. flashlib:bulk")
    parser.add_argument("--result", default=None,
                        help="write the result to this file (after every point, then in full) instead of --out")
    parser.add_argument("--no-ceilings", action="store_true", help="do not measure the matmul rate and bandwidth")
    args = parser.parse_args(argv)
    points = None
    if args.points is not None:
        points = json.loads(Path(args.points).read_text())
        if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
            parser.error(f"--points must name a JSON file holding a list of grid points, got {args.points}")
    def save_partial(rows):  # the rows so far, for a caller that may have to stop this process
        Path(args.result).write_text(json.dumps({"points": rows}) + "\n")
    result = run_ladder_bench(args.budget, compile_ahead=not args.no_precompile, points=points,
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
