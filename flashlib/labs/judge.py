"""The judge: runs the checkers, in a process that runs no student code, and owns every verdict.

A worker (:class:`Worker`) is one warm student process (:mod:`.zygote`), sandboxed where the machine can
(:mod:`.sandbox`), that forks a child per graded cell. The child runs the cell; every checker it calls is a
stub that sends the arguments here. The judge runs the course's own checker on them (:func:`assess_lab`,
:func:`assess_exercise`); an answer that is a function stays in the child and is called there
(:mod:`.remote`). A cell is graded on the first answer it gives to the checker of the lab or exercise it is
graded as; nothing it prints, writes or sends otherwise is a verdict.

:func:`assess_lab` and :func:`assess_exercise` are the library's way to run a checker on an answer and get
its verdict, the mistake it named and its whole message, whatever process the answer lives in.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import own_code
from ..course import wire
from ..course.remote import Link, RemoteGone
from .sandbox import COURSE, Sandbox
from .zygote import CHECKER_MODULES

_OUT_OF_MEMORY = ("MemoryError", "can't allocate memory", "out of memory", "Cannot allocate memory")
START_S = 300  # seconds a worker may take to import what the cells need
GRACE_S = 60  # beyond a cell's own limit, for the worker to clean up and report


@dataclass(frozen=True)
class Assessment:
    """A checker's verdict on one answer: passed, the whole message it printed, the mistake it named."""

    passed: bool
    message: str
    mistake: str | None = None


class _Output(io.TextIOBase):
    """sys.stdout for the judge: what a checker prints goes to the thread's own buffer while it is assessed."""

    def __init__(self, real):
        self.real, self.local = real, threading.local()

    def write(self, text: str) -> int:
        buffer = getattr(self.local, "buffer", None)
        return (buffer or self.real).write(text)

    def flush(self) -> None:
        (getattr(self.local, "buffer", None) or self.real).flush()


_LOCK = threading.Lock()


@contextlib.contextmanager
def _captured():
    """What this thread prints meanwhile, in a buffer (other threads print as before)."""
    with _LOCK:
        if not isinstance(sys.stdout, _Output):
            sys.stdout = _Output(sys.stdout)
        out = sys.stdout
    buffer = io.StringIO()
    out.local.buffer = buffer
    try:
        yield buffer
    finally:
        out.local.buffer = None


def assess_lab(name: str, fn, source: str | None = None) -> Assessment:
    """The checker of lab ``name`` on the answer ``fn`` (local, or a :class:`~.remote.Remote`); ``source``, the
    cell's code, is looked at for a copy of the course's own code (compiled, never run)."""
    from .catalog import LABS
    from .core import _refused, verdict

    if source is not None and name in LABS:
        copy = own_code.copied(source, LABS[name].answers)
        if copy is not None:
            result = _refused(name, copy, "course_code")
            return Assessment(False, result.message, result.mistake)
    result = verdict(name, fn, solutions=False)  # the students have the student edition
    return Assessment(result.passed, result.message, result.mistake)


def assess_exercise(module: str, name: str, args=(), kwargs=None) -> Assessment:
    """The checker ``module.check_<name>`` on the answer ``args`` (functions in them local or remote): passed,
    what it printed (or the verdict it returned shows), no mistake key."""
    from ..course import exercises

    checker = getattr(importlib.import_module(module), f"check_{name}")
    exercises.HintSteps.reset_all()  # each answer starts from the first hint, whoever was checked before
    with _captured() as printed:
        result = checker(*args, **(kwargs or {}))
    message = printed.getvalue().strip()
    if not isinstance(result, bool) and result is not None and hasattr(result, "message"):
        message = "\n".join(filter(None, (message, repr(result))))  # a Verdict shows itself
    return Assessment(bool(result), message)


@dataclass
class Outcome:
    """What became of one graded cell: ``status`` "graded", or "error" when the grader could not grade it."""

    passed: bool
    message: str
    mistake: str | None = None
    status: str = "graded"
    seconds: float = 0.0
    printed: str = ""


