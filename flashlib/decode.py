"""Decoding with a KV cache: a few new queries against a long cache, cut into chunks and merged.

A model that generates text runs one step per new token. The keys and values of earlier
positions never change, so they are kept in a **KV cache** and each step computes q, k, v for
its new tokens only, appends k and v to the cache and attends over all of it. Per step, the
work is a few query rows against L cached keys: the cache is read once, and each byte of it
takes part in only a few multiply-adds, so decoding is bound by memory bandwidth.

Conventions (flash-attn's ``flash_attn_with_kvcache``, vLLM's paged cache):

    q              (batch, q_heads, new_tokens, head_dim)   the new tokens' queries
    k/v cache      (batch, kv_heads, capacity, head_dim)    contiguous: a slot per position
                   (num_pages, kv_heads, page_size, head_dim) with block_table (batch, max_pages)
                   int32: position j of sequence b lives in page block_table[b, j // page_size]
    cache_seqlens  (batch,) int32: valid positions of each sequence, its new tokens included;
                   with o = cache_seqlens[b] - new_tokens, query i sits at position o + i and
                   sees key j iff j <= o + i (and j >= o + i - left with window=(left, right))
    GQA            q_heads a multiple of kv_heads; query head h reads kv head h // (q_heads // kv_heads)

Split-KV (Flash-Decoding): each sequence's visible keys are cut into ``num_splits`` chunks
(:func:`split_bounds`); each chunk gives a partial output and its log-sum-exp, and notebook 02's
:func:`flashlib.merge_partials` combines them. :func:`decode_reference` does this in plain PyTorch
(a loop over chunks); :func:`decode_attention` runs the two Triton kernels of
:mod:`flashlib.kernels.decode` (compiled on a GPU, interpreted on a CPU), imported on first use.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple

import torch

from ._checks import check_index_tensor, check_score_mod, check_sinks, check_softcap, check_window, resolve_scale
from .rules import Visibility, key_range_start
from .options import Options
from .rules import Scoring
from .scores import softcap as softcap_score
from .softmax import merge_partials, merge_sink

FN = "decode_attention"
REFERENCE_FN = "decode_reference"


class DecodeArgs(NamedTuple):
    """The checked options of one call."""

    scale: float
    score_mod: Callable | None  # the score function (flashlib.scores; soft-capping is one), or None
    window_left: int     # -1: no limit to the left
    paged: bool
    page_size: int       # paged: the page size; contiguous: the capacity (one "page" per sequence)
    capacity: int        # positions a sequence can hold: capacity, or max_pages * page_size


# ----- checks ---------------------------------------------------------------------------

def _check_tensor(fn, name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{fn}: argument '{name}' must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_int32(fn, name, t, shape, device, what):
    """An index tensor the kernels read: int32, any strides (decode_forward makes it contiguous)."""
    check_index_tensor(fn, name, t, device, what=what)
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: argument '{name}' has shape {tuple(t.shape)}; expected {shape}")


def _check_caches(fn, q, k_cache, v_cache, block_table):
    """Shapes, dtypes and devices of q and the caches; returns (page_size, capacity)."""
    _check_tensor(fn, "q", q, 4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(fn, name, t, 4)
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: argument '{name}' has dtype {t.dtype} but 'q' has {q.dtype}; "
                            "cast q and the caches to one dtype")
        if t.device != q.device:
            raise ValueError(f"{fn}: argument '{name}' is on {t.device} but 'q' is on {q.device}; "
                             "move q and the caches to one device")
    if not q.is_floating_point():
        raise TypeError(f"{fn}: argument 'q' has dtype {q.dtype}; expected a floating-point dtype")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: arguments 'k_cache' {tuple(k_cache.shape)} and 'v_cache' "
                         f"{tuple(v_cache.shape)} must have the same shape")
    batch, q_heads, _, head_dim = q.shape
    blocks, kv_heads, block_len, cache_dim = k_cache.shape
    if cache_dim != head_dim or head_dim < 1:
        raise ValueError(f"{fn}: argument 'k_cache' has head_dim {cache_dim} but 'q' has {head_dim}; "
                         "they must be equal and >= 1")
    if q_heads and kv_heads < 1:
        raise ValueError(f"{fn}: argument 'k_cache' has 0 heads but 'q' has {q_heads}; each query head needs a "
                         "key/value head to read")
    if q_heads and q_heads % kv_heads:  # no query heads: an empty result, as with an empty batch
        raise ValueError(f"{fn}: argument 'q' has {q_heads} heads and 'k_cache' {kv_heads}; the query "
                         "heads must be a multiple of the key/value heads (grouped-query attention)")
    if block_table is None:
        if blocks != batch:
            raise ValueError(f"{fn}: argument 'k_cache' holds {blocks} sequences but 'q' has batch {batch}; "
                             "a contiguous cache is (batch, kv_heads, capacity, head_dim) (pass "
                             "'block_table' for a paged cache)")
        return block_len, block_len
    _check_tensor(fn, "block_table", block_table, 2)
    _check_int32(fn, "block_table", block_table, (batch, block_table.shape[1]), q.device, "page numbers")
    if blocks < 1 or block_len < 1:
        raise ValueError(f"{fn}: argument 'k_cache' has shape {tuple(k_cache.shape)}; a paged cache is "
                         "(num_pages >= 1, kv_heads, page_size >= 1, head_dim)")
    return block_len, block_table.shape[1] * block_len


def _check_num_splits(fn, num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"{fn}: argument 'num_splits' must be None or an int >= 1, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"{fn}: argument 'num_splits' is {num_splits}; it must be >= 1 (or None to choose)")
    return int(num_splits)


def check_decode_inputs(fn, q, k_cache, v_cache, cache_seqlens, *, scale, softcap, window, block_table,
                        num_splits, score_mod=None) -> DecodeArgs:
    """Everything about a call that its shapes, dtypes and options say (no values read)."""
    page_size, capacity = _check_caches(fn, q, k_cache, v_cache, block_table)
    _check_tensor(fn, "cache_seqlens", cache_seqlens, 1)
    _check_int32(fn, "cache_seqlens", cache_seqlens, (q.shape[0],), q.device, "lengths")
    _check_num_splits(fn, num_splits)
    score_mod = check_score_mod(fn, score_mod, softcap)
    cap = check_softcap(fn, softcap)
    return DecodeArgs(resolve_scale(fn, scale, q.shape[-1]), score_mod or (softcap_score(cap) if cap else None),
                      check_window(fn, window)[0], block_table is not None, page_size, capacity)


def check_decode_values(fn, cache_seqlens, block_table, new_tokens: int, args: DecodeArgs, num_pages: int):
    """The checks that read the lengths and the block table: one transfer from the device."""
    lengths = cache_seqlens.long()
    flags = [(lengths < new_tokens).any(), (lengths > args.capacity).any()]
    bad_pages = None
    if args.paged:
        pages = torch.arange(block_table.shape[1], device=lengths.device)
        used = pages[None, :] < (lengths[:, None] + args.page_size - 1).clamp(min=0) // args.page_size
        bad_pages = used & ((block_table < 0) | (block_table >= num_pages))
        flags.append(bad_pages.any())
    if not any(torch.stack(flags).tolist()):
        return
    values = lengths.tolist()
    short = [(b, n) for b, n in enumerate(values) if n < new_tokens]
    if short:
        raise ValueError(f"{fn}: argument 'cache_seqlens' is {short[0][1]} for sequence {short[0][0]}, fewer than "
                         f"the {new_tokens} new tokens in 'q'; it counts every valid position, the new tokens "
                         "included (append their keys and values to the cache first)")
    long = [(b, n) for b, n in enumerate(values) if n > args.capacity]
    if long:
        raise ValueError(f"{fn}: argument 'cache_seqlens' is {long[0][1]} for sequence {long[0][0]}, more than the "
                         f"cache holds ({args.capacity} positions); grow the cache"
                         + (" or its block table" if args.paged else ""))
    b, j = (int(x) for x in bad_pages.nonzero()[0])
    raise ValueError(f"{fn}: argument 'block_table' sends page {j} of sequence {b} to page "
                     f"{int(block_table[b, j])}, outside the cache's {num_pages} pages; entries for the pages a "
                     f"sequence uses must lie in 0..{num_pages - 1}")


def _check_inference(fn, *tensors):
    if torch.is_grad_enabled():
        for name, t in zip(("q", "k_cache", "v_cache", "sinks"), tensors):
            if t is not None and t.requires_grad:
                raise ValueError(f"{fn}: argument '{name}' requires grad, but decoding is inference only "
                                 "(there is no backward); call it under torch.no_grad() or "
                                 f"torch.inference_mode(), or pass {name}.detach()")


# ----- the pieces the reference and the kernels share -------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_bounds(seqlen: int, new_tokens: int, num_splits: int, *, window_left: int = -1,
                 block: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each of the ``num_splits`` chunks of one sequence's keys.

    The keys any of its queries can see, [first, seqlen) (first = 0, or where the window of the
    first new token starts, rounded down to a multiple of ``block``), are cut into chunks of
    ceil(span / num_splits) keys rounded up to a multiple of ``block`` (the kernels' BLOCK_K, so
    that no tile straddles two chunks); trailing chunks may be empty (start == stop).
    """
    # the new tokens are the last queries of the cache: the forward's rule with seq_q = new_tokens,
    # seq_k = seqlen, causal, window (left, 0); its first row's key range
    first = key_range_start(0, new_tokens, seqlen, Visibility(True, (window_left, -1)), block)
    chunk = _cdiv(_cdiv(seqlen - first, num_splits), block) * block
    starts = [min(first + s * chunk, seqlen) for s in range(num_splits)]
    return [(start, min(start + chunk, seqlen)) for start in starts]


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A paged cache's first ``length`` positions of every sequence, laid out contiguously:
    (num_pages, kv_heads, page_size, d) with block_table (batch, max_pages) -> (batch, kv_heads, length, d).
    Reads only the pages those positions use."""
    page_size = cache.shape[2]
    n_pages = _cdiv(length, page_size)
    pages = cache[block_table[:, :n_pages].long()]  # (B, n_pages, Hkv, page_size, d)
    batch, _, kv_heads, _, d = pages.shape
    return pages.transpose(1, 2).reshape(batch, kv_heads, n_pages * page_size, d)[:, :, :length]


def paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, *, spare_pages: int = 0,
                generator: torch.Generator | None = None):
    """A contiguous cache (batch, kv_heads, capacity, d) copied into pages scattered at random.

    Returns (k_pages, v_pages, block_table): pages (num_pages, kv_heads, page_size, d) with
    num_pages = batch * ceil(capacity / page_size) + spare_pages (spare pages hold zeros and
    belong to no sequence), and block_table (batch, ceil(capacity / page_size)) int32. The
    positions past capacity in a sequence's last page are zeros."""
    batch, kv_heads, capacity, d = k_cache.shape
    per_seq = _cdiv(capacity, page_size)
    num_pages = batch * per_seq + spare_pages
    order = torch.randperm(num_pages, generator=generator)[: batch * per_seq].to(k_cache.device)
    block_table = order.reshape(batch, per_seq).to(torch.int32)
    out = []
    for cache in (k_cache, v_cache):
        padded = torch.zeros(batch, kv_heads, per_seq * page_size, d, dtype=cache.dtype, device=cache.device)
        padded[:, :, :capacity] = cache
        pages = torch.zeros(num_pages, kv_heads, page_size, d, dtype=cache.dtype, device=cache.device)
        # (B, Hkv, per_seq, P, d) -> (B * per_seq, Hkv, P, d), in block-table order
        pages[order] = padded.reshape(batch, kv_heads, per_seq, page_size, d).transpose(1, 2).reshape(
            batch * per_seq, kv_heads, page_size, d)
        out.append(pages)
    return out[0], out[1], block_table


