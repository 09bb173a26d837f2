"""Reading recorded benchmarks and putting them against the hardware's ceilings.

Nothing here needs a GPU: the figures come from JSON files in ``data/bench/`` written by
``python -m flashlib bench`` (``cpu-<date>.json``) and by the GPU check
(``gpu-<device>-<date>.json``, its ladder benchmark under the key ``"ladder"``).

The arithmetic is the usual convention of FlashAttention's papers:

    forward FLOPs   4 · B · H · N_q · N_k · d     (two matmuls, 2 FLOPs per multiply-add)
                    halved when causal            (about half the scores are computed)
    backward FLOPs  2.5 × forward                 (five matmuls instead of two)
    forward + backward = 3.5 × forward

A roofline says how fast a kernel could be: at best the larger of FLOPs / matmul rate
and bytes moved / memory bandwidth, both rates measured on the same device in the same run.
"""
from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from . import iomodel, viz

BENCH_DIR = Path(__file__).resolve().parent.parent / "data" / "bench"
PASSES = ("fwd", "bwd", "fwd_bwd")
_PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"perf: argument '{name}' must be an int >= 1, got {value!r}")


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, *,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of attention: 4·B·H·N_q·N_k·d forward, halved if causal; mode fwd, bwd or fwd_bwd."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k),
                        ("head_dim", head_dim)):
        _positive_int(name, value)
    if mode not in PASSES:
        raise ValueError(f"perf: argument 'mode' must be one of {PASSES}, got {mode!r}")
    forward = 4.0 * batch * heads * seq_q * seq_k * head_dim / (2 if causal else 1)
    return forward * _PASS_FACTOR[mode]


def tflops(flops: float, milliseconds: float) -> float:
    """Rate in TFLOP/s of ``flops`` done in ``milliseconds``."""
    if not milliseconds > 0:
        raise ValueError(f"perf: argument 'milliseconds' must be > 0, got {milliseconds!r}")
    return flops / (milliseconds * 1e-3) / 1e12


def attention_bytes(batch: int, heads: int, n: int, head_dim: int, *, element_size: int = 2,
                    block_m: int = 128, method: str = "flash2") -> int:
    """HBM bytes of one forward by the IO model: "flash2" (query blocks outer, the kernels'
    order) or "standard" (S and P written and read back), for every (batch, head)."""
    _positive_int("batch", batch)
    _positive_int("heads", heads)
    if method == "flash2":
        per_head = iomodel.flash2_attention_io(n, head_dim, block_m, element_size).bytes
    elif method == "standard":
        per_head = iomodel.standard_attention_io(n, head_dim, element_size).bytes
    else:
        raise ValueError(f"perf: argument 'method' must be 'flash2' or 'standard', got {method!r}")
    return batch * heads * per_head


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved: above the ridge point (rate / bandwidth) a kernel is compute bound."""
    if not nbytes > 0:
        raise ValueError(f"perf: argument 'nbytes' must be > 0, got {nbytes!r}")
    return flops / nbytes


def roofline_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """Least possible time in ms: the larger of compute time and memory time."""
    if not peak_tflops > 0 or not bandwidth_gbps > 0:
        raise ValueError(f"perf: 'peak_tflops' and 'bandwidth_gbps' must be > 0, got "
                         f"{peak_tflops!r} and {bandwidth_gbps!r}")
    return max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)) * 1e3


# ----- recorded runs ----------------------------------------------------------------------

def load_runs(kind: str = "gpu", directory: Path | str | None = None) -> list[dict]:
    """Every recorded run of one kind ("cpu" or "gpu"), oldest first; each gets a "file" key."""
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"perf: argument 'kind' must be 'cpu' or 'gpu', got {kind!r}")
    directory = Path(directory) if directory is not None else BENCH_DIR
    runs = []
    for path in sorted(directory.glob(f"{kind}-*.json")):
        run = json.loads(path.read_text())
        run["file"] = path.name
        runs.append(run)
    return sorted(runs, key=lambda r: (provenance(r).get("date", ""), r["file"]))


def latest(kind: str = "gpu", directory: Path | str | None = None, with_key: str | None = None) -> dict | None:
    """The newest recorded run of that kind (holding ``with_key``, if given), or None."""
    runs = [r for r in load_runs(kind, directory) if with_key is None or r.get(with_key)]
    return runs[-1] if runs else None


def provenance(run: dict) -> dict:
    """Device, versions and date of a run, wherever its writer put them."""
    info = dict(run.get("provenance", {}))
    for key in ("device", "torch", "triton", "cuda", "date"):
        if key not in info and key in run:
            info[key] = run[key]
    ladder = run.get("ladder") or {}
    for key, value in ladder.get("provenance", {}).items():
        info.setdefault(key, value)
    return info


def label(run: dict) -> str:
    """One line naming where and when a run was measured, for every figure title."""
    info = provenance(run)
    where = info.get("device") or info.get("cpu") or "unknown device"
    parts = [where, f"torch {info.get('torch', '?')}"]
    if info.get("triton"):
        parts.append(f"Triton {info['triton']}")
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    parts.append(info.get("date", "undated"))
    return ", ".join(parts)


def ladder_points(run: dict, **where) -> list[dict]:
    """Points of a GPU run's ladder benchmark matching every key=value in ``where``. Rows a
    run's errata mark ``invalid`` (not a measurement of what they name) are left out."""
    points = (run.get("ladder") or {}).get("points", [])
    return [p for p in points if not p.get("invalid") and all(p.get(k) == v for k, v in where.items())]


