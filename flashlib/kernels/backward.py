"""The fused backward kernels: gradients recomputed from the log-sum-exp, no atomics.

Three launches, as in ``flashlib/backward.py`` (notebook 04):

    1. _attn_bwd_preprocess  delta_i = rowsum(dO_i * O_i), over v's head dim  (B*H, SEQ_Q)
    2. _attn_bwd_dkdv        one program per key tile: loops over query blocks,
                             P = 2^(s - lse * log2 e), dV += Pᵀ dO, dK += dSᵀ Q · scale
    3. _attn_bwd_dq          one program per query block: loops over key tiles,
                             dQ += dS K · scale

with dS = P * (dP - delta) and dP = dO Vᵀ. V, dO and dV have v's head dim, HEAD_DIM_V (padded to
HEAD_DIM_V_PAD; MLA's 128 beside q and k's 192; None where it is q's, as in the forward), Q, K, dQ,
dK q's. Every program writes only its own rows of
dK, dV or dQ, so no atomics are needed and the same inputs give bitwise the same
gradients. The price is computing P and dP twice (once per kernel).

The variants use the forward's helpers. Grouped-query attention: a dK/dV program owns one
kv head's key tile and loops over the BLOCK_H query heads that read it (the kv head's group, a
block of heads: a compile-time size, so that the loop vanishes for BLOCK_H = 1), summing their
contributions in registers (no atomics, still deterministic). A score function (soft-capping,
ALiBi...), the ``score`` bundle: dS picks up its slope at the score, derived from the function
(:func:`_mod_slope`). A window, a chunk or a mask function, the ``mask`` bundle: each key tile visits the
query blocks of :func:`_query_range` and skips those its block mask row skips.
"""
from __future__ import annotations

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

from .forward import _load_rows  # noqa: E402
from .rules import (_SKIPPED, _batch_head, _key_range, _mask_row, _mod_scores_slope, _mod_slope,  # noqa: E402,F401
                    _query_range, _query_range_start, _tile_kind, _visible, _visible_slope)


@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta, stride_o, stride_do, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD: tl.constexpr,
                         BLOCK_Q: tl.constexpr):
    """delta = rowsum(dO * O): the term softmax's Jacobian needs, from (seq, d) tensors only; launched
    with v's head dim (O's and dO's), their strides (head, row)."""
    off_z = tl.program_id(1).to(tl.int64)
    offs_q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_rows(Out + off_z * stride_o[0], stride_o[1], offs_q, offs_d, SEQ_Q, HEAD_DIM)
    do = _load_rows(DO + off_z * stride_do[0], stride_do[1], offs_q, offs_d, SEQ_Q, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + off_z * SEQ_Q + offs_q, delta, mask=offs_q < SEQ_Q)


@triton.jit
def _lse_base2_split(Lse, offs_q, SEQ_Q):
    """(hi, lo): the forward's lse in base 2 as two float32 numbers, hi + lo (exact for the float64
    the forward writes; lo = 0 for a float32 lse), so that p = 2^((s - hi) - lo) keeps its bits where
    s is close to the lse; hi = +inf (lo = 0) for padding rows and rows that saw no key, so p = 0."""
    lse = tl.load(Lse + offs_q, mask=offs_q < SEQ_Q, other=float("inf"))
    no_key = (lse == float("-inf")) | (lse == float("inf"))
    finite = tl.where(no_key, 0.0, lse)  # inf - inf would be a NaN, even one thrown away
    hi = finite.to(tl.float32)
    lo = (finite - hi.to(lse.dtype)).to(tl.float32)
    return tl.where(no_key, float("inf"), hi), lo


