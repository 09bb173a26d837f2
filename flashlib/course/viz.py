"""Figures for the course, in one visual language.

Every figure is a plain ``matplotlib.figure.Figure`` (no pyplot state), so a notebook
shows it by returning it from a cell and a widget turns it into PNG bytes with
:func:`figure_png`. The same colours mean the same thing everywhere:

    orange  the current tile / chunk (held in fast memory right now)
    blue    tiles / chunks already folded into the running statistics
    grey    tiles / chunks still to come
    white, hatched   tiles skipped because causal masking hides them entirely
    dark grey        single score entries hidden by the causal mask

Running statistics use fixed colours too: m purple, l green, the partial output teal,
the final output black.
"""
from __future__ import annotations

import io
import math

import matplotlib
import numpy as np
import PIL.Image
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..kernels.schedule import schedule

CURRENT = "#f28e2b"
DONE = "#4e79a7"
TODO = "#e3e3e3"
SKIPPED = "#ffffff"
MASKED = "#7f7f7f"
M_COLOR = "#8e6bb8"
L_COLOR = "#59a14f"
PARTIAL_COLOR = "#2ca7a0"
FINAL_COLOR = "#000000"

# Element states of the score grid, in colormap order.
TODO_STATE, DONE_STATE, CURRENT_STATE, SKIPPED_STATE, MASKED_STATE = range(5)
STATE_COLORS = [TODO, DONE, CURRENT, SKIPPED, MASKED]
_STATE_CMAP = ListedColormap(STATE_COLORS)

DISCARD_NOTE = ("Earlier score tiles are discarded; only their running statistics "
                "and weighted output contribution remain.")
MAX_TEXT = 24  # above this many numbers a panel shows bars only: text would be unreadable


def fmt4(x) -> str:
    """A number to four significant digits, as every figure and printout shows it."""
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


def figure_png(fig: Figure, dpi: int = 72) -> bytes:
    """Render ``fig`` to PNG bytes (what an ipywidgets Image shows)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _new_figure(width: float, height: float, ncols: int = 1, width_ratios=None,
                layout: str | None = "constrained"):
    fig = Figure(figsize=(width, height), layout=layout)
    axes = fig.subplots(1, ncols, width_ratios=width_ratios, squeeze=False)[0]
    return fig, list(axes)


def _to_numpy(t) -> np.ndarray:
    """A float64 copy: a numpy view of the learner's tensor would follow its later changes into a drawn figure,
    and would leave its storage unable to resize."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.float64, copy=True).numpy()
    return np.asarray(t, dtype=np.float64)


# ----- dense attention: S and P ------------------------------------------------------

def matrix_heatmap(matrix, title: str = "", ax=None, annotate: bool | None = None,
                   cmap: str = "viridis"):
    """Heatmap of a (seq_q, seq_k) matrix; -inf entries (causally masked) in dark grey."""
    values = _to_numpy(matrix)
    if values.ndim != 2:
        raise ValueError(f"matrix_heatmap: argument 'matrix' must be 2-D (seq_q, seq_k), "
                         f"got shape {values.shape}")
    fig = None
    if ax is None:
        fig, (ax,) = _new_figure(4.2, 3.6)
    masked = ~np.isfinite(values)
    colormap = matplotlib.colormaps[cmap].with_extremes(bad=MASKED)
    image = ax.imshow(np.ma.masked_array(values, masked), cmap=colormap, aspect="equal")
    ax.figure.colorbar(image, ax=ax, shrink=0.85)
    if annotate if annotate is not None else values.size <= 64:
        for (i, j), x in np.ndenumerate(values):
            r, g, b, _ = image.cmap(image.norm(x)) if not masked[i, j] else (0, 0, 0, 1)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # light text on dark cells
            ax.text(j, i, "-inf" if masked[i, j] else fmt4(x), ha="center", va="center",
                    fontsize=7, color="white" if dark else "black")
    ax.set(title=title, xlabel="key j", ylabel="query i")
    return fig if fig is not None else ax


