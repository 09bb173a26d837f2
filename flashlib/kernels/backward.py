"""The fused backward kernels: gradients recomputed from the log-sum-exp, no atomics.

Three launches, as in ``flashlib/backward.py`` (notebook 04):

    1. _attn_bwd_preprocess  delta_i = rowsum(dO_i * O_i)                     (B*H, SEQ_Q)
    2. _attn_bwd_dkdv        one program per key block: loops over query blocks,
                             P = 2^(s - lse * log2 e), dV += Pᵀ dO, dK += dSᵀ Q · scale
    3. _attn_bwd_dq          one program per query block: loops over key blocks,
                             dQ += dS K · scale

with dS = P * (dP - delta) and dP = dO Vᵀ. Every program writes only its own rows of
dK, dV or dQ, so no atomics are needed and the same inputs give bitwise the same
gradients. The price is computing P and dP twice (once per kernel).
"""
from __future__ import annotations

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

from .forward import _key_range_end, _visible  # noqa: E402


@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta, stride_oz, stride_om, stride_doz, stride_dom, SEQ_Q, HEAD_DIM,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O): the term softmax's Jacobian needs, from (seq, d) tensors only."""
    start_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + off_z * stride_oz + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + off_z * stride_doz + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + off_z * SEQ_Q + offs_m, delta, mask=offs_m < SEQ_Q)


@triton.jit
def _load_rows(Ptr, stride, offs, offs_d, SEQ, HEAD_DIM):
    mask = (offs[:, None] < SEQ) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(Ptr + offs[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _lse_base2(Lse, offs_m, SEQ_Q):
    """lse in base-2 units; +inf for padding rows and rows that saw no key, so 2^(s - lse) = 0."""
    lse = tl.load(Lse + offs_m, mask=offs_m < SEQ_Q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_n, offs_d, lo,
                         qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                         BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate one key block's dk, dv over the query blocks that can see it (from lo on)."""
    for start_m in range(lo, SEQ_Q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, stride_qm, offs_m, offs_d, SEQ_Q, HEAD_DIM)
        do = _load_rows(DO, stride_dom, offs_m, offs_d, SEQ_Q, HEAD_DIM)
        lse = _lse_base2(Lse, offs_m, SEQ_Q)
        delta = tl.load(Delta + offs_m, mask=offs_m < SEQ_Q, other=0.0)
        # transposed tiles (BLOCK_N, BLOCK_M): keys are this program's rows
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        p_t = tl.where(tl.trans(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL)), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale,
                   stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                   stride_doz, stride_dom, stride_dkz, stride_dkn, stride_dvz, stride_dvn,
                   SEQ_Q, SEQ_K, HEAD_DIM,
                   HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = _load_rows(K + off_z * stride_kz, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM)  # stays resident
    v = _load_rows(V + off_z * stride_vz, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    lo = 0
    if CAUSAL:
        # the first query that sees key start_n*BLOCK_N is i = j - (SEQ_K - SEQ_Q): skip blocks above
        lo = tl.maximum(start_n * BLOCK_N - (SEQ_K - SEQ_Q), 0) // BLOCK_M * BLOCK_M
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q + off_z * stride_qz, DO + off_z * stride_doz,
                                  Lse + off_z * SEQ_Q, Delta + off_z * SEQ_Q, stride_qm, stride_dom,
                                  offs_n, offs_d, lo, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                                  BLOCK_M, CAUSAL, INPUT_PRECISION)
    mask = (offs_n[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    dk = dk * scale  # s = scale * q kᵀ, so dk picks up the scale once, at the end
    tl.store(DK + off_z * stride_dkz + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + off_z * stride_dvz + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, hi,
                       qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate one query block's dq over the key blocks it can see (up to hi)."""
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM)
        v = _load_rows(V, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])
        p = tl.where(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale,
                 stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                 stride_doz, stride_dom, stride_dqz, stride_dqm,
                 SEQ_Q, SEQ_K, HEAD_DIM,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_rows(Q + off_z * stride_qz, stride_qm, offs_m, offs_d, SEQ_Q, HEAD_DIM)  # stays resident
    do = _load_rows(DO + off_z * stride_doz, stride_dom, offs_m, offs_d, SEQ_Q, HEAD_DIM)
    lse = _lse_base2(Lse + off_z * SEQ_Q, offs_m, SEQ_Q)
    delta = tl.load(Delta + off_z * SEQ_Q + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    hi = _key_range_end(start_m, SEQ_Q, SEQ_K, BLOCK_M, CAUSAL)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K + off_z * stride_kz, V + off_z * stride_vz,
                            stride_kn, stride_vn, offs_m, offs_d, hi, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                            BLOCK_N, CAUSAL, INPUT_PRECISION)
    mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + off_z * stride_dqz + offs_m[:, None] * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)
