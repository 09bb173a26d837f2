"""The fused backward kernels: gradients recomputed from the log-sum-exp, no atomics.

Three launches, as in ``flashlib/backward.py`` (notebook 04):

    1. _attn_bwd_preprocess  delta_i = rowsum(dO_i * O_i)                     (B*H, SEQ_Q)
    2. _attn_bwd_dkdv        one program per key tile: loops over query blocks,
                             P = 2^(s - lse * log2 e), dV += Pᵀ dO, dK += dSᵀ Q · scale
    3. _attn_bwd_dq          one program per query block: loops over key tiles,
                             dQ += dS K · scale

with dS = P * (dP - delta) and dP = dO Vᵀ. Every program writes only its own rows of
dK, dV or dQ, so no atomics are needed and the same inputs give bitwise the same
gradients. The price is computing P and dP twice (once per kernel).
"""
from __future__ import annotations

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

from .forward import _LOG2E, _key_range_end, _load_rows, _visible  # noqa: E402


@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta, stride_oz, stride_om, stride_doz, stride_dom, SEQ_Q, HEAD_DIM,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """delta = rowsum(dO * O): the term softmax's Jacobian needs, from (seq, d) tensors only."""
    off_z = tl.program_id(1).to(tl.int64)
    offs_q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_rows(Out + off_z * stride_oz, stride_om, offs_q, offs_d, SEQ_Q, HEAD_DIM)
    do = _load_rows(DO + off_z * stride_doz, stride_dom, offs_q, offs_d, SEQ_Q, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + off_z * SEQ_Q + offs_q, delta, mask=offs_q < SEQ_Q)


@triton.jit
def _lse_base2(Lse, offs_q, SEQ_Q):
    """lse in base-2 units; +inf for padding rows and rows that saw no key, so 2^(s - lse) = 0."""
    lse = tl.load(Lse + offs_q, mask=offs_q < SEQ_Q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr):
    """The first query block that sees key k0: blocks above it see none of this key tile."""
    q_start = 0
    if CAUSAL:  # query i sees key j when j <= i + SEQ_K - SEQ_Q
        q_start = tl.maximum(k0 - (SEQ_K - SEQ_Q), 0) // BLOCK_Q * BLOCK_Q
    return q_start


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d,
                         q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                         BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate one key tile's dk, dv over the query blocks that can see it (from q_start on)."""
    for q0 in range(q_start, SEQ_Q, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)
        do_blk = _load_rows(DO, stride_dom, offs_q, offs_d, SEQ_Q, HEAD_DIM)
        lse = _lse_base2(Lse, offs_q, SEQ_Q)
        delta = tl.load(Delta + offs_q, mask=offs_q < SEQ_Q, other=0.0)
        # transposed tiles (BLOCK_K, BLOCK_Q): keys are this program's rows
        s_t = tl.dot(k_tile, tl.trans(q_blk), input_precision=INPUT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        p_t = tl.where(tl.trans(_visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL)), p_t, 0.0)
        dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale,
                   stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                   stride_doz, stride_dom, stride_dkz, stride_dkn, stride_dvz, stride_dvn,
                   SEQ_Q, SEQ_K, HEAD_DIM,
                   HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K  # the grid replaces the reference's loop over key tiles
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_tile = _load_rows(K + off_z * stride_kz, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)  # stays resident
    v_tile = _load_rows(V + off_z * stride_vz, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    q_start = _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q + off_z * stride_qz, DO + off_z * stride_doz,
                                  Lse + off_z * SEQ_Q, Delta + off_z * SEQ_Q, stride_qm, stride_dom,
                                  offs_k, offs_d, q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                                  BLOCK_Q, CAUSAL, INPUT_PRECISION)
    mask = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    dk = dk * scale  # s = scale * q kᵀ, so dk picks up the scale once, at the end
    tl.store(DK + off_z * stride_dkz + offs_k[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + off_z * stride_dvz + offs_k[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq_inner(dq, q_blk, do_blk, lse, delta, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                       qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                       BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate one query block's dq over the key tiles it can see (before k_end)."""
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_tile = _load_rows(K, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        v_tile = _load_rows(V, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_Q, BLOCK_K)
        p = tl.math.exp2(s - lse[:, None])
        p = tl.where(_visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL), p, 0.0)
        dp = tl.dot(do_blk, tl.trans(v_tile), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale,
                 stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                 stride_doz, stride_dom, stride_dqz, stride_dqm,
                 SEQ_Q, SEQ_K, HEAD_DIM,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    q0 = tl.program_id(0) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_blk = _load_rows(Q + off_z * stride_qz, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)  # stays resident
    do_blk = _load_rows(DO + off_z * stride_doz, stride_dom, offs_q, offs_d, SEQ_Q, HEAD_DIM)
    lse = _lse_base2(Lse + off_z * SEQ_Q, offs_q, SEQ_Q)
    delta = tl.load(Delta + off_z * SEQ_Q + offs_q, mask=offs_q < SEQ_Q, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_end = _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    dq = _attn_bwd_dq_inner(dq, q_blk, do_blk, lse, delta, K + off_z * stride_kz, V + off_z * stride_vz,
                            stride_kn, stride_vn, offs_q, offs_d, k_end, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                            BLOCK_K, CAUSAL, INPUT_PRECISION)
    mask = (offs_q[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + off_z * stride_dqz + offs_q[:, None] * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)
