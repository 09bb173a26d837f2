"""What every lab checker shares: calling the learner's function safely, reading its result, comparing.

A checker never raises on the learner's behalf: an exception, a wrong type or a wrong shape
becomes a :class:`Problem`, the sentence the message shows, with the key of a known mistake
when one is recognised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import own_code
from ..course.remote import beside_answer
from .watch import TensorWatch


@dataclass(frozen=True)
class Problem:
    """What went wrong in one case: ``what`` was seen; ``mistake`` names it when it is a known one."""

    what: str
    mistake: str | None = None
    why: str | None = None  # replaces the mistake's general explanation with one for this case


@dataclass(frozen=True)
class Report:
    """A checker's verdict: how many cases it has, and the first that failed (1-based), if any."""

    cases: int
    failed: int | None = None
    case: str = ""
    problem: Problem | None = None


def first_failure(cases, run_case) -> Report:
    """Run ``run_case(case) -> Problem | None`` over the cases in order; stop at the first problem."""
    for index, case in enumerate(cases, start=1):
        problem = run_case(case)
        if problem is not None:
            return Report(len(cases), index, case.describe(), problem)
    return Report(len(cases))


@dataclass
class Call:
    result: object = None
    error: str | None = None
    watch: TensorWatch | None = None


@beside_answer
def call(fn, name: str, *args, watch: bool = True) -> Call:
    """Run the learner's ``fn(*args)``, recording the tensors it creates; an exception becomes text. While a
    lab is checked, what the function ran is watched too: the course's own code is refused
    (:class:`~.own_code.Refused`). Given a function held in the student's process, it runs there."""
    recorder = TensorWatch() if watch else None
    with own_code.Ran() as ran:
        try:
            if recorder is None:
                result = fn(*args)
            else:
                with recorder:
                    result = fn(*args)
        except Exception as error:  # the learner's bug is feedback, never a traceback
            done = Call(error=f"{name} raised {error_text(error)}", watch=recorder)
        else:
            done = Call(result=result, watch=recorder)
    ran.refuse()
    return done


def error_text(error: BaseException) -> str:
    """'TypeError: what it said' of the innermost cause (Triton's interpreter wraps errors in its own)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def unpack(result, fn_name: str, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]):
    """The result as a tuple of tensors of the given shapes, or the Problem that says why not."""
    expected = "(" + ", ".join(names) + ")"
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        got = type(result).__name__ if not isinstance(result, (tuple, list)) else f"{len(result)} values"
        return Problem(f"{fn_name} should return {expected}; it returned {got}.")
    tensors = []
    for name, value, shape in zip(names, result, shapes):
        if value is None:
            return Problem(f"{name} is None: not computed yet.")
        if not isinstance(value, torch.Tensor):
            return Problem(f"{name} should be a torch.Tensor of shape {shape}; got {type(value).__name__}.")
        if tuple(value.shape) != tuple(shape):
            return Problem(f"{name} has shape {tuple(value.shape)}; expected {tuple(shape)}.")
        tensors.append(value.detach().double())
    return tuple(tensors)


def wrong_rows(got, want, tol: float, *, columns: bool = True, whole: bool = False) -> torch.Tensor:
    """Bool mask of the rows of ``got`` that differ from ``want``: (..., rows) from (..., rows, d) tensors,
    or the entries themselves with ``columns=False`` ((..., rows) tensors such as lse).

    Equal infinities agree; NaN never does. The tolerance is tol · (1 + |want|) per entry, or
    tol · (1 + max |want|) with ``whole`` (gradients, whose entries near 0 carry the rounding of the
    largest ones).
    """
    size = want.abs().nan_to_num(posinf=0.0, neginf=0.0)
    size = size.amax() if whole else size
    close = (((got - want).abs() <= tol * (1 + size)) | (got == want)) & ~got.isnan()
    return ~close.all(dim=-1) if columns else ~close


def rows_summary(bad, what: str, got=None, want=None) -> str:
    """'out is off by up to 0.61 in 30 of 74 rows (first: batch 0, head 1, row 5)'."""
    index = bad.nonzero()[0].tolist()
    where = ", ".join(f"{axis} {i}" for axis, i in zip(("batch", "head", "row")[-len(index):], index))
    size = ""
    if got is not None and want is not None:
        diff = (got - want).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
        diff = diff[bad] if diff.dim() == bad.dim() else diff[bad].amax(dim=-1)
        worst = diff.max().item()
        size = f" by up to {worst:.3g}" if worst != float("inf") else " (NaN or inf)"
    return f"{what} is off{size} in {int(bad.sum())} of {bad.numel()} rows (first: {where})"
