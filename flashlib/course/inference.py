"""Notebook 10's support: figures, the split-KV slider and the exercise checkers.

    step_seconds(...)                  the time a decoding step's bytes predict: bytes / bandwidth
    prediction_figure(gbps, label)     that time against the cache length, for a measured bandwidth
    measured_figure(decode, gbps)      a recorded decoding benchmark beside that prediction
    occupancy_figure(...)              busy multiprocessors as the number of splits grows
    split_kv_figure(q, k, v, seqlen, num_splits)   the splits, their partial outputs and weights, the merge
    SplitKVStepper                     the same figure under a ``num_splits`` slider
    paged_cache_figure(table, ...)     sequences' pages scattered in memory, found through a block table
    check_step_time, check_cache_gib, check_gather   the exercises

The notebook's lab, split_kv, is checked by ``labs.check("split_kv", fn)`` (:mod:`flashlib.labs.split_kv_lab`).

Colours as everywhere in the course (:mod:`flashlib.course.viz`): teal partial outputs, black
the final output, blue what is held, orange what is being read now, white hatched free.
Recorded runs are read by the notebook (:mod:`flashlib.bench.records`) and passed in as data.
"""
from __future__ import annotations

import math
import numbers

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .. import decode
from . import viz
from .exercises import Digest, matches
from .ring import Verdict
from .widgets import FigureBox

H200_SMS = 132  # streaming multiprocessors of an H200 (NVIDIA's specification)


# ----- bytes and time -----------------------------------------------------------------------

def step_seconds(*, batch: int, kv_heads: int, length: int, head_dim: int, gbps: float,
                 element_size: int = 2) -> float:
    """The time one decoding step's attention in one layer takes if its bytes set it: every cached key
    and value read once, 2 · batch · kv_heads · length · head_dim · element_size bytes, at
    ``gbps`` gigabytes per second (the FLOPs, 4 · batch · q_heads · length · head_dim, take far
    less at any GPU's matmul rate). An estimate, not a floor: at a copy kernel's rate (it reads and
    writes) a kernel that only reads can beat it."""
    nbytes = decode.kv_cache_bytes(layers=1, batch=batch, kv_heads=kv_heads, tokens=length, head_dim=head_dim,
                                   element_size=element_size)
    return nbytes / (gbps * 1e9)


def prediction_figure(gbps: float, label: str, *, lengths=(4096, 8192, 16384, 32768, 65536, 131072),
                      batches=(1, 8), kv_heads: int = 8, head_dim: int = 128) -> Figure:
    """The time one decoding step's bytes predict (one layer, bf16) against the cache length."""
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    for batch, colour in zip(batches, (viz.DONE, viz.CURRENT)):
        times = [1e6 * step_seconds(batch=batch, kv_heads=kv_heads, length=n, head_dim=head_dim, gbps=gbps)
                 for n in lengths]
        ax.plot(lengths, times, marker="o", color=colour, label=f"batch {batch}: bytes / copy bandwidth")
    ax.set(xscale="log", yscale="log", xlabel="cached positions L", ylabel="microseconds per step and layer",
           title=f"estimated: {kv_heads} kv heads of {head_dim}, bf16, at {gbps:.0f} GB/s\n"
                 f"(copy bandwidth measured on {label})")
    ax.set_xticks(list(lengths), [f"{n // 1024}k" for n in lengths])
    ax.legend(fontsize=8)
    return fig


def _series(rows, method, layout=None):
    """[(length, microseconds)] of one method (the fastest SDPA backend per length for "sdpa")."""
    best = {}
    for p in rows:
        if (p["method"] == method or method == "sdpa" and p["method"].startswith("sdpa:")) and \
                layout in (None, p["layout"]):
            best[p["length"]] = min(best.get(p["length"], math.inf), p["ms"] * 1e3)
    return sorted(best.items())


