"""Notebook 11's support: a traced ring of CPU processes, its figures, the stepper, checkers.

:func:`run_ring_demo` launches a ring with :func:`flashlib.distributed.spawn`, records every
rank's running output after every step, and returns one :class:`RingDemo` per layout.
:func:`ring_step_figure` draws one step (which pairs of the attention matrix have been
computed, who holds which key/value shard, each rank's distance to its final output);
:class:`RingStepper` puts a slider on it; :func:`idle_figure` compares the causal work of
the two layouts. Colours as everywhere in the course (:mod:`flashlib.course.viz`):
orange computed at this step, blue computed before, grey still to come, dark grey hidden
by the causal mask, white hatched idle.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Patch, Rectangle

from .. import dense_attention, edition
from .. import distributed as ring
from . import verdicts, viz
from .exercises import Digest, matches
from .widgets import FigureBox

ROUNDING = 1e-12  # distances below this are float64 rounding, shown as such


# ----- the traced ring ----------------------------------------------------------------

@dataclass
class RingDemo:
    """One layout of a traced ring: what every rank did at every step, and the references.

    ``origins[t][r]`` is the rank whose K, V shard rank r holds at step t, ``blocks[t][r]``
    what it computed (:func:`flashlib.distributed.ring_block`, None if idle) and
    ``distances[t][r]`` the max |running output - final output| over its rows after it;
    ``partials[t][r]`` is that running output, (batch, heads, local_seq, head_dim). The
    other tensors are (batch, heads, seq, head_dim), gathered into sequence order.
    """

    layout: str
    world_size: int
    causal: bool
    positions: list          # per rank: the global positions it holds, (local_seq,)
    origins: list
    blocks: list
    distances: list
    partials: list
    out: torch.Tensor        # the ring's output, gathered
    reference: torch.Tensor  # dense float64 attention over the whole sequence
    grads: list              # the ring's dq, dk, dv, gathered
    reference_grads: list    # autograd's through dense attention
    sent_bytes: list         # per rank: bytes posted at each forward step

    @property
    def seq(self) -> int:
        return sum(len(p) for p in self.positions)


def _reference(q, k, v, dout, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dense_attention(*leaves, causal=causal)
    out.backward(dout)
    return out.detach(), [leaf.grad for leaf in leaves]


def _demo(layout, traces, q, k, v, dout, causal) -> RingDemo:
    world_size, seq = len(traces), q.shape[-2]
    reference, reference_grads = _reference(q, k, v, dout, causal)
    positions = [ring.positions(seq, r, world_size, layout=layout) for r in range(world_size)]
    steps = [t[layout]["steps"] for t in traces]  # [rank][step]
    distances = [[(steps[r][t].out - reference[..., positions[r], :]).abs().max().item()
                  for r in range(world_size)] for t in range(world_size)]
    gather = lambda parts: ring.unshard(parts, layout=layout)  # noqa: E731
    return RingDemo(
        layout, world_size, causal, positions,
        [[steps[r][t].origin for r in range(world_size)] for t in range(world_size)],
        [[steps[r][t].block for r in range(world_size)] for t in range(world_size)],
        distances, [[steps[r][t].out for r in range(world_size)] for t in range(world_size)],
        gather([s[-1].out for s in steps]), reference,
        [gather([t[layout]["grads"][i] for t in traces]) for i in range(3)], reference_grads,
        [t[layout]["sent_bytes"] for t in traces])


def run_ring_demo(world_size: int = 4, *, chunk: int = 2, heads: int = 1, head_dim: int = 4,
                  causal: bool = True, seed: int = 0, timeout: float = 120.0) -> dict:
    """Launch a ring of ``world_size`` CPU processes on a seeded float64 sequence of
    2 · world_size · chunk tokens; return {layout: :class:`RingDemo`} for both layouts."""
    g = torch.Generator().manual_seed(seed)
    seq = 2 * world_size * chunk
    q, k, v, dout = (torch.randn(1, heads, seq, head_dim, generator=g, dtype=torch.float64)
                     for _ in range(4))
    traces = ring.spawn(ring.trace_worker, world_size, timeout=timeout,
                        args=(q, k, v, causal, ring.LAYOUTS, dout))
    return {layout: _demo(layout, traces, q, k, v, dout, causal) for layout in ring.LAYOUTS}


def fmt_distance(x: float) -> str:
    """A distance to four digits, or 'rounding' once it is float64 rounding error."""
    return "rounding" if x < ROUNDING else viz.fmt4(x)


# ----- work per (rank, step) ----------------------------------------------------------

def step_work(world_size: int, *, layout: str, causal: bool = True) -> np.ndarray:
    """(ranks, steps) array: the share of a full local block each rank computes per step,
    for long shards (a causal diagonal block counts one half)."""
    work = np.zeros((world_size, world_size))
    # Shards of 2 tokens are enough to read each block's shape (full, half or diagonal);
    # a block covering rows x cols of the 2 x 2 block does rows * cols / 4 of the work.
    for r in range(world_size):
        for t in range(world_size):
            block = ring.ring_block(r, (r - t) % world_size, 2, causal=causal, layout=layout)
            if block is not None:
                rows, cols = block.q.stop - block.q.start, block.k.stop - block.k.start
                work[r, t] = rows * cols / 4 / (2 if block.causal else 1)
    return work


def critical_path(world_size: int, *, layout: str, causal: bool = True) -> float:
    """Blocks of time the ring takes: each step lasts as long as its busiest rank."""
    return float(step_work(world_size, layout=layout, causal=causal).max(axis=0).sum())


def hiding_length(flops_per_s: float, bytes_per_s: float, element_size: int, *,
                  share: float = 1.0, group: int = 1, backward: bool = False) -> float:
    """Shortest local_seq L at which a step's computation outlasts its transfer.

    Forward: a step computes share · 2 · 2 · L² · q_heads · head_dim FLOPs (two L x L x head_dim
    products per query head; share = 1/2 for zigzag's causal half blocks) and sends
    2 · L · kv_heads · head_dim · element_size bytes (K and V), with q_heads = group · kv_heads
    (grouped-query attention). head_dim and kv_heads cancel:
    L = element_size · flops_per_s / (2 · share · group · bytes_per_s).

    backward: seven products per block (flashlib's backward kernels recompute S and dP in each
    of its two kernels, then dV, dK and dQ) and K, V plus dK, dV, which travel in float32
    (4 bytes each).
    """
    products, sent = (7, 2 * element_size + 2 * 4) if backward else (2, 2 * element_size)
    return sent * flops_per_s / (2 * products * share * group * bytes_per_s)


# ----- figures ------------------------------------------------------------------------

def pair_states(demo: RingDemo, step: int) -> np.ndarray:
    """(seq, seq) states of the global attention matrix after ``step`` (viz's state codes)."""
    seq = demo.seq
    grid = np.full((seq, seq), viz.TODO_STATE, dtype=np.int8)
    if demo.causal:
        grid[np.triu(np.ones((seq, seq), dtype=bool), 1)] = viz.MASKED_STATE
    for t in range(step + 1):
        for r, block in enumerate(demo.blocks[t]):
            if block is None:
                continue
            rows = demo.positions[r][block.q].numpy()
            cols = demo.positions[demo.origins[t][r]][block.k].numpy()
            seen = rows[:, None] >= cols[None, :] if demo.causal else np.ones((len(rows), len(cols)), bool)
            cell = np.ix_(rows, cols)
            grid[cell] = np.where(seen, viz.CURRENT_STATE if t == step else viz.DONE_STATE, grid[cell])
    return grid


def _matrix_panel(ax, demo: RingDemo, step: int):
    colours = ListedColormap(viz.STATE_COLORS)
    ax.imshow(pair_states(demo, step), cmap=colours, vmin=0, vmax=len(viz.STATE_COLORS) - 1,
              interpolation="nearest")
    chunk = demo.seq // (demo.world_size * (2 if demo.layout == "zigzag" else 1))
    owner = {int(p) // chunk: r for r, ps in enumerate(demo.positions) for p in ps}
    ticks = [c * chunk + (chunk - 1) / 2 for c in sorted(owner)]
    ax.set_yticks(ticks, [f"rank {owner[c]}" for c in sorted(owner)], fontsize=7)
    ax.set_xticks(ticks, [f"K,V {owner[c]}" for c in sorted(owner)], fontsize=7, rotation=90)
    for edge in range(chunk, demo.seq, chunk):
        ax.axhline(edge - 0.5, color="white", lw=1)
        ax.axvline(edge - 0.5, color="white", lw=1)
    ax.set(title=f"{demo.layout}: pairs computed by step {step}", xlabel="key position",
           ylabel="query position")


def _ring_panel(ax, demo: RingDemo, step: int):
    w = demo.world_size
    angles = [math.pi / 2 - 2 * math.pi * r / w for r in range(w)]
    centres = [(math.cos(a), math.sin(a)) for a in angles]
    for r, (x, y) in enumerate(centres):
        busy = demo.blocks[step][r] is not None
        ax.add_patch(Circle((x, y), 0.33, facecolor=viz.CURRENT if busy else viz.SKIPPED,
                            edgecolor="black", hatch=None if busy else "//"))
        ax.text(x, y, f"rank {r}\nK,V {demo.origins[step][r]}" + ("" if busy else "\nidle"),
                ha="center", va="center", fontsize=8,
                bbox=None if busy else dict(facecolor="white", edgecolor="none", pad=1))
    if step + 1 < w:  # the next shards are already on their way during this step
        for r in range(w):
            (x0, y0), (x1, y1) = centres[r], centres[(r + 1) % w]
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), shrinkA=24, shrinkB=24,
                                         arrowstyle="-|>", mutation_scale=10,
                                         connectionstyle="arc3,rad=-0.25", color=viz.DONE))
    ax.set(xlim=(-1.5, 1.5), ylim=(-1.5, 1.5), aspect="equal",
           title="in flight: the next K,V" if step + 1 < w else "last step: nothing in flight")
    ax.axis("off")


