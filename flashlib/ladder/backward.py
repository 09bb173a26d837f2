"""The tuned backwards: notebook 07's kernels with mask-free interior tiles and their own tiles.

``backward="tuned"``: the same three launches and the same arithmetic as
:mod:`flashlib.kernels.backward` (P and dP recomputed from the log-sum-exp, no atomics,
bitwise deterministic). Two changes:

* The query loop of dK/dV and the key loop of dQ are split like the forward's rung 2: tiles
  that every row sees in full, inside the bounds, skip the mask, the bounds checks and the
  guard for rows that saw no key; only tiles on the diagonal or at a ragged end pay for them.
* dK/dV and dQ get tiles of their own. Each kernel keeps one block resident (keys for
  dK/dV, queries for dQ) and streams the other: a tall resident block feeds Hopper's wgmma
  (64 rows per warpgroup) while a short streamed block keeps the recomputed (resident,
  streamed) score tiles small. On a GPU both kernels are autotuned; in the interpreter,
  or given a :class:`~flashlib.kernels.FlashConfig`, they use its ``bwd_*`` tiles.

HEAD_DIM is a compile-time constant here (one compiled kernel per head dim), so a head dim
that is already a power of two loads without any column mask.

``backward="atomic"``: one kernel; the dK/dV kernel also adds each tile's share of dQ into a
float32 dQ with atomics (five products per tile pair instead of seven; the order of the
additions, so the last bits of dQ, can change from run to run).

``backward="lean"`` adds the forward's last two rungs to the same kernels: the streamed
blocks (Q and dO for dK/dV, K and V for dQ) arrive through tensor descriptors on sm_90
(TMA), and causal dQ launches start with the longest query blocks (dK/dV's longest key
blocks already come first). ``backward="bulk"`` is ``"atomic"`` with the same descriptors,
and each dQ tile added to the float32 dQ by one bulk reduction of the copy engine, as
FlashAttention-3 does on Hopper, instead of one atomic instruction per element.
"""
from __future__ import annotations

import torch

from ..kernels._mode import require_triton
from ..kernels.config import LOG2E, FlashConfig, head_dim_pad, seq_bucket

triton = require_triton()
import triton.language as tl  # noqa: E402

from ..kernels.backward import _attn_bwd_preprocess  # noqa: E402
from ..kernels.forward import _LOG2E, _visible  # noqa: E402
from .forward import _ensure_allocator, _key_ranges, _load_rows, _query_block, _tma_hardware, tma_eligible  # noqa: E402


