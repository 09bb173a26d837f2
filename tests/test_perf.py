"""flashlib.perf's arithmetic against hand-computed values, recorded-run loading, figures;
the ladder benchmark's plan and one grid point run on the CPU with stand-in timers."""
from __future__ import annotations

import json
import sys
from pathlib import Path
import time

import pytest
import torch

from flashlib import roofline
from flashlib.bench import gpu as perf_bench
from flashlib.bench import plots, records
from flashlib.course import perf_exercises, viz
from flashlib.kernels import triton_installed


def test_attention_flops_by_hand():
    # 4 * B * H * N_q * N_k * d = 4 * 2 * 3 * 5 * 7 * 11
    assert roofline.attention_flops(2, 3, 5, 7, 11) == 9240
    assert roofline.attention_flops(2, 3, 5, 7, 11, causal=True) == 4620
    assert roofline.attention_flops(2, 3, 5, 7, 11, mode="bwd") == 23100
    assert roofline.attention_flops(2, 3, 5, 7, 11, mode="fwd_bwd") == 32340
    assert roofline.attention_flops(1, 1, 4096, 4096, 128, causal=True, mode="fwd_bwd") == 3.5 * 2 * 4096 ** 2 * 128


def test_rates_and_roofline_by_hand():
    assert roofline.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert roofline.tflops(5e9, 0.5) == pytest.approx(10.0)
    assert roofline.arithmetic_intensity(1000.0, 250.0) == 4.0
    # 1e12 FLOPs at 100 TFLOP/s: 10 ms; 1e9 bytes at 1000 GB/s: 1 ms -> compute bound
    assert roofline.roofline_ms(1e12, 1e9, 100.0, 1000.0) == pytest.approx(10.0)
    # 1e9 FLOPs: 0.01 ms; 4e9 bytes: 4 ms -> memory bound
    assert roofline.roofline_ms(1e9, 4e9, 100.0, 1000.0) == pytest.approx(4.0)


def test_attention_bytes_by_hand():
    n, d = 256, 64
    # flash2, BLOCK_Q 128: Q once, K and V once per query block (2 blocks), O and lse once
    flash2 = (n * d + 2 * 2 * n * d + n * d + n) * 2
    assert roofline.attention_bytes(1, 1, n, d, block_q=128) == flash2 == 197120
    assert roofline.attention_bytes(3, 4, n, d, block_q=128) == 12 * flash2
    # standard: Q, K, V read and O written; S and P each written and read back
    assert roofline.attention_bytes(1, 1, n, d, method="standard") == (4 * n * d + 4 * n * n) * 2 == 655360


