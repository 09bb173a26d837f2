"""The attention cases the tiled and kernel labs share, and how a wrong result is read.

A case fixes shapes, tile sizes, causal or not, and whether scores are in the hundreds; its
inputs are drawn from a seeded generator. A wrong result is compared with what each known
mistake would produce (a model, computed from the definitions in :mod:`.reference`) and with
the rows each mistake would spoil (rows that see no key, rows whose max moves after their first
tile, rows whose scores are all far below 0, the last query block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import reference
from .common import Problem, rows_summary, wrong_rows

FORWARD_TOL = 1e-4
BACKWARD_TOL = 2e-4


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    block_q: int
    block_k: int
    causal: bool
    large: bool = False  # scores in the hundreds, some rows entirely far below 0
    seed: int = 0

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def describe(self) -> str:
        b, h, d = self.batch, self.heads, self.head_dim
        text = (f"q {(b, h, self.seq_q, d)}, k and v {(b, h, self.seq_k, d)}, block_q={self.block_q}, "
                f"block_k={self.block_k}, causal={self.causal}")
        return text + (", scores in the hundreds" if self.large else "")

    def inputs(self):
        """q (batch, heads, seq_q, d), k, v, dout (batch, heads, seq_k or seq_q, d), float32."""
        g = torch.Generator().manual_seed(self.seed)
        lead = (self.batch, self.heads)
        q, k, v = (torch.randn(*lead, n, self.head_dim, generator=g) for n in (self.seq_q, self.seq_k, self.seq_k))
        dout = torch.randn(*lead, self.seq_q, self.head_dim, generator=g)
        if self.large:
            # scores ≈ ±(150..450): every key shares one direction u, each query points along ±u
            u = torch.nn.functional.normalize(torch.randn(self.head_dim, generator=g), dim=0)
            sign = torch.where(torch.rand(*lead, self.seq_q, 1, generator=g) < 0.5, -1.0, 1.0)
            size = 0.5 + torch.rand(*lead, self.seq_k, 1, generator=g)
            q = sign * u * 300.0 / self.scale + 0.3 * q
            k = size * u + 0.05 * k
        return q, k, v, dout

    def mask(self, causal: bool | None = None, **mistake) -> torch.Tensor:
        causal = self.causal if causal is None else causal
        return reference.visible(self.seq_q, self.seq_k, causal, **mistake)

    def full_keys(self) -> int:
        """Keys covered by whole tiles: what a loop that drops the last, shorter tile sees."""
        return self.seq_k // self.block_k * self.block_k

    def full_queries(self) -> int:
        return self.seq_q // self.block_q * self.block_q


def expected_forward(case: Case, q, k, v):
    return reference.attention(q, k, v, case.scale, case.mask())


def forward_models(case: Case, q, k, v, *, kernel: bool):
    """(mistake key, why or None, (out, lse) or out alone) for every known mistake that applies to the case."""
    models = []
    if case.causal and case.seq_q != case.seq_k:
        models.append(("top_left_causal", None, reference.attention(q, k, v, case.scale, case.mask(top_left=True))))
    if case.seq_k % case.block_k:
        models.append(("dropped_last_tile", "the last, shorter key tile was left out. " + _DROPPED,
                       reference.attention(q, k, v, case.scale, case.mask(keys=case.full_keys()))))
    if case.causal and kernel:  # the kernel still stops at k_end, but nothing masks the pairs before it
        models.append(("causal_mask_missing", None, reference.attention(q, k, v, case.scale, _forward_tiles(case))))
    if kernel:
        # exp where exp2 belongs: in p and alpha, a softmax of base-2 scores taken in base e (lse not comparable);
        # in alpha alone, the old sums shrink by e^(m_old - m_new) in base-2 units
        models.append(("natural_exp_base2", None, reference.attention(q, k, v, case.scale * reference.LOG2E,
                                                                      case.mask())[0]))
        s = reference.scores(q, k, case.scale, case.mask())
        models.append(("natural_exp_base2", "alpha = exp(m_i - m_new) with a max in base-2 units: use "
                       "tl.math.exp2, like p.", reference.fold_tiles(s, v, reference.tile_widths(
                           case.seq_k, case.block_k), lambda d: torch.exp(d * reference.LOG2E))))
    else:
        models.append(("unscaled_scores", None, reference.attention(q, k, v, 1.0, case.mask())))
    return models


_DROPPED = ("Loop over range(0, n, block) and cut each tile at min(start + block, n), or mask the rows past n; "
            "the last tile is shorter but has to be computed.")


def _forward_tiles(case: Case) -> torch.Tensor:
    """The pairs the forward kernel visits: every key of the tiles that start before its query block's k_end
    (_key_range_end)."""
    i, j = torch.arange(case.seq_q)[:, None], torch.arange(case.seq_k)[None, :]
    k_end = (i // case.block_q * case.block_q + case.block_q + case.seq_k - case.seq_q).clamp(0, case.seq_k)
    return j < (k_end + case.block_k - 1) // case.block_k * case.block_k


def _dkdv_tiles(case: Case) -> torch.Tensor:
    """The pairs the dK/dV kernel visits: every query from its key tile's q_start on (_query_range_start)."""
    i, j = torch.arange(case.seq_q)[:, None], torch.arange(case.seq_k)[None, :]
    q_start = (j // case.block_k * case.block_k - (case.seq_k - case.seq_q)).clamp(min=0) // case.block_q
    return i >= q_start * case.block_q


def _matches(got, model) -> bool:
    if isinstance(model, torch.Tensor):
        return not wrong_rows(got[0], model, FORWARD_TOL).any()
    return not (wrong_rows(got[0], model[0], FORWARD_TOL).any()
                or wrong_rows(got[1], model[1], FORWARD_TOL, columns=False).any())


def forward_problem(case: Case, q, k, v, got, *, kernel: bool = False) -> Problem | None:
    """None if (out, lse) = ``got`` is right; else what is wrong, named when it is a known mistake."""
    out_want, lse_want = expected_forward(case, q, k, v)
    bad_out = wrong_rows(got[0], out_want, FORWARD_TOL)
    bad_lse = wrong_rows(got[1], lse_want, FORWARD_TOL, columns=False)
    bad = bad_out | bad_lse
    if not bad.any():
        return None
    what = (rows_summary(bad_out, "out", got[0], out_want) if bad_out.any()
            else rows_summary(bad_lse, "lse", got[1], lse_want)) + "."
    empty = ~case.mask().any(dim=-1)  # (seq_q,) rows that see no key
    if kernel and (got[0] == 0).all() and (got[1] == float("-inf")).all():
        return Problem("out is 0 and lse -inf in every row.", "nothing_done",
                       "the loop returned (m_i, l_i, acc) as it found them: fold every key tile into them.")
    if empty.any() and not (bad & ~empty).any():
        if torch.isfinite(got[0]).all() and not got[1].isnan().any():
            return Problem(what + " Rows that see no key must give out = 0 and lse = -inf (their l_i ends at 0).")
        return Problem(what, "nan_empty_rows")
    for key, why, model in forward_models(case, q, k, v, kernel=kernel):
        if _matches(got, model):
            return Problem(what, key, why)
    return _row_pattern(case, q, k, got, (bad, bad_lse), (out_want, lse_want), what, kernel)


def _row_pattern(case, q, k, got, bads, want, what, kernel) -> Problem:
    bad, bad_lse = bads
    last = torch.arange(case.seq_q) >= case.full_queries()
    if case.seq_q % case.block_q and not (bad & ~last).any():
        return Problem(what, "dropped_last_tile", "the last, shorter query block was left out. " + _DROPPED)
    s = reference.scores(q, k, case.scale, case.mask())
    # exp(s - 0) is 0 in float32 for every score of these rows (rows that see no key aside)
    negative = (s.amax(dim=-1) < -100) & case.mask().any(dim=-1)
    if negative.any() and not (bad & ~negative).any():
        return Problem(what, "max_starts_at_zero",
                       "rows whose scores are all far below 0 come out empty: with m_i starting at 0 instead of "
                       "-inf, exp(s - 0) underflows to 0 for every key. Start m_i at -inf.")
    moved = reference.max_moves(s, reference.tile_widths(case.seq_k, case.block_k))
    if not (bad & ~moved).any():
        return Problem(what, "no_rescale", _no_rescale_why(got[1], want[1], bad_lse, kernel))
    return Problem(what)


def _no_rescale_why(lse, lse_want, bad_lse, kernel: bool) -> str:
    if not bad_lse.any():
        seen = "acc was not rescaled when the row max grew: rows whose max is in a later key tile come out wrong " \
               "(their lse is right), the others right"
    elif (lse[bad_lse] > lse_want[bad_lse]).all():
        seen = "the running sum l_i was not rescaled when the row max grew: rows whose max is in a later key tile " \
               "come out too large (lse too large), the others right"
    else:
        seen = "l_i was not rescaled rightly when the row max grew: rows whose max is in a later key tile come out " \
               "wrong, the others right"
    extra = " (and check that alpha uses exp2, like p: the max is in base-2 units)" if kernel else ""
    return f"{seen}. Multiply what was accumulated by alpha = exp(m_old - m_new){extra}."


def expected_backward(case: Case, q, k, v, dout):
    """(out, lse) as the forward gives them (float32) and the gradients (dq, dk, dv) in float64."""
    out, lse = expected_forward(case, q, k, v)
    p = reference.probabilities(q, k, lse, case.scale, case.mask())
    return out.float(), lse.float(), reference.gradients(p, q, k, v, out, dout, case.scale)


def backward_models(case: Case, q, k, v, out, lse, dout, *, kernel: bool):
    """(mistake key, why or None, (dq, dk, dv)) for every known mistake that applies to the case."""
    def grads(mask=None, units="natural", **flags):
        p = reference.probabilities(q, k, lse, case.scale, case.mask() if mask is None else mask, units=units)
        return reference.gradients(p, q, k, v, out, dout, case.scale, **flags)

    models = [("no_delta", None, grads(delta=False))]
    if not kernel:  # the kernel multiplies dk by the scale itself, after the learner's loop
        models += [("unscaled_gradient", "dq was not multiplied by the scale (dq = dS k · scale).",
                    grads(scale_dq=False)),
                   ("unscaled_gradient", "dk was not multiplied by the scale (dk = dSᵀ q · scale).",
                    grads(scale_dk=False)),
                   ("unscaled_gradient", None, grads(scale_dq=False, scale_dk=False))]
    if case.causal and case.seq_q != case.seq_k:
        models.append(("top_left_causal", None, grads(case.mask(top_left=True))))
    if case.seq_k % case.block_k:
        models.append(("dropped_last_tile", "the last, shorter key tile was left out. " + _DROPPED,
                       grads(case.mask(keys=case.full_keys()))))
    if case.seq_q % case.block_q:
        models.append(("dropped_last_tile", "the last, shorter query block was left out. " + _DROPPED,
                       grads(case.mask(queries=case.full_queries()))))
    if kernel:
        models += [("natural_exp_base2", "the lse was used in natural units against base-2 scores: multiply it "
                    "by log2 e (as _lse_base2 does) before 2^(s - lse).", grads(units="lse_natural")),
                   ("natural_exp_base2", "exp was taken of base-2 quantities: use tl.math.exp2.",
                    grads(units="exp_natural"))]
        if case.causal:  # the kernel still starts at q_start, but nothing masks the pairs after it
            models.append(("causal_mask_missing", None, grads(_dkdv_tiles(case))))
    return models


def backward_problem(case: Case, inputs, got: dict, *, kernel: bool = False) -> Problem | None:
    """None if the gradients in ``got`` ({"dq": ..., "dk": ..., "dv": ...}, any subset) are right."""
    q, k, v, dout = inputs
    out, lse, want = expected_backward(case, q, k, v, dout)
    want = dict(zip(("dq", "dk", "dv"), want))
    bad = {name: wrong_rows(t, want[name], BACKWARD_TOL, whole=True) for name, t in got.items()}
    if not any(b.any() for b in bad.values()):
        return None
    name = next(n for n, b in bad.items() if b.any())
    what = rows_summary(bad[name], name, got[name], want[name]) + "."
    empty = ~case.mask().any(dim=-1)
    if kernel and all((t == 0).all() for t in got.values()):
        return Problem(f"{' and '.join(got)} are 0 everywhere.", "nothing_done",
                       "the loop returned (dk, dv) as it found them: add every query block's part to them.")
    if empty.any() and not all(torch.isfinite(t).all() for t in got.values()):
        return Problem(what, "nan_empty_rows", "rows that see no key have lse = -inf, and exp(s - lse) = "
                       "exp(-inf + inf) = NaN: give them lse = +inf so that their p is exactly 0.")
    for key, why, model in backward_models(case, q, k, v, out, lse, dout, kernel=kernel):
        model = dict(zip(("dq", "dk", "dv"), model))
        if not any(wrong_rows(t, model[n], BACKWARD_TOL, whole=True).any() for n, t in got.items()):
            return Problem(what, key, why)
    return Problem(what)
