"""The faster backwards: notebook 07's kernels with mask-free interior tiles and their own tiles
(what each backward changes and why: :data:`flashlib.ladder.rungs.BACKWARDS`).

``backward="tuned"``: the arithmetic of :mod:`flashlib.kernels.backward` (P and dP recomputed
from the log-sum-exp, no atomics, bitwise deterministic), with the query loop of dK/dV and the
key loop of dQ split like the forward's rung 2 (only tiles on the diagonal or at a ragged end
pay for the mask, the bounds checks and the guard for rows that saw no key), and tiles of their
own: each kernel keeps one block resident (keys for dK/dV, queries for dQ) and streams the other.
``"lean"``: the same kernels with the streamed blocks moved by tensor descriptors (TMA) and causal
dQ blocks launched longest first (dK/dV's longest key blocks already come first).
``"bulk"``: one kernel, _attn_bwd_fused: lean's dK/dV loop also adds each tile's share of dQ into
a float32 dQ (or its transpose, DQ_T), by one bulk reduction of the TMA per tile (sm_90) or, in
Triton's interpreter, which has none, one atomic per element; the order of the additions, so
the last bits of dQ, can change from run to run. HEAD_DIM is a compile-time constant, as in
the forwards.
"""
from __future__ import annotations

import torch

from ..kernels._mode import require_triton
from ..kernels.config import LOG2E, FlashConfig, head_dim_pad, seq_bucket
from . import autotune
from .rungs import Backward, kernel_function, backward as backward_named

triton = require_triton()
import triton.language as tl  # noqa: E402

from ..kernels.backward import _lse_base2  # noqa: E402
from ..kernels.forward import _load_rows  # noqa: E402
from ..kernels.rules import _key_tiles, _query_tiles, _visible, row_runs  # noqa: E402
from .forward import (_load_full_rows, _query_block, _store_rows, empty_rows, ensure_allocator,  # noqa: E402
                      int32_rows, tma_eligible, tma_hardware)


# ----- the steps shared by the kernels ----------------------------------------------------

@triton.jit
def _lse_delta(Lse, Delta, offs_q, SEQ_Q, MASKED: tl.constexpr):
    """(lse in base 2, delta) of query rows; a masked tile may hold padding rows and rows
    that saw no key, whose lse is +inf so that 2^(s - lse) = 0. An unmasked tile has neither."""
    if MASKED:
        lse = _lse_base2(Lse, offs_q, SEQ_Q)
        delta = tl.load(Delta + offs_q, mask=offs_q < SEQ_Q, other=0.0)
    else:
        lse = tl.load(Lse + offs_q)  # base 2, as the forward wrote it
        delta = tl.load(Delta + offs_q)
    return lse, delta


@triton.jit
def _stream_rows(Src, row0, stride, offs_rows, offs_d, n_rows, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The streamed tile of rows row0 + [0, rows), (rows, HEAD_DIM_PAD): Src is a tensor
    descriptor when TMA (rows and columns out of bounds arrive as zeros), else a pointer
    loaded with the masks it needs."""
    if TMA:  # an else, not an early return: the code after a return would still be compiled
        tile = Src.load([row0, 0])
    elif MASKED:
        tile = _load_rows(Src, stride, offs_rows, offs_d, n_rows, HEAD_DIM)
    else:
        tile = _load_full_rows(Src, stride, offs_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    return tile


@triton.jit
def _rows_source(Ptr, stride, n_rows, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 TMA: tl.constexpr):
    """Where the streamed tiles of one head's (n_rows, HEAD_DIM) matrix come from: a
    descriptor with TMA, else the pointer itself."""
    if TMA:
        src = tl.make_tensor_descriptor(Ptr, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                        block_shape=[BLOCK, HEAD_DIM_PAD])
    else:
        src = Ptr
    return src


@triton.jit
def _probs_t(k_tile, q_blk, lse, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Pᵀ, (BLOCK_K, BLOCK_Q): the key tile's rows are the resident ones."""
    s_t = tl.dot(k_tile, tl.trans(q_blk), input_precision=INPUT_PRECISION) * qk_scale
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        p_t = tl.where(tl.trans(_visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL)), p_t, 0.0)
    return p_t


# ----- "tuned" and "lean": dK/dV and dQ, two kernels ------------------------------------------