@pytest.mark.parametrize("call, name", [
    (lambda: roofline.attention_flops(0, 1, 1, 1, 1), "batch"),
    (lambda: roofline.attention_flops(1, 1, 1, 1, 2.0), "head_dim"),
    (lambda: roofline.attention_flops(1, 1, 1, 1, 1, mode="bwd+fwd"), "mode"),
    (lambda: roofline.tflops(1.0, 0.0), "milliseconds"),
    (lambda: roofline.attention_bytes(1, 1, 8, 8, method="dense"), "method"),
    (lambda: roofline.roofline_ms(1.0, 1.0, 0.0, 1.0), "peak_tflops"),
    (lambda: records.load_runs("tpu"), "kind"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        call()


def _gpu_run(date="2026-01-02", device="Test GPU"):
    points = []
    for n, (teach, tma, flash) in {4096: (100.0, 150.0, 140.0), 16384: (110.0, 170.0, 150.0)}.items():
        for method, rate in (("rung:teaching", teach), ("rung:tma", tma), ("sdpa:flash", flash),
                             ("sdpa:efficient", flash / 2)):
            points.append(dict(method=method, d=128, n=n, dtype="bfloat16", causal=False, mode="fwd", tflops=rate))
    points.append(dict(method="sdpa:cudnn", d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd",
                       error="RuntimeError: no kernel"))
    return {"device": device, "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8", "date": date,
            "ladder": {"points": points, "ceilings": {"bf16_matmul_tflops": 700.0, "copy_gbps": 4000.0}}}


def test_load_runs_sorts_by_date_and_labels(tmp_path):
    assert records.load_runs("gpu", tmp_path) == [] and records.latest("gpu", tmp_path) is None
    (tmp_path / "gpu-b-2026-03-01.json").write_text(json.dumps(_gpu_run("2026-03-01", "Newer GPU")))
    (tmp_path / "gpu-a-2026-01-02.json").write_text(json.dumps(_gpu_run()))
    (tmp_path / "cpu-2026-02-01.json").write_text(json.dumps(
        {"provenance": {"cpu": "Some CPU", "torch": "2.13.0", "date": "2026-02-01"}, "points": []}))
    runs = records.load_runs("gpu", tmp_path)
    assert [r["file"] for r in runs] == ["gpu-a-2026-01-02.json", "gpu-b-2026-03-01.json"]
    assert records.latest("gpu", tmp_path)["device"] == "Newer GPU"
    (tmp_path / "gpu-c-2026-04-01.json").write_text(json.dumps({"device": "No ladder", "date": "2026-04-01"}))
    assert records.latest("gpu", tmp_path)["device"] == "No ladder"
    assert records.latest("gpu", tmp_path, with_key="ladder")["device"] == "Newer GPU"
    assert records.label(runs[0]) == "Test GPU, torch 2.11.0, Triton 3.6.0, CUDA 12.8, 2026-01-02"
    assert records.label(records.latest("cpu", tmp_path)) == "Some CPU, torch 2.13.0, 2026-02-01"


def test_selections_from_a_run():
    run = _gpu_run()
    points = records.ladder_points(run, n=4096)
    assert len(points) == 5
    assert records.best_sdpa(points, 4096) == ("sdpa:flash", 140.0)
    assert records.best_sdpa(points, 512) is None
    assert records.ladder_gains(run, n=16384) == [("teaching", 110.0), ("tma", 170.0)]
    assert records.series(points) == {"rung:teaching": {4096: 100.0}, "rung:tma": {4096: 150.0},
                                   "sdpa:flash": {4096: 140.0}, "sdpa:efficient": {4096: 70.0}}


def test_target_and_memory_ratios():
    run = _gpu_run()
    ratios = perf_bench.target_ratios(run["ladder"]["points"], 600.0)
    assert [(r["n"], r["ours"], r["sdpa"]) for r in ratios] == [(4096, "rung:tma", "sdpa:flash"),
                                                               (16384, "rung:tma", "sdpa:flash")]
    assert ratios[0]["ratio"] == pytest.approx(150 / 140) and ratios[0]["target"] == 1.0
    assert ratios[1]["matmul_fraction"] == pytest.approx(170 / 600)
    table = perf_bench.format_ladder({"ladder": {"target_ratios": ratios}}).splitlines()
    assert len(table) == 3 and table[1].split()[-4:] == ["1.07", "1.0", "0.25", "-"]
    assert ratios[0]["ratio_range"] is None  # no spread recorded for these points
    timed = [dict(p, ms=m, ms_p20=lo, ms_p80=hi) for p, (m, lo, hi) in
             zip([dict(method="rung:tma", tflops=150.0), dict(method="sdpa:flash", tflops=140.0)],
                 [(1.0, 0.9, 1.2), (1.07, 1.0, 1.1)])]
    for p in timed:
        p.update(d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd")
    (spread,) = perf_bench.target_ratios(timed)
    # ours at its slowest (1.2 ms) against theirs at its fastest (1.0 ms), and the other way
    assert spread["ratio_range"] == pytest.approx([1.0 / 1.2, 1.1 / 0.9])
    line = perf_bench.format_ladder({"ladder": {"target_ratios": [spread]}}).splitlines()[1]
    assert line.split()[-1] == "0.83-1.22"
    base = dict(d=128, dtype="float16", causal=False, mode="fwd_bwd", batch=1, heads=16)
    points = [dict(base, method="flashlib", n=4096, peak_bytes=100),
              dict(base, method="sdpa:math", n=4096, peak_bytes=1000),
              dict(base, method="flashlib", n=16384, peak_bytes=400)]
    rows = perf_bench.memory_ratios(points)
    assert rows[0]["ratio"] == pytest.approx(0.1) and rows[0]["scores_bytes"] == 16 * 4096 ** 2 * 2
    assert rows[1]["ratio"] is None and rows[1]["ratio_to_scores"] == pytest.approx(400 / (16 * 16384 ** 2 * 2))


def test_plan_covers_the_grid_once_targets_first():
    plan = perf_bench.plan()
    keys = [tuple(sorted(p.items())) for p in plan]
    assert len(keys) == len(set(keys)) == 2 * 6 * 2 * 2 * 2
    targets = [p["d"] == 128 and p["n"] >= 4096 for p in plan]
    first_other = targets.index(False)
    assert all(targets[:first_other]) and not any(targets[first_other:])
    assert perf_bench.shape(4096, 128) == (4, 16) and perf_bench.shape(32768, 64) == (1, 32)


def test_run_plan_stops_before_a_point_would_overrun():
    now = [0.0]
    costs = {"a": 3.0, "b": 5.0, "c": 1.0, "d": 1.0, "e": 1.0}

    def measure(p):
        now[0] += costs[p]
        return [p]

    timeline = []
    rows, skipped = perf_bench.run_plan([dict(p=p) for p in costs], lambda p: measure(p["p"]), budget_s=10.0,
                                        clock=lambda: now[0], timeline=timeline)
    # after a and b (8 s, longest 5 s) nothing else may start: 8 + 5 > 10
    assert rows == ["a", "b"] and skipped == [dict(p=p) for p in "cde"]
    assert timeline == [dict(p="a", seconds=3.0, first_of_kind=True), dict(p="b", seconds=5.0, first_of_kind=False)]
    now[0] = 0.0
    rows, skipped = perf_bench.run_plan(list(costs), measure, budget_s=100.0, clock=lambda: now[0])
    assert rows == list(costs) and skipped == []


def test_run_plan_budgets_first_points_apart_from_the_rest():
    # the first point of a head dim, dtype, mask and pass compiles and autotunes: a slow one
    # must not stop the cheap points of a kind already measured
    now = [0.0]
    a = dict(d=128, dtype="bfloat16", causal=False, mode="fwd")
    b, c = dict(a, causal=True), dict(a, mode="fwd_bwd")
    grid = [dict(a, n=16384), dict(a, n=8192), dict(b, n=16384), dict(c, n=16384), dict(a, n=4096),
            dict(a, n=2048)]
    cost = {(True, "fwd", 16384): 6.0, (False, "fwd", 16384): 2.0}

    def measure(p):
        now[0] += cost.get((p["causal"], p["mode"], p["n"]), 1.0)
        return [(p["causal"], p["mode"], p["n"])]

    timeline = []
    rows, skipped = perf_bench.run_plan(grid, measure, budget_s=10.0, clock=lambda: now[0], timeline=timeline)
    # at 9 s a first point (the longest so far: 6 s) cannot fit, a later one (1 s) can; the
    # longest point of any kind would have stopped both
    assert rows == [(False, "fwd", 16384), (False, "fwd", 8192), (True, "fwd", 16384), (False, "fwd", 4096)]
    assert skipped == [grid[3], grid[5]]
    assert [t["first_of_kind"] for t in timeline] == [True, False, True, False]


# ----- a kernel fault: the run stops, and the points left run in a fresh process -----

def _grid_point(n, mode="fwd", causal=False):
    return dict(d=128, n=n, dtype="bfloat16", causal=causal, mode=mode)


def test_a_fault_that_leaves_the_device_unusable_stops_the_point():
    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")

    def fault(q, k, v, causal):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    methods = {"sdpa:math": perf_bench._sdpa("math"), "bad": fault, "sdpa:after": perf_bench._sdpa("math")}
    point = dict(d=16, n=8, dtype="float32", causal=False, mode="fwd")
    kwargs = dict(device="cpu", tokens=8, hidden=32, bench=lambda fn: (fn(), 1.0)[1], peak=lambda fn: (fn(), 0)[1])
    with pytest.raises(perf_bench.DeviceLost) as lost:
        perf_bench._measure_point(point, methods, lambda *a: None, usable=lambda device: False, **kwargs)
    assert lost.value.method == "bad" and lost.value.point == point
    assert lost.value.row["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    # an error that leaves the device usable (an out-of-memory, an unsupported backend) is a row
    rows = perf_bench._measure_point(point, methods, lambda *a: None, usable=lambda device: True, **kwargs)
    assert [("error" in r, r["method"]) for r in rows] == [(False, "sdpa:math"), (True, "bad"), (False, "sdpa:after")]


def test_run_plan_stops_at_a_lost_device_and_lists_what_is_pending():
    grid = [_grid_point(n) for n in (16384, 8192, 4096, 2048)]
    bad_row = dict(grid[2], method="flashlib:bulk", error="RuntimeError: illegal address")

    def measure(p):
        if p["n"] == 4096:
            raise perf_bench.DeviceLost("flashlib:bulk", p, bad_row)
        return [dict(p, method="sdpa:cudnn", ms=1.0)]

    saved, lost = [], []
    rows, skipped = perf_bench.run_plan(grid, measure, budget_s=1e9, progress=lambda r: saved.append(len(r)),
                                        lost=lost)
    assert [r["n"] for r in rows] == [16384, 8192, 4096] and rows[-1] is bad_row and skipped == []
    assert lost == [dict(method="flashlib:bulk", point=grid[2], error="RuntimeError: illegal address",
                         pending=grid[2:])]
    assert saved == [1, 2, 3]  # the fault's row is saved too
    with pytest.raises(perf_bench.DeviceLost):  # without a list to note it in, it propagates
        perf_bench.run_plan(grid, measure, budget_s=1e9)


def _fresh(measured, lost_method=None, lost_at=None):
    """A fresh process's result: rows for measured points, a loss at lost_at with the rest pending."""
    ladder = dict(points=[dict(p, method="sdpa:cudnn", tflops=1.0) for p in measured], skipped=[], timeline=[],
                  autotuned_by_n={"d=128": {str(p["n"]): {"tma": len(measured)} for p in measured}})
    ladder["device_lost"] = None if lost_method is None else dict(
        method=lost_method, point=lost_at[0], error="boom", pending=lost_at)
    return {"ladder": ladder}


def test_points_left_by_a_lost_device_are_measured_in_fresh_processes():
    grid = [_grid_point(n, mode) for n in (16384, 8192, 4096) for mode in ("fwd", "fwd_bwd")]
    result = {"ladder": dict(points=[dict(grid[0], method="rung:lean", tflops=400.0),
                                     dict(grid[1], method="flashlib:bulk", error="boom")],
                             skipped=[], timeline=[], autotuned={}, autotuned_by_n={}, ceilings=None,
                             device_lost=dict(method="flashlib:bulk", point=grid[1], error="boom",
                                              pending=grid[1:]))}
    calls = []

    def run_fresh(points, exclude, budget_s):
        calls.append((list(points), list(exclude), budget_s))
        if len(calls) == 1:  # a second method faults two points later
            return _fresh(points[:2], "flashlib:lean", points[2:])
        return _fresh(points)

    now = [0.0]
    out = perf_bench.continue_after_device_lost(result, deadline=1000.0, run_fresh=run_fresh,
                                                clock=lambda: now[0], log=lambda *a: None)
    assert out is result
    assert calls == [(grid[1:], ["flashlib:bulk"], 985.0), (grid[3:], ["flashlib:bulk", "flashlib:lean"], 985.0)]
    ladder = result["ladder"]
    measured = [(r["n"], r["mode"]) for r in ladder["points"] if "tflops" in r]
    assert sorted(measured) == sorted((p["n"], p["mode"]) for p in grid)
    assert [loss["method"] for loss in ladder["devices_lost"]] == ["flashlib:bulk", "flashlib:lean"]
    assert "pending" not in ladder["device_lost"] and ladder["skipped"] == []
    # each bucket's choice from the process that measured it, the longest bucket's as "autotuned"
    assert ladder["autotuned_by_n"] == {"d=128": {"16384": {"tma": 2}, "8192": {"tma": 3}, "4096": {"tma": 3}}}
    assert ladder["autotuned"] == {"d=128": {"tma": 2}}


def test_no_time_or_no_result_leaves_the_pending_points_skipped():
    grid = [_grid_point(n) for n in (16384, 8192)]
    lost = dict(method="flashlib:bulk", point=grid[0], error="boom", pending=grid)

    def never(*args):
        raise AssertionError("no fresh process without time for one")

    result = {"ladder": dict(points=[], skipped=[], device_lost=dict(lost))}
    perf_bench.continue_after_device_lost(result, deadline=30.0, run_fresh=never, clock=lambda: 0.0,
                                          log=lambda *a: None)
    assert result["ladder"]["skipped"] == grid
    result = {"ladder": dict(points=[], skipped=[], device_lost=dict(lost))}
    perf_bench.continue_after_device_lost(result, deadline=1000.0, run_fresh=lambda *a: None, clock=lambda: 0.0,
                                          log=lambda *a: None)
    assert result["ladder"]["skipped"] == grid and result["ladder"]["devices_lost"][0]["method"] == "flashlib:bulk"
    # a fresh process stopped on time: what it measured is kept, what it never reached is skipped
    partial = {"ladder": {"points": [dict(grid[0], method="sdpa:cudnn", tflops=1.0)]}, "unreached": grid[1:]}
    result = {"ladder": dict(points=[], skipped=[], device_lost=dict(lost))}
    perf_bench.continue_after_device_lost(result, deadline=1000.0, run_fresh=lambda *a: partial, clock=lambda: 0.0,
                                          log=lambda *a: None)
    assert [r["n"] for r in result["ladder"]["points"]] == [16384] and result["ladder"]["skipped"] == grid[1:]


def test_the_ladder_end_to_end_on_a_cpu_with_a_fault_and_a_fresh_run(monkeypatch):
    """run_ladder_bench and continue_after_device_lost as the GPU check chains them, on the CPU
    (interpreter, stand-in timers): a method that faults stops the first run; a second run,
    standing in for the fresh process, measures the rest without it."""
    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")
    real_methods, broken = perf_bench._methods, [False]

    def fault(q, k, v, causal):
        broken[0] = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def methods(mode):
        m = real_methods(mode)
        if mode == "fwd":
            return {"rung:lean": m["rung:lean"], "sdpa:math": m["sdpa:math"]}
        return {"flashlib": m["flashlib"], "flashlib:faulty": fault, "sdpa:math": m["sdpa:math"]}

    monkeypatch.setattr(perf_bench, "_methods", methods)
    monkeypatch.setattr(perf_bench, "_device_usable", lambda device="cuda": not broken[0])
    kwargs = dict(ds=(32,), ns=(16, 32), dtypes=("float32",), causals=(True,), log=lambda *a: None,
                  compile_ahead=False, ceilings=False, device="cpu", tokens=32, hidden=64,
                  bench=lambda fn: (fn(), (2.0, 1.5, 2.5))[1], peak=lambda fn: (fn(), 0)[1])
    result = perf_bench.run_ladder_bench(1e6, **kwargs)
    ladder = result["ladder"]
    grid = perf_bench.plan((32,), (16, 32), ("float32",), (True,))
    assert [(p["n"], p["mode"]) for p in grid] == [(16, "fwd"), (16, "fwd_bwd"), (32, "fwd"), (32, "fwd_bwd")]
    assert ladder["device_lost"]["method"] == "flashlib:faulty" and ladder["device_lost"]["pending"] == grid[1:]
    assert [(r["n"], r["method"], "error" in r) for r in ladder["points"]] == [
        (16, "rung:lean", False), (16, "sdpa:math", False), (16, "flashlib:faulty", True)]

    def fresh(points, exclude, budget_s):
        broken[0] = False  # a new process: a working device
        return perf_bench.run_ladder_bench(budget_s, points=points, exclude=tuple(exclude), **kwargs)

    perf_bench.continue_after_device_lost(result, time.perf_counter() + 1e6, run_fresh=fresh, log=lambda *a: None)
    timed = {(r["n"], r["mode"], r["method"]) for r in ladder["points"] if "tflops" in r}
    assert timed == {(n, mode, m) for n in (16, 32) for mode, ms in
                     (("fwd", ("rung:lean", "sdpa:math")), ("fwd_bwd", ("flashlib", "sdpa:math"))) for m in ms}
    assert all(r["max_abs_err_vs_sdpa"] < 1e-5 for r in ladder["points"] if r["method"] == "rung:lean")
    assert [loss["method"] for loss in ladder["devices_lost"]] == ["flashlib:faulty"]
    assert ladder["skipped"] == [] and len(ladder["timeline"]) == 4


def test_a_fresh_process_stopped_early_returns_what_it_measured(tmp_path, monkeypatch):
    # a stand-in for `python -m flashlib.bench.gpu`: checks its arguments, writes the
    # partial result of its first point, and stops as if killed
    stub = tmp_path / "python"
    stub.write_text("""#!/bin/sh
exec "$FLASHLIB_REAL_PYTHON" - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "flashlib.bench.gpu"], args
opt = lambda name: args[args.index(name) + 1]
assert "--no-precompile" in args and "--no-ceilings" in args
assert [args[i + 1] for i, a in enumerate(args) if a == "--exclude"] == ["flashlib:bulk", "flashlib:lean"]
points = json.load(open(opt("--points")))
json.dump({"points": [dict(points[0], method="sdpa:cudnn", ms=1.0)]}, open(opt("--result"), "w"))
sys.exit(1)
PY
""")
    stub.chmod(0o755)
    monkeypatch.setenv("FLASHLIB_REAL_PYTHON", sys.executable)
    grid = [_grid_point(n) for n in (16384, 8192, 4096)]
    got = perf_bench.run_fresh_process(grid, ["flashlib:bulk", "flashlib:lean"], 20.0,
                                       out_path=tmp_path / "r.json", python=str(stub))
    assert [r["n"] for r in got["ladder"]["points"]] == [16384] and got["unreached"] == grid[1:]


def test_a_fresh_process_without_a_gpu_returns_nothing(tmp_path):
    """The real command, on a machine without CUDA: it refuses, writes no result, and the caller
    gets None (its points are then listed as skipped)."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the command would run the benchmark")
    got = perf_bench.run_fresh_process([_grid_point(4096)], ["flashlib:bulk"], 60.0, out_path=tmp_path / "r.json")
    assert got is None and not (tmp_path / "r.json").exists()


def test_perf_bench_command_line_passes_points_and_exclusions(tmp_path, monkeypatch, capsys):
    grid = [_grid_point(n) for n in (16384, 8192)]
    (tmp_path / "points.json").write_text(json.dumps(grid))
    seen = {}

    def fake_run(budget_s, **kwargs):
        seen.update(kwargs, budget_s=budget_s)
        kwargs["progress"]([dict(grid[0], method="sdpa:cudnn", ms=1.0)])
        seen["partial"] = json.loads((tmp_path / "r.json").read_text())
        return {"ladder": dict(points=[], target_ratios=[])}

    monkeypatch.setattr(perf_bench, "run_ladder_bench", fake_run)
    perf_bench.main(["--points", str(tmp_path / "points.json"), "--exclude", "flashlib:bulk", "--budget", "50",
                     "--result", str(tmp_path / "r.json"), "--no-precompile", "--no-ceilings"])
    assert seen["points"] == grid and seen["exclude"] == ("flashlib:bulk",) and seen["budget_s"] == 50.0
    assert seen["ceilings"] is False and seen["compile_ahead"] is False
    assert seen["partial"]["points"][0]["n"] == 16384
    assert json.loads((tmp_path / "r.json").read_text()) == {"ladder": dict(points=[], target_ratios=[])}
    (tmp_path / "bad.json").write_text(json.dumps({"d": 128}))
    with pytest.raises(SystemExit):
        perf_bench.main(["--points", str(tmp_path / "bad.json")])
    assert "--points must name a JSON file holding a list of grid points" in capsys.readouterr().err


def test_figures_render():
    run = _gpu_run()
    figures = [plots.rate_plot(records.series(records.ladder_points(run)), title=records.label(run), ceiling=700.0),
               plots.bar_chart(["teaching", "tma"], [100.0, 150.0], title="ladder"),
               plots.roofline_plot([dict(label="tma", flops=4e12, bytes=2e9, ms=20.0)], 700.0, 4000.0)]
    cpu = {"provenance": {"cpu": "Some CPU", "torch": "2.13.0", "date": "2026-02-01"},
           "points": [dict(method=m, n=n, peak_alloc_bytes=n * (n if m == "dense" else 64) * 4, seconds=n * 1e-6)
                      for m in ("dense", "tiled") for n in (1024, 2048)]}
    figures += list(plots.cpu_figures(cpu))
    for fig in figures:
        assert viz.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(figures[0].axes[0].lines) == 5  # four methods and the ceiling


def test_exercise_checkers(capsys):
    assert perf_exercises.check_attention_flops(2 * 2 * 16 * 4096 ** 2 * 128)
    assert not perf_exercises.check_attention_flops(4 * 2 * 16 * 4096 ** 2 * 128)
    assert "half" in capsys.readouterr().out
    assert not perf_exercises.check_attention_flops(None)
    n, d = 4096, 128
    assert perf_exercises.check_intensity(4 * n * n * d / ((n * d + 32 * 2 * n * d + n * d + n) * 2))
    assert not perf_exercises.check_intensity(1.0)


# ----- one grid point of the benchmark, on the CPU (interpreter) with stand-in timers -----

def test_measure_point_runs_every_method_on_cpu():
    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")
    for mode in ("fwd", "fwd_bwd"):
        point = dict(d=32, n=24, dtype="float32", causal=True, mode=mode)
        rows = perf_bench._measure_point(point, perf_bench._methods(mode), lambda *a: None, device="cpu",
                                         tokens=24, hidden=64, bench=lambda fn: (fn(), (2.0, 1.5, 2.5))[1],
                                         peak=lambda fn: (fn(), 0)[1])
        by = {r["method"]: r for r in rows}
        flops = roofline.attention_flops(1, 2, 24, 24, 32, causal=True, mode=mode)
        assert by["sdpa:math"]["tflops"] == pytest.approx(roofline.tflops(flops, 2.0))
        assert (by["sdpa:math"]["ms_p20"], by["sdpa:math"]["ms_p80"]) == (1.5, 2.5)
        ours = [m for m in by if not m.startswith("sdpa:")]
        assert ours == (["rung:teaching", "rung:autotuned", "rung:causal-split", "rung:tma", "rung:lean",
                         "rung:lazy-rescale"] if mode == "fwd"
                        else ["flashlib", "flashlib:4-warp-backward", "flashlib:tuned", "flashlib:lean",
                              "flashlib:bulk"])
        for m in ours:
            assert "error" not in by[m], by[m]
            if mode == "fwd":
                assert by[m]["max_abs_err_vs_sdpa"] < 1e-5


@pytest.mark.parametrize("rung", ["autotuned", "causal-split", "tma", "lean", "lazy-rescale"])
def test_ladder_forward_with_fused_backward_gradients(rung):
    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 21, 16, generator=gen) for _ in range(3))  # (B, H, N, D)
    dout = torch.randn(1, 2, 21, 16, generator=gen)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    from flashlib.ladder import attention

    attention(*ours, causal=True, forward=rung, backward="teaching").backward(dout)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(21, 21, dtype=torch.bool).tril()
    torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=mask).backward(dout.double())
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


def test_autotuned_choices_by_sequence_bucket():
    """What the autotuners kept, per bucket and for the longest, as the JSON records it (a
    choice filed by hand here, as a GPU run files them)."""
    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")
    from flashlib.ladder import backward as bf
    from flashlib.ladder import forward as ff

    fwd = ff._tuner("lean", ff._attn_fwd_tma, 4096)
    bwd = bf._tuner("dkdv", "lean", 4096)
    fwd_key = (128, 128, False, "tf32", *["torch.bfloat16"] * 4, "torch.float32")
    bwd_key = (128, False, "tf32", True, *["torch.bfloat16"] * 7, "torch.float32", "torch.float32")
    fwd.cache[fwd_key], bwd.cache[bwd_key] = fwd.configs[0], bwd.configs[1]
    try:
        longest, by_n = perf_bench.autotuned_choices((64, 128), ("bfloat16",), (False, True), (2048, 4096))
    finally:
        del fwd.cache[fwd_key], bwd.cache[bwd_key]
    tile = lambda c: dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)  # noqa: E731
    assert by_n == {"d=128 bfloat16 causal=False": {"4096": {"lean": tile(fwd.configs[0]),
                                                             "bwd_lean_dkdv": tile(bwd.configs[1])}}}
    assert longest == {"d=128 bfloat16 causal=False": by_n["d=128 bfloat16 causal=False"]["4096"]}


def test_launch_model_by_hand():
    # two slots; durations 1, 2, 3, 4 in order: 3 starts at 1 (ends 4), 4 starts at 2 (ends 6)
    assert roofline.launch_makespan([1, 2, 3, 4], 2) == 6
    # longest first: 4 and 3 start at 0; 2 starts at 3 (ends 5), 1 at 4 (ends 5): the ideal 10 / 2
    assert roofline.launch_makespan([4, 3, 2, 1], 2) == 5
    assert roofline.launch_makespan([], 3) == 0
    # one head of 4 blocks (1 + 2 + 3 + 4 = 10 tiles) on 2 slots: 6 / 5 in order, 5 / 5 longest first
    model = roofline.causal_launch_model(256, block=64, tokens=256, hidden=128, head_dim=128, slots=2)
    assert model == {"in_order": pytest.approx(1.2), "longest_first": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="'slots'"):
        roofline.launch_makespan([1], 0)


def test_autotuned_tiles_by_bucket_and_from_older_runs():
    tile = dict(BLOCK_Q=64, BLOCK_K=64, num_warps=4, num_stages=3)
    wide = dict(tile, BLOCK_Q=128, num_warps=8)
    new = {"ladder": {"autotuned": {"d=128 bfloat16 causal=False": {"tma": wide}},
                      "autotuned_by_n": {"d=128 bfloat16 causal=False": {"4096": {"tma": tile}, "16384": {"tma": wide}}}}}
    assert records.autotuned_tiles(new, n=3000) == {"tma": tile}      # 3000 -> the 4096 bucket
    assert records.autotuned_tiles(new, n=16384) == {"tma": wide}
    assert records.autotuned_tiles(new, n=1024) == {}                 # nothing kept for that bucket
    old = {"ladder": {"autotuned": {"d=128 bfloat16 causal=False": {"tma": tile}}}}
    assert records.autotuned_tiles(old, n=1024) == {"tma": tile}      # one choice for every N
    assert records.autotuned_tiles(old, causal=True) == {}


def test_write_result_names_the_device_and_date(tmp_path):
    result = _gpu_run()
    result["ladder"]["provenance"] = {"device": "NVIDIA H200 (test)", "date": "2026-05-06", "torch": "2.11.0"}
    path = perf_bench.write_result(result, tmp_path)
    assert path.name == "gpu-ladder-nvidia-h200-test-2026-05-06.json"
    run = records.latest("gpu", tmp_path, with_key="ladder")
    assert run["ladder"]["points"] == result["ladder"]["points"]
    assert records.label(run).startswith("NVIDIA H200 (test), torch 2.11.0")


def test_rows_marked_invalid_are_left_out_and_errata_are_readable():
    run = _gpu_run()
    run["ladder"]["points"][0]["invalid"] = "timed two kernels"
    run["errata"] = [dict(rows="rung:teaching rows", count=1, problem="timed two kernels", instead="another run")]
    first = _gpu_run()["ladder"]["points"][0]
    left = records.ladder_points(run, n=first["n"], method=first["method"])
    assert left == []
    assert records.rates_at(run, ["rung:teaching", "rung:tma"], n=first["n"]) == \
        {"rung:tma": next(p["tflops"] for p in run["ladder"]["points"] if p["n"] == first["n"] and p["method"] == "rung:tma")}
    assert records.errata(run) == ["rung:teaching rows (1 rows): timed two kernels; instead: another run"]
    assert records.errata(_gpu_run()) == []


def test_grouped_bar_chart_draws_only_measured_bars():
    fig = plots.grouped_bar_chart({"run 1": {"teaching": 100.0, "tma": 150.0}, "run 2": {"tma": 170.0}}, title="t")
    assert viz.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes[0].patches) == 3


def test_saved_multiplies_checker(capsys):
    # by hand: 128 x 64 scores per tile over 256 threads is 32 each; 4096 / 64 = 64 tiles
    assert perf_exercises.check_saved_multiplies(32 * 64)
    assert not perf_exercises.check_saved_multiplies(32)
    assert "N / BLOCK_K" in capsys.readouterr().out
    assert not perf_exercises.check_saved_multiplies(128 * 4096 // 8)
    assert "divide by threads" in capsys.readouterr().out
    assert not perf_exercises.check_saved_multiplies(None)


def test_backward_products_and_the_mma_sync_checker(capsys):
    # by hand, 16 query rows, 64 key rows, d = 128: four products of 64 rows, dQ of 16 (or 128
    # transposed), each 2 * 16 * 64 * 128 FLOPs
    shapes = [(rows, cols, inner) for _, rows, cols, inner in roofline.backward_products(16, 64, 128)]
    assert shapes == [(64, 16, 128), (64, 128, 16), (64, 16, 128), (64, 128, 16), (16, 128, 64)]
    assert roofline.backward_products(16, 64, 128, dq_transposed=True)[-1][1:] == (128, 16, 64)
    assert perf_exercises.check_mma_sync_fraction(0.2) and perf_exercises.check_mma_sync_fraction(1 / 5)
    assert not perf_exercises.check_mma_sync_fraction(0.25)
    assert "five products" in capsys.readouterr().out
    assert not perf_exercises.check_mma_sync_fraction(1 / 7)
    assert "seven" in capsys.readouterr().out
    assert not perf_exercises.check_mma_sync_fraction(None)


def test_speedups_by_hand():
    point = dict(d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd")
    run = {"ladder": {"points": [dict(point, method="new", ms=2.0, ms_p20=1.8, ms_p80=2.2),
                                 dict(point, method="old", ms=3.0, ms_p20=2.9, ms_p80=3.3),
                                 dict(point, n=8192, method="new", ms=4.0),  # no baseline there
                                 dict(point, n=1024, method="old", error="boom")]}}
    (row,) = records.speedups(run, "new", "old", d=128)
    assert row["n"] == 4096 and row["speedup"] == pytest.approx(1.5)
    assert row["range"] == pytest.approx([2.9 / 2.2, 3.3 / 1.8])
    earlier = {"ladder": {"points": [dict(point, n=8192, method="new", ms=5.0)]}}
    (row,) = records.speedups(run, "new", "new", against=earlier)
    assert row["n"] == 8192 and row["speedup"] == pytest.approx(1.25) and row["range"] is None
    assert records.speedups(run, "new", "missing") == []


def test_run_report_reads_the_recorded_runs():
    """python -m flashlib.bench.report on the second H200 run against the first: a step's speedup as
    computed here from the file, and the earlier run named."""
    import subprocess

    root = Path(records.__file__).resolve().parent.parent.parent
    run, earlier = (root / "data" / "bench" / f"gpu-nvidia-h200-{stamp}.json"
                    for stamp in ("2026-11-30T0015Z", "2026-11-29T2353Z"))
    newest = json.loads(run.read_text())
    ms = {p["method"]: p["ms"] for p in records.ladder_points(newest, d=128, n=4096, dtype="bfloat16", causal=False,
                                                          mode="fwd_bwd") if p.get("ms")}
    done = subprocess.run([sys.executable, "-m", "flashlib.bench.report", str(run), "--against", str(earlier)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"N=4096: {ms['flashlib'] / ms['flashlib:tuned']:.2f}" in done.stdout
    assert records.label(json.loads(earlier.read_text())) in done.stdout
    assert "rung:lean over rung:tma: not measured in this run" in done.stdout


def test_ridge_checker(capsys):
    run = _gpu_run()  # 700 TFLOP/s, 4000 GB/s
    assert perf_exercises.check_ridge(700e12 / 4000e9, run)
    assert not perf_exercises.check_ridge(700 / 4000, run)
    assert "factor 1000" in capsys.readouterr().out
    assert not perf_exercises.check_ridge(4000e9 / 700e12, run)
    assert not perf_exercises.check_ridge(175.0, None)
    assert "nothing to check" in capsys.readouterr().out


def test_newest_run_with_every_method_valid(tmp_path):
    old, new = _gpu_run("2026-01-02", "Old GPU"), _gpu_run("2026-03-01", "New GPU")
    for p in new["ladder"]["points"]:
        if p["method"] == "rung:teaching":
            p["invalid"] = "timed two kernels"
    (tmp_path / "gpu-a-2026-01-02.json").write_text(json.dumps(old))
    (tmp_path / "gpu-b-2026-03-01.json").write_text(json.dumps(new))
    pick = lambda methods: records.newest_run_with(methods, n=4096, directory=tmp_path)  # noqa: E731
    assert pick(["rung:tma", "sdpa:flash"])["device"] == "New GPU"
    assert pick(["rung:teaching", "sdpa:flash"])["device"] == "Old GPU"
    assert pick(["rung:teaching", "sdpa:cudnn"]) is None  # cuDNN failed there: no run has both