def launch_makespan(durations, slots: int) -> float:
    """Time to run programs of the given durations, started in launch order, each on the
    first slot to come free: a model of how a GPU hands thread blocks to its SMs."""
    import heapq

    _positive_int("slots", slots)
    free = [0.0] * slots
    end = 0.0
    for duration in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + duration)
        end = max(end, start + duration)
    return end


def causal_launch_model(n: int, *, block: int = 64, tokens: int = 16384, hidden: int = 2048, head_dim: int = 128,
                        slots: int = 264) -> dict:
    """The causal forward's launch, by the model of :func:`launch_makespan`: query block m of a
    square causal problem folds m + 1 key tiles (BLOCK_M = BLOCK_N = block), one launch holds
    every (batch, head), batch x n = tokens and heads x head_dim = hidden (the ladder's grid).
    Returns the makespan over the ideal (total work / slots) in launch order and with each
    head's longest blocks first (rung 4)."""
    for name, value in (("n", n), ("block", block), ("slots", slots)):
        _positive_int(name, value)
    heads = max(1, tokens // n) * max(1, hidden // head_dim)
    per_head = [m + 1 for m in range(-(-n // block))]
    ideal = heads * sum(per_head) / slots
    return {order: launch_makespan((w for _ in range(heads) for w in blocks), slots) / ideal
            for order, blocks in (("in_order", per_head), ("longest_first", per_head[::-1]))}


def autotuned_tiles(run: dict, *, head_dim: int = 128, dtype: str = "bfloat16", causal: bool = False,
                    n: int | None = None) -> dict[str, dict]:
    """{kernel: tiles} the run's autotuners kept for this head dim, dtype and mask: for the
    sequence bucket of n where the run recorded one per bucket, else (older runs, which tuned
    once at the first N measured) the run's only choice."""
    from .kernels.config import seq_bucket

    key = f"d={head_dim} {dtype} causal={causal}"
    ladder = run.get("ladder") or {}
    by_n = (ladder.get("autotuned_by_n") or {}).get(key)
    if by_n and n is not None:
        return by_n.get(str(seq_bucket(n, n)), {})
    return (ladder.get("autotuned") or {}).get(key, {})


def errata(run: dict) -> list[str]:
    """What a run's file says, after the fact, about rows it holds that are not to be used."""
    return [f"{e['rows']} ({e.get('count', '?')} rows): {e['problem']}; instead: {e.get('instead', '-')}"
            for e in run.get("errata", [])]


def series(points, method_key: str = "method", value: str = "tflops") -> dict[str, dict[int, float]]:
    """{method: {n: value}} over the points that have the value."""
    out: dict[str, dict[int, float]] = {}
    for p in points:
        if p.get(value) is not None:
            out.setdefault(p[method_key], {})[p["n"]] = p[value]
    return out


def best_sdpa(points, n: int) -> tuple[str, float] | None:
    """(backend, TFLOP/s) of the fastest SDPA backend at sequence length n, or None."""
    rates = [(p["method"], p["tflops"]) for p in points
             if p["n"] == n and p["method"].startswith("sdpa:") and p.get("tflops")]
    return max(rates, key=lambda r: r[1]) if rates else None


def ladder_gains(run: dict, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
                 causal: bool = False) -> list[tuple[str, float]]:
    """Forward TFLOP/s of every rung at one shape, in ladder order, for the bar chart."""
    points = ladder_points(run, d=head_dim, n=n, dtype=dtype, causal=causal, mode="fwd")
    rates = {p["method"]: p["tflops"] for p in points if p.get("tflops")}
    from .kernels.ladder import LADDER

    return [(r.name, rates[f"rung:{r.name}"]) for r in LADDER if f"rung:{r.name}" in rates]


def newest_run_with(methods, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
                    causal: bool = False, mode: str = "fwd", directory: Path | str | None = None) -> dict | None:
    """The newest recorded GPU run that measured (validly) every one of ``methods`` at this
    shape, so that a table compares figures of one run; None if no run did."""
    for run in reversed(load_runs("gpu", directory)):
        got = rates_at(run, methods, head_dim=head_dim, n=n, dtype=dtype, causal=causal, mode=mode)
        if len(got) == len(list(methods)):
            return run
    return None


def rates_at(run: dict, methods, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
             causal: bool = False, mode: str = "fwd") -> dict[str, float]:
    """{method: TFLOP/s} at one shape for the methods asked for that the run measured (validly)."""
    points = ladder_points(run, d=head_dim, n=n, dtype=dtype, causal=causal, mode=mode)
    rates = {p["method"]: p["tflops"] for p in points if p.get("tflops")}
    return {m: rates[m] for m in methods if m in rates}


def speedups(run: dict, method: str, baseline: str, *, against: dict | None = None, **where) -> list[dict]:
    """Where ``method`` and ``baseline`` were both timed (in ``run``, or ``baseline`` in the
    run ``against``, an earlier one), per grid point matching ``where``: the baseline's
    median time over the method's (above 1: the method is faster), with a ``range`` from the
    20th/80th percentiles where both have them (a range that spans 1 says nothing)."""
    def timed(points, name):
        return {(p["d"], p["n"], p["dtype"], p["causal"], p["mode"]): p for p in points
                if p["method"] == name and p.get("ms")}

    ours = timed(ladder_points(run, **where), method)
    theirs = timed(ladder_points(against if against is not None else run, **where), baseline)
    out = []
    for key in sorted(ours.keys() & theirs.keys()):
        a, b = ours[key], theirs[key]
        spread = all(k in p for p in (a, b) for k in ("ms_p20", "ms_p80"))
        out.append(dict(zip(("d", "n", "dtype", "causal", "mode"), key), speedup=b["ms"] / a["ms"],
                        range=[b["ms_p20"] / a["ms_p80"], b["ms_p80"] / a["ms_p20"]] if spread else None))
    return out


# ----- figures (flashlib.viz's colours and layout) ---------------------------------------

_LINE_COLORS = [viz.CURRENT, viz.DONE, viz.L_COLOR, viz.M_COLOR, viz.PARTIAL_COLOR, viz.MASKED,
                viz.FINAL_COLOR, "#e15759", "#b07aa1"]


def rate_plot(by_method: dict[str, dict[int, float]], title: str = "", ceiling: float | None = None,
              ylabel: str = "TFLOP/s") -> Figure:
    """A rate against N, one line per method; an optional dashed ceiling (measured matmul rate)."""
    fig, (ax,) = viz._new_figure(6.4, 3.8)
    for (name, values), color in zip(sorted(by_method.items()), _LINE_COLORS * 3):
        ns = sorted(values)
        ax.plot(ns, [values[n] for n in ns], marker="o", color=color, label=name)
    if ceiling:
        ax.axhline(ceiling, color=viz.FINAL_COLOR, linestyle="--", linewidth=1,
                   label=f"measured bf16 matmul {viz.fmt4(ceiling)}")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.set(title=title, xlabel="sequence length N", ylabel=ylabel)
    return fig


def bar_chart(labels, values, title: str = "", ylabel: str = "TFLOP/s") -> Figure:
    """One bar per label with its value written on top (the ladder's gains)."""
    fig, (ax,) = viz._new_figure(max(4.0, 1.1 * len(labels) + 1.5), 3.6)
    bars = ax.bar(range(len(values)), values, color=[viz.DONE] * (len(values) - 1) + [viz.CURRENT])
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), viz.fmt4(value),
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels=list(labels), fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    return fig


def grouped_bar_chart(groups: dict[str, dict[str, float]], title: str = "", ylabel: str = "TFLOP/s") -> Figure:
    """Bars of several series side by side: groups = {series: {category: value}}; a category
    a series lacks gets no bar (and no invented value)."""
    categories = list(dict.fromkeys(c for values in groups.values() for c in values))
    width = 0.8 / max(1, len(groups))
    fig, (ax,) = viz._new_figure(max(4.5, 1.2 * len(categories) + 2), 3.8)
    for i, ((series_name, values), color) in enumerate(zip(groups.items(), _LINE_COLORS * 3)):
        xs = [c + (i - (len(groups) - 1) / 2) * width for c, cat in enumerate(categories) if cat in values]
        ys = [values[cat] for cat in categories if cat in values]
        bars = ax.bar(xs, ys, width=width, color=color, label=series_name)
        for bar, value in zip(bars, ys):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), viz.fmt4(value),
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(categories)), labels=categories, fontsize=7)
    ax.legend(fontsize=7)
    ax.set(title=title, ylabel=ylabel)
    return fig


