"""Executing one notebook in this process, as a kernel would, and judging each cell as nbval does.

    python -m flashlib.bench.nbexec NOTEBOOK --result FILE [--device-dependent compare|report]

No Jupyter machinery (no kernel, no messages): IPython's shell runs the code cells in order
in one namespace, in the notebook's folder, with the repository on ``sys.path``;
``%matplotlib inline`` and ``display`` work as in a kernel, and a widget shows as its text.
What a cell writes to file descriptors 1 and 2, from Python, C code or child processes (as
ipykernel captures them), becomes its stdout and stderr; displays, results and errors become
outputs as a kernel sends them. Each cell is then judged against its stored outputs
(:mod:`flashlib.bench.nbcompare`) and the notebook's entry in FILE rewritten, after every
cell: a process stopped at its time limit still says which cells passed and which one ran.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .nbcompare import SANITIZE_CFG, cell_options, code_cells, compare_outputs, read_notebook, sanitize_patterns

ROOT = Path(__file__).resolve().parent.parent.parent
SHOWN_CHARS = 2000  # of a cell's new text outputs kept in the result, where they matter
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class FdText(io.TextIOBase):
    """sys.stdout or sys.stderr writing straight to a file descriptor, unbuffered, so that what
    Python prints and what C code or a child process writes there stay in order."""

    def __init__(self, fd: int):
        self._fd = fd

    encoding, errors = "utf-8", "replace"

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        data = text.encode(self.encoding, self.errors)
        while data:
            data = data[os.write(self._fd, data):]
        return len(text)

    def fileno(self):
        return self._fd

    def writable(self):
        return True

    def isatty(self):
        return False


@contextmanager
def captured_streams():
    """Within the block, file descriptors 1 and 2 go to temporary files; after it, the yielded
    dict holds their texts as {"stdout": ..., "stderr": ...}."""
    files = {"stdout": tempfile.TemporaryFile(), "stderr": tempfile.TemporaryFile()}
    fds = {"stdout": 1, "stderr": 2}
    saved = {name: os.dup(fd) for name, fd in fds.items()}
    texts = {}
    try:
        for name, fd in fds.items():
            os.dup2(files[name].fileno(), fd)
        yield texts
    finally:
        for name, fd in fds.items():
            os.dup2(saved[name], fd)
            os.close(saved[name])
            files[name].seek(0)
            texts[name] = files[name].read().decode("utf-8", "replace")
            files[name].close()


def make_shell(sink: list):
    """An IPython shell whose displays, results and errors are appended to sink as notebook
    outputs (what ipykernel would send), instead of being printed."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets import Type
    from traitlets.config import Config

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, *args, update=False, **kwargs):
            if not update:  # nbval leaves out updates of an earlier display
                sink.append(dict(output_type="display_data", data=data, metadata=metadata or {}))

        def clear_output(self, wait=False):
            """nbval keeps what a cell showed before it cleared its output: so does this."""

    class ResultHook(DisplayHook):
        def write_output_prompt(self):
            """A kernel sends the result without a prompt."""

        def write_format_data(self, format_dict, md_dict=None):
            sink.append(dict(output_type="execute_result", data=format_dict, metadata=md_dict or {}))

    class CellShell(InteractiveShell):
        displayhook_class = Type(ResultHook)
        display_pub_class = Type(Publisher)

        def enable_gui(self, gui=None):
            """The inline backend (``%matplotlib inline``) needs no event loop; nothing else is shown here."""
            if gui not in (None, "inline"):
                raise ValueError(f"enable_gui: only the inline backend runs here, got gui {gui!r}; "
                                 "use %matplotlib inline")

        def _showtraceback(self, etype, evalue, stb):
            sink.append(dict(output_type="error", ename=etype.__name__, evalue=str(evalue),
                             traceback=[_ANSI.sub("", line) for line in stb]))

    config = Config()
    config.HistoryManager.enabled = False
    return CellShell.instance(config=config)


def run_cell(shell, source: str, sink: list) -> list[dict]:
    """Execute one cell; its outputs in the order a kernel sends them (streams first, then the rest)."""
    sink.clear()
    with captured_streams() as texts:
        # as nbval sends it: not stored in the history, so a trailing ';' hides no result
        shell.run_cell(source, store_history=False)
    streams = [dict(output_type="stream", name=name, text=text) for name, text in texts.items() if text]
    return streams + list(sink)


