"""The attention cases the tiled and kernel labs share, and how a wrong result is read.

A case fixes shapes, tile sizes, causal or not, whether scores are in the hundreds, and the dtype
of the inputs; its inputs are drawn from a seeded generator. A wrong result is compared with what
each known mistake would produce (a model, computed from the definitions in :mod:`.reference`);
when none matches, :mod:`.diagnose` says what is right, what is not and where, and a probe (the
same shapes with v = the identity) names the first (query, key) pair whose weight differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import diagnose, reference
from .common import Problem, rows_summary, wrong_rows

FORWARD_TOL = 1e-4
BACKWARD_TOL = 2e-4
HALF_TOL = 5e-3  # float16 inputs: p and dS are rounded to float16 before their products
NEG_INF = float("-inf")


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
    dtype: torch.dtype = torch.float32
    probe: bool = False  # v = the identity (head_dim >= seq_k): each output row is that query's row of P
    probe_grad: bool = False  # q = dO = the identity (head_dim >= seq_q): dv holds Pᵀ and dk / scale dSᵀ

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def forward_tol(self) -> float:
        return FORWARD_TOL if self.dtype == torch.float32 else HALF_TOL

    @property
    def backward_tol(self) -> float:
        return BACKWARD_TOL if self.dtype == torch.float32 else HALF_TOL

    def describe(self) -> str:
        b, h, d = self.batch, self.heads, self.head_dim
        text = (f"q {(b, h, self.seq_q, d)}, k and v {(b, h, self.seq_k, d)}, block_q={self.block_q}, "
                f"block_k={self.block_k}, causal={self.causal}")
        return text + (", scores in the hundreds" if self.large else "")

    def inputs(self):
        """q (batch, heads, seq_q, d), k, v, dout (batch, heads, seq_k or seq_q, d), in the case's dtype."""
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
        if self.probe:
            v = torch.eye(self.seq_k, self.head_dim).expand(*lead, -1, -1).contiguous()
        if self.probe_grad:
            q = torch.eye(self.seq_q, self.head_dim).expand(*lead, -1, -1).contiguous()
            dout = q.clone()
        return tuple(t.to(self.dtype) for t in (q, k, v, dout))

    def mask(self, causal: bool | None = None, **mistake) -> torch.Tensor:
        causal = self.causal if causal is None else causal
        return reference.visible(self.seq_q, self.seq_k, causal, **mistake)

    def full_keys(self) -> int:
        """Keys covered by whole tiles: what a loop that drops the last, shorter tile sees."""
        return self.seq_k // self.block_k * self.block_k

    def full_queries(self) -> int:
        return self.seq_q // self.block_q * self.block_q

    def widths(self) -> list[int]:
        return reference.tile_widths(self.seq_k, self.block_k)


def probe_of(case: Case) -> Case:
    """The case's shapes, tiles and mask with v = the identity, in float32 and without large scores."""
    return replace(case, batch=1, heads=1, head_dim=max(case.seq_k, 16), large=False, seed=case.seed + 100,
                   dtype=torch.float32, probe=True)


def backward_probe_of(case: Case) -> Case:
    """The case's shapes, tiles and mask with q = dO = the identity, in float32 and without large scores."""
    return replace(case, batch=1, heads=1, head_dim=max(case.seq_q, case.seq_k, 16), large=False,
                   seed=case.seed + 100, dtype=torch.float32, probe_grad=True)


def expected_forward(case: Case, q, k, v):
    return reference.attention(q, k, v, case.scale, case.mask())


_DROPPED = ("Loop over range(0, n, block) and cut each tile at min(start + block, n), or mask the rows past n; "
            "the last tile is shorter but has to be computed.")


def _key_end(case: Case, kernel: bool) -> torch.Tensor:
    """(seq_q, 1): one past the last key each query's block visits under the causal rule (the forward's k_end)."""
    i = torch.arange(case.seq_q)[:, None]
    if not case.causal:
        return torch.full_like(i, case.seq_k)
    q0 = i // case.block_q * case.block_q
    q1 = q0 + case.block_q if kernel else torch.clamp(q0 + case.block_q, max=case.seq_q)
    return (q1 + case.seq_k - case.seq_q).clamp(0, case.seq_k)


