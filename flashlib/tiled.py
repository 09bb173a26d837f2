"""Tiled attention: exact softmax(q kᵀ · scale) v without the full score matrix.

Each query block keeps three running quantities while key/value tiles stream past:

    m_i  running row max of the scores seen so far          (..., BLOCK_Q)
    l_i  running denominator, sum exp(s - m_i)               (..., BLOCK_Q)
    acc  unnormalised output, sum exp(s - m_i) v             (..., BLOCK_Q, D)

When a tile raises the max, the old l_i and acc are rescaled by alpha = exp(m_old - m_new).
Only one (BLOCK_Q, BLOCK_K) score tile exists at a time; earlier score tiles are discarded,
and only their running statistics and weighted output contribution remain.

The differentiable ``tiled_attention`` lives in ``flashlib/backward.py``, with the backward
pass it needs (notebook 04); this module is the forward alone.

Two loop orders compute the same result:
  loop="query": outer loop over query blocks (FlashAttention-2); acc is normalised once.
  loop="key":   outer loop over key/value tiles (the paper's Algorithm 1); O, l and m for
                every row live in "HBM" and are read, updated and written back per tile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ._checks import check_attention_inputs, check_block, check_loop
from .dense import causal_mask

NEG_INF = float("-inf")


def _finite(m: torch.Tensor) -> torch.Tensor:
    # m = -inf means the row has seen no visible key yet: shift by 0 so exp(-inf) = 0, not NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def _tile_visible(q0, q1, k0, k1, seq_q, seq_k, causal):
    """None if every pair in the tile is visible, else its (q1-q0, k1-k0) boolean mask."""
    if not causal:
        return None
    offset = seq_k - seq_q  # bottom-right alignment: query i sees key j <= i + offset
    if k1 - 1 <= q0 + offset:
        return None
    return causal_mask(seq_q, seq_k, device=None)[q0:q1, k0:k1]


def _key_range_end(q0, q1, seq_q, seq_k, causal) -> int:
    """One past the last key that query rows q0:q1 can see: tiles from there on are skipped."""
    if not causal:
        return seq_k
    return min(max(q1 + (seq_k - seq_q), 0), seq_k)  # the last row, q1 - 1, sees keys <= q1 - 1 + offset


def _tile_skipped(q0, q1, k0, seq_q, seq_k, causal) -> bool:
    """True when no query in rows q0:q1 sees any key from k0 on: the tile is never computed."""
    return k0 >= _key_range_end(q0, q1, seq_q, seq_k, causal)


def _score_tile(q_blk, k_tile, scale, visible):
    s = (q_blk @ k_tile.transpose(-2, -1)) * scale  # (B, H, BLOCK_Q, BLOCK_K)
    if visible is not None:
        s = s.masked_fill(~visible.to(s.device), NEG_INF)
    return s


def _online_update(m_i, l_i, acc, s, v_tile):
    """Fold one score tile into the running (m_i, l_i, acc) of its query block."""
    m_new = torch.maximum(m_i, s.amax(dim=-1))  # (B, H, BLOCK_Q)
    shift = _finite(m_new)
    alpha = torch.exp(m_i - shift)  # rescales what was accumulated under the old max
    p = torch.exp(s - shift.unsqueeze(-1))  # (B, H, BLOCK_Q, BLOCK_K), unnormalised
    l_i = alpha * l_i + p.sum(dim=-1)
    acc = alpha.unsqueeze(-1) * acc + p @ v_tile  # (B, H, BLOCK_Q, D)
    return m_new, l_i, acc


def _normalise(acc, l_i):
    """acc / l_i; a row that saw no visible key has l_i == 0 and acc == 0, and gets 0."""
    empty = l_i == 0  # NaN is not 0: a NaN row stays NaN
    return acc / torch.where(empty, 1.0, l_i).unsqueeze(-1)


def _finish(m_i, l_i, acc):
    """Normalise once at the end; a row that saw no key (l_i == 0) gives out = 0 and lse = -inf."""
    empty = l_i == 0
    l_safe = torch.where(empty, 1.0, l_i)
    lse = torch.where(empty, NEG_INF, m_i + torch.log(l_safe))
    return acc / l_safe.unsqueeze(-1), lse


def _compute_dtype(dtype):
    # Half-precision inputs accumulate in float32, as the fused kernel does.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _query_major(q, k, v, block_q, block_k, causal, scale, on_step=None):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    out = torch.empty_like(q)
    lse = torch.empty(*lead, seq_q, dtype=q.dtype, device=q.device)
    for q0 in range(0, seq_q, block_q):
        q1 = min(q0 + block_q, seq_q)
        q_blk = q[..., q0:q1, :]  # stays resident for the whole inner loop
        m_i = torch.full((*lead, q1 - q0), NEG_INF, dtype=q.dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_blk)
        k_end = _key_range_end(q0, q1, seq_q, seq_k, causal)
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, seq_k)
            k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]
            s = _score_tile(q_blk, k_tile, scale, _tile_visible(q0, q1, k0, k1, seq_q, seq_k, causal))
            m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile)
            if on_step is not None:
                on_step((q0, q1), (k0, k1), s, m_i, l_i, acc)
        out[..., q0:q1, :], lse[..., q0:q1] = _finish(m_i, l_i, acc)
    return out, lse


def _key_major(q, k, v, block_q, block_k, causal, scale, on_step=None):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    # Algorithm 1 keeps the normalised O and the statistics of every row in HBM.
    o = torch.zeros_like(q)
    l = torch.zeros(*lead, seq_q, dtype=q.dtype, device=q.device)
    m = torch.full_like(l, NEG_INF)
    for k0 in range(0, seq_k, block_k):
        k1 = min(k0 + block_k, seq_k)
        k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]  # loaded once per outer step
        for q0 in range(0, seq_q, block_q):
            q1 = min(q0 + block_q, seq_q)
            if _tile_skipped(q0, q1, k0, seq_q, seq_k, causal):
                continue
            s = _score_tile(q[..., q0:q1, :], k_tile, scale, _tile_visible(q0, q1, k0, k1, seq_q, seq_k, causal))
            m_i, l_i = m[..., q0:q1], l[..., q0:q1]
            acc = o[..., q0:q1, :] * l_i.unsqueeze(-1)  # un-normalise what HBM holds
            m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile)
            o[..., q0:q1, :] = _normalise(acc, l_i)
            m[..., q0:q1], l[..., q0:q1] = m_i, l_i  # write the statistics back
            if on_step is not None:
                on_step((q0, q1), (k0, k1), s, m_i, l_i, acc)
    return _finish(m, l, o * l.unsqueeze(-1))


def tiled_forward(q, k, v, *, block_q=64, block_k=64, causal=False, scale=None, loop="query",
                  on_step: Callable | None = None, fn: str = "tiled_forward"):
    """The tiled forward pass without autograd: returns (out, lse).

    ``lse`` (..., seq_q) is the log-sum-exp of each score row, m_i + log(l_i): all the
    backward pass needs to recompute the probabilities. ``on_step`` is called after every
    computed tile with ((q0, q1), (k0, k1), s, m_i, l_i, acc); traces use it.
    """
    scale = check_attention_inputs(fn, q, k, v, causal=causal, scale=scale)
    block_q = check_block(fn, "block_q", block_q)
    block_k = check_block(fn, "block_k", block_k)
    loop = check_loop(fn, loop)
    work = _compute_dtype(q.dtype)
    run = _query_major if loop == "query" else _key_major
    out, lse = run(q.to(work), k.to(work), v.to(work), block_q, block_k, causal, scale, on_step)
    return out.to(q.dtype), lse.float() if work != torch.float64 else lse


@dataclass
class TileStep:
    """One computed tile of the schedule, as the notebooks and widgets replay it.

    Tensors are for the first index of every leading dim (one batch, one head).
    """

    index: int
    rows: tuple[int, int]        # query rows [start, stop)
    cols: tuple[int, int]        # key columns [start, stop)
    scores: torch.Tensor         # (rows, cols) score tile, masked entries -inf
    m: torch.Tensor              # (rows,) running max after this tile
    l: torch.Tensor              # (rows,) running denominator
    acc: torch.Tensor            # (rows, D) unnormalised output
    partial: torch.Tensor        # (rows, D) acc / l: the output from the keys seen so far
    distance: float = 0.0        # max |partial - final output| over these rows
    tile_elements: int = 0       # score elements held for this tile
    full_elements: int = 0       # elements of the full (seq_q, seq_k) score matrix


@dataclass
class TiledTrace:
    """The whole schedule of one tiled forward pass, with its inputs and output."""

    steps: list[TileStep]
    out: torch.Tensor            # (seq_q, D) final output, first batch/head
    seq_q: int
    seq_k: int
    block_q: int
    block_k: int
    loop: str
    causal: bool
    skipped: list[tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=list)


def trace_tiled_attention(q, k, v, *, block_q=2, block_k=2, causal=False, scale=None,
                          loop="query") -> TiledTrace:
    """Run the tiled forward and record every step (see :class:`TileStep`)."""
    fn = "trace_tiled_attention"
    records = []

    lead = q.ndim - 2 if isinstance(q, torch.Tensor) else 0

    def first(t):  # first batch/head only: what a figure shows
        return t.reshape(-1, *t.shape[lead:])[0].clone()

    def on_step(rows, cols, s, m_i, l_i, acc):
        records.append((rows, cols, first(s), first(m_i), first(l_i), first(acc)))

    with torch.no_grad():
        out, _ = tiled_forward(q, k, v, block_q=block_q, block_k=block_k, causal=causal,
                               scale=scale, loop=loop, on_step=on_step, fn=fn)
    final = out.reshape(-1, *out.shape[-2:])[0].to(records[0][5].dtype if records else out.dtype)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    steps = []
    for i, (rows, cols, s, m_i, l_i, acc) in enumerate(records):
        partial = _normalise(acc, l_i)
        dist = (partial - final[rows[0]:rows[1]]).abs().max().item() if partial.numel() else 0.0
        steps.append(TileStep(i, rows, cols, s, m_i, l_i, acc, partial, dist,
                              s.numel(), seq_q * seq_k))
    block_q, block_k = check_block(fn, "block_q", block_q), check_block(fn, "block_k", block_k)
    skipped = [((q0, min(q0 + block_q, seq_q)), (k0, min(k0 + block_k, seq_k)))
               for q0 in range(0, seq_q, block_q) for k0 in range(0, seq_k, block_k)
               if _tile_skipped(q0, min(q0 + block_q, seq_q), k0, seq_q, seq_k, causal)]
    return TiledTrace(steps, final, seq_q, seq_k, block_q, block_k, loop, causal, skipped)
