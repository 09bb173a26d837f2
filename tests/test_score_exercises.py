"""Notebook 13's checker: a right answer passes, each named mistake is named, anything else is
described by the head it is off at; the expected gradient is autograd's through the score function."""
from __future__ import annotations

import pytest
import torch

from flashlib import scores
from flashlib.course import score_exercises as ex


def right(ds):
    n = ds.shape[-1]
    distance = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    return (ds * distance).sum(dim=(0, 2, 3))


def test_the_expected_gradient_is_autograds_through_flashlib_scores_alibi():
    ds, slopes = ex.alibi_case()
    # the same number by hand from the formula ds * (kv - q), summed over batch, queries and keys
    n = ds.shape[-1]
    by_hand = torch.stack([sum(ds[b, h, i, j] * (j - i) for b in range(ds.shape[0]) for i in range(n)
                               for j in range(n)) for h in range(ds.shape[1])])
    torch.testing.assert_close(ex.expected_alibi_grad(ds, slopes), by_hand)
    assert scores.alibi is not None


def test_a_right_answer_passes(capsys):
    assert ex.check_alibi_grad(right)
    assert capsys.readouterr().out.startswith("PASS")


MISTAKES = [
    (lambda ds: -right(ds), "wrong sign"),
    (lambda ds: ds.sum(dim=(0, 2, 3)), "per-head bias"),
    (lambda ds: (ds * (torch.arange(ds.shape[-1])[None, :] - torch.arange(ds.shape[-1])[:, None]).abs())
     .sum(dim=(0, 2, 3)), "drops the sign"),
    (lambda ds: right(ds) / (ds.shape[-1] ** 2 * ds.shape[0]), "a mean, not a sum"),
    (lambda ds: right(ds) / ds.shape[0], "divided by the batch"),
    (lambda ds: (ds * (torch.arange(ds.shape[-1])[None, :] - torch.arange(ds.shape[-1])[:, None])).sum(dim=(2, 3)),
     "sums over it too"),
    (lambda ds: right(ds).sum(), "one number"),
    (lambda ds: right(ds).tolist(), "should return a torch.Tensor"),
    (lambda ds: 1 / 0, "raised ZeroDivisionError"),
    (lambda ds: right(ds) + torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64), "head 1"),
]


@pytest.mark.parametrize("wrong, words", MISTAKES, ids=[w for _, w in MISTAKES])
def test_each_mistake_is_named(wrong, words, capsys):
    ex.ALIBI_HINTS.reset()
    assert not ex.check_alibi_grad(wrong)
    out = capsys.readouterr().out
    assert out.startswith("NOT YET") and words in out, out
    assert "hint 1 of 3" in out


def test_no_answer_gives_no_hint_and_the_solution_passes(capsys):
    assert not ex.check_alibi_grad(None)
    out = capsys.readouterr().out
    assert "no answer yet" in out and "hint" not in out
    ex.solution("alibi_grad")
    code = capsys.readouterr().out
    scope = {"torch": torch}
    exec(code, scope)  # noqa: S102  (the course's own answer)
    assert ex.check_alibi_grad(scope["alibi_grad"])
    with pytest.raises(ValueError, match="'name'"):
        ex.solution("nope")
