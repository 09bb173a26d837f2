"""Notebook 14's cascade-merge exercise: the solution passes, each named mistake is named."""
from __future__ import annotations

import torch

from flashlib.course import serving
from flashlib.course.exercises import PASS


def _solution():
    scope = {"torch": torch}
    exec(serving.MERGE_HINTS.answer, scope)
    return scope["merge"]


def test_the_solution_passes_and_equals_merge_partials(capsys):
    assert serving.check_cascade_merge(_solution()) is True
    assert PASS in capsys.readouterr().out


def _says(capsys, merge, words):
    serving.MERGE_HINTS.reset()
    assert serving.check_cascade_merge(merge) is False
    out = capsys.readouterr().out
    assert words in out, out


def test_each_mistake_is_named(capsys):
    right = _solution()

    def averaged(op, lp, os_, ls):
        return (op + os_) / 2, torch.logaddexp(lp, ls)

    def swapped(op, lp, os_, ls):
        lse = torch.logaddexp(lp, ls)
        safe = torch.where(torch.isneginf(lse), 0.0, lse)
        return torch.exp(ls - safe)[..., None] * op + torch.exp(lp - safe)[..., None] * os_, lse

    def undivided(op, lp, os_, ls):
        return torch.exp(lp)[..., None] * op + torch.exp(ls)[..., None] * os_, torch.logaddexp(lp, ls)

    def naive(op, lp, os_, ls):  # right in exact arithmetic: e^lse itself, which overflows float64 here
        total = torch.exp(lp) + torch.exp(ls)
        out = (torch.exp(lp)[..., None] * op + torch.exp(ls)[..., None] * os_) / total[..., None]
        return torch.nan_to_num(out), torch.log(total)

    def maximum(op, lp, os_, ls):
        out, _ = right(op, lp, os_, ls)
        return out, torch.maximum(lp, ls)

    def unsafe(op, lp, os_, ls):
        lse = torch.logaddexp(lp, ls)
        return torch.exp(lp - lse)[..., None] * op + torch.exp(ls - lse)[..., None] * os_, lse

    def out_only(op, lp, os_, ls):
        return right(op, lp, os_, ls)[0]

    for merge, words in [(averaged, "averaged"), (swapped, "swapped"), (undivided, "overflowed"), (naive, "float64 overflows past"),
                         (maximum, "larger of the two"), (unsafe, "NaN"), (out_only, "two tensors"),
                         (lambda *a: 1 / 0, "ZeroDivisionError")]:
        _says(capsys, merge, words)
    assert serving.check_cascade_merge(None) is False and "no answer yet" in capsys.readouterr().out


def test_the_figures_draw():
    assert serving.bytes_figure().axes[0].get_yscale() == "log"
    fig = serving.mixed_batch_figure([6, 1, 0, 3], [16, 31, 5, 3])
    assert len(fig.axes[0].patches) == 4 * 6


def test_the_case_overflows_in_its_own_dtype():
    """The exercise says the lse overflow: they must, in float64, the dtype the checker runs."""
    out_p, lse_p, out_s, lse_s = serving.merge_case()
    assert lse_p.dtype == torch.float64 and lse_p[torch.isfinite(lse_p)].max() > 709.8
    assert torch.isinf(torch.exp(lse_p[torch.isfinite(lse_p)])).any()
