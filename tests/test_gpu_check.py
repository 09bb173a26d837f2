"""The GPU check's logic that needs no GPU: arguments, plan, budget, table, JSON report."""
from __future__ import annotations

import json
import sys
import time

import pytest

from flashlib.bench import check as gpu_check


def _fake_measure(point, impl):
    """Deterministic made-up timings, so that the table and JSON can be checked on a CPU."""
    if impl == "sdpa:cudnn":
        raise RuntimeError("No available kernel. Aborting execution.\nmore detail")
    base = point["seq"] / 1024 * (2.0 if impl == "sdpa:math" else 1.0)
    return dict(fwd_ms=base, bwd_ms=2.5 * base, peak_mb=float(point["seq"]) / 8)


def test_arguments_and_plan():
    args = gpu_check.parse_args(["--quick", "--budget", "60"])
    assert args.quick and args.budget == 60
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget", "-1"])
    points = gpu_check.plan(quick=False)
    assert len(points) == 2 * 2 * 2 * len(gpu_check.SEQS)
    assert all(p["batch"] * p["heads"] * p["seq"] == gpu_check.TOKENS for p in points)
    assert points[0]["head_dim"] == 128 and points[0]["seq"] >= 4096  # the targets come first


def test_flops_and_rates():
    p = dict(batch=2, heads=3, seq=1000, head_dim=64, causal=False)
    assert gpu_check.attention_flops(p) == 4 * 2 * 3 * 1000 ** 2 * 64
    assert gpu_check.attention_flops(dict(p, causal=True), backward=True) == 4 * 2 * 3 * 1000 ** 2 * 64 * 2.5 / 2
    assert gpu_check.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert gpu_check.tflops(1.0, None) is None


def _fake_provenance(device):
    real = gpu_check.provenance

    def provenance():
        return dict(real(), device=device, capability=[9, 0] if device else None)
    return provenance


def test_main_with_fake_measurements_writes_json_copy_and_table(tmp_path, monkeypatch):
    out_copy = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out_copy))
    monkeypatch.setattr(gpu_check, "provenance", _fake_provenance("Fake GPU 80GB HBM3"))
    printed = []
    code = gpu_check.main(["--quick", "--skip-tests", "--no-ladder", "--out-dir", str(tmp_path / "bench")],
                          measure=_fake_measure, log=printed.append)
    assert code == 0
    (path,) = (tmp_path / "bench").glob("gpu-fake-gpu-80gb-hbm3-*.json")
    assert (out_copy / path.name).read_text() == path.read_text()
    report = json.loads(path.read_text())
    for key in ("date", "torch", "triton", "cuda", "python", "device", "bench", "elapsed_s"):
        assert key in report
    rows = report["bench"]["rows"]
    assert len(rows) == len(gpu_check.plan(quick=True)) * len(gpu_check.IMPLS)
    cudnn = [r for r in rows if r["impl"] == "sdpa:cudnn"]
    assert all(r["error"] == "RuntimeError: No available kernel. Aborting execution." for r in cudnn)
    big_math = [r for r in rows if r["impl"] == "sdpa:math" and r["seq"] > gpu_check.MATH_MAX_SEQ]
    assert big_math and all(r["error"].startswith("skipped") and r["fwd_ms"] is None for r in big_math)
    ours = next(r for r in rows if r["impl"] == "flashlib" and r["seq"] == 4096 and not r["causal"])
    assert ours["fwd_tflops"] == pytest.approx(gpu_check.attention_flops(ours) / (4.0e-3) / 1e12)
    table = next(line for line in printed if line.lstrip().startswith("dtype"))
    assert "ratio" in table
    # flashlib and the fastest SDPA backend get the same fake time: every ratio printed is 1.00
    body = "\n".join(printed)
    assert "1.00" in body and "sdpa:flash" in body


