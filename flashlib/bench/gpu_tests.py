"""The GPU tests, run so that one kernel fault costs one test, not every test after it.

    python -m pytest tests/test_gpu.py -p flashlib.bench.gpu_tests --flashlib-tests-result FILE

A kernel that faults (an illegal address, say) leaves its process's GPU unusable: every later
CUDA call fails. This plugin asks the device after each test whether it is still usable; when
it is not, it records that test as the one that faulted and stops the session at once, naming
it. :func:`run_tests` then starts pytest again in a fresh process with every test that already
has a result deselected, until all have one, the budget is spent or ``MAX_PROCESSES`` ran.

FILE holds one row per test (``passed``, ``failed``, ``skipped``, ``fault``) with its seconds
and, for a failure, the end of its report; it is rewritten after each test, so a process
stopped at its time limit still says what ran and what was running.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from . import processes

FAULT_EXIT = 3         # pytest's exit status when this plugin stopped a session after a fault
MAX_PROCESSES = 6      # fresh processes at most: each fault costs one, and its compiling again
MIN_START_S = 20.0     # below this left, no fresh process is started
SHOWN_CHARS = 1500     # of a failed test's report kept in its row


def read_rows(path) -> dict:
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {"tests": {}}


def _write(path, results: dict) -> None:
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, default=str) + "\n")
    temporary.replace(path)


def pytest_addoption(parser):
    parser.getgroup("flashlib").addoption("--flashlib-tests-result", default=None,
                                          help="JSON file for each test's outcome (rewritten after each test)")


class Recorder:
    """Each test's outcome, written as it ends; a lost device ends the session."""

    def __init__(self, path):
        self.path = Path(path)
        self.results = read_rows(self.path)
        self.process = self.results.setdefault("processes", 0) + 1
        self.results["processes"] = self.process

    def _save(self):
        _write(self.path, self.results)

    def pytest_runtest_logstart(self, nodeid, location):
        self.results["tests"][nodeid] = dict(status="running", process=self.process)
        self._save()

    def pytest_runtest_logreport(self, report):
        row = self.results["tests"].setdefault(report.nodeid, dict(status="running", process=self.process))
        row["seconds"] = round(row.get("seconds", 0.0) + report.duration, 2)
        if report.failed:
            row.update(status="failed", error=report.longreprtext[-SHOWN_CHARS:], phase=report.when)
        elif report.skipped and row["status"] == "running":
            row["status"] = "skipped"
        elif report.when == "call" and report.passed:
            row["status"] = "passed"
        self._save()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        row = self.results["tests"].get(item.nodeid, {})
        if row.get("status") == "running":  # teardown passed after a setup that passed: no call ran
            row["status"] = "passed"
        if device_lost():
            row.update(status="fault", note="the device was unusable after this test: a kernel fault")
            self._save()
            pytest.exit(f"kernel fault in {item.nodeid}: the device is unusable in this process",
                        returncode=FAULT_EXIT)
        self._save()


def device_lost() -> bool:
    """Has a kernel left this process's GPU unusable? (False where CUDA never started.)"""
    if "torch" not in sys.modules:
        return False
    import torch

    from .point import device_usable

    return torch.cuda.is_available() and torch.cuda.is_initialized() and not device_usable()


def pytest_configure(config):
    if config.getoption("flashlib_tests_result"):
        config.pluginmanager.register(Recorder(config.getoption("flashlib_tests_result")), "flashlib-gpu-tests")


def tests_command(tests, result_path, done=()) -> list:
    """pytest on tests with this plugin, every test of done deselected (they have a result)."""
    cmd = [sys.executable, "-m", "pytest", *map(str, tests), "-q", "-p", "no:cacheprovider", "-p",
           "flashlib.bench.gpu_tests", "--flashlib-tests-result", str(result_path), "--durations=12"]
    for nodeid in done:
        cmd += ["--deselect", nodeid]
    return cmd


def summarize(results: dict) -> dict:
    """Counts per status, the tests that faulted, and whether every test passed in one process."""
    rows = results.get("tests", {})
    counts: dict[str, int] = {}
    for row in rows.values():
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    faults = [nodeid for nodeid, row in rows.items() if row["status"] == "fault"]
    bad = {"failed", "fault", "running"}
    return dict(counts=counts, faults=faults, processes=results.get("processes", 0),
                all_passed=bool(rows) and not any(row["status"] in bad for row in rows.values()))


def _blame_running(result_path, returncode) -> bool:
    """After a process died of a signal: mark the test it was running as the fault; False if none ran."""
    results = read_rows(result_path)
    running = [row for row in results["tests"].values() if row["status"] == "running"]
    for row in running:
        row.update(status="fault", note=f"the process died of signal {-returncode} during this test")
    _write(result_path, results)
    return bool(running)


def run_tests(tests, result_path, *, budget_s: float, clock=time.perf_counter, start=None, finish=None,
              log=print) -> dict:
    """The tests in as few processes as faults allow, within budget_s; the results (also in
    result_path) with each process's exit status and output tail under ``jobs``."""
    start, finish = start or processes.start, finish or processes.finish
    result_path = Path(result_path)
    result_path.unlink(missing_ok=True)  # an earlier run's rows would read as this one's
    began, jobs = clock(), []
    while len(jobs) < MAX_PROCESSES:
        left = budget_s - (clock() - began)
        done = [nodeid for nodeid, row in read_rows(result_path)["tests"].items() if row["status"] != "running"]
        if left < MIN_START_S:
            break
        job = finish(start(tests_command(tests, result_path, done), left), log=log)
        jobs.append({k: job[k] for k in ("returncode", "seconds", "summary", "tail")})
        if job["returncode"] < -1 and _blame_running(result_path, job["returncode"]):
            pass  # killed by a signal (a crash) inside a test: that test is blamed, the rest go on
        elif job["returncode"] != FAULT_EXIT:  # finished (passed or failed) or stopped at its limit
            break
        log(f"process {len(jobs)} ended after a fault (exit {job['returncode']}): the tests left run in a fresh one")
    results = read_rows(result_path)
    if jobs and jobs[-1]["returncode"] == -1:  # stopped at the limit: the running test did not finish
        for row in results["tests"].values():
            if row["status"] == "running":
                row.update(status="failed", error=f"stopped at the time limit ({budget_s:.0f} s)")
    results.update(jobs=jobs, seconds=round(clock() - began, 1), **summarize(results))
    _write(result_path, results)
    return results
