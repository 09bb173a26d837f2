# A worked solution of the lab attn_fwd_inner (notebook 06): the forward kernel's loop over key tiles.
from flashlib import labs  # noqa: F401  before triton: without a GPU, flashlib switches on Triton's CPU interpreter

import triton
import triton.language as tl


@triton.jit
def attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                   qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                   BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold every key/value tile before k_end into (m_i, l_i, acc); q_blk stays in registers."""
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # the last tile reaches past SEQ_K, and offs_d past HEAD_DIM when it is padded: read 0 there
        kv_mask = (offs_k[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
        k_tile = tl.load(K + offs_k[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v_tile = tl.load(V + offs_k[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        # (BLOCK_Q, BLOCK_K) scores in base-2 units: qk_scale = scale * log2(e)
        s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale
        visible = (offs_q[:, None] < SEQ_Q) & (offs_k[None, :] < SEQ_K)
        if CAUSAL:  # bottom-right: query i sees key j when j <= i + SEQ_K - SEQ_Q
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: 2^-inf = 0, not NaN
        alpha = tl.math.exp2(m_i - shift)  # exp2, like p: the max is in base-2 units too
        p = tl.math.exp2(s - shift[:, None])
        l_i = alpha * l_i + tl.sum(p, 1)
        acc = alpha[:, None] * acc + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=INPUT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
