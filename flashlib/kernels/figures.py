"""Figures for the kernel notebooks (05-07): plain ``matplotlib.figure.Figure`` objects.

No pyplot state: a notebook shows the returned figure once, as the cell's value.
"""
from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from .schedule import schedule

PALETTE = {"kernel": "#1f77b4", "reference": "#ff7f0e", "masked": "#d62728", "idle": "#dddddd"}


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
            ax.barh(0, block - live, left=start + live, color=PALETTE["idle"], hatch="//", edgecolor="white")
            ax.text(start + live + (block - live) / 2, 0, "masked", ha="center", va="center", fontsize=8)
    ax.axvline(n, color="black", lw=1)
    ax.set_yticks([])
    ax.set_xlabel("element index")
    ax.set_title(f"n = {n}, BLOCK = {block}: {programs} programs; lanes past n are masked off")
    return fig


def tile_schedule(seq_q: int, seq_k: int, block_m: int, block_n: int, causal: bool):
    """The forward's grid of (query block, key tile): computed or skipped."""
    grid = np.array(schedule(seq_q, seq_k, block_m, block_n, causal), dtype=float)
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(grid, cmap=ListedColormap([PALETTE["idle"], PALETTE["kernel"]]),
              vmin=0, vmax=1, aspect="auto")
    ax.set_xlabel(f"key tile (BLOCK_N = {block_n})")
    ax.set_ylabel(f"query block = program (BLOCK_M = {block_m})")
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