def measured_figure(result: dict, gbps: float) -> Figure:
    """A recorded decoding benchmark (the ``decode`` part of a GPU run): flashlib's time, contiguous
    and paged, and the fastest SDPA backend's against the cache length, per batch size, beside the
    estimate from the bytes at the copy bandwidth (a kernel that only reads can beat it)."""
    points = [p for p in result.get("points", []) if p.get("ms")]
    batches = sorted({p["batch"] for p in points})
    fig = Figure(figsize=(5.0 * max(1, len(batches)), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, max(1, len(batches))))
    for ax, batch in zip(axes, batches):
        rows = [p for p in points if p["batch"] == batch]
        for method, layout, style in (("flashlib", "contiguous", dict(color=viz.CURRENT, marker="o")),
                                      ("flashlib", "paged", dict(color=viz.CURRENT, marker="o", linestyle="--")),
                                      ("sdpa", None, dict(color=viz.DONE, marker="."))):
            series = _series(rows, method, layout)
            if series:
                ax.plot(*zip(*series), label=f"{method} ({layout})" if layout else "fastest SDPA backend", **style)
        lengths, p0 = sorted({p["length"] for p in rows}), rows[0]
        predicted = [1e6 * step_seconds(batch=batch, kv_heads=p0["kv_heads"], length=n, head_dim=p0["head_dim"],
                                        gbps=gbps) for n in lengths]
        ax.plot(lengths, predicted, color="black", label="estimate: bytes / copy bandwidth")
        ax.set(xscale="log", yscale="log", xlabel="cached positions L", ylabel="microseconds", title=f"batch {batch}")
        ax.legend(fontsize=6)
    return fig


def occupancy_figure(*, kv_heads: int = 8, batches=(1, 8), sm_count: int = H200_SMS, max_splits: int = 64) -> Figure:
    """Programs launched per multiprocessor as the number of splits grows (one query block per
    kv head): below 1, multiprocessors sit idle; the split rule aims at 2."""
    from ..kernels.decode import choose_num_splits  # the rule itself (Linux: Triton)

    splits = [1, 2, 4, 8, 16, 32, 64]
    fig = Figure(figsize=(6.4, 3.4), layout="constrained")
    ax = fig.subplots()
    for batch, colour in zip(batches, (viz.DONE, viz.CURRENT)):
        programs = batch * kv_heads
        ax.plot(splits, [programs * s / sm_count for s in splits], marker="o", color=colour,
                label=f"batch {batch}: {programs} programs per split")
        chosen = choose_num_splits(programs, 65536, sm_count)
        ax.plot([chosen], [programs * chosen / sm_count], marker="*", markersize=14, color=colour)
    ax.axhline(1, color=viz.MASKED, linestyle="--", label="one program per multiprocessor")
    ax.set(xscale="log", yscale="log", xlabel="num_splits", ylabel="programs per multiprocessor",
           title=f"{sm_count} multiprocessors; the split rule's choice at 64k keys: *")
    ax.set_xticks(splits, [str(s) for s in splits])
    ax.legend(fontsize=7)
    return fig


# ----- split-KV, in one picture -------------------------------------------------------------------

def split_kv_parts(q, k, v, seqlen: int, num_splits: int):
    """(parts, merged, full) for one sequence, one head, one new token: ``decode_partials``' splits
    (start, stop, out, lse), their merge with ``merge_partials``, and softmax attention over all
    the keys at once. q (d,), k and v (L, d), float64."""
    q4, k4, v4 = q.reshape(1, 1, 1, -1), k[None, None], v[None, None]  # (batch, heads, seq, dim)
    lengths = torch.tensor([seqlen], dtype=torch.int32)
    (parts,) = decode.decode_partials(q4, k4, v4, lengths, num_splits=num_splits)
    merged = decode.decode_reference(q4, k4, v4, lengths, num_splits=num_splits)[0, 0, 0]
    p = torch.softmax((k[:seqlen] @ q) / math.sqrt(q.shape[-1]), dim=0)  # (seqlen,)
    return [(a, b, o[0, 0], lse[0, 0]) for a, b, o, lse in parts], merged, p @ v[:seqlen]


