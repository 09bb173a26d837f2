"""Notebook 14, serving: the figures of what a decoding step reads, and the cascade-merge exercise.

``bytes_figure`` draws notebook 10's byte model for a group of requests sharing a prefix, plain and
cascaded (:func:`flashlib.decode.cascade_bytes`); ``mixed_batch_figure`` draws the rows one launch
of a mixed batch computes; ``check_cascade_merge`` checks a learner's merge of a prefix's and a
suffix's (out, lse) against notebook 02's :func:`flashlib.merge_partials`, naming six mistakes.
"""
from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from ..decode import cascade_bytes
from ..softmax import merge_partials
from .exercises import HintSteps, _call, _failed, _passed, _unanswered, print_solution


def bytes_figure(*, groups=(1, 2, 4, 8, 16, 32, 64), prefix: int = 16384, suffix: int = 512, kv_heads: int = 8,
                 q_heads: int = 32, head_dim: int = 128) -> Figure:
    """GiB of keys and values one decoding step reads for a group of requests sharing ``prefix``
    positions, each with ``suffix`` of its own, plain and cascaded (bf16, one new token each)."""
    rows = q_heads // kv_heads
    counts = [cascade_bytes(batch=b, kv_heads=kv_heads, rows_per_kv_head=rows, prefix=prefix, suffix=suffix,
                            head_dim=head_dim) for b in groups]
    fig = Figure(figsize=(7.2, 3.4))
    ax = fig.subplots()
    for key, label, style in (("plain", "plain: every request reads the prefix", "o-"),
                              ("cascade", "cascade: the prefix once per 64 stacked rows", "s-")):
        ax.plot(groups, [c[key] / 2**30 for c in counts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(groups, [str(g) for g in groups])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("requests sharing the prefix")
    ax.set_ylabel("GiB read per step and layer")
    ax.set_title(f"prefix {prefix:,} + suffix {suffix} positions, {kv_heads} kv heads of {head_dim}, bf16")
    for g, c in zip(groups, counts):
        if g >= 4:
            ax.annotate(f"{c['ratio']:.1f}x", (g, c["cascade"] / 2**30), textcoords="offset points", xytext=(0, 7),
                        ha="center", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def mixed_batch_figure(counts, lengths) -> Figure:
    """The rows of one launch for sequences with ``counts`` new tokens over caches of ``lengths``
    valid positions (after the append): each sequence's rows padded to the longest, the padding
    computing nothing; row i of sequence b sits at position lengths[b] - counts[b] + i."""
    longest = max(max(counts), 1)
    fig = Figure(figsize=(7.2, 0.5 + 0.45 * len(counts)))
    ax = fig.subplots()
    for b, (n, length) in enumerate(zip(counts, lengths)):
        for i in range(longest):
            real = i < n
            ax.add_patch(_cell(i, b, "tab:blue" if real else "white"))
            if real:
                ax.text(i + 0.5, b + 0.5, str(length - n + i), ha="center", va="center", color="white", fontsize=8)
        ax.text(longest + 0.3, b + 0.5, f"{n} new, cache {length}", va="center", fontsize=8)
    ax.set_xlim(0, longest + 4)
    ax.set_ylim(len(counts), 0)
    ax.set_yticks([b + 0.5 for b in range(len(counts))], [f"seq {b}" for b in range(len(counts))])
    ax.set_xticks([])
    ax.set_title("one launch: each sequence's new tokens, and the position each sits at (white: padding)",
                 fontsize=9)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def _cell(x, y, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, facecolor=color, edgecolor="tab:blue")


# ----- the exercise: the cascade's merge ----------------------------------------------------------

MERGE_HINTS = HintSteps(
    "each part is attention over its own keys: out_p is normalised by the prefix's denominator e^lse_p, out_s by "
    "the suffix's e^lse_s; the whole denominator is their sum, and each part keeps its share of it",
    "lse = torch.logaddexp(lse_p, lse_s); each part's weight is exp(its lse - lse), a (..., rows) tensor to "
    "broadcast over the head dim with [..., None]; a row empty in both parts (both -inf) must give zeros, not NaN",
    answer="cascade_merge")
SOLUTIONS = {"cascade_merge": MERGE_HINTS}


def solution(name: str) -> None:
    """Print an answer to exercise ``name`` at once (the checker gives it only after repeated tries)."""
    print_solution(SOLUTIONS, name)


# float64, the case's dtype, overflows past e^709.78: the case's lse reach past it, so a merge that
# forms e^lse itself fails here, as it would in float32 past e^88.7
LSE_RANGE = (700.0, 800.0)


def merge_case(seed: int = 0):
    """(out_p, lse_p, out_s, lse_s) of a prefix and a suffix, (2, 3, 4, 8) and (2, 3, 4) float64: lse from
    700 to 800 (e^lse overflows float64 from 709.8 on), one row that sees no suffix key and one that sees
    no key at all."""
    g = torch.Generator().manual_seed(seed)
    out_p, out_s = (torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    low, high = LSE_RANGE
    lse_p, lse_s = (low + (high - low) * torch.rand(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lse_s[0, 0, 1], out_s[0, 0, 1] = float("-inf"), 0.0  # a row that sees none of its suffix
    lse_p[1, 2, 3] = lse_s[1, 2, 3] = float("-inf")  # a row that sees no key at all: zeros, lse -inf
    out_p[1, 2, 3], out_s[1, 2, 3] = 0.0, 0.0
    return out_p, lse_p, out_s, lse_s


def check_cascade_merge(merge) -> bool:
    """``merge(out_p, lse_p, out_s, lse_s) -> (out, lse)``: a prefix's and a suffix's attention merged, against
    :func:`flashlib.merge_partials`; named mistakes: averaged outputs, e^lse formed (it overflows float64
    here), the max instead of log-add-exp, the weights swapped, NaN on an empty row, the lse left out."""
    unanswered = _unanswered(merge, "a function merge(out_p, lse_p, out_s, lse_s) -> (out, lse)")
    if unanswered is not None:
        return unanswered
    case = merge_case()
    got, error = _call(merge, "merge", *(t.clone() for t in case))
    if error:
        return _failed(error, MERGE_HINTS)
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return _failed("merge should return two tensors, (out, lse): the lse is what a third part would merge with "
                       f"next; got {type(got).__name__}", MERGE_HINTS)
    out, lse = (t.double() for t in got)
    out_p, lse_p, out_s, lse_s = case
    want_out, want_lse = merge_partials(*case)
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return _failed(f"merge returned shapes {tuple(out.shape)} and {tuple(lse.shape)}; expected "
                       f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}", MERGE_HINTS)
    finite = ~torch.isneginf(want_lse)
    if not (torch.isfinite(out[finite]).all() and torch.isfinite(lse[finite]).all()):
        return _failed(f"e^lse overflowed: the lse here reach {LSE_RANGE[1]:.0f} and float64 overflows past "
                       "e^709.8, so never form e^lse itself: the merged lse is torch.logaddexp(lse_p, lse_s), and "
                       "each part's weight is exp(its lse - lse), at most 1", MERGE_HINTS)
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return _failed("a row that sees no key in either part (both lse -inf) came out NaN: e^(-inf - (-inf)) is "
                       "undefined, so shift by 0 where the merged lse is -inf, and the row stays zeros", MERGE_HINTS)
    ok_lse = torch.allclose(lse, want_lse, rtol=0, atol=1e-12, equal_nan=False) and torch.equal(
        torch.isneginf(lse), torch.isneginf(want_lse))
    if ok_lse and torch.allclose(out, want_out, rtol=0, atol=1e-12):
        MERGE_HINTS.reset()
        return _passed("the merged output and lse equal notebook 02's merge, the empty rows included.")
    if not ok_lse and torch.allclose(lse[finite], torch.maximum(lse_p, lse_s)[finite]):
        return _failed("the merged lse is the larger of the two: the denominators add, so lse = log(e^lse_p + "
                       "e^lse_s), torch.logaddexp", MERGE_HINTS)
    if not ok_lse:
        return _failed("the merged lse is not log(e^lse_p + e^lse_s) on every row", MERGE_HINTS)
    rows = finite & ~torch.isneginf(lse_s)
    mistakes = [((out_p + out_s) / 2, "the outputs were averaged: each part's weight is its share of the denominator, "
                                      "exp(its lse - lse), not one half"),
                (torch.exp(lse_s - want_lse)[..., None] * out_p + torch.exp(lse_p - want_lse)[..., None] * out_s,
                 "the weights are swapped: out_p goes with exp(lse_p - lse)")]
    for wrong, message in mistakes:
        if torch.allclose(out[rows], wrong[rows], rtol=1e-9, atol=1e-9, equal_nan=True):
            return _failed(message, MERGE_HINTS)
    return _failed("the merged output differs from exp(lse_p - lse) * out_p + exp(lse_s - lse) * out_s", MERGE_HINTS)
