"""The decoding benchmark: flashlib's split-KV kernels against every SDPA backend, and the bandwidth.

    python -m flashlib.bench.decode [--budget S] [--result FILE]

Points: batch 1 and 8, 32 query heads, 8 kv heads, head_dim 128, bfloat16, one new token, every
sequence's cache full at L = 4k ... 128k keys, contiguous and paged (16-position pages scattered by
a shuffled block table, as :func:`flashlib.decode.paged_cache` makes them). Methods:

    flashlib        the two kernels of :mod:`flashlib.kernels.decode` (``decode_forward``, with
                    the split rule's num_splits; the inputs are checked once before timing, as
                    ``decode_attention`` does at every call)
    sdpa:<backend>  torch's scaled_dot_product_attention forced to one backend, on the contiguous
                    cache, with ``enable_gqa=True`` where the backend accepts it, else on K and V
                    expanded to the 32 query heads beforehand (the expansion is not timed; the
                    row's ``gqa`` says which)

SDPA cannot read pages: a paged point is compared with SDPA on the contiguous cache holding the
same keys, so the gather SDPA would need first is not counted against it. Timed with
``triton.testing.do_bench`` (medians and 20th/80th percentiles; L2 flushed before each call) as
a caller runs them, and, for flashlib and the fastest SDPA backend, replayed from a CUDA graph
(``ms_graph``: a step of a few microseconds is otherwise partly the launches' Python).
Bytes: the K and V the step must read, 2 · batch · kv_heads · L · head_dim · 2. The copy
bandwidth is measured at the start of the same run (:func:`flashlib.bench.point.measure_ceilings`).
Targets at L >= 16k, on the times as called: flashlib at least as fast as the best SDPA backend,
and its K and V bytes over its time at least 70 % of the copy bandwidth (the graph times' ratios
are written beside them). Every kernel the run launches is compiled first, on all cores; the
points run targets first; the sweeps (split counts, page sizes, tiles) fill what is left of the
budget. Absorbed MLA steps (DeepSeek-V3: 128 query heads over one 576-wide latent cache in 64-position
pages, values its first 512 columns) time the one read of the latent cache against a value cache of
its own, with their bytes (:func:`flashlib.decode.mla_bytes`) and GB/s.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from .methods import SDPA_BACKENDS
from .grid import run_plan
from .point import DeviceLost, bench_spread, device_usable, error_text, measure_ceilings

BATCHES = (1, 8)
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
LAYOUTS = ("contiguous", "paged")
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
TARGET_LENGTH, SPEEDUP_TARGET, BANDWIDTH_TARGET = 16384, 1.0, 0.7
# bf16 outputs of values of size about 1 differ by a few 1e-3 between two correct kernels; a point
# whose output is farther from SDPA's meets no target
MAX_ERROR_VS_SDPA = 3e-2
OURS = "flashlib"
SPLIT_SWEEP = (1, 8, 16, 32, 64, 128)
TILE_SWEEP = ((32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 2), (128, 8, 3))  # (BLOCK_K, warps, stages)
PAGE_SWEEP = (16, 64, 256)


def plan(batches=BATCHES, lengths=LENGTHS, layouts=LAYOUTS) -> list[dict]:
    """Every point once: the targets (L >= 16k) first, longest first; then the shorter caches."""
    points = [dict(batch=b, length=n, layout=layout) for n in lengths for b in batches for layout in layouts]
    return sorted(points, key=lambda p: (p["length"] < TARGET_LENGTH, -p["length"], p["batch"],
                                         p["layout"] != "contiguous"))


def kv_bytes(batch: int, kv_heads: int, length: int, head_dim: int, element_size: int = 2) -> int:
    """Bytes of K and V one decoding step reads: every cached key and value once."""
    from ..decode import kv_cache_bytes

    return kv_cache_bytes(layers=1, batch=batch, kv_heads=kv_heads, tokens=length, head_dim=head_dim,
                          element_size=element_size)


class Inputs:
    """One point's tensors: q (B, Hq, 1, d), the contiguous cache (B, Hkv, L, d), lengths (B,) int32,
    and, for a paged point, the same keys in pages with their block table."""

    def __init__(self, p, *, q_heads, kv_heads, head_dim, page_size, dtype, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (p["batch"], kv_heads, p["length"], head_dim)
        self.q = torch.randn(p["batch"], q_heads, 1, head_dim, generator=g, device=device, dtype=dtype)
        self.k, self.v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(2))
        self.lengths = torch.full((p["batch"],), p["length"], dtype=torch.int32, device=device)
        self.pages = None
        if p["layout"] == "paged":
            self.paginate(page_size, seed)

    def paginate(self, page_size, seed=0):
        from ..decode import paged_cache

        self.pages = paged_cache(self.k, self.v, page_size, generator=torch.Generator().manual_seed(seed))


def ours_call(x: Inputs, *, num_splits=None, config=None):
    """f() -> out running flashlib's kernels on x (paged when x holds pages); the inputs checked once."""
    from ..decode import check_decode_inputs, check_decode_values
    from ..kernels.decode import decode_forward
    from ..kvcache import prepare

    k, v, table = x.pages if x.pages is not None else (x.k, x.v, None)
    args = check_decode_inputs(OURS, x.q, k, v, x.lengths, block_table=table, num_splits=num_splits)
    check_decode_values(OURS, prepare(OURS, x.q, k, v, x.lengths, block_table=table), args, k.shape[0])
    return lambda: decode_forward(x.q, k, v, x.lengths, options=args.options, block_table=table,
                                  num_splits=num_splits, config=config)[0]


