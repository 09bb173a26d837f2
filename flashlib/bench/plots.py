"""Figures of recorded runs, in the course's visual language (:mod:`flashlib.course.viz`)."""
from __future__ import annotations

from matplotlib.figure import Figure

from ..course import viz
from ..roofline import arithmetic_intensity, tflops
from .records import label

# lines that lie on top of each other stay visible: markers and dashes differ as well as colours
_LINE_STYLES = [dict(marker=m, linestyle=ls, markersize=5, markerfacecolor="none" if i % 2 else None)
                for i, (m, ls) in enumerate(zip("osD^v<>xP+" * 2, ["-", "--", "-.", ":"] * 5))]


def _legend_outside(ax, fontsize=7):
    """The legend right of the axes, never over the data."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


_LINE_COLORS = [viz.CURRENT, viz.DONE, viz.L_COLOR, viz.M_COLOR, viz.PARTIAL_COLOR, viz.MASKED,
                viz.FINAL_COLOR, "#e15759", "#b07aa1"]


def rate_plot(by_method: dict[str, dict[int, float]], title: str = "", ceiling: float | None = None,
              ylabel: str = "TFLOP/s") -> Figure:
    """A rate against N, one line per method; an optional dashed ceiling (measured matmul rate)."""
    fig, (ax,) = viz._new_figure(8.4, 3.8)
    for (name, values), color, style in zip(sorted(by_method.items()), _LINE_COLORS * 3, _LINE_STYLES):
        ns = sorted(values)
        ax.plot(ns, [values[n] for n in ns], color=color, label=name, **style)
    if ceiling:
        ax.axhline(ceiling, color=viz.FINAL_COLOR, linestyle="--", linewidth=1,
                   label=f"measured bf16 matmul {viz.fmt4(ceiling)}")
    ax.set_xscale("log", base=2)
    _legend_outside(ax)
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


def grouped_bar_chart(groups: dict[str, dict[str, float]], title: str = "", ylabel: str = "TFLOP/s",
                      order: tuple | list = ()) -> Figure:
    """Bars of several series side by side: groups = {series: {category: value}}; a category
    a series lacks gets no bar (and no invented value). Categories in ``order`` come first, in
    that order (a ladder's rungs, whichever series measured them); the rest as first met."""
    met = [c for values in groups.values() for c in values]
    categories = list(dict.fromkeys([c for c in order if c in met] + met))
    width = 0.8 / max(1, len(groups))
    fig, (ax,) = viz._new_figure(max(4.5, 1.2 * len(categories) + 2) + 2.5, 3.8)
    for i, ((series_name, values), color) in enumerate(zip(groups.items(), _LINE_COLORS * 3)):
        xs = [c + (i - (len(groups) - 1) / 2) * width for c, cat in enumerate(categories) if cat in values]
        ys = [values[cat] for cat in categories if cat in values]
        bars = ax.bar(xs, ys, width=width, color=color, label=series_name)
        for bar, value in zip(bars, ys):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), viz.fmt4(value),
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(categories)), labels=categories, fontsize=7)
    _legend_outside(ax)
    ax.set(title=title, ylabel=ylabel)
    return fig


def roofline_plot(points, peak_tflops: float, bandwidth_gbps: float, title: str = "") -> Figure:
    """Measured TFLOP/s against arithmetic intensity, under the roofline of the two ceilings.

    points: dicts with "label", "flops", "bytes" and "ms" (measured).
    """
    import numpy as np

    fig, (ax,) = viz._new_figure(8.6, 3.8)
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
    _legend_outside(ax, fontsize=6)
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
