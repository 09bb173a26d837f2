"""The decoding benchmark: flashlib's split-KV kernels against every SDPA backend, and the bandwidth.

    python -m flashlib.bench.decode [--budget S] [--result FILE]

Points: batch 1 and 8, 32 query heads, 8 kv heads, head_dim 128, bfloat16, one new token, every
sequence's cache full at L = 4k ... 128k keys, contiguous and paged (16-position pages scattered by
a shuffled block table, as :func:`flashlib.decode.paged_cache` makes them). Methods:

    flashlib        :meth:`flashlib.DecodePlan.run`, the plan made once before timing (an engine's
                    path: the checks, trace, split count, grids and buffers once per layout)
    flashlib:call   :func:`flashlib.decode_attention` as a user calls it: a plan made and run at
                    every call (timed as called only: its value checks wait for the GPU)
    sdpa:<backend>  torch's scaled_dot_product_attention forced to one backend, on the contiguous
                    cache, with ``enable_gqa=True`` where the backend accepts it, else on K and V
                    expanded to the 32 query heads beforehand (the expansion is not timed; the
                    row's ``gqa`` says which)

SDPA cannot read pages: a paged point is compared with SDPA on the contiguous cache holding the
same keys, so the gather SDPA would need first is not counted against it. Timed with
``triton.testing.do_bench`` (medians and 20th/80th percentiles; L2 flushed before each call) as
a caller runs them, and, for flashlib and the fastest SDPA backend, replayed from a CUDA graph
(``ms_graph``: the kernels alone; as called, a step of a few microseconds is partly the host's Python).
Bytes: the K and V the step must read, 2 · batch · kv_heads · L · head_dim · 2. The copy
bandwidth is measured at the start of the same run (:func:`flashlib.bench.point.measure_ceilings`).
Targets at L >= 16k, on the times as called: flashlib at least as fast as the best SDPA backend,
and its K and V bytes over its time at least 70 % of the copy bandwidth (the graph times' ratios
are written beside them). Every kernel the run launches is compiled first, on all cores; the
points run targets first; the sweeps (split counts, page sizes, tiles) fill what is left of the
budget. Shared-prefix groups time plain decoding over each request's whole cache against
:class:`flashlib.decode.CascadePlan`; absorbed MLA steps (DeepSeek-V3: 128 query heads over one 576-wide
latent cache in 64-position pages, values its first 512 columns) time the one read of the latent cache
against a value cache of its own, with their bytes (:func:`flashlib.decode.mla_bytes`); both as called and
from graphs, with their GB/s as a fraction of the run's copy bandwidth. Their kernels are compiled ahead
with the points', so the budget goes to timing them.
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
# serving's targets: paged as fast as contiguous, a shared prefix read once pays, MLA near the copy bandwidth
PAGED_TARGET, CASCADE_TARGET, MLA_TARGET = 0.9, 2.0, 0.5
# bf16 outputs of values of size about 1 differ by a few 1e-3 between two correct kernels; a point
# whose output is farther from SDPA's meets no target
MAX_ERROR_VS_SDPA = 3e-2
OURS = "flashlib"
SPLIT_SWEEP = (1, 8, 16, 32, 64, 128)
TILE_SWEEP = ((32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 2), (128, 8, 3))  # (BLOCK_K, warps, stages)
# a paged tile's loads wait on its page numbers: two more stages for as many tiles in flight
# (flashlib.kernels.decode.PAGED_EXTRA_STAGES); 16 keys: a tile per page, one page number per tile
PAGED_TILE_SWEEP = ((16, 4, 10), (32, 4, 5), (64, 8, 5), (128, 4, 4), (128, 8, 5))
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
    """f() -> out running flashlib's kernels on x (paged when x holds pages): a DecodePlan made once and
    its run; with config (the tile sweep), the kernels' own DecodeLaunch, made once with those tiles."""
    from ..decode import DecodePlan
    from ..machinery.decode_checks import check_decode_inputs, decode_options
    from ..kernels.decode import DecodeLaunch

    k, v, table = x.pages if x.pages is not None else (x.k, x.v, None)
    if config is None:
        plan = DecodePlan(x.q, k, v, x.lengths, block_table=table, num_splits=num_splits)
        return lambda: plan.run(x.q, k, v, x.lengths, table)
    args = check_decode_inputs(OURS, x.q, k, v, x.lengths, block_table=table, num_splits=num_splits,
                               options=decode_options(OURS, x.q))
    launch = DecodeLaunch(x.q, k, v, options=args.options, block_table=table, num_splits=num_splits, config=config)
    return lambda: launch(x.q, k, v, x.lengths, table)[0]