def sdpa_call(backend: str, x: Inputs):
    """(f() -> out, how GQA was given): one SDPA backend on the contiguous cache."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def native():
        with sdpa_kernel([which]):
            return sdpa(x.q, x.k, x.v, enable_gqa=True)
    try:
        native()
        return native, "enable_gqa"
    except (RuntimeError, TypeError):  # the backend (or this torch) takes no grouped heads
        group = x.q.shape[1] // x.k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (x.k, x.v))  # (B, Hq, L, d), not timed

        def expanded():
            with sdpa_kernel([which]):
                return sdpa(x.q, k, v)
        return expanded, "expanded"


def _timed(row, call, reference, bench):
    out = call()
    if reference is not None:
        row["max_abs_err_vs_sdpa"] = float((out.float() - reference).abs().max())
    median, low, high = bench(call)
    gbps = row["bytes"] / (median * 1e-3) / 1e9
    row.update(ms=float(median), ms_p20=float(low), ms_p80=float(high), gbps=gbps)


def graphed(call):
    """call() captured once in a CUDA graph: replaying it launches the same kernels with no Python
    between them, so that a step of a few microseconds is timed as the GPU runs it, not as fast as
    Python launches it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on a side stream, as capturing requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _timed_graph(row, call, bench, graph):
    """Also the median time of call replayed from a graph (ms_graph, gbps_graph), where it captures."""
    if graph is None:
        return
    try:
        median = float(bench(graph(call))[0])
        row.update(ms_graph=median, gbps_graph=row["bytes"] / (median * 1e-3) / 1e9)
    except Exception as exc:  # a method that cannot be captured keeps its eager time
        row["graph_error"] = error_text(exc)


def _sdpa_rows(base, x: Inputs, bench, graph):
    """Every SDPA backend on the contiguous cache (the fastest also replayed from a graph), and the
    first one's output in float32, to check flashlib's against."""
    rows, calls, reference = [], {}, None
    for backend in SDPA_BACKENDS:
        row = dict(base, layout="contiguous", method=f"sdpa:{backend}")
        try:
            call, row["gqa"] = sdpa_call(backend, x)
            _timed(row, call, None, bench)
            calls[row["method"]] = call
            reference = call().float() if reference is None else reference
        except Exception as exc:  # an unsupported backend is a result, not a crash
            row["error"] = error_text(exc)
        rows.append(row)
    best = best_sdpa(rows)
    if best is not None:
        _timed_graph(best, calls[best["method"]], bench, graph)
    return rows, reference


