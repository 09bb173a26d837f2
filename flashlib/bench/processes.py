"""Child processes of the GPU check: started beside other work, stopped at their time limit.

A child's output goes to a file, not a pipe: a pipe nobody reads while the parent compiles
or measures could fill up and stall the child. Every child imports flashlib from this
checkout (the repository first on PYTHONPATH), with the machine's own packages.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TAIL_CHARS = 6000  # of a child's output kept in the report


def with_root_on_path(env=None) -> dict:
    """The environment (default this process's) with the repository first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def start(cmd, timeout_s: float, *, env=None, cwd=ROOT) -> dict:
    """Start cmd and return at once; :func:`finish` waits for it until timeout_s after its start.
    The child leads a process group of its own, so that stopping it stops what it started too
    (a notebook's compiler or worker processes, say), which would otherwise go on using the GPU."""
    output = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True,
                            env=with_root_on_path(env), cwd=cwd, start_new_session=True)
    return dict(proc=proc, output=output, start=time.perf_counter(), timeout_s=timeout_s)


def _stop(proc) -> None:
    """Kill the child and every process of its group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    proc.wait()


def finish(started: dict, log=print) -> dict:
    """Wait for a started child (killed at its time limit); its exit status, the last line of its
    output (``summary``), its seconds and the tail of its output (also logged)."""
    proc, output = started["proc"], started["output"]
    try:
        proc.wait(timeout=max(0.0, started["timeout_s"] - (time.perf_counter() - started["start"])))
        code, note = proc.returncode, ""
    except subprocess.TimeoutExpired:
        _stop(proc)
        code, note = -1, f"\ntimed out after {started['timeout_s']:.0f} s"
    output.seek(0)
    out = output.read() + note
    output.close()
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    log(out[-TAIL_CHARS:])
    return dict(returncode=code, summary=summary, seconds=round(time.perf_counter() - started["start"], 1),
                tail=out[-TAIL_CHARS:])
