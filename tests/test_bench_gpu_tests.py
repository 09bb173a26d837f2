"""The GPU tests' runner (flashlib.bench.gpu_tests) on a CPU: a faked kernel fault stops its process
at once, naming the test, and the tests left run in a fresh process; a crash is blamed on the test
that was running; a process past its time is stopped and its running test says so."""
from __future__ import annotations

import json
import textwrap

import pytest

from flashlib.bench import gpu_tests


@pytest.fixture(autouse=True)
def _children_without_installed_plugins(monkeypatch):
    """The stand-in suites use no installed pytest plugin: loading them (nbval's Jupyter imports, ...)
    was most of each child's start. The runner's own plugin is named by -p and still loads."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

# The device is faked: a test "faults" by poisoning its process, as a kernel fault poisons a CUDA
# context; the plugin's device_lost() reads the poison. A fresh process starts clean.
CONFTEST = """
import flashlib.bench.gpu_tests as gpu_tests
POISONED = []
gpu_tests.device_lost = lambda: bool(POISONED)
"""

TESTS = """
import os, signal, time
import conftest

def test_a():
    pass

def test_b_faults():
    conftest.POISONED.append(1)

def test_c():
    pass

def test_d_fails():
    assert 1 == 2, "an ordinary failure"

def test_e_faults_in_its_process_too():
    conftest.POISONED.append(1)

def test_f():
    pass
"""


def _suite(tmp_path, tests=TESTS):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_fake_gpu.py").write_text(textwrap.dedent(tests))
    return tmp_path / "test_fake_gpu.py"


def _status(results):
    return {nodeid.split("::")[1]: row["status"] for nodeid, row in results["tests"].items()}


def test_a_fault_stops_its_process_and_the_rest_run_in_a_fresh_one(tmp_path):
    path = tmp_path / "out" / "tests.json"
    path.parent.mkdir()
    results = gpu_tests.run_tests([_suite(tmp_path)], path, budget_s=120, log=lambda *_: None)
    assert _status(results) == dict(test_a="passed", test_b_faults="fault", test_c="passed", test_d_fails="failed",
                                    test_e_faults_in_its_process_too="fault", test_f="passed")
    # three processes: each fault ended one; each test ran once, in the process its row names
    assert [job["returncode"] for job in results["jobs"]] == [gpu_tests.FAULT_EXIT, gpu_tests.FAULT_EXIT, 0]
    assert "kernel fault in" in results["jobs"][0]["tail"] and "test_b_faults" in results["jobs"][0]["tail"]
    rows = {n.split("::")[1]: r for n, r in results["tests"].items()}
    assert [rows[t]["process"] for t in ("test_a", "test_b_faults", "test_c", "test_f")] == [1, 1, 2, 3]
    assert "an ordinary failure" in rows["test_d_fails"]["error"]
    assert results["faults"] == [n for n in results["tests"] if "faults" in n]
    assert results["counts"] == dict(passed=3, fault=2, failed=1) and results["all_passed"] is False
    assert json.loads(path.read_text())["jobs"] == results["jobs"]  # the file holds the summary too


def test_a_clean_run_is_one_process_and_all_passed(tmp_path):
    path = tmp_path / "tests.json"
    results = gpu_tests.run_tests([_suite(tmp_path, "def test_one():\n    pass\n\ndef test_two():\n    pass\n")],
                                  path, budget_s=120, log=lambda *_: None)
    assert results["all_passed"] and results["processes"] == 1 and len(results["jobs"]) == 1
    assert results["jobs"][0]["returncode"] == 0


def test_a_crash_is_blamed_on_the_running_test(tmp_path):
    suite = _suite(tmp_path, "import os, signal\n\ndef test_ok():\n    pass\n\n"
                             "def test_crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n"
                             "def test_after():\n    pass\n")
    results = gpu_tests.run_tests([suite], tmp_path / "tests.json", budget_s=120, log=lambda *_: None)
    assert _status(results) == dict(test_ok="passed", test_crash="fault", test_after="passed")
    # by the test's own name: a node id may hold the temporary folder's, which is this test's
    assert "signal 11" in results["tests"][next(n for n in results["tests"] if n.endswith("::test_crash"))]["note"]


def test_a_process_past_the_budget_is_stopped_and_its_test_marked(tmp_path):
    suite = _suite(tmp_path, "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n")
    # just over the least left that starts a process: room for a loaded machine's imports before the
    # quick test, none for a second process after the first is stopped
    budget_s = gpu_tests.MIN_START_S + 1
    results = gpu_tests.run_tests([suite], tmp_path / "tests.json", budget_s=budget_s, log=lambda *_: None)
    assert _status(results) == dict(test_quick="passed", test_slow="failed")
    assert "time limit" in results["tests"][next(n for n in results["tests"] if n.endswith("::test_slow"))]["error"]
    assert results["jobs"][0]["returncode"] == -1 and len(results["jobs"]) == 1 and results["seconds"] < 70


def test_the_command_deselects_what_has_a_result(tmp_path):
    cmd = gpu_tests.tests_command(["tests/test_gpu.py"], tmp_path / "r.json", ["a::b[1-2]", "a::c"])
    assert cmd[cmd.index("--flashlib-tests-result") + 1] == str(tmp_path / "r.json")
    assert [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--deselect"] == ["a::b[1-2]", "a::c"]
    assert "flashlib.bench.gpu_tests" in cmd


def test_the_fault_tests_kernel_is_defined_in_a_file():
    """test_gpu.py's fault runs tests/gpu_fault_probe.py as a script: its kernel must decorate
    from a file (a kernel defined in a ``python -c`` string fails: Triton reads the source file)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).with_name("gpu_fault_probe.py")
    check = ("import runpy; ns = runpy.run_path(%r, run_name='probe'); k = ns['_stray_store']; "
             "print(type(k).__name__, 'tl.store' in k.src)" % str(probe))
    env = dict(os.environ, TRITON_INTERPRET="0")  # decorated as on a GPU, where the source file matters
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["JITFunction", "True"], done.stderr[-2000:]
    assert "gpu_fault_probe.py" in Path(__file__).with_name("test_gpu.py").read_text()