def test_time_budget_skips_the_rest():
    rows = gpu_check.run_benchmark(gpu_check.plan(quick=True), _fake_measure, budget_s=0.0, log=lambda *_: None)
    assert rows and all(r["error"] == "skipped: time budget" for r in rows)


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "provenance", _fake_provenance(None))
    assert gpu_check.main(["--quick"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_source_revision_names_the_code(tmp_path):
    import shutil

    here = gpu_check.source_revision()
    assert len(here["source_sha256"]) == 64 and here == gpu_check.source_revision()
    copy = tmp_path / "copy"
    shutil.copytree(gpu_check.ROOT / "flashlib", copy / "flashlib", ignore=shutil.ignore_patterns("__pycache__"))
    outside_git = gpu_check.source_revision(copy)
    assert outside_git["source_sha256"] == here["source_sha256"] and outside_git["git_commit"] is None
    (copy / "flashlib" / "demo.py").write_text((copy / "flashlib" / "demo.py").read_text() + "\n# changed\n")
    assert gpu_check.source_revision(copy)["source_sha256"] != here["source_sha256"]


def test_tests_run_beside_other_work_and_keep_their_output():
    # 200 kB of output, more than a pipe holds, written while nobody reads it
    loud = [sys.executable, "-c", "import sys; print('x' * 200_000); print('3 passed'); sys.exit(3)"]
    started = gpu_check.start_tests(timeout_s=60, cmd=loud)
    time.sleep(0.5)  # the caller is busy elsewhere meanwhile
    result = gpu_check.finish_tests(started, log=lambda *_: None)
    assert result["returncode"] == 3 and result["summary"] == "3 passed"
    assert result["tail"].endswith("3 passed\n") and len(result["tail"]) == 6000


def test_tests_past_their_time_are_stopped():
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = gpu_check.start_tests(timeout_s=1.0, cmd=slow)
    result = gpu_check.finish_tests(started, log=lambda *_: None)
    assert result["returncode"] == -1 and "timed out after 1 s" in result["summary"]
    assert result["seconds"] < 30
    assert started["proc"].poll() is not None  # killed, not left running


def _stub_run(monkeypatch, events, precompile=None):
    """gpu_check.main with its tests, compiling and ladder replaced by notes of the calls."""
    from flashlib.bench import gpu as perf_bench

    monkeypatch.setattr(gpu_check, "provenance", _fake_provenance("Fake GPU 80GB HBM3"))
    monkeypatch.setattr(gpu_check, "start_tests", lambda timeout_s: events.append("tests start") or {})
    monkeypatch.setattr(gpu_check, "finish_tests", lambda started, log: events.append("tests end") or dict(
        returncode=0, summary="1 passed", seconds=1.0, tail=""))

    def compile_ahead(grid, log):
        events.append(("compile ahead", len(grid)))
        if precompile is not None:
            raise precompile
        return {"kernels": 3}

    monkeypatch.setattr(perf_bench, "precompile", compile_ahead)
    monkeypatch.setattr(perf_bench, "run_ladder_bench", lambda budget_s, log, progress, compile_ahead: events.append(
        ("ladder", compile_ahead)) or {"ladder": {"target_ratios": []}})


def test_main_compiles_the_ladder_while_the_tests_run(tmp_path, monkeypatch):
    from flashlib.bench import gpu as perf_bench

    events = []
    _stub_run(monkeypatch, events)
    assert gpu_check.main(["--out-dir", str(tmp_path / "a")], log=lambda *_: None) == 0
    assert events == ["tests start", ("compile ahead", len(perf_bench.plan())), "tests end", ("ladder", True)]
    (path,) = (tmp_path / "a").glob("*.json")
    assert json.loads(path.read_text())["precompile"] == {"kernels": 3}

    events.clear()
    assert gpu_check.main(["--out-dir", str(tmp_path / "b"), "--no-precompile"], log=lambda *_: None) == 0
    assert events == ["tests start", "tests end", ("ladder", False)]


def test_a_failure_to_compile_ahead_is_recorded_and_the_ladder_still_runs(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, precompile=RuntimeError("no threads today"))
    assert gpu_check.main(["--out-dir", str(tmp_path)], log=lambda *_: None) == 0
    assert events[-2:] == ["tests end", ("ladder", True)]
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["precompile"] == {"error": "RuntimeError: no threads today"}


def test_a_lost_device_sends_the_points_left_to_a_fresh_process(tmp_path, monkeypatch):
    from flashlib.bench import gpu as perf_bench

    events = []
    _stub_run(monkeypatch, events)
    point = dict(d=128, n=16384, dtype="bfloat16", causal=False, mode="fwd_bwd")
    lost = dict(method="flashlib:bulk", point=point, error="RuntimeError: illegal address", pending=[point])
    monkeypatch.setattr(perf_bench, "run_ladder_bench", lambda **kw: {"ladder": dict(
        points=[dict(point, method="flashlib:bulk", error=lost["error"])], skipped=[], device_lost=lost,
        target_ratios=[])})

    def fresh_process(points, exclude, budget_s, out_path=None):
        events.append(("fresh", len(points), list(exclude)))
        return {"ladder": dict(points=[dict(point, method="sdpa:cudnn", tflops=500.0)], skipped=[],
                               device_lost=None)}

    monkeypatch.setattr(perf_bench, "run_fresh_process", fresh_process)
    printed = []
    assert gpu_check.main(["--out-dir", str(tmp_path), "--no-precompile"], log=printed.append) == 0
    assert events[-1] == ("fresh", 1, ["flashlib:bulk"])
    (path,) = tmp_path.glob("*.json")
    ladder = json.loads(path.read_text())["ladder"]
    assert [r["method"] for r in ladder["points"]] == ["flashlib:bulk", "sdpa:cudnn"]
    assert ladder["devices_lost"] == [{k: v for k, v in lost.items() if k != "pending"}]
    assert any("flashlib:bulk left the device unusable at d=128 N=16384" in line for line in printed)
