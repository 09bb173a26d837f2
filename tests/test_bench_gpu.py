"""The ladder benchmark (flashlib.bench.gpu and the modules it is made of) without a GPU:
method names from the ladder's table, the grid and its budget, results, recovery from a
kernel fault in fresh processes, the command line; grid points run on the CPU (Triton's
interpreter) with stand-in timers."""
from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from flashlib import roofline
from flashlib.bench import fresh, gpu, grid, methods, point, results
from flashlib.kernels import triton_installed
from flashlib.ladder.rungs import BACKWARDS, LADDER
from tests.bench_runs import gpu_run, grid_point

needs_triton = pytest.mark.skipif(not triton_installed(), reason="Triton ships Linux wheels only")
STAND_IN = dict(bench=lambda fn: (fn(), (2.0, 1.5, 2.5))[1], peak=lambda fn: (fn(), 0)[1])


# ----- names -----

def test_methods_are_named_from_the_ladders_table():
    sdpa = [f"sdpa:{b}" for b in methods.SDPA_BACKENDS]
    assert list(methods.methods("fwd")) == [f"rung:{r.name}" for r in LADDER] + sdpa
    paired = []
    for b in BACKWARDS:
        paired += [f"ladder:{b.name}"] + (["ladder:teaching-4-warp"] if b.name == "teaching" else [])
    assert list(methods.methods("fwd_bwd")) == ["flashlib"] + paired + ["flashlib:gqa", "flashlib:window"] + sdpa
    assert methods.pair_name("tuned", "tma") == "ladder:tuned" == methods.pair_name("tuned")
    assert methods.pair_name("teaching", "tma") == "ladder:tma+teaching"
    with pytest.raises(ValueError, match="'mode'"):
        methods.methods("bwd")


def test_the_variants_rows_belong_to_points_of_their_own():
    """flashlib:gqa and flashlib:window time other problems than their point's: no target ratio
    sets them against SDPA, however fast they are."""
    p = dict(d=128, n=4096, dtype="bfloat16", causal=True, mode="fwd_bwd")
    rows = [dict(p, method=m, tflops=t, ms=1.0) for m, t in
            (("flashlib", 300.0), ("flashlib:window", 900.0), ("flashlib:gqa", 500.0), ("sdpa:flash", 400.0))]
    assert grid.point_key(rows[0]) == grid.point_key(p) == (128, 4096, "bfloat16", True, "fwd_bwd")
    assert grid.point_key(rows[1]) == (128, 4096, "bfloat16", True, "fwd_bwd+window")
    (ratio,) = results.target_ratios(rows)
    assert (ratio["ours"], ratio["sdpa"], ratio["ratio"]) == ("flashlib", "sdpa:flash", 0.75)
    assert [methods.variant_of(r["method"]) for r in rows] == [None, "window", "gqa", None]


# ----- the grid and its budget -----

def test_plan_covers_the_grid_once_targets_first():
    plan = grid.plan()
    keys = [tuple(sorted(p.items())) for p in plan]
    assert len(keys) == len(set(keys)) == 2 * 6 * 2 * 2 * 2
    targets = [p["d"] == 128 and p["n"] >= 4096 for p in plan]
    first_other = targets.index(False)
    assert all(targets[:first_other]) and not any(targets[first_other:])
    assert point.shape(4096, 128) == (4, 16) and point.shape(32768, 64) == (1, 32)
    assert gpu.plan is grid.plan  # as the compile-ahead probe and the GPU check reach it


def test_run_plan_stops_before_a_point_would_overrun():
    now = [0.0]
    costs = {"a": 3.0, "b": 5.0, "c": 1.0, "d": 1.0, "e": 1.0}

    def measure(p):
        now[0] += costs[p]
        return [p]

    timeline = []
    rows, skipped = grid.run_plan([dict(p=p) for p in costs], lambda p: measure(p["p"]), budget_s=10.0,
                                  clock=lambda: now[0], timeline=timeline)
    # after a and b (8 s, longest 5 s) nothing else may start: 8 + 5 > 10
    assert rows == ["a", "b"] and skipped == [dict(p=p) for p in "cde"]
    assert timeline == [dict(p="a", seconds=3.0, first_of_kind=True), dict(p="b", seconds=5.0, first_of_kind=False)]
    now[0] = 0.0
    rows, skipped = grid.run_plan(list(costs), measure, budget_s=100.0, clock=lambda: now[0])
    assert rows == list(costs) and skipped == []


