"""The GPU check (flashlib.bench.check) without a GPU: arguments, provenance, child processes
with time limits, and the order of its steps with the GPU work replaced by stand-ins."""
from __future__ import annotations

import json
import sys
import time

import pytest

from flashlib.bench import check, fresh, gpu


def _fake_provenance(device):
    real = check.provenance

    def provenance():
        return dict(real(), device=device, capability=[9, 0] if device else None)
    return provenance


def test_arguments():
    args = check.parse_args(["--budget", "60", "--skip-notebooks"])
    assert args.budget == 60 and args.skip_notebooks and not args.skip_tests
    assert check.parse_args([]).budget == check.BUDGET_S == 480
    notebooks = check.parse_args(["notebooks"])
    assert notebooks.budget == 300 and notebooks.jobs == check.default_jobs() >= 1
    assert notebooks.skip_tests and notebooks.skip_bench and notebooks.skip_decode and not notebooks.skip_notebooks
    tests = check.parse_args(["tests", "--budget", "200"])
    assert tests.budget == 200 and tests.skip_notebooks and not (tests.skip_tests or tests.skip_bench)
    assert check.parse_args(["tests"]).budget == 320 and check.parse_args(["notebooks", "--jobs", "2"]).jobs == 2
    assert [check.default_jobs(c) for c in (1, 2, 8, 16, 64)] == [1, 1, 2, 5, 6]
    for bad in (["--budget", "-1"], ["--budget", "nan"], ["--sdpa-table"], ["--quick"], ["benchmarks"],
                ["notebooks", "--jobs", "0"]):
        with pytest.raises(SystemExit):
            check.parse_args(bad)


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(check, "provenance", _fake_provenance(None))
    assert check.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_provenance_records_the_versions_the_course_has_floors_for():
    from flashlib.course import runtime

    packages = check.provenance()["packages"]
    assert set(packages) == set(runtime.TESTED) and packages == runtime.installed()


def test_source_revision_names_the_code(tmp_path, monkeypatch):
    import shutil

    here = check.source_revision()
    assert len(here["source_sha256"]) == 64 and here == check.source_revision()
    copy = tmp_path / "copy"
    shutil.copytree(check.ROOT / "flashlib", copy / "flashlib", ignore=shutil.ignore_patterns("__pycache__"))
    outside_git = check.source_revision(copy)
    assert outside_git["source_sha256"] == here["source_sha256"] and outside_git["git_commit"] is None
    monkeypatch.setenv("FLASHLIB_GIT_COMMIT", "51f551b405bc6b011ed32b8bc7a303659f20b566")
    declared = check.source_revision(copy)
    assert declared["git_commit"].startswith("51f551b") and declared["git_commit_declared"] is True
    stale = check.source_revision()  # a copy whose .git is older than its files: the declared commit wins
    assert stale["git_commit"].startswith("51f551b") and stale["git_commit_seen"] == here["git_commit"]
    monkeypatch.delenv("FLASHLIB_GIT_COMMIT")
    (copy / "flashlib" / "demo.py").write_text((copy / "flashlib" / "demo.py").read_text() + "\n# changed\n")
    assert check.source_revision(copy)["source_sha256"] != here["source_sha256"]


def test_children_run_beside_other_work_and_keep_their_output():
    # 200 kB of output, more than a pipe holds, written while nobody reads it
    loud = [sys.executable, "-c", "import sys; print('x' * 200_000); print('3 passed'); sys.exit(3)"]
    started = check.processes.start(loud, timeout_s=60)
    time.sleep(0.5)  # the caller is busy elsewhere meanwhile
    result = check.processes.finish(started, log=lambda *_: None)
    assert result["returncode"] == 3 and result["summary"] == "3 passed"
    assert result["tail"].endswith("3 passed\n") and len(result["tail"]) == 6000


