"""Verdicts told to a grader directly by the checkers, not read back from what a cell printed.

A checker ends by printing PASS or NOT YET for the student, and by calling :func:`report`. Outside
the grader nothing listens and :func:`report` returns at once. The grader's harness
(:mod:`flashlib.labs.gradecell`) installs a listener before the student's cell runs, and credits a
cell only from what the listener heard: a printed "PASS" is not a verdict, nor is a function of the
student's own that replaces a checker, since a report is taken only from flashlib's own code, named
after the checker that ran (``check_<name>`` for an exercise, the lab's name for a lab).

What this does not defend against: code written to reach into the checkers' internals (replacing a
private function of flashlib, say). The harness runs each cell in a fresh process with the course's
own package, so such code would have to be written for the purpose.
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