def measure_point(p, x: Inputs, sdpa_rows, bench, log, device, graph=None) -> list[dict]:
    """flashlib at point p, and (once per batch and length, on the contiguous cache) every SDPA backend;
    flashlib and the fastest SDPA backend also from a CUDA graph when ``graph`` (:func:`graphed`) is given."""
    base = dict(p, q_heads=x.q.shape[1], kv_heads=x.k.shape[1], head_dim=x.k.shape[-1], new_tokens=1,
                dtype=str(x.q.dtype).replace("torch.", ""),
                bytes=kv_bytes(p["batch"], x.k.shape[1], p["length"], x.k.shape[-1], x.k.element_size()))
    rows, reference = [], None
    key = (p["batch"], p["length"])
    if key not in sdpa_rows:
        sdpa_rows[key], reference = _sdpa_rows(base, x, bench, graph)
        rows.extend(sdpa_rows[key])
    row = dict(base, method=OURS)
    try:
        from ..kernels.decode import default_num_splits

        k, _, table = x.pages if x.pages is not None else (x.k, x.v, None)
        row["num_splits"] = default_num_splits(x.q, k, table)
        call = ours_call(x)
        _timed(row, call, reference if reference is not None else _first_reference(x), bench)
        _timed_graph(row, call, bench, graph)
    except Exception as exc:  # a result row; a fault that leaves the device unusable ends the run
        row["error"] = error_text(exc)
        if not device_usable(device):
            raise DeviceLost(OURS, p, row) from exc
    rows.append(row)
    best = best_sdpa(sdpa_rows[key])
    log(f"  B={p['batch']} L={p['length']:6d} {p['layout']:10s} flashlib "
        + (f"{row['ms'] * 1e3:7.1f} us {row['gbps']:5.0f} GB/s" if "ms" in row else row.get("error", "?"))
        + (f"; best SDPA {best['method']} {best['ms'] * 1e3:.1f} us" if best else ""))
    return rows


def _first_reference(x: Inputs):
    """The first SDPA backend's output that runs here (float32), to check flashlib's against."""
    for backend in SDPA_BACKENDS:
        try:
            return sdpa_call(backend, x)[0]().float()
        except Exception:  # noqa: BLE001 - any backend that fails is simply not the reference
            continue
    return None


def best_sdpa(rows):
    timed = [r for r in rows if r["method"].startswith("sdpa:") and r.get("ms")]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def targets(rows, copy_gbps) -> list[dict]:
    """Per point at L >= 16k: flashlib's speed-up over the best SDPA backend at the same batch and
    length, its fraction of the copy bandwidth, and whether each target is met (never by an output
    farther than MAX_ERROR_VS_SDPA from SDPA's, or not checked against it)."""
    out = []
    for r in rows:
        if r["method"] != OURS or r["length"] < TARGET_LENGTH or not r.get("ms"):
            continue
        same = [s for s in rows if s["batch"] == r["batch"] and s["length"] == r["length"]]
        best = best_sdpa(same)
        speedup = best["ms"] / r["ms"] if best else None
        fraction = r["gbps"] / copy_gbps if copy_gbps else None
        correct = r.get("max_abs_err_vs_sdpa", math.inf) <= MAX_ERROR_VS_SDPA
        graphs = best is not None and "ms_graph" in best and "ms_graph" in r
        out.append(dict(batch=r["batch"], length=r["length"], layout=r["layout"], sdpa=best and best["method"],
                        correct=correct, speedup=speedup,
                        speedup_range=[best["ms_p20"] / r["ms_p80"], best["ms_p80"] / r["ms_p20"]] if best else None,
                        speedup_met=correct and speedup is not None and speedup >= SPEEDUP_TARGET,
                        bandwidth_fraction=fraction,
                        bandwidth_met=correct and fraction is not None and fraction >= BANDWIDTH_TARGET,
                        # the same from CUDA graphs: the GPU's time without the launches' Python
                        speedup_graph=best["ms_graph"] / r["ms_graph"] if graphs else None,
                        bandwidth_fraction_graph=r["gbps_graph"] / copy_gbps if copy_gbps and "gbps_graph" in r
                        else None))
    return out


# ----- the sweeps: what the split rule and the shipped tiles are chosen from ---------------------