def user_call(x: Inputs):
    """f() -> out: :func:`flashlib.decode_attention` on x as a user calls it (checks, trace, plan every call)."""
    from ..decode import decode_attention

    k, v, table = x.pages if x.pages is not None else (x.k, x.v, None)
    return lambda: decode_attention(x.q, k, v, x.lengths, block_table=table)


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
    called = dict(base, method=f"{OURS}:call")  # the one-call form: the host's work at every call
    try:
        _timed(called, user_call(x), None, bench)
    except Exception as exc:  # noqa: BLE001 - a result row, as flashlib's
        called["error"] = error_text(exc)
    rows.append(called)
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
    farther than MAX_ERROR_VS_SDPA from SDPA's, or not checked against it); beside them the one-call
    form's speed-up (``speedup_call``: decode_attention as a user calls it)."""
    out = []
    for r in rows:
        if r["method"] != OURS or r["length"] < TARGET_LENGTH or not r.get("ms"):
            continue
        same = [s for s in rows if s["batch"] == r["batch"] and s["length"] == r["length"]]
        best = best_sdpa(same)
        called = next((s for s in same if s["method"] == f"{OURS}:call" and s["layout"] == r["layout"]
                       and s.get("ms")), None)
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
                        else None,
                        speedup_call=best["ms"] / called["ms"] if best and called else None))
    return out


def serving_targets(points, cascade, mla) -> list[dict]:
    """Serving's targets, as called and from graphs: paged over contiguous time at each batch and length
    (L >= 16k) >= PAGED_TARGET; plain over cascade time >= CASCADE_TARGET for a group of 8 sharing 16k;
    MLA's one-read step at >= MLA_TARGET of the copy bandwidth."""
    def ratio(a, b, key):
        return a[key] / b[key] if key in a and key in b else None

    out = []
    ours = {(r["batch"], r["length"], r["layout"]): r for r in points if r["method"] == OURS and r.get("ms")}
    for (batch, length, layout), paged in ours.items():
        contiguous = ours.get((batch, length, "contiguous"))
        if layout == "paged" and contiguous and length >= TARGET_LENGTH:
            out.append(dict(target="paged/contiguous", batch=batch, length=length, goal=PAGED_TARGET,
                            ratio=ratio(contiguous, paged, "ms"), ratio_graph=ratio(contiguous, paged, "ms_graph")))
    for plain, shared in zip(cascade[::2], cascade[1::2]):
        if plain.get("ms") and shared.get("ms") and plain["batch"] == 8 and plain["prefix"] == 16384:
            out.append(dict(target="cascade/plain", batch=8, prefix=16384, goal=CASCADE_TARGET,
                            ratio=ratio(plain, shared, "ms"), ratio_graph=ratio(plain, shared, "ms_graph")))
    for row in mla:
        if row.get("method") == f"{OURS}:mla" and "copy_fraction" in row:
            out.append(dict(target="mla/copy", batch=row["batch"], length=row["length"], goal=MLA_TARGET,
                            ratio=row["copy_fraction"], ratio_graph=row.get("copy_fraction_graph")))
    for t in out:
        t["met"] = t["ratio"] is not None and t["ratio"] >= t["goal"]
        t["met_graph"] = t["ratio_graph"] is not None and t["ratio_graph"] >= t["goal"]
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
              for layout, tiles in zip(LAYOUTS, (TILE_SWEEP, PAGED_TILE_SWEEP)) for bk, w, st in tiles]
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


