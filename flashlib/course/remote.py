"""The student's functions seen from the judge: handles that run them in the student's process.

While a class is graded, a checker runs in the judge and the student's code in a process of its own
(:mod:`flashlib.labs.grade`, :mod:`flashlib.labs.zygote`). An answer that is a function reaches the checker as a :class:`Remote`:
calling it sends the arguments to the student's process, which calls the function and sends the result
back (:mod:`.wire`). What must run beside the student's function (the watches on what it creates, reads
and runs, a kernel lab's harness) is a course function marked :func:`beside_answer`: called with a
:class:`Remote` among its arguments, it runs in the student's process with the student's function in its
place; called with a local function (a notebook's own check), it runs here. Only marked functions can be
run that way (:data:`RUNNERS`). What is being checked in a thread (:func:`checking`) travels with
each call, and an answer refused there (:class:`Refused`) is refused here.
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import threading

from . import wire

RUNNERS: dict[str, object] = {}  # "module:qualname" -> the course function the student's process may be asked to run


class Refused(BaseException):
    """An answer refused for what it is or what it ran (a BaseException, so that no checker's ``except
    Exception`` around the learner's code keeps it); ``mistake`` is its key in the labs' MISTAKES."""

    def __init__(self, text: str, mistake: str = "course_code"):
        super().__init__(text)
        self.text, self.mistake = text, mistake


_STATE = threading.local()


@contextlib.contextmanager
def checking(name: str | None):
    """While lab ``name`` is being checked in this thread (what the watches beside the answer look for)."""
    before = getattr(_STATE, "lab", None)
    _STATE.lab = name
    try:
        yield
    finally:
        _STATE.lab = before


def checked() -> str | None:
    """The lab being checked in this thread, if any."""
    return getattr(_STATE, "lab", None)


class RemoteGone(BaseException):
    """The student's process ended (or broke the protocol) while the judge waited on it: no verdict."""


def _exception(type_name: str, text: str) -> Exception:
    """The student's exception as one of Python's own where it is one, else a new class of that name."""
    known = getattr(builtins, type_name, None)
    if isinstance(known, type) and issubclass(known, Exception):
        return known(text)
    name = type_name if type_name.isidentifier() else "Error"
    return type(name, (Exception,), {})(text)


class Remote:
    """A function of the student's, in the student's process: calling it calls it there."""

    def __init__(self, link: "Link", handle: int, type_name: str, text: str):
        self._link, self._wire_handle, self.type_name, self._text = link, handle, type_name, text

    def __call__(self, *args, **kwargs):
        return self._link.apply(None, (self, *args), kwargs)

    def __repr__(self) -> str:
        return self._text


class Link:
    """The judge's end of one cell's channel to the student's process."""

    def __init__(self, sock, limit: int = wire.LIMIT):
        self.sock, self.limit = sock, limit

    def remote(self, tree: dict) -> Remote:
        return Remote(self, int(tree["__fn__"]), str(tree.get("type", "function")), str(tree.get("text", "")))

    def receive(self) -> dict:
        try:
            return wire.receive(self.sock, self.remote, self.limit)
        except (EOFError, OSError) as error:
            raise RemoteGone(f"the student's process ended ({error})") from None
        except wire.WireError as error:
            raise RemoteGone(f"the student's process sent what is not a message: {error}") from None

    def send(self, message: dict) -> None:
        try:
            wire.send(self.sock, message)
        except OSError as error:
            raise RemoteGone(f"the student's process ended ({error})") from None

    def apply(self, runner: str | None, args: tuple, kwargs: dict):
        """Run ``runner`` (a marked course function; None: call ``args[0]``) in the student's process."""
        self.send({"op": "apply", "runner": runner, "args": tuple(args), "kwargs": dict(kwargs),
                   "lab": checked()})
        reply = self.receive()
        op = reply.get("op")
        if op == "result":
            return reply.get("value")
        if op == "raised":
            raise _exception(str(reply.get("type")), str(reply.get("text")))
        if op == "refused":
            raise Refused(str(reply.get("text")), str(reply.get("mistake") or "course_code"))
        raise RemoteGone(f"the student's process answered {op!r} where a result was expected")


def _link(args, kwargs) -> Link | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Remote):
            return value._link
    return None


def beside_answer(fn):
    """Mark a course function that must run where the student's function is (see the module's text)."""
    name = f"{fn.__module__}:{fn.__qualname__}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        link = _link(args, kwargs)
        if link is None:
            return fn(*args, **kwargs)
        return link.apply(name, args, kwargs)

    RUNNERS[name] = fn
    return wrapper


def holds(value) -> bool:
    """Whether ``value`` is a function of the student's held in another process."""
    return isinstance(value, Remote)