def sweep_items(batch: int = 1, length: int = 65536) -> list[dict]:
    """One point's variations, each timed once: split counts (contiguous), page sizes, tiles (both
    layouts); at batch 1 and 64k keys, where splitting matters most."""
    items = [dict(sweep="splits", batch=batch, length=length, layout="contiguous", num_splits=s)
             for s in SPLIT_SWEEP]
    items += [dict(sweep="pages", batch=batch, length=length, layout="paged", page_size=ps) for ps in PAGE_SWEEP]
    # last: each tile compiles its own kernels
    items += [dict(sweep="tiles", batch=batch, length=length, layout=layout, block_k=bk, num_warps=w, num_stages=st)
              for layout in LAYOUTS for bk, w, st in TILE_SWEEP]
    return items


def run_sweeps(items, make_inputs, bench, budget_s, log, clock=time.perf_counter, graph=None) -> tuple[list, list]:
    """(rows, skipped): each item starts only if the longest so far would still end in budget_s;
    each timed as it is called and, with ``graph``, from a CUDA graph."""
    from ..kernels.decode import DecodeConfig

    start, longest, rows, skipped, inputs = clock(), 0.0, [], [], {}
    for item in items:
        began = clock()
        if began - start + longest > budget_s:
            skipped.append(item)
            continue
        key = (item["batch"], item["length"], item["layout"], item.get("page_size", PAGE_SIZE))
        if key not in inputs:
            inputs.clear()  # one point's tensors at a time: 64k keys at batch 8 are 2 GB each
            inputs[key] = make_inputs(dict(item), item.get("page_size", PAGE_SIZE))
        x = inputs[key]
        row = dict(item, method=OURS, bytes=kv_bytes(item["batch"], x.k.shape[1], item["length"], x.k.shape[-1],
                                                      x.k.element_size()))
        config = DecodeConfig(item["block_k"], item["num_warps"], item["num_stages"]) if "block_k" in item else None
        try:
            call = ours_call(x, num_splits=item.get("num_splits"), config=config)
            _timed(row, call, None, bench)
            _timed_graph(row, call, bench, graph)
        except Exception as exc:  # an item that does not compile or fit is a result too
            row["error"] = error_text(exc)
        rows.append(row)
        longest = max(longest, clock() - began)
        log(f"  sweep {item['sweep']}: " + ", ".join(f"{k}={item[k]}" for k in item if k not in
                                                       ("sweep", "batch", "length"))
            + (f": {row['ms'] * 1e3:.1f} us" if "ms" in row else f": {row.get('error')}"))
    return rows, skipped


# ----- shared prefixes: cascade decoding against decoding over the concatenated caches ----------

CASCADE_GROUPS, CASCADE_PREFIXES, CASCADE_SUFFIX = (8, 32), (16384, 65536), 512


def cascade_items(groups=CASCADE_GROUPS, prefixes=CASCADE_PREFIXES, suffix=CASCADE_SUFFIX) -> list[dict]:
    """A group of requests sharing a prefix, each with its own suffix of ``suffix`` positions."""
    return [dict(sweep="cascade", batch=b, prefix=p, suffix=suffix) for p in prefixes for b in groups]


def measure_cascade(item, *, q_heads, kv_heads, head_dim, dtype, device, bench, seed=0) -> list[dict]:
    """Two rows for one group: flashlib's decoding over each request's concatenated cache (plain) and
    :func:`flashlib.decode.cascade_attention` (the prefix read once for the group); their bytes by
    :func:`flashlib.decode.cascade_bytes` (BLOCK_Q 64 assumed for the prefix's stacked rows), and
    how far the two outputs are apart."""
    from ..decode import cascade_attention, cascade_bytes, decode_attention

    g = torch.Generator(device=device).manual_seed(seed)
    batch, prefix, suffix = item["batch"], item["prefix"], item["suffix"]
    make = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    q = make(batch, q_heads, 1, head_dim)
    prefix_k, prefix_v = make(kv_heads, prefix, head_dim), make(kv_heads, prefix, head_dim)
    k_cache, v_cache = make(batch, kv_heads, suffix, head_dim), make(batch, kv_heads, suffix, head_dim)
    lengths = torch.full((batch,), suffix, dtype=torch.int32, device=device)
    full_k, full_v = (torch.cat((p[None].expand(batch, -1, -1, -1), c), dim=2) for p, c in
                      ((prefix_k, k_cache), (prefix_v, v_cache)))
    counted = cascade_bytes(batch=batch, kv_heads=kv_heads, rows_per_kv_head=q_heads // kv_heads, prefix=prefix,
                            suffix=suffix, head_dim=head_dim, element_size=q.element_size())
    calls = dict(plain=lambda: decode_attention(q, full_k, full_v, lengths + prefix),
                 cascade=lambda: cascade_attention(q, prefix_k, prefix_v, k_cache, v_cache, lengths))
    rows = []
    with torch.no_grad():
        outs = {name: call() for name, call in calls.items()}
        difference = (outs["plain"].float() - outs["cascade"].float()).abs().max().item()
        for name, call in calls.items():
            ms, low, high = bench(call)
            rows.append(dict(item, method=f"{OURS}:{name}", ms=ms, ms_p20=low, ms_p80=high, bytes=counted[name],
                             gbps=counted[name] / ms / 1e6, max_abs_difference=difference))
    return rows


