"""The ladder benchmark's grid, the order it is measured in, and the time budget.

A grid point is {d, n, dtype, causal, mode} (its tensors' shape: :func:`flashlib.bench.point.shape`).
Points are measured in priority order, the performance targets (d = 128, N >= 4k)
first, and a point starts only if the longest point of its kind so far would still end
within the budget (:func:`run_plan`); what the budget leaves out is listed as skipped.
"""
from __future__ import annotations

import time

from .methods import variant_of
from .point import DeviceLost

DS = (64, 128)
NS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("float16", "bfloat16")
CAUSALS = (False, True)
MODES = ("fwd", "fwd_bwd")
TARGET_D, TARGET_N = 128, 4096
POINT_KEYS = ("d", "n", "dtype", "causal", "mode")


def plan(ds=DS, ns=NS, dtypes=DTYPES, causals=CAUSALS, modes=MODES) -> list[dict]:
    """Every point of the grid once, the performance targets (d = 128, N >= 4k) first."""
    points = [dict(d=d, n=n, dtype=dtype, causal=causal, mode=mode)
              for d in ds for n in ns for dtype in dtypes for causal in causals for mode in modes]

    def priority(p):
        target = p["d"] == TARGET_D and p["n"] >= TARGET_N
        return (not target, p["d"] != TARGET_D, -p["n"] if target else p["n"], p["mode"] != "fwd")

    return sorted(points, key=priority)


def point_key(p) -> tuple:
    """(d, n, dtype, causal, mode): a grid point, or the point a result row belongs to. A variant's
    row (methods.VARIANTS: grouped heads, a window) times another problem than its point's: it
    belongs to a point of its own, of mode "<mode>+<variant>", that no other method shares."""
    key = tuple(p.get(k) for k in POINT_KEYS)
    variant = variant_of(p.get("method"))
    return key if variant is None else (*key[:-1], f"{key[-1]}+{variant}")


def compile_key(p):
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
        first = compile_key(p) not in seen
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
        seen.add(compile_key(p))
        longest[first] = max(longest[first] or 0.0, took)
        if timeline is not None:
            timeline.append(dict(p, seconds=round(took, 2), first_of_kind=first))
        if progress is not None:
            progress(rows)
    return rows, skipped
