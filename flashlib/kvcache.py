"""Before a decoding call attends: what it does to and with its KV cache (flash-attn's contract).

:func:`flashlib.decode_attention` takes the arguments of flash-attn's ``flash_attn_with_kvcache``
(in flashlib's (batch, heads, seq, dim) layout) and one more, ``cu_seqlens_q``; this module
turns them into one :class:`Batch`: every sequence's queries, where its keys live, how many of
its positions are valid, how many new tokens it has and where it starts. The reference
(:func:`flashlib.decode_reference`) and the kernels (:mod:`flashlib.kernels.decode`) then read
the same batch::

    k_new, v_new       the new tokens' keys and values, (batch, kv_heads, n_new, d): written
                       into the cache at positions cache_seqlens[b] .. + n_new - 1 (then
                       cache_seqlens counts the positions *before* the call, as flash-attn's)
    rotary_cos, _sin   (positions, rotary_dim / 2): k_new rotated at the positions it is
                       written to, q at cache_seqlens[b] + i (causal or windowed; else all at
                       cache_seqlens[b]), as flash-attn rotates them (flashlib.rotary)
    cache_batch_idx    (batch,) int32: sequence b's cache is row cache_batch_idx[b] of a pool
                       (rows, kv_heads, capacity, d), read as pages of the capacity's size
    cache_leftpad      (batch,) int32: sequence b starts there: keys before it (left padding)
                       are not seen, and a score function counts positions from it
    cu_seqlens_q       (batch + 1,) int32: q packed (total_q, q_heads, d), sequence b's new
                       tokens rows cu[b] .. cu[b+1] - 1: a mixed batch (a prefill chunk beside
                       decoding steps) in one launch; k_new, v_new then packed the same way

Queries align bottom-right: with L_b the valid positions after the append, sequence b's new
token i of n_b sits at position L_b - n_b + i (rows before position 0, when L_b < n_b, see no
key and give zeros, as flash-attn's do).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .machinery.checks import check_cu_seqlens, check_index_tensor
from .rotary import apply_rotary
from .rules import Visibility


class Batch(NamedTuple):
    """One decoding call, ready to attend: q (batch, q_heads, n_max, d), padded in a mixed batch; the
    caches and their block table (None: contiguous); seqlens, new_tokens, starts (batch,) int32: each
    sequence's valid positions (after the append), its new tokens (<= n_max) and its first position;
    unpack(out, lse) gives the caller's layout back; write() performs the append (and the rotation)
    and returns the batch that attends: :func:`prepare` leaves it for after the caller's checks of the
    values (lengths within the capacity), so that a bad call writes nothing."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor | None
    seqlens: torch.Tensor
    new_tokens: torch.Tensor
    starts: torch.Tensor
    unpack: Callable
    write: Callable


def _as_is(out, lse):
    return out, lse


def _check_same(fn, name, t, like, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != like.dtype or t.device != like.device:
        raise TypeError(f"{fn}: argument '{name}' is {t.dtype} on {t.device}; expected {like.dtype} on {like.device}, "
                        "as the cache")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fn}: argument '{name}' has shape {tuple(t.shape)}; expected {tuple(shape)}")


def _check_per_sequence(fn, name, t, batch, device, what="positions"):
    check_index_tensor(fn, name, t, device, what=what)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{fn}: argument '{name}' has shape {tuple(t.shape)}; expected ({batch},), one per sequence")


def _unpacker(seq_of, tok_of):
    """unpack(out, lse): (batch, heads, n_max, .) results back to packed (total_q, heads, d) and the lse
    to flash-attn's packed (heads, total_q)."""
    def unpack(out, lse):
        return out[seq_of, :, tok_of], lse[seq_of, :, tok_of].transpose(0, 1)
    return unpack