def _filled(fill, generator):
    """make(*shape) -> a tensor: random values (fill "randn"), or uninitialised memory ("empty": what
    compiling ahead needs, the shapes and layouts alone)."""
    def make(*shape, dtype, device):
        if fill == "empty":
            return torch.empty(*shape, dtype=dtype, device=device)
        return torch.randn(*shape, generator=generator, dtype=dtype, device=device)
    return make


def cascade_plans(item, *, q_heads, kv_heads, head_dim, dtype, device, seed=0, fill="randn") -> dict:
    """{"plain": (run, bytes), "cascade": (run, bytes)} for one group: a DecodePlan over each request's
    concatenated cache and a CascadePlan (the prefix read once), each made once; bytes by
    :func:`flashlib.decode.cascade_bytes` (BLOCK_Q 64 assumed for the prefix's stacked rows)."""
    from ..decode import CascadePlan, DecodePlan, cascade_bytes

    make = _filled(fill, torch.Generator(device=device).manual_seed(seed))
    batch, prefix, suffix = item["batch"], item["prefix"], item["suffix"]
    like = dict(dtype=dtype, device=device)
    q = make(batch, q_heads, 1, head_dim, **like)
    prefix_k, prefix_v = make(kv_heads, prefix, head_dim, **like), make(kv_heads, prefix, head_dim, **like)
    k_cache, v_cache = make(batch, kv_heads, suffix, head_dim, **like), make(batch, kv_heads, suffix, head_dim, **like)
    lengths = torch.full((batch,), suffix, dtype=torch.int32, device=device)
    full_k, full_v = (torch.cat((p[None].expand(batch, -1, -1, -1), c), dim=2) for p, c in
                      ((prefix_k, k_cache), (prefix_v, v_cache)))
    full_lengths = lengths + prefix
    counted = cascade_bytes(batch=batch, kv_heads=kv_heads, rows_per_kv_head=q_heads // kv_heads, prefix=prefix,
                            suffix=suffix, head_dim=head_dim, element_size=q.element_size())
    plain = DecodePlan(q, full_k, full_v, full_lengths)
    cascade = CascadePlan(q, prefix_k, prefix_v, k_cache, v_cache, lengths)
    return {"plain": (lambda: plain.run(q, full_k, full_v, full_lengths), counted["plain"], plain.launch_shape),
            "cascade": (lambda: cascade.run(q, prefix_k, prefix_v, k_cache, v_cache, lengths), counted["cascade"],
                        cascade.launch_shapes["prefix"])}


def _timed_plans(item, plans, bench, graph, copy_gbps, extra=lambda name: {}) -> list[dict]:
    """One row per plan: as called and from a graph, GB/s and their fractions of the copy bandwidth, the
    splits launched, and how far the first two outputs are apart."""
    rows = []
    with torch.no_grad():
        outs = [run().float() for run, _, _ in plans.values()]
        difference = (outs[0] - outs[1]).abs().max().item()
        for name, (run, bytes_, shape) in plans.items():
            ms, low, high = bench(run)
            row = dict(item, method=f"{OURS}:{name}", ms=ms, ms_p20=low, ms_p80=high, bytes=bytes_,
                       gbps=bytes_ / ms / 1e6, num_splits=shape.num_splits, max_abs_difference=difference, **extra(name))
            _timed_graph(row, run, bench, graph)
            for key in ("gbps", "gbps_graph"):
                if copy_gbps and key in row:
                    row[key.replace("gbps", "copy_fraction")] = row[key] / copy_gbps
            rows.append(row)
    return rows


def measure_cascade(item, *, q_heads, kv_heads, head_dim, dtype, device, bench, graph=None, copy_gbps=None,
                    seed=0) -> list[dict]:
    """Two rows for one group, "flashlib:plain" and "flashlib:cascade" (:func:`cascade_plans`), as called and
    from graphs; num_splits: the plain launch's, and the prefix pass's for the cascade."""
    plans = cascade_plans(item, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                          seed=seed)
    return _timed_plans(item, plans, bench, graph, copy_gbps)


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