@dataclass(frozen=True)
class Cell:
    """One graded cell: the item it is graded as, its source, the imports of the cells before it, its notebook."""

    kind: str  # "lab" or "exercise"
    name: str
    source: str
    imports: str
    notebook_name: str
    notebook_text: str
    module: str | None = None  # an exercise's checker's module, where the course's notebook names it
    arity: tuple[int, tuple[str, ...]] | None = None  # (positional arguments, keywords) the course's cell passes


class Hearing:
    """The judge's side of one cell: answers its checks, keeps the first verdict for the item graded."""

    def __init__(self, cell: Cell, memory_mib: float = 0):
        self.cell, self.first, self.others, self.memory_mib = cell, None, set(), memory_mib
        self.raised = self.gone = self.internal = None
        self.printed = ""

    def serve(self, link: Link) -> None:
        while True:
            try:
                message = link.receive()
                if message.get("op") == "done":
                    self.raised, self.printed = message.get("raised"), str(message.get("printed") or "")
                    return
                if message.get("op") != "check":
                    self.gone = f"the cell's process sent {message.get('op')!r} where a check was expected"
                    return
                link.send({"op": "verdict", **self._check(message)})
            except RemoteGone as gone:
                self.gone = str(gone)
                return

    def _check(self, message: dict) -> dict:
        kind, name, module = message.get("kind"), message.get("name"), message.get("module")
        cell = self.cell
        # an exercise's checker only from the course's checker modules (and the one the course's cell names)
        foreign = kind == "exercise" and (module not in CHECKER_MODULES or cell.module not in (None, module))
        if (kind, name) != (cell.kind, cell.name) or foreign:
            self.others.add(str(name))
            return dict(passed=False, message=f"(the grader checks {cell.name} in this cell, not {name})")
        again = self.first is not None
        if not again:
            self.first = self._assess(message)
        note = "\n(graded on this cell's first answer, above)" if again else ""
        return dict(passed=self.first.passed, message=self.first.message + note, mistake=self.first.mistake)

    def _assess(self, message: dict) -> Assessment:
        args, kwargs = tuple(message.get("args") or ()), dict(message.get("kwargs") or {})
        try:
            if self.cell.kind == "lab":
                return assess_lab(self.cell.name, args[0] if args else None, self.cell.source)
            if self.cell.arity is not None:  # the question the course's cell asks: no more, no other
                count, names = self.cell.arity
                args, kwargs = args[:count], {k: v for k, v in kwargs.items() if k in names}
            return assess_exercise(message.get("module"), self.cell.name, args, kwargs)
        except RemoteGone:
            raise
        except Exception:  # noqa: BLE001  the judge's own failure: this cell is not graded
            self.internal = traceback.format_exc(limit=-4)
            return Assessment(False, "the grader could not check this answer (an error in the grader)")

    def outcome(self, end: dict | None) -> Outcome:
        name = self.cell.name
        if self.internal is not None:
            return Outcome(False, f"not graded: the checker of {name} failed: {self.internal.strip().splitlines()[-1]}",
                           status="error", printed=self.internal)
        if self.first is not None:
            return Outcome(self.first.passed, self.first.message, self.first.mistake, printed=self.printed)
        stopped = (end or {}).get("stopped")
        if stopped:
            return Outcome(False, stopped, printed=self.printed)
        if self.raised and any(clue in self.raised for clue in _OUT_OF_MEMORY):
            return Outcome(False, f"the cell used more than {self.memory_mib:.0f} MiB of memory ({self.raised[:200]})",
                           printed=self.printed)
        if self.raised:
            return Outcome(False, f"the cell raised {self.raised}", printed=self.printed)
        if self.others:
            return Outcome(False, f"the cell ran the checker of {', '.join(sorted(self.others))}, not of {name}: no "
                                  f"credit for {name}", printed=self.printed)
        if self.gone is not None and (end or {}).get("status") not in (0, None):
            return Outcome(False, f"the cell's process ended (exit status {end.get('status')}) before a checker of "
                                  f"{name} ran", printed=self.printed)
        return Outcome(False, f"no checker of {name} ran (a printed PASS is not a verdict)", printed=self.printed)