def prepare(fn, q, k_cache, v_cache, cache_seqlens, *, block_table=None, rule: Visibility = Visibility(causal=True),
            k_new=None, v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
            cache_batch_idx=None, cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None) -> Batch:
    """The :class:`Batch` of a call. Shapes, dtypes and devices are checked here, and the rotary tables'
    reach; the lengths against the capacity and the page numbers by the caller, after which
    ``batch.write()`` writes the new keys and values into the cache (the one side effect: in place,
    as flash-attn's) and gives the batch that attends."""
    q, unpack, cu = _queries(fn, q, cu_seqlens_q, max_seqlen_q)
    batch, q_heads, n_max, d = q.shape
    device = q.device
    if cu is None:
        new_tokens = torch.full((batch,), n_max, dtype=torch.int32, device=device)
    else:
        new_tokens = (cu[1:] - cu[:-1]).to(torch.int32)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError(f"{fn}: arguments 'cache_batch_idx' and 'block_table' were both given; a paged cache "
                             "already says where each sequence lives (its block table's rows)")
        _check_per_sequence(fn, "cache_batch_idx", cache_batch_idx, batch, device)
        # the pool's rows as pages of the capacity's size: sequence b's one page is row cache_batch_idx[b]
        block_table = cache_batch_idx.to(torch.int32).reshape(batch, 1)
    starts = torch.zeros(batch, dtype=torch.int32, device=device)
    if cache_leftpad is not None:
        _check_per_sequence(fn, "cache_leftpad", cache_leftpad, batch, device)
        starts = cache_leftpad.to(torch.int32)
    _check_per_sequence(fn, "cache_seqlens", cache_seqlens, batch, device, "lengths")
    seqlens = cache_seqlens.to(torch.int32)
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{fn}: arguments 'k_new' and 'v_new' go together: pass both or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{fn}: arguments 'rotary_cos' and 'rotary_sin' go together: pass both or neither")
    if rotary_cos is not None and k_new is None:
        raise ValueError(f"{fn}: argument 'rotary_cos' rotates the new keys as they are written: it needs 'k_new' "
                         "and 'v_new' (rotate queries and keys yourself when the cache is already filled)")
    if k_new is None:
        plain = Batch(q, k_cache, v_cache, block_table, seqlens, new_tokens, starts, unpack, None)
        return plain._replace(write=lambda: plain)
    kv_heads = k_cache.shape[1]
    dv = v_cache.shape[-1] if isinstance(v_cache, torch.Tensor) and v_cache.ndim == 4 else d
    tokens, seq_of, offsets = _new_tokens(fn, k_new, v_new, cu, batch, kv_heads, d, k_cache, dv)
    positions = seqlens.long()[seq_of] + offsets  # each new key's cache position
    moving = not rule.everything  # queries rotated at their own positions
    if rotary_cos is not None:
        _check_rotary(fn, rotary_cos, rotary_sin, d, k_cache)
        reach = max(int(positions.max()) + 1 if positions.numel() else 0,
                    int((seqlens.long() + new_tokens.long()).max()) if moving and batch else 0)
        if reach > rotary_cos.shape[0]:
            raise ValueError(f"{fn}: argument 'rotary_cos' has {rotary_cos.shape[0]} positions but the call "
                             f"rotates up to position {reach - 1}; the tables must cover every new token's")
    appended = torch.zeros(batch, dtype=torch.int32, device=device).index_add_(
        0, seq_of, torch.ones_like(seq_of, dtype=torch.int32))
    ready = Batch(q, k_cache, v_cache, block_table, seqlens + appended, new_tokens, starts, unpack, None)

    def write() -> Batch:
        keys, queries = tokens[0], ready.q
        if rotary_cos is not None:
            keys = apply_rotary(keys, rotary_cos, rotary_sin, positions[:, None], interleaved=rotary_interleaved)
            queries = _rotate_queries(queries, new_tokens, seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                                      moving=moving)
        _write(k_cache, v_cache, block_table, (keys, tokens[1]), seq_of, positions)
        return ready._replace(q=queries, write=lambda: None)

    return ready._replace(write=write)