def _run_in_budget(items, measure, budget_s, clock, describe) -> tuple[list, list]:
    """(rows, skipped): measure(item) for each item only if the longest so far would still end in
    budget_s; a step that raises is a row with its error; describe(item, rows) is logged per step."""
    start, longest, rows, skipped = clock(), 0.0, [], []
    for item in items:
        began = clock()
        if began - start + longest > budget_s:
            skipped.append(item)
            continue
        try:
            found = measure(item)
        except Exception as exc:  # a step that does not fit is a result too
            found = [dict(item, error=error_text(exc))]
        rows += found
        longest = max(longest, clock() - began)
        if "ms" in found[-1]:
            describe(item, found)
    return rows, skipped


def run_cascade(items, bench, budget_s, log, clock=time.perf_counter, **shapes) -> tuple[list, list]:
    """(rows, skipped): each group only if the longest so far would still end in budget_s."""
    def describe(item, found):
        log(f"  cascade B={item['batch']} prefix={item['prefix']}: plain {found[0]['ms'] * 1e3:.0f} us, "
            f"cascade {found[1]['ms'] * 1e3:.0f} us ({found[0]['ms'] / found[1]['ms']:.2f}x)")
    return _run_in_budget(items, lambda item: measure_cascade(item, bench=bench, **shapes), budget_s, clock, describe)


# ----- absorbed MLA: one latent cache read once, against a value cache of its own ------------------

MLA_BATCHES, MLA_LENGTHS, MLA_PAGE_SIZE = (64, 132), (4096, 16384), 64
MLA_Q_HEADS, MLA_WIDTH, MLA_HEAD_DIM_V, MLA_SCALE = 128, 576, 512, 192 ** -0.5  # DeepSeek-V3, one GPU


def mla_items(batches=MLA_BATCHES, lengths=MLA_LENGTHS, page_size=MLA_PAGE_SIZE) -> list[dict]:
    """Absorbed MLA decoding steps: every sequence's paged latent cache full at ``length``."""
    return [dict(sweep="mla", batch=b, length=n, layout="paged", page_size=page_size) for n in lengths for b in batches]


