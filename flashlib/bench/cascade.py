"""Shared-prefix (cascade) decoding against plain decoding on this CPU, side by side in one run.

A group of ``batch`` requests shares a prefix of ``prefix`` positions (a system prompt) and holds
``suffix`` of its own. Plain decoding reads every request's whole cache; cascade decoding
(:func:`flashlib.decode.cascade_attention`) reads the prefix once for the group, with every
request's new queries stacked as the rows of one block, and merges each request's suffix
attention with it through (out, lse). Both run as PyTorch's matmuls here (``reference=True`` and
:func:`flashlib.decode_reference` over the concatenated cache), interleaved, median of
``repeats``; the bytes each reads are counted by :func:`flashlib.decode.cascade_bytes`, notebook
10's model. ``python -m flashlib bench cascade`` writes ``data/bench/cascade-cpu-DATE.json``.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..decode import _stack_queries, _unstack, cascade_attention, cascade_bytes
from ..softmax import merge_partials
from ..tiled import tiled_forward
from .cpu import provenance, write_result

GROUPS = (1, 2, 4, 8, 16, 32)
SHAPE = dict(prefix=16384, suffix=64, q_heads=8, kv_heads=2, head_dim=64)


def _inputs(batch, *, prefix, suffix, q_heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g)
    prefix_k, prefix_v = (torch.randn(kv_heads, prefix, head_dim, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, kv_heads, suffix, head_dim, generator=g) for _ in range(2))
    lengths = torch.full((batch,), suffix, dtype=torch.int32)
    full = [torch.cat((p[None].expand(batch, -1, -1, -1), c), dim=2).contiguous()
            for p, c in ((prefix_k, k_cache), (prefix_v, v_cache))]  # what plain decoding keeps per request
    return q, prefix_k, prefix_v, k_cache, v_cache, lengths, full


def _one_tile(q, k, v):
    """(out, lse) of q (..., rows, d) over all of k, v (..., keys, d): one tile, no mask."""
    return tiled_forward(q, k, v, block_q=max(q.shape[-2], 1), block_k=max(k.shape[-2], 1))


def _plain(q, full_k, full_v):
    batch, q_heads, _, d = q.shape
    kv_heads = full_k.shape[1]
    out, _ = _one_tile(q.reshape(batch, kv_heads, q_heads // kv_heads, d), full_k, full_v)
    return out.reshape(q.shape)


def _cascade(q, prefix_k, prefix_v, k_cache, v_cache):
    batch, q_heads, _, d = q.shape
    kv_heads = k_cache.shape[1]
    out_p, lse_p = _one_tile(_stack_queries(q, kv_heads), prefix_k[None], prefix_v[None])  # the prefix, once
    out_s, lse_s = _one_tile(q.reshape(batch, kv_heads, q_heads // kv_heads, d), k_cache, v_cache)
    out_p, lse_p = _unstack(out_p, batch, q_heads, 1), _unstack(lse_p[..., None], batch, q_heads, 1)[..., 0]
    out, _ = merge_partials(out_p, lse_p, out_s.reshape(q.shape), lse_s.reshape(q.shape[:-1]))
    return out


def measure_group(batch: int, *, repeats: int = 5, clock=time.perf_counter, **shape) -> dict:
    """One group size: both methods' median seconds (interleaved), their bytes, and how far each is
    from :func:`flashlib.decode.cascade_attention` (float32 rounding: the same attention)."""
    shape = {**SHAPE, **shape}
    q, pk, pv, kc, vc, lengths, (full_k, full_v) = _inputs(batch, **shape)
    calls = dict(plain=lambda: _plain(q, full_k, full_v), cascade=lambda: _cascade(q, pk, pv, kc, vc))
    times = {name: [] for name in calls}
    with torch.no_grad():
        want = cascade_attention(q, pk, pv, kc, vc, lengths, reference=True)
        difference = max((call() - want).abs().max().item() for call in calls.values())  # a warm-up too
        for _ in range(repeats):
            for name, call in calls.items():
                start = clock()
                call()
                times[name].append(clock() - start)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    rows = shape["q_heads"] // shape["kv_heads"]  # one new token: the query heads of a kv head
    counted = cascade_bytes(batch=batch, kv_heads=shape["kv_heads"], rows_per_kv_head=rows, prefix=shape["prefix"],
                            suffix=shape["suffix"], head_dim=shape["head_dim"], element_size=4,
                            block_q=max(batch * rows, 1))  # one tile: the prefix read once
    return dict(batch=batch, plain_s=seconds["plain"], cascade_s=seconds["cascade"],
                speedup=seconds["plain"] / seconds["cascade"], plain_bytes=counted["plain"],
                cascade_bytes=counted["cascade"], bytes_ratio=counted["ratio"], max_difference=difference)


def run_cascade_bench(groups=GROUPS, *, repeats: int = 9, out_dir: Path | None = None, log=print, **shape) -> Path:
    """Every group size, one after another in this process; the JSON written under out_dir."""
    rows = []
    for batch in groups:
        rows.append(measure_group(batch, repeats=repeats, **shape))
        log(format_rows(rows[-1:], header=not rows[:-1]))
    result = dict(provenance(), kind="cascade-cpu", shape={**SHAPE, **shape}, repeats=repeats, points=rows)
    return write_result(result, f"cascade-cpu-{result['date']}", out_dir)


def format_rows(rows, header: bool = True) -> str:
    lines = [f"{'group':>5} {'plain ms':>9} {'cascade ms':>11} {'speedup':>8} {'bytes ratio':>12}"] if header else []
    lines += [f"{r['batch']:5d} {1e3 * r['plain_s']:9.2f} {1e3 * r['cascade_s']:11.2f} {r['speedup']:7.2f}x "
              f"{r['bytes_ratio']:11.2f}x" for r in rows]
    return "\n".join(lines)
