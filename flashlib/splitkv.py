"""Split-KV decoding in plain PyTorch: the reference of :func:`flashlib.decode_attention`.

A decoding step attends a few new queries per sequence over its KV cache (:mod:`flashlib.decode` says the
conventions). Split-KV (Flash-Decoding) cuts each sequence's visible keys into ``num_splits`` splits
(:func:`split_bounds`); each gives a partial output and its log-sum-exp (:func:`split_attention`), and
notebook 02's :func:`flashlib.merge_partials` combines them: :func:`decode_partials` lists the partials,
:func:`decode_reference` merges them, every argument of :func:`flashlib.decode_attention` taken. The kernels
of :mod:`flashlib.kernels.decode` compute the same splits.
"""
from __future__ import annotations

import torch

from . import kvcache
from .kvcache import Batch
from .machinery.decode_checks import DecodeArgs, check_decode_inputs, check_decode_values, decode_options
from .machinery.options import Options
from .rules import Visibility, key_range_start
from .softmax import merge_partials, merge_sink

REFERENCE_FN = "decode_reference"
# flash-attn's KV-cache contract (flashlib.kvcache): what a call appends and where its sequences live
KVCACHE_ARGUMENTS = ("k_new", "v_new", "rotary_cos", "rotary_sin", "rotary_interleaved", "cache_batch_idx",
                     "cache_leftpad", "cu_seqlens_q", "max_seqlen_q")


# ----- the pieces the reference and the kernels share -------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_bounds(seqlen: int, new_tokens: int, num_splits: int, *, rule: Visibility = Visibility(),
                 block: int = 1, start: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of each of the ``num_splits`` splits of one sequence's keys.

    The keys any of its queries can see, [first, seqlen) (first: the sequence's start, or where the first
    new token's keys start under ``rule``, its window or chunk, if later; rounded down to a multiple of
    ``block``), are cut into splits of ceil(span / num_splits) keys rounded up to a multiple of ``block``
    (the kernels' BLOCK_K: no tile straddles two splits); trailing splits may be empty (start == stop).
    """
    # the new tokens are the last queries of the cache: the forward's rule with seq_q = new_tokens,
    # seq_k = seqlen - start, positions from the sequence's start; its first row's key range
    first = (key_range_start(0, new_tokens, seqlen - start, rule, 1) + start) // block * block
    size = _cdiv(_cdiv(seqlen - first, num_splits), block) * block
    starts = [min(first + s * size, seqlen) for s in range(num_splits)]
    return [(start, min(start + size, seqlen)) for start in starts]


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A paged cache's first ``length`` positions of every sequence, contiguous, reading only their pages:
    (num_pages, kv_heads, page_size, d) with block_table (batch, max_pages) -> (batch, kv_heads, length, d)."""
    pages = cache[block_table[:, :_cdiv(length, cache.shape[2])].long()]  # (B, n_pages, Hkv, page_size, d)
    return pages.transpose(1, 2).flatten(2, 3)[:, :, :length]


def paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, *, spare_pages: int = 0,
                generator: torch.Generator | None = None):
    """A contiguous cache (batch, kv_heads, capacity, d) copied into pages scattered at random (v_cache's d may differ
    from k_cache's). Returns (k_pages, v_pages, block_table): pages (num_pages, kv_heads, page_size, d), num_pages =
    batch * ceil(capacity / page_size) + spare_pages (spare pages hold zeros and belong to no sequence; so do the
    positions past capacity), and block_table (batch, ceil(capacity / page_size)) int32."""
    batch, kv_heads, capacity, _ = k_cache.shape
    per_seq = _cdiv(capacity, page_size)
    num_pages = batch * per_seq + spare_pages
    order = torch.randperm(num_pages, generator=generator)[: batch * per_seq].to(k_cache.device)
    block_table = order.reshape(batch, per_seq).to(torch.int32)
    out = []
    for cache in (k_cache, v_cache):  # v's head dim may differ (MLA)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, per_seq * page_size - capacity))
        pages = cache.new_zeros(num_pages, kv_heads, page_size, cache.shape[-1])
        # (B, Hkv, per_seq * P, d) -> (B * per_seq, Hkv, P, d), in block-table order
        pages[order] = padded.unflatten(2, (per_seq, page_size)).transpose(1, 2).flatten(0, 1)
        out.append(pages)
    return out[0], out[1], block_table


def kv_cache_bytes(*, layers: int, batch: int, kv_heads: int, tokens: int, head_dim: int,
                   element_size: int = 2) -> int:
    """Bytes of a KV cache: a key and a value vector per layer, sequence, kv head and position."""
    return 2 * layers * batch * kv_heads * tokens * head_dim * element_size


# ----- the reference ------------------------------------------------------------------------

def split_attention(q, k, v, positions, offset: int, options: Options, *, start: int = 0, batch_row: int = 0):
    """Attention of one sequence's new queries over one split of its keys: (out, lse).

    q (heads, new_tokens, d); k, v (heads, keys, d) at the consecutive cache positions ``positions`` (keys,); query
    i sits at position offset + i; the sequence starts at ``start`` (no key before it is seen). out is normalised over
    the split alone, lse (heads, new_tokens) its log-sum-exp, -inf (out 0) where a row sees none of it. options: the
    call's (a score function is told batch_row, the head and the positions counted from the sequence's start).
    """
    s = (q @ k.transpose(-2, -1)) * options.scale  # (H, Nnew, keys)
    if options.score_function is not None and s.numel():
        s = options.scoring.modded(s[None], offset - start, int(positions[0]) - start, batch_row)[0]
    new_tokens = q.shape[-2]
    rows = torch.arange(new_tokens, device=q.device)[:, None]  # (Nnew, 1); query i sits at offset + i
    # the forward's rule with seq_q = Nnew, seq_k = offset + Nnew - start: positions from the sequence's
    # start (attention chunks begin there), keys before it never seen
    visible = options.visibility.pairs(rows, positions[None, :] - start, new_tokens, offset + new_tokens - start)
    visible = positions[None, :] >= start if visible is None else visible & (positions[None, :] >= start)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, Nnew); -inf for a row that sees no key of the split
    shift = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    return torch.exp(s - shift[..., None]) @ v, lse