def _graph_note(row) -> str:
    return f" ({row['ms_graph'] * 1e3:.0f} us from a graph)" if "ms_graph" in row else ""


def run_cascade(items, bench, budget_s, log, clock=time.perf_counter, graph=None, copy_gbps=None,
                **shapes) -> tuple[list, list]:
    """(rows, skipped): each group only if the longest so far would still end in budget_s."""
    def describe(item, found):
        log(f"  cascade B={item['batch']} prefix={item['prefix']}: plain {found[0]['ms'] * 1e3:.0f} us"
            f"{_graph_note(found[0])}, cascade {found[1]['ms'] * 1e3:.0f} us{_graph_note(found[1])} "
            f"({found[0]['ms'] / found[1]['ms']:.2f}x)")
    return _run_in_budget(items, lambda item: measure_cascade(item, bench=bench, graph=graph, copy_gbps=copy_gbps,
                                                              **shapes), budget_s, clock, describe)


# ----- absorbed MLA: one latent cache read once, against a value cache of its own ------------------

MLA_BATCHES, MLA_LENGTHS, MLA_PAGE_SIZE = (64, 132), (4096, 16384), 64
MLA_Q_HEADS, MLA_WIDTH, MLA_HEAD_DIM_V, MLA_SCALE = 128, 576, 512, 192 ** -0.5  # DeepSeek-V3, one GPU


def mla_items(batches=MLA_BATCHES, lengths=MLA_LENGTHS, page_size=MLA_PAGE_SIZE) -> list[dict]:
    """Absorbed MLA decoding steps: every sequence's paged latent cache full at ``length``."""
    return [dict(sweep="mla", batch=b, length=n, layout="paged", page_size=page_size) for n in lengths for b in batches]