def _distance_panel(ax, demo: RingDemo, step: int):
    w = demo.world_size
    values = [max(d, 1e-16) for d in demo.distances[step]]
    ax.bar(range(w), values, color=viz.PARTIAL_COLOR)
    ax.set_yscale("log")
    ax.set_ylim(1e-17, 10)
    for r, d in enumerate(demo.distances[step]):
        ax.text(r, max(d, 1e-16) * 2, fmt_distance(d), ha="center", fontsize=7)
    ax.set_xticks(range(w), [f"rank {r}" for r in range(w)], fontsize=7)
    ax.set(title="max |partial - final| per rank", ylabel="distance (log)")


def ring_step_figure(demo: RingDemo, step: int) -> Figure:
    """Step ``step`` of a traced ring: the attention matrix, the ring, the distances."""
    if not isinstance(step, numbers.Integral) or not 0 <= step < demo.world_size:
        raise ValueError(f"ring_step_figure: argument 'step' must be an int in 0..{demo.world_size - 1}, "
                         f"got {step!r}")
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[1.1, 1, 1])
    _matrix_panel(axes[0], demo, step)
    _ring_panel(axes[1], demo, step)
    _distance_panel(axes[2], demo, step)
    legend = [("computed at this step", viz.CURRENT), ("computed before", viz.DONE),
              ("still to come", viz.TODO), ("hidden by the causal mask", viz.MASKED)]
    fig.legend(handles=[Patch(facecolor=c, edgecolor="black", label=t) for t, c in legend],
               loc="outside lower center", ncols=4, fontsize=8)
    return fig