@triton.jit
def _lse_base2(Lse, offs_q, SEQ_Q):
    """The forward's lse in base 2, one float32 number (the ladder's kernels read this)."""
    hi, lo = _lse_base2_split(Lse, offs_q, SEQ_Q)
    return hi


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d,
                         q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                         BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         k0=0, scale=1.0, off_b=0, off_h=0, mask=None, score=None, HEAD_DIM_V=None):
    """Accumulate one key tile's (keys k0 ..) dk, dv over the query blocks that can see it, from q_start to
    SEQ_Q, or with a mask bundle to its :func:`_query_range` end, passing over the blocks its block mask's row
    skips. dO's columns are dv's; HEAD_DIM_V: v's head dim (None: q's, as the lab's kernel calls it)."""
    offs_dv = tl.arange(0, dv.shape[1])
    if HEAD_DIM_V is None:
        HEAD_DIM_V = HEAD_DIM
    _, q_end = _query_range(k0, SEQ_Q, SEQ_K, BLOCK_Q, offs_k.shape[0], CAUSAL, mask)  # SEQ_Q without a mask
    tiles = _mask_row(off_b, off_h, k0 // offs_k.shape[0], mask)
    for q0 in range(q_start, q_end, BLOCK_Q):
        kind = _tile_kind(tiles, q0 // BLOCK_Q, mask)  # _FULL without a mask bundle
        if kind != _SKIPPED:
            offs_q = q0 + tl.arange(0, BLOCK_Q)
            q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)
            do_blk = _load_rows(DO, stride_dom, offs_q, offs_dv, SEQ_Q, HEAD_DIM_V)
            lse, lse_lo = _lse_base2_split(Lse, offs_q, SEQ_Q)
            delta = tl.load(Delta + offs_q, mask=offs_q < SEQ_Q, other=0.0)
            # transposed tiles (BLOCK_K, BLOCK_Q): keys are this program's rows
            x_t = tl.dot(k_tile, tl.trans(q_blk), input_precision=INPUT_PRECISION)
            s_t, slope_t = _mod_scores_slope(x_t, scale, qk_scale, off_b, off_h, offs_q[None, :], offs_k[:, None],
                                             score)
            p_t = tl.math.exp2((s_t - lse[None, :]) - lse_lo[None, :])
            visible = _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL, kind, off_b, off_h, mask)
            p_t = tl.where(tl.trans(visible), p_t, 0.0)
            slope_t = _visible_slope(slope_t, tl.trans(visible), score)
            dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)
            dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)
            ds_t = _mod_slope(p_t * (dp_t - delta[None, :]), slope_t, score)
            dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_block(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale, stride_q, stride_do, stride_lh, stride_kv,
                         stride_dkv, k0, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V, off_b, off_h,
                         HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, CAUSAL: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, mask=None, score=None):
    """One key tile (k0 ..) of one kv head: K, V, DK, DV point at its first key, their rows stride_kv (K's,
    V's) and stride_dkv (dK's, dV's) apart; Q, DO, Lse and Delta at the first of the BLOCK_H query heads
    that read it (query head off_h), the next ones a head stride further: stride_q, stride_do (head, row),
    stride_lh Lse's and Delta's."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # v's, dO's and dV's columns
    if HEAD_DIM_V is None:  # v's head dim is q's (the launchers pass None): the code of before
        HEAD_DIM_V = HEAD_DIM
    k_tile = _load_rows(K, stride_kv[0], offs_k, offs_d, SEQ_K, HEAD_DIM)  # stays resident
    v_tile = _load_rows(V, stride_kv[1], offs_k, offs_dv, SEQ_K, HEAD_DIM_V)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_V_PAD], dtype=tl.float32)
    q_start, _ = _query_range(k0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, mask)
    for g in range(0, BLOCK_H):  # the query heads that share this kv head add to its dk, dv
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q + g * stride_q[0], DO + g * stride_do[0],
                                      Lse + g * stride_lh, Delta + g * stride_lh, stride_q[1], stride_do[1], offs_k,
                                      offs_d, q_start, qk_scale, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM,
                                      BLOCK_Q=BLOCK_Q, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, k0=k0,
                                      scale=scale, off_b=off_b, off_h=off_h + g, mask=mask, score=score,
                                      HEAD_DIM_V=HEAD_DIM_V)
    mask_k = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    dk = dk * scale  # s = scale * q kᵀ, so dk picks up the scale once, at the end
    rows = offs_k[:, None].to(tl.int64)  # int64: a row stride times a row can pass 2^31
    tl.store(DK + rows * stride_dkv[0] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask_k)
    mask_v = (offs_k[:, None] < SEQ_K) & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(DV + rows * stride_dkv[1] + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=mask_v)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale, stride_q, stride_k, stride_v, stride_do, stride_dk,
                   stride_dv, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V,
                   HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   HEADS=1, BLOCK_H: tl.constexpr = 1, ROW0=0, mask=None, score=None):
    """One program per key tile of one kv head: the grid is (key tiles, B*H_kv); BLOCK_H = H / H_kv; each
    tensor's strides one tuple, (head, row). mask, score: the launch's bundles (kernels/rules.py) or None, the
    block mask's kinds by key tile, (B or 1, H or 1, key tiles, query blocks). ROW0: where K's rows start among
    all B*H_kv, on a batch boundary (a launch takes at most 65,535 rows: rules.row_runs)."""
    k0 = tl.program_id(0) * BLOCK_K  # the grid replaces the reference's loop over key tiles
    off_z = tl.program_id(1).to(tl.int64)  # batch * kv head
    off_q = off_z * BLOCK_H  # its group's first query head, batch * HEADS + head
    off_b, off_h = _batch_head(off_q, HEADS, ROW0 * BLOCK_H)  # what mask and score functions are told
    _attn_bwd_dkdv_block(Q + off_q * stride_q[0], K + off_z * stride_k[0], V + off_z * stride_v[0],
                         DO + off_q * stride_do[0], DK + off_z * stride_dk[0], DV + off_z * stride_dv[0],
                         Lse + off_q * SEQ_Q, Delta + off_q * SEQ_Q, qk_scale, scale, stride_q, stride_do,
                         stride_lh=SEQ_Q, stride_kv=(stride_k[1], stride_v[1]), stride_dkv=(stride_dk[1], stride_dv[1]),
                         k0=k0, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, off_b=off_b,
                         off_h=off_h, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_Q=BLOCK_Q,
                         BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_H, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, mask=mask, score=score)


@triton.jit
def _attn_bwd_dq_inner(dq, q_blk, do_blk, lse, delta, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                       qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                       BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       k_start=0, q0=0, scale=1.0, off_b=0, off_h=0, mask=None, score=None, lse_lo=0.0,
                       HEAD_DIM_V=None):
    """Accumulate one query block's (rows q0 ..) dq over the key tiles it can see, [k_start, k_end); with a
    mask bundle, tiles its block mask's row skips are passed over. lse + lse_lo: the rows' base-2 lse.
    v's columns are do_blk's; HEAD_DIM_V: v's head dim (None: q's)."""
    offs_dv = tl.arange(0, do_blk.shape[1])
    if HEAD_DIM_V is None:
        HEAD_DIM_V = HEAD_DIM
    tiles = _mask_row(off_b, off_h, q0 // offs_q.shape[0], mask)
    for k0 in range(k_start, k_end, BLOCK_K):
        kind = _tile_kind(tiles, k0 // BLOCK_K, mask)  # _FULL without a mask bundle
        if kind != _SKIPPED:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_tile = _load_rows(K, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)
            v_tile = _load_rows(V, stride_vn, offs_k, offs_dv, SEQ_K, HEAD_DIM_V)
            x = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_K)
            s, slope = _mod_scores_slope(x, scale, qk_scale, off_b, off_h, offs_q[:, None], offs_k[None, :], score)
            p = tl.math.exp2((s - lse[:, None]) - lse_lo[:, None])
            visible = _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL, kind, off_b, off_h, mask)
            p = tl.where(visible, p, 0.0)
            slope = _visible_slope(slope, visible, score)
            dp = tl.dot(do_blk, tl.trans(v_tile), input_precision=INPUT_PRECISION)
            ds = _mod_slope(p * (dp - delta[:, None]), slope, score)
            dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_block(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale, stride_qm, stride_kn, stride_vn, stride_dom,
                       stride_dqm, q0, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V, off_b, off_h,
                       HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, mask=None,
                       score=None):
    """One query block (rows q0 ..) of one sequence and head: Q, DO, DQ, Lse, Delta point at the
    head's first row, K, V at its kv head's first key; mask, score: the launch's bundles or None."""
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # v's and dO's columns: dP = dO Vᵀ sums over them
    if HEAD_DIM_V is None:  # v's head dim is q's (the launchers pass None): the code of before
        HEAD_DIM_V = HEAD_DIM
    q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)  # stays resident
    do_blk = _load_rows(DO, stride_dom, offs_q, offs_dv, SEQ_Q, HEAD_DIM_V)
    lse, lse_lo = _lse_base2_split(Lse, offs_q, SEQ_Q)
    delta = tl.load(Delta + offs_q, mask=offs_q < SEQ_Q, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_start, k_end = _key_range(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, mask)
    dq = _attn_bwd_dq_inner(dq, q_blk, do_blk, lse, delta, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end, qk_scale,
                            SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM, BLOCK_K=BLOCK_K, CAUSAL=CAUSAL,
                            INPUT_PRECISION=INPUT_PRECISION, k_start=k_start, q0=q0, scale=scale, off_b=off_b,
                            off_h=off_h, mask=mask, score=score, lse_lo=lse_lo, HEAD_DIM_V=HEAD_DIM_V)
    mask_q = (offs_q[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + offs_q[:, None].to(tl.int64) * stride_dqm + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=mask_q)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale, stride_q, stride_k, stride_v, stride_do, stride_dq,
                 SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V,
                 HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 GROUP=1, HEADS=1, ROW0=0, mask=None, score=None):
    """One program per query block of one head: the grid is (query blocks, B*H); each tensor's strides
    one tuple, (head, row). mask, score: the launch's bundles (kernels/rules.py) or None. ROW0: where Q's rows
    start among all B*H, on a batch boundary (a launch takes at most 65,535 rows: rules.row_runs)."""
    q0 = tl.program_id(0) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)
    off_kv = off_z // GROUP  # grouped-query attention: query head h reads kv head h // GROUP
    off_b, off_h = _batch_head(off_z, HEADS, ROW0)  # what mask and score functions are told
    _attn_bwd_dq_block(Q + off_z * stride_q[0], K + off_kv * stride_k[0], V + off_kv * stride_v[0],
                       DO + off_z * stride_do[0], DQ + off_z * stride_dq[0], Lse + off_z * SEQ_Q, Delta + off_z * SEQ_Q,
                       qk_scale, scale, stride_q[1], stride_k[1], stride_vn=stride_v[1], stride_dom=stride_do[1],
                       stride_dqm=stride_dq[1], q0=q0, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM,
                       HEAD_DIM_V=HEAD_DIM_V, off_b=off_b, off_h=off_h, HEAD_DIM_PAD=HEAD_DIM_PAD,
                       HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, CAUSAL=CAUSAL,
                       INPUT_PRECISION=INPUT_PRECISION, mask=mask, score=score)
