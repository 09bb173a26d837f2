"""After a kernel fault: the points a run left, measured in fresh processes.

A kernel that faults on the GPU (an illegal address, say) leaves its process unable to run
anything more there: every later call fails too. The ladder run then stops and records the
method and the points still pending (``device_lost``); :func:`continue_after_device_lost`
measures those points in a new process (a new CUDA context) without that method, and again
without the next one if another faults, until none is pending or the time is spent.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from . import processes
from .grid import point_key
from .point import matmul_ceiling
from .results import memory_ratios, target_ratios

FRESH_MIN_S = 60  # below this a fresh process would spend its time starting and compiling


def _merge(ladder: dict, part: dict) -> list[dict]:
    """Fold a fresh process's result into ladder; returns the points it left pending."""
    fresh = part["ladder"]
    ladder["points"] = ladder.get("points", []) + fresh.get("points", [])
    ladder["timeline"] = ladder.get("timeline", []) + fresh.get("timeline", [])
    # one choice per key and sequence bucket: each process tuned the buckets it measured
    by_n = ladder.get("autotuned_by_n") or {}
    for key, buckets in (fresh.get("autotuned_by_n") or {}).items():
        by_n[key] = {**by_n.get(key, {}), **buckets}
    ladder["autotuned_by_n"] = by_n
    ladder["autotuned"] = {key: buckets[max(buckets, key=int)] for key, buckets in by_n.items()}
    # what the fresh process neither measured nor left pending: skipped by its budget, or
    # never reached when it was stopped
    ladder["skipped"] = ladder.get("skipped", []) + fresh.get("skipped", []) + part.get("unreached", [])
    return list(fresh["device_lost"]["pending"]) if fresh.get("device_lost") else []


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
        if restarts <= 0 or left < FRESH_MIN_S:
            log(f"  {len(pending)} grid points not measured: "
                + ("no time left" if left < FRESH_MIN_S else "too many faults"))
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
        pending = _merge(ladder, part)
        if part["ladder"].get("device_lost"):
            losses.append(part["ladder"]["device_lost"])
    if losses:
        ladder["devices_lost"] = [{k: v for k, v in loss.items() if k != "pending"} for loss in losses]
        ladder["device_lost"] = ladder["devices_lost"][0]
        matmul = matmul_ceiling(ladder["ceilings"])[0] if ladder.get("ceilings") else None
        ladder["target_ratios"] = target_ratios(ladder["points"], matmul)
        ladder["memory_ratios"] = memory_ratios(ladder["points"])
    return result


def run_fresh_process(points, exclude, budget_s: float, *, out_path=None, python=None,
                      log=print) -> dict | None:
    """Run ``python -m flashlib.bench.gpu`` on points without the methods in exclude, in a new
    process (a new CUDA context), and return its result; None if it wrote none. Its result file
    is written after every point, so a process stopped on time still returns what it measured
    (the points it never reached are returned as ``unreached``); its output's tail goes to log."""
    work = Path(tempfile.mkdtemp(prefix="flashlib-ladder-"))
    points_file = work / "points.json"
    points_file.write_text(json.dumps(points))
    out_path = Path(out_path) if out_path is not None else work / "result.json"
    cmd = [python or sys.executable, "-m", "flashlib.bench.gpu", "--points", str(points_file),
           "--budget", f"{max(budget_s, 1.0):.0f}", "--result", str(out_path), "--no-precompile", "--no-ceilings"]
    for name in exclude:
        cmd += ["--exclude", name]
    processes.finish(processes.start(cmd, budget_s + 30), log=log)
    if not out_path.exists():
        return None
    result = json.loads(out_path.read_text())
    if "ladder" not in result:  # a partial result: the rows of the points done so far
        done = {point_key(r) for r in result.get("points", [])}
        result = {"ladder": {"points": result.get("points", [])},
                  "unreached": [p for p in points if point_key(p) not in done]}
    return result