def shown(outputs) -> str:
    """The text of new outputs (streams, text/plain, errors), cut to SHOWN_CHARS, for the result."""
    parts = []
    for o in outputs:
        if o["output_type"] == "stream":
            parts.append(o["text"])
        elif o["output_type"] == "error":
            parts.append(f"{o['ename']}: {o['evalue']}\n")
        elif "text/plain" in o.get("data", {}):
            parts.append(str(o["data"]["text/plain"]) + "\n")
    text = "".join(parts)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def verdict(cell: dict, options: dict, outputs: list[dict], patterns, device_dependent: str = "compare") -> dict:
    """What nbval would say of the cell's new outputs: passed, failed (an exception, or a stored
    cell that has outputs but never ran) or differed; "not compared" for a device-dependent cell
    when device_dependent is "report"."""
    errors = [o for o in outputs if o["output_type"] == "error"]
    if errors and not options["check_exception"]:
        tail = "\n".join(errors[0]["traceback"])[-SHOWN_CHARS:]
        return dict(status="failed", error=f"{errors[0]['ename']}: {errors[0]['evalue']}", traceback=tail,
                    outputs=shown(outputs))
    if cell.get("execution_count") is None:
        if cell.get("outputs"):
            return dict(status="failed", error="Unrun reference cell has outputs")
        return dict(status="passed", note="never run in the stored notebook: not compared")
    if not options["check"]:
        return dict(status="passed", note="output not compared (NBVAL_IGNORE_OUTPUT)", outputs=shown(outputs))
    difference = compare_outputs(outputs, cell.get("outputs", []), patterns)
    if options["device_dependent"] and device_dependent == "report":
        return dict(status="not compared", note="DEVICE_DEPENDENT_OUTPUT", would_differ=difference,
                    outputs=shown(outputs))
    if difference is None:
        return dict(status="passed")
    return dict(status="differed", difference=difference[:2 * SHOWN_CHARS], outputs=shown(outputs))


def write_entry(path, entry: dict) -> None:
    """Put one notebook's entry into the results file at path (replacing its earlier one), atomically."""
    path = Path(path)
    results = json.loads(path.read_text()) if path.exists() else {"notebooks": []}
    others = [e for e in results.get("notebooks", []) if e.get("notebook") != entry["notebook"]]
    results["notebooks"] = others + [entry]
    results["notebooks"].sort(key=lambda e: e.get("order", 0))
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, default=str) + "\n")
    temporary.replace(path)


def notebook_status(cells: list[dict]) -> str:
    """"passed" when every cell passed, was skipped or not compared; else "failed"."""
    bad = [c for c in cells if c["status"] in ("failed", "differed", "running")]
    return "failed" if bad else "passed"


def _first_line(source: str) -> str:
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return (lines[0] if lines else source.strip().splitlines()[0] if source.strip() else "")[:120]


def _execute_cells(shell, sink, cells, entry, result_path, patterns, device_dependent) -> None:
    for number, (index, cell) in enumerate(cells):
        options = cell_options(cell)
        row = dict(cell=number, index=index, line=_first_line(cell["source"]), status="running")
        entry["cells"].append(row)
        if options["skip"]:
            row.update(status="skipped", note="NBVAL_SKIP")
            continue
        write_entry(result_path, entry)  # a stop during this cell leaves it marked "running"
        began = time.perf_counter()
        outputs = run_cell(shell, cell["source"], sink)
        row.update(verdict(cell, options, outputs, patterns, device_dependent),
                   seconds=round(time.perf_counter() - began, 2))
        write_entry(result_path, entry)


def run_notebook(path, result_path, *, device_dependent: str = "compare", sanitize=SANITIZE_CFG,
                 order: int = 0) -> dict:
    """Execute the notebook at path cell by cell and judge each cell; returns its entry (also in
    result_path). Changes this process's working directory, sys.path and sys.stdout/err."""
    if device_dependent not in ("compare", "report"):
        raise ValueError(f"run_notebook: argument 'device_dependent' must be 'compare' or 'report', "
                         f"got {device_dependent!r}")
    path = Path(path).resolve()
    cells = code_cells(read_notebook(path))
    entry = dict(notebook=path.name, order=order, status="running", cells=[], python=sys.version.split()[0])
    write_entry(result_path, entry)
    began = time.perf_counter()
    try:
        from IPython import __version__ as ipython_version

        sink: list = []
        shell = make_shell(sink)
        entry["ipython"] = ipython_version
    except ImportError as exc:
        entry.update(status="not run", error=f"{type(exc).__name__}: {exc}; the notebooks need IPython and "
                     "ipywidgets (make gpu-check installs the wheels carried in .whl/)")
        write_entry(result_path, entry)
        return entry
    os.chdir(path.parent)
    sys.path[:0] = [str(path.parent), str(ROOT)]
    sys.stdout, sys.stderr = FdText(1), FdText(2)
    _execute_cells(shell, sink, cells, entry, result_path, sanitize_patterns(sanitize), device_dependent)
    entry.update(status=notebook_status(entry["cells"]), seconds=round(time.perf_counter() - began, 1))
    write_entry(result_path, entry)
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.nbexec", description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--result", required=True, help="JSON file holding every notebook's entry")
    parser.add_argument("--device-dependent", choices=("compare", "report"), default="compare",
                        help="compare cells marked DEVICE_DEPENDENT_OUTPUT (as nbval does), or only report them")
    parser.add_argument("--order", type=int, default=0, help="the notebook's place in the course")
    args = parser.parse_args(argv)
    entry = run_notebook(args.notebook, args.result, device_dependent=args.device_dependent, order=args.order)
    return 0 if entry["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
