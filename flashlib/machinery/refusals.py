"""How a function the kernels cannot compile is refused: the construct, where it is and the fix.

The one leaf of the machinery that the rules (:mod:`flashlib.rules`) import: a reference that calls a mask
or score function on whole tensors refuses a Python truth value of them ('if', 'and', 'not', min...) with
the TypeError the kernels' translator (:mod:`flashlib.machinery.trace`) gives, named and placed alike.
"""
from __future__ import annotations

import dis
import linecache
import os
import sys

import torch

_MACHINERY = os.path.dirname(__file__)  # frames of the translator, never the user's function
_TORCH_DIR = torch.__file__.rpartition("/")[0]


def _ours(filename: str) -> bool:
    return filename.startswith(_MACHINERY) or filename.startswith(_TORCH_DIR)


class TraceError(TypeError):
    """A construct the kernels cannot compile: what it is, where (function and line) and the fix."""

    def __init__(self, what: str, fix: str, where: str | None = None):
        self.what, self.fix = what, fix
        self.where = _user_frame_text() if where is None else where
        super().__init__(f"{what}{self.where} cannot be compiled into the kernels; {fix}")



def _user_frame():
    """The innermost frame outside the machinery and PyTorch: the mask function's own line."""
    frame = sys._getframe(1)
    while frame is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _user_frame_text(frame=None, line_number=None) -> str:
    """Where a construct is: " (in fn, line n: its source)" of ``frame`` at ``line_number`` (default: the
    user's frame now, at its current line)."""
    frame = _user_frame() if frame is None else frame
    if frame is None:
        return ""
    number = frame.f_lineno if line_number is None else line_number
    line = linecache.getline(frame.f_code.co_filename, number).strip()
    return f" (in {frame.f_code.co_name}, line {number}{': ' + line if line else ''})"


def _truth_construct(frame=None, offset=None) -> tuple[str, str]:
    """What asked for a Python truth value, read from the instruction ``frame`` is at (default: the user's
    frame now, at its last instruction)."""
    frame = _user_frame() if frame is None else frame
    name = ""
    if frame is not None:
        offset = frame.f_lasti if offset is None else offset
        for ins in dis.get_instructions(frame.f_code):
            if ins.offset == offset:
                name = ins.opname
    if "NOT" in name:
        return "'not' of a traced value", "write ~(x)"
    if "CALL" in name:
        return ("a builtin that compares traced values in Python (min, max, sorted, any, all)",
                "write torch.minimum(a, b) or torch.maximum(a, b), and & or | for all or any")
    # the kernel evaluates the mask on whole tiles at once: no one truth value to branch on
    return ("a Python truth value of a traced value ('and', 'or', 'if', 'x if c else y', a < b < c)",
            "write (a) & (b), (a) | (b), torch.where(c, x, y); compare two values at a time")


def truth_refusal(op: str | None, argument: str, function, exc: RuntimeError) -> TypeError | None:
    """For a reference op (PyTorch on whole tensors of indices and scores): the TypeError the kernels give a
    function that asks for a Python truth value of its tensors ('if', 'and', 'not', min...), named and
    placed as they name it, where PyTorch raised ``exc`` ("Boolean value of Tensor ... is ambiguous");
    None for any other error."""
    if "Boolean value of Tensor" not in str(exc):
        return None
    tb, place = exc.__traceback__, None
    while tb is not None:  # the innermost frame outside the machinery and PyTorch: the function's own line
        if not _ours(tb.tb_frame.f_code.co_filename):
            place = tb
        tb = tb.tb_next
    if place is None:
        return None
    what, fix = _truth_construct(place.tb_frame, place.tb_lasti)
    where = _user_frame_text(place.tb_frame, place.tb_lineno)
    return refusal(op, argument, function, TraceError(what, fix, where=where))


def function_name(fn) -> str:
    """How an error names a user's function: its name, or its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def refusal(op: str | None, argument: str, function, exc: TraceError) -> TypeError:
    """The TypeError an op raises for a function the kernels cannot compile: the op called (if named), the argument,
    the construct and where it is (at least the function's name) and the fix."""
    if not exc.where:
        exc = TraceError(exc.what, exc.fix, where=f" (in {function_name(function)})")
    return TypeError(f"{op + ': ' if op else ''}argument '{argument}': {exc}")