class Worker:
    """One warm student process, sandboxed where the machine can, that runs one cell at a time."""

    def __init__(self, sandbox: Sandbox, package_dir: Path, preload=(), env: dict | None = None):
        self.sandbox, self.package_dir, self.preload, self.extra_env = sandbox, package_dir, tuple(preload), env or {}
        self.proc = self.control = None
        self.scratch = None

    def _environment(self) -> dict:
        inside_tmp = "/tmp" if self.sandbox.sandboxed else str(Path(self.scratch.name) / "tmp")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": inside_tmp, "TMPDIR": inside_tmp,
               "MPLBACKEND": "Agg", "FLASHLIB_PROGRESS": "off", "TQDM_DISABLE": "1", "PYTHONHASHSEED": "0",
               "TRITON_CACHE_DIR": f"{inside_tmp}/triton", "FLASHLIB_SANDBOXED": "1" if self.sandbox.sandboxed else "0",
               "FLASHLIB_CELL_ROOT": str(Path(self.scratch.name) / "work")}
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if key in os.environ:
                env[key] = os.environ[key]
        env.setdefault("OMP_NUM_THREADS", "1")
        return {**env, **self.extra_env}

    def start(self) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix="flashlib-worker-")
        for sub in ("tmp", "work"):
            (Path(self.scratch.name) / sub).mkdir()
        mine, theirs = socket.socketpair()
        course = COURSE if self.sandbox.sandboxed else str(self.package_dir)
        boot = (f"import sys; sys.path.insert(0, {course!r}); from flashlib.labs.zygote import main; "
                f"sys.exit(main({theirs.fileno()}))")
        command = [*(self.sandbox.prefix or ()), sys.executable, "-I", "-c", boot]
        self.log = open(Path(self.scratch.name) / "worker.log", "w+b")
        self.proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=self._environment(),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     cwd=Path(self.scratch.name) / "work", start_new_session=True)
        theirs.close()
        self.control = mine
        self.control.settimeout(START_S)
        wire.send(self.control, {"op": "hello", "preload": self.preload})
        try:
            ready = wire.receive(self.control)
        except (EOFError, OSError, wire.WireError) as error:
            self.stop()
            log = self._stderr()
            self.stop()
            raise RuntimeError(f"the grader's worker did not start ({error}): {log}") from None
        if ready.get("op") != "ready":
            self.stop()
            raise RuntimeError(f"the grader's worker said {ready.get('op')!r} instead of ready")

    def _stderr(self) -> str:
        try:
            self.log.seek(0)
            return self.log.read().decode(errors="replace")[-1500:]
        except (OSError, ValueError, AttributeError):
            return ""

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()
            self.proc = None
            self.log.close()
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None

    def grade(self, cell: Cell, timeout: float, memory_mib: float) -> Outcome:
        """Run one graded cell in a fresh child of the worker and judge its checks."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        start = time.perf_counter()
        hearing = Hearing(cell, memory_mib)
        try:
            end = self._run(cell, hearing, timeout, memory_mib)
        except (EOFError, OSError, wire.WireError) as error:
            self.stop()  # the worker itself failed: the next cell gets a fresh one
            return Outcome(False, f"not graded: the grader's worker failed ({error})", status="error",
                           seconds=time.perf_counter() - start)
        outcome = hearing.outcome(end)
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _run(self, cell: Cell, hearing: Hearing, timeout: float, memory_mib: float) -> dict:
        self.control.settimeout(timeout + GRACE_S)
        wire.send(self.control, {"op": "cell", "name": cell.name, "source": cell.source, "imports": cell.imports,
                                 "notebook": cell.notebook_text, "notebook_name": cell.notebook_name,
                                 "timeout": float(timeout), "memory_mib": float(memory_mib)})
        _, fds, _, _ = socket.recv_fds(self.control, 1, 1)
        if not fds:
            raise EOFError("the worker sent no channel for the cell")
        with socket.socket(fileno=fds[0]) as channel:
            channel.settimeout(timeout + GRACE_S)
            hearing.serve(Link(channel))
        end = wire.receive(self.control)
        if end.get("op") != "end":
            raise wire.WireError(f"the worker said {end.get('op')!r} where a cell's end was expected")
        return end