def kv_cache_bytes(*, layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int,
                   element_size: int = 2) -> int:
    """Bytes of a KV cache: a key and a value vector per layer, sequence, kv head and position."""
    return 2 * layers * batch * kv_heads * tokens * head_dim * element_size


# ----- the reference ------------------------------------------------------------------------

def chunk_attention(q, k, v, positions, offset: int, *, scale: float, score_mod=None, window_left: int = -1,
                    batch_row: int = 0):
    """Attention of one sequence's new queries over one chunk of its keys: (out, lse).

    q (heads, new_tokens, d); k, v (heads, chunk, d) with their cache positions ``positions``
    (chunk,), consecutive; query i sits at position offset + i. out is normalised over the chunk
    alone and lse (heads, new_tokens) is its log-sum-exp, -inf (with out = 0) where a row sees none
    of it. score_mod: a score function, told batch_row, the head and those positions.
    """
    s = (q @ k.transpose(-2, -1)) * scale  # (H, Nnew, chunk)
    if score_mod is not None and s.numel():
        s = Scoring(scale, score_mod).modded(s[None], offset, int(positions[0]), batch_row)[0]
    new_tokens = q.shape[-2]
    rows = torch.arange(new_tokens, device=q.device)[:, None]  # (Nnew, 1); query i sits at offset + i
    rule = Visibility(True, (window_left, -1))  # the forward's rule, seq_q = Nnew, seq_k = offset + Nnew
    visible = rule.pairs(rows, positions[None, :], new_tokens, offset + new_tokens)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, Nnew); -inf for a row that sees no key of the chunk
    shift = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    return torch.exp(s - shift[..., None]) @ v, lse


