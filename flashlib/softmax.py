"""Softmax three ways, and the running state that makes it streamable.

naive:  exp(x) / sum exp(x)                 overflows once x > ~88 in float32
safe:   exp(x - max x) / sum exp(x - max x)  two passes over x (max, then sum)
online: one pass keeping a running max m and denominator l, rescaling l whenever
        the max grows; two partial states merge exactly, in any grouping.

The same merge combines two partial attention outputs, each normalised over its own keys
and carried with its log-sum-exp lse = m + log l (:func:`merge_partials`): split-KV
decoding and ring attention are built on it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

NEG_INF = float("-inf")


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum(exp(x)): correct on paper, inf/inf = NaN for large x."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def safe_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax with the row max subtracted first, so every exponent is <= 0."""
    m = x.amax(dim=dim, keepdim=True)
    e = torch.exp(x - _finite(m))
    return e / e.sum(dim=dim, keepdim=True)


class SoftmaxState(NamedTuple):
    """What online softmax carries: the running max m and denominator l = sum exp(x - m)."""

    m: torch.Tensor
    l: torch.Tensor


def _finite(m: torch.Tensor) -> torch.Tensor:
    # A max of -inf means "nothing seen yet"; shifting by 0 instead keeps exp(-inf - 0) = 0
    # rather than exp(-inf - -inf) = NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def empty_state(shape, dtype=torch.float32, device=None) -> SoftmaxState:
    """The identity of :func:`merge_states`: nothing seen (m = -inf, l = 0)."""
    return SoftmaxState(torch.full(shape, NEG_INF, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))


def softmax_state(x: torch.Tensor, dim: int = -1) -> SoftmaxState:
    """The state of one chunk: m = max x, l = sum exp(x - m)."""
    m = x.amax(dim=dim) if x.shape[dim] else torch.full(
        x.sum(dim=dim).shape, NEG_INF, dtype=x.dtype, device=x.device)
    l = torch.exp(x - _finite(m).unsqueeze(dim)).sum(dim=dim)
    return SoftmaxState(m, l)


def merge_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine the states of two disjoint chunks into the state of their union.

    m = max(m_a, m_b);  l = l_a exp(m_a - m) + l_b exp(m_b - m).
    Exact, commutative and associative, so chunks may be merged in any order or tree.
    """
    m = torch.maximum(a.m, b.m)
    shift = _finite(m)
    return SoftmaxState(m, a.l * torch.exp(a.m - shift) + b.l * torch.exp(b.m - shift))


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Attention over the union of two disjoint key sets, from each set's result.

    out_a (..., seq_q, d) is softmax attention over key set A alone and lse_a (..., seq_q)
    its log-sum-exp (-inf where a row sees none of A, with out_a = 0 there); likewise B.
    With lse = log(e^lse_a + e^lse_b), each part's weight is its share of the denominator:

        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    which is :func:`merge_states` with l = 1 per part, applied to the outputs. A row empty in
    both parts keeps lse = -inf and out = 0. Returns (out, lse).
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (..., seq_q); -inf only if both are
    shift = _finite(lse)
    w_a = torch.exp(lse_a - shift).unsqueeze(-1)  # exp(-inf) = 0 for an empty part
    w_b = torch.exp(lse_b - shift).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """Attention with sinks from attention without: an attention sink (one logit per query head,
    sinks (heads,)) is a partial result with no value, out = 0 and lse = sink, merged with
    :func:`merge_partials`. It takes a share exp(sink - lse) of every row's denominator.
    out (..., heads, seq_q, d), lse (..., heads, seq_q); sinks None returns them unchanged."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).reshape(-1, 1).expand(lse.shape)  # (..., heads, seq_q)
    return merge_partials(out, lse, torch.zeros_like(out), sink)


def online_softmax(x: torch.Tensor, dim: int = -1, *, block: int = 1) -> torch.Tensor:
    """Softmax in one streaming pass for the statistics, ``block`` elements at a time.

    Pass 1 folds each chunk's state into the running (m, l); pass 2 writes
    exp(x - m) / l. Only (m, l) are kept between chunks, never the exponentials.
    """
    state = online_softmax_state(x, dim=dim, block=block)
    return torch.exp(x - _finite(state.m).unsqueeze(dim)) / state.l.unsqueeze(dim)


def online_softmax_state(x: torch.Tensor, dim: int = -1, *, block: int = 1) -> SoftmaxState:
    """The final (m, l) of a row reached by streaming over it in chunks of ``block``."""
    return online_softmax_steps(x, dim=dim, block=block)[-1].state


class OnlineStep(NamedTuple):
    """One chunk of online softmax: which elements, the state before and after, the rescale."""

    start: int
    stop: int
    previous: SoftmaxState
    state: SoftmaxState
    rescale: torch.Tensor  # exp(m_old - m_new): how much the old denominator shrinks


def online_softmax_steps(x: torch.Tensor, dim: int = -1, *, block: int = 1) -> list[OnlineStep]:
    """Every step of the streaming pass, for notebooks to replay (the last holds the final state)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"online_softmax: argument 'block' must be an int >= 1, got {block!r}")
    x = x.movedim(dim, -1)
    state = empty_state(x.shape[:-1], dtype=x.dtype, device=x.device)
    steps = [OnlineStep(0, 0, state, state, torch.ones_like(state.l))]
    for start in range(0, x.shape[-1], block):
        stop = min(start + block, x.shape[-1])
        new = merge_states(state, softmax_state(x[..., start:stop]))
        rescale = torch.exp(state.m - _finite(new.m))
        steps.append(OnlineStep(start, stop, state, new, rescale))
        state = new
    return steps
