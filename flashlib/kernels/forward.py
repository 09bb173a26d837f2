"""The fused forward kernel: notebook 03's query-major loop, online softmax in base 2.

One program owns one query block (BLOCK_Q rows) of one (batch, head) and streams every
key/value tile it can see past it, keeping in registers the same three quantities, in the
same order and under the same names, as ``flashlib/tiled.py``:

    m_i  running row max of the scaled scores, in base-2 units     (BLOCK_Q,)
    l_i  running denominator, sum 2^(s - m_i)                       (BLOCK_Q,)
    acc  unnormalised output, sum 2^(s - m_i) v                     (BLOCK_Q, HEAD_DIM_PAD)

The scale is folded into one multiplier, qk_scale = scale * log2(e), so each score costs
one multiply and one exp2; normalisation by l_i happens once, after the loop, and the
log-sum-exp (natural log) is stored for the backward pass.
"""
from __future__ import annotations

from ._mode import require_triton
from .config import LOG2E

triton = require_triton()
import triton.language as tl  # noqa: E402

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _finite(m):
    """m = -inf means the row has seen no visible key yet: shift by 0 so 2^-inf = 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL: tl.constexpr):
    """(BLOCK_Q, BLOCK_K) mask of the (query, key) pairs that exist and may attend."""
    mask = (offs_q[:, None] < SEQ_Q) & (offs_k[None, :] < SEQ_K)
    if CAUSAL:
        # bottom-right diagonal: query i sees key j when j <= i + SEQ_K - SEQ_Q
        mask = mask & (offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q))
    return mask


@triton.jit
def _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key that query rows q0 .. q0 + BLOCK_Q - 1 can see: later tiles are skipped."""
    k_end = SEQ_K
    if CAUSAL:
        k_end = tl.minimum(tl.maximum(q0 + BLOCK_Q + (SEQ_K - SEQ_Q), 0), SEQ_K)
    return k_end


@triton.jit
def _load_rows(Ptr, stride, offs_rows, offs_d, n_rows, HEAD_DIM):
    """A (rows, HEAD_DIM_PAD) tile; rows past n_rows and columns past HEAD_DIM read as 0."""
    mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(Ptr + offs_rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _score_tile(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION: tl.constexpr):
    """(BLOCK_Q, BLOCK_K) scores in base-2 units; pairs that may not attend get -inf."""
    s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION: tl.constexpr):
    """Fold one score tile into the running (m_i, l_i, acc) of its query block."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_Q,)
    shift = _finite(m_new)
    alpha = tl.math.exp2(m_i - shift)  # rescales what was accumulated under the old max
    p = tl.math.exp2(s - shift[:, None])  # (BLOCK_Q, BLOCK_K), unnormalised
    l_i = alpha * l_i + tl.sum(p, 1)
    acc = alpha[:, None] * acc + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc):
    """Normalise once at the end; a row that saw no key (l_i == 0) gives out = 0 and lse = -inf."""
    empty = l_i == 0  # NaN is not 0: a NaN row stays NaN
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) / _LOG2E)  # natural log
    return acc / l_safe[:, None], lse


@triton.jit
def _attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                    qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold every key/value tile before k_end into (m_i, l_i, acc); q_blk stays in registers."""
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_tile = _load_rows(K, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        v_tile = _load_rows(V, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        s = _score_tile(q_blk, k_tile, qk_scale, _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL), INPUT_PRECISION)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, qk_scale,
              stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om,
              SEQ_Q, SEQ_K, HEAD_DIM,
              HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
              CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Q, K, V, Out: (B*H, seq, HEAD_DIM), last dim contiguous; Lse: (B*H, SEQ_Q) float32."""
    q0 = tl.program_id(0) * BLOCK_Q  # the grid replaces the reference's loop over query blocks
    off_z = tl.program_id(1).to(tl.int64)  # batch * head index; int64 so large tensors index safely
    Q += off_z * stride_qz
    K += off_z * stride_kz
    V += off_z * stride_vz
    Out += off_z * stride_oz
    Lse += off_z * SEQ_Q
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # HEAD_DIM padded to a power of two; the pad is masked
    q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_end = _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    m_i, l_i, acc = _attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                                    qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, BLOCK_K, CAUSAL, INPUT_PRECISION)

    out, lse = _finish(m_i, l_i, acc)
    o_mask = (offs_q[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(Out + offs_q[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(Lse + offs_q, lse, mask=offs_q < SEQ_Q)