def test_run_plan_budgets_first_points_apart_from_the_rest():
    # the first point of a head dim, dtype, mask and pass compiles and autotunes: a slow one
    # must not stop the cheap points of a kind already measured
    now = [0.0]
    a = dict(d=128, dtype="bfloat16", causal=False, mode="fwd")
    b, c = dict(a, causal=True), dict(a, mode="fwd_bwd")
    plan = [dict(a, n=16384), dict(a, n=8192), dict(b, n=16384), dict(c, n=16384), dict(a, n=4096),
            dict(a, n=2048)]
    cost = {(True, "fwd", 16384): 6.0, (False, "fwd", 16384): 2.0}

    def measure(p):
        now[0] += cost.get((p["causal"], p["mode"], p["n"]), 1.0)
        return [(p["causal"], p["mode"], p["n"])]

    timeline = []
    rows, skipped = grid.run_plan(plan, measure, budget_s=10.0, clock=lambda: now[0], timeline=timeline)
    # at 9 s a first point (the longest so far: 6 s) cannot fit, a later one (1 s) can; the
    # longest point of any kind would have stopped both
    assert rows == [(False, "fwd", 16384), (False, "fwd", 8192), (True, "fwd", 16384), (False, "fwd", 4096)]
    assert skipped == [plan[3], plan[5]]
    assert [t["first_of_kind"] for t in timeline] == [True, False, True, False]


# ----- results -----

