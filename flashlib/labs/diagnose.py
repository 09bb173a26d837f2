"""What a checker says when a result is wrong and no known mistake explains it.

Each function returns a sentence, or None when it has nothing to say: which outputs are right and
which are not, a constant factor or offset it recognises (ln 2, log2 e, the scale), which rows (or
keys) are wrong and what they have in common, and, read from a probe whose values are the identity
(so that each output row is that query's row of P), the first (query, key) pair whose weight
differs and what it should be.
"""
from __future__ import annotations

import math

import torch

from ..kernels.config import LOG2E

LN2 = math.log(2.0)


def _constants(scale: float):
    return (("ln 2", LN2), ("log2 e = 1/ln 2", LOG2E), ("the scale 1/sqrt(d)", scale),
            ("sqrt(d) = 1/scale", 1 / scale), ("qk_scale = scale · log2 e", scale * LOG2E),
            ("1/qk_scale", 1 / (scale * LOG2E)), ("scale²", scale ** 2), ("2", 2.0), ("1/2", 0.5), ("-1", -1.0))


def _label(value: float, scale: float) -> str | None:
    return next((name for name, c in _constants(scale) if abs(value / c - 1) < 2e-3), None)


def spans(positions) -> str:
    """'3, 8–15, 24–31' of a sorted list of integers."""
    runs, start = [], None
    for a, b in zip([None, *positions], [*positions, None]):
        if start is None:
            start = b
        elif b is None or b != a + 1:
            runs.append(f"{start}" if a == start else f"{start}–{a}")
            start = b
    return ", ".join(runs)


def right_and_wrong(bad: dict) -> str | None:
    """'out is right; lse is wrong' from {name: bool tensor of wrong entries} when some are right."""
    right = [n for n, b in bad.items() if not b.any()]
    wrong = [n for n, b in bad.items() if b.any()]
    if not right or not wrong:
        return None
    return f"{' and '.join(right)} {'is' if len(right) == 1 else 'are'} right; " \
           f"{' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} wrong"


def factor(name: str, got, want, rows, scale: float) -> str | None:
    """'lse is 0.6931 times what it should be everywhere: a factor of ln 2', when the ratio is one constant
    over the wrong ``rows`` (bool, got's shape without its last dim for (..., d) tensors)."""
    g, w = got[rows], want[rows]
    where = "everywhere" if rows.all() else "in every wrong row"
    if (g == 0).all():
        return f"{name} is 0 {where}"
    ok = torch.isfinite(g) & torch.isfinite(w) & (w.abs() > 1e-6 * (1 + w.abs().nan_to_num(posinf=0).max()))
    if ok.sum() < 2:
        return None
    ratio = g[ok] / w[ok]
    c = ratio.median().item()
    if abs(c - 1) > 1e-3 and ((ratio - c).abs() <= 2e-3 * abs(c)).all():
        label = _label(c, scale)
        return f"{name} is {c:.4g} times what it should be {where}" + (f": a factor of {label}" if label else "")
    if g.dim() == 2 and ok.all():  # (rows, d): one factor per row
        per_row = g / w
        row_c = per_row.median(dim=-1).values
        if ((per_row - row_c[:, None]).abs() <= 2e-3 * row_c.abs()[:, None]).all():
            return (f"each wrong row of {name} is its right value times a factor of its own (from {row_c.min():.3g} "
                    f"to {row_c.max():.3g}): the rows are right up to their normalisation")
    return None


def offset(name: str, got, want, rows, scale: float) -> str | None:
    """'lse is off by -0.6931 everywhere', when the difference is one constant over the wrong ``rows``."""
    g, w = got[rows], want[rows]
    ok = torch.isfinite(g) & torch.isfinite(w)
    if ok.sum() < 2 or g.dim() != 1:
        return None
    diff = g[ok] - w[ok]
    c = diff.median().item()
    if abs(c) > 1e-4 and ((diff - c).abs() <= 1e-4 * (1 + abs(c))).all():
        label = _label(c, scale)
        where = "everywhere" if rows.all() else "in every wrong row"
        return f"{name} is off by {c:+.4g} {where}" + (f" ({label})" if label else "")
    return None


