"""A pytest plugin beside nbval: one notebook's results, cell by cell, in the course's results file.

    python -m pytest NOTEBOOK --nbval --nbval-current-env -p flashlib.bench.nbval_results \
        --flashlib-result FILE [--flashlib-order N] [--flashlib-device-dependent compare|report]

nbval runs the notebook in a fresh kernel and judges each cell against its stored outputs, as
CI does; this plugin only writes what nbval said into FILE, the notebook's entry rewritten as
each cell starts and ends, so that a process stopped at its time limit still says which cells
passed and which one was running. Statuses: passed, failed (an exception), differed (outputs
not as stored), skipped (``NBVAL_SKIP``), not compared.

One marker of this project's own: the cell tag ``device-dependent-output`` says that the cell's
output depends on the device (a GPU, or the Triton release that compiles for it). nbval does not
know it, so CI compares such a cell as any other, and its CPU output must be the same on every
CPU. With ``--flashlib-device-dependent report`` (the GPU check) such a cell is run but not
compared: its new output is recorded, with what nbval would have said of it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from pathlib import Path

import pytest

DEVICE_TAG = "device-dependent-output"
SHOWN_CHARS = 2000  # of a cell's new text outputs kept in the result, where they matter
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock beside path: notebooks run side by side, in processes of their own,
    each rewriting the one results file; without it, one's read-modify-write loses another's entry."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_entry(path, entry: dict) -> None:
    """Put one notebook's entry into the results file at path (replacing its earlier one), atomically."""
    path = Path(path)
    with _locked(path):
        results = json.loads(path.read_text()) if path.exists() else {"notebooks": []}
        others = [e for e in results.get("notebooks", []) if e.get("notebook") != entry["notebook"]]
        results["notebooks"] = sorted(others + [entry], key=lambda e: e.get("order", 0))
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(results, indent=1, default=str) + "\n")
        temporary.replace(path)


def notebook_status(cells: list[dict]) -> str:
    """"passed" when every cell passed, was skipped or not compared; else "failed"."""
    return "failed" if any(c["status"] in ("failed", "differed", "running") for c in cells) else "passed"


def first_line(source: str) -> str:
    """A cell's first line of code (comments and blank lines skipped), to name it in a report."""
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return (lines[0] if lines else source.strip().splitlines()[0] if source.strip() else "")[:120]


def text_of(outputs) -> str:
    """The text a cell's outputs show: streams, plain-text results and errors."""
    parts = []
    for out in outputs or []:
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
        elif "text/plain" in out.get("data", {}):
            parts.append(out["data"]["text/plain"] + "\n")
    return "".join(parts)[:SHOWN_CHARS]


def pytest_addoption(parser):
    group = parser.getgroup("flashlib", "the course's results file")
    group.addoption("--flashlib-result", default=None, help="JSON file for the notebook's entry (rewritten per cell)")
    group.addoption("--flashlib-order", type=int, default=0, help="the notebook's place in the course")
    group.addoption("--flashlib-device-dependent", choices=("compare", "report"), default="compare",
                    help=f"compare cells tagged {DEVICE_TAG} (as CI does), or run them and only report their output")


def _cells(items):
    return [item for item in items if hasattr(item, "cell_num") and hasattr(item, "cell")]


class Recorder:
    """The entries of the notebooks this session runs, written after each cell's start and end."""

    def __init__(self, config):
        self.path = Path(config.getoption("flashlib_result"))
        self.order = config.getoption("flashlib_order")
        self.report_device_dependent = config.getoption("flashlib_device_dependent") == "report"
        self.entries, self.rows, self.began = {}, {}, {}

    def entry_of(self, item) -> dict:
        name = Path(str(item.parent.fspath)).name
        if name not in self.entries:
            self.entries[name] = dict(notebook=name, order=self.order + len(self.entries), status="running",
                                      cells=[], started=time.time())
        return self.entries[name]

    def save(self, entry):
        entry["seconds"] = round(time.time() - entry["started"], 1)
        write_entry(self.path, {k: v for k, v in entry.items() if k != "started"})

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in _cells(items):
            tagged = DEVICE_TAG in item.cell.get("metadata", {}).get("tags", [])
            item.flashlib_unchecked = tagged and self.report_device_dependent and item.options["check"]
            if item.flashlib_unchecked:
                item.options["check"] = False  # run it, record its output, compare nothing

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if not hasattr(item, "cell_num") or report.when not in ("setup", "call"):
            return
        entry = self.entry_of(item)
        cells = item.parent.nb.cells
        key = (str(item.parent.fspath), item.cell_num)  # nbval's cells may share a nodeid across notebooks
        row = self.rows.setdefault(key, dict(
            cell=item.cell_num, index=next(i for i, c in enumerate(cells) if c is item.cell),
            line=first_line(item.cell.source), status="running"))
        if row not in entry["cells"]:
            entry["cells"].append(row)
        if report.when == "setup" and report.passed:
            self.began[key] = time.perf_counter()
            self.save(entry)  # a stop during this cell leaves it marked "running"
            return
        row.update(self._verdict(item, report))
        row["seconds"] = round(time.perf_counter() - self.began.get(key, time.perf_counter()), 2)
        self.save(entry)

    def _verdict(self, item, report) -> dict:
        outputs = item.test_outputs or []
        if report.skipped:
            return dict(status="skipped", note="NBVAL_SKIP")
        if report.failed:
            text = _ANSI.sub("", report.longreprtext)
            errors = [o for o in outputs if o.get("output_type") == "error"]
            if "Cell outputs differ" in text:
                return dict(status="differed", difference=text[text.find("Cell outputs differ"):][:SHOWN_CHARS],
                            outputs=text_of(outputs))
            if errors:
                return dict(status="failed", error=f"{errors[-1]['ename']}: {errors[-1]['evalue']}",
                            traceback=_ANSI.sub("", "\n".join(errors[-1].get("traceback", [])))[-SHOWN_CHARS:])
            return dict(status="failed", error=text[-SHOWN_CHARS:])
        if getattr(item, "flashlib_unchecked", False):
            verdict = dict(status="not compared", outputs=text_of(outputs),
                           note=f"output not compared (tag {DEVICE_TAG})")
            if item.cell.execution_count is not None:
                from nbval.plugin import coalesce_streams

                if not item.compare_outputs(outputs, coalesce_streams(item.cell.outputs)):
                    verdict["would_differ"] = _ANSI.sub("", "\n".join(item.comparison_traceback))[:SHOWN_CHARS]
            return verdict
        if not item.options["check"]:  # NBVAL_IGNORE_OUTPUT: timings and the like, worth reading on a GPU
            return dict(status="passed", outputs=text_of(outputs), note="output not compared (NBVAL_IGNORE_OUTPUT)")
        return dict(status="passed")

    def pytest_sessionfinish(self, session):
        for entry in self.entries.values():
            entry["status"] = notebook_status(entry["cells"])
            self.save(entry)


def pytest_configure(config):
    if config.getoption("flashlib_result"):
        config.pluginmanager.register(Recorder(config), "flashlib-results")
