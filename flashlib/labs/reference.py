"""What the lab checkers compare with: attention and its gradients from the definitions, in float64.

Every function takes the visibility matrix explicitly, so that the same few lines also
compute what a known mistake produces (a top-left diagonal, a dropped last tile, a missing
term), and a checker can recognise the mistake by its result.
"""
from __future__ import annotations

import torch

from ..kernels.config import LOG2E

NEG_INF = float("-inf")


def visible(seq_q: int, seq_k: int, causal: bool, *, top_left: bool = False, strict: bool = False,
            keys: int | None = None, queries: int | None = None) -> torch.Tensor:
    """(seq_q, seq_k) bool: True where query i sees key j.

    Causal is aligned bottom-right (query i sees key j <= i + seq_k - seq_q) unless ``top_left``;
    ``strict`` drops the diagonal itself (j < i + seq_k - seq_q); ``keys`` / ``queries`` keep only the
    first that many keys / query rows (a dropped last tile).
    """
    i = torch.arange(seq_q)[:, None]
    j = torch.arange(seq_k)[None, :]
    mask = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if causal:
        diagonal = i + (0 if top_left else seq_k - seq_q)
        mask = j < diagonal if strict else j <= diagonal
    if keys is not None:
        mask = mask & (j < keys)
    if queries is not None:
        mask = mask & (i < queries)
    return mask


def scores(q, k, scale: float, mask) -> torch.Tensor:
    """S = q kᵀ · scale in float64, -inf where the pair is not visible; (batch, heads, seq_q, seq_k)."""
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    return s.masked_fill(~mask, NEG_INF)


def _shift(lse):
    # A row that sees no key has lse = -inf: shift it by +inf so that exp(-inf - inf) = 0, not NaN.
    return torch.where(lse == NEG_INF, float("inf"), lse)


def attention(q, k, v, scale: float, mask):
    """(out, lse) of softmax attention; a row that sees no key gives out = 0 and lse = -inf."""
    s = scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # (batch, heads, seq_q)
    p = torch.exp(s - _shift(lse)[..., None])
    return p @ v.double(), lse


def probabilities(q, k, lse, scale: float, mask, *, units: str = "natural"):
    """P = exp(S - lse) recomputed from a saved lse, as the backward pass does.

    ``units`` models the unit mistakes: "lse_natural" is 2^(S log2 e - lse), scores in base 2 but lse
    left natural; "exp_natural" is exp(S log2 e - lse log2 e), both in base 2 but the natural exp
    taken; "exp2" is 2^(S - lse), base 2 where the natural exp is meant.
    """
    s = scores(q, k, scale, mask)
    shift = _shift(lse.double())[..., None]
    if units == "lse_natural":
        return torch.exp2(s * LOG2E - shift)
    if units == "exp_natural":
        return torch.exp((s - shift) * LOG2E)
    if units == "exp2":
        return torch.exp2(s - shift)
    return torch.exp(s - shift)


def gradients(p, q, k, v, out, dout, scale: float, *, delta: bool | list[int] = True, scale_dq: float = 1.0,
              scale_dk: float = 1.0):
    """(dq, dk, dv) of attention from its probabilities p (batch, heads, seq_q, seq_k), in float64.

    dS = P ∘ (dP - delta) with delta = rowsum(dO ∘ O). The options model mistakes: ``delta=False``
    drops the term, ``delta=widths`` takes it from each key tile's own P ∘ dP (tiles of those widths);
    ``scale_dq`` / ``scale_dk`` are the power of the scale in dq / dk (1 right, 0 not scaled, 2 twice).
    """
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    if isinstance(delta, list):  # (batch, heads, seq_q, seq_k): each tile's own rowsum, spread over the tile
        row_term = torch.cat([(pt * dpt).sum(dim=-1, keepdim=True).expand_as(pt) for pt, dpt in
                              zip(p.split(delta, dim=-1), dp.split(delta, dim=-1))], dim=-1)
    else:
        row_term = (dout * out).sum(dim=-1, keepdim=True) if delta else 0.0
    ds = p * (dp - row_term)
    dq = (ds @ k) * scale ** scale_dq
    dk = (ds.transpose(-2, -1) @ q) * scale ** scale_dk
    return dq, dk, dv


def softmax_state(s):
    """(m, l) of each row of s (..., n): its max and sum exp(s - m); (-inf, 0) for a row of -inf."""
    m = s.amax(dim=-1)
    return m, torch.exp(s - torch.where(m == NEG_INF, 0.0, m)[..., None]).sum(dim=-1)


def max_moves(s, widths) -> torch.Tensor:
    """Rows whose running max grows after their first tile: (...) bool, from s (..., n) cut in ``widths``."""
    tile_max = torch.stack([t.amax(dim=-1) for t in s.split(list(widths), dim=-1)], dim=-1)
    running = tile_max.cummax(dim=-1).values
    return (tile_max[..., 1:] > running[..., :-1]).any(dim=-1)


def tile_widths(n: int, block: int) -> list[int]:
    """The widths of the tiles that cover n columns, the last one possibly shorter."""
    return [min(block, n - start) for start in range(0, n, block)]


def fold_tiles(s, v, widths, rescale=torch.exp):
    """(out, lse) of the online loop over key tiles of s (batch, heads, seq_q, seq_k) and v, in float64.

    ``rescale(m_old - m_new)`` is the factor what was accumulated gets when the max moves; exp is
    right, anything else models a mistake in it.
    """
    m = torch.full(s.shape[:-1], NEG_INF, dtype=torch.float64)
    l, acc = torch.zeros_like(m), torch.zeros(*s.shape[:-1], v.shape[-1], dtype=torch.float64)
    for s_tile, v_tile in zip(s.split(list(widths), dim=-1), v.double().split(list(widths), dim=-2)):
        m_new = torch.maximum(m, s_tile.amax(dim=-1))
        shift = torch.where(m_new == NEG_INF, 0.0, m_new)
        alpha = rescale(m - shift)
        p = torch.exp(s_tile - shift[..., None])
        l, acc, m = alpha * l + p.sum(dim=-1), alpha[..., None] * acc + p @ v_tile, m_new
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    return acc / l_safe[..., None], torch.where(empty, NEG_INF, m + torch.log(l_safe))
