"""tools/gpu_probe_bulk.py without a GPU: each case in a process of its own, what the parent calls
each ending (a result, a fault raised or a process killed by a signal, a hang past the deadline),
the JSON it writes as it goes, the compute-sanitizer run (a stand-in on PATH), and one case's
comparison run in Triton's interpreter."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_probe_bulk.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("gpu_probe_bulk", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_self_test_tells_every_ending_apart_within_its_budget(tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(TOOL), "--self-test", "--budget", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    found = {c["name"]: c["status"] for c in report["cases"]}
    assert found == {"selftest-ok": "ok", "selftest-wrong": "wrong", "selftest-fault": "fault",
                     "selftest-crash": "fault", "selftest-hang": "timeout"}
    assert report["as_expected"] and report["elapsed_s"] < 15
    assert "every case as expected: True" in done.stdout


def test_verdict_reads_the_last_json_line_or_how_the_process_ended(tool):
    noisy = "a compiler warning\n" + json.dumps(dict(status="wrong", errors={"dq": 1})) + "\n"
    assert tool.verdict(noisy, "", 0, False)["status"] == "wrong"
    assert tool.verdict("", "Segmentation fault", -11, False)["status"] == "fault"  # a signal
    assert tool.verdict("", "CUDA error: an illegal memory access was encountered", 1, False)["status"] == "fault"
    assert tool.verdict("", "ImportError: no module named triton", 1, False)["status"] == "error"
    assert tool.verdict(noisy, "", 0, True)["status"] == "timeout"


def test_results_go_to_out_or_a_temporary_folder(tool, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert tool._out_path(None) == tmp_path / "out" / "bulk-probe.json"
    monkeypatch.delenv("OUT")
    fallback = tool._out_path(None)
    assert fallback.name == "bulk-probe.json" and fallback.parent.is_dir()


def test_the_sanitizer_runs_its_case_once_and_its_tail_is_kept(tool, monkeypatch, tmp_path):
    """A stand-in compute-sanitizer prints memcheck's line and runs the command it was given."""
    fake = tmp_path / "fake-sanitizer"
    fake.write_text("#!/bin/sh\necho '========= Out-of-range shared or local address'\n"
                    "while [ \"$1\" != \"--print-limit\" ]; do shift; done; shift 2; exec \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLASHLIB_SANITIZER", str(fake))
    monkeypatch.setattr(tool, "SANITIZED", "selftest-fault")
    report = tool.probe(["selftest-ok"], tmp_path / "p.json", budget_s=20)
    sanitizer = report["sanitizer"]
    assert sanitizer["ran"] and sanitizer["errors_reported"] == 1 and not sanitizer["timed_out"]
    assert "illegal memory access" in sanitizer["tail"] and sanitizer["returncode"] == 1
    assert json.loads((tmp_path / "p.json").read_text())["cases"][0]["status"] == "ok"


def test_cases_hold_the_faulted_shape_and_force_the_withdrawn_tile(tool):
    from flashlib.ladder import rungs

    assert tool.WITHDRAWN not in rungs.BULK_TILES[128]
    faulted = tool.CASES["faulted-bf16-causal-4096"]
    assert (faulted["seq"], faulted["dim"], faulted["dtype"], faulted["causal"], faulted["tiles"]) == \
        (4096, 128, "bfloat16", True, None)
    assert tool.CASES[tool.SANITIZED]["tiles"] == tool.WITHDRAWN
    forced = [c["tiles"] for c in tool.CASES.values() if c["tiles"] not in (None, tool.WITHDRAWN)]
    assert forced and all(t in rungs.BULK_TILES[128] for t in forced)


@pytest.mark.parametrize("tiles", [None, (16, 16, 4, 1, True)])
def test_a_case_is_right_in_the_interpreter_and_a_wrong_gradient_is_caught(tool, tiles, monkeypatch):
    from flashlib.kernels import triton_installed

    if not triton_installed():
        pytest.skip("Triton ships Linux wheels only")
    case = dict(batch=1, heads=2, seq=37, dim=16, dtype="float32", causal=True, tiles=tiles)
    result = tool.run_case(case, device="cpu")
    assert result["status"] == "ok", result["errors"]
    import flashlib.ladder

    real = flashlib.ladder.attention
    monkeypatch.setattr(flashlib.ladder, "attention", lambda *a, **kw: real(*a, **kw) * 1.01)
    assert tool.run_case(case, device="cpu")["status"] == "wrong"