def mla_inputs(item, *, q_heads, width, dtype, device, seed=0):
    """(q (B, Hq, 1, width), latent pages (num_pages, 1, page_size, width) scattered by a shuffled block
    table (B, pages per sequence) int32, lengths (B,) int32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    batch, length, page_size = item["batch"], item["length"], item["page_size"]
    per_seq = -(-length // page_size)
    q = torch.randn(batch, q_heads, 1, width, generator=g, device=device, dtype=dtype)
    pages = torch.randn(batch * per_seq, 1, page_size, width, generator=g, device=device, dtype=dtype)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
    table = order.reshape(batch, per_seq).to(device=device, dtype=torch.int32)
    return q, pages, table, torch.full((batch,), length, dtype=torch.int32, device=device)


def measure_mla(item, *, dtype, device, bench, q_heads=MLA_Q_HEADS, width=MLA_WIDTH, head_dim_v=MLA_HEAD_DIM_V,
                scale=MLA_SCALE, seed=0) -> list[dict]:
    """Two rows for one step: "flashlib:mla", decoding with v_cache a view of the latent pages' first
    head_dim_v columns (the value tile taken from the key tile, each row read once), and
    "flashlib:mla-separate", the same attention with the values copied into pages of their own (the
    general path: both read). Bytes by :func:`flashlib.decode.mla_bytes` (each cached row once per
    kv head, q read and the output written once: the DRAM traffic when the query row blocks that
    share a row, ceil(q_heads / BLOCK_Q) of them, meet it in L2), and how far the outputs are apart."""
    from ..decode import check_decode_inputs, check_decode_values, mla_bytes
    from ..kernels.decode import decode_forward, row_block, values_in_keys
    from ..kvcache import prepare

    q, pages, table, lengths = mla_inputs(item, q_heads=q_heads, width=width, dtype=dtype, device=device, seed=seed)
    values = {"mla": pages[..., :head_dim_v], "mla-separate": pages[..., :head_dim_v].contiguous()}
    assert values_in_keys(pages, values["mla"]) and not values_in_keys(pages, values["mla-separate"])
    counted = mla_bytes(batch=item["batch"], tokens=item["length"], width=width, head_dim_v=head_dim_v,
                        q_heads=q_heads, element_size=q.element_size())
    calls = {}
    for name, v in values.items():
        args = check_decode_inputs(OURS, q, pages, v, lengths, block_table=table, num_splits=None, scale=scale)
        check_decode_values(OURS, prepare(OURS, q, pages, v, lengths, block_table=table), args, pages.shape[0])
        calls[name] = (lambda v=v, args=args: decode_forward(q, pages, v, lengths, options=args.options,
                                                             block_table=table)[0])
    rows = []
    with torch.no_grad():
        outs = {name: call() for name, call in calls.items()}
        difference = (outs["mla"].float() - outs["mla-separate"].float()).abs().max().item()
        for name, call in calls.items():
            ms, low, high = bench(call)
            bytes_ = counted["shared" if name == "mla" else "separate"]
            rows.append(dict(item, method=f"{OURS}:{name}", q_heads=q_heads, width=width, head_dim_v=head_dim_v,
                             ms=ms, ms_p20=low, ms_p80=high, bytes=bytes_, gbps=bytes_ / ms / 1e6,
                             row_blocks=-(-q_heads // row_block(q_heads, head_dim_v)), max_abs_difference=difference))
    return rows


def run_mla(items, bench, budget_s, log, clock=time.perf_counter, **shapes) -> tuple[list, list]:
    """(rows, skipped): each step only if the longest so far would still end in budget_s; shapes: dtype,
    device (and measure_mla's head counts and widths, for a test's tiny ones)."""
    def describe(item, found):
        log(f"  mla B={item['batch']} L={item['length']}: shared {found[0]['ms'] * 1e3:.0f} us "
            f"({found[0]['gbps']:.0f} GB/s), separate {found[1]['ms'] * 1e3:.0f} us ({found[1]['gbps']:.0f} GB/s)")
    return _run_in_budget(items, lambda item: measure_mla(item, bench=bench, **shapes), budget_s, clock, describe)


# ----- compiling ahead ------------------------------------------------------------------------

def what_runs(p, *, q_heads, kv_heads, device) -> tuple:
    """(layout, page_size, num_splits, config) a grid point or sweep item launches with: what its
    kernels are compiled for (the shape beyond these only sets the grid)."""
    from ..kernels.decode import DecodeConfig, choose_num_splits, row_block, sm_count

    rows = q_heads // kv_heads  # one new token
    page_size = p.get("page_size", PAGE_SIZE)
    keys = p["length"] if p["layout"] == "contiguous" else -(-p["length"] // page_size) * page_size
    num_splits = p.get("num_splits") or choose_num_splits(p["batch"] * kv_heads * -(-rows // row_block(rows)), keys,
                                                          sm_count(torch.device(device)))
    config = DecodeConfig(p["block_k"], p["num_warps"], p["num_stages"]) if "block_k" in p else None
    return p["layout"], page_size, num_splits, config


def compile_ahead(runs, *, q_heads, kv_heads, head_dim, dtype, device, threads=None, log=print) -> dict:
    """Compile the kernels of every (layout, page_size, num_splits, config) in ``runs`` on many threads
    before the first point (:mod:`flashlib.bench.ahead`: launches noted on small inputs that bind
    alike, 4096 positions, then compiled; nothing runs), so that the budget goes to measuring."""
    from ..kernels.decode import decode_forward
    from ..options import Options
    from .ahead import compile_notes, recording

    start = time.perf_counter()
    with recording() as notes:
        for layout, page_size, num_splits, config in sorted(set(runs), key=str):
            x = Inputs(dict(batch=1, length=4096, layout=layout), page_size=page_size, q_heads=q_heads,
                       kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
            k, v, table = x.pages if x.pages is not None else (x.k, x.v, None)
            decode_forward(x.q, k, v, x.lengths, options=Options(True, head_dim ** -0.5), block_table=table,
                           num_splits=num_splits, config=config)
    result = compile_notes(notes, threads)
    result.update(launches_noted=len(notes), record_seconds=round(time.perf_counter() - start - result["seconds"], 2))
    log(f"  compiled ahead: {result['kernels']} kernels ({result['failed']} failed) in {result['seconds']:.0f} s "
        f"on {result['threads']} threads")
    return result


# ----- the run ------------------------------------------------------------------------------

def provenance(device) -> dict:
    from importlib.metadata import version

    gpu = torch.device(device).type == "cuda"
    return {"device": torch.cuda.get_device_name() if gpu else str(device),
            "capability": list(torch.cuda.get_device_capability()) if gpu else None,
            "torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def run_decode_bench(budget_s: float = 45.0, *, device="cuda", batches=BATCHES, lengths=LENGTHS, layouts=LAYOUTS,
                     q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                     dtype=torch.bfloat16, sweeps=True, bench=None, ceilings=None, graph="cuda", log=print,
                     progress=None, precompile: bool | None = None, cascade=None, mla=None) -> dict:
    """Measure the points, then the sweeps, within ``budget_s``; returns {"decode": {...}} for the JSON.
    bench(fn) -> (median, 20th, 80th percentile) ms and ceilings ({"copy_gbps": ...}) default to the
    GPU's timers and a measurement now; graph(call) -> replay, default :func:`graphed` on a CUDA device
    (None: no graph times); precompile: compile every kernel first on all cores (default on a CUDA
    device: :func:`compile_ahead`); cascade: the shared-prefix groups (default :func:`cascade_items`
    with the sweeps, none without); mla: the absorbed MLA steps (default :func:`mla_items` with the sweeps,
    none without); a test passes stand-ins and runs it through the interpreter."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run_decode_bench: no CUDA device; the decoding benchmark runs on a GPU")
    start, bench = time.perf_counter(), bench or bench_spread
    if graph == "cuda":
        graph = graphed if torch.device(device).type == "cuda" else None
    info = provenance(device)
    log(f"decoding benchmark on {info['device']} (budget {budget_s:.0f} s)")
    ceilings = ceilings or measure_ceilings(device)
    log(f"  copy bandwidth {ceilings['copy_gbps']:.0f} GB/s")
    shapes = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)

    def make_inputs(p, pages=page_size):
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return Inputs(p, page_size=pages, **shapes)

    grid = plan(batches, lengths, layouts)
    length = 65536 if 65536 in lengths else max(lengths)
    items = sweep_items(batches[0], length) if sweeps else []
    cascade = (cascade_items() if sweeps else []) if cascade is None else cascade
    mla = (mla_items() if sweeps else []) if mla is None else mla
    compiled = None
    if precompile if precompile is not None else torch.device(device).type == "cuda":
        try:
            runs = [what_runs(p, q_heads=q_heads, kv_heads=kv_heads, device=device) for p in grid + items]
            compiled = compile_ahead(runs, log=log, **shapes)
        except Exception as exc:  # the kernels then compile at their first launch
            compiled = {"error": error_text(exc)}
    sdpa_rows, lost, timeline = {}, [], []
    measure = lambda p: measure_point(p, make_inputs(p), sdpa_rows, bench, log, device, graph)  # noqa: E731
    rows, skipped = run_plan(grid, measure, budget_s - (time.perf_counter() - start), progress=progress,
                             timeline=timeline, lost=lost)
    sweep_rows, sweep_skipped, cascade_rows, cascade_skipped = [], [], [], []
    if cascade and not lost:  # before the sweeps: never timed before, and a quarter of what is left at most
        left = (budget_s - (time.perf_counter() - start)) / (4 if items else 1)
        cascade_rows, cascade_skipped = run_cascade(cascade, bench, left, log, **shapes)
    mla_rows, mla_skipped = [], []
    if mla and not lost:  # then a third of what is left at most
        left = (budget_s - (time.perf_counter() - start)) / (3 if items else 1)
        mla_rows, mla_skipped = run_mla(mla, bench, left, log, dtype=dtype, device=device)
    if items and not lost:
        left = budget_s - (time.perf_counter() - start)
        sweep_rows, sweep_skipped = run_sweeps(items, make_inputs, bench, left, log, graph=graph)
    return {"decode": {
        "provenance": info,
        "config": {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                   "dtype": str(dtype).replace("torch.", ""), "new_tokens": 1, "page_size": page_size,
                   "budget_s": budget_s,
                   "timing": "triton.testing.do_bench median ms (ms_p20, ms_p80: 20th and 80th percentiles), "
                             "L2 flushed before each call; ms_graph: the same call replayed from a CUDA graph "
                             "(flashlib and the fastest SDPA backend)",
                   "bytes": "K and V read: 2 * batch * kv_heads * length * head_dim * element size",
                   "sdpa": "on the contiguous cache, enable_gqa=True or K/V expanded beforehand (row 'gqa'); "
                           "paged points compare with SDPA on the contiguous cache (no gather timed)"},
        "ceilings": ceilings, "precompile": compiled, "points": rows, "skipped": skipped, "timeline": timeline,
        "targets": targets(rows, ceilings.get("copy_gbps")), "sweeps": sweep_rows, "sweeps_skipped": sweep_skipped,
        "cascade": cascade_rows, "cascade_skipped": cascade_skipped, "mla": mla_rows, "mla_skipped": mla_skipped,
        "device_lost": {k: v for k, v in lost[0].items() if k != "pending"} if lost else None,
        "elapsed_s": round(time.perf_counter() - start, 1)}}