def _visited(case: Case, kernel: bool) -> torch.Tensor:
    """The pairs the forward's loop visits when causal: every key of the tiles that start before k_end."""
    j = torch.arange(case.seq_k)[None, :]
    tiles_end = (_key_end(case, kernel) + case.block_k - 1) // case.block_k * case.block_k
    return j < tiles_end


def _last_tile(case: Case, kernel: bool) -> torch.Tensor:
    """The visible pairs of the last key tile each query's block visits."""
    j = torch.arange(case.seq_k)[None, :]
    last = (_key_end(case, kernel) - 1).clamp(min=0) // case.block_k * case.block_k
    return case.mask() & (j >= last)


def _state_models(case: Case, q, k, v):
    """Mistakes in the PyTorch forward's state: exp2 for exp, lse in base 2 or without m, out not divided."""
    out, lse = expected_forward(case, q, k, v)
    m, l = reference.softmax_state(reference.scores(q, k, case.scale, case.mask()))
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    return [("exp2_for_exp", None, reference.attention(q, k, v, case.scale * diagnose.LN2, case.mask())[0]),
            ("lse_base2", None, (out, torch.where(empty, NEG_INF, m + torch.log2(l_safe)))),
            ("lse_without_max", None, (out, torch.where(empty, NEG_INF, torch.log(l_safe)))),
            ("not_normalised", None, out * l[..., None])]


def _scale_models(case: Case, q, k, v, kernel: bool):
    """The scores scaled wrongly: (mistake, why, out) for each plausible wrong multiplier."""
    if kernel:  # the kernel's scores are base-2: a multiplier c on q kᵀ is c · ln 2 in natural units
        # (log2 e applied twice gives what exp in place of exp2 gives: natural_exp_base2 names both)
        wrong = [(diagnose.LN2, "the scores were not multiplied by qk_scale."),
                 (case.scale ** 2 * reference.LOG2E, "the scores were multiplied by qk_scale twice.")]
    else:
        wrong = [(1.0, "the scores are q kᵀ · scale with scale = 1/sqrt(head_dim); they were not scaled."),
                 (case.scale ** 2, "the scores were multiplied by the scale twice."),
                 (1 / case.scale, "the scores were multiplied by sqrt(head_dim); the scale is 1/sqrt(head_dim).")]
    return [("unscaled_scores", why, reference.attention(q, k, v, c, case.mask())[0]) for c, why in wrong]


def forward_models(case: Case, q, k, v, *, kernel: bool):
    """(mistake key, why or None, (out, lse) or out alone) for every known mistake that applies to the case."""
    mask = case.mask()
    models = []
    if case.causal and case.seq_q != case.seq_k:
        models.append(("top_left_causal", None, reference.attention(q, k, v, case.scale, case.mask(top_left=True))))
    if case.causal:
        models.append(("strict_diagonal", None, reference.attention(q, k, v, case.scale, case.mask(strict=True))))
        # the loop still stops at k_end, but nothing masks the pairs before it
        models.append(("causal_mask_missing", None, reference.attention(q, k, v, case.scale, _visited(case, kernel))))
        if not kernel:
            models.append(("causal_mask_missing", "no key was masked: causal attention was computed as if it were "
                           "not causal.", reference.attention(q, k, v, case.scale, case.mask(causal=False))))
    if case.seq_k % case.block_k:
        models.append(("dropped_last_tile", "the last, shorter key tile was left out. " + _DROPPED,
                       reference.attention(q, k, v, case.scale, case.mask(keys=case.full_keys()))))
    if len(case.widths()) > 1:
        models.append(("last_tile_only", None, reference.attention(q, k, v, case.scale, _last_tile(case, kernel))[0]))
    models += _scale_models(case, q, k, v, kernel)
    models.append(("inverted_rescale", _INVERTED_WHY, inverted_alpha(case, q, k, v, guarded=True)))
    if kernel:
        models += _kernel_models(case, q, k, v, mask)
    else:
        models += _state_models(case, q, k, v)
    return models


_INVERTED_WHY = ("alpha is inverted: when the row max grows, what was accumulated must shrink, alpha = "
                 "exp(m_old - m_new) <= 1 (exp2 in the kernel), not exp(m_new - m_old).")