def _sequence(cache, block_table, b: int, length: int, paged: bool):
    """Sequence b's first ``length`` cached positions, (kv_heads, length, d)."""
    if paged:
        return gather_cache(cache, block_table[b:b + 1], length)[0]
    return cache[b, :, :length]


def decode_partials(q, k_cache, v_cache, cache_seqlens, *, scale=None, softcap=None, window=None,
                    block_table=None, num_splits: int = 1, score_mod=None):
    """Each sequence's partial results, one per chunk of :func:`split_bounds`, in plain PyTorch.

    Returns a list over the batch of lists over the splits of (start, stop, out, lse): out
    (q_heads, new_tokens, d) is attention over keys [start, stop) alone, lse (q_heads, new_tokens)
    its log-sum-exp. Computed in float64 for float64 inputs, else in float32."""
    args = check_decode_inputs(REFERENCE_FN, q, k_cache, v_cache, cache_seqlens, scale=scale, softcap=softcap,
                               window=window, block_table=block_table, num_splits=num_splits, score_mod=score_mod)
    new_tokens, num_splits = q.shape[2], num_splits or 1
    check_decode_values(REFERENCE_FN, cache_seqlens, block_table, new_tokens, args, k_cache.shape[0])
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k_cache.shape[1]
    result = []
    for b, seqlen in enumerate(cache_seqlens.tolist()):
        # (kv_heads, seqlen, d) -> (q_heads, seqlen, d): query head h reads kv head h // group
        k, v = (_sequence(c, block_table, b, seqlen, args.paged).to(work).repeat_interleave(group, dim=0)
                for c in (k_cache, v_cache))
        parts = []
        for start, stop in split_bounds(seqlen, new_tokens, num_splits, window_left=args.window_left):
            positions = torch.arange(start, stop, device=q.device)
            out, lse = chunk_attention(q[b].to(work), k[:, start:stop], v[:, start:stop], positions,
                                       seqlen - new_tokens, scale=args.scale, score_mod=args.score_mod,
                                       window_left=args.window_left, batch_row=b)
            parts.append((start, stop, out, lse))
        result.append(parts)
    return result