def split_kv_figure(q, k, v, seqlen: int, num_splits: int) -> Figure:
    """Left: the cache cut into splits, each position's softmax weight, each split's share of the
    sum e^(lse_s - lse). Middle: each split's partial output (teal) and their merge (black) over the
    head dim, the full attention output (x) on it. Right: the shares as bars."""
    parts, merged, full = split_kv_parts(q, k, v, seqlen, num_splits)
    lse = torch.logsumexp(torch.stack([part[3] for part in parts]), 0)
    shares = [float(torch.exp(part_lse - lse)) for *_, part_lse in parts]
    weights = torch.softmax((k[:seqlen] @ q) / math.sqrt(q.shape[-1]), dim=0).numpy()
    fig = Figure(figsize=(11, 3.6))
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.16, top=0.84, wspace=0.25)
    ax_cache, ax_out, ax_share = fig.subplots(1, 3, width_ratios=[1.5, 1.2, 0.8])
    for s, (start, stop, _, _) in enumerate(parts):
        colour = viz.DONE if s % 2 == 0 else viz.PARTIAL_COLOR
        ax_cache.bar(range(start, stop), weights[start:stop], color=colour, width=0.9)
        if stop > start:
            ax_cache.axvspan(start - 0.5, stop - 0.5, color=colour, alpha=0.08)
            ax_cache.text((start + stop - 1) / 2, 0.95, f"share {shares[s]:.2f}", ha="center", fontsize=7,
                          transform=ax_cache.get_xaxis_transform())
    ax_cache.set(xlim=(-0.5, k.shape[0] - 0.5), ylim=(0, 1.15 * weights.max()), xlabel="cache position",
                 ylabel="softmax weight", title=f"{num_splits} splits of the {seqlen} cached keys")
    dims = np.arange(q.shape[-1])
    for s, (start, stop, out, _) in enumerate(parts):
        if stop > start:
            ax_out.plot(dims, out.numpy(), color=viz.PARTIAL_COLOR, alpha=0.5, linewidth=1,
                        label="partial outputs" if s == 0 else None)
    ax_out.plot(dims, merged.numpy(), color=viz.FINAL_COLOR, linewidth=2, label="merged")
    ax_out.plot(dims, full.numpy(), "x", color=viz.CURRENT, label="all keys at once")
    distance = float((merged - full).abs().max())
    ax_out.set(xlabel="head dim", title=f"max |merged - all at once| = {viz.fmt4(distance)}")
    ax_out.legend(fontsize=7)
    ax_share.bar(range(len(parts)), shares, color=viz.PARTIAL_COLOR)
    ax_share.set(ylim=(0, 1), xlabel="split", title="share e^(lse_s - lse)")
    ax_share.set_xticks(range(len(parts)))
    return fig


class SplitKVStepper(FigureBox):
    """:func:`split_kv_figure` under a ``num_splits`` slider."""

    def __init__(self, q, k, v, seqlen: int, *, num_splits: int = 3, max_splits: int = 8):
        self.q, self.k, self.v, self.seqlen = q, k, v, seqlen
        self.num_splits = widgets.IntSlider(value=num_splits, min=1, max=max_splits, description="num_splits")
        self.image = widgets.Image(format="png")
        self.image.add_class("flashlib-figure")
        super().__init__([self.num_splits, self.image])
        self.num_splits.observe(lambda _change: self.redraw(), names="value")
        self.redraw()

    def figure(self) -> Figure:
        return split_kv_figure(self.q, self.k, self.v, self.seqlen, self.num_splits.value)

    def _state(self):
        return self.num_splits.value

    def _draw(self, num_splits):
        return viz.figure_png(split_kv_figure(self.q, self.k, self.v, self.seqlen, num_splits))

    def _neighbours(self, num_splits):
        return [n for n in (num_splits + 1, num_splits - 1) if 1 <= n <= self.num_splits.max]

    def __repr__(self):
        # Stored notebooks compare this text: no widget ids, no image bytes.
        return f"SplitKVStepper(seqlen={self.seqlen}, num_splits={self.num_splits.value} of 1..{self.num_splits.max})"