@triton.jit
def _lse_delta(Lse, Delta, offs_m, SEQ_Q, MASKED: tl.constexpr):
    """(lse in base 2, delta) of query rows; +inf lse for padding rows and rows that saw no
    key, so 2^(s - lse) = 0 there. An unmasked tile has neither kind of row."""
    if MASKED:
        lse = tl.load(Lse + offs_m, mask=offs_m < SEQ_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
        delta = tl.load(Delta + offs_m, mask=offs_m < SEQ_Q, other=0.0)
    else:
        lse = tl.load(Lse + offs_m) * _LOG2E
        delta = tl.load(Delta + offs_m)
    return lse, delta


@triton.jit
def _stream_rows(Src, start, stride, offs_rows, offs_d, n_rows, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The streamed tile of rows start + [0, rows), (rows, HEAD_DIM_PAD): Src is a tensor
    descriptor when TMA (rows and columns out of bounds arrive as zeros), else a pointer
    loaded with the masks it needs."""
    if TMA:  # an else, not an early return: the code after a return would still be compiled
        tile = Src.load([start, 0])
    else:
        tile = _load_rows(Src, stride, offs_rows, offs_d, n_rows, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    return tile


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, Lse, Delta, DQ, stride_qm, stride_dom, stride_dqm, offs_n, offs_d, lo, hi,
               qk_scale, scale, SEQ_Q, SEQ_K, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               BLOCK_Q: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr,
               BULK_DQ: tl.constexpr, DQ_T: tl.constexpr):
    """Fold query blocks [lo, hi) into one key block's dk, dv; MASKED tiles check everything.
    ATOMIC_DQ: also add this key block's share of dq (float32) into DQ with atomic adds.
    TMA: Q and DO are tensor descriptors. BULK_DQ: DQ is one too, and each dq tile is added
    by the copy engine in one bulk reduction instead of one atomic per element."""
    for start_m in range(lo, hi, BLOCK_Q):
        offs_m = start_m + tl.arange(0, BLOCK_Q)
        q = _stream_rows(Q, start_m, stride_qm, offs_m, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        do = _stream_rows(DO, start_m, stride_dom, offs_m, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        lse, delta = _lse_delta(Lse, Delta, offs_m, SEQ_Q, MASKED)
        # transposed tiles (BLOCK_K, BLOCK_Q): keys are this program's rows
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL)), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            # dS scaled here, by an FMA where dp - delta was a subtraction (Delta arrives
            # scaled, see launch_backward): the dq tile is then added as it is, without a
            # multiply per element, and dk needs none at the end
            ds_t = p_t * (dp_t * scale - delta[None, :])
        else:
            ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=INPUT_PRECISION)
        # other key blocks add into the same rows at the same time: the order of these float
        # additions, so the last bits of dq, can change from run to run
        if ATOMIC_DQ and DQ_T:
            # dQ transposed, (HEAD_DIM_PAD, BLOCK_Q) = K^T dS^T: the product's long side is the
            # head dim, not the few query rows, so it fills a warpgroup's tensor-core tile
            dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=INPUT_PRECISION)
            if BULK_DQ:  # past HEAD_DIM and SEQ_Q the copy engine clips
                DQ.atomic_add([0, start_m], dq_t)
            else:
                dq_ptrs = DQ + offs_d[:, None] * stride_dqm + offs_m[None, :]
                tl.atomic_add(dq_ptrs, dq_t, mask=(offs_d[:, None] < HEAD_DIM) & (offs_m[None, :] < SEQ_Q),
                              sem="relaxed")
        elif ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=INPUT_PRECISION)  # (BLOCK_Q, HEAD_DIM_PAD)
            if BULK_DQ:  # rows past SEQ_Q and columns past HEAD_DIM are clipped by the copy engine
                DQ.atomic_add([start_m, 0], dq)
            else:
                dq_ptrs = DQ + offs_m[:, None] * stride_dqm + offs_d[None, :]
                tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM),
                              sem="relaxed")
    return dk, dv


@triton.jit
def _query_ranges(start_n, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """(lo, mid, full_end) for key block start_n: query blocks [lo, mid) cross the diagonal
    (masked), [mid, full_end) see the whole key block inside the bounds (unmasked), and
    [full_end, SEQ_Q) is the ragged end (masked). Blocks before lo see none of these keys."""
    n0 = start_n * BLOCK_K
    q_full = (SEQ_Q // BLOCK_Q) * BLOCK_Q
    keys_full = n0 + BLOCK_K <= SEQ_K
    if CAUSAL:
        off = SEQ_K - SEQ_Q  # query i sees key j when j <= i + off
        lo = (tl.maximum(n0 - off, 0) // BLOCK_Q) * BLOCK_Q
        # the first block whose first row sees this block's last key
        first_full = tl.cdiv(tl.maximum(n0 + BLOCK_K - 1 - off, 0), BLOCK_Q) * BLOCK_Q
    else:
        lo = 0
        first_full = 0
    mid = tl.minimum(tl.maximum(first_full, lo), q_full)
    full_end = tl.where(keys_full, q_full, mid)  # a ragged key block is masked throughout
    return lo, mid, full_end


@triton.jit
def _attn_bwd_dkdv_split(Q, K, V, DO, DK, DV, DQ, Lse, Delta, qk_scale, scale,
                         stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                         stride_doz, stride_dom, stride_dkz, stride_dkn, stride_dvz, stride_dvn,
                         stride_dqz, stride_dqm, stride_dqt, SEQ_Q, SEQ_K,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr = False, BULK_DQ: tl.constexpr = False,
                         DQ_T: tl.constexpr = False):
    """dK, dV of one key block; with ATOMIC_DQ also every dQ contribution (DQ: float32, zeroed;
    with BULK_DQ through a descriptor, by bulk reductions; Delta then holds delta * scale).
    DQ_T: DQ is held transposed, (HEAD_DIM, SEQ_Q) per head with rows stride_dqt apart, and
    each dQ tile is computed transposed. Key blocks are launched in order: under a causal
    mask the first see the most queries."""
    start_n = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)
    offs_n = start_n * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = _load_rows(K + off_z * stride_kz, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, True)
    v = _load_rows(V + off_z * stride_vz, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, True)
    dk = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM_PAD], dtype=tl.float32)
    # the streamed blocks' sources: descriptors of this head's (SEQ_Q, HEAD_DIM) Q and dO with TMA
    # (a compile-time branch: a helper returning either type would not compile), else pointers
    if TMA:
        q_src = tl.make_tensor_descriptor(Q + off_z * stride_qz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_qm, 1],
                                          block_shape=[BLOCK_Q, HEAD_DIM_PAD])
        do_src = tl.make_tensor_descriptor(DO + off_z * stride_doz, shape=[SEQ_Q, HEAD_DIM],
                                           strides=[stride_dom, 1], block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    else:
        q_src = Q + off_z * stride_qz
        do_src = DO + off_z * stride_doz
    if DQ_T:
        stride_dqm = stride_dqt  # the loop's row stride of DQ: head-dim rows now
    if BULK_DQ and DQ_T:
        dq_dst = tl.make_tensor_descriptor(DQ + off_z * stride_dqz, shape=[HEAD_DIM, SEQ_Q], strides=[stride_dqt, 1],
                                           block_shape=[HEAD_DIM_PAD, BLOCK_Q])
    elif BULK_DQ:
        dq_dst = tl.make_tensor_descriptor(DQ + off_z * stride_dqz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_dqm, 1],
                                           block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    else:
        dq_dst = DQ + off_z * stride_dqz
    Lse += off_z * SEQ_Q
    Delta += off_z * SEQ_Q
    lo, mid, full_end = _query_ranges(start_n, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    # masked [lo, mid), unmasked [mid, full_end), masked [full_end, SEQ_Q)
    dk, dv = _dkdv_loop(dk, dv, k, v, q_src, do_src, Lse, Delta, dq_dst, stride_qm, stride_dom, stride_dqm, offs_n, offs_d,
                        lo, mid, qk_scale, scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True, CAUSAL,
                        INPUT_PRECISION, ATOMIC_DQ, TMA, BULK_DQ, DQ_T)
    dk, dv = _dkdv_loop(dk, dv, k, v, q_src, do_src, Lse, Delta, dq_dst, stride_qm, stride_dom, stride_dqm, offs_n, offs_d,
                        mid, full_end, qk_scale, scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, False, CAUSAL,
                        INPUT_PRECISION, ATOMIC_DQ, TMA, BULK_DQ, DQ_T)
    dk, dv = _dkdv_loop(dk, dv, k, v, q_src, do_src, Lse, Delta, dq_dst, stride_qm, stride_dom, stride_dqm, offs_n, offs_d,
                        full_end, SEQ_Q, qk_scale, scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_Q, True, CAUSAL,
                        INPUT_PRECISION, ATOMIC_DQ, TMA, BULK_DQ, DQ_T)
    mask = (offs_n[:, None] < SEQ_K) & (offs_d[None, :] < HEAD_DIM)
    if not ATOMIC_DQ:  # with ATOMIC_DQ the loop scaled dS already
        dk = dk * scale
    tl.store(DK + off_z * stride_dkz + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + off_z * stride_dvz + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, lo, hi,
             qk_scale, SEQ_Q, SEQ_K, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             BLOCK_K: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
             TMA: tl.constexpr):
    """Fold key blocks [lo, hi) into one query block's dq (TMA: K and V are descriptors)."""
    for start_n in range(lo, hi, BLOCK_K):
        offs_n = start_n + tl.arange(0, BLOCK_K)
        k = _stream_rows(K, start_n, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        v = _stream_rows(V, start_n, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, MASKED, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_Q, BLOCK_K)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_split(Q, K, V, DO, DQ, Lse, Delta, qk_scale, scale,
                       stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn,
                       stride_doz, stride_dom, stride_dqz, stride_dqm,
                       SEQ_Q, SEQ_K,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       TMA: tl.constexpr = False, LEAN: tl.constexpr = False):
    """dQ of one query block (LEAN: causal launches start with the longest blocks)."""
    start_m = _query_block(CAUSAL, LEAN)
    off_z = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_rows(Q + off_z * stride_qz, stride_qm, offs_m, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, True)
    do = _load_rows(DO + off_z * stride_doz, stride_dom, offs_m, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, True)
    # padding rows and rows without keys get lse = +inf: their p is 0 even in unmasked tiles
    lse, delta = _lse_delta(Lse + off_z * SEQ_Q, Delta + off_z * SEQ_Q, offs_m, SEQ_Q, True)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    if TMA:  # descriptors of this head's (SEQ_K, HEAD_DIM) K and V, as in the dK/dV kernel
        k_src = tl.make_tensor_descriptor(K + off_z * stride_kz, shape=[SEQ_K, HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_K, HEAD_DIM_PAD])
        v_src = tl.make_tensor_descriptor(V + off_z * stride_vz, shape=[SEQ_K, HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_K, HEAD_DIM_PAD])
    else:
        k_src = K + off_z * stride_kz
        v_src = V + off_z * stride_vz
    full_end, hi = _key_ranges(start_m, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    dq = _dq_loop(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, offs_m, offs_d, 0, full_end,
                  qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, False, CAUSAL, INPUT_PRECISION, TMA)
    dq = _dq_loop(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, offs_m, offs_d, full_end, hi,
                  qk_scale, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, BLOCK_K, True, CAUSAL, INPUT_PRECISION, TMA)
    mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + off_z * stride_dqz + offs_m[:, None] * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)


# ----- autotuning (GPU only) -------------------------------------------------------------

# (BLOCK_Q, BLOCK_K, warps, stages) per padded head dim. dK/dV keeps BLOCK_K keys resident,
# dQ BLOCK_Q queries. Every candidate's causal kernel compiles for sm_90 without spills with
# Triton 3.6 and 3.7 (tests/test_backward_fast.py); without the mask (16, 32, 4, 2) at head
# dim 256 spills 4 bytes with 3.6 and is timed like the rest. At head dim 128 a 64 x 128
# dK/dV tile already spills.
# At head dims 64 and 128 no candidate holds its score tile twice: a tile whose probabilities
# feed another product is split among warps by rows only, so it needs 16 rows per warp (64
# with 4 warps, 128 with 8); with fewer, Triton gives every warp pair the same rows and each
# exponential and score product is done twice (compile.exponentials_per_score). That rules
# out (32, 64, 8, 2) for dK/dV (64 key rows, 8 warps). At head dim 256 every spill-free dK/dV
# tile but (32, 32, 4, 1) does so; these are kept, unmeasured, as before.
DKDV_TILES = {64: ((32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)),
              128: ((32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (16, 64, 4, 3)),
              256: ((32, 32, 8, 1), (16, 32, 4, 2))}
DQ_TILES = {64: ((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)),
            128: ((128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)),
            256: ((32, 32, 4, 1), (16, 32, 4, 2))}  # (32, 16, 4, 2) spills with descriptors (Triton 3.6)
# dK/dV with the atomic dQ: one more (BLOCK_Q, HEAD_DIM_PAD) float32 tile per step (at head
# dim 128, (16, 64, 4, 3) spills here)
FUSED_TILES = {64: ((32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 2)),
               128: ((32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3)),
               256: ((32, 32, 8, 1), (16, 32, 8, 1))}
# "lean": descriptors free registers (no address arithmetic for the streamed tiles), which
# lets dK/dV at head dim 128 run 64 key rows with 4 warps and 32-row query tiles without
# spilling (the pointer kernel spills there): two programs per SM where 128 key rows allow one.
LEAN_DKDV_TILES = {64: DKDV_TILES[64],
                   128: ((32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3)),
                   256: DKDV_TILES[256]}
# "bulk": the fused kernel with descriptors and bulk dQ reductions. At head dim 128 a 64 x 64
# tile would put dQ's product on wgmma too, but with 8 warps it holds its scores twice and
# with 4 it spills; (16, 64, 4, 3) builds clean with descriptors (the pointer kernel spills).
# A fifth entry True builds dQ transposed (FlashConfig.bwd_dq_transposed): dQ = dS K has as
# many rows as the query tile (16 or 32, too few for wgmma, so it runs on mma.sync), its
# transpose K^T dS^T as many as the head dim, so every product goes to wgmma. Transposed at
# head dim 128, 32-row query tiles spill (or, on one stage, spill when causal with Triton 3.6),
# and so do 16 x 128 on 2 or 3 stages; (16, 64, 4, 3) and (16, 128, 8, 1) do not.
BULK_TILES = {64: FUSED_TILES[64] + ((32, 128, 8, 3, True), (32, 64, 4, 3, True)),
              128: ((16, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (16, 64, 4, 3, True),
                    (16, 128, 8, 1, True)),
              256: FUSED_TILES[256]}


def tiles_for(table, head_dim_pad_: int):
    """The candidates for a padded head dim (16 and 32 use head dim 64's)."""
    return table[max(64, head_dim_pad_)]


def _config(bm, bn, w, s, dq_t=None):
    """A candidate (BLOCK_Q, BLOCK_K, warps, stages[, DQ_T]) as Triton's Config."""
    extra = {} if dq_t is None else {"DQ_T": dq_t}
    return triton.Config({"BLOCK_Q": bm, "BLOCK_K": bn, **extra}, num_warps=w, num_stages=s)


def _prune(table):
    def prune(configs, named_args, **kwargs):
        return [_config(*tile) for tile in tiles_for(table, kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD")))]
    return prune


def _bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_KEY = ["HEAD_DIM", "CAUSAL", "INPUT_PRECISION", "TMA", "LEAN", "BULK_DQ"]  # Triton adds the argument dtypes
_TABLES = {"dkdv": DKDV_TILES, "dq": DQ_TILES, "fused": FUSED_TILES}


def candidate_table(kernel: str, backward: str) -> dict:
    """The autotune candidates of one kernel ("dkdv", "dq", "fused") of one backward."""
    if kernel == "fused" and backward == "bulk":
        return BULK_TILES
    if kernel == "dkdv" and backward == "lean":
        return LEAN_DKDV_TILES
    return _TABLES[kernel]
# One autotuner per (kernel, backward, sequence bucket), as for the forward (config.seq_bucket):
# each keeps its own choices and all share the kernel's compiled binaries.
_TUNERS: dict = {}


def _tuner(kernel: str, backward: str, bucket: int):
    key = (kernel, backward, bucket)
    if key not in _TUNERS:
        table = candidate_table(kernel, backward)
        # the listed configs are placeholders: the pruner swaps in the head dim's own candidates;
        # the fused kernel's atomics add into a float32 dq that must start at zero for every
        # timed run, and is zeroed again after timing (Triton's reset_to_zero)
        _TUNERS[key] = triton.autotune(
            configs=[_config(*t) for t in table[128]], key=_KEY, do_bench=_bench,
            reset_to_zero=["DQ"] if kernel == "fused" else None,
            prune_configs_by={"early_config_prune": _prune(table)})(
                _attn_bwd_dq_split if kernel == "dq" else _attn_bwd_dkdv_split)
    return _TUNERS[key]


BACKWARDS = ("tuned", "atomic", "lean", "bulk")


def launch_backward(q, k, v, out, lse, dout, causal, scale, cfg: FlashConfig | None, backward: str = "tuned",
                    dlse=None):
    """All (B*H, seq, d) but lse (B*H, seq_q). cfg None: autotuned tiles (GPU only).
    backward: "tuned"; "atomic" (one kernel: dQ added with float32 atomics); "lean" ("tuned"
    with descriptors for the streamed blocks where TMA exists, and longest-first causal dQ);
    "bulk" ("atomic" with descriptors for the streamed blocks, and each dQ tile added by one
    bulk reduction of the copy engine: compiled on sm_90 only, since Triton's interpreter
    has no bulk reductions and runs "bulk" with per-element atomics; its autotuner also
    chooses whether dQ is built transposed, as cfg.bwd_dq_transposed does for fixed tiles).
    dlse: an optional gradient with respect to lse, (B*H, seq_q) float32. Returns dq, dk, dv."""
    if backward not in BACKWARDS:
        raise ValueError(f"launch_backward: argument 'backward' must be one of {BACKWARDS}, got {backward!r}")
    bh, seq_q, d = q.shape
    seq_k = k.shape[1]
    d_pad = head_dim_pad(d)
    atomic_dq = backward in ("atomic", "bulk")
    tma = backward in ("lean", "bulk") and tma_eligible(q, k, v, dout) and _tma_hardware(q.device)
    bulk_dq = backward == "bulk" and tma and q.device.type == "cuda"
    if tma and q.device.type == "cuda":
        _ensure_allocator()
    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(seq_q, 64), bh)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), seq_q, d,
        HEAD_DIM_PAD=d_pad, BLOCK_Q=64)
    if dlse is not None:
        delta -= dlse  # d lse_i / d s_ij = p_ij: a gradient of lse enters where delta does
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # atomics accumulate in float32 and start from zero, in a buffer that holds dQ either way:
    # (B*H, seq_pad, d) as it is, or (B*H, d, seq_pad) transposed (DQ_T; seq_pad keeps its rows
    # 16-byte aligned for the copy engine); the two-kernel path writes dq once
    seq_pad = triton.cdiv(seq_q, 16) * 16
    dq = torch.zeros(bh, seq_pad, d, dtype=torch.float32, device=q.device) if atomic_dq else torch.empty_like(q)
    bulk_dq = bulk_dq and tma_eligible(dq)  # follows from q's eligibility; checked, not assumed
    common = dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, CAUSAL=causal,
                  INPUT_PRECISION=cfg.input_precision if cfg else "tf32", TMA=tma)
    fused = dict(ATOMIC_DQ=atomic_dq, BULK_DQ=bulk_dq)  # the dK/dV kernel's own options
    # with atomics the kernel scales dS itself and wants delta scaled alike: one multiply per
    # row here instead of one per score there
    dkdv_args = (q, k, v, dout, dk, dv, dq, lse, delta * scale if atomic_dq else delta, scale * LOG2E, scale,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                 dq.stride(0), dq.stride(1), seq_pad, seq_q, seq_k)
    dq_args = (q, k, v, dout, dq, lse, delta, scale * LOG2E, scale,
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), seq_q, seq_k)
    lean = backward == "lean"
    if cfg is None:
        bucket = seq_bucket(seq_q, seq_k)
        grid_n = lambda meta: (triton.cdiv(seq_k, meta["BLOCK_K"]), bh)  # noqa: E731
        if atomic_dq:
            tuner = _tuner("fused", backward, bucket)
            tuner[grid_n](*dkdv_args, **common, **fused)
            chosen = getattr(tuner, "best_config", None)  # this launch's (none when compiling ahead)
            return _dq_from(dq, q, bool(chosen and chosen.kwargs.get("DQ_T", False))), dk, dv
        _tuner("dkdv", backward, bucket)[grid_n](*dkdv_args, **common, **fused)
        _tuner("dq", backward, bucket)[lambda meta: (triton.cdiv(seq_q, meta["BLOCK_Q"]), bh)](
            *dq_args, **common, LEAN=lean)
        return dq, dk, dv
    tiles = dict(BLOCK_Q=cfg.bwd_block_q, BLOCK_K=cfg.bwd_block_k, num_warps=cfg.bwd_num_warps,
                 num_stages=cfg.bwd_num_stages)
    if atomic_dq:
        fused["DQ_T"] = cfg.bwd_dq_transposed
    _attn_bwd_dkdv_split[(triton.cdiv(seq_k, cfg.bwd_block_k), bh)](*dkdv_args, **common, **tiles, **fused)
    if atomic_dq:
        return _dq_from(dq, q, fused["DQ_T"]), dk, dv
    _attn_bwd_dq_split[(triton.cdiv(seq_q, cfg.bwd_block_q), bh)](*dq_args, **common, **tiles, LEAN=lean)
    return dq, dk, dv


def _dq_from(buffer, q, transposed: bool):
    """dq, contiguous in q's dtype, from the float32 buffer the atomics added into."""
    bh, seq_pad, d = buffer.shape
    held = buffer.view(bh, d, seq_pad).transpose(1, 2) if transposed else buffer
    return torch.empty(q.shape, dtype=q.dtype, device=q.device).copy_(held[:, :q.shape[1]])


def autotuned_choices(head_dim: int, dtype: torch.dtype, causal: bool, backward: str = "tuned",
                      seq: int = 16384) -> dict:
    """{"dkdv": tiles, "dq": tiles} ("fused" for backward="atomic") the autotuners of one
    backward kept for sequence length seq's bucket (empty before the first GPU call)."""
    found = {}
    bucket = seq_bucket(seq, seq)
    for name in _TABLES:
        tuner = _TUNERS.get((name, backward, bucket))
        for key, config in (tuner.cache.items() if tuner else ()):
            if key[0] == head_dim and key[1] == causal and str(dtype) in key:
                found[name] = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return found