def scores_figure(scores, probs, causal: bool = False) -> Figure:
    """S and P side by side, one batch/head: what standard attention writes to memory."""
    fig, (ax_s, ax_p) = _new_figure(8.6, 3.6, 2)
    suffix = " (masked: dark grey)" if causal else ""
    matrix_heatmap(scores, "S = q kᵀ · scale" + suffix, ax=ax_s)
    matrix_heatmap(probs, "P = softmax(S)", ax=ax_p, cmap="magma")
    return fig


# ----- tiled attention: the score grid and running statistics ------------------------

def tile_states(trace, step: int) -> np.ndarray:
    """(seq_q, seq_k) array of element states at ``step`` of a :class:`flashlib.TiledTrace`."""
    grid = np.full((trace.seq_q, trace.seq_k), TODO_STATE, dtype=np.int8)
    for (r0, r1), (c0, c1) in trace.skipped:
        grid[r0:r1, c0:c1] = SKIPPED_STATE
    for done in trace.steps[:step]:
        grid[done.rows[0]:done.rows[1], done.cols[0]:done.cols[1]] = DONE_STATE
    if trace.steps:
        now = trace.steps[step]
        grid[now.rows[0]:now.rows[1], now.cols[0]:now.cols[1]] = CURRENT_STATE
    if trace.causal:
        for done in trace.steps[:step + 1]:
            hidden = ~np.isfinite(_to_numpy(done.scores))
            block = grid[done.rows[0]:done.rows[1], done.cols[0]:done.cols[1]]
            block[hidden] = MASKED_STATE
    return grid


def _grid_segments(seq_q, seq_k, block_q, block_k):
    rows = sorted(set(range(0, seq_q, block_q)) | {seq_q})
    cols = sorted(set(range(0, seq_k, block_k)) | {seq_k})
    return [[(0, r), (seq_k, r)] for r in rows] + [[(c, 0), (c, seq_q)] for c in cols]


def _bar_verts(x, heights, width=0.8):
    x, h = np.asarray(x, dtype=float), np.asarray(heights, dtype=float)
    left, right, zero = x - width / 2, x + width / 2, np.zeros_like(h)
    return np.stack([np.stack([left, zero], 1), np.stack([left, h], 1),
                     np.stack([right, h], 1), np.stack([right, zero], 1)], 1)


def _padded(values, margin: float) -> tuple[float, float]:
    flat = np.concatenate([np.zeros(1), *[np.ravel(v) for v in values]])
    lo, hi = float(flat.min()), float(flat.max())
    pad = margin * max(hi - lo, 1e-6)
    return lo - pad, hi + pad


def trace_limits(trace, margin: float = 0.15) -> dict[str, tuple[float, float]]:
    """One y range per panel ("m", "l", "out") that holds its values at every step of a
    trace, so that a slider never rescales the axes under the reader's eyes."""
    m = [_to_numpy(s.m) for s in trace.steps]
    return {"m": _padded([x[np.isfinite(x)] for x in m], margin),
            "l": _padded([_to_numpy(s.l) for s in trace.steps], margin),
            "out": _padded([_to_numpy(trace.out)] + [_to_numpy(s.partial) for s in trace.steps], margin)}


def _query_blocks(trace) -> dict[tuple[int, int], list[int]]:
    """The steps of each query block, in schedule order."""
    blocks: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(trace.steps):
        blocks.setdefault(s.rows, []).append(i)
    return blocks