def test_target_and_memory_ratios():
    run = gpu_run()
    ratios = results.target_ratios(run["ladder"]["points"], 600.0)
    assert [(r["n"], r["ours"], r["sdpa"]) for r in ratios] == [(4096, "rung:tma", "sdpa:flash"),
                                                               (16384, "rung:tma", "sdpa:flash")]
    assert ratios[0]["ratio"] == pytest.approx(150 / 140) and ratios[0]["target"] == 1.0
    assert ratios[1]["matmul_fraction"] == pytest.approx(170 / 600)
    table = results.format_ladder({"ladder": {"target_ratios": ratios}}).splitlines()
    assert len(table) == 3 and table[1].split()[-4:] == ["1.07", "1.0", "0.25", "-"]
    assert ratios[0]["ratio_range"] is None  # no spread recorded for these points
    timed = [dict(p, ms=m, ms_p20=lo, ms_p80=hi) for p, (m, lo, hi) in
             zip([dict(method="rung:tma", tflops=150.0), dict(method="sdpa:flash", tflops=140.0)],
                 [(1.0, 0.9, 1.2), (1.07, 1.0, 1.1)])]
    for p in timed:
        p.update(d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd")
    (spread,) = results.target_ratios(timed)
    # ours at its slowest (1.2 ms) against theirs at its fastest (1.0 ms), and the other way
    assert spread["ratio_range"] == pytest.approx([1.0 / 1.2, 1.1 / 0.9])
    line = results.format_ladder({"ladder": {"target_ratios": [spread]}}).splitlines()[1]
    assert line.split()[-1] == "0.83-1.22"
    base = dict(d=128, dtype="float16", causal=False, mode="fwd_bwd", batch=1, heads=16)
    points = [dict(base, method="flashlib", n=4096, peak_bytes=100),
              dict(base, method="sdpa:math", n=4096, peak_bytes=1000),
              dict(base, method="flashlib", n=16384, peak_bytes=400),
              dict(base, method="ladder:teaching", n=4096, peak_bytes=300)]
    rows = results.memory_ratios(points)
    assert rows[0]["ratio"] == pytest.approx(0.1) and rows[0]["scores_bytes"] == 16 * 4096 ** 2 * 2
    assert rows[1]["ratio"] is None and rows[1]["ratio_to_scores"] == pytest.approx(400 / (16 * 16384 ** 2 * 2))
    assert {r["method"] for r in rows} == {"flashlib"}
    assert results.memory_ratios(points, method="ladder:teaching")[0]["ratio"] == pytest.approx(0.3)


def test_autotuned_choices_by_sequence_bucket(monkeypatch):
    """What the autotuners kept, per bucket and for the longest, as the JSON records it: read
    through the ladder's autotuned_choice and autotuned_choices (stand-ins here, as a GPU
    run's autotuners would answer)."""
    from flashlib.ladder import backward as ladder_backward
    from flashlib.ladder import forward as ladder_forward

    tile = dict(BLOCK_Q=128, BLOCK_K=64, num_warps=8, num_stages=3)
    kept_fwd = {(128, False, "lean", 4096): tile}
    kept_bwd = {(128, False, "lean", 4096): {"dkdv": dict(tile, BLOCK_Q=32)}}
    monkeypatch.setattr(ladder_forward, "autotuned_choice",
                        lambda q, causal, rung, seq: kept_fwd.get((q.shape[-1], causal, rung, seq)))
    monkeypatch.setattr(ladder_backward, "autotuned_choices",
                        lambda d, dtype, causal, backward, seq: kept_bwd.get((d, causal, backward, seq), {}))
    longest, by_n = results.autotuned_choices((64, 128), ("bfloat16",), (False, True), (2048, 4096))
    assert by_n == {"d=128 bfloat16 causal=False": {"4096": {"lean": tile, "bwd_lean_dkdv": dict(tile, BLOCK_Q=32)}}}
    assert longest == {"d=128 bfloat16 causal=False": by_n["d=128 bfloat16 causal=False"]["4096"]}
    kept_bwd[(128, False, "tuned", 2048)] = {"dq": tile}
    _, by_n = results.autotuned_choices((128,), ("bfloat16",), (False,), (2048, 4096))
    assert by_n["d=128 bfloat16 causal=False"]["2048"] == {"bwd_dq": tile}  # "tuned" is the plain bwd_ prefix


def test_write_result_names_the_device_and_date(tmp_path):
    from flashlib.bench import records

    result = gpu_run()
    result["ladder"]["provenance"] = {"device": "NVIDIA H200 (test)", "date": "2026-05-06", "torch": "2.11.0"}
    path = results.write_result(result, tmp_path)
    assert path.name == "gpu-ladder-nvidia-h200-test-2026-05-06.json"
    run = records.latest("gpu", tmp_path, with_key="ladder")
    assert run["ladder"]["points"] == result["ladder"]["points"]
    assert records.label(run).startswith("NVIDIA H200 (test), torch 2.11.0")


# ----- a kernel fault: the run stops, and the points left run in a fresh process -----

@needs_triton
def test_a_fault_that_leaves_the_device_unusable_stops_the_point():
    def fault(q, k, v, causal):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    chosen = {"sdpa:math": methods.sdpa("math"), "bad": fault, "sdpa:after": methods.sdpa("math")}
    p = dict(d=16, n=8, dtype="float32", causal=False, mode="fwd")
    kwargs = dict(device="cpu", tokens=8, hidden=32, bench=lambda fn: (fn(), 1.0)[1], peak=lambda fn: (fn(), 0)[1])
    with pytest.raises(point.DeviceLost) as lost:
        point.measure_point(p, chosen, lambda *a: None, usable=lambda device: False, **kwargs)
    assert lost.value.method == "bad" and lost.value.point == p
    assert lost.value.row["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    # an error that leaves the device usable (an out-of-memory, an unsupported backend) is a row
    rows = point.measure_point(p, chosen, lambda *a: None, usable=lambda device: True, **kwargs)
    assert [("error" in r, r["method"]) for r in rows] == [(False, "sdpa:math"), (True, "bad"), (False, "sdpa:after")]


def test_run_plan_stops_at_a_lost_device_and_lists_what_is_pending():
    plan = [grid_point(n) for n in (16384, 8192, 4096, 2048)]
    bad_row = dict(plan[2], method="ladder:bulk", error="RuntimeError: illegal address")

    def measure(p):
        if p["n"] == 4096:
            raise point.DeviceLost("ladder:bulk", p, bad_row)
        return [dict(p, method="sdpa:cudnn", ms=1.0)]

    saved, lost = [], []
    rows, skipped = grid.run_plan(plan, measure, budget_s=1e9, progress=lambda r: saved.append(len(r)), lost=lost)
    assert [r["n"] for r in rows] == [16384, 8192, 4096] and rows[-1] is bad_row and skipped == []
    assert lost == [dict(method="ladder:bulk", point=plan[2], error="RuntimeError: illegal address",
                         pending=plan[2:])]
    assert saved == [1, 2, 3]  # the fault's row is saved too
    with pytest.raises(point.DeviceLost):  # without a list to note it in, it propagates
        grid.run_plan(plan, measure, budget_s=1e9)


def _fresh(measured, lost_method=None, lost_at=None):
    """A fresh process's result: rows for measured points, a loss at lost_at with the rest pending."""
    ladder = dict(points=[dict(p, method="sdpa:cudnn", tflops=1.0) for p in measured], skipped=[], timeline=[],
                  autotuned_by_n={"d=128": {str(p["n"]): {"tma": len(measured)} for p in measured}})
    ladder["device_lost"] = None if lost_method is None else dict(
        method=lost_method, point=lost_at[0], error="boom", pending=lost_at)
    return {"ladder": ladder}


def test_points_left_by_a_lost_device_are_measured_in_fresh_processes():
    plan = [grid_point(n, mode) for n in (16384, 8192, 4096) for mode in ("fwd", "fwd_bwd")]
    result = {"ladder": dict(points=[dict(plan[0], method="rung:lean", tflops=400.0),
                                     dict(plan[1], method="ladder:bulk", error="boom")],
                             skipped=[], timeline=[], autotuned={}, autotuned_by_n={}, ceilings=None,
                             device_lost=dict(method="ladder:bulk", point=plan[1], error="boom", pending=plan[1:]))}
    calls = []

    def run_fresh(points, exclude, budget_s):
        calls.append((list(points), list(exclude), budget_s))
        if len(calls) == 1:  # a second method faults two points later
            return _fresh(points[:2], "ladder:lean", points[2:])
        return _fresh(points)

    out = fresh.continue_after_device_lost(result, deadline=1000.0, run_fresh=run_fresh, clock=lambda: 0.0,
                                           log=lambda *a: None)
    assert out is result
    assert calls == [(plan[1:], ["ladder:bulk"], 985.0), (plan[3:], ["ladder:bulk", "ladder:lean"], 985.0)]
    ladder = result["ladder"]
    measured = [(r["n"], r["mode"]) for r in ladder["points"] if "tflops" in r]
    assert sorted(measured) == sorted((p["n"], p["mode"]) for p in plan)
    assert [loss["method"] for loss in ladder["devices_lost"]] == ["ladder:bulk", "ladder:lean"]
    assert "pending" not in ladder["device_lost"] and ladder["skipped"] == []
    # each bucket's choice from the process that measured it, the longest bucket's as "autotuned"
    assert ladder["autotuned_by_n"] == {"d=128": {"16384": {"tma": 2}, "8192": {"tma": 3}, "4096": {"tma": 3}}}
    assert ladder["autotuned"] == {"d=128": {"tma": 2}}


def test_no_time_or_no_result_leaves_the_pending_points_skipped():
    plan = [grid_point(n) for n in (16384, 8192)]
    lost = dict(method="ladder:bulk", point=plan[0], error="boom", pending=plan)

    def never(*args):
        raise AssertionError("no fresh process without time for one")

    def continued(deadline, run_fresh):
        result = {"ladder": dict(points=[], skipped=[], device_lost=dict(lost))}
        return fresh.continue_after_device_lost(result, deadline=deadline, run_fresh=run_fresh, clock=lambda: 0.0,
                                                log=lambda *a: None)["ladder"]

    assert continued(30.0, never)["skipped"] == plan
    ladder = continued(1000.0, lambda *a: None)
    assert ladder["skipped"] == plan and ladder["devices_lost"][0]["method"] == "ladder:bulk"
    # a fresh process stopped on time: what it measured is kept, what it never reached is skipped
    partial = {"ladder": {"points": [dict(plan[0], method="sdpa:cudnn", tflops=1.0)]}, "unreached": plan[1:]}
    ladder = continued(1000.0, lambda *a: partial)
    assert [r["n"] for r in ladder["points"]] == [16384] and ladder["skipped"] == plan[1:]


@needs_triton
def test_the_ladder_end_to_end_on_a_cpu_with_a_fault_and_a_fresh_run(monkeypatch):
    """run_ladder_bench and continue_after_device_lost as the GPU check chains them, on the CPU
    (interpreter, stand-in timers): a method that faults stops the first run; a second run,
    standing in for the fresh process, measures the rest without it."""
    real_methods, broken = methods.methods, [False]

    def fault(q, k, v, causal):
        broken[0] = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def chosen(mode):
        m = real_methods(mode)
        if mode == "fwd":
            return {"rung:lean": m["rung:lean"], "sdpa:math": m["sdpa:math"]}
        return {"flashlib": m["flashlib"], "ladder:faulty": fault, "sdpa:math": m["sdpa:math"]}

    monkeypatch.setattr(gpu, "methods", chosen)
    monkeypatch.setattr(point, "device_usable", lambda device="cuda": not broken[0])
    kwargs = dict(ds=(32,), ns=(16, 32), dtypes=("float32",), causals=(True,), log=lambda *a: None,
                  compile_ahead=False, ceilings=False, device="cpu", tokens=32, hidden=64, **STAND_IN)
    result = gpu.run_ladder_bench(1e6, **kwargs)
    ladder = result["ladder"]
    plan = grid.plan((32,), (16, 32), ("float32",), (True,))
    assert [(p["n"], p["mode"]) for p in plan] == [(16, "fwd"), (16, "fwd_bwd"), (32, "fwd"), (32, "fwd_bwd")]
    assert ladder["device_lost"]["method"] == "ladder:faulty" and ladder["device_lost"]["pending"] == plan[1:]
    assert [(r["n"], r["method"], "error" in r) for r in ladder["points"]] == [
        (16, "rung:lean", False), (16, "sdpa:math", False), (16, "ladder:faulty", True)]
    assert ladder["vocabulary"] == 2

    def fresh_run(points, exclude, budget_s):
        broken[0] = False  # a new process: a working device
        return gpu.run_ladder_bench(budget_s, points=points, exclude=tuple(exclude), **kwargs)

    fresh.continue_after_device_lost(result, time.perf_counter() + 1e6, run_fresh=fresh_run, log=lambda *a: None)
    timed = {(r["n"], r["mode"], r["method"]) for r in ladder["points"] if "tflops" in r}
    assert timed == {(n, mode, m) for n in (16, 32) for mode, ms in
                     (("fwd", ("rung:lean", "sdpa:math")), ("fwd_bwd", ("flashlib", "sdpa:math"))) for m in ms}
    assert all(r["max_abs_err_vs_sdpa"] < 1e-5 for r in ladder["points"] if r["method"] == "rung:lean")
    assert [loss["method"] for loss in ladder["devices_lost"]] == ["ladder:faulty"]
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
assert [args[i + 1] for i, a in enumerate(args) if a == "--exclude"] == ["ladder:bulk", "ladder:lean"]
points = json.load(open(opt("--points")))
json.dump({"points": [dict(points[0], method="sdpa:cudnn", ms=1.0)]}, open(opt("--result"), "w"))
sys.exit(1)
PY
""")
    stub.chmod(0o755)
    monkeypatch.setenv("FLASHLIB_REAL_PYTHON", sys.executable)
    plan = [grid_point(n) for n in (16384, 8192, 4096)]
    got = fresh.run_fresh_process(plan, ["ladder:bulk", "ladder:lean"], 20.0, out_path=tmp_path / "r.json",
                                  python=str(stub))
    assert [r["n"] for r in got["ladder"]["points"]] == [16384] and got["unreached"] == plan[1:]


def test_a_fresh_process_without_a_gpu_returns_nothing(tmp_path):
    """The real command, on a machine without CUDA: it refuses, writes no result, and the caller
    gets None (its points are then listed as skipped)."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the command would run the benchmark")
    got = fresh.run_fresh_process([grid_point(4096)], ["ladder:bulk"], 60.0, out_path=tmp_path / "r.json")
    assert got is None and not (tmp_path / "r.json").exists()


def test_the_command_line_passes_points_and_exclusions(tmp_path, monkeypatch, capsys):
    plan = [grid_point(n) for n in (16384, 8192)]
    (tmp_path / "points.json").write_text(json.dumps(plan))
    seen = {}

    def fake_run(budget_s, **kwargs):
        seen.update(kwargs, budget_s=budget_s)
        kwargs["progress"]([dict(plan[0], method="sdpa:cudnn", ms=1.0)])
        seen["partial"] = json.loads((tmp_path / "r.json").read_text())
        return {"ladder": dict(points=[], target_ratios=[])}

    monkeypatch.setattr(gpu, "run_ladder_bench", fake_run)
    gpu.main(["--points", str(tmp_path / "points.json"), "--exclude", "ladder:bulk", "--budget", "50",
              "--result", str(tmp_path / "r.json"), "--no-precompile", "--no-ceilings"])
    assert seen["points"] == plan and seen["exclude"] == ("ladder:bulk",) and seen["budget_s"] == 50.0
    assert seen["ceilings"] is False and seen["compile_ahead"] is False
    assert seen["partial"]["points"][0]["n"] == 16384
    assert json.loads((tmp_path / "r.json").read_text()) == {"ladder": dict(points=[], target_ratios=[])}
    (tmp_path / "bad.json").write_text(json.dumps({"d": 128}))
    with pytest.raises(SystemExit):
        gpu.main(["--points", str(tmp_path / "bad.json")])
    assert "--points must name a JSON file holding a list of grid points" in capsys.readouterr().err


# ----- one grid point of the benchmark, on the CPU (interpreter) with stand-in timers -----

@needs_triton
def test_measure_point_runs_every_method_on_cpu():
    for mode in ("fwd", "fwd_bwd"):
        p = dict(d=32, n=24, dtype="float32", causal=True, mode=mode)
        rows = point.measure_point(p, methods.methods(mode), lambda *a: None, device="cpu", tokens=24, hidden=64,
                                   **STAND_IN)
        by = {r["method"]: r for r in rows}
        flops = roofline.attention_flops(1, 2, 24, 24, 32, causal=True, mode=mode)
        assert by["sdpa:math"]["tflops"] == pytest.approx(roofline.tflops(flops, 2.0))
        assert (by["sdpa:math"]["ms_p20"], by["sdpa:math"]["ms_p80"]) == (1.5, 2.5)
        ours = [m for m in by if methods.is_ours(m)]
        assert ours == [m for m in methods.methods(mode) if methods.is_ours(m)]
        for m in ours:
            assert "error" not in by[m], by[m]
            if mode == "fwd":
                assert by[m]["max_abs_err_vs_sdpa"] < 1e-5


@needs_triton
@pytest.mark.parametrize("rung", [r.name for r in LADDER if r.name != "teaching"])
def test_ladder_forward_with_the_teaching_backward_gradients(rung):
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


def test_a_forward_backward_call_lets_the_peak_probe_clear_the_last_gradients_first():
    """peak_bytes clears what the previous call left before its window (fn.clear): freed
    inside the window, the gradients would lower the peak by their own size."""
    from flashlib.bench import point

    x = torch.randn(1, 1, 8, 4)
    call = point._call(lambda q, k, v, causal: (q * k * v).sum(-1, keepdim=True).expand_as(q), x, x, x,
                       dict(mode="fwd_bwd", causal=False))
    call()
    assert all(t.grad is not None for t in call.leaves)
    call.clear()
    assert all(t.grad is None for t in call.leaves)