# ----- the paged cache --------------------------------------------------------------------------

def paged_cache_figure(block_table, seqlens, num_pages: int, page_size: int, *, reading: int = 1) -> Figure:
    """Left: each sequence's block table, logical page j -> physical page (blank: not used).
    Right: the pages in memory, labelled with the sequence and logical page they hold; the pages
    of sequence ``reading`` orange, the others blue, free pages white hatched."""
    table = torch.as_tensor(block_table).tolist()
    lengths = [int(n) for n in torch.as_tensor(seqlens).tolist()]
    owner = {}
    for b, (row, n) in enumerate(zip(table, lengths)):
        for j in range(-(-n // page_size)):
            owner[row[j]] = (b, j)
    fig = Figure(figsize=(11, 3.6))
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.18, top=0.88, wspace=0.12)
    ax_table, ax_memory = fig.subplots(1, 2, width_ratios=[1, 1.6])
    for b, (row, n) in enumerate(zip(table, lengths)):
        for j, page in enumerate(row):
            used = j * page_size < n
            colour = (viz.CURRENT if b == reading else viz.DONE) if used else viz.SKIPPED
            ax_table.add_patch(Rectangle((j, b), 1, 1, facecolor=colour, edgecolor="black"))
            if used:
                ax_table.text(j + 0.5, b + 0.5, str(page), ha="center", va="center", color="white", fontsize=9)
        ax_table.text(-0.1, b + 0.5, f"seq {b} ({n} tokens)", ha="right", va="center", fontsize=8)
    width = len(table[0])
    ax_table.set(xlim=(0, width), ylim=(len(table), 0), title=f"block tables: page j of a sequence -> page in memory")
    ax_table.set_xticks([j + 0.5 for j in range(width)], [f"j={j}" for j in range(width)], fontsize=7)
    ax_table.set_yticks([])
    cols = math.ceil(num_pages / 2)
    for page in range(num_pages):
        x, y = page % cols, page // cols
        b, j = owner.get(page, (None, None))
        colour = viz.SKIPPED if b is None else viz.CURRENT if b == reading else viz.DONE
        ax_memory.add_patch(Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="black",
                                      hatch="//" if b is None else None))
        text = f"page {page}\n" + ("free" if b is None else f"seq {b}, j={j}")
        ax_memory.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                       color="black" if b is None else "white",
                       bbox=dict(facecolor="white", edgecolor="none", pad=1) if b is None else None)
    ax_memory.set(xlim=(0, cols), ylim=(2, 0), title=f"memory: {num_pages} pages of {page_size} positions")
    ax_memory.axis("off")
    fig.legend(handles=[Patch(facecolor=viz.CURRENT, label=f"seq {reading}'s pages"),
                        Patch(facecolor=viz.DONE, label="other sequences' pages"),
                        Patch(facecolor=viz.SKIPPED, edgecolor="black", hatch="//", label="free")],
               loc="lower center", ncols=3, fontsize=8)
    return fig


# ----- exercises ----------------------------------------------------------------------------

def _number(answer):
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer):
        return None
    return float(answer)


def _check_number(answer, expected: Digest, *, unit, mistakes, hint, rel=1e-3) -> Verdict:
    """A number against the digest of the answer (what the checker keeps instead of it: reading this file
    gives the answer away no more than a hash does); mistakes: (digest, advice) pairs."""
    if answer is None or answer is Ellipsis:
        return Verdict(False, f"no answer yet; expected a number of {unit}.")
    value = _number(answer)
    if value is None:
        return Verdict(False, f"expected a number of {unit}, got {type(answer).__name__} {answer!r}.", hint)
    if matches(value, expected, rel):
        return Verdict(True, f"{viz.fmt4(value)} {unit}.")
    for wrong, advice in mistakes:
        if matches(value, wrong, rel):
            return Verdict(False, f"{viz.fmt4(value)} is not it: {advice}.", hint)
    return Verdict(False, f"{viz.fmt4(value)} is not it.", hint)