def test_children_past_their_time_are_stopped_with_what_they_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    slow = [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"]
    started = check.processes.start(slow, timeout_s=2.0)
    result = check.processes.finish(started, log=lambda *_: None)
    assert result["returncode"] == -1 and "timed out after 2 s" in result["summary"]
    assert result["seconds"] < 30
    assert started["proc"].poll() is not None  # killed, not left running
    grandchild = int(pid_file.read_text())
    # nor what it started (here a process that would sleep on): gone, or a zombie until reaped. A
    # signal is delivered asynchronously, so a loaded machine may show it running for a moment.
    deadline, state = time.monotonic() + 10.0, None
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{grandchild}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            break
        time.sleep(0.05)
    assert state in ("Z", "X", "gone"), f"the grandchild outlived its parent's limit (state {state})"


NOTEBOOKS = {"notebooks": [dict(notebook="01_dense_attention.ipynb", order=0, status="passed", cells=[]),
                           dict(notebook="07_backward_kernels.ipynb", order=6, status="failed", cells=[
                               dict(cell=5, index=10, line="losses = ...", status="failed",
                                    error="ValueError: argument 'q' is on cpu")])]}


def _stub_run(monkeypatch, events, tmp_path, precompile=None):
    """check.main with its tests, notebooks, compiling and ladder replaced by notes of the calls;
    each step writes the report, and $OUT gets its copy."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(check, "provenance", _fake_provenance("Fake GPU 80GB HBM3"))
    monkeypatch.setattr(check, "start_tests", lambda timeout_s: events.append(("tests start", timeout_s)) or {})
    monkeypatch.setattr(check, "finish_tests", lambda started, log: events.append("tests end") or dict(
        returncode=0, summary="1 passed", seconds=1.0, tail=""))
    monkeypatch.setattr(check, "start_notebooks", lambda budget_s, path, jobs: events.append(
        ("notebooks start", budget_s, path.name) + ((jobs,) if jobs != 1 else ())) or {})
    monkeypatch.setattr(check, "finish_notebooks", lambda started: events.append("notebooks end") or NOTEBOOKS)

    def compile_ahead(plan, threads, log):
        events.append(("compile ahead", len(plan)))
        if precompile is not None:
            raise precompile
        return {"kernels": 3}

    def ladder(budget_s, log, progress, compile_ahead):
        events.append(("ladder", compile_ahead, round(budget_s)))
        progress([{"method": "sdpa:cudnn"}])
        return {"ladder": {"target_ratios": []}}

    monkeypatch.setattr(gpu, "precompile", compile_ahead)
    monkeypatch.setattr(gpu, "run_ladder_bench", ladder)
    monkeypatch.setattr(check, "start_decode", lambda budget_s, path: events.append(
        ("decode start", round(budget_s), path.name)) or {})
    monkeypatch.setattr(check, "finish_decode", lambda started, log: events.append("decode end") or dict(
        points=[{"method": "flashlib"}], targets=[]))


def test_the_check_runs_tests_and_notebooks_beside_compiling_then_the_ladder(tmp_path, monkeypatch):
    events, printed = [], []
    _stub_run(monkeypatch, events, tmp_path)
    assert check.main(["--out-dir", str(tmp_path / "a"), "--budget", "400"], log=printed.append) == 0
    assert events[:5] == [("tests start", 200.0), ("notebooks start", 200.0, "notebooks.json"),
                          ("compile ahead", len(gpu.plan())), "tests end", "notebooks end"]
    (step, compiled, budget), decode_start, decode_end = events[5:]
    # the ladder leaves the decoding benchmark its share; the decoding benchmark gets what is left
    assert step == "ladder" and compiled is True and 325 <= budget <= 345
    assert decode_start[0] == "decode start" and 370 <= decode_start[1] <= 390 and decode_start[2] == "decode.json"
    assert decode_end == "decode end"
    (path,) = (tmp_path / "a").glob("gpu-fake-gpu-80gb-hbm3-*.json")
    report = json.loads(path.read_text())
    assert report["precompile"] == {"kernels": 3} and report["tests"]["summary"] == "1 passed"
    assert report["notebooks"] == NOTEBOOKS and "ladder_partial" not in report
    assert report["decode"] == dict(points=[{"method": "flashlib"}], targets=[])
    assert (tmp_path / "out" / path.name).read_text() == path.read_text()
    assert any(line.startswith("07_backward_kernels.ipynb: failed") for line in "\n".join(printed).splitlines())
    assert "  Cell 5 (cell 10, 'losses = ...'): failed: ValueError: argument 'q' is on cpu" in "\n".join(printed)

    events.clear()
    assert check.main(["--out-dir", str(tmp_path / "b"), "--no-precompile", "--skip-notebooks"],
                      log=lambda *_: None) == 0
    assert [e if isinstance(e, str) else e[:2] for e in events] == [("tests start", 240.0), "tests end",
                                                                    ("ladder", False), ("decode start", 470),
                                                                    "decode end"]

    events.clear()
    assert check.main(["--out-dir", str(tmp_path / "c"), "--skip-notebooks", "--skip-decode"],
                      log=lambda *_: None) == 0
    ladder_budget = next(e[2] for e in events if isinstance(e, tuple) and e[0] == "ladder")
    assert 460 <= ladder_budget <= 470 and "decode end" not in events  # no share kept back


def test_each_step_is_written_as_soon_as_it_ends(tmp_path, monkeypatch):
    events, written = [], []
    _stub_run(monkeypatch, events, tmp_path)
    real = check.write_report
    monkeypatch.setattr(check, "write_report", lambda report, out_dir, copy_to=None: written.append(
        sorted(k for k in ("tests", "notebooks", "ladder_partial", "ladder", "decode", "elapsed_s") if k in report))
        or real(report, out_dir, copy_to=copy_to))
    check.main(["--out-dir", str(tmp_path)], log=lambda *_: None)
    assert written == [["tests"], ["notebooks", "tests"], ["ladder_partial", "notebooks", "tests"],
                       ["decode", "ladder", "notebooks", "tests"],
                       ["decode", "elapsed_s", "ladder", "notebooks", "tests"]]


def test_a_failure_to_compile_ahead_is_recorded_and_the_ladder_still_runs(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, tmp_path, precompile=RuntimeError("no threads today"))
    assert check.main(["--out-dir", str(tmp_path), "--skip-decode"], log=lambda *_: None) == 0
    assert events[-3:-1] == ["tests end", "notebooks end"] and events[-1][:2] == ("ladder", True)
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["precompile"] == {"error": "RuntimeError: no threads today"}


def test_failing_gpu_tests_set_the_exit_status(tmp_path, monkeypatch):
    _stub_run(monkeypatch, [], tmp_path)
    monkeypatch.setattr(check, "finish_tests", lambda started, log: dict(returncode=1, summary="1 failed",
                                                                         seconds=1.0, tail=""))
    assert check.main(["--out-dir", str(tmp_path), "--skip-bench", "--skip-notebooks"], log=lambda *_: None) == 1


def test_a_lost_device_sends_the_points_left_to_a_fresh_process(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, tmp_path)
    point = dict(d=128, n=16384, dtype="bfloat16", causal=False, mode="fwd_bwd")
    lost = dict(method="ladder:bulk", point=point, error="RuntimeError: illegal address", pending=[point])
    monkeypatch.setattr(gpu, "run_ladder_bench", lambda **kw: {"ladder": dict(
        points=[dict(point, method="ladder:bulk", error=lost["error"])], skipped=[], device_lost=lost,
        target_ratios=[])})

    def fresh_process(points, exclude, budget_s, out_path=None):
        events.append(("fresh", len(points), list(exclude), out_path.name))
        return {"ladder": dict(points=[dict(point, method="sdpa:cudnn", tflops=500.0)], skipped=[],
                               device_lost=None)}

    monkeypatch.setattr(fresh, "run_fresh_process", fresh_process)
    printed = []
    assert check.main(["--out-dir", str(tmp_path), "--no-precompile"], log=printed.append) == 0
    # under $OUT; then the decoding benchmark, in a process of its own, starts on a fresh device too
    assert events[-3] == ("fresh", 1, ["ladder:bulk"], "ladder-fresh-1.json")
    assert events[-2][0] == "decode start" and events[-1] == "decode end"
    (path,) = tmp_path.glob("*.json")
    ladder = json.loads(path.read_text())["ladder"]
    assert [r["method"] for r in ladder["points"]] == ["ladder:bulk", "sdpa:cudnn"]
    assert ladder["devices_lost"] == [{k: v for k, v in lost.items() if k != "pending"}]
    assert any("ladder:bulk left the device unusable at d=128 N=16384" in line for line in printed)


def test_notebook_results_come_back_from_the_job(tmp_path):
    path = tmp_path / "notebooks.json"
    script = f"import json; json.dump({NOTEBOOKS!r}, open({str(path)!r}, 'w')); print('done')"
    started = check.processes.start([sys.executable, "-c", script], 60)
    started["result_path"] = path
    result = check.finish_notebooks(started)
    assert result["notebooks"] == NOTEBOOKS["notebooks"]
    assert result["job"]["returncode"] == 0 and result["job"]["summary"] == "done" == result["job"]["tail"].strip()


def test_notebooks_stopped_at_their_limit_say_what_ran_and_what_did_not(tmp_path):
    from flashlib.bench import notebooks

    path = tmp_path / "notebooks.json"
    running = dict(notebook="01_dense_attention.ipynb", order=0, status="running",
                   cells=[dict(cell=0, index=1, line="import torch", status="running")])
    script = f"import json, time; json.dump({{'notebooks': [{running!r}]}}, open({str(path)!r}, 'w')); time.sleep(60)"
    started = check.processes.start([sys.executable, "-c", script], 1.0)
    started["result_path"] = path
    result = check.finish_notebooks(started)
    entries = {e["notebook"]: e for e in result["notebooks"]}
    assert entries["01_dense_attention.ipynb"]["status"] == "failed"
    assert entries["01_dense_attention.ipynb"]["cells"][0]["error"].startswith("the notebooks were stopped")
    assert {name for name, e in entries.items() if e["status"] == "not run"} == \
        {p.name for p in notebooks.course()} - {"01_dense_attention.ipynb"}
    assert result["job"]["returncode"] == -1



def test_the_decoding_benchmark_gets_what_the_ladder_left_or_is_left_out(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, tmp_path)
    clock = [0.0]
    monkeypatch.setattr(check.time, "perf_counter", lambda: clock[0])

    def slow_ladder(budget_s, log, progress, compile_ahead):  # overruns its budget by 40 s
        clock[0] += budget_s + 40
        return {"ladder": {"target_ratios": []}}

    monkeypatch.setattr(gpu, "run_ladder_bench", slow_ladder)
    assert check.main(["--out-dir", str(tmp_path), "--skip-notebooks", "--skip-tests", "--no-precompile"],
                      log=lambda *_: None) == 0
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert "decode" not in report and report["decode_error"] == "no time left for the decoding benchmark (5 s)"
    assert not any(isinstance(e, tuple) and e[0] == "decode start" for e in events)


def test_the_decoding_benchmark_runs_in_its_own_process_and_its_result_comes_back(tmp_path):
    path = tmp_path / "decode.json"
    started = check.start_decode(30.0, path)
    assert started["proc"].args[-4:] == ["--budget", "22", "--result", str(path)]  # its margin kept
    check.processes.finish(started, log=lambda *_: None)  # here it says there is no CUDA device

    script = f"import json; json.dump({{'decode': {{'targets': [1]}}}}, open({str(path)!r}, 'w')); print('ok')"
    child = check.processes.start([sys.executable, "-c", script], 60)
    child["result_path"] = path
    result = check.finish_decode(child, log=lambda *_: None)
    assert result["targets"] == [1] and result["job"]["returncode"] == 0 and result["job"]["summary"] == "ok"

    child = check.processes.start([sys.executable, "-c", f"open({str(path)!r}, 'w').write('{{\"dec')"], 60)
    child["result_path"] = path
    result = check.finish_decode(child, log=lambda *_: None)
    assert result["error"].startswith("unreadable result") and result["job"]["returncode"] == 0


def test_the_notebooks_part_runs_them_alone_several_at_once(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, tmp_path)
    assert check.main(["notebooks", "--out-dir", str(tmp_path / "a"), "--jobs", "4"], log=lambda *_: None) == 1
    # all of its budget but the writing, four at a time; no tests, no compiling, no benchmark
    assert events == [("notebooks start", 300.0 - check.FINAL_WRITE_S, "notebooks.json", 4), "notebooks end"]
    (path,) = (tmp_path / "a").glob("*.json")
    report = json.loads(path.read_text())
    assert report["part"] == "notebooks" and "tests" not in report and "ladder" not in report
    monkeypatch.setattr(check, "finish_notebooks", lambda started: {"notebooks": [NOTEBOOKS["notebooks"][0]]})
    assert check.main(["notebooks", "--out-dir", str(tmp_path / "b")], log=lambda *_: None) == 0  # all passed


def test_the_tests_part_runs_tests_then_ladder_then_decoding(tmp_path, monkeypatch):
    events = []
    _stub_run(monkeypatch, events, tmp_path)
    assert check.main(["tests", "--out-dir", str(tmp_path)], log=lambda *_: None) == 0
    assert [e if isinstance(e, str) else e[0] for e in events] == [
        "tests start", "compile ahead", "tests end", "ladder", "decode start", "decode end"]
    assert events[0] == ("tests start", 160.0)
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["part"] == "tests"


def test_the_tests_step_reports_each_test_and_the_fault(tmp_path, monkeypatch):
    """start_tests/finish_tests over a stand-in suite whose second test poisons its process as a
    kernel fault does (the plugin's device_lost faked): each test's row, the fault named, exit 1."""
    (tmp_path / "conftest.py").write_text("import flashlib.bench.gpu_tests as g\nPOISON = []\n"
                                          "g.device_lost = lambda: bool(POISON)\n")
    (tmp_path / "test_stand_in.py").write_text("import conftest\n\ndef test_a():\n    pass\n\n"
                                               "def test_b():\n    conftest.POISON.append(1)\n\n"
                                               "def test_c():\n    pass\n")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    # the stand-in suite uses no installed pytest plugin: loading them was most of each child's start
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    (tmp_path / "out").mkdir()
    result = check.finish_tests(check.start_tests(120, tests=[tmp_path / "test_stand_in.py"]), log=lambda *_: None)
    assert result["returncode"] == 1 and [j["returncode"] for j in result["jobs"]] == [3, 0]
    assert result["faults"] == [n for n in result["tests"] if n.endswith("test_b")]
    assert result["summary"].startswith("1 fault, 2 passed in 2 processes; kernel faults in ")
    assert json.loads((tmp_path / "out" / "tests.json").read_text())["tests"] == result["tests"]