def decode_reference(q, k_cache, v_cache, cache_seqlens, *, scale=None, softcap=None, window=None,
                     block_table=None, num_splits: int = 1, sinks=None, score_mod=None, return_lse: bool = False):
    """:func:`decode_attention` in plain PyTorch: the chunks of :func:`decode_partials` folded
    with notebook 02's :func:`flashlib.merge_partials`, and the attention sinks, if any, with
    :func:`flashlib.softmax.merge_sink` (a partial with no value). Any device and dtype; the result
    in q's dtype (computed in float64 for float64, else float32); lse (batch, q_heads, new_tokens)."""
    every = decode_partials(q, k_cache, v_cache, cache_seqlens, scale=scale, softcap=softcap, window=window,
                            block_table=block_table, num_splits=num_splits, score_mod=score_mod)
    sinks = check_sinks(REFERENCE_FN, sinks, q.shape[1], q.device)
    outs, lses = [], []
    for parts in every:
        _, _, out, lse = parts[0]
        for _, _, part_out, part_lse in parts[1:]:
            out, lse = merge_partials(out, lse, part_out, part_lse)
        out, lse = merge_sink(out, lse, sinks)
        outs.append(out)
        lses.append(lse)
    if not outs:  # batch 0
        return (q.clone(), q.new_zeros(q.shape[:-1], dtype=torch.float32)) if return_lse else q.clone()
    out = torch.stack(outs).to(q.dtype)  # (B, Hq, Nnew, d)
    return (out, torch.stack(lses)) if return_lse else out


