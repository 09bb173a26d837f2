"""Checkers of notebook 02's labs: ``online_softmax(blocks)`` and ``merge_states(m_a, l_a, m_b, l_b)``.

The expected (m, l) come from the definitions in float64 (max, then sum of exp(x - max)) over
the whole row; the known mistakes are recognised by which rows come out wrong, and how.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import diagnose
from .common import Problem, Report, call, first_failure, rows_summary, unpack, wrong_rows
from .reference import max_moves
from ..course.remote import beside_answer
from .watch import Stream

NEG_INF = float("-inf")
TOL = 1e-5


def state(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, l) of the rows of x in float64: m = max, l = sum exp(x - m); (-inf, 0) for a row of -inf."""
    x = x.double()
    m = x.amax(dim=-1)
    return m, torch.exp(x - torch.where(m == NEG_INF, 0.0, m)[:, None]).sum(dim=-1)


@dataclass(frozen=True)
class RowCase:
    """One matrix cut into blocks: ``kind`` "normal", "negative" (half the rows near -300) or "infinite"."""

    rows: int
    widths: tuple[int, ...]
    kind: str
    seed: int

    def describe(self) -> str:
        extra = {"normal": "", "negative": ", some rows near -300", "infinite": ", rows starting with or all -inf"}
        return f"{self.rows} rows in blocks of widths {list(self.widths)}{extra[self.kind]}"

    def matrix(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.rows, sum(self.widths), generator=g) * 3
        x[0, 0], x[1, -1] = 20.0, 20.0  # row 0's max comes first, row 1's last
        if self.kind == "negative":
            x[::2] -= 300.0
        if self.kind == "infinite":
            x[0] = NEG_INF                    # a row of only -inf
            x[1, :self.widths[0]] = NEG_INF   # a row whose first block is all -inf
            x[2, ::2] = NEG_INF
        return x

    def blocks(self, x):
        return list(x.split(list(self.widths), dim=-1))


ROW_CASES = (RowCase(6, (3, 5, 2, 4), "normal", 0), RowCase(5, (4, 1, 7), "negative", 1),
             RowCase(4, (2, 3, 3), "infinite", 2), RowCase(3, (1,) * 9, "normal", 3))


@beside_answer
def _run_online(fn, case, x, *, wipe=True):
    """(the call, how many times blocks was asked for more after its last block)."""
    stream = Stream(case.blocks(x), wipe=wipe)
    return call(fn, "online_softmax", stream), stream.reads_after_end


def _online_case(fn, case: RowCase) -> Problem | None:
    x = case.matrix()
    run, reads_after_end = _run_online(fn, case, x)
    if reads_after_end > 1:
        return Problem("blocks was asked for more after its last block, a second time.", "read_twice")
    if run.error:
        return Problem(run.error)
    held = run.watch.full_width(x.shape[-1])
    if held is not None:
        return Problem(f"a tensor of shape {held} was created: the whole row at once.", "full_matrix",
                       "keep only the running (m, l), two numbers per row, between blocks.")
    got = unpack(run.result, "online_softmax", ("m", "l"), ((case.rows,), (case.rows,)))
    if isinstance(got, Problem):
        return got
    m_want, l_want = state(x)
    bad_m = wrong_rows(got[0], m_want, TOL, columns=False)
    bad = bad_m | wrong_rows(got[1], l_want, TOL, columns=False)
    if not bad.any():
        return None
    what = rows_summary(bad_m, "m", got[0], m_want) if bad_m.any() else rows_summary(bad, "l", got[1], l_want)
    return _swapped(got, (m_want, l_want)) or _online_diagnosis(fn, case, x, got, bad, what + ".")


def _swapped(got, want) -> Problem | None:
    """(l, m) returned for (m, l)."""
    if not (wrong_rows(got[0], want[1], TOL, columns=False) | wrong_rows(got[1], want[0], TOL, columns=False)).any():
        return Problem("m holds what l should and l what m should.", "swapped_outputs",
                       "the results came back as (l, m): return (m, l).")
    return None


def _close(l, model, rows=None) -> bool:
    bad = wrong_rows(l, model, TOL, columns=False)
    return not (bad if rows is None else bad[rows]).any()


def _online_diagnosis(fn, case, x, got, bad, what) -> Problem:
    m, l = got
    m_want, l_want = state(x)
    rerun, _ = _run_online(fn, case, x, wipe=False)
    again = unpack(rerun.result, "online_softmax", ("m", "l"), ((case.rows,), (case.rows,)))
    if not isinstance(again, Problem) and not (wrong_rows(again[0], m_want, TOL, columns=False)
                                               | wrong_rows(again[1], l_want, TOL, columns=False)).any():
        return Problem(what, "read_after_next")
    starts_inf = (x[:, :case.widths[0]] == NEG_INF).all(dim=-1)
    if (m.isnan() | l.isnan()).any() and not (bad & ~starts_inf).any():
        return Problem(what, "nan_empty_rows")
    negative = m_want < 0
    if bad[negative].all() and not bad[~negative].any() and (m[negative] == 0).any():
        return Problem(what, "max_starts_at_zero")
    moved = max_moves(x.double(), case.widths)
    if not bad[~moved].any() and (l[bad] > l_want[bad]).all():
        return Problem(what, "no_rescale")
    if _close(l, torch.exp2(x.double() - torch.where(m_want == NEG_INF, 0.0, m_want)[:, None]).sum(dim=-1)):
        return Problem(what, "exp2_for_exp", "l = sum(exp(x - m)), a natural exp: 2^(x - m) is a different sum.")
    groups = [("the rows whose max comes in a later block", moved), ("the rows near -300", m_want < -100),
              ("the rows that start with -inf", starts_inf)]
    detail = [diagnose.factor("l", l, l_want, bad, 1.0), diagnose.which(bad[None, None], groups)]
    return Problem(" ".join([what] + [d + "." for d in detail if d]))