def idle_figure(world_size: int = 4) -> Figure:
    """Causal work per (rank, step) in the two layouts; idle pairs hatched."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    names = {1.0: "full", 0.5: "half"}
    for ax, layout in zip(axes, ring.LAYOUTS):
        work = step_work(world_size, layout=layout)
        for (r, t), share in np.ndenumerate(work):
            diagonal = t == 0
            ax.add_patch(Rectangle((t - 0.5, r - 0.5), 1, 1, edgecolor="black",
                                       facecolor=viz.DONE if share else viz.SKIPPED,
                                       hatch=None if share else "//"))
            label = "idle" if not share else ("diag" if diagonal else names.get(share, f"{share:g}"))
            ax.text(t, r, label, ha="center", va="center", fontsize=8,
                    color="white" if share else "black",
                    bbox=None if share else dict(facecolor="white", edgecolor="none", pad=1))
        idle = int((work == 0).sum())
        ax.set(xlim=(-0.5, world_size - 0.5), ylim=(world_size - 0.5, -0.5), aspect="equal",
               xlabel="step", ylabel="rank",
               title=f"{layout}: {idle} idle of {world_size ** 2}; "
                     f"{critical_path(world_size, layout=layout):g} blocks long")
        ax.set_xticks(range(world_size))
        ax.set_yticks(range(world_size))
    fig.legend(handles=[Patch(facecolor=viz.DONE, label="computes"),
                        Patch(facecolor=viz.SKIPPED, edgecolor="black", hatch="//", label="idle")],
               loc="outside lower center", ncols=2, fontsize=8)
    return fig


# ----- the stepper --------------------------------------------------------------------

class RingStepper(FigureBox):
    """Step through a traced ring: a ``step`` slider and a ``layout`` toggle over
    :func:`run_ring_demo`'s result; the figure is :func:`ring_step_figure`."""

    def __init__(self, demos: dict, *, layout: str = "contiguous", step: int = 0):
        self.demos = demos
        world_size = demos[layout].world_size
        self.step = widgets.IntSlider(value=step, min=0, max=world_size - 1, description="step")
        self.layout_toggle = widgets.ToggleButtons(options=list(demos), value=layout, description="layout")
        self.image = widgets.Image(format="png")
        self.image.add_class("flashlib-figure")
        super().__init__([widgets.HBox([self.step, self.layout_toggle]), self.image])
        self.add_class("flashlib-ring-stepper")
        for control in (self.step, self.layout_toggle):
            control.observe(lambda _change: self.redraw(), names="value")
        self.redraw()

    def figure(self) -> Figure:
        """The current step as a regular matplotlib figure (shows without a kernel)."""
        return ring_step_figure(self.demos[self.layout_toggle.value], self.step.value)

    def _state(self):
        return self.layout_toggle.value, self.step.value

    def _draw(self, state):
        layout, step = state
        return viz.figure_png(ring_step_figure(self.demos[layout], step))

    def _neighbours(self, state):
        layout, step = state
        steps = [(layout, s) for s in (step + 1, step - 1) if 0 <= s <= self.step.max]
        return steps + [(other, step) for other in self.demos if other != layout]

    def __repr__(self):
        # Stored notebooks compare this text: no widget ids, no image bytes.
        return (f"RingStepper(world_size={self.step.max + 1}, layout={self.layout_toggle.value!r}, "
                f"step={self.step.value} of 0..{self.step.max})")


