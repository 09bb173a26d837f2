"""Checker of notebook 10's lab: ``split_kv(q, k, v, num_splits)`` for one query, in PyTorch.

Every case runs the learner's function inside a :class:`~.watch.TensorWatch`: an operation that computed
with a tensor one of whose dims counts more keys than one split holds (views and copies aside) means the
keys were never split, as in plain attention that ignores ``num_splits``, which gives the right output.
The cases' sizes keep those counts apart from the head dim and the number of splits.

The expected output is softmax attention over all the keys at once, in float64, from the definition.
A wrong output is compared with what each usual wrong merge gives (the partial outputs averaged or
added, the weights e^(lse_s) left undivided, the last split alone), with attention under a wrong
scale and with attention over only the first keys; a constant factor is described.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import Problem, Report, call, first_failure

TOL = 1e-9


@dataclass(frozen=True)
class SplitCase:
    length: int
    num_splits: int
    size: float  # scores grow with it: 2000 puts them past 1000, where e^lse overflows float64
    seed: int

    def describe(self) -> str:
        text = f"{self.length} keys, num_splits={self.num_splits}"
        return text + (", scores past 1000" if self.size > 1 else "")

    def inputs(self):
        g = torch.Generator().manual_seed(self.seed)
        q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
                   for shape in ((8,), (self.length, 8), (self.length, 8)))
        return q * self.size, k, v


CASES = (SplitCase(7, 1, 1.0, 0), SplitCase(7, 3, 1.0, 1), SplitCase(40, 7, 1.0, 2), SplitCase(40, 40, 1.0, 3),
         SplitCase(33, 4, 2000.0, 4))


def attention(q, k, v, scale: float | None = None):
    """softmax(k q · scale) v for one query q (d,) over k, v (L, d); scale 1/sqrt(d) by default."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(k @ q * scale, dim=0) @ v


def _splits(length: int, num_splits: int):
    size = -(-length // num_splits)
    return [(a, min(a + size, length)) for a in range(0, length, size)]


def _wrong_merges(q, k, v, num_splits):
    """(mistake, output) of the usual wrong merges of the splits' partial outputs."""
    outs, lses = [], []
    for a, b in _splits(k.shape[0], num_splits):
        s = k[a:b] @ q / math.sqrt(q.shape[-1])
        outs.append(torch.softmax(s, 0) @ v[a:b])
        lses.append(torch.logsumexp(s, 0))
    outs, lses = torch.stack(outs), torch.stack(lses)
    return [("averaged_partials", outs.mean(0)), ("unnormalised_weights", (torch.exp(lses)[:, None] * outs).sum(0)),
            ("summed_partials", outs.sum(0)), ("last_split_only", outs[-1])]


def _wrong_scales(d: int):
    return ((1.0, "unscaled_scores", "the scores are not scaled by 1/sqrt(d)."),
            (math.log2(math.e) / math.sqrt(d), "unscaled_scores",
             "the scores are scaled by log2 e too: an exp2 needs that factor, torch.exp and softmax do not."),
            (math.log(2) / math.sqrt(d), "exp2_for_exp",
             "the scores are multiplied by ln 2, as torch.exp2 of natural-log scores gives: use torch.exp."))


def _diagnose(got, q, k, v, case: SplitCase, what: str, passed: list) -> Problem:
    def same(x):
        return torch.allclose(got, x, rtol=0, atol=TOL)

    want = attention(q, k, v)
    if not torch.isfinite(got).all():
        return Problem(what, "overflow",
                       "e^lse_s overflows for large scores: weigh each split by exp(lse_s - lse), never exp(lse_s) "
                       "alone.")
    for scale, key, why in _wrong_scales(q.shape[-1]):
        if same(attention(q, k, v, scale)):
            return Problem(f"{what} That is attention with the wrong scale.", key, why)
    for n in range(1, k.shape[0]):
        if same(attention(q, k[:n], v[:n])):
            return Problem(f"{what} That is attention over the first {n} of the {k.shape[0]} keys.",
                           "dropped_last_tile", "the splits must cover every key: ceil(L / num_splits) keys each, "
                           "the last may be shorter.")
    for key, wrong in _wrong_merges(q, k, v, case.num_splits):
        if same(wrong):
            return Problem(what, key)
    factor = (got @ want / (want @ want)).item()
    if math.isfinite(factor) and not math.isclose(factor, 1.0, rel_tol=1e-6) and same(factor * want):
        return Problem(f"{what} Your output is {factor:.4g} times the right one: softmax weights, and the splits' "
                       "shares of the denominator, add up to 1.")
    if case.num_splits == 1:
        return Problem(f"{what} With one split, it holds every key, so the output is attention over all the keys: "
                       "the attention inside a split is wrong (scores k_split q / sqrt(d), softmax over the keys).")
    right = f" With {passed[0]} it is right, so each split's attention is; the merge is not." if passed else ""
    return Problem(what + right)


def _unsplit(run, case: SplitCase, head_dim: int) -> Problem | None:
    """A product over more keys than one split holds: the keys were not split (or not as asked)."""
    splits = _splits(case.length, case.num_splits)
    most = splits[0][1] - splits[0][0]
    wider = set(range(most + 1, case.length + 1)) - {len(splits), head_dim}  # key counts no split has
    seen = run.watch.computed_with(wider)
    if seen is None:
        return None
    op, shape = seen
    keys = next(n for n in shape if n in wider)
    return Problem(f"an operation ({op}) worked on a tensor of shape {shape}, {keys} keys at once, but with "
                   f"num_splits={case.num_splits} the {case.length} keys come in splits of at most {most}.",
                   "no_split")


def _case(fn, case: SplitCase, passed: list) -> Problem | None:
    q, k, v = case.inputs()
    run = call(fn, "split_kv", q.clone(), k.clone(), v.clone(), case.num_splits)
    if run.error:
        return Problem(run.error)
    unsplit = _unsplit(run, case, q.shape[0])
    if unsplit is not None:
        return unsplit
    if run.result is None:
        return Problem("split_kv returned None: return the output, a tensor of shape (d,).")
    try:
        got = torch.as_tensor(run.result, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        return Problem(f"split_kv should return a tensor of shape (8,); it returned {type(run.result).__name__} "
                       f"({error}).")
    if got.shape != (q.shape[0],):
        return Problem(f"the output has shape {tuple(got.shape)}; expected ({q.shape[0]},).")
    want = attention(q, k, v)
    if torch.allclose(got, want, rtol=0, atol=TOL):
        passed.append(case.describe())
        return None
    finite = torch.isfinite(got).all()
    what = f"the output is off by up to {(got - want).abs().max().item():.4g}." if finite else \
        "the output holds inf or NaN."
    return _diagnose(got, q, k, v, case, what, passed)


def check_split_kv(fn) -> Report:
    passed: list[str] = []
    return first_failure(CASES, lambda case: _case(fn, case, passed))