def decode_partials(q, k_cache, v_cache, cache_seqlens, *, num_splits: int = 1, block_table=None, **options):
    """Each sequence's partial results, one per split of :func:`split_bounds`, in plain PyTorch.

    Returns a list over the batch of lists over the splits of (start, stop, out, lse): out (q_heads,
    new_tokens, d) is attention over keys [start, stop) alone, lse (q_heads, new_tokens) its log-sum-exp
    (a mixed batch's padding rows, past a sequence's own new tokens, see nothing). In float64 for float64
    inputs, else float32. options: :func:`decode_attention`'s (its KV-cache contract's too)."""
    options, contract = _split_call(REFERENCE_FN, q, options)
    batch, args = _prepared(REFERENCE_FN, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, options, contract)
    return _partials(batch, args, num_splits or 1)


def _partials(batch: Batch, args: DecodeArgs, num_splits: int):
    q = batch.q
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // batch.k_cache.shape[1]
    result = []
    where = zip(*(t.tolist() for t in (batch.seqlens, batch.new_tokens, batch.starts)))
    for b, (seqlen, n, start) in enumerate(where):
        # its cached (kv_heads, seqlen, d) -> (q_heads, seqlen, d): query head h reads kv head h // group
        k, v = ((gather_cache(c, batch.block_table[b:b + 1], seqlen)[0] if args.paged else c[b, :, :seqlen])
                .to(work).repeat_interleave(group, dim=0) for c in (batch.k_cache, batch.v_cache))
        parts = []
        for lo, hi in split_bounds(seqlen, n, num_splits, rule=args.options.visibility, start=start):
            positions = torch.arange(lo, hi, device=q.device)
            out, lse = split_attention(q[b, :, :n].to(work), k[:, lo:hi], v[:, lo:hi], positions, seqlen - n,
                                       args.options, start=start, batch_row=b)
            pad = q.shape[2] - n  # a mixed batch's padding rows: zeros, lse -inf
            parts.append((lo, hi, torch.nn.functional.pad(out, (0, 0, 0, pad)),
                          torch.nn.functional.pad(lse, (0, pad), value=float("-inf"))))
        result.append(parts)
    return result


def _split_call(fn, q, keywords: dict) -> tuple[Options, dict]:
    """(the call's options, checked once, and its KV-cache arguments) from a decoding call's keywords."""
    contract = {name: keywords.pop(name) for name in KVCACHE_ARGUMENTS if name in keywords}
    return decode_options(fn, q, **keywords), contract


def _prepared(fn, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, options: Options, contract: dict):
    """(the call's Batch after its append, its DecodeArgs): the KV-cache arguments (``contract``) read by
    flashlib.kvcache, the rest checked, the values checked before anything is written."""
    batch = kvcache.prepare(fn, q, k_cache, v_cache, cache_seqlens, block_table=block_table, **contract,
                            rule=options.visibility)
    args = check_decode_inputs(fn, batch.q, k_cache, v_cache, cache_seqlens, block_table=batch.block_table,
                               num_splits=num_splits, options=options)
    table_name = "cache_batch_idx" if contract.get("cache_batch_idx") is not None else "block_table"
    check_decode_values(fn, batch, args, k_cache.shape[0], table_name)
    return batch.write(), args


def decode_reference(q, k_cache, v_cache, cache_seqlens, *, num_splits: int = 1, block_table=None,
                     return_lse: bool = False, **options):
    """:func:`decode_attention` in plain PyTorch, every argument of it: the splits of :func:`decode_partials` folded
    with notebook 02's :func:`flashlib.merge_partials`, and the attention sinks, if any, with
    :func:`flashlib.softmax.merge_sink` (a partial with no value). Any device and dtype; the result in q's dtype
    (computed in float64 for float64, else float32); lse (batch, q_heads, new_tokens) (packed: (q_heads, total_q))."""
    options, contract = _split_call(REFERENCE_FN, q, options)
    batch, args = _prepared(REFERENCE_FN, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, options, contract)
    merged = []
    for parts in _partials(batch, args, num_splits or 1):
        _, _, out, lse = parts[0]
        for _, _, part_out, part_lse in parts[1:]:
            out, lse = merge_partials(out, lse, part_out, part_lse)
        merged.append(merge_sink(out, lse, args.options.sinks))
    if not merged:  # batch 0
        out = batch.q.new_zeros(*batch.q.shape[:-1], batch.v_cache.shape[-1])
        lse = batch.q.new_zeros(batch.q.shape[:-1], dtype=torch.float32)
    else:  # (B, Hq, Nnew, d), (B, Hq, Nnew)
        out, lse = torch.stack([o for o, _ in merged]).to(q.dtype), torch.stack([lse for _, lse in merged])
    out, lse = batch.unpack(out, lse)
    return (out, lse) if return_lse else out