def which(bad, groups, noun: str = "rows") -> str | None:
    """Where the wrong positions of ``bad`` (batch, heads, n) lie along n: exactly one of the named
    ``groups`` [(label, (n,) bool)], only inside one, or as spans."""
    pos = bad.reshape(-1, bad.shape[-1]).any(dim=0)
    if pos.all():
        return None  # the count says so already
    for label, group in groups:
        if group.any() and torch.equal(pos, group):
            return f"The wrong {noun} are exactly {label}"
    for label, group in groups:
        if group.any() and not (pos & ~group).any():
            return f"The wrong {noun} are all among {label}"
    return f"The wrong {noun} are {spans(pos.nonzero().flatten().tolist())} (of 0–{pos.numel() - 1})"


def _visible_keys(mask_row) -> str:
    keys = mask_row.nonzero().flatten().tolist()
    return f"sees keys {spans(keys)}" if keys else "sees no key"


_PROBE = "With v = the identity, each output row is that query's row of P: "


def pairs(p_got, p_want, mask, block_k: int, *, prefix: str = _PROBE, noun: str = "weight") -> str | None:
    """The first (query, key) pair whose weight (or, with ``noun="dS"``, whose dS) differs, from
    (batch, heads, seq_q, seq_k) tensors read back from a probe, with what the others that differ have in
    common."""
    p_got, p_want = p_got.reshape(-1, *p_got.shape[-2:]), p_want.reshape(-1, *p_want.shape[-2:])
    differ = ~((p_got - p_want).abs() <= 1e-4)  # NaN differs
    if not differ.any():
        return None
    seen = (p_got.abs() > 1e-6) | p_got.isnan()
    wrong_seen = (seen != mask) & differ
    cells = (wrong_seen if wrong_seen.any() else differ).any(dim=0)  # (seq_q, seq_k)
    i, j = (int(x) for x in cells.nonzero()[0])
    z = int(differ[:, i, j].nonzero()[0])
    got, want = p_got[z, i, j].item(), p_want[z, i, j].item()
    what = (f"query {i} gives key {j} weight {got:.3g}" if noun == "weight"
            else f"the {noun} of query {i} and key {j} is {got:.3g}")
    if not mask[i, j]:
        text = f"{what}, but it must not see key {j} (query {i} {_visible_keys(mask[i])})"
    elif not seen[z, i, j]:
        text = (f"query {i} gives key {j} no weight" if noun == "weight" else f"the {noun} of query {i} and key {j} "
                "is 0") + f", but it sees key {j} ({noun} {want:.3g}; query {i} {_visible_keys(mask[i])})"
    else:
        text = f"{what} where it should be {want:.3g}" if noun != "weight" else \
            f"query {i} gives key {j} weight {got:.3g} where it should give {want:.3g}"
    return prefix + text + _pattern(cells, mask, block_k)


def _pattern(cells, mask, block_k: int) -> str:
    """What the (query, key) pairs that differ have in common, when it is simple."""
    seq_q, seq_k = mask.shape
    i, j = cells.nonzero().unbind(dim=-1)
    diagonal = seq_k - seq_q
    offsets = torch.unique(j - i).tolist()
    tiles = torch.unique(j // block_k).tolist()
    if offsets == [diagonal]:
        return f"; every pair that differs lies on the diagonal, key j = i + {diagonal} for query i."
    if len(offsets) == 1:
        return f"; every pair that differs has key j = i + {offsets[0]}, {offsets[0] - diagonal:+d} from the " \
               f"diagonal j = i + {diagonal}."
    if tiles == [(seq_k - 1) // block_k]:
        return f"; every pair that differs is in the last key tile (keys {tiles[0] * block_k}–{seq_k - 1})."
    if len(tiles) == 1:
        return f"; every pair that differs is in key tile {tiles[0]} (keys {tiles[0] * block_k}–" \
               f"{min(seq_k, (tiles[0] + 1) * block_k) - 1})."
    return f"; {int(cells.sum())} (query, key) pairs differ, in key tiles {spans(tiles)}."


def weight_sums(p_got, mask) -> str | None:
    """'the weights of query 3 add up to 0.84, not 1', where a row's weights over the real keys do not sum to 1."""
    sums = p_got.reshape(-1, *p_got.shape[-2:]).sum(dim=-1)  # (z, seq_q)
    sees = mask.any(dim=-1)
    off = ~((sums - 1).abs() <= 1e-4) & sees
    if not off.any():
        return None
    z, i = (int(x) for x in off.nonzero()[0])
    return f"the weights of query {i} over the keys that exist add up to {sums[z, i]:.4g}, not 1"
