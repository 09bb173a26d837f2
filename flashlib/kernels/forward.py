"""The fused forward kernel: notebook 03's query-major loop, online softmax in base 2.

One program owns one query block (BLOCK_Q rows) of one (batch, head) and streams every
key/value tile it can see past it, keeping in registers the same three quantities, in the
same order and under the same names, as ``flashlib/tiled.py``:

    m_i  running row max of the scaled scores, in base-2 units     (BLOCK_Q,)
    l_i  running denominator, sum 2^(s - m_i)                       (BLOCK_Q,)
    acc  unnormalised output, sum 2^(s - m_i) v                     (BLOCK_Q, HEAD_DIM_V_PAD)

v may have a head dim of its own (MLA's 192 for q and k, 128 for v): HEAD_DIM_V, padded to
HEAD_DIM_V_PAD (a size). Where v's dim is q's the launchers pass HEAD_DIM_V=None: v's columns are
then masked with HEAD_DIM itself, and the kernel compiles to the code it had before (a second
run-time dim costs registers: data/bench/LOG.md, 2026-12-02).

The scale is folded into one multiplier, qk_scale = scale * log2(e), so each score costs
one multiply and one exp2; normalisation by l_i happens once, after the loop, and the
log-sum-exp (natural log) is stored for the backward pass.

The variants enter through small helpers, each a no-op for the defaults, so that the loop
compiles as before without them. A launch passes each side of them as one argument, a bundle
(:mod:`flashlib.kernels.rules`), None where it has none:

    grouped-query attention   K, V point at kv head h // GROUP (the kernel's first lines)
    a score function, sinks   ``score``: _dot_scores: SCORE_MOD(scale * q.k, b, h, q_idx, kv_idx, data),
                              e.g. soft-capping, ALiBi, a bias table (flashlib.scores), compiled from
                              what the function does (flashlib.kernels.scorefn); _start_state: the sinks
    a window, a chunk or a    ``mask``: _key_range: the window's key tiles only; _tile_kind: the block
      mask function           mask's word for a tile (skipped, partial, full); _visible: the window's
                              band, the chunk and MASK_MOD(b, h, q_idx, kv_idx, data) in partial tiles
"""
from __future__ import annotations

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

# which keys a query sees and soft-capping: the course's rules, written once (kernels/rules.py)
from .rules import (_FULL, _PARTIAL, _SKIPPED, _batch_head, _key_range, _key_range_end,  # noqa: E402,F401
                    _mask_row, _mod_scores, _start_state, _tile_kind, _visible)