def roofline_plot(points, peak_tflops: float, bandwidth_gbps: float, title: str = "") -> Figure:
    """Measured TFLOP/s against arithmetic intensity, under the roofline of the two ceilings.

    points: dicts with "label", "flops", "bytes" and "ms" (measured).
    """
    import numpy as np

    fig, (ax,) = viz._new_figure(6.0, 3.8)
    intensities = [arithmetic_intensity(p["flops"], p["bytes"]) for p in points]
    ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)  # where the two roofs meet
    lo, hi = min(intensities + [ridge]) / 8, max(intensities + [ridge]) * 8
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(peak_tflops, x * bandwidth_gbps * 1e9 / 1e12), color=viz.FINAL_COLOR,
            label=f"roofline: {viz.fmt4(bandwidth_gbps)} GB/s, {viz.fmt4(peak_tflops)} TFLOP/s")
    for p, i, color in zip(points, intensities, _LINE_COLORS * 4):
        ax.plot([i], [tflops(p["flops"], p["ms"])], marker="o", color=color, linestyle="", label=p["label"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    ax.set(title=title, xlabel="arithmetic intensity (FLOPs per HBM byte)", ylabel="TFLOP/s")
    return fig


def cpu_figures(run: dict) -> tuple[Figure, Figure]:
    """Peak memory and time of dense against tiled attention from a recorded CPU run."""
    points = run["points"]
    ns = sorted({p["n"] for p in points})
    by = {(p["method"], p["n"]): p for p in points}
    methods = [m for m in ("dense", "tiled") if all((m, n) in by for n in ns)]
    memory = viz.memory_plot(ns, {m: [by[(m, n)]["peak_alloc_bytes"] for n in ns] for m in methods},
                             title=f"peak allocated bytes\n{label(run)}")
    time = viz.memory_plot(ns, {m: [by[(m, n)]["seconds"] for n in ns] for m in methods},
                           title=f"forward time\n{label(run)}", ylabel="seconds")
    return memory, time


# ----- exercises ------------------------------------------------------------------------------

FLOPS_EXERCISE = dict(batch=2, heads=16, n=4096, head_dim=128, causal=True)


def check_attention_flops(answer) -> bool:
    """FLOPs of a causal forward for batch 2, 16 heads, N = 4096, head dim 128."""
    from .exercises import _check_number

    b, h, n, d = (FLOPS_EXERCISE[k] for k in ("batch", "heads", "n", "head_dim"))
    expected = 2 * b * h * n * n * d  # two matmuls of 2·N·N·d FLOPs each, half the scores kept
    return _check_number(
        answer, expected, kind="a number (FLOPs)",
        hint="Q Kᵀ and P V each cost 2·N·N·d FLOPs per head (a multiply and an add); causal keeps half.",
        known_mistakes=[(4 * b * h * n * n * d, "causal attention computes only about half of the scores."),
                        (b * h * n * n * d, "a multiply-add is two FLOPs, and there are two matmuls."),
                        (2 * h * n * n * d, "every batch element has its own heads.")])


INTENSITY_EXERCISE = dict(n=4096, head_dim=128, block_m=128, element_size=2)


def check_intensity(answer) -> bool:
    """FLOPs per HBM byte of one head's non-causal forward (FlashAttention-2 IO model)."""
    from .exercises import _check_number

    n, d, block_m, size = INTENSITY_EXERCISE.values()
    query_blocks = -(-n // block_m)
    nbytes = (n * d + query_blocks * 2 * n * d + n * d + n) * size  # Q; K, V per block; O, lse
    expected = 4 * n * n * d / nbytes
    return _check_number(
        answer, expected, kind="a number (FLOPs per byte)", rel=1e-3,
        hint="FLOPs = 4·N²·d; bytes: Q read once, K and V read once per query block "
             "(N / BLOCK_M blocks), O and lse written once; 2 bytes an element.",
        known_mistakes=[(4 * n * n * d / ((4 * n * d + n) * size), "K and V are read once per query block, "
                         "not once in all.")])


LEAN_EXERCISE = dict(n=4096, block_m=128, block_n=64, num_warps=8)


def check_saved_multiplies(answer) -> bool:
    """Multiplies one thread saves with rung 4 over one query block's non-causal key loop."""
    from .exercises import _check_number

    n, block_m, block_n, warps = LEAN_EXERCISE.values()
    threads = warps * 32
    per_tile = block_m * block_n // threads  # scores of one tile each thread holds
    expected = per_tile * (n // block_n)
    return _check_number(
        answer, expected, kind="a number (multiplies per thread)",
        hint="One multiply per score; a tile's BLOCK_M x BLOCK_N scores are shared by warps x 32 threads, "
             "and the loop visits N / BLOCK_N key tiles.",
        known_mistakes=[(per_tile, "that is one key tile; the loop visits N / BLOCK_N of them."),
                        (block_m * n, "that is the whole query block: its scores are shared by all the threads."),
                        (block_m * n // warps, "a warp is 32 threads: divide by threads, not by warps.")])


# Hopper's warpgroup product (wgmma): four warps compute a tile of at least 64 rows together;
# a product with fewer rows runs on the older per-warp mma.sync
WGMMA_ROWS = 64
SWAP_EXERCISE = dict(block_m=16, block_n=64, head_dim=128)


def backward_products(block_m: int, block_n: int, head_dim: int, dq_transposed: bool = False) -> list[tuple]:
    """The five matrix products of one (query tile, key tile) pair in the fused backward (dQ
    added from the dK/dV kernel), as (product, rows, columns, inner). S^T, dV, dP^T and dK
    have the key tile's rows; dQ has the query tile's, or, built transposed, the head dim's."""
    m, n, d = block_m, block_n, head_dim
    dq = ("dQ^T = K^T dS^T", d, m, n) if dq_transposed else ("dQ = dS K", m, d, n)
    return [("S^T = K Q^T", n, m, d), ("dV += P^T dO", n, d, m), ("dP^T = V dO^T", n, m, d),
            ("dK += dS^T Q", n, d, m), dq]


def check_mma_sync_fraction(answer) -> bool:
    """The fraction of one tile pair's matrix-multiply FLOPs whose product has fewer rows than
    a warpgroup product needs (so runs on mma.sync), dQ not transposed, SWAP_EXERCISE's tiles."""
    from .exercises import _check_number

    products = backward_products(**SWAP_EXERCISE)
    flops = [2 * rows * cols * inner for _, rows, cols, inner in products]
    short = sum(f for f, (_, rows, _, _) in zip(flops, products) if rows < WGMMA_ROWS)
    return _check_number(
        answer, short / sum(flops), kind="a fraction between 0 and 1", rel=1e-3,
        hint="Write down the five products with their shapes (rows x inner times inner x columns); each costs "
             "2 x rows x columns x inner FLOPs. Which of them has fewer than 64 rows?",
        known_mistakes=[(1 / 4, "there are five products per tile pair, not four: dQ is one of them."),
                        (1 / 7, "seven is the teaching backward's count; the fused one recomputes nothing."),
                        (0.0, "one product has the query tile's 16 rows: which?")])


def check_ridge(answer, run: dict | None) -> bool:
    """The ridge point R / W, FLOPs per byte, of a recorded GPU run's measured ceilings."""
    from .exercises import _check_number

    if run is None or not (run.get("ladder") or {}).get("ceilings"):
        print("No GPU run with measured ceilings is recorded in data/bench/: nothing to check against yet.")
        return False
    ceilings = run["ladder"]["ceilings"]
    rate, bandwidth = ceilings["bf16_matmul_tflops"] * 1e12, ceilings["copy_gbps"] * 1e9
    return _check_number(
        answer, rate / bandwidth, kind="a number (FLOPs per byte)", rel=1e-3,
        hint="R is in TFLOP/s (1e12 FLOP/s), W in GB/s (1e9 bytes/s): convert both to units, then divide.",
        known_mistakes=[(ceilings["bf16_matmul_tflops"] / ceilings["copy_gbps"],
                         "TFLOP/s over GB/s leaves a factor 1000: convert to FLOP/s and bytes/s first."),
                        (bandwidth / rate, "the ridge is FLOPs per byte: rate over bandwidth.")])