def _queries(fn, q, cu, max_seqlen_q):
    """(q (batch, q_heads, n_max, d), unpack, cu or None): a packed q spread over one row of new tokens per
    sequence (zeros past each one's count)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{fn}: argument 'q' must be a torch.Tensor, got {type(q).__name__}")
    if cu is None:
        if q.ndim != 4:
            raise ValueError(f"{fn}: argument 'q' must have 4 dims, (batch, q_heads, new_tokens, head_dim), got shape "
                             f"{tuple(q.shape)} (a packed q needs 'cu_seqlens_q')")
        return q, _as_is, None
    if q.ndim != 3:
        raise ValueError(f"{fn}: with 'cu_seqlens_q', argument 'q' is packed, (total_q, q_heads, head_dim); got "
                         f"shape {tuple(q.shape)}")
    check_cu_seqlens(fn, "cu_seqlens_q", cu, q.shape[0], q.device)
    counts = (cu[1:] - cu[:-1]).long()
    longest = int(counts.max()) if counts.numel() else 0
    if max_seqlen_q is not None and max_seqlen_q < longest:
        raise ValueError(f"{fn}: argument 'max_seqlen_q' is {max_seqlen_q} but a sequence has {longest} new tokens")
    batch = counts.numel()
    seq_of = torch.repeat_interleave(torch.arange(batch, device=q.device), counts)
    tok_of = torch.arange(q.shape[0], device=q.device) - cu.long()[seq_of]
    padded = q.new_zeros(batch, q.shape[1], max(longest, 1), q.shape[2])
    padded[seq_of, :, tok_of] = q
    return padded, _unpacker(seq_of, tok_of), cu


def _new_tokens(fn, k_new, v_new, cu, batch, kv_heads, d, cache, dv=None):
    """((k, v) as (tokens, kv_heads, d and dv), each token's sequence, its offset among that sequence's new
    ones); dv: the value cache's head dim (d by default; MLA's differs)."""
    device = cache.device
    dv = d if dv is None else dv
    if cu is None:
        n = k_new.shape[2] if isinstance(k_new, torch.Tensor) and k_new.ndim == 4 else 0
        for name, t, width in (("k_new", k_new, d), ("v_new", v_new, dv)):
            _check_same(fn, name, t, cache, (batch, kv_heads, n, width))
        seq_of = torch.arange(batch, device=device).repeat_interleave(n)
        offsets = torch.arange(n, device=device).repeat(batch)
        tokens = tuple(t.transpose(1, 2).reshape(batch * n, kv_heads, t.shape[-1]) for t in (k_new, v_new))
        return tokens, seq_of, offsets
    total = int(cu[-1])
    for name, t, width in (("k_new", k_new, d), ("v_new", v_new, dv)):
        _check_same(fn, name, t, cache, (total, kv_heads, width))
    counts = (cu[1:] - cu[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    return (k_new, v_new), seq_of, torch.arange(total, device=device) - cu.long()[seq_of]


def _check_rotary(fn, cos, sin, d, like):
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or not t.is_floating_point():
            raise TypeError(f"{fn}: argument '{name}' must be a 2-d floating tensor (positions, rotary_dim / 2)")
        if t.device != like.device:
            raise ValueError(f"{fn}: argument '{name}' is on {t.device} but the cache is on {like.device}")
    if cos.shape != sin.shape or 2 * cos.shape[1] > d:
        raise ValueError(f"{fn}: arguments 'rotary_cos' {tuple(cos.shape)} and 'rotary_sin' {tuple(sin.shape)} must "
                         f"have one shape (positions, rotary_dim / 2) with rotary_dim <= head_dim {d}")


def _rotate_queries(q, new_tokens, seqlens, cos, sin, interleaved, *, moving: bool):
    """q (batch, heads, n_max, d) rotated as flash-attn rotates it: new token i of sequence b at
    position seqlens[b] + i when the queries move with their positions (causal, or a window), all
    at seqlens[b] otherwise."""
    steps = torch.arange(q.shape[2], device=q.device)[None, :]
    if not moving:
        steps = torch.zeros_like(steps[:, :1])
    positions = seqlens.long()[:, None] + steps  # (batch, n_max or 1)
    limit = cos.shape[0] - 1  # padding rows of a mixed batch: any row of the table, never read back
    valid = torch.arange(q.shape[2], device=q.device)[None, :] < new_tokens[:, None].long()
    positions = torch.where(valid, positions, 0).clamp(max=limit) if moving else positions.expand(valid.shape)
    return apply_rotary(q, cos, sin, positions[:, None, :], interleaved=interleaved)


def _write(k_cache, v_cache, block_table, tokens, seq_of, positions):
    """The new tokens' keys and values into the caches, in place: contiguous (batch, kv_heads, capacity, d)
    or pages through the block table."""
    if block_table is None:
        blocks, rows = seq_of, positions
    else:
        page_size = k_cache.shape[2]
        blocks = block_table.long()[seq_of, positions // page_size]
        rows = positions % page_size
    for cache, values in zip((k_cache, v_cache), tokens):
        cache[blocks, :, rows] = values.to(cache.dtype)