@triton.jit
def _dkdv_loop(dk, dv, k_tile, v_tile, Q, DO, Lse, Delta, stride_qm, stride_dom, offs_k, offs_d, q_lo, q_hi,
               qk_scale, SEQ_Q, SEQ_K, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               BLOCK_Q: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Fold query blocks [q_lo, q_hi) into one key tile's dk, dv; MASKED tiles check everything."""
    for q0 in range(q_lo, q_hi, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_blk = _stream_rows(Q, q0, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        do_blk = _stream_rows(DO, q0, stride_dom, offs_q, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        lse, delta = _lse_delta(Lse, Delta, offs_q, SEQ_Q, MASKED)
        p_t = _probs_t(k_tile, q_blk, lse, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K, MASKED, CAUSAL, INPUT_PRECISION)
        dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_split(Q, K, V, DO, DK, DV, Lse, Delta, qk_scale, scale, stride_q, stride_k, stride_v, stride_do,
                         stride_dk, stride_dv, SEQ_Q, SEQ_K,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         TMA: tl.constexpr = False):
    """dK, dV of one key tile (TMA: Q and dO streamed by descriptors); each tensor's strides one tuple,
    (head, row). Key tiles are launched in order: under a causal mask the first see the most queries."""
    k0 = tl.program_id(0) * BLOCK_K
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_tile = _load_rows(K + off_z * stride_k[0], stride_k[1], offs_k, offs_d, SEQ_K, HEAD_DIM)  # stays resident
    v_tile = _load_rows(V + off_z * stride_v[0], stride_v[1], offs_k, offs_d, SEQ_K, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    q_src = _rows_source(Q + off_z * stride_q[0], stride_q[1], SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, TMA)
    do_src = _rows_source(DO + off_z * stride_do[0], stride_do[1], SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, TMA)
    Lse += off_z * SEQ_Q
    Delta += off_z * SEQ_Q
    q_start, q_full, q_end = _query_tiles(k0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    # masked [q_start, q_full), unmasked [q_full, q_end), masked [q_end, SEQ_Q)
    dk, dv = _dkdv_loop(dk, dv, k_tile, v_tile, q_src, do_src, Lse, Delta, stride_q[1], stride_do[1], offs_k, offs_d,
                        q_start, q_full, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, MASKED=True,
                        CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, TMA=TMA)
    dk, dv = _dkdv_loop(dk, dv, k_tile, v_tile, q_src, do_src, Lse, Delta, stride_q[1], stride_do[1], offs_k, offs_d,
                        q_full, q_end, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, MASKED=False,
                        CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, TMA=TMA)
    dk, dv = _dkdv_loop(dk, dv, k_tile, v_tile, q_src, do_src, Lse, Delta, stride_q[1], stride_do[1], offs_k, offs_d,
                        q_end, SEQ_Q, qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, MASKED=True,
                        CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, TMA=TMA)
    dk = dk * scale  # s = scale * q kᵀ, so dk picks up the scale once, at the end
    _store_rows(DK + off_z * stride_dk[0], stride_dk[1], offs_k, offs_d, SEQ_K, dk, HEAD_DIM)
    _store_rows(DV + off_z * stride_dv[0], stride_dv[1], offs_k, offs_d, SEQ_K, dv, HEAD_DIM)


@triton.jit
def _dq_loop(dq, q_blk, do_blk, lse, delta, K, V, stride_kn, stride_vn, offs_q, offs_d, k_lo, k_hi,
             qk_scale, SEQ_Q, SEQ_K, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             BLOCK_K: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
             TMA: tl.constexpr):
    """Fold key tiles [k_lo, k_hi) into one query block's dq (TMA: K and V are descriptors)."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_tile = _stream_rows(K, k0, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        v_tile = _stream_rows(V, k0, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_Q, BLOCK_K)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL), p, 0.0)
        dp = tl.dot(do_blk, tl.trans(v_tile), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_split(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale, stride_q, stride_k, stride_v, stride_do,
                       stride_dq, SEQ_Q, SEQ_K,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       TMA: tl.constexpr = False, LONGEST_FIRST: tl.constexpr = False):
    """dQ of one query block (TMA: K and V streamed by descriptors); each tensor's strides one tuple,
    (head, row)."""
    q0 = _query_block(CAUSAL, LONGEST_FIRST) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_blk = _load_rows(Q + off_z * stride_q[0], stride_q[1], offs_q, offs_d, SEQ_Q, HEAD_DIM)  # stays resident
    do_blk = _load_rows(DO + off_z * stride_do[0], stride_do[1], offs_q, offs_d, SEQ_Q, HEAD_DIM)
    # padding rows and rows without keys get lse = +inf: their p is 0 even in unmasked tiles
    lse, delta = _lse_delta(Lse + off_z * SEQ_Q, Delta + off_z * SEQ_Q, offs_q, SEQ_Q, True)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_src = _rows_source(K + off_z * stride_k[0], stride_k[1], SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, TMA)
    v_src = _rows_source(V + off_z * stride_v[0], stride_v[1], SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, TMA)
    k_full, k_end = _key_tiles(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    dq = _dq_loop(dq, q_blk, do_blk, lse, delta, k_src, v_src, stride_k[1], stride_v[1], offs_q, offs_d, 0, k_full,
                  qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, MASKED=False, CAUSAL=CAUSAL,
                  INPUT_PRECISION=INPUT_PRECISION, TMA=TMA)
    dq = _dq_loop(dq, q_blk, do_blk, lse, delta, k_src, v_src, stride_k[1], stride_v[1], offs_q, offs_d, k_full, k_end,
                  qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, MASKED=True, CAUSAL=CAUSAL,
                  INPUT_PRECISION=INPUT_PRECISION, TMA=TMA)
    _store_rows(DQ + off_z * stride_dq[0], stride_dq[1], offs_q, offs_d, SEQ_Q, dq * scale, HEAD_DIM)


# ----- "bulk": dK/dV and dQ, one kernel ------------------------------------------------------

@triton.jit
def _bulk_add_dq(DQ, stride_dq, ds_t, k_tile, q0, offs_q, offs_d, SEQ_Q, HEAD_DIM: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """dQ[q0 : q0 + BLOCK_Q] += dS K, (BLOCK_Q, HEAD_DIM_PAD), by one bulk reduction of the
    TMA into the descriptor DQ (rows past SEQ_Q, columns past HEAD_DIM clipped)."""
    DQ.atomic_add([q0, 0], tl.dot(tl.trans(ds_t.to(k_tile.dtype)), k_tile, input_precision=INPUT_PRECISION))


@triton.jit
def _bulk_add_dq_t(DQ, stride_dq, ds_t, k_tile, q0, offs_q, offs_d, SEQ_Q, HEAD_DIM: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    """dQᵀ[:, q0 : q0 + BLOCK_Q] += Kᵀ dSᵀ, (HEAD_DIM_PAD, BLOCK_Q): the product's long side is
    the head dim, not the few query rows, so it fills a warpgroup's tensor-core tile."""
    DQ.atomic_add([0, q0], tl.dot(tl.trans(k_tile), ds_t.to(k_tile.dtype), input_precision=INPUT_PRECISION))


@triton.jit
def _atomic_add_dq(DQ, stride_dq, ds_t, k_tile, q0, offs_q, offs_d, SEQ_Q, HEAD_DIM: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    """_bulk_add_dq with one atomic per element into the pointer DQ (the interpreter's way)."""
    dq = tl.dot(tl.trans(ds_t.to(k_tile.dtype)), k_tile, input_precision=INPUT_PRECISION)
    mask = (offs_q[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.atomic_add(DQ + offs_q[:, None] * stride_dq + offs_d[None, :], dq, mask=mask, sem="relaxed")


@triton.jit
def _atomic_add_dq_t(DQ, stride_dq, ds_t, k_tile, q0, offs_q, offs_d, SEQ_Q, HEAD_DIM: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    """_bulk_add_dq_t with one atomic per element into the pointer DQ (the interpreter's way)."""
    dq_t = tl.dot(tl.trans(k_tile), ds_t.to(k_tile.dtype), input_precision=INPUT_PRECISION)
    mask = (offs_d[:, None] < HEAD_DIM) & (offs_q[None, :] < SEQ_Q)
    tl.atomic_add(DQ + offs_d[:, None] * stride_dq + offs_q[None, :], dq_t, mask=mask, sem="relaxed")


@triton.jit
def _fused_loop(dk, dv, k_tile, v_tile, q_desc, do_desc, Lse, Delta, dq_dst, stride_dq, offs_k, offs_d, q_lo, q_hi,
                qk_scale, scale, SEQ_Q, SEQ_K, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, ADD_DQ: tl.constexpr):
    """_dkdv_loop with Q and dO from descriptors, and this key tile's share of dq added by ADD_DQ.
    dS is scaled here, by an FMA where dp - delta was a subtraction (Delta arrives scaled):
    the dq tile is then added as it is, without a multiply per element, and dk needs none at
    the end. Other key tiles add into the same rows at the same time."""
    for q0 in range(q_lo, q_hi, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_blk = q_desc.load([q0, 0])
        do_blk = do_desc.load([q0, 0])
        lse, delta = _lse_delta(Lse, Delta, offs_q, SEQ_Q, MASKED)
        p_t = _probs_t(k_tile, q_blk, lse, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K, MASKED, CAUSAL, INPUT_PRECISION)
        dv += tl.dot(p_t.to(do_blk.dtype), do_blk, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v_tile, tl.trans(do_blk), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t * scale - delta[None, :])
        dk += tl.dot(ds_t.to(q_blk.dtype), q_blk, input_precision=INPUT_PRECISION)
        ADD_DQ(dq_dst, stride_dq, ds_t, k_tile, q0, offs_q, offs_d, SEQ_Q, HEAD_DIM, INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dq_destination(DQ, stride_dq, SEQ_Q, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    BLOCK_Q: tl.constexpr, DQ_T: tl.constexpr):
    """A descriptor of one head's float32 dQ, (SEQ_Q, HEAD_DIM), or with DQ_T of its transpose."""
    if DQ_T:
        desc = tl.make_tensor_descriptor(DQ, shape=[HEAD_DIM, SEQ_Q], strides=[stride_dq, 1],
                                         block_shape=[HEAD_DIM_PAD, BLOCK_Q])
    else:
        desc = _rows_source(DQ, stride_dq, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True)
    return desc


@triton.jit
def _attn_bwd_fused(Q, K, V, DO, DK, DV, DQ, Lse, Delta, qk_scale, scale, stride_q, stride_k, stride_v, stride_do,
                    stride_dk, stride_dv, stride_dq, stride_dqt, SEQ_Q, SEQ_K,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    BULK_DQ: tl.constexpr, DQ_T: tl.constexpr = False):
    """dK, dV of one key tile and its share of every dQ row; each tensor's strides one tuple, (head, row).
    DQ: float32, zeroed, (SEQ_Q, HEAD_DIM) per head with rows stride_dq[1] apart, or with DQ_T its transpose,
    rows stride_dqt apart; BULK_DQ: added by bulk reductions of the TMA, else by atomics. Delta holds delta *
    scale."""
    k0 = tl.program_id(0) * BLOCK_K
    off_z = tl.program_id(1).to(tl.int64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_tile = _load_rows(K + off_z * stride_k[0], stride_k[1], offs_k, offs_d, SEQ_K, HEAD_DIM)
    v_tile = _load_rows(V + off_z * stride_v[0], stride_v[1], offs_k, offs_d, SEQ_K, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    q_desc = _rows_source(Q + off_z * stride_q[0], stride_q[1], SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True)
    do_desc = _rows_source(DO + off_z * stride_do[0], stride_do[1], SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True)
    dq_rows = stride_dqt if DQ_T else stride_dq[1]  # how far apart the rows dQ is added by are
    if BULK_DQ:  # a compile-time branch: a descriptor here, a pointer there
        dq_dst = _dq_destination(DQ + off_z * stride_dq[0], dq_rows, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, DQ_T)
    else:
        dq_dst = DQ + off_z * stride_dq[0]
    ADD_DQ: tl.constexpr = ((_bulk_add_dq_t if DQ_T else _bulk_add_dq) if BULK_DQ
                            else (_atomic_add_dq_t if DQ_T else _atomic_add_dq))
    Lse += off_z * SEQ_Q
    Delta += off_z * SEQ_Q
    q_start, q_full, q_end = _query_tiles(k0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    dk, dv = _fused_loop(dk, dv, k_tile, v_tile, q_desc, do_desc, Lse, Delta, dq_dst, dq_rows, offs_k, offs_d,
                         q_start, q_full, qk_scale=qk_scale, scale=scale, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM,
                         BLOCK_Q=BLOCK_Q, MASKED=True, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, ADD_DQ=ADD_DQ)
    dk, dv = _fused_loop(dk, dv, k_tile, v_tile, q_desc, do_desc, Lse, Delta, dq_dst, dq_rows, offs_k, offs_d, q_full,
                         q_end, qk_scale=qk_scale, scale=scale, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM,
                         BLOCK_Q=BLOCK_Q, MASKED=False, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, ADD_DQ=ADD_DQ)
    dk, dv = _fused_loop(dk, dv, k_tile, v_tile, q_desc, do_desc, Lse, Delta, dq_dst, dq_rows, offs_k, offs_d, q_end,
                         SEQ_Q, qk_scale=qk_scale, scale=scale, SEQ_Q=SEQ_Q, SEQ_K=SEQ_K, HEAD_DIM=HEAD_DIM,
                         BLOCK_Q=BLOCK_Q, MASKED=True, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, ADD_DQ=ADD_DQ)
    _store_rows(DK + off_z * stride_dk[0], stride_dk[1], offs_k, offs_d, SEQ_K, dk, HEAD_DIM)  # scaled through dS
    _store_rows(DV + off_z * stride_dv[0], stride_dv[1], offs_k, offs_d, SEQ_K, dv, HEAD_DIM)


# ----- launching --------------------------------------------------------------------------

def runs_as(name: str, descriptors: bool) -> Backward:
    """The backward that runs for ``name``: itself, or the one its table row names where
    descriptors cannot be used."""
    chosen = backward_named(name)
    return backward_named(chosen.without_descriptors) if chosen.without_descriptors and not descriptors else chosen


def variant(chosen: Backward, role: str, descriptors: bool, bulk: bool = True):
    """(kernel, compile-time options) of one autotuned kernel of a backward ("dkdv", "dq" or
    "fused"); descriptors: the streamed blocks move by TMA (the fused kernel's always do);
    bulk: the fused kernel adds dQ by bulk reductions, not atomics."""
    options = dict(BULK_DQ=bulk) if role == "fused" else dict(TMA=descriptors)
    if role == "dq":
        options["LONGEST_FIRST"] = chosen.longest_first
    return kernel_function(chosen.kernels[role]), options


def _preprocess(chosen: Backward, out, dout, dlse):
    """delta = rowsum(dO * O), (B*H, seq_q) float32, less dlse: d lse_i / d s_ij = p_ij, so a
    gradient of lse enters where delta does."""
    bh, seq_q, d = out.shape
    delta = torch.empty(bh, seq_q, dtype=torch.float32, device=out.device)
    for rows in row_runs(bh):  # grid axis 1 holds a launch's rows: CUDA takes at most 65,535
        kernel_function(chosen.kernels["preprocess"])[(triton.cdiv(seq_q, 64), rows.stop - rows.start)](
            out[rows], dout[rows], delta[rows], out.stride()[:2], dout.stride()[:2], seq_q, d,
            HEAD_DIM_PAD=head_dim_pad(d), BLOCK_Q=64)
    if dlse is not None:
        delta -= dlse
    return delta


def _dq_from(buffer, q, transposed: bool):
    """dq, contiguous in q's dtype, from the float32 buffer the fused kernel added into."""
    bh, seq_pad, d = buffer.shape
    held = buffer.view(bh, d, seq_pad).transpose(1, 2) if transposed else buffer
    return torch.empty(q.shape, dtype=q.dtype, device=q.device).copy_(held[:, :q.shape[1]])


def _launch(chosen: Backward, role: str, args, rows: int, options: dict, cfg, bucket: int) -> bool:
    """One kernel of a backward over ``rows`` resident rows per head, with the tiles of cfg or
    autotuned (GPU only) when cfg is None; returns whether it built dQ transposed."""
    options = dict(options)
    kernel, own = variant(chosen, role, options.pop("TMA"), options.pop("BULK_DQ"))
    if cfg is None:
        kernel = autotune.tuner(kernel, (role, chosen.name), bucket, chosen.tiles[role],
                                reset_to_zero=["DQ"] if role == "fused" else None)  # atomics add into DQ
    else:
        own.update(BLOCK_Q=cfg.bwd_block_q, BLOCK_K=cfg.bwd_block_k, num_warps=cfg.bwd_num_warps,
                   num_stages=cfg.bwd_num_stages, **({"DQ_T": cfg.bwd_dq_transposed} if role == "fused" else {}))
    block = "BLOCK_Q" if role == "dq" else "BLOCK_K"
    for run in row_runs(args[0].shape[0]):  # grid axis 1 holds a launch's rows: CUDA takes at most 65,535
        part = tuple(a[run] if isinstance(a, torch.Tensor) else a for a in args)  # every tensor: (B*H, ...)
        kernel[lambda meta, n=run.stop - run.start: (triton.cdiv(rows, meta[block]), n)](*part, **options, **own)
    if cfg is None:
        best = getattr(kernel, "best_config", None)  # this launch's (none when compiling ahead)
        return bool(best and best.kwargs.get("DQ_T", False))
    return own.get("DQ_T", False)


def launch_backward(q, k, v, out, lse, dout, causal, scale, cfg: FlashConfig | None, backward: str = "tuned",
                    dlse=None):
    """(dq, dk, dv) of one backward of the ladder. All (B*H, seq, d) but lse and dlse (an
    optional gradient with respect to lse), (B*H, seq_q) float32. cfg None: autotuned tiles
    (GPU only); for "bulk" the autotuner also chooses whether dQ is built transposed, as
    cfg.bwd_dq_transposed does for fixed tiles."""
    descriptors = tma_eligible(q, k, v, dout) and tma_hardware(q.device)
    chosen = runs_as(backward, descriptors)
    descriptors = descriptors and chosen.descriptors
    if descriptors:
        ensure_allocator(q.device)
    else:  # pointer loads of the streamed blocks: offsets inside one head in int32
        q, k, v, dout = (int32_rows(t) for t in (q, k, v, dout))
    bh, seq_q, d = q.shape
    seq_k = k.shape[1]
    delta = _preprocess(chosen, out, dout, dlse)
    dk, dv = empty_rows(k), empty_rows(v)  # stored with int32 row offsets, as are dq's
    options = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), CAUSAL=causal,
                   INPUT_PRECISION=cfg.input_precision if cfg else "tf32", TMA=descriptors, BULK_DQ=False)
    bucket = seq_bucket(seq_q, seq_k)

    def args(*outputs, delta=delta, lengths=(seq_q, seq_k)):  # the kernels' arguments, strides (head, row) each
        tensors = (q, k, v, dout, *outputs)
        return (*tensors, lse, delta, scale * LOG2E, scale, *(t.stride()[:2] for t in tensors), *lengths)

    if "fused" in chosen.tiles:
        # float32 atomics start from zero, in a buffer that holds dQ either way: (B*H, seq_pad, d)
        # as it is or (B*H, d, seq_pad) transposed (seq_pad keeps its rows 16-byte aligned for the
        # TMA). The kernel scales dS itself and wants delta scaled alike: one multiply per
        # row here instead of one per score there.
        seq_pad = triton.cdiv(seq_q, 16) * 16
        dq = torch.zeros(bh, seq_pad, d, dtype=torch.float32, device=q.device)
        options["BULK_DQ"] = q.device.type == "cuda" and tma_eligible(dq)  # follows from q's; checked
        transposed = _launch(chosen, "fused", args(dk, dv, dq, delta=delta * scale, lengths=(seq_pad, seq_q, seq_k)),
                             seq_k, options, cfg, bucket)
        return _dq_from(dq, q, transposed), dk, dv
    dq = empty_rows(q)
    _launch(chosen, "dkdv", args(dk, dv), seq_k, options, cfg, bucket)
    _launch(chosen, "dq", args(dq), seq_q, options, cfg, bucket)
    return dq, dk, dv


def autotuned_choices(head_dim: int, dtype: torch.dtype, causal: bool, backward: str = "tuned",
                      seq: int = 16384) -> dict:
    """{"dkdv": tiles, "dq": tiles} ("fused" for backward="bulk") the autotuners of one
    backward kept for sequence length seq's bucket (empty before the first GPU call)."""
    bucket = seq_bucket(seq, seq)
    found = {role: autotune.kept((role, backward), bucket, head_dim, causal, dtype)
             for role in backward_named(backward).tiles}
    return {role: tiles for role, tiles in found.items() if tiles}
