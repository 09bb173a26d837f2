"""Verdicts told directly by the checkers to a listener in the same process, not read back from what they printed.

A checker ends by printing PASS or NOT YET for the student, and by calling :func:`report`. Outside
a listener nothing happens and :func:`report` returns at once. A listener (a tool, a test) hears a
report only from flashlib's own code, named after the checker that ran (``check_<name>`` for an
exercise, the lab's name for a lab): a printed "PASS" is not a verdict, nor is a function of one's own
that replaces a checker.

The grader does not rely on this: it runs the checkers in a process of its own, apart from the students'
code (:mod:`flashlib.labs.judge`), and nothing a student's cell calls here reaches it.
"""
from __future__ import annotations

import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # flashlib/
_LISTENER = None


def listen(listener) -> None:
    """Send every later report to ``listener(dict)`` (the grader's harness; None stops listening)."""
    global _LISTENER
    _LISTENER = listener


def _ours(frame) -> bool:
    try:
        return Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):  # "<string>" and the like: not a file of the package
        return False


def _checker_name(frame) -> str | None:
    """The exercise whose checker is running: the nearest ``check_<name>`` frame of flashlib's own code."""
    while frame is not None:
        name = frame.f_code.co_name
        if name.startswith("check_") and _ours(frame):
            return name[len("check_"):]
        frame = frame.f_back
    return None


def report(passed: bool, message: str, *, lab: str | None = None, mistake: str | None = None) -> None:
    """Tell the listener, if any, a checker's verdict: ``lab`` for a lab, else the exercise whose
    ``check_<name>`` called. Ignored unless called from flashlib's own code."""
    if _LISTENER is None:
        return
    caller = sys._getframe(1)
    if not _ours(caller):
        return
    name = lab if lab is not None else _checker_name(caller)
    if name is None:
        return
    _LISTENER(dict(name=name, kind="lab" if lab is not None else "exercise", passed=bool(passed),
                   message=message.strip().splitlines()[0] if message.strip() else "", detail=message.strip(),
                   mistake=mistake))
