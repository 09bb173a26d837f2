"""The course's kernels with the learner's loop plugged in: what the Triton labs launch.

Each harness is the teaching kernel of :mod:`flashlib.kernels.forward` or ``.backward`` around
its inner loop, with the loop passed in as ``INNER``, a ``@triton.jit`` function given as a
compile-time argument (Triton accepts one there). The loop is called exactly as the teaching
kernel calls ``_attn_fwd_inner`` / ``_attn_bwd_dkdv_inner``, so either can be plugged in. The
harness also takes a row stride for lse and delta (the teaching kernels assume them contiguous)
so that every tensor can sit inside guard regions.
"""
from __future__ import annotations

from ..kernels._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

from ..kernels.backward import _query_range_start  # noqa: E402
from ..kernels.config import LN2  # noqa: E402
from ..kernels.forward import _finish, _key_range_end, _load_rows  # noqa: E402

_LN2 = tl.constexpr(LN2)


@triton.jit
def _store_rows(Ptr, stride, offs_rows, offs_d, n_rows, HEAD_DIM, tile):
    """Store a (rows, HEAD_DIM_PAD) tile; rows past n_rows and columns past HEAD_DIM are not written."""
    mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(Ptr + offs_rows[:, None] * stride + offs_d[None, :], tile.to(Ptr.dtype.element_ty), mask=mask)


@triton.jit
def lab_attn_fwd(Q, K, V, Out, Lse, qk_scale,
                 stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om, stride_lz,
                 SEQ_Q, SEQ_K, HEAD_DIM,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, INNER: tl.constexpr):
    """_attn_fwd with INNER as its loop over key tiles. Q, K, V, Out: (B*H, seq, HEAD_DIM); Lse: (B*H, SEQ_Q)."""
    q0 = tl.program_id(0) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_blk = _load_rows(Q + off_z * stride_qz, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_end = _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    m_i, l_i, acc = INNER(m_i, l_i, acc, q_blk, K + off_z * stride_kz, V + off_z * stride_vz, stride_kn, stride_vn,
                          offs_q, offs_d, k_end, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_K, CAUSAL, INPUT_PRECISION)
    out, lse2 = _finish(m_i, l_i, acc)
    _store_rows(Out + off_z * stride_oz, stride_om, offs_q, offs_d, SEQ_Q, HEAD_DIM, out)
    # the natural log, as the lab's checker (and every caller of flashlib) reads the lse
    tl.store(Lse + off_z * stride_lz + offs_q, lse2 * _LN2, mask=offs_q < SEQ_Q)


@triton.jit
def lab_attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale,
                      stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_doz, stride_dom,
                      stride_dkz, stride_dkn, stride_dvz, stride_dvn, stride_lz,
                      SEQ_Q, SEQ_K, HEAD_DIM,
                      HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                      CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, INNER: tl.constexpr):
    """_attn_bwd_dkdv with INNER as its loop over query blocks. Lse (natural log), Delta: (B*H, SEQ_Q)."""
    k0 = tl.program_id(0) * BLOCK_K
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_tile = _load_rows(K + off_z * stride_kz, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)  # stays resident
    v_tile = _load_rows(V + off_z * stride_vz, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    q_start = _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    dk, dv = INNER(dk, dv, k_tile, v_tile, Q + off_z * stride_qz, DO + off_z * stride_doz,
                   Lse + off_z * stride_lz, Delta + off_z * stride_lz, stride_qm, stride_dom,
                   offs_k, offs_d, q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_Q, CAUSAL, INPUT_PRECISION)
    _store_rows(DK + off_z * stride_dkz, stride_dkn, offs_k, offs_d, SEQ_K, HEAD_DIM, dk * scale)  # scale once
    _store_rows(DV + off_z * stride_dvz, stride_dvn, offs_k, offs_d, SEQ_K, HEAD_DIM, dv)
