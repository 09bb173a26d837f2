"""Checker of notebook 12's lab: ``sink_grad(sinks, lse, delta)``, the gradient of attention sinks.

The expected gradient is autograd's through attention with sinks written from the definition in
float64 (the sink one more score in each row's softmax, with no value), never flashlib's rule.
A wrong answer is compared with what each usual slip in the derivation gives; a constant factor
over every head is named when it is a count of the sum (the rows, the sequences, both) and
described otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import Problem, Report, call, first_failure

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SinkCase:
    seed: int
    batch: int = 2
    heads: int = 3
    seq_q: int = 5
    seq_k: int = 7
    silent_head: int | None = None  # a head whose sink is -inf: its rows that see no key have lse = -inf
    d: int = 4

    def describe(self) -> str:
        text = f"batch {self.batch}, {self.heads} heads, {self.seq_q} causal rows over {self.seq_k} keys"
        if self.seq_q > self.seq_k:
            text += f" (rows 0–{self.seq_q - self.seq_k - 1} see no key)"
        return text + (f", the sink of head {self.silent_head} -inf" if self.silent_head is not None else "")

    def inputs(self):
        """sinks (heads,), lse and delta (batch, heads, seq_q), and autograd's gradient (heads,)."""
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.heads)
        q, dout = (torch.randn(*shape, self.seq_q, self.d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(*shape, self.seq_k, self.d, generator=g, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(self.heads, generator=g, dtype=torch.float64) * 2
        silent = torch.zeros(self.heads, dtype=torch.bool)
        if self.silent_head is not None:
            silent[self.silent_head] = True
            sinks[self.silent_head] = NEG_INF
        out, lse = attention(q, k, v, sinks, self.seq_k - self.seq_q)
        # autograd needs a finite sink; a sink of -inf takes no share of any row, so its gradient is 0
        leaf = torch.where(silent, 0.0, sinks).requires_grad_()
        (want,) = torch.autograd.grad(attention(q, k, v, leaf, self.seq_k - self.seq_q)[0], leaf, dout)
        want = torch.where(silent, 0.0, want)
        return sinks, lse, (dout * out).sum(dim=-1), want


def attention(q, k, v, sinks, diagonal: int):
    """(out, lse) of causal attention (bottom-right) with one sink logit per head, from the definition."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    s = s.masked_fill(j > i + diagonal, NEG_INF)
    column = sinks[:, None, None].expand(*s.shape[:-1], 1)  # the sink: one more score per row, no value
    full = torch.cat((s, column), dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(full - torch.where(lse == NEG_INF, float("inf"), lse)[..., None])
    return p[..., :-1] @ v, lse


def _share(sinks, lse, exp=torch.exp):
    p = exp(sinks[:, None] - lse)
    return torch.where(lse == NEG_INF, 0.0, p)


def _models(sinks, lse, delta):
    """(mistake, why or None, gradient) of the usual slips in the derivation."""
    p = _share(sinks, lse)
    silent = (lse == NEG_INF)
    return [("sink_sign", None, (p * delta).sum((0, 2))),
            ("no_delta", "dS = P (dP - delta) with the sink's dP = 0 leaves -p · delta, not -p.", -p.sum((0, 2))),
            ("sink_not_normalised", None, -(torch.exp(sinks)[:, None] * delta).sum((0, 2))),
            ("exp2_for_exp", "the lse is a natural log here: exp(sink - lse), not 2^(sink - lse).",
             -(_share(sinks, lse, torch.exp2) * delta).sum((0, 2))),
            ("flipped_exponent", None,
             -(torch.where(silent, 0.0, torch.exp(lse - sinks[:, None])) * delta).sum((0, 2))),
            ("sum_axes", "that is the first sequence's sum alone: sum over the batch too.", -(p * delta)[0].sum(-1)),
            ("sum_axes", "the mean is not the gradient: sum the rows and the sequences, do not average them.",
             -(p * delta).mean((0, 2)))]


def _counts(case: SinkCase):
    rows, batch = case.seq_q, case.batch
    return ((rows, f"the number of rows ({rows})"), (batch, f"the number of sequences ({batch})"),
            (rows * batch, f"the number of rows in all sequences ({rows * batch})"))


def _factor(got, want, case: SinkCase) -> Problem | None:
    """A constant ratio got / want over the heads: named when it is a count of the sum."""
    ok = want.abs() > 1e-12
    if ok.sum() < 2:
        return None
    ratio = got[ok] / want[ok]
    c = ratio.median().item()
    if not math.isfinite(c) or abs(c - 1) < 1e-6 or not ((ratio - c).abs() <= 1e-6 * abs(c)).all():
        return None
    what = f"your gradient is {c:.4g} times autograd's for every head"
    for n, label in _counts(case):
        for value, how in ((n, f"{label} times too large"), (1 / n, f"divided by {label}")):
            if math.isclose(c, value, rel_tol=1e-6):
                return Problem(f"{what}: {how}.", "sum_axes",
                               "each row adds -p · delta once to its head's gradient: sum over the rows and the "
                               "sequences, neither averaging nor counting a row more than once.")
    if math.isclose(c, -1.0, rel_tol=1e-6):
        return Problem(what + ".", "sink_sign")
    return Problem(f"{what}.")


def _case(fn, case: SinkCase) -> Problem | None:
    sinks, lse, delta, want = case.inputs()
    run = call(fn, "sink_grad", sinks.clone(), lse.clone(), delta.clone(), watch=False)
    if run.error:
        return Problem(run.error)
    if run.result is None:
        return Problem("sink_grad returned None: return a tensor of one gradient per head.")
    try:
        got = torch.as_tensor(run.result, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        return Problem(f"sink_grad should return a tensor of shape ({case.heads},); it returned "
                       f"{type(run.result).__name__} ({error}).")
    if got.shape != want.shape:
        return Problem(f"expected one gradient per head, shape {tuple(want.shape)}; got {tuple(got.shape)}.")
    if torch.allclose(got, want, rtol=1e-9, atol=1e-12):
        return None
    if got.isnan().any():
        heads = ", ".join(str(h) for h in got.isnan().nonzero().flatten().tolist())
        silent = (lse == NEG_INF).any(dim=(0, 2))
        if silent.any() and not (got.isnan() & ~silent).any():
            return Problem(f"the gradient of head {heads} is NaN.", "nan_empty_rows",
                           "a row that sees no key, in a head whose sink is -inf, has lse = -inf: exp(sink - lse) "
                           "= exp(-inf + inf) is NaN. Such a row gives the sink no share: p = 0 where lse is -inf.")
        return Problem(f"the gradient of head {heads} is NaN.")
    for key, why, wrong in _models(sinks, lse, delta):
        if torch.allclose(got, wrong, rtol=1e-9, atol=1e-12):
            return Problem(f"head {_worst(got, want)}.", key, why)
    return _factor(got, want, case) or Problem(f"head {_worst(got, want)}.")


def _worst(got, want) -> str:
    h = int((got - want).abs().argmax())
    return f"{h}: got {got[h].item():.6g}, autograd says {want[h].item():.6g}"


CASES = (SinkCase(0), SinkCase(1), SinkCase(2, seq_q=6, seq_k=4, silent_head=0))


def check_sink_grad(fn) -> Report:
    return first_failure(CASES, lambda case: _case(fn, case))