def check_step_time(answer) -> Verdict:
    """Exercise 1: the time bytes / bandwidth predicts, in microseconds, for one decoding step's attention
    in one layer: batch 4, 32 query heads, 8 kv heads of 128, 100,000 cached positions, bf16, 3,000 GB/s."""
    mistakes = [(Digest("step_time:188004f89d8bf38b"), "that reads the keys only; the values are read too"),
                (Digest("step_time:b9d0c90161f5df8f"), "that counts the 32 query heads; the cache holds the 8 kv heads"),
                (Digest("step_time:27c6abac3f91b362"), "that is in milliseconds; the answer is asked in microseconds"),
                (Digest("step_time:839478c730083ec6"), "that counts bits; a bf16 number is 2 bytes")]
    return _check_number(answer, Digest("step_time:2b565a250b5705fa"), unit="microseconds", mistakes=mistakes,
                         hint="bytes = 2 (K and V) x batch x kv heads x positions x head dim x 2 bytes; "
                              "time = bytes / (3,000 x 10^9 bytes per second)")


def check_cache_gib(answer) -> Verdict:
    """Exercise 2: the KV cache, in GiB, of one sequence of 32,768 tokens in a model of 80 layers,
    64 query heads, 8 kv heads of 128, bf16."""
    mistakes = [(Digest("cache_gib:dc9ae242f2f89f83"), "that counts the 64 query heads; with grouped-query "
                                                       "attention only the 8 kv heads are cached"),
                (Digest("cache_gib:c7467043a210ea83"), "that holds the keys only; the values are cached too"),
                (Digest("cache_gib:23e8a9de6b918046"), "that is in GB (a billion bytes); a GiB is 2^30 bytes"),
                (Digest("cache_gib:9a1e040d9cbca430"), "that is one layer; every layer keeps its own cache")]
    return _check_number(answer, Digest("cache_gib:c58ab06606836cd2"), unit="GiB", mistakes=mistakes,
                         hint="2 x layers x kv heads x tokens x head dim x 2 bytes, divided by 2^30")


def check_gather(gather) -> Verdict:
    """Exercise 4: ``gather(pages, table, length)``: one sequence's first ``length`` positions,
    (length, d), from pages (num_pages, page_size, d) and its block table (max_pages,) int32."""
    if gather is None or gather is Ellipsis:
        return Verdict(False, "no answer yet; expected a function gather(pages, table, length) returning a "
                              "(length, d) tensor.")
    hint = "position j lives in page table[j // page_size], at row j % page_size of that page"
    if not callable(gather):
        return Verdict(False, f"expected a function, got {type(gather).__name__}.", hint)
    g = torch.Generator().manual_seed(1)
    for page_size, length in ((4, 10), (3, 3), (5, 17)):
        n = -(-length // page_size)
        pages = torch.randn(2 * n + 3, page_size, 2, generator=g)
        table = torch.randperm(2 * n + 3, generator=g)[:n].to(torch.int32)
        want = pages[table.long()].reshape(-1, 2)[:length]
        where = f"with pages of {page_size} and {length} positions"
        try:
            got = torch.as_tensor(gather(pages, table, length))
        except Exception as error:  # a learner's bug becomes feedback, not a traceback
            return Verdict(False, f"{where}: gather raised {type(error).__name__}: {error}.", hint)
        if got.shape == want.shape and torch.equal(got, want):
            continue
        if got.shape == want.shape and torch.equal(got, pages.reshape(-1, 2)[:length]):
            return Verdict(False, f"{where}: those are the pages in the order memory holds them; a sequence's "
                                  "pages are wherever its block table says.", hint)
        return Verdict(False, f"{where}: expected shape {tuple(want.shape)} with position j from page "
                              f"table[j // {page_size}], got shape {tuple(got.shape)} with other values.", hint)
    return Verdict(True, "you follow the block table as the kernel does, a page at a time.")