def format_targets(result: dict) -> str:
    """The targets as lines of text, for the log."""
    lines = [f"decoding targets (L >= {TARGET_LENGTH}): speed-up over the best SDPA >= {SPEEDUP_TARGET}, "
             f"bandwidth >= {BANDWIDTH_TARGET:.0%} of copy"]
    for t in result["decode"]["targets"]:
        speedup = f"{t['speedup']:.2f}x {t['sdpa']}" if t["speedup"] is not None else "no SDPA"
        wrong = "" if t["correct"] else " OUTPUT DIFFERS FROM SDPA'S"
        graphs = "" if t.get("speedup_graph") is None else (
            f"; from graphs {t['speedup_graph']:.2f}x, bandwidth {t['bandwidth_fraction_graph']:.0%}")
        lines.append(f"  B={t['batch']} L={t['length']:6d} {t['layout']:10s}{wrong} {speedup} "
                     f"({'met' if t['speedup_met'] else 'not met'}); bandwidth {t['bandwidth_fraction']:.0%} "
                     f"({'met' if t['bandwidth_met'] else 'not met'}){graphs}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=45.0, help="seconds for the whole run (default 45)")
    parser.add_argument("--result", default=None, help="write the JSON here, after every point and at the end "
                                                       "(default data/bench/decode-<device>-<time>.json)")
    parser.add_argument("--no-sweeps", action="store_true", help="measure the points only")
    args = parser.parse_args(argv)
    if args.result is None:
        from .records import BENCH_DIR
        from .results import device_slug

        name = device_slug(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        args.result = str(BENCH_DIR / f"decode-{name}-{time.strftime('%Y-%m-%dT%H%MZ', time.gmtime())}.json")
    path = Path(args.result)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save_partial(rows):  # a run stopped at its limit still leaves what it measured
        path.write_text(json.dumps({"decode": {"points": rows, "partial": True}}, default=str) + "\n")
    result = run_decode_bench(args.budget, sweeps=not args.no_sweeps, progress=save_partial)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(format_targets(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
