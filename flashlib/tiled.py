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
import torch.nn.functional as F

from .machinery.checks import check_block, check_chunk, check_loop, check_mask_mod, check_window
from .dense import batch_and_heads, expand_kv, head_indices
from .rules import (FULL, PARTIAL, SKIPPED, BlockMask, Scoring, Visibility, key_range_end, key_range_start,  # noqa: F401
                    query_range, tile_kinds)
from .machinery.options import Options, check_options

NEG_INF = float("-inf")


def _finite(m: torch.Tensor) -> torch.Tensor:
    # m = -inf means the row has seen no visible key yet: shift by 0 so exp(-inf) = 0, not NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def _tile_visible(rule: Visibility, q0, q1, k0, k1, seq_q, seq_k, like):
    """None if every pair in the tile is visible, else its boolean mask, broadcastable to the
    tile's (batch, heads, q1-q0, k1-k0) scores. like: the (batch, heads, seq_q, d) queries."""
    if rule.everything:
        return None
    rows = torch.arange(q0, q1, device=like.device)[:, None]
    cols = torch.arange(k0, k1, device=like.device)[None, :]
    visible = rule.pairs(rows, cols, seq_q, seq_k, *head_indices(like.shape[0], like.shape[1], like.device))
    return None if bool(visible.all()) else visible


def _skipped(visible) -> bool:
    """True for a tile of which no pair is visible: a block mask skips it, nothing is computed."""
    return visible is not None and not bool(visible.any())


# the tile ranges are the course's rule (flashlib.rules), under the names notebook 06 shows
_key_range_end, _key_range_start, _query_range = key_range_end, key_range_start, query_range


def _scores(q_blk, k_tile, scoring: Scoring, q0=0, k0=0):
    """(B, H, BLOCK_Q, BLOCK_K) scores of queries q0.. and keys k0..: scale * q kᵀ, through the score
    function if there is one (soft-capping is one: flashlib.scores)."""
    return scoring.tile(q_blk, k_tile, q0, k0)


def _score_tile(q_blk, k_tile, scoring: Scoring, visible, q0=0, k0=0):
    """The scores of one tile, pairs that may not attend -inf."""
    s = _scores(q_blk, k_tile, scoring, q0, k0)
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


def _start(lead, rows, sinks, like):
    """(m_i, l_i) of a query block before its first tile: nothing seen (-inf, 0), or with attention
    sinks (one logit per head, sinks (H,)) the sink already counted as one score with no value:
    m_i = sink and l_i = exp(sink - m_i) = 1, while acc stays 0."""
    m_i = torch.full((*lead, rows), NEG_INF, dtype=like.dtype, device=like.device)
    if sinks is None:
        return m_i, torch.zeros_like(m_i)
    m_i = m_i.copy_(sinks.to(like.dtype)[:, None].expand(m_i.shape))  # lead = (B, H): row r of head h gets sinks[h]
    return m_i, torch.ones_like(m_i)


def _compute_dtype(dtype):
    # Half-precision inputs accumulate in float32, as the fused kernel does.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _query_major(q, k, v, block_q, block_k, rule, scoring, on_step=None, sinks=None):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    out = q.new_empty(*lead, seq_q, v.shape[-1])  # v's head dim (MLA's differs from q's)
    lse = torch.empty(*lead, seq_q, dtype=q.dtype, device=q.device)
    for q0 in range(0, seq_q, block_q):
        q1 = min(q0 + block_q, seq_q)
        q_blk = q[..., q0:q1, :]  # stays resident for the whole inner loop
        m_i, l_i = _start(lead, q1 - q0, sinks, q)
        acc = q_blk.new_zeros(*lead, q1 - q0, v.shape[-1])
        k_end = _key_range_end(q0, q1, seq_q, seq_k, rule)
        k_start = _key_range_start(q0, seq_q, seq_k, rule, block_k)
        for k0 in range(k_start, k_end, block_k):
            k1 = min(k0 + block_k, seq_k)
            visible = _tile_visible(rule, q0, q1, k0, k1, seq_q, seq_k, q)
            if _skipped(visible):
                continue  # the block mask: no pair of this tile may attend
            k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]
            s = _score_tile(q_blk, k_tile, scoring, visible, q0, k0)
            m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile)
            if on_step is not None:
                on_step((q0, q1), (k0, k1), s, m_i, l_i, acc)
        out[..., q0:q1, :], lse[..., q0:q1] = _finish(m_i, l_i, acc)
    return out, lse


