"""The student's side of the grader: a warm process that forks one child per graded cell.

The grader (:mod:`.grade`) starts one of these per worker, inside a bubblewrap sandbox where the machine
has one (:mod:`.sandbox`), with the student edition of the package. It imports Python, torch, the course's
package and what the course's notebooks import, once; then, for each cell the judge sends, it writes the
cell's notebook into an empty folder and forks. The child runs the imports of the notebook's earlier cells
and the cell itself, with every checker replaced by a stub that sends its arguments to the judge
(:mod:`.judge`) and prints the verdict the judge sends back; while the judge checks, the child serves its
requests (:mod:`.remote`): calls of the student's functions, with the watches that must run beside them.
The child talks to the judge over a socket of its own, which this process hands the judge.

This process runs no student code. In the sandbox it is the pid namespace's init, which no process of a
cell can kill, stop or trace (nor read its memory: it is not dumpable). When the child ends, or passes
its time or memory limit, every other process of the sandbox ends with it (``kill(-1)``; without a
sandbox, every descendant of this process, a subreaper), the cell's folder and /tmp are emptied, and the
judge is told why the cell ended. Memory is counted over every process of the cell (private pages, which a fork shares
until written).
"""
from __future__ import annotations

import ctypes
import importlib
import io
import os
import resource
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from ..course import wire

CHECKER_MODULES = ("flashlib.course.exercises", "flashlib.course.kernel_exercises", "flashlib.course.perf_exercises",
                   "flashlib.course.score_exercises", "flashlib.course.variant_exercises", "flashlib.course.inference",
                   "flashlib.course.ring", "flashlib.course.serving")
WORK = Path("/work") if os.environ.get("FLASHLIB_SANDBOXED") == "1" else None
POLL_S = 0.05
_PRINTED = 4000  # characters of what the cell printed, kept for the judge's record
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to set
        pass


def _preload(modules) -> None:
    """Import what the cells will: the course's package, its checkers, what the notebooks import."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  what a checker's dispatch mode imports on first use
    import flashlib  # noqa: F401
    from flashlib import labs  # noqa: F401  switches on Triton's interpreter on a CPU, before triton
    from flashlib.labs import own_code

    for name in (*CHECKER_MODULES, "flashlib.labs.tiled_labs", "flashlib.labs.softmax_labs",
                 "flashlib.labs.split_kv_lab", "flashlib.labs.sink_lab", "flashlib.labs.kernel_labs", *modules):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  what cannot be imported here fails in the cell, as it would there
            pass
    own_code.course_shapes()  # computed once, before the forks


class Student:
    """The child's end of its channel: sends checks to the judge and serves its requests meanwhile."""

    def __init__(self, sock):
        self.sock, self.held = sock, {}

    def hold(self, fn) -> dict:
        self.held[len(self.held) + 1] = fn
        try:
            text = repr(fn)[:200]
        except Exception:  # noqa: BLE001  a repr of the student's that raises
            text = f"<{type(fn).__name__}>"
        return {"__fn__": len(self.held), "type": type(fn).__name__, "text": text}

    def resolve(self, tree: dict):
        handle = tree["__fn__"]
        if handle not in self.held:
            raise wire.WireError(f"no function {handle} is held here")
        return self.held[handle]

    def ask(self, request: dict) -> dict:
        """Send a check to the judge; serve its requests until its verdict comes."""
        wire.send(self.sock, request, self.hold)
        while True:
            message = wire.receive(self.sock, self.resolve)
            if message.get("op") == "verdict":
                return message
            wire.send(self.sock, self._apply(message), self.hold)

    def _apply(self, message: dict) -> dict:
        from . import own_code
        from ..course.remote import RUNNERS

        try:
            args, kwargs = message["args"], message["kwargs"]
            with own_code.checking(message.get("lab")):
                if message.get("runner") is None:
                    value = args[0](*args[1:], **kwargs)
                else:
                    value = RUNNERS[message["runner"]](*args, **kwargs)
            wire.pack(value, self.hold)  # what cannot be sent is said here, not found half sent
            return {"op": "result", "value": value}
        except own_code.Refused as refused:
            return {"op": "refused", "text": refused.text, "mistake": refused.mistake}
        except Exception as error:  # noqa: BLE001  the student's exception travels as its name and text
            return {"op": "raised", "type": type(error).__name__, "text": str(error)[:2000]}


def _stubs(student: Student) -> None:
    """Every checker a cell can call, replaced by one that asks the judge."""
    from flashlib import labs
    from flashlib.labs import core

    class Verdict:  # what labs.check returns in a notebook: its bool is the verdict
        def __init__(self, message):
            self.passed, self.message, self.mistake = bool(message.get("passed")), message.get("message", ""), \
                message.get("mistake")

        def __bool__(self):
            return self.passed

    def check(name, fn):
        verdict = Verdict(student.ask({"op": "check", "kind": "lab", "module": "flashlib.labs", "name": name,
                                       "args": (fn,), "kwargs": {}}))
        print(verdict.message)
        return verdict

    labs.check = core.check = check
    originals = {}
    for module_name in CHECKER_MODULES:
        module = sys.modules.get(module_name)
        for attr, fn in list(vars(module).items()) if module is not None else ():
            if attr.startswith("check_") and callable(fn):
                home = originals.setdefault(fn, (getattr(fn, "__module__", module_name), attr[len("check_"):]))
                setattr(module, attr, _exercise_stub(student, *home))


