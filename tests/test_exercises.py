"""flashlib.exercises: right answers pass, wrong ones get feedback, nothing raises."""
import math

import pytest
import torch

from flashlib.course import exercises


def passes(capsys, checker, answer):
    result = checker(answer)
    out = capsys.readouterr().out
    assert result is True and out.startswith("PASS"), out
    return out


def fails(capsys, checker, answer, *fragments):
    result = checker(answer)
    out = capsys.readouterr().out
    assert result is False and out.startswith("NOT YET") and "hint:" in out, out
    for fragment in fragments:
        assert fragment in out, out
    return out


ALL_CHECKERS = [exercises.check_score_bytes, exercises.check_causal_mask, exercises.check_standard_io,
                exercises.check_online_state, exercises.check_rescale, exercises.check_merge,
                exercises.check_tile_count, exercises.check_causal_tiles, exercises.check_tile_fraction,
                exercises.check_delta, exercises.check_probs_from_lse, exercises.check_kept_ratio]


@pytest.mark.parametrize("checker", ALL_CHECKERS)
@pytest.mark.parametrize("answer", [None, "forty-two", [1, 2], torch.zeros(2, 2), float("nan"), lambda *a: 1 / 0])
def test_no_answer_or_garbage_gives_feedback_not_an_exception(capsys, checker, answer):
    fails(capsys, checker, answer)


def test_score_bytes(capsys):
    passes(capsys, exercises.check_score_bytes, 1 * 8 * 4096 * 4096 * 4)
    fails(capsys, exercises.check_score_bytes, 8 * 4096 * 4096, "number of elements")
    fails(capsys, exercises.check_score_bytes, 4096 * 4096 * 4, "one head")


def test_causal_mask(capsys):
    passes(capsys, exercises.check_causal_mask, torch.ones(3, 5).tril(diagonal=2).bool())
    fails(capsys, exercises.check_causal_mask, torch.ones(3, 5).tril().bool(), "top-left")
    fails(capsys, exercises.check_causal_mask, torch.ones(5, 3).bool(), "(5, 3)")


def test_standard_io(capsys):
    n, d = 1024, 64
    passes(capsys, exercises.check_standard_io, (2 * n * d + 2 * n * n + n * d) + (2 * n * n + n * d))
    fails(capsys, exercises.check_standard_io, 4 * n * d + 2 * n * n, "round trip")


def test_online_state(capsys):
    row = [2.0, 5.0, 1.0, 7.0]
    l = sum(math.exp(x - 7.0) for x in row)
    passes(capsys, exercises.check_online_state, (7.0, l))
    passes(capsys, exercises.check_online_state, (torch.tensor(7.0), torch.tensor(l)))
    fails(capsys, exercises.check_online_state, (7.0, sum(math.exp(x) for x in row)), "naive")
    fails(capsys, exercises.check_online_state, (5.0, l), "running max")


def test_rescale(capsys):
    passes(capsys, exercises.check_rescale, math.exp(-2.0))
    fails(capsys, exercises.check_rescale, math.exp(2.0), "inverse")


def test_merge(capsys):
    def merge(m_a, l_a, m_b, l_b):
        m = torch.maximum(m_a, m_b)
        return m, l_a * torch.exp(m_a - m) + l_b * torch.exp(m_b - m)

    def no_rescale(m_a, l_a, m_b, l_b):
        return torch.maximum(m_a, m_b), l_a + l_b

    passes(capsys, exercises.check_merge, merge)
    fails(capsys, exercises.check_merge, no_rescale, "whole row")
    fails(capsys, exercises.check_merge, lambda *args: args[0], "pair")


def test_tile_counts(capsys):
    passes(capsys, exercises.check_tile_count, math.ceil(10 / 4) * math.ceil(10 / 3))
    fails(capsys, exercises.check_tile_count, (10 // 4) * (10 // 3), "uneven")
    passes(capsys, exercises.check_causal_tiles, 4 + 3 + 2 + 1)
    fails(capsys, exercises.check_causal_tiles, 16, "every tile")
    passes(capsys, exercises.check_tile_fraction, 1 / 256)
    fails(capsys, exercises.check_tile_fraction, 1 / 16, "one side")


def test_delta(capsys):
    passes(capsys, exercises.check_delta, lambda dout, out: (dout * out).sum(dim=-1))
    fails(capsys, exercises.check_delta, lambda dout, out: dout * out, "sum over head_dim")
    fails(capsys, exercises.check_delta, lambda dout, out: (dout * out).sum(dim=-2), "shape")


def test_probs_from_lse(capsys):
    passes(capsys, exercises.check_probs_from_lse, lambda s, lse: torch.exp(s - lse.unsqueeze(-1)))
    fails(capsys, exercises.check_probs_from_lse,
          lambda s, lse: torch.exp(s) / torch.exp(lse).unsqueeze(-1), "inf or NaN")
    fails(capsys, exercises.check_probs_from_lse, lambda s, lse: torch.exp(s - lse), "raised")


def test_kept_ratio(capsys):
    passes(capsys, exercises.check_kept_ratio, 4096)
    fails(capsys, exercises.check_kept_ratio, 1 / 4096, "inverse")