def _key_major(q, k, v, block_q, block_k, rule, scoring, on_step=None, sinks=None):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    # Algorithm 1 keeps the normalised O and the statistics of every row in HBM.
    o = q.new_zeros(*lead, seq_q, v.shape[-1])
    m, l = _start(lead, seq_q, sinks, q)
    for k0 in range(0, seq_k, block_k):
        k1 = min(k0 + block_k, seq_k)
        k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]  # loaded once per outer step
        q_start, q_end = _query_range(k0, k1, seq_q, seq_k, rule, block_q)
        for q0 in range(q_start, q_end, block_q):
            q1 = min(q0 + block_q, seq_q)
            visible = _tile_visible(rule, q0, q1, k0, k1, seq_q, seq_k, q)
            if _skipped(visible):
                continue
            s = _score_tile(q[..., q0:q1, :], k_tile, scoring, visible, q0, k0)
            m_i, l_i = m[..., q0:q1], l[..., q0:q1]
            acc = o[..., q0:q1, :] * l_i.unsqueeze(-1)  # un-normalise what HBM holds
            m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile)
            o[..., q0:q1, :] = _normalise(acc, l_i)
            m[..., q0:q1], l[..., q0:q1] = m_i, l_i  # write the statistics back
            if on_step is not None:
                on_step((q0, q1), (k0, k1), s, m_i, l_i, acc)
    return _finish(m, l, o * l.unsqueeze(-1))


def canonical(t: torch.Tensor) -> torch.Tensor:
    """(..., heads, seq, d) -> (batch, heads, seq, d): the shape every tile is computed in."""
    return t.reshape(*batch_and_heads(t.shape), *t.shape[-2:])


def tiled_forward(q, k, v, *, block_q=64, block_k=64, causal=False, scale=None, loop="query", window=None,
                  softcap=None, mask_mod=None, sinks=None, on_step: Callable | None = None, fn: str = "tiled_forward",
                  score_mod=None, attention_chunk=None):
    """The tiled forward pass without autograd: returns (out, lse).

    ``lse`` (..., seq_q) is the log-sum-exp of each score row, m_i + log(l_i): all the
    backward pass needs to recompute the probabilities. ``on_step`` is called after every
    computed tile with ((q0, q1), (k0, k1), s, m_i, l_i, acc), tensors (batch, heads, ...);
    traces use it. window, attention_chunk, softcap, mask_mod, sinks, score_mod and grouped k, v: as
    :func:`flashlib.tiled_attention`.
    """
    options = check_options(fn, q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            mask_mod=mask_mod, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk,
                            value_dim=True)
    tiles = check_block(fn, "block_q", block_q), check_block(fn, "block_k", block_k), check_loop(fn, loop)
    return forward_pass(q, k, v, options, tiles, on_step)


def forward_pass(q, k, v, options: Options, tiles, on_step=None):
    """:func:`tiled_forward` on checked options; tiles: (block_q, block_k, loop)."""
    block_q, block_k, loop = tiles
    work = _compute_dtype(q.dtype)
    run = _query_major if loop == "query" else _key_major
    qc = canonical(q)
    kc, vc = (expand_kv(canonical(t), qc.shape[1]) for t in (k, v))  # query head h reads kv head h // group
    sinks = options.sinks
    out, lse = run(qc.to(work), kc.to(work), vc.to(work), block_q, block_k, options.visibility, options.scoring,
                   on_step, None if sinks is None else sinks.to(work))
    out, lse = out.reshape(*q.shape[:-1], v.shape[-1]).to(q.dtype), lse.reshape(q.shape[:-1])
    return out, lse.float() if work != torch.float64 else lse