def inverted_alpha(case: Case, q, k, v, *, guarded: bool):
    """(out, lse) of the loop with alpha = exp(m_new - m_old). Unguarded, the first tile's alpha is
    exp(+inf) = inf and inf * 0 is NaN in every row that sees a key; guarded (alpha 0 there), the rows
    whose max grows later come out wrong. In base 2 (the kernel's units) the factor is the same."""
    s = reference.scores(q, k, case.scale, case.mask())
    grow = (lambda d: torch.where(torch.isneginf(d), 0.0, torch.exp(-d))) if guarded else (lambda d: torch.exp(-d))
    return reference.fold_tiles(s, v, case.widths(), grow)


def _kernel_models(case: Case, q, k, v, mask):
    # exp where exp2 belongs: in p and alpha, a softmax of base-2 scores taken in base e (lse not comparable);
    # in alpha alone, the old sums shrink by e^(m_old - m_new) in base-2 units
    s = reference.scores(q, k, case.scale, mask)
    models = [("natural_exp_base2", None, reference.attention(q, k, v, case.scale * reference.LOG2E, mask)[0]),
              ("natural_exp_base2", "alpha = exp(m_i - m_new) with a max in base-2 units: use tl.math.exp2, like p.",
               reference.fold_tiles(s, v, case.widths(), lambda d: torch.exp(d * reference.LOG2E)))]
    padding = -case.seq_k % case.block_k
    if padding and not case.causal:  # the last tile's padded keys: k = 0 gives score 0, v = 0 adds nothing
        out, lse = expected_forward(case, q, k, v)
        lse_padded = torch.logaddexp(lse, torch.tensor(math.log(padding), dtype=torch.float64))
        models.append(("padded_keys", None, (out * torch.exp(lse - lse_padded)[..., None], lse_padded)))
    return models


def _matches(got, model, tol: float) -> bool:
    if isinstance(model, torch.Tensor):
        return not wrong_rows(got[0], model, tol).any()
    return not (wrong_rows(got[0], model[0], tol).any()
                or wrong_rows(got[1], model[1], tol, columns=False).any())


def forward_problem(case: Case, q, k, v, got, *, kernel: bool = False, probe=None) -> Problem | None:
    """None if (out, lse) = ``got`` is right; else what is wrong, named when it is a known mistake.

    ``probe(case) -> (out, lse) or None`` runs the learner's function on another case (a probe); it is
    called only to describe a mistake no model explains."""
    out_want, lse_want = expected_forward(case, q, k, v)
    tol = case.forward_tol
    bad_out = wrong_rows(got[0], out_want, tol)
    bad_lse = wrong_rows(got[1], lse_want, tol, columns=False)
    bad = bad_out | bad_lse
    if not bad.any():
        return None
    what = (rows_summary(bad_out, "out", got[0], out_want) if bad_out.any()
            else rows_summary(bad_lse, "lse", got[1], lse_want)) + "."
    empty = ~case.mask().any(dim=-1)  # (seq_q,) rows that see no key
    if kernel and (got[0] == 0).all() and (got[1] == NEG_INF).all():
        return Problem("out is 0 and lse -inf in every row.", "nothing_done",
                       "the loop returned (m_i, l_i, acc) as it found them: fold every key tile into them.")
    if empty.any() and not (bad & ~empty).any():
        if torch.isfinite(got[0]).all() and not got[1].isnan().any():
            return Problem(what + " Rows that see no key must give out = 0 and lse = -inf (their l_i ends at 0).")
        return Problem(what, "nan_empty_rows")
    nan_rows = got[0].isnan().any(dim=-1)
    if nan_rows[..., ~empty].all() and inverted_alpha(case, q, k, v, guarded=False)[0][..., ~empty, :].isnan().all():
        return Problem(what, "inverted_rescale", "every row that sees a key is NaN, as when alpha is inverted: the "
                       "first tile's exp(m_new - m_old) is exp(+inf) = inf, and inf * 0 is NaN. " + _INVERTED_WHY)
    for key, why, model in forward_models(case, q, k, v, kernel=kernel):
        if _matches(got, model, tol):
            return Problem(what, key, why)
    return _row_pattern(case, q, k, got, (bad_out, bad_lse), (out_want, lse_want), what, kernel, probe)