def mla_inputs(item, *, q_heads, width, dtype, device, seed=0, fill="randn"):
    """(q (B, Hq, 1, width), latent pages (num_pages, 1, page_size, width) scattered by a shuffled block
    table (B, pages per sequence) int32, lengths (B,) int32)."""
    make = _filled(fill, torch.Generator(device=device).manual_seed(seed))
    batch, length, page_size = item["batch"], item["length"], item["page_size"]
    per_seq = -(-length // page_size)
    q = make(batch, q_heads, 1, width, dtype=dtype, device=device)
    pages = make(batch * per_seq, 1, page_size, width, dtype=dtype, device=device)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
    table = order.reshape(batch, per_seq).to(device=device, dtype=torch.int32)
    return q, pages, table, torch.full((batch,), length, dtype=torch.int32, device=device)


def mla_plans(item, *, dtype, device, q_heads=MLA_Q_HEADS, width=MLA_WIDTH, head_dim_v=MLA_HEAD_DIM_V,
              scale=MLA_SCALE, seed=0, fill="randn") -> dict:
    """{"mla": (run, bytes, shape), "mla-separate": ...}: DecodePlans with v_cache a view of the latent
    pages' first head_dim_v columns (the value tile taken from the key tile, each row read once) and with
    the values copied into pages of their own (the general path: both read). Bytes by
    :func:`flashlib.decode.mla_bytes` (each cached row once per kv head, q read and the output written
    once: the DRAM traffic when the query row blocks that share a row, side by side on the grid, meet it in L2)."""
    from ..decode import DecodePlan, mla_bytes
    from ..kernels.decode import values_in_keys

    q, pages, table, lengths = mla_inputs(item, q_heads=q_heads, width=width, dtype=dtype, device=device, seed=seed,
                                          fill=fill)
    values = {"mla": pages[..., :head_dim_v], "mla-separate": pages[..., :head_dim_v].contiguous()}
    assert values_in_keys(pages, values["mla"]) and not values_in_keys(pages, values["mla-separate"])
    counted = mla_bytes(batch=item["batch"], tokens=item["length"], width=width, head_dim_v=head_dim_v,
                        q_heads=q_heads, element_size=q.element_size())
    plans = {}
    for name, v in values.items():
        plan = DecodePlan(q, pages, v, lengths, block_table=table, scale=scale)
        plans[name] = (lambda plan=plan, v=v: plan.run(q, pages, v, lengths, table),
                       counted["shared" if name == "mla" else "separate"], plan.launch_shape)
    return plans


def measure_mla(item, *, dtype, device, bench, graph=None, copy_gbps=None, q_heads=MLA_Q_HEADS, width=MLA_WIDTH,
                head_dim_v=MLA_HEAD_DIM_V, scale=MLA_SCALE, seed=0) -> list[dict]:
    """Two rows for one step, "flashlib:mla" and "flashlib:mla-separate" (:func:`mla_plans`), as called and
    from graphs, with the query row blocks each latent row is read by (side by side on the grid)."""
    plans = mla_plans(item, dtype=dtype, device=device, q_heads=q_heads, width=width, head_dim_v=head_dim_v,
                      scale=scale, seed=seed)
    shape = plans["mla"][2]
    extra = lambda name: dict(q_heads=q_heads, width=width, head_dim_v=head_dim_v,  # noqa: E731
                              row_blocks=-(-q_heads // shape.block_q))
    return _timed_plans(item, plans, bench, graph, copy_gbps, extra)


def run_mla(items, bench, budget_s, log, clock=time.perf_counter, graph=None, copy_gbps=None,
            **shapes) -> tuple[list, list]:
    """(rows, skipped): each step only if the longest so far would still end in budget_s; shapes: dtype,
    device (and measure_mla's head counts and widths, for a test's tiny ones)."""
    def describe(item, found):
        log(f"  mla B={item['batch']} L={item['length']}: shared {found[0]['ms'] * 1e3:.0f} us "
            f"({found[0]['gbps']:.0f} GB/s){_graph_note(found[0])}, separate {found[1]['ms'] * 1e3:.0f} us "
            f"({found[1]['gbps']:.0f} GB/s)")
    return _run_in_budget(items, lambda item: measure_mla(item, bench=bench, graph=graph, copy_gbps=copy_gbps,
                                                          **shapes), budget_s, clock, describe)


# ----- compiling ahead ------------------------------------------------------------------------

def what_runs(p, *, q_heads, kv_heads, device, head_dim=HEAD_DIM, dtype=torch.bfloat16) -> tuple:
    """(layout, page_size, num_splits, config) a grid point or sweep item launches with: what its
    kernels are compiled for (the shape beyond these only sets the grid)."""
    from ..kernels.decode import DecodeConfig, device_target, launch_shape

    page_size = p.get("page_size", PAGE_SIZE)
    paged = p["layout"] == "paged"
    keys = -(-p["length"] // page_size) * page_size if paged else p["length"]
    config = DecodeConfig(p["block_k"], p["num_warps"], p["num_stages"]) if "block_k" in p else None
    capability, sms = device_target(torch.device(device))
    num_splits = p.get("num_splits") or launch_shape(p["batch"], kv_heads, q_heads // kv_heads, keys, head_dim, head_dim,
                                                     dtype, paged=paged, capability=capability, sms=sms,
                                                     config=config).num_splits
    return p["layout"], page_size, num_splits, config


def compile_ahead(runs, *, q_heads, kv_heads, head_dim, dtype, device, threads=None, log=print, groups=(),
                  steps=()) -> dict:
    """Compile the kernels of every (layout, page_size, num_splits, config) in ``runs``, of every cascade
    group in ``groups`` and every MLA step in ``steps`` on many threads before the first point
    (:mod:`flashlib.bench.ahead`: launches noted, then compiled; nothing runs): the points' on small inputs
    that bind alike (4096 positions), the groups' and steps' plans at their own shapes in uninitialised
    memory. The budget then goes to measuring."""
    from .ahead import compile_notes, recording

    start = time.perf_counter()
    shapes = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    with recording() as notes:
        for layout, page_size, num_splits, config in sorted(set(runs), key=str):
            x = Inputs(dict(batch=1, length=4096, layout=layout), page_size=page_size, **shapes)
            ours_call(x, num_splits=num_splits, config=config)()
        for item in groups:
            for run, *_ in cascade_plans(item, fill="empty", **shapes).values():
                run()
        for item in steps:
            for run, *_ in mla_plans(item, dtype=dtype, device=device, fill="empty").values():
                run()
    result = compile_notes(notes, threads)
    result.update(launches_noted=len(notes), record_seconds=round(time.perf_counter() - start - result["seconds"], 2))
    log(f"  compiled ahead: {result['kernels']} kernels ({result['failed']} failed) in {result['seconds']:.0f} s "
        f"on {result['threads']} threads")
    return result


# ----- the launch model's shapes ------------------------------------------------------------------

def launch_points(*, capability=(9, 0), sms=132, dtype=torch.bfloat16) -> list[dict]:
    """Every launch of the benchmark's steps as a GPU of this capability and multiprocessor count shapes it
    (default an H200's): the points (contiguous and paged), each cascade group's prefix pass and suffixes, and
    each MLA step; {"name", "keys" (a sequence's capacity), "head_dim", "head_dim_v", "rows" (stacked query rows
    of a sequence and kv head; the prefix pass's, every sequence's), "paged", "page_size", "v_from_k", "prefix"
    (a merge that folds a prefix's splits), "shape": LaunchShape}
    (flashlib.kernels.launches; tests/test_launch_model.py compiles each and holds its waves)."""
    from ..kernels.decode import launch_shape

    out = []

    def add(name, batch, kv_heads, rows, keys, d, dv, paged=False, page_size=PAGE_SIZE, v_from_k=False, prefix=False):
        shape = launch_shape(batch, kv_heads, rows, keys, d, dv, dtype, paged=paged, capability=capability, sms=sms)
        out.append(dict(name=name, keys=keys, head_dim=d, head_dim_v=dv, rows=rows, paged=paged, page_size=page_size,
                        v_from_k=v_from_k, prefix=prefix, shape=shape))
    group = Q_HEADS // KV_HEADS
    for p in plan():
        keys = -(-p["length"] // PAGE_SIZE) * PAGE_SIZE
        add(f"{p['layout']} B={p['batch']} L={p['length']}", p["batch"], KV_HEADS, group, keys, HEAD_DIM, HEAD_DIM,
            paged=p["layout"] == "paged")
    for item in cascade_items():
        batch = item["batch"]
        add(f"cascade prefix B={batch} P={item['prefix']}", 1, KV_HEADS, batch * group, item["prefix"], HEAD_DIM,
            HEAD_DIM)
        add(f"cascade suffixes B={batch} P={item['prefix']}", batch, KV_HEADS, group, item["suffix"], HEAD_DIM, HEAD_DIM,
            prefix=True)
    for item in mla_items():
        add(f"mla B={item['batch']} L={item['length']}", item["batch"], 1, MLA_Q_HEADS, item["length"], MLA_WIDTH,
            MLA_HEAD_DIM_V, paged=True, page_size=item["page_size"], v_from_k=True)
    return out


# ----- the run ------------------------------------------------------------------------------

def provenance(device) -> dict:
    from importlib.metadata import version

    gpu = torch.device(device).type == "cuda"
    return {"device": torch.cuda.get_device_name() if gpu else str(device),
            "capability": list(torch.cuda.get_device_capability()) if gpu else None,
            "torch": torch.__version__, "triton": version("triton"), "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


_CONFIG = {"new_tokens": 1,
           "timing": "triton.testing.do_bench median ms (ms_p20, ms_p80: 20th and 80th percentiles), "
                     "L2 flushed before each call; ms_graph: the same call replayed from a CUDA graph "
                     "(flashlib's plan.run, the fastest SDPA backend, cascade and MLA plans); "
                     "flashlib:call: decode_attention as a user calls it (plan and run every call)",
           "bytes": "K and V read: 2 * batch * kv_heads * length * head_dim * element size",
           "sdpa": "on the contiguous cache, enable_gqa=True or K/V expanded beforehand (row 'gqa'); "
                   "paged points compare with SDPA on the contiguous cache (no gather timed)"}


def _precompile(points, cascade, mla, log, **shapes) -> dict:
    """compile_ahead for the points and sweep items, the cascade groups and MLA steps; its error, if any."""
    try:
        runs = [what_runs(p, q_heads=shapes["q_heads"], kv_heads=shapes["kv_heads"], device=shapes["device"],
                          head_dim=shapes["head_dim"], dtype=shapes["dtype"]) for p in points]
        return compile_ahead(runs, log=log, groups=cascade, steps=mla, **shapes)
    except Exception as exc:  # the kernels then compile at their first launch
        return {"error": error_text(exc)}


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
        compiled = _precompile(grid + items, cascade, mla, log, **shapes)
    sdpa_rows, lost, timeline = {}, [], []
    measure = lambda p: measure_point(p, make_inputs(p), sdpa_rows, bench, log, device, graph)  # noqa: E731
    rows, skipped = run_plan(grid, measure, budget_s - (time.perf_counter() - start), progress=progress,
                             timeline=timeline, lost=lost)
    sweep_rows, sweep_skipped, cascade_rows, cascade_skipped = [], [], [], []
    timing = dict(graph=graph, copy_gbps=ceilings.get("copy_gbps"))
    if cascade and not lost:  # before the sweeps (compiled ahead): half of what is left if more follows
        left = (budget_s - (time.perf_counter() - start)) / (2 if items or mla else 1)
        cascade_rows, cascade_skipped = run_cascade(cascade, bench, left, log, **timing, **shapes)
    mla_rows, mla_skipped = [], []
    if mla and not lost:  # then two thirds of what is left if the sweeps follow
        left = (budget_s - (time.perf_counter() - start)) * (2 / 3 if items else 1)
        mla_rows, mla_skipped = run_mla(mla, bench, left, log, dtype=dtype, device=device, **timing)
    if items and not lost:
        left = budget_s - (time.perf_counter() - start)
        sweep_rows, sweep_skipped = run_sweeps(items, make_inputs, bench, left, log, graph=graph)
    return {"decode": {
        "provenance": info,
        "config": dict(_CONFIG, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=str(dtype).replace("torch.", ""), budget_s=budget_s),
        "ceilings": ceilings, "precompile": compiled, "points": rows, "skipped": skipped, "timeline": timeline,
        "targets": targets(rows, ceilings.get("copy_gbps")), "sweeps": sweep_rows, "sweeps_skipped": sweep_skipped,
        "cascade": cascade_rows, "cascade_skipped": cascade_skipped, "mla": mla_rows, "mla_skipped": mla_skipped,
        "serving_targets": serving_targets(rows, cascade_rows, mla_rows),
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
        called = "" if t.get("speedup_call") is None else f"; decode_attention as called {t['speedup_call']:.2f}x"
        lines.append(f"  B={t['batch']} L={t['length']:6d} {t['layout']:10s}{wrong} {speedup} "
                     f"({'met' if t['speedup_met'] else 'not met'}); bandwidth {t['bandwidth_fraction']:.0%} "
                     f"({'met' if t['bandwidth_met'] else 'not met'}){graphs}{called}")
    for t in result["decode"].get("serving_targets", []):
        where = " ".join(f"{k}={t[k]}" for k in ("batch", "length", "prefix") if k in t)
        graph = "" if t["ratio_graph"] is None else f", from graphs {t['ratio_graph']:.2f} ({'met' if t['met_graph'] else 'not met'})"
        lines.append(f"  {t['target']} {where}: {t['ratio']:.2f} as called ({'met' if t['met'] else 'not met'}, "
                     f"goal {t['goal']}){graph}")
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