# ----- exercises ----------------------------------------------------------------------

class Verdict:
    """A checker's result: true when passed; shows as one PASS / NOT YET line."""

    def __init__(self, passed: bool, message: str, hint: str | None = None, label: str = "hint"):
        hint = None if hint is None else edition.one_hint(hint)  # the edition's teacher may give none
        self.passed, self.message, self.hint, self.label = passed, message, hint, label
        verdicts.report(passed, f"{'PASS' if passed else 'NOT YET'}: {message}")

    def __bool__(self):
        return self.passed

    def __repr__(self):
        head = f"{'PASS' if self.passed else 'NOT YET'}: {self.message}"
        return head if self.hint is None else f"{head}\n  {self.label}: {self.hint}"


def check_idle_steps(answer) -> Verdict:
    """Exercise 1: idle (rank, step) pairs of causal ring attention, 6 ranks, contiguous. The checker keeps
    digests of the answer and of the usual mistakes, not the numbers."""
    hint = ("at step t rank r holds the shard of rank (r - t) mod 6; it is idle when every one of "
            "those keys comes after every one of its queries")
    if answer is None or answer is Ellipsis:
        return Verdict(False, "no answer yet; expected a whole number of (rank, step) pairs.")
    whole = isinstance(answer, numbers.Real) and not isinstance(answer, bool) and float(answer).is_integer()
    if not whole:  # 15.0 is a whole number, as the other checkers take it
        return Verdict(False, f"expected a whole number, got {type(answer).__name__} {answer!r}.", hint)
    answer = int(answer)
    if matches(answer, Digest("idle_steps:fe0f63475eb409ca")):
        return Verdict(True, f"{answer} idle pairs: rank r works r + 1 of the 6 steps.")
    mistakes = {Digest("idle_steps:59cbeb32fd344602"): "that counts the diagonal blocks as idle too; at step 0 "
                                                      "each rank holds its own shard and sees half of it",
                Digest("idle_steps:78cee0b9c58f6f9f"): "that counts every block off the diagonal; keys from an "
                                                      "earlier rank are all visible and must be computed"}
    advice = next((text for wrong, text in mistakes.items() if matches(answer, wrong)), None)
    return Verdict(False, f"{answer} is not it" + (f": {advice}." if advice else "."), hint)