def _row_pattern(case, q, k, got, bads, want, what, kernel, probe) -> Problem:
    bad_out, bad_lse = bads
    bad = bad_out | bad_lse
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
    moved = reference.max_moves(s, case.widths())
    if not (bad & ~moved).any():
        return Problem(what, "no_rescale", _no_rescale_why(got[1], want[1], bad_lse, kernel))
    return Problem(_forward_detail(case, s, got, want, bads, what, probe))


def _query_groups(case: Case, s) -> list:
    last = torch.arange(case.seq_q) >= case.full_queries()
    first, end = case.full_queries(), case.seq_q - 1
    groups = [("the rows that see no key", ~case.mask().any(dim=-1)),
              (f"the rows of the last, shorter query block (rows {first}–{end})", last),
              ("the rows whose max is in a later key tile than their first",
               reference.max_moves(s, case.widths()).reshape(-1, case.seq_q).any(dim=0))]
    if case.causal:
        groups.append(("the rows that see only some of the keys", ~case.mask().all(dim=-1)))
    return groups


def _forward_detail(case: Case, s, got, want, bads, what, probe) -> str:
    """What is right, what is not, and where, for a forward result no known mistake explains (s: the scores)."""
    bad_out, bad_lse = bads
    sentences = [diagnose.right_and_wrong({"out": bad_out, "lse": bad_lse})]
    for name, g, w, rows in (("out", got[0], want[0], bad_out), ("lse", got[1], want[1], bad_lse)):
        if rows.any():
            sentences.append(diagnose.factor(name, g, w, rows, case.scale) or
                             (diagnose.offset(name, g, w, rows, case.scale) if name == "lse" else None))
    sentences.append(diagnose.which(bad_out | bad_lse, _query_groups(case, s)))
    sentences.append(_probe_pairs(case, probe))
    return " ".join([what] + [_sentence(x) for x in sentences if x])


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def _probe_pairs(case: Case, probe) -> str | None:
    """Run the learner's function with v = the identity and compare its P with the right one, pair by pair."""
    if probe is None:
        return None
    pc = probe_of(case)
    got = probe(pc)
    if got is None:
        return None
    q, k, v, _ = pc.inputs()
    mask = pc.mask()
    p_want = reference.probabilities(q, k, expected_forward(pc, q, k, v)[1], pc.scale, mask)
    p_got = got[0][..., :pc.seq_k]  # v is the identity: out = P v = P
    text = diagnose.pairs(p_got, p_want, mask, pc.block_k)
    if text is None:
        return None
    sums = diagnose.weight_sums(p_got, mask)
    return text + (f" And {sums}." if sums else "")


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