def _exercise_stub(student: Student, module: str, name: str):
    def check(*args, **kwargs):
        verdict = student.ask({"op": "check", "kind": "exercise", "module": module, "name": name, "args": args,
                               "kwargs": kwargs})
        print(verdict.get("message", ""))
        return bool(verdict.get("passed"))

    check.__name__ = f"check_{name}"
    return check


def _magic_free(source: str) -> str:
    """A cell's code without IPython's % and ! lines (a plain interpreter runs it)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def run_cell(job: dict, sock) -> None:
    """The child: run the cell's earlier imports and the cell, its checks asked of the judge; then say so."""
    from flashlib.labs import cells

    student, printed = Student(sock), io.StringIO()
    _stubs(student)
    sys.stdout = sys.stderr = printed
    namespace, raised = {"__name__": "__main__", "display": print}, None
    try:
        if job["imports"]:
            exec(compile(_magic_free(job["imports"]), "<earlier imports>", "exec"), namespace)
        cells.run_source(_magic_free(job["source"]), job["name"], namespace)
    except BaseException as error:  # noqa: BLE001  whatever the cell raised is the judge's to say
        lines = str(error).strip().splitlines()
        raised = f"{type(error).__name__}: {lines[0] if lines else ''}"
        printed.write(traceback.format_exc(limit=-3))
    wire.send(sock, {"op": "done", "raised": raised, "printed": printed.getvalue()[-_PRINTED:]})


def _private_mib(pids) -> float:
    """Private memory (pages not shared with another process) of ``pids``, in MiB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty")))
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024


def _others() -> list[int]:
    """The processes of the cell: in the sandbox every process but its init and this one; without it, every
    descendant of this process."""
    me, found = os.getpid(), []
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    if WORK is not None:  # this process is the sandbox's init (pid 1)
        return [pid for pid in parents if pid not in (1, me)]
    mine, grew = {me}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in mine and pid not in mine}
        mine |= more
        grew = bool(more)
    return sorted(mine - {me})


def _end_all() -> None:
    """Kill every process of the cell and wait until none is left."""
    for _ in range(200):
        others = _others()
        if not others:
            return
        if WORK is not None:
            os.kill(-1, signal.SIGKILL)  # every process of the sandbox but this one, its init
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.01)


def _watch(child: int, timeout: float, memory_mib: float) -> tuple[int | None, str | None, float]:
    """Wait for the child: (its exit status, why it was stopped, the most memory its processes held)."""
    start, peak = time.monotonic(), 0.0
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status), None, peak
        peak = max(peak, _private_mib(_others()))
        if peak > memory_mib:
            return None, f"the cell used more than {memory_mib:.0f} MiB of memory", peak
        if time.monotonic() - start > timeout:
            return None, f"the cell ran past {timeout:.0f} s", peak
        time.sleep(POLL_S)


def _folder(job: dict) -> Path:
    """The cell's working folder, holding a copy of its notebook and nothing else."""
    folder = (WORK or Path(os.environ["FLASHLIB_CELL_ROOT"])) / "cell"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / Path(job["notebook_name"]).name).write_text(job["notebook"], encoding="utf-8")
    return folder


def _wipe(folder: Path) -> None:
    """Empty what the cell could write: its folder and the temporary folder (nothing passes to the next)."""
    shutil.rmtree(folder, ignore_errors=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    for entry in scratch.iterdir() if scratch.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _limits(memory_mib: float) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not any(Path("/dev").glob("nvidia[0-9]*")):  # a GPU's driver maps far more address space than it uses
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        limit = size + int(memory_mib * 2**20)  # an allocation past the limit fails at once, in this process
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _one(control, job: dict) -> None:
    folder = _folder(job)
    mine, theirs = socket.socketpair()
    start = time.monotonic()
    child = os.fork()
    if child == 0:
        try:
            control.close()
            mine.close()
            _prctl(_PR_SET_DUMPABLE, 1)  # the cell's own processes: this one may read their memory's size
            os.setsid()
            os.chdir(folder)
            _limits(job["memory_mib"])
            run_cell(job, theirs)
        finally:
            os._exit(0)
    theirs.close()
    socket.send_fds(control, [b"F"], [mine.fileno()])
    mine.close()
    status, stopped, peak = _watch(child, job["timeout"], job["memory_mib"])
    _end_all()
    _wipe(folder)
    wire.send(control, {"op": "end", "status": status, "stopped": stopped, "seconds": time.monotonic() - start,
                        "peak_mib": round(peak, 1)})


def main(fd: int) -> int:
    """Serve the judge on the socket ``fd``: a hello naming what to import, then one cell at a time."""
    control = socket.socket(fileno=fd)
    _prctl(_PR_SET_DUMPABLE, 0)  # no process of the cell may read or write this one's memory
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of the cell stay below this process
    hello = wire.receive(control)
    _preload(hello.get("preload", ()))
    wire.send(control, {"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    while True:
        try:
            job = wire.receive(control)
        except EOFError:
            return 0
        if job.get("op") != "cell":
            return 2
        _one(control, job)