@triton.jit
def _finite(m):
    """m = -inf means the row has seen no visible key yet: shift by 0 so 2^-inf = 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _load_rows(Ptr, stride, offs_rows, offs_d, n_rows, HEAD_DIM):
    """A (rows, HEAD_DIM_PAD) tile; rows past n_rows and columns past HEAD_DIM read as 0."""
    mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_rows[:, None].to(tl.int64) * stride  # int64: a row stride times a row can pass 2^31
    return tl.load(Ptr + rows + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _dot_scores(a, b, qk_scale, INPUT_PRECISION: tl.constexpr, scale=1.0, off_b=0, off_h=0, q_idx=0, kv_idx=0,
                score=None):
    """a bᵀ in base-2 units, through the score bundle's function if any (told the pairs' b, h, q_idx,
    kv_idx): the scores (a = q_blk, b = k_tile) or their transpose (a = k_tile, b = q_blk)."""
    x = tl.dot(a, tl.trans(b), input_precision=INPUT_PRECISION)
    return _mod_scores(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score)


@triton.jit
def _scores(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION: tl.constexpr, scale=1.0, off_b=0, off_h=0, q_idx=0,
            kv_idx=0, score=None):
    """(BLOCK_Q, BLOCK_K) scores in base-2 units, through the score bundle's function if any; pairs that
    may not attend get -inf."""
    s = _dot_scores(q_blk, k_tile, qk_scale, INPUT_PRECISION, scale, off_b, off_h, q_idx, kv_idx, score)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _score_tile(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION: tl.constexpr):
    """(BLOCK_Q, BLOCK_K) scores in base-2 units; pairs that may not attend get -inf."""
    return _scores(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION)


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
    """Normalise once at the end: (out, lse2), the lse in base 2 (kernels.config says why), in
    float64; a row that saw no key (l_i == 0) gives out = 0 and lse2 = -inf."""
    empty = l_i == 0  # NaN is not 0: a NaN row stays NaN
    l_safe = tl.where(empty, 1.0, l_i)
    # m_i + log2(l_i) rounded to float32 is off by up to half an ulp of |lse2| (2.4e-7 at 6), and so
    # is every p = 2^(s - lse2) of a row that one key dominates, relatively: in float64 the sum is
    # exact, and the backward reads it as two float32 numbers (_lse_base2_split)
    lse2 = tl.where(empty, float("-inf"), m_i.to(tl.float64) + tl.math.log2(l_safe).to(tl.float64))
    return acc / l_safe[:, None], lse2


@triton.jit
def _attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end,
                    qk_scale, SEQ_Q, SEQ_K, HEAD_DIM,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    k_start=0, q0=0, scale=1.0, off_b=0, off_h=0, mask=None, score=None, HEAD_DIM_V=None):
    """Fold every key/value tile of [k_start, k_end) into (m_i, l_i, acc); q_blk stays in registers.
    With a mask bundle, the tiles its block mask's row (query block q0 // BLOCK_Q) marks skipped are passed
    over. v's columns are acc's; HEAD_DIM_V: v's head dim (None: q's, as the lab's kernel calls it)."""
    offs_dv = tl.arange(0, acc.shape[1])
    if HEAD_DIM_V is None:
        HEAD_DIM_V = HEAD_DIM
    tiles = _mask_row(off_b, off_h, q0 // offs_q.shape[0], mask)
    for k0 in range(k_start, k_end, BLOCK_K):
        kind = _tile_kind(tiles, k0 // BLOCK_K, mask)  # _FULL without a mask bundle
        if kind != _SKIPPED:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_tile = _load_rows(K, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)
            v_tile = _load_rows(V, stride_vn, offs_k, offs_dv, SEQ_K, HEAD_DIM_V)
            visible = _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL, kind, off_b, off_h, mask)
            s = _scores(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION, scale, off_b, off_h, offs_q[:, None],
                        offs_k[None, :], score)
            m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attn_fwd_block(Q, K, V, Out, Lse, qk_scale, scale, stride_qm, stride_kn, stride_vn, stride_om,
                    q0, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V, off_b, off_h,
                    HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    mask=None, score=None):
    """One query block (rows q0 ..) of one sequence and head: Q, Out point at the head's first row,
    K, V at its kv head's first key, Lse at its first lse; mask, score: the launch's bundles or None.
    Rows and keys are numbered from the sequence's start: what a score or mask function is told."""
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # HEAD_DIM padded to a power of two; the pad is masked
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # v's and out's columns
    if HEAD_DIM_V is None:  # v's head dim is q's (the launchers pass None): the code of before
        HEAD_DIM_V = HEAD_DIM
    q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)

    m_i, l_i = _start_state(tl.zeros([BLOCK_Q], dtype=tl.int64) + off_h, score)  # (-inf, 0) without sinks
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_V_PAD], dtype=tl.float32)
    k_start, k_end = _key_range(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, mask)
    m_i, l_i, acc = _attn_fwd_inner(m_i, l_i, acc, q_blk, K, V, stride_kn, stride_vn, offs_q, offs_d, k_end, qk_scale,
                                    SEQ_Q, SEQ_K, HEAD_DIM=HEAD_DIM, BLOCK_K=BLOCK_K, CAUSAL=CAUSAL,
                                    INPUT_PRECISION=INPUT_PRECISION, k_start=k_start, q0=q0, scale=scale, off_b=off_b,
                                    off_h=off_h, mask=mask, score=score, HEAD_DIM_V=HEAD_DIM_V)

    out, lse = _finish(m_i, l_i, acc)
    o_mask = (offs_q[:, None] < SEQ_Q) & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(Out + offs_q[:, None].to(tl.int64) * stride_om + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=o_mask)
    tl.store(Lse + offs_q, lse, mask=offs_q < SEQ_Q)


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, qk_scale, stride_q, stride_k, stride_v, stride_o, SEQ_Q, SEQ_K, HEAD_DIM,
              HEAD_DIM_V, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
              BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              GROUP=1, HEADS=1, scale=1.0, mask=None, ROW0=0, score=None):
    """Q: (B*H, seq, HEAD_DIM), Out: (B*H, seq, HEAD_DIM_V); K: (B*H_kv, seq, HEAD_DIM), V: (B*H_kv,
    seq, HEAD_DIM_V), H = GROUP * H_kv; last dims contiguous; HEAD_DIM_V None: HEAD_DIM; their strides one
    tuple each, (head, row). Lse: (B*H, SEQ_Q) float32. scale: the natural scale, which a score function is
    given (qk_scale = scale * log2 e). mask: the mask side (a window, chunk or mask function, its block mask of
    (B or 1, H or 1, query blocks, key tiles)), score: the score side (a score function, sinks (H,)), bundles of
    kernels/rules.py, or None. ROW0: where Q's rows start among all B*H, on a batch boundary (a launch takes at
    most 65,535 rows: rules.row_runs). The run-time parameters keep the order they had before the bundles
    (scale, the rule, the block mask, ROW0): ptxas allocates registers by it (data/bench/LOG.md, 2026-12-07)."""
    q0 = tl.program_id(0) * BLOCK_Q  # the grid replaces the reference's loop over query blocks
    off_z = tl.program_id(1).to(tl.int64)  # batch * head index; int64 so large tensors index safely
    off_kv = off_z // GROUP  # grouped-query attention: query head h reads kv head h // GROUP
    off_b, off_h = _batch_head(off_z, HEADS, ROW0)  # what mask and score functions are told
    _attn_fwd_block(Q + off_z * stride_q[0], K + off_kv * stride_k[0], V + off_kv * stride_v[0],
                    Out + off_z * stride_o[0], Lse + off_z * SEQ_Q, qk_scale, scale, stride_q[1], stride_k[1],
                    stride_v[1], stride_o[1], q0, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                    off_b=off_b, off_h=off_h, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
                    BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, mask=mask,
                    score=score)
