"""Which edition of the course this copy is: the full one, or the student edition ``make student`` writes.

The student edition has no worked solutions (no ``flashlib.labs.solutions``, the labs', nor
``flashlib.course.answers``, the exercises') and gives at most ``HINTS`` hints per lab or exercise, which
``tools/student_edition.py --hints N`` writes into its copy of this file. Nothing here imports the rest
of the package.
"""
from __future__ import annotations

import importlib.util

HINTS: int | None = None  # hints a lab or an exercise gives at most; None: every one it has


def solutions_shipped() -> bool:
    """Whether this copy ships the worked solutions (the full edition does, the student edition does not)."""
    return importlib.util.find_spec("flashlib.labs.solutions") is not None


def answers_shipped() -> bool:
    """Whether this copy ships the exercises' worked answers (:mod:`flashlib.course.answers`)."""
    return importlib.util.find_spec("flashlib.course.answers") is not None


def given(hints: tuple) -> tuple:
    """The hints of ``hints`` this edition gives, in order."""
    return tuple(hints) if HINTS is None else tuple(hints)[:HINTS]


NO_HINTS = "this edition gives none: the message above says what is wrong"


def one_hint(hint: str) -> str:
    """An exercise's single hint as this edition gives it: itself, or, where the teacher chose no hints, that
    there is none (a one-hint exercise counts as the first of its hints)."""
    return given((hint,))[0] if given((hint,)) else NO_HINTS


NO_SOLUTIONS = "This is the student edition of the course: it has no worked solutions"