# a block mask is evaluated in chunks of query rows holding about this many pairs
_CHUNK_PAIRS = 1 << 22


def block_mask(seq_q: int, seq_k: int, *, block_q: int = 64, block_k: int = 64, causal: bool = False,
               window=None, mask_mod=None, batch: int = 1, heads: int = 1, device=None,
               attention_chunk=None) -> BlockMask:
    """The tiles that a (block_q, block_k) tiling computes for this mask (:class:`BlockMask`).

    The mask (:class:`flashlib.rules.Visibility`) is evaluated on index tensors, a chunk of
    query blocks at a time, and reduced per tile: O(seq_q * seq_k) work, O(tiles) memory."""
    fn = "block_mask"
    rule = Visibility(bool(causal), check_window(fn, window), check_mask_mod(fn, mask_mod, device, built_on=True),
                      check_chunk(fn, attention_chunk))
    block_q, block_k = check_block(fn, "block_q", block_q), check_block(fn, "block_k", block_k)
    b, h = head_indices(batch, heads, device)
    cols = torch.arange(seq_k, device=device)[None, :]
    step = block_q * max(1, _CHUNK_PAIRS // max(1, block_q * seq_k * (batch * heads if mask_mod else 1)))
    parts = [tile_kinds(rule.pairs(rows, cols, seq_q, seq_k, b, h), rows.shape[0], seq_k, block_q, block_k)
             for rows in (torch.arange(q0, min(q0 + step, seq_q), device=device)[:, None]
                          for q0 in range(0, seq_q, step))]
    kinds = torch.cat(parts, dim=2) if parts else torch.zeros(1, 1, 0, -(-seq_k // block_k), dtype=torch.uint8)
    return BlockMask(kinds.to(device), seq_q, seq_k, block_q, block_k, rule)


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
                          loop="query", window=None, softcap=None, mask_mod=None, score_mod=None,
                          attention_chunk=None) -> TiledTrace:
    """Run the tiled forward and record every step (see :class:`TileStep`); the tiles it never
    computed (above the causal diagonal, outside the window, or skipped by the block mask) are
    listed in ``skipped``."""
    fn = "trace_tiled_attention"
    records = []

    def on_step(rows, cols, s, m_i, l_i, acc):  # first batch row and head only: what a figure shows
        records.append((rows, cols, *(t[0, 0].clone() for t in (s, m_i, l_i, acc))))

    with torch.no_grad():
        out, _ = tiled_forward(q, k, v, block_q=block_q, block_k=block_k, causal=causal, scale=scale, loop=loop,
                               window=window, softcap=softcap, mask_mod=mask_mod, on_step=on_step, fn=fn,
                               score_mod=score_mod, attention_chunk=attention_chunk)
    final = out.reshape(-1, *out.shape[-2:])[0].to(records[0][5].dtype if records else out.dtype)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    steps = []
    for i, (rows, cols, s, m_i, l_i, acc) in enumerate(records):
        partial = _normalise(acc, l_i)
        dist = (partial - final[rows[0]:rows[1]]).abs().max().item() if partial.numel() else 0.0
        steps.append(TileStep(i, rows, cols, s, m_i, l_i, acc, partial, dist,
                              s.numel(), seq_q * seq_k))
    computed = {(step.rows, step.cols) for step in steps}
    skipped = [tile for tile in (((q0, min(q0 + block_q, seq_q)), (k0, min(k0 + block_k, seq_k)))
                                 for q0 in range(0, seq_q, block_q) for k0 in range(0, seq_k, block_k))
               if tile not in computed]
    return TiledTrace(steps, final, seq_q, seq_k, block_q, block_k, loop, causal, skipped)