class TileStepView:
    """The figure of one tiled-attention step, built once and updated in place.

    Left: the score grid, each tile current / already accumulated / still to come (or
    skipped by causal masking). Middle, one panel each: m and l of the current query rows,
    and their partial output acc / l against the final output (bars with black ticks for a
    few rows, two images side by side for many). Right: the partial output's distance from
    the final output, one line per query block, and the score elements held versus the
    full matrix.

    A slider move must redraw fast: :meth:`draw` updates the artists that change with the
    step and :meth:`png` paints only those over a cached picture of everything else.
    """

    def __init__(self, dpi: int = 72):
        self.fig = Figure(figsize=(12.0, 4.8), dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        self.fig.suptitle(DISCARD_NOTE, fontsize=9, y=0.985)
        self.ax_grid = self.fig.add_axes((0.035, 0.25, 0.25, 0.6))
        self.ax_m = self.fig.add_axes((0.35, 0.71, 0.36, 0.14))
        self.ax_l = self.fig.add_axes((0.35, 0.50, 0.36, 0.14))
        self.ax_out = self.fig.add_axes((0.35, 0.10, 0.36, 0.30))
        self.ax_err = self.fig.add_axes((0.78, 0.12, 0.205, 0.7))
        self._build_grid()
        self._build_statistics()
        self._build_output()
        self._build_distance()
        self._texts = []
        self._schedule = None
        self._ylim = None
        self._background = None
        self.titles = [ax.text(0.5, 1.03, "", transform=ax.transAxes, ha="center", va="bottom",
                               fontsize=10) for ax in (self.ax_grid, self.ax_m, self.ax_err)]

    def _build_grid(self):
        ax = self.ax_grid
        self.grid_image = ax.imshow(np.zeros((1, 1)), cmap=_STATE_CMAP, vmin=0,
                                    vmax=len(STATE_COLORS) - 1, interpolation="nearest",
                                    aspect="equal", extent=(0, 1, 1, 0))
        self.tile_lines = LineCollection([], colors="white", linewidths=1.5)
        ax.add_collection(self.tile_lines)
        self.skipped_hatch = PolyCollection([], facecolors="none", edgecolors="#b0b0b0",
                                            hatch="//", linewidths=0)
        ax.add_collection(self.skipped_hatch)
        self.current_box = Rectangle((0, 0), 1, 1, fill=False, edgecolor="black", linewidth=2,
                                     zorder=3)
        ax.add_patch(self.current_box)
        ax.set(xlabel="key j", ylabel="query i")
        ax.tick_params(length=0)  # tick marks would touch the repainted grid image
        ax.legend(handles=[Patch(color=CURRENT, label="current tile"),
                           Patch(color=DONE, label="already accumulated"),
                           Patch(color=TODO, label="other tiles"),
                           Patch(facecolor=SKIPPED, edgecolor="#b0b0b0", hatch="//",
                                 label="skipped (causal)"),
                           Patch(color=MASKED, label="masked entry")],
                  fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)

    def _build_statistics(self):
        self.bars = {}
        for name, ax, color, label in (("m", self.ax_m, M_COLOR, "m, running max"),
                                       ("l", self.ax_l, L_COLOR, "l, denominator")):
            self.bars[name] = PolyCollection([], facecolors=color, edgecolors="none")
            ax.add_collection(self.bars[name])
            ax.axhline(0.0, color="black", linewidth=0.6)
            ax.set_ylabel(label, fontsize=8, color=color)
            ax.tick_params(labelsize=7)
            ax.set_xticks([])

    def _build_output(self):
        ax = self.ax_out
        self.bars["partial"] = PolyCollection([], facecolors=PARTIAL_COLOR, edgecolors="none")
        ax.add_collection(self.bars["partial"])
        self.final_ticks = LineCollection([], colors=FINAL_COLOR, linewidths=1.5)
        ax.add_collection(self.final_ticks)
        self.out_zero = ax.axhline(0.0, color="black", linewidth=0.6)
        # many rows: the partial output and the final output as two images, one colour scale
        self.out_image = ax.imshow(np.zeros((1, 1)), cmap="coolwarm", interpolation="nearest",
                                   aspect="auto", visible=False)
        ax.tick_params(labelsize=7)
        ax.set_xticks([])
        self.out_label = ax.set_ylabel("", fontsize=8, color=PARTIAL_COLOR)

    def _build_distance(self):
        ax = self.ax_err
        self.distance_lines = LineCollection([], colors=PARTIAL_COLOR, linewidths=1)
        ax.add_collection(self.distance_lines)
        (self.distance_points,) = ax.plot([], [], ".", color=PARTIAL_COLOR)
        (self.distance_dot,) = ax.plot([], [], "o", color=CURRENT, markersize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("max |partial - final|, current rows", fontsize=8)
        ax.tick_params(labelsize=7)

    def draw(self, trace, step: int = 0, ylim=None) -> Figure:
        """Show ``step`` of ``trace`` (a :class:`flashlib.TiledTrace`); returns the figure.
        ylim: the panels' y ranges as :func:`trace_limits` gives them (computed if None)."""
        if not trace.steps:
            raise ValueError("TileStepView.draw: the trace has no computed tiles")
        if (isinstance(step, bool) or not isinstance(step, (int, np.integer))
                or not 0 <= step < len(trace.steps)):
            raise ValueError(f"TileStepView.draw: argument 'step' must be an int in "
                             f"0..{len(trace.steps) - 1}, got {step!r}")
        for text in self._texts:
            text.remove()
        self._texts = []
        ylim = dict(ylim) if ylim is not None else trace_limits(trace)
        if trace is not self._schedule or ylim != self._ylim:
            self._set_schedule(trace, ylim)
            self._schedule, self._ylim, self._background = trace, ylim, None
        self._draw_grid(trace, step)
        self._draw_statistics(trace, step)
        self._draw_output(trace, step)
        self._draw_distance(trace, step)
        return self.fig

    def _foreground(self):
        """Artists repainted on every step: those that change, and the static ones that
        overlap them (spines, zero lines), in full-render order."""
        changing = [self.grid_image, self.skipped_hatch, self.tile_lines, self.current_box,
                    *self.bars.values(), self.final_ticks, self.out_image, self.distance_dot,
                    *self.titles, *self._texts]
        overlapping = [*self.ax_m.lines, *self.ax_l.lines, self.out_zero]
        for ax in (self.ax_grid, self.ax_m, self.ax_l, self.ax_out, self.ax_err):
            overlapping += list(ax.spines.values())
        return sorted(changing + overlapping, key=lambda artist: artist.get_zorder())

    def png(self) -> bytes:
        """The figure as PNG bytes, repainting only what :meth:`draw` changed."""
        dynamic = self._foreground()
        for artist in dynamic:
            artist.set_animated(True)  # left out of the cached background
        if self._background is None:
            self.canvas.draw()
            self._background = self.canvas.copy_from_bbox(self.fig.bbox)
        else:
            self.canvas.restore_region(self._background)
        renderer = self.canvas.get_renderer()
        for artist in dynamic:
            artist.draw(renderer)
            artist.set_animated(False)
        width, height = self.canvas.get_width_height()
        image = PIL.Image.frombuffer("RGBA", (width, height), self.canvas.buffer_rgba(),
                                     "raw", "RGBA", 0, 1)
        buf = io.BytesIO()
        image.save(buf, format="png", compress_level=1)
        return buf.getvalue()

    def _few(self, trace) -> bool:
        """Bars and numbers for a few output entries; images for many."""
        rows = min(trace.block_q, trace.seq_q)
        return rows * trace.out.shape[-1] <= MAX_TEXT

    def _set_schedule(self, trace, ylim):
        seq_q, seq_k = trace.seq_q, trace.seq_k
        self.grid_image.set_extent((0, seq_k, seq_q, 0))
        self.tile_lines.set_segments(_grid_segments(seq_q, seq_k, trace.block_q, trace.block_k))
        self.skipped_hatch.set_verts([[(c0, r0), (c1, r0), (c1, r1), (c0, r1)]
                                      for (r0, r1), (c0, c1) in trace.skipped])
        self.ax_grid.set(xlim=(0, seq_k), ylim=(seq_q, 0))
        small = seq_q * seq_k <= 400
        self.ax_grid.set_xticks(np.arange(seq_k) + 0.5 if small else [],
                                labels=[str(j) for j in range(seq_k)] if small else [])
        self.ax_grid.set_yticks(np.arange(seq_q) + 0.5 if small else [],
                                labels=[str(i) for i in range(seq_q)] if small else [])
        distances = [s.distance for s in trace.steps]
        self.distance_lines.set_segments([[(i, distances[i]) for i in steps]
                                          for steps in _query_blocks(trace).values()])
        self.distance_points.set_data(range(len(distances)), distances)
        self.ax_err.set_xlim(-0.5, len(distances) - 0.5)
        self.ax_err.set_ylim(0.0, max(max(distances), 1e-6) * 1.15)
        rows = min(trace.block_q, trace.seq_q)
        for ax, name in ((self.ax_m, "m"), (self.ax_l, "l")):
            ax.set_xlim(-0.6, rows - 0.4)
            ax.set_ylim(*ylim[name])
        few, dim = self._few(trace), trace.out.shape[-1]
        for artist in (self.bars["partial"], self.final_ticks, self.out_zero):
            artist.set_visible(few)
        self.out_image.set_visible(not few)
        if few:
            self.ax_out.set_xlim(-1, rows * (dim + 1) - 1)
            self.ax_out.set_ylim(*ylim["out"])
            self.out_label.set_text("partial output acc / l\n(black ticks: final output)")
        else:
            bound = max(abs(ylim["out"][0]), abs(ylim["out"][1]))
            self.out_image.set_clim(-bound, bound)
            self.out_label.set_text("partial output acc / l (left)\nand final output (right)")

    def _draw_grid(self, trace, step):
        self.grid_image.set_data(tile_states(trace, step))
        now = trace.steps[step]
        (r0, r1), (c0, c1) = now.rows, now.cols
        self.current_box.set_bounds(c0, r0, c1 - c0, r1 - r0)
        # beyond 8 columns a cell is narrower than four digits
        if now.scores.numel() <= MAX_TEXT and max(trace.seq_q, trace.seq_k) <= 8:
            for (i, j), s in np.ndenumerate(_to_numpy(now.scores)):
                self._texts.append(self.ax_grid.text(c0 + j + 0.5, r0 + i + 0.5, fmt4(s),
                                                     ha="center", va="center", fontsize=7))
        self.titles[0].set_text(f"step {step} of steps 0-{len(trace.steps) - 1}: "
                                f"rows {r0}:{r1}, keys {c0}:{c1}")

    def _draw_statistics(self, trace, step):
        now = trace.steps[step]
        rows = np.arange(now.rows[1] - now.rows[0])
        m = _to_numpy(now.m)
        m = np.where(np.isfinite(m), m, 0.0)  # a row that has seen only masked keys: m = -inf
        for name, ax, values in (("m", self.ax_m, m), ("l", self.ax_l, _to_numpy(now.l))):
            self.bars[name].set_verts(_bar_verts(rows, values))
            if len(rows) <= 8:
                for x, h in zip(rows, values):
                    self._texts.append(ax.text(x, h, fmt4(h), ha="center", fontsize=7,
                                               va="bottom" if h >= 0 else "top"))
        self.titles[1].set_text(f"rows {now.rows[0]}:{now.rows[1]} after folding in keys "
                                f"{now.cols[0]}:{now.cols[1]}")

    def _draw_output(self, trace, step):
        now = trace.steps[step]
        partial = _to_numpy(now.partial)
        final = _to_numpy(trace.out[now.rows[0]:now.rows[1]])
        n_rows, dim = partial.shape
        if not self._few(trace):
            gap = np.full((n_rows, 1), np.nan)
            self.out_image.set_data(np.concatenate([partial, gap, final], axis=1))
            r0 = now.rows[0]
            self.out_image.set_extent((-0.5, 2 * dim + 0.5, r0 + n_rows - 0.5, r0 - 0.5))  # rows by their index
            self.ax_out.set_xlim(-0.5, 2 * dim + 0.5)
            self.ax_out.set_ylim(r0 + n_rows - 0.5, r0 - 0.5)
            return
        px = (np.arange(n_rows)[:, None] * (dim + 1) + np.arange(dim)[None, :]).ravel()
        self.bars["partial"].set_verts(_bar_verts(px, partial.ravel()))
        self.final_ticks.set_segments([[(x - 0.4, y), (x + 0.4, y)] for x, y in zip(px, final.ravel())])
        for x, h in zip(px, partial.ravel()):
            self._texts.append(self.ax_out.text(x, h, fmt4(h), ha="center", fontsize=6,
                                                va="bottom" if h >= 0 else "top"))
        axis = self.ax_out.get_xaxis_transform()
        for i in range(n_rows):
            self._texts.append(self.ax_out.text(i * (dim + 1) + (dim - 1) / 2, -0.02, f"row {now.rows[0] + i}",
                                                fontsize=8, transform=axis, ha="center", va="top"))

    def _draw_distance(self, trace, step):
        now = trace.steps[step]
        self.distance_dot.set_data([step], [now.distance])
        share = 100.0 * now.tile_elements / now.full_elements
        self.titles[2].set_text(f"distance {fmt4(now.distance)}\nscores held: {now.tile_elements} "
                                f"of {now.full_elements} ({fmt4(share)}%)")


def tile_step_figure(trace, step: int = 0, ylim=None, dpi: int = 72) -> Figure:
    """A new figure of ``step`` of a :class:`flashlib.TiledTrace` (see :class:`TileStepView`)."""
    return TileStepView(dpi=dpi).draw(trace, step, ylim)


# ----- online softmax ------------------------------------------------------------------

def online_softmax_figure(x, steps, step: int) -> Figure:
    """One step of online softmax over a 1-D row ``x`` (from ``online_softmax_steps``).

    Left: the row, chunks coloured as seen / current / to come, with the running max m.
    Right: m and l after every step; the current step marked, with its rescale factor.
    """
    x = _to_numpy(x).ravel()
    if not 1 <= step < len(steps):
        raise ValueError(f"online_softmax_figure: argument 'step' must be in 1..{len(steps) - 1}, "
                         f"got {step}")
    now = steps[step]
    colors = [DONE if i < now.start else CURRENT if i < now.stop else TODO for i in range(len(x))]
    # A fixed layout: a slider redraws this figure, and constrained layout costs most of the time.
    fig, (ax_row, ax_state) = _new_figure(10.0, 3.6, 2, layout=None)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.9, wspace=0.18)
    ax_row.bar(range(len(x)), x, color=colors, edgecolor="black", linewidth=0.5)
    m = float(now.state.m)
    ax_row.axhline(m, color=M_COLOR, linestyle="--", label=f"running max m = {fmt4(m)}")
    if len(x) <= MAX_TEXT:
        for i, xi in enumerate(x):
            ax_row.text(i, xi, fmt4(xi), ha="center", va="bottom" if xi >= 0 else "top", fontsize=7)
    ax_row.legend(fontsize=7, loc="lower right")
    ax_row.set(xlabel="element", ylabel="x", title=f"step {step}: elements {now.start}:{now.stop}")
    ms = [float(s.state.m) for s in steps[1:]]
    ls = [float(s.state.l) for s in steps[1:]]
    ax_state.plot(range(1, len(steps)), ms, color=M_COLOR, marker="o", label="m (running max)")
    ax_state.plot(range(1, len(steps)), ls, color=L_COLOR, marker="o", label="l (denominator)")
    ax_state.axvline(step, color=CURRENT, linewidth=2)
    if len(steps) <= 33:
        ax_state.set_xticks(range(1, len(steps)))
    ax_state.legend(fontsize=7)
    ax_state.set(xlabel="step", title=f"m = {fmt4(m)}, l = {fmt4(now.state.l)}, "
                                      f"old l rescaled by {fmt4(now.rescale)}")
    return fig


# ----- errors and memory ---------------------------------------------------------------

def error_curve(labels, errors, title: str = "", ylabel: str = "max |error|",
                tolerance: float | None = None) -> Figure:
    """Errors of several variants (tile sizes, dtypes, ...) against a reference, log scale."""
    errors = [float(e) for e in errors]
    fig, (ax,) = _new_figure(min(10.0, max(4.0, 0.4 * len(errors) + 2.0)), 3.6)
    ax.plot(range(len(errors)), [max(e, 1e-17) for e in errors], color=PARTIAL_COLOR, marker="o")
    if tolerance is not None:
        ax.axhline(tolerance, color=CURRENT, linestyle="--", label=f"tolerance {fmt4(tolerance)}")
        ax.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(errors)), labels=[str(s) for s in labels], rotation=60, ha="right", fontsize=7)
    ax.set(title=title, ylabel=ylabel)
    return fig


