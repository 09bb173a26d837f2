"""The fused forward kernel: FlashAttention-2 order, online softmax in base 2.

One program owns one query block (BLOCK_M rows) of one (batch, head) and streams every
key/value tile it can see past it, keeping in registers the same three quantities as
``flashlib/tiled.py``:

    m_i  running row max of the scaled scores, in base-2 units     (BLOCK_M,)
    l_i  running denominator, sum 2^(s - m_i)                       (BLOCK_M,)
    acc  unnormalised output, sum 2^(s - m_i) v                     (BLOCK_M, HEAD_DIM_PAD)

The scale is folded into one multiplier, qk_scale = scale * log2(e), so each score costs
one multiply and one exp2; normalisation by l_i happens once, after the loop, and the
log-sum-exp (natural log) is stored for the backward pass.
"""
from __future__ import annotations

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = 2^(x * LOG2E)


@triton.jit
def _visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the (query, key) pairs that exist and may attend."""
    mask = (offs_m[:, None] < SEQ_Q) & (offs_n[None, :] < SEQ_K)
    if CAUSAL:
        # bottom-right diagonal: query i sees key j when j <= i + SEQ_K - SEQ_Q
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + (SEQ_K - SEQ_Q))
    return mask


@triton.jit
def _key_range_end(start_m, SEQ_Q, SEQ_K, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key this query block can see: tiles beyond it are skipped."""
    if CAUSAL:
        hi = (start_m + 1) * BLOCK_M + (SEQ_K - SEQ_Q)
        hi = tl.minimum(tl.maximum(hi, 0), SEQ_K)
    else:
        hi = SEQ_K
    return hi


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, hi,
                    qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold every visible key/value tile into (acc, l_i, m_i); q stays in registers throughout."""
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        s = tl.where(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key keeps m = -inf: shift by 0 so 2^-inf = 0, not NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - shift)  # rescales what was accumulated under the old max
        p = tl.math.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, qk_scale,
              stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om,
              SEQ_Q, SEQ_K, HEAD_DIM,
              HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Q, K, V, Out: (B*H, seq, HEAD_DIM), last dim contiguous; Lse: (B*H, SEQ_Q) float32."""
    start_m = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)  # batch * head index; int64 so large tensors index safely
    Q += off_z * stride_qz
    K += off_z * stride_kz
    V += off_z * stride_vz
    Out += off_z * stride_oz
    Lse += off_z * SEQ_Q
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # HEAD_DIM padded to a power of two; the pad is masked
    q_mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    hi = _key_range_end(start_m, SEQ_Q, SEQ_K, BLOCK_M, CAUSAL)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, hi,
                                    qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_N, CAUSAL, INPUT_PRECISION)

    # deferred normalisation; a row that saw no key gets out = 0 and lse = -inf
    seen = l_i != 0  # only a row with no visible key has l_i == 0; NaN stays NaN
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(Out + offs_m[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(Lse + offs_m, lse, mask=offs_m < SEQ_Q)
