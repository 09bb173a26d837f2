# A worked solution of the lab attn_bwd_dkdv_inner (notebook 07): the dK/dV kernel's loop over query blocks.
from flashlib.labs import LOG2E  # before triton: without a GPU, flashlib switches on Triton's CPU interpreter

import triton
import triton.language as tl


@triton.jit
def attn_bwd_dkdv_inner(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d,
                        q_start, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                        BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Accumulate one key tile's dk, dv over the query blocks that can see it (from q_start on)."""
    for q0 in range(q_start, SEQ_Q, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        in_rows = offs_q < SEQ_Q  # the last block reaches past SEQ_Q
        qd_mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_blk = tl.load(Q + offs_q[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0)
        do_blk = tl.load(DO + offs_q[:, None] * stride_dom + offs_d[None, :], mask=qd_mask, other=0.0)
        # lse is stored as a natural log and the scores are in base 2: convert it; +inf for padding rows
        # and rows that saw no key, so that their p is 2^-inf = 0
        lse = tl.load(Lse + offs_q, mask=in_rows, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(Delta + offs_q, mask=in_rows, other=0.0)
        # transposed tiles (BLOCK_K, BLOCK_Q): this program's keys are the rows
        s_t = tl.dot(k_tile, tl.trans(q_blk), input_precision=INPUT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        visible = (offs_k[:, None] < SEQ_K) & in_rows[None, :]
        if CAUSAL:  # bottom-right: query i sees key j when j <= i + SEQ_K - SEQ_Q
            visible = visible & (offs_k[:, None] <= offs_q[None, :] + (SEQ_K - SEQ_Q))
        p_t = tl.where(visible, p_t, 0.0)
        dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # dS = P ∘ (dP - delta), transposed
        dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)  # the kernel scales dk after
    return dk, dv