def _dkdv_tiles(case: Case) -> torch.Tensor:
    """The pairs the dK/dV kernel visits: every query from its key tile's q_start on (_query_range_start)."""
    i, j = torch.arange(case.seq_q)[:, None], torch.arange(case.seq_k)[None, :]
    q_start = (j // case.block_k * case.block_k - (case.seq_k - case.seq_q)).clamp(min=0) // case.block_q
    return i >= q_start * case.block_q


def backward_models(case: Case, q, k, v, out, lse, dout, *, kernel: bool):
    """(mistake key, why or None, (dq, dk, dv)) for every known mistake that applies to the case."""
    def grads(mask=None, units="natural", **flags):
        p = reference.probabilities(q, k, lse, case.scale, case.mask() if mask is None else mask, units=units)
        return reference.gradients(p, q, k, v, out, dout, case.scale, **flags)

    models = [("no_delta", None, grads(delta=False))]
    if len(case.widths()) > 1:
        models.append(("tile_delta", None, grads(delta=case.widths())))
    if case.causal and case.seq_q != case.seq_k:
        models.append(("top_left_causal", None, grads(case.mask(top_left=True))))
    if case.causal:
        models.append(("strict_diagonal", None, grads(case.mask(strict=True))))
    if case.seq_k % case.block_k:
        models.append(("dropped_last_tile", "the last, shorter key tile was left out. " + _DROPPED,
                       grads(case.mask(keys=case.full_keys()))))
    if case.seq_q % case.block_q:
        models.append(("dropped_last_tile", "the last, shorter query block was left out. " + _DROPPED,
                       grads(case.mask(queries=case.full_queries()))))
    models += _kernel_backward_models(case, grads) if kernel else _tiled_backward_models(case, grads)
    if kernel:
        models += _transposed_models(case, q, k, v, out, lse, dout)
    return models


def _tiled_backward_models(case: Case, grads):
    models = [("unscaled_gradient", "dq was not multiplied by the scale (dq = dS k · scale).", grads(scale_dq=0)),
              ("unscaled_gradient", "dk was not multiplied by the scale (dk = dSᵀ q · scale).", grads(scale_dk=0)),
              ("unscaled_gradient", None, grads(scale_dq=0, scale_dk=0)),
              ("scaled_twice", "dq was multiplied by the scale twice.", grads(scale_dq=2)),
              ("scaled_twice", "dk was multiplied by the scale twice.", grads(scale_dk=2)),
              ("scaled_twice", None, grads(scale_dq=2, scale_dk=2)),
              ("exp2_for_exp", "p = 2^(s - lse) where p = exp(s - lse) is meant: s and lse are natural.",
               grads(units="exp2"))]
    if case.causal:
        models.append(("causal_mask_missing", None, grads(case.mask(causal=False))))
    return models


def _kernel_backward_models(case: Case, grads):
    models = [("natural_exp_base2", "the lse was used in natural units against base-2 scores: multiply it "
               "by log2 e before 2^(s - lse).", grads(units="lse_natural")),
              ("natural_exp_base2", "exp was taken of base-2 quantities: use tl.math.exp2.",
               grads(units="exp_natural")),
              ("scaled_twice", None, grads(scale_dk=2))]
    dq, dk, dv = grads()
    models.append(("scaled_twice", "dk was multiplied by qk_scale inside the loop, and the kernel multiplies it "
                   "by the scale after the loop: leave dk unscaled in the loop.",
                   (dq, dk * case.scale * reference.LOG2E, dv)))
    if case.causal:  # the kernel still starts at q_start, but nothing masks the pairs after it
        models.append(("causal_mask_missing", None, grads(_dkdv_tiles(case))))
    return models


def _transposed_models(case: Case, q, k, v, out, lse, dout):
    """lse or delta broadcast along the keys of the transposed (BLOCK_K, BLOCK_Q) tile: key k0 + a takes the
    row term of query q0 + a of the block (only when the tiles are square, else the shapes do not fit)."""
    if case.block_q != case.block_k:
        return []
    i, j = torch.arange(case.seq_q)[:, None], torch.arange(case.seq_k)[None, :]
    index = i // case.block_q * case.block_q + j % case.block_k  # (seq_q, seq_k): whose term pair (i, j) gets
    inside = index < case.seq_q  # past SEQ_Q the kernel's loads give lse = +inf, delta = 0
    index = index.clamp(max=case.seq_q - 1)
    lse, delta = lse.double(), (dout.double() * out.double()).sum(dim=-1)
    s = reference.scores(q, k, case.scale, case.mask())
    lse_t = torch.where(inside, lse[..., index], float("inf"))
    p_t = torch.exp(s - torch.where(lse_t == NEG_INF, float("inf"), lse_t))
    p = reference.probabilities(q, k, lse, case.scale, case.mask())
    dp = dout.double() @ v.double().transpose(-2, -1)

    def grads(p, row_term):
        ds = p * (dp - row_term)
        return None, (ds.transpose(-2, -1) @ q.double()) * case.scale, p.transpose(-2, -1) @ dout.double()

    return [("transposed_broadcast", "lse was broadcast along the keys, lse[:, None]: in the transposed tile the "
             "queries are the columns, so lse[None, :].", grads(p_t, delta[..., None])),
            ("transposed_broadcast", "delta was broadcast along the keys, delta[:, None]: in the transposed tile the "
             "queries are the columns, so delta[None, :].",
             grads(p, torch.where(inside, delta[..., index], 0.0)))]


def _swapped(got: dict, want: dict, tol: float, after: dict) -> Problem | None:
    """Two outputs of one shape returned in each other's place; ``after[name]`` multiplies what the learner's
    code returns in that slot before it is read (the dK/dV kernel scales dk after the loop)."""
    names = list(got)

    def holds(a, b):  # slot a holds what slot b should
        return not wrong_rows(got[a], want[b] / after.get(b, 1.0) * after.get(a, 1.0), tol, whole=True).any()

    for a in names:
        for b in names:
            if a < b and got[a].shape == got[b].shape and holds(a, b) and holds(b, a):
                order = ", ".join(b if n == a else a if n == b else n for n in names)
                return Problem(f"{a} holds what {b} should and {b} what {a} should.", "swapped_outputs",
                               f"the results came back as ({order}): return ({', '.join(names)}).")
    return None


def _key_groups(case: Case) -> list:
    keys = torch.arange(case.seq_k)
    first = case.full_keys()
    groups = [(f"the keys of the last, shorter key tile (keys {first}–{case.seq_k - 1})", keys >= first),
              ("the keys no query sees", ~case.mask().any(dim=0))]
    if case.causal:
        groups.append(("the keys that only some queries see", ~case.mask().all(dim=0)))
    return groups


def _backward_probe(case: Case, probe) -> str | None:
    """Run the learner's loop with q = dO = the identity: dv holds Pᵀ and dk / scale dSᵀ; name the first
    (query, key) pair whose P, or else whose dS, differs."""
    if probe is None:
        return None
    pc = backward_probe_of(case)
    got = probe(pc)
    if got is None:
        return None
    q, k, v, dout = pc.inputs()
    out, lse = expected_forward(pc, q, k, v)
    mask = pc.mask()
    p = reference.probabilities(q, k, lse, pc.scale, mask)
    ds = p * (dout.double() @ v.double().transpose(-2, -1) - (dout.double() * out).sum(dim=-1)[..., None])
    n = pc.seq_q
    p_got = got["dv"][..., :n].transpose(-2, -1) if "dv" in got else None
    ds_got = (got["dk"] / pc.scale)[..., :n].transpose(-2, -1) if "dk" in got else None
    prefix = "With q and dO the identity, dv holds Pᵀ and dk / scale holds dSᵀ: "
    if p_got is not None:
        text = diagnose.pairs(p_got, p, mask, pc.block_k, prefix=prefix)
        if text is not None:
            return text
    return None if ds_got is None else diagnose.pairs(ds_got, ds, mask, pc.block_k, prefix=prefix, noun="dS")


def _backward_detail(case: Case, got: dict, want: dict, bad: dict, what: str, probe=None) -> str:
    sentences = [diagnose.right_and_wrong(bad)]
    for name, rows in bad.items():
        if rows.any():
            sentences.append(diagnose.factor(name, got[name], want[name], rows, case.scale))
            groups = _key_groups(case) if name != "dq" else _query_groups(
                case, reference.scores(*case.inputs()[:2], case.scale, case.mask()))
            place = diagnose.which(rows, groups, "rows" if name == "dq" else "keys")
            sentences.append(f"In {name}, {place[0].lower()}{place[1:]}" if place else None)
    sentences.append(_backward_probe(case, probe))
    return " ".join([what] + [_sentence(x) for x in sentences if x])


def backward_problem(case: Case, inputs, got: dict, *, kernel: bool = False, probe=None) -> Problem | None:
    """None if the gradients in ``got`` ({"dq": ..., "dk": ..., "dv": ...}, any subset) are right.

    ``probe(case) -> got or None`` runs the learner's function on another case; it is called only to
    describe a mistake no model explains."""
    q, k, v, dout = inputs
    out, lse, want = expected_backward(case, q, k, v, dout)
    want = dict(zip(("dq", "dk", "dv"), want))
    tol = case.backward_tol
    bad = {name: wrong_rows(t, want[name], tol, whole=True) for name, t in got.items()}
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
    swapped = _swapped(got, want, tol, {"dk": case.scale} if kernel else {})
    if swapped is not None:
        return swapped
    for key, why, model in backward_models(case, q, k, v, out, lse, dout, kernel=kernel):
        model = dict(zip(("dq", "dk", "dv"), model))
        if not any(wrong_rows(t, model[n], tol, whole=True).any() for n, t in got.items()):
            return Problem(what, key, why)
    return Problem(_backward_detail(case, got, want, bad, what, probe))
