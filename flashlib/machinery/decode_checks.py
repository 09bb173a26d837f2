"""The checks of a decoding call (:mod:`flashlib.decode`, :mod:`flashlib.splitkv`): q and the caches, the
lengths and the block table, and its options, checked once where the public op is entered."""
from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .checks import check_index_tensor, resolve_scale
from .options import Options, checked_options


class DecodeArgs(NamedTuple):
    """The checked options and layout of one call."""

    options: Options     # causal, scale, window, score function (soft-capping is one), sinks: flashlib.machinery.options
    paged: bool
    page_size: int       # paged: the page size; contiguous: the capacity (one "page" per sequence)
    capacity: int        # positions a sequence can hold: capacity, or max_pages * page_size


def _check_tensor(fn, name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{fn}: argument '{name}' must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_int32(fn, name, t, ndim, batch, device, what):
    """An index tensor the kernels read, a row per sequence: int32, any strides (the kernels read a contiguous copy)."""
    _check_tensor(fn, name, t, ndim)
    check_index_tensor(fn, name, t, device, what=what)
    if t.shape[0] != batch:
        raise ValueError(f"{fn}: argument '{name}' has shape {tuple(t.shape)}; expected {(batch, *t.shape[1:])}")


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
    if k_cache.shape[:-1] != v_cache.shape[:-1] or v_cache.shape[-1] < 1:
        raise ValueError(f"{fn}: arguments 'k_cache' {tuple(k_cache.shape)} and 'v_cache' {tuple(v_cache.shape)} "
                         "must have the same shape but for the head dim (v's may differ, as MLA's, and is >= 1)")
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
            raise ValueError(f"{fn}: argument 'k_cache' holds {blocks} sequences but 'q' has batch {batch}; a "
                             "contiguous cache is (batch, kv_heads, capacity, head_dim) (pass 'block_table' for a "
                             "paged cache)")
        return block_len, block_len
    _check_int32(fn, "block_table", block_table, 2, batch, q.device, "page numbers")
    if blocks < 1 or block_len < 1:
        raise ValueError(f"{fn}: argument 'k_cache' has shape {tuple(k_cache.shape)}; a paged cache is "
                         "(num_pages >= 1, kv_heads, page_size >= 1, head_dim)")
    return block_len, block_table.shape[1] * block_len


def _check_num_splits(fn, num_splits, name="num_splits"):
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"{fn}: argument '{name}' must be None or an int >= 1, got {num_splits!r}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{fn}: argument '{name}' is {num_splits}; it must be >= 1 (or None to choose)")


def decode_options(fn, q, *, causal=True, scale=None, window=None, softcap=None, score_mod=None, sinks=None,
                   attention_chunk=None) -> Options:
    """A decoding call's options, checked once where the public op is entered: q (batch, q_heads, new_tokens,
    head_dim), or packed (total_q, q_heads, head_dim), gives the heads, the device and the default scale."""
    if not isinstance(q, torch.Tensor) or q.ndim not in (3, 4):
        _check_tensor(fn, "q", q, 4)
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: argument 'causal' must be True or False, got {causal!r}")
    return checked_options(fn, q.shape[1], q.device, causal=causal, scale=resolve_scale(fn, scale, q.shape[-1]),
                           window=window, softcap=softcap, score_mod=score_mod, sinks=sinks,
                           attention_chunk=attention_chunk)


def check_decode_inputs(fn, q, k_cache, v_cache, cache_seqlens, *, block_table, num_splits,
                        options: Options) -> DecodeArgs:
    """Everything its shapes and dtypes say of a call (no values read), its options checked already
    (:func:`decode_options`); a mixed batch's q already spread."""
    page_size, capacity = _check_caches(fn, q, k_cache, v_cache, block_table)
    _check_int32(fn, "cache_seqlens", cache_seqlens, 1, q.shape[0], q.device, "lengths")
    _check_num_splits(fn, num_splits)
    return DecodeArgs(options, block_table is not None, page_size, capacity)


def check_decode_values(fn, batch, args: DecodeArgs, num_pages: int, table_name: str = "block_table"):
    """The checks that read the lengths and the block table: one transfer from the device. batch:
    the call's :class:`flashlib.kvcache.Batch` (:func:`flashlib.kvcache.prepare`), its lengths counting the
    new tokens it appends."""
    lengths, starts, block_table = batch.seqlens.long(), batch.starts.long(), batch.block_table
    flags = [(lengths > args.capacity).any(), (starts > lengths).any() | (starts < 0).any()]
    bad_pages = None
    if args.paged:
        pages = torch.arange(block_table.shape[1], device=lengths.device)
        used = pages[None, :] < (lengths[:, None] + args.page_size - 1).clamp(min=0) // args.page_size
        bad_pages = used & ((block_table < 0) | (block_table >= num_pages))
        flags.append(bad_pages.any())
    if not any(torch.stack(flags).tolist()):
        return
    values = lengths.tolist()
    long = [(b, n) for b, n in enumerate(values) if n > args.capacity]
    if long:
        raise ValueError(f"{fn}: argument 'cache_seqlens' gives sequence {long[0][0]} {long[0][1]} positions (its new "
                         f"keys appended), more than the cache holds ({args.capacity} positions); grow the cache"
                         + (" or its block table" if args.paged else ""))
    wrong = [(b, s) for b, (s, n) in enumerate(zip(starts.tolist(), values)) if not 0 <= s <= n]
    if wrong:
        raise ValueError(f"{fn}: argument 'cache_leftpad' is {wrong[0][1]} for sequence {wrong[0][0]}, outside its "
                         f"{values[wrong[0][0]]} valid positions; a sequence starts at 0 .. its length")
    b, j = (int(x) for x in bad_pages.nonzero()[0])
    raise ValueError(f"{fn}: argument '{table_name}' sends page {j} of sequence {b} to {int(block_table[b, j])}, "
                     f"outside the cache's {num_pages} {'rows' if table_name == 'cache_batch_idx' else 'pages'}; "
                     f"entries for what a sequence uses must lie in 0..{num_pages - 1}")