def memory_plot(ns, series: dict, title: str = "", xlabel: str = "sequence length N",
                ylabel: str = "bytes") -> Figure:
    """Memory (or traffic) against N on log-log axes, one line per named series."""
    outside = len(series) > 3  # many lines: the legend goes right of the axes, off the data
    fig, (ax,) = _new_figure(8.0 if outside else 5.6, 3.6)
    colors = [CURRENT, DONE, L_COLOR, M_COLOR, MASKED, PARTIAL_COLOR, FINAL_COLOR, "#e15759"]
    for i, ((name, values), color) in enumerate(zip(series.items(), colors)):
        # lines that coincide stay visible: each has its own marker and dash as well as its colour
        ax.plot(list(ns), [float(v) for v in values], marker="osD^v<>x"[i], linestyle=["-", "--", "-.", ":"][i % 4],
                markerfacecolor="none" if i % 2 else color, color=color, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    if outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=7)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


# ----- the kernel notebooks (05-07) ---------------------------------------------------

def program_blocks(n: int, block: int):
    """Which program handles each element of a length-n vector, and which lanes are masked."""
    programs = -(-n // block)
    fig = Figure(figsize=(8, 1.8), layout="constrained")
    ax = fig.add_subplot()
    for pid in range(programs):
        start = pid * block
        live = min(block, n - start)
        ax.barh(0, live, left=start, color=colormaps["tab10"](pid % 10), edgecolor="white")
        ax.text(start + live / 2, 0, f"program {pid}", ha="center", va="center", fontsize=8, color="white")
        if live < block:
            ax.barh(0, block - live, left=start + live, color=TODO, hatch="//", edgecolor="white")
            ax.text(start + live + (block - live) / 2, 0, "masked", ha="center", va="center", fontsize=8)
    ax.axvline(n, color="black", lw=1)
    ax.set_yticks([])
    ax.set_xlabel("element index")
    ax.set_title(f"n = {n}, BLOCK = {block}: {programs} programs; lanes past n are masked off")
    return fig


def tile_schedule(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool):
    """The forward's grid of (query block, key tile): computed or skipped."""
    grid = np.array(schedule(seq_q, seq_k, block_q, block_k, causal), dtype=float)
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(grid, cmap=ListedColormap([TODO, DONE]),
              vmin=0, vmax=1, aspect="auto")
    ax.set_xlabel(f"key tile (BLOCK_K = {block_k})")
    ax.set_ylabel(f"query block = program (BLOCK_Q = {block_q})")
    done = int(grid.sum())
    ax.set_title(f"{'causal' if causal else 'full'}: {done} of {grid.size} tiles computed")
    return fig


def loss_curves(curves: dict):
    """Training loss per step, one line per attention implementation."""
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for (name, losses), style in zip(curves.items(), ("-", "--", ":")):
        ax.plot(range(1, len(losses) + 1), losses, style, lw=2, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    ax.set_title("the same model trained with each attention")
    return fig


# ----- masks and variants (09) ---------------------------------------------------------

_BLOCK_CMAP = ListedColormap([SKIPPED, PARTIAL_COLOR, DONE])  # indexed by SKIPPED, PARTIAL, FULL = 0, 1, 2


def block_mask_figure(block_mask, title: str = "", batch: int = 0, head: int = 0) -> Figure:
    """A :class:`flashlib.tiled.BlockMask` as a grid of tiles: skipped (never computed, white,
    hatched), partial (the mask is evaluated inside the tile) and full (computed without a mask)."""
    kinds = _to_numpy(block_mask.kinds[min(batch, block_mask.kinds.shape[0] - 1),
                                       min(head, block_mask.kinds.shape[1] - 1)])
    fig, (ax,) = _new_figure(6.6, 4.4)
    rows, cols = kinds.shape
    ax.imshow(kinds, cmap=_BLOCK_CMAP, vmin=0, vmax=2, interpolation="nearest", aspect="equal",
              extent=(0, cols, rows, 0))
    skipped = [[(c, r), (c + 1, r), (c + 1, r + 1), (c, r + 1)] for r, c in zip(*np.nonzero(kinds == 0))]
    ax.add_collection(PolyCollection(skipped, facecolors="none", edgecolors="#b0b0b0", hatch="//", linewidths=0))
    if rows * cols <= 400:  # tile borders while they can be told apart
        ax.add_collection(LineCollection(_grid_segments(rows, cols, 1, 1), colors="white", linewidths=0.8))
    counts = {name: int((kinds == kind).sum()) for name, kind in (("full", 2), ("partial", 1), ("skipped", 0))}
    ax.legend(handles=[Patch(color=DONE, label=f"full: no mask ({counts['full']})"),
                       Patch(color=PARTIAL_COLOR, label=f"partial: mask inside ({counts['partial']})"),
                       Patch(facecolor=SKIPPED, edgecolor="#b0b0b0", hatch="//",
                             label=f"skipped ({counts['skipped']})")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    ax.set(xlabel=f"key tile (block_k = {block_mask.block_k})", ylabel=f"query block (block_q = {block_mask.block_q})",
           title=title)
    return fig


def packing_figure(lengths, title: str = "") -> Figure:
    """A batch of sequences two ways: padded to the longest (every row as long, padding grey) and
    packed one after another (flash_attention_varlen's layout, cumulative lengths marked)."""
    lengths = [int(n) for n in lengths]
    longest, total = max(lengths, default=0), sum(lengths)
    fig, (ax_pad, ax_pack) = _new_figure(9.0, 2.8 + 0.25 * len(lengths), 2,
                                         width_ratios=[max(longest, 1), max(total, 1) * 0.6])
    colors = [CURRENT, DONE, L_COLOR, M_COLOR, PARTIAL_COLOR, "#e15759", "#b07aa1", MASKED]
    for row, n in enumerate(lengths):
        ax_pad.barh(row, n, color=colors[row % len(colors)], edgecolor="white")
        ax_pad.barh(row, longest - n, left=n, color=TODO, edgecolor="white")
    ax_pad.set(yticks=range(len(lengths)), yticklabels=[f"seq {b}: {n}" for b, n in enumerate(lengths)],
               xlabel="position", title=f"padded: {len(lengths)} x {longest} = {len(lengths) * longest} slots")
    ax_pad.invert_yaxis()
    start = 0
    for b, n in enumerate(lengths):
        ax_pack.barh(0, n, left=start, color=colors[b % len(colors)], edgecolor="white")
        start += n
    ax_pack.set(yticks=[], xlabel="packed position", title=f"packed: {total} tokens, cu_seqlens "
                f"{[0] + list(np.cumsum(lengths).tolist())}")
    fig.suptitle(title, fontsize=10)
    return fig


def softcap_figure(caps=(5.0, 20.0), limit: float = 60.0) -> Figure:
    """Soft-capping c·tanh(s / c) against the score s, and its slope (the gradient's factor)."""
    s = np.linspace(-limit, limit, 401)
    fig, (ax_value, ax_slope) = _new_figure(9.0, 3.2, 2)
    ax_value.plot(s, s, color=MASKED, linestyle=":", label="no cap")
    for cap, color in zip(caps, (CURRENT, DONE)):
        ax_value.plot(s, cap * np.tanh(s / cap), color=color, label=f"c = {fmt4(cap)}")
        ax_slope.plot(s, 1 - np.tanh(s / cap) ** 2, color=color, label=f"c = {fmt4(cap)}")
    ax_value.set(xlabel="score s", ylabel="c tanh(s / c)", title="capped score")
    ax_slope.set(xlabel="score s", ylabel="1 - tanh(s / c)^2", title="its slope: the gradient's factor")
    ax_value.legend(fontsize=7)
    ax_slope.legend(fontsize=7)
    return fig


def score_function_figure(functions: dict, n: int = 16, head: int = 0) -> Figure:
    """What each score function adds to a score of 0, f(0, 0, head, i, j), over queries i and keys j:
    ALiBi's distance penalty, a bias table's band, a temperature's (none: it scales)."""
    fig, axes = _new_figure(3.0 * len(functions), 3.0, len(functions))
    axes = axes if isinstance(axes, (list, tuple, np.ndarray)) else [axes]
    zero = torch.zeros(1, 1, n, n, dtype=torch.float64)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.full((1, 1, 1, 1), head, dtype=torch.long)
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for ax, (label, fn) in zip(axes, functions.items()):
        added = fn(zero, b, h, rows, cols).detach().double().expand(1, 1, n, n)[0, 0].numpy()
        limit = max(float(np.abs(added).max()), 1e-12)
        image = ax.imshow(added, cmap="RdBu", vmin=-limit, vmax=limit)
        ax.set(title=label, xlabel="key j", ylabel="query i")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return fig