# ----- the public function ------------------------------------------------------------------

def decode_attention(q, k_cache, v_cache, cache_seqlens, *, scale=None, softcap=None, window=None,
                     block_table=None, num_splits=None, sinks=None, score_mod=None):
    """Attention of a few new tokens per sequence over a KV cache, with split-KV kernels.

    Args:
        q: (batch, q_heads, new_tokens, head_dim), the new tokens' queries.
        k_cache, v_cache: (batch, kv_heads, capacity, head_dim); or, with ``block_table``, a
            paged cache (num_pages, kv_heads, page_size, head_dim). q_heads must be a multiple
            of kv_heads (grouped-query attention: query head h reads kv head h // (q_heads // kv_heads)).
            The new tokens' keys and values must already be in the cache.
        cache_seqlens: (batch,) int32, the valid positions of each sequence, its new tokens
            included (new_tokens <= cache_seqlens[b] <= capacity). With o = cache_seqlens[b] -
            new_tokens, query i sees the keys at positions j <= o + i::

                new_tokens = 3, cache_seqlens[b] = 6       keys 0 1 2 3 4 5
                query 0 (position 3)                            1 1 1 1 0 0
                query 1 (position 4)                            1 1 1 1 1 0
                query 2 (position 5)                            1 1 1 1 1 1
        scale: defaults to 1/sqrt(head_dim).
        softcap: None for none; c > 0 computes scores as c * tanh(scale * q.k / c) (Gemma 2).
        window: None, or (left, right) as in flash-attn, -1 for no limit on a side: query i also
            needs j >= o + i - left (right never binds under the causal rule, so it only has to be
            >= 0 or -1). Every row sees at least its own position, so no output row is empty.
        block_table: (batch, max_pages) int32 for a paged cache (vLLM's layout); entries past a
            sequence's last used page are not read. It and cache_seqlens may have any strides
            (views are copied for the kernels); other dtypes are refused.
        num_splits: how many chunks each sequence's keys are cut into, each read by its own
            program and merged by a second kernel; None chooses by
            :func:`flashlib.kernels.decode.choose_num_splits` (1 in the CPU interpreter). Every
            value >= 1 gives the same output up to rounding.
        sinks: attention sinks (q_heads,) as in :func:`flashlib.flash_attention`: one logit per
            query head with no value; the merge kernel starts from it, a partial like the splits'.
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`), applied
            to each scaled score before the mask; q_idx is a new token's position in its sequence
            (o + i, not i) and kv_idx a cache position, so that ALiBi or a bias table means what
            it means in the prefill. Not with softcap (compose them).

    Returns the output (batch, q_heads, new_tokens, head_dim) in q's dtype. Inference only: an
    input that requires grad while grad mode is on is an error. float16, bfloat16 (a GPU of compute
    capability >= 8.0) and float32, head_dim 1..256. Without a CUDA device the kernels run in
    Triton's CPU interpreter on CPU tensors (slow: small shapes); :func:`decode_reference` is the
    same computation in PyTorch, for any dtype and device.
    """
    args = check_decode_inputs(FN, q, k_cache, v_cache, cache_seqlens, scale=scale, softcap=softcap,
                               window=window, block_table=block_table, num_splits=num_splits, score_mod=score_mod)
    sinks = check_sinks(FN, sinks, q.shape[1], q.device)
    _check_inference(FN, q, k_cache, v_cache, sinks)
    from .kernels._mode import require_triton

    require_triton()  # says how to get Triton where it is missing
    from .kernels.decode import decode_forward
    from .kernels.function import check_kernel_inputs

    if q.dtype == torch.float64:
        raise TypeError(f"{FN}: argument 'q' is float64, which the kernels do not compute; use float16, "
                        "bfloat16 or float32 (or flashlib.decode_reference for float64)")
    check_kernel_inputs(FN, q)
    check_decode_values(FN, cache_seqlens, block_table, q.shape[2], args, k_cache.shape[0])
    from .kernels.function import kernel_score

    batch, heads = q.shape[:2]
    score = kernel_score(Options(score_mod=args.score_mod), q.device, batch=batch, heads=heads,
                         seq_q=args.capacity, seq_k=args.capacity)
    out, _ = decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=args.scale,
                            score=score, window_left=args.window_left, num_splits=num_splits, sinks=sinks)
    return out