def _pairs(rows: slice, cols: slice, local_seq: int) -> set:
    return {(i, j) for i in range(local_seq)[rows] for j in range(local_seq)[cols]}


def check_zigzag_block(zigzag_block) -> Verdict:
    """Exercise 2: ``zigzag_block(rank, origin, local_seq) -> (q_rows, k_rows)`` for origin != rank.

    Compared, for 2 to 5 ranks and several shard lengths, with the (query, key) pairs that
    the causal mask shows between the two zigzag shards, worked out from their positions.
    """
    if zigzag_block is None or zigzag_block is Ellipsis:
        return Verdict(False, "no answer yet; expected a function zigzag_block(rank, origin, local_seq) "
                              "returning two slices (query rows, key rows).")
    hint = ("rank r holds chunks r and 2W-1-r. For origin < rank, which of origin's two chunks comes "
            "before both of r's? For origin > rank, which of r's chunks comes after both of origin's?")
    if not callable(zigzag_block):
        return Verdict(False, f"expected a function, got {type(zigzag_block).__name__}.", hint)
    for w in range(2, 6):
        for half in (1, 3):
            for r in range(w):
                for s in (s for s in range(w) if s != r):
                    verdict = _check_one_block(zigzag_block, w, r, s, half, hint)
                    if verdict is not None:
                        return verdict
    return Verdict(True, "your blocks hold exactly the visible pairs, half a block per step.")


def _check_one_block(zigzag_block, w, r, s, half, hint):
    local = 2 * half
    pos = lambda rank: [c * half + i for c in (rank, 2 * w - 1 - rank) for i in range(half)]  # noqa: E731
    visible = {(i, j) for i, qi in enumerate(pos(r)) for j, kj in enumerate(pos(s)) if kj <= qi}
    try:
        rows, cols = zigzag_block(r, s, local)
        computed = _pairs(rows, cols, local)
    except Exception as error:  # a learner's bug becomes feedback, not a traceback
        return Verdict(False, f"zigzag_block({r}, {s}, {local}) raised {type(error).__name__}: {error}.", hint)
    if computed == visible:
        return None
    where = f"with {w} ranks, rank {r} and origin {s} (local_seq {local})"
    opposite = (slice(half, local), slice(None)) if s < r else (slice(None), slice(0, half))
    if computed == _pairs(*opposite, local):
        return Verdict(False, f"{where}: that is the block of the opposite case (origin "
                              f"{'>' if s < r else '<'} rank); the two rules are swapped.", hint)
    if computed >= visible:
        return Verdict(False, f"{where}: your block holds all {len(visible)} visible pairs but also "
                              f"{len(computed - visible)} that the mask hides; it can be half as big.", hint)
    return Verdict(False, f"{where}: {len(visible - computed)} of the {len(visible)} visible pairs "
                          "are missing.", hint)