def check_online_softmax(fn) -> Report:
    return first_failure(ROW_CASES, lambda case: _online_case(fn, case))


@dataclass(frozen=True)
class MergeCase:
    """Two chunks of the same rows; ``kind`` "normal", "large" (maxima in the hundreds) or "empty"."""

    rows: int
    kind: str
    seed: int

    def describe(self) -> str:
        extra = {"normal": "", "large": ", maxima in the hundreds", "empty": ", some states empty (-inf, 0)"}
        return f"states of {self.rows} rows{extra[self.kind]}"

    def chunks(self):
        g = torch.Generator().manual_seed(self.seed)
        a, b = torch.randn(self.rows, 5, generator=g) * 3, torch.randn(self.rows, 3, generator=g) * 3
        if self.kind == "large":
            a += torch.tensor([400.0, -400.0, 300.0, 0.0])[:, None]
            b += torch.tensor([380.0, -350.0, 310.0, 500.0])[:, None]
        if self.kind == "empty":
            a[0], b[1], a[2], b[2] = NEG_INF, NEG_INF, NEG_INF, NEG_INF  # rows 0, 1: one side; row 2: both
        return a, b


MERGE_CASES = (MergeCase(6, "normal", 0), MergeCase(4, "large", 1), MergeCase(5, "empty", 2))


def _merge_case(fn, case: MergeCase) -> Problem | None:
    a, b = case.chunks()
    (m_a, l_a), (m_b, l_b) = state(a), state(b)
    run = call(fn, "merge_states", *(t.float() for t in (m_a, l_a, m_b, l_b)))
    if run.error:
        return Problem(run.error)
    got = unpack(run.result, "merge_states", ("m", "l"), ((case.rows,), (case.rows,)))
    if isinstance(got, Problem):
        return got
    m_want, l_want = state(torch.cat([a, b], dim=-1))
    swapped = _swapped(got, (m_want, l_want))
    if swapped is not None:
        return swapped
    bad_m = wrong_rows(got[0], m_want, TOL, columns=False)
    if bad_m.any():
        return Problem(rows_summary(bad_m, "m", got[0], m_want) + ": m is max(m_a, m_b).")
    bad = wrong_rows(got[1], l_want, TOL, columns=False)
    if not bad.any():
        return None
    return _merge_diagnosis(got[1], bad, (m_a, l_a, m_b, l_b), m_want, rows_summary(bad, "l", got[1], l_want) + ".")


def _merge_diagnosis(l, bad, states, m, what) -> Problem:
    m_a, l_a, m_b, l_b = states
    empty = (m_a == NEG_INF) & (m_b == NEG_INF)
    if l.isnan().any() and not (bad & ~empty).any():
        return Problem(what, "nan_empty_rows", "two empty states have m = -inf, and m_a - m = -inf - (-inf) = NaN. "
                       "Shift by torch.where(m == -inf, 0, m) instead of m.")
    if not torch.isfinite(l[bad]).all() and (m[bad].abs() > 80).all():
        return Problem(what, "overflow")
    with torch.no_grad():
        if not wrong_rows(l, l_a + l_b, TOL, columns=False).any():
            return Problem(what, "no_rescale", "l = l_a + l_b adds sums taken under two different maxima: "
                           "rescale each to the merged max first, l_a * exp(m_a - m) + l_b * exp(m_b - m).")
        inverted = l_a * torch.exp(m - m_a) + l_b * torch.exp(m - m_b)
        if _close(l, inverted, ~empty):
            return Problem(what, "inverted_rescale")
        shift = torch.where(m == NEG_INF, 0.0, m)
        if _close(l, l_a * torch.exp2(m_a - shift) + l_b * torch.exp2(m_b - shift)):
            return Problem(what, "exp2_for_exp", "each l is a sum of natural exps: rescale it by exp(m_part - m), "
                           "not 2^(m_part - m).")
    factor = diagnose.factor("l", l, _right_l(states, m), bad, 1.0)
    return Problem(what + (f" {factor}." if factor else ""))


def _right_l(states, m):
    m_a, l_a, m_b, l_b = states
    shift = torch.where(m == NEG_INF, 0.0, m)
    return l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)


def check_merge_states(fn) -> Report:
    return first_failure(MERGE_CASES, lambda case: _merge_case(fn, case))
