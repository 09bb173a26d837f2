"""Split-KV decoding (Flash-Decoding) in two kernels, in the words of notebook 06's forward.

Decoding has a few query rows per sequence and a long cache. FlashAttention-2's schedule (one program per
query block) would launch batch x kv_heads programs, 8 for one sequence of a model with 8 kv heads, on a GPU
with 132 multiprocessors. So the cache is cut into splits as well:

    stage 1, ``_decode_split``   grid (row blocks, num_splits, batch * kv_heads): each program streams its
        split of one sequence's cache past its query rows, keeping (m_i, l_i, acc) as ``_attn_fwd`` does,
        and writes its normalised partial output, m_i and l_i (float32);
    stage 2, ``_decode_merge``   grid (batch * kv_heads, row blocks): folds the splits' states into the
        output with notebook 02's merge, from the attention sinks' state where there are sinks (a partial
        with no value), and, for cascade decoding, a shared prefix's splits too.

Grouped-query attention: the query heads that share a kv head, and their new tokens, are stacked into the
rows of one query block (row r: new token r % new_tokens), so every cached key and value is read once per kv
head. The row blocks of one (sequence, split) are neighbours on grid axis 0: they run side by side, each cached
row coming from DRAM once for all of them (absorbed MLA's 128 heads: two blocks of 64, the second reads L2).

Where a position's key lives is a compile-time function argument, ``KEY_ROWS``: ``_contiguous_rows`` (block b,
the sequence; row j) or ``_paged_rows`` (page table[b, j // PAGE_SIZE], row j % PAGE_SIZE; PAGE_SIZE a
compile-time constant, as a division by a runtime integer costs a dozen instructions per key). The rest of
the kernel is the same for both caches.

Values may have a head dim of their own (HEAD_DIM_V: MLA's). Absorbed MLA's values are its latent cache's
first HEAD_DIM_V columns: the launcher sees v_cache as a view of k_cache's (:func:`values_in_keys`) and
passes V_FROM_K, so each cached row is loaded once, in two pieces, [value columns | the key's own].
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..machinery.checks import check_grid
from ..machinery.options import Options
from ..rules import key_span
from ._mode import interpreting
from .config import LN2, LOG2E, head_dim_pad
from .forward import _finish, _finite, _load_rows, _online_update, _scores, triton
from .rules import (_PARTIAL, _batch_head, _key_range, _key_split, _mod_scores, _sink_state, _stacked_head,
                    _visible, mask_bundle, row_runs, score_bundle)
from .maskfn import copied

import triton.language as tl  # noqa: E402  (after forward: it chose the interpreter mode)

DECODE_FN = "decode_attention"
MAX_BLOCK_Q = 64
# The split rule (choose_num_splits): one wave of programs, PROGRAMS_PER_SM on each streaming
# multiprocessor (what the decoding kernels' registers and shared memory let reside on an H200, 2 or
# 3, MLA's 1 in whole waves: flashlib.kernels.launches, tests/test_launch_model.py), each reading at least MIN_KEYS_PER_SPLIT keys
# (shorter splits spend more on their partial output and its merge than they save), and never more
# than MAX_SPLITS partial outputs to merge.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2
_LN2 = tl.constexpr(LN2)


# ----- stage 1: one split of the cache per program -----------------------------------------------

@triton.jit
def _contiguous_rows(Table, stride_table, off_b, k0, offs_k, valid, PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Contiguous cache (batch, kv_heads, capacity, d): position j of sequence b is row j of block b
    (int64: a row stride times a position can pass 2^31)."""
    return tl.zeros_like(offs_k).to(tl.int64) + off_b, offs_k.to(tl.int64)


@triton.jit
def _paged_rows(Table, stride_table, off_b, k0, offs_k, valid, PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Paged cache (num_pages, kv_heads, PAGE_SIZE, d): position j of sequence b is row j % PAGE_SIZE
    of page Table[b, j // PAGE_SIZE] (the page int64: pages x their size can pass 2^31 elements; the
    row int32, 17 fewer registers: a page holds fewer, checked on the host). A tile that lies in one page
    (k0 a multiple of BLOCK_K, which divides PAGE_SIZE) reads one page number, and its rows share a base
    address as a contiguous tile's do; else each key reads its own."""
    if PAGE_SIZE % BLOCK_K == 0:
        page = tl.load(Table + off_b.to(tl.int64) * stride_table + k0 // PAGE_SIZE).to(tl.int64)
        return tl.zeros_like(offs_k).to(tl.int64) + page, (offs_k % PAGE_SIZE).to(tl.int32)
    page = tl.load(Table + off_b.to(tl.int64) * stride_table + offs_k // PAGE_SIZE, mask=valid, other=0)
    return page.to(tl.int64), (offs_k % PAGE_SIZE).to(tl.int32)


@triton.jit
def _load_cache_rows(Ptr, stride_block, stride_row, blocks, rows, valid, offs_d, HEAD_DIM):
    """A (BLOCK_K, HEAD_DIM_PAD) tile gathered row by row (blocks, rows: KEY_ROWS's); invalid rows and
    the pad read as 0."""
    ptrs = Ptr + blocks[:, None] * stride_block + rows[:, None] * stride_row + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _query_rows(Q, q_rows, offs_r, offs_d, ROWS, HEAD_DIM):
    """A (BLOCK_Q, HEAD_DIM_PAD) tile of queries at element offsets q_rows; rows past ROWS and the pad read as 0."""
    mask = (offs_r[:, None] < ROWS) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal, mask):
    """(BLOCK_Q, BLOCK_K) pairs that exist and may attend: row r is the query of new token r % NEW_TOKENS
    (the rows' stride; the sequence has new_tokens, the rest are padding), seeing this split's keys by the
    forward's rule (kernels/rules.py, the mask bundle's) with seq_q = new_tokens, seq_k = seqlen, attention chunks
    counted from the sequence's start and no key before it; causal a runtime flag (decoding is bound by memory, not
    this test)."""
    tok = offs_r % NEW_TOKENS  # (BLOCK_Q,) each row's new token
    visible = tl.where(causal != 0, _visible(tok, offs_k, new_tokens, seqlen, True),
                       _visible(tok, offs_k, new_tokens, seqlen, False))
    ruled = _visible(tok, offs_k, new_tokens, seqlen, False, _PARTIAL, mask=mask, origin=start)
    visible = visible & ruled & (offs_k[None, :] >= start)
    return visible & (offs_r[:, None] < ROWS) & (offs_k[None, :] < k_hi)


@triton.jit
def _shared_scores(q_blk, q_own, v_tile, k_own, qk_scale, visible, INPUT_PRECISION: tl.constexpr, scale, off_b,
                   off_h, q_idx, kv_idx, score=None):
    """_scores for a key tile held in two pieces, [shared | own]: q.k = q_blk.v_tileᵀ + q_own.k_ownᵀ, the
    columns the values share and the key's own (MLA's latent 512 and rope 64)."""
    x = tl.dot(q_blk, tl.trans(v_tile), input_precision=INPUT_PRECISION)
    x = tl.dot(q_own, tl.trans(k_own), x, input_precision=INPUT_PRECISION)
    s = _mod_scores(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _decode_split(Q, K, V, Partial, PartialML, Seqs, Table, qk_scale, scale, causal, mask, stride_q, stride_k,
                  stride_v, stride_table, stride_p, KV_HEADS, NUM_SPLITS, ROWS, SEQ_ROWS, NEW_TOKENS, HEAD_DIM,
                  HEAD_DIM_V, PAGE_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEY_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  score=None, V_FROM_K: tl.constexpr = False):
    """Q: (batch * kv_heads, ROWS, HEAD_DIM), a kv head's query heads x new tokens, row r at (r // SEQ_ROWS) *
    stride_q[1] + (r % SEQ_ROWS) * stride_q[2] (a shared prefix: every sequence's SEQ_ROWS rows; else SEQ_ROWS =
    ROWS); K, V: caches (blocks, kv_heads, rows per block, HEAD_DIM and HEAD_DIM_V); Partial, PartialML: (batch *
    kv_heads * NUM_SPLITS, ROWS, HEAD_DIM_V and 2) float32, each split's normalised output and its rows' base-2
    max and sum; Seqs: (batch,) int32 each, each sequence's length (new tokens included), new tokens (<= the
    rows' stride NEW_TOKENS) and first position (left padding before it is never seen). mask: the rule's bundle
    (kernels/rules.py; always given, its sides read at run time), score: the score side or None. V_FROM_K: V
    is K's first HEAD_DIM_V columns (absorbed MLA), read with the keys; HEAD_DIM_PAD then pads the rest."""
    split = tl.program_id(1)
    off_z = tl.program_id(2).to(tl.int64)  # batch * KV_HEADS + kv head; int64: offsets from it can pass 2^31
    off_b, kv_head = _batch_head(off_z, KV_HEADS, 0)
    seqlen = tl.load(Seqs[0] + off_b)
    new_tokens = tl.load(Seqs[1] + off_b)
    start = tl.load(Seqs[2] + off_b)
    offset = seqlen - new_tokens  # cache position of the first new token (< 0: rows before 0 see nothing)
    # the keys any row sees, [first, seqlen): the rule's key range for seq_q = new_tokens, seq_k = seqlen (attention
    # chunks counted from the sequence's start), none before that start (its left padding); this program's split of it
    first, _ = _key_range(0, new_tokens, seqlen, 1, BLOCK_K, False, mask, start)
    k_lo, k_hi = _key_split(tl.maximum(first, start // BLOCK_K * BLOCK_K), seqlen, split, NUM_SPLITS, BLOCK_K)
    Q += off_z * stride_q[0]
    K += kv_head * stride_k[1]
    V += kv_head * stride_v[1]
    offs_r = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # fastest: row blocks reading the same cached rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    q_rows = (offs_r // SEQ_ROWS).to(tl.int64) * stride_q[1] + (offs_r % SEQ_ROWS).to(tl.int64) * stride_q[2]
    if V_FROM_K:  # q = [q_blk | q_own], against the columns the values share and the key's own
        q_blk = _query_rows(Q, q_rows, offs_r, offs_dv, ROWS, HEAD_DIM_V)
        q_own = _query_rows(Q + HEAD_DIM_V, q_rows, offs_r, offs_d, ROWS, HEAD_DIM - HEAD_DIM_V)
    else:
        q_blk = _query_rows(Q, q_rows, offs_r, offs_d, ROWS, HEAD_DIM)
        q_own = q_blk  # not read
    # what a score function is told: rows before the cache and keys before the start see nothing, and are at 0
    heads = _stacked_head(kv_head, offs_r, ROWS, NEW_TOKENS)[:, None]
    positions = tl.maximum(offset - start + offs_r % NEW_TOKENS, 0)[:, None]
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_V_PAD], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # q_blk stays in registers; a key's position: its cache position - start
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid = offs_k < k_hi
        blocks, rows = KEY_ROWS(Table, stride_table, off_b, k0, offs_k, valid, PAGE_SIZE, BLOCK_K)
        if V_FROM_K:  # one read of each key row: its first HEAD_DIM_V columns are its value
            v_tile = _load_cache_rows(K, stride_k[0], stride_k[2], blocks, rows, valid, offs_dv, HEAD_DIM_V)
            k_own = _load_cache_rows(K + HEAD_DIM_V, stride_k[0], stride_k[2], blocks, rows, valid, offs_d,
                                     HEAD_DIM - HEAD_DIM_V)
            visible = _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal, mask)
            s = _shared_scores(q_blk, q_own, v_tile, k_own, qk_scale, visible, INPUT_PRECISION, scale, off_b,
                               heads, positions, tl.maximum(offs_k - start, 0)[None, :], score)
        else:
            k_tile = _load_cache_rows(K, stride_k[0], stride_k[2], blocks, rows, valid, offs_d, HEAD_DIM)
            v_tile = _load_cache_rows(V, stride_v[0], stride_v[2], blocks, rows, valid, offs_dv, HEAD_DIM_V)
            visible = _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal, mask)
            s = _scores(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION, scale, off_b, heads, positions,
                        tl.maximum(offs_k - start, 0)[None, :], score)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION)
    out, _ = _finish(m_i, l_i, acc)  # an empty split: out = 0, m = -inf, l = 0, a weight of 0 in the merge
    part = off_z * NUM_SPLITS + split
    o_mask = (offs_r[:, None] < ROWS) & (offs_dv[None, :] < HEAD_DIM_V)
    rows = offs_r[:, None].to(tl.int64) * stride_p[1]
    tl.store(Partial + part * stride_p[0] + rows + offs_dv[None, :], out, mask=o_mask)
    # the state as notebook 02 merges it, m and l, not their lse: its ulp near 72 (base 2), 8e-6, would skew each weight
    stats = PartialML + (part * ROWS + offs_r) * 2
    tl.store(stats, m_i, mask=offs_r < ROWS)
    tl.store(stats + 1, l_i, mask=offs_r < ROWS)


# ----- stage 2: the merge ---------------------------------------------------------------------

@triton.jit
def _merge_partial(m_i, l_i, acc, m_s, l_s, out_s):
    """Fold one split's state (max m_s, denominator l_s, normalised output out_s) into the running
    (m_i, l_i, acc): notebook 02's merge of two partial states, in base 2."""
    m_new = tl.maximum(m_i, m_s)
    shift = _finite(m_new)
    alpha = tl.math.exp2(m_i - shift)
    weight = tl.math.exp2(m_s - shift) * l_s  # 0 for an empty split (m_s = -inf, l_s = 0)
    return m_new, alpha * l_i + weight, alpha[:, None] * acc + weight[:, None] * out_s


@triton.jit
def _fold_splits(m_i, l_i, acc, Partial, PartialML, stride_pz, stride_pr, part0, num_splits, row0, rows_per_part,
                 offs_r, offs_d, ROWS, HEAD_DIM):
    """Fold parts part0 .. part0 + num_splits - 1 of Partial (rows_per_part rows each, from row0 on: this
    program's ROWS rows) into the running state."""
    for split in range(0, num_splits):
        part = part0 + split
        stats = PartialML + (part * rows_per_part + row0 + offs_r) * 2
        m_s = tl.load(stats, mask=offs_r < ROWS, other=float("-inf"))
        l_s = tl.load(stats + 1, mask=offs_r < ROWS, other=0.0)
        out_s = _load_rows(Partial + part * stride_pz + row0 * stride_pr, stride_pr, offs_r, offs_d, ROWS, HEAD_DIM)
        m_i, l_i, acc = _merge_partial(m_i, l_i, acc, m_s, l_s, out_s)
    return m_i, l_i, acc


@triton.jit
def _decode_merge(Partial, PartialML, Out, Lse, stride_pz, stride_pr, stride_oz, stride_or,
                  NUM_SPLITS, ROWS, HEAD_DIM, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  Sinks=None, KV_HEADS=1, NEW_TOKENS=1, Prefix=None, PrefixML=None, stride_xz=0, stride_xr=0,
                  PREFIX_SPLITS=1, BATCH=1):
    """Out, Lse: (batch * kv_heads, ROWS, HEAD_DIM) in q's dtype, HEAD_DIM the values' (as Partial's), and
    (batch * kv_heads, ROWS) float32, natural log; Sinks: (q_heads,) or None (row r of kv head h belongs to
    query head h * ROWS // NEW_TOKENS + r // NEW_TOKENS); Prefix, PrefixML: None, or a shared prefix's stage-1
    results for cascade decoding, (kv_heads * PREFIX_SPLITS, BATCH * ROWS, HEAD_DIM) and their stats: every
    sequence's rows of a kv head stacked, sequence b's from row b * ROWS."""
    off_z = tl.program_id(0).to(tl.int64)  # int64: offsets from it can pass 2^31
    offs_r = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    off_b, kv_head = _batch_head(off_z, KV_HEADS, 0)
    heads = _stacked_head(kv_head, offs_r, ROWS, NEW_TOKENS)
    m_i, l_i = _sink_state(Sinks, heads)  # (-inf, 0) without sinks
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    m_i, l_i, acc = _fold_splits(m_i, l_i, acc, Partial, PartialML, stride_pz, stride_pr, off_z * NUM_SPLITS,
                                 NUM_SPLITS, 0, ROWS, offs_r, offs_d, ROWS, HEAD_DIM)
    if Prefix is not None:
        m_i, l_i, acc = _fold_splits(m_i, l_i, acc, Prefix, PrefixML, stride_xz, stride_xr, kv_head * PREFIX_SPLITS,
                                     PREFIX_SPLITS, off_b * ROWS, BATCH * ROWS, offs_r, offs_d, ROWS, HEAD_DIM)
    out, lse = _finish(m_i, l_i, acc)
    Out += off_z * stride_oz
    o_mask = (offs_r[:, None] < ROWS) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_r[:, None].to(tl.int64) * stride_or
    tl.store(Out + rows + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(Lse + off_z * ROWS + offs_r, lse * _LN2, mask=offs_r < ROWS)  # base 2 until here


# ----- the launcher ---------------------------------------------------------------------------

class DecodeConfig(NamedTuple):
    """Stage 1's launch: BLOCK_K keys per tile, warps, pipeline stages (stage 2: :func:`merge_warps`, 1 stage)."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


# absorbed MLA's widths (576 / 512), measured by tests/decode_compile.py (data/bench/LOG.md, 2026-12-02)
WIDE_CONFIG = DecodeConfig(32, 8, 3)
# Triton's pipeliner gives a load that waits on another load of the loop (a paged tile on its page
# numbers) ceil((stages - 2) / 2) buffers where a load of its own gets stages - 1: two more stages give
# a paged tile as many tiles in flight as a contiguous one (shared memory of the compiled kernels,
# data/bench/LOG.md 2026-12-05)
PAGED_EXTRA_STAGES = 2


def decode_config(head_dim: int, dtype: torch.dtype, capability=None, head_dim_v: int | None = None,
                  paged: bool = False) -> DecodeConfig:
    """The shipped tiles: about 32 KB of K and V per tile (memory-bound: bytes in flight are what count), three stages
    from sm_80 on (96 KB of shared memory at most), two on sm_75 (64 KB), with 8 warps there (4 spilled registers at
    head dim 64 with a soft-cap); a paged cache PAGED_EXTRA_STAGES more. Head dims past 256 (absorbed MLA's 576 for q
    and k, head_dim_v 512): :data:`WIDE_CONFIG`, the accumulator alone (BLOCK_Q x 512 float32) needing eight warps."""
    if capability is None:  # the interpreter: tiles small enough that short test caches span several
        return DecodeConfig(32, 4, 1)
    if max(head_dim, head_dim_v or head_dim) > 256:
        config = WIDE_CONFIG
    else:
        per_tile = 128 if head_dim_pad(head_dim) <= 64 else 64 if head_dim_pad(head_dim) <= 128 else 32
        per_tile //= 2 if dtype == torch.float32 else 1
        config = DecodeConfig(max(16, per_tile // 2), 8, 2) if tuple(capability) < (8, 0) else DecodeConfig(per_tile, 4, 3)
    return config._replace(num_stages=config.num_stages + PAGED_EXTRA_STAGES) if paged else config


def choose_num_splits(programs: int, keys: int, sm_count: int | None) -> int:
    """The number of splits ``num_splits=None`` picks.

    programs: the programs one split launches (batch x kv_heads x query row blocks); keys: the longest span
    a query can see (the cache's capacity, or the window's); sm_count: the GPU's multiprocessors, None for
    Triton's CPU interpreter (programs one at a time: splitting gains nothing, 1). On a GPU, as many splits
    as one wave of PROGRAMS_PER_SM programs per multiprocessor holds (a part-filled second wave takes as long
    as the first), no more than keys / MIN_KEYS_PER_SPLIT, at most MAX_SPLITS:

        num_splits = clamp(min(floor(2 * sm_count / programs), ceil(keys / 256)), 1, 64)

    e.g. an H200 (132 multiprocessors), 8 kv heads, one query row block, 64k keys: batch 1 gives 33 splits
    (264 programs), batch 8 gives 4 (256 programs).
    """
    if sm_count is None or programs < 1:
        return 1
    wave = PROGRAMS_PER_SM * sm_count // programs
    return max(1, min(wave, -(-keys // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def row_block(rows: int, head_dim_v: int = 0, capability=None) -> int:
    """BLOCK_Q for ``rows`` stacked query rows: a power of two, >= 16 (tl.dot's minimum), <= 64. Where the values are
    wider than 256 (absorbed MLA's 512): 64 on sm_90 (a warpgroup's wgmma rows: 250 registers at 8 warps, no spill),
    32 before it (a 64 x 512 float32 accumulator spills on sm_80 at any warp count, data/bench/LOG.md 2026-12-02)."""
    hopper = capability is not None and tuple(capability) >= (9, 0)
    most = MAX_BLOCK_Q if head_dim_v <= 256 or hopper else MAX_BLOCK_Q // 2
    return min(most, max(16, 1 << max(rows - 1, 0).bit_length()))


def device_target(device: torch.device) -> tuple:
    """(compute capability, multiprocessors) the launches are shaped for; (None, None) in the interpreter."""
    if device.type != "cuda" or interpreting():
        return None, None
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def sm_count(device: torch.device):
    """Streaming multiprocessors of a CUDA device; None for the interpreter's CPU tensors."""
    return device_target(device)[1]


class LaunchShape(NamedTuple):
    """What one batch layout launches (:func:`launch_shape`): tiles, row blocks, split count, grids, warps."""

    config: DecodeConfig
    block_q: int
    num_splits: int
    split_grid: tuple   # (query row blocks, num_splits, batch x kv_heads)
    merge_grid: tuple   # (batch x kv_heads, stage 2's query row blocks)
    merge_warps: int
    merge_block_q: int


def launch_shape(batch: int, kv_heads: int, rows: int, keys: int, head_dim: int, head_dim_v: int, dtype, *,
                 paged: bool, capability=None, sms=None, span: int | None = None,
                 num_splits: int | None = None, config: DecodeConfig | None = None) -> LaunchShape:
    """The launches of a layout: ``rows`` stacked query rows per (sequence, kv head), ``keys`` positions a
    sequence can hold (its capacity), capability and sms the target's (None: the interpreter's);
    num_splits None: :func:`choose_num_splits`, for ``span``, the most keys a sequence's queries see
    together (flashlib.rules.key_span; None: all ``keys``)."""
    config = config or decode_config(head_dim, dtype, capability, head_dim_v=head_dim_v, paged=paged)
    block_q = row_block(rows, head_dim_v, capability)
    row_blocks = -(-rows // block_q)
    if num_splits is None:
        num_splits = choose_num_splits(batch * kv_heads * row_blocks, keys if span is None else min(span, keys), sms)
    num_splits = min(num_splits, max(1, -(-keys // config.block_k)))  # splits past the last tile are empty
    # stage 2's: stage 1's rule with no tensor cores to use (64 x 512 float32 spills at 8 warps on sm_90 too)
    merge_block_q = row_block(rows, head_dim_v)
    return LaunchShape(config, block_q, num_splits, (row_blocks, num_splits, batch * kv_heads),
                       (batch * kv_heads, -(-rows // merge_block_q)), merge_warps(head_dim_v), merge_block_q)


def default_num_splits(q, k_cache, block_table=None, span: int | None = None, head_dim_v: int = 0) -> int:
    """What ``num_splits=None`` gives for these inputs (:func:`launch_shape`), for the most keys the queries see:
    the cache's capacity (no lengths are read on the host) or ``span``."""
    batch, q_heads, new_tokens, d = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache.shape[2] * (block_table.shape[1] if block_table is not None else 1)
    capability, sms = device_target(q.device)
    return launch_shape(batch, kv_heads, q_heads // kv_heads * new_tokens, keys, d, head_dim_v or d, q.dtype,
                        paged=block_table is not None, capability=capability, sms=sms, span=span).num_splits


def values_in_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether v_cache is a view of k_cache's leading columns (absorbed MLA's ``kv_cache[..., :512]`` of a
    576-wide latent cache): one storage and start, the same strides and leading sizes, a last dim no wider.
    Then stage 1 reads each cached row once (V_FROM_K), the value tile the key tile's first columns."""
    same_storage = v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
    return (same_storage and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_cache.shape[:-1] == k_cache.shape[:-1] and v_cache.shape[-1] <= k_cache.shape[-1]
            and k_cache.stride(-1) == 1)


def merge_warps(head_dim_v: int) -> int:
    """Stage 2's warps: 4, or 8 where the values are wider than 256 (a 32 x 512 float32 accumulator and
    a partial beside it spill at 4 warps; data/bench/LOG.md 2026-12-02)."""
    return 4 if head_dim_v <= 256 else 8


class DecodeLaunch:
    """Both stages for one layout of inputs, prepared once (the launch shape, every argument but the per-call
    tensors, the scratch buffers, the output): a call launches the kernels and nothing else (no allocation,
    no synchronisation, no value read on the host: a CUDA graph can capture it), on tensors of that layout.

    q (batch, q_heads, new_tokens, d); k_cache, v_cache (batch, kv_heads, capacity, d and dv), or paged with
    block_table, last dims contiguous; options: the call's; score: its score function compiled
    (:func:`flashlib.kernels.function.kernel_score`); config: stage 1's tiles (default :func:`decode_config`);
    new_tokens, starts (batch,) int32: each sequence's new tokens and first position (default q's, 0).
    ``stacked``: a cascade's shared prefix's pass, stage 1 alone over the prefix (k_cache (1, kv_heads,
    prefix_len, d)), its query rows every sequence's rows of a kv head; ``prefix``: such a launch, to merge in.
    """

    def __init__(self, q, k_cache, v_cache, *, options: Options, score=None, block_table=None, num_splits=None,
                 config: DecodeConfig | None = None, new_tokens=None, starts=None, stacked: bool = False,
                 prefix: "DecodeLaunch | None" = None):
        batch, q_heads, n, d = q.shape
        kv_heads, dv = k_cache.shape[1], v_cache.shape[-1]
        rows = q_heads // max(kv_heads, 1) * n
        self.empty, self._merge = q.numel() == 0, not stacked
        self.copies = []  # (buffer, tensor): what the kernels read from a copy, made again by refresh()
        self.out = q.new_zeros(batch, q_heads, n, dv) if self.empty else q.new_empty(batch, q_heads, n, dv)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        if self.empty:  # no batch, heads or new tokens: zeros and -inf, no launch
            return
        paged = block_table is not None
        if paged and k_cache.shape[2] * max(k_cache.stride(2), v_cache.stride(2)) >= 2 ** 31:
            raise ValueError(f"{DECODE_FN}: a page of 'k_cache' spans {k_cache.shape[2]} x {k_cache.stride(2)} "
                             "elements, past the kernels' int32 offsets within a page; use smaller pages")
        keys = k_cache.shape[2] * (block_table.shape[1] if paged else 1)
        options = options.window_within(keys + n)  # exact: a window as wide as the cache limits nothing
        launches, self.rows = (1, batch * rows) if stacked else (batch, rows)  # sequences and rows launched
        capability, sms = device_target(q.device)
        self.shape = launch_shape(launches, kv_heads, self.rows, keys, d, dv, q.dtype, paged=paged, capability=capability,
                                  sms=sms, span=key_span(options.visibility, keys, n), num_splits=num_splits,
                                  config=config)
        splits, block_q, cfg = self.shape.num_splits, self.shape.block_q, self.shape.config
        # q's rows as stage 1 reads them, (batch, kv_heads, rows, d) with rows = a kv head's query heads x new
        # tokens; a q whose strides allow no such view is copied into a buffer of this launch's at every call
        self._q_view = (batch * kv_heads, rows, d) if not stacked else (batch, kv_heads, rows, d)
        self._q_copy = None if _viewed(q, self._q_view) else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        view = (q if self._q_copy is None else self._q_copy).view(self._q_view)
        q_strides = (view.stride(1), view.stride(0), view.stride(2)) if stacked else (view.stride(0), 0, view.stride(1))
        self.partial = torch.empty(launches * kv_heads * splits, self.rows, dv, dtype=torch.float32, device=q.device)
        self.partial_ml = torch.empty(launches * kv_heads * splits, self.rows, 2, dtype=torch.float32, device=q.device)
        self._out_rows_shape = (batch * kv_heads, rows, dv)
        self._out_rows, self._lse_rows = self.out.view(self._out_rows_shape), self.lse.view(batch * kv_heads, rows)
        new_tokens = torch.full((launches,), n, dtype=torch.int32, device=q.device) if new_tokens is None else new_tokens
        starts = torch.zeros(launches, dtype=torch.int32, device=q.device) if starts is None else starts
        shared = values_in_keys(k_cache, v_cache)
        # the rule, whatever it is (its sides read at run time: one kernel for every window), and the strides of q
        # (sequence, stack, row), the caches (block, head, row) and the partials (part, row), one tuple each
        self._split_args = (options.scale * LOG2E, options.scale, int(options.visibility.causal),
                            mask_bundle(options, always=True), q_strides, k_cache.stride()[:3], v_cache.stride()[:3],
                            block_table.stride(0) if paged else 0, self.partial.stride()[:2], kv_heads, splits,
                            self.rows, rows, n, d, dv)
        # V_FROM_K: HEAD_DIM_PAD pads the key's own columns, past the dv it shares with the values
        self._split_kw = dict(
            PAGE_SIZE=k_cache.shape[2] if paged else 1, HEAD_DIM_PAD=head_dim_pad(d - dv) if shared else head_dim_pad(d),
            HEAD_DIM_V_PAD=head_dim_pad(dv), BLOCK_Q=block_q, BLOCK_K=cfg.block_k,
            KEY_ROWS=_paged_rows if paged else _contiguous_rows, INPUT_PRECISION="tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, V_FROM_K=shared, score=score_bundle(score))
        # grid axis 2, batch x kv_heads, takes at most 65,535 on CUDA (rules.row_runs): a larger batch launches in
        # runs of whole sequences, each on views of what stage 1 indexes by sequence
        self._runs = []
        for run in row_runs(launches * kv_heads, kv_heads):
            seqs = slice(run.start // kv_heads, run.stop // kv_heads)
            parts = slice(run.start * splits, run.stop * splits)
            self._runs.append(((self.shape.split_grid[0], splits, run.stop - run.start), run, seqs, self.partial[parts],
                               self.partial_ml[parts], new_tokens[seqs], starts[seqs]))
        check_grid(DECODE_FN, self._runs[0][0], q.device, ("query row blocks (query heads per kv head x new tokens)",
                                                           "num_splits", "batch x kv_heads"))  # the largest run
        self.copies = copied(score) if score is not None else []
        extra = self._merge_inputs(options.sinks, prefix, batch)
        self._merge_tail = (self.partial.stride(0), self.partial.stride(1), self._out_rows.stride(0),
                            self._out_rows.stride(1), splits, rows, dv)
        self._merge_kw = dict(HEAD_DIM_PAD=head_dim_pad(dv), BLOCK_Q=self.shape.merge_block_q,
                              num_warps=self.shape.merge_warps, num_stages=1, KV_HEADS=kv_heads, NEW_TOKENS=n, **extra)

    def _merge_inputs(self, sinks, prefix, batch) -> dict:
        """What the merge reads besides the partials: the sinks and a cascade's prefix pass."""
        extra = {}
        if sinks is not None:  # float32 contiguous, as the merge reads them: in place, or a copy
            extra["Sinks"] = read = sinks.detach().to(torch.float32).contiguous()
            if read.data_ptr() != sinks.data_ptr():
                self.copies.append((read, sinks))
        if prefix is not None:
            extra.update(Prefix=prefix.partial, PrefixML=prefix.partial_ml, stride_xz=prefix.partial.stride(0),
                         stride_xr=prefix.partial.stride(1), PREFIX_SPLITS=prefix.shape.num_splits, BATCH=batch)
        return extra

    def refresh(self):
        """Copy again, into the same buffers, what the kernels read from a copy (:attr:`copies`: a score
        function's int64 tensors narrowed to int32, sinks that are not float32 contiguous), so that a
        launch reads their values now; no allocation (a CUDA graph can capture it)."""
        with torch.no_grad():  # sinks a model trains: the copy is no part of its graph
            for buffer, tensor in self.copies:
                buffer.copy_(tensor)

    def __call__(self, q, k_cache, v_cache, seqlens, block_table=None, out=None):
        """Launch both stages (a prefix's pass: stage 1 alone, returning None); seqlens (batch,) int32 contiguous.
        Returns out (batch, q_heads, new_tokens, dv) in q's dtype (``out``, or this launch's buffer, which the
        next call overwrites) and lse (batch, q_heads, new_tokens) float32, natural log (this launch's buffer)."""
        if self.empty:
            return self.out, self.lse
        if self._q_copy is not None:
            q = self._q_copy.copy_(q)
        for kernel, grid, args, kwargs in self.bound(q, k_cache, v_cache, seqlens, block_table, out):
            kernel[grid](*args, **kwargs)
        return ((self.out if out is None else out), self.lse) if self._merge else None

    def bound(self, q, k_cache, v_cache, seqlens, block_table=None, out=None) -> list:
        """What a call launches on these tensors (q of a layout that needs no copy), as [(kernel, grid, args,
        kwargs)]: stage 1 per run of sequences, then the merge; to inspect the launches, or to time them bare."""
        table = seqlens if block_table is None else block_table  # not read by _contiguous_rows
        launches = []
        for grid, run, seqs, partial, partial_ml, new_tokens, starts in self._runs:
            q_run, k_run, v_run, lens, table_run = q, k_cache, v_cache, seqlens, table
            if len(self._runs) > 1:  # views of what the kernel indexes by sequence
                q_run, lens, table_run = q.view(self._q_view)[run], seqlens[seqs], table[seqs]
                if block_table is None:
                    k_run, v_run = k_cache[seqs], v_cache[seqs]
            launches.append((_decode_split, grid, (q_run, k_run, v_run, partial, partial_ml, (lens, new_tokens, starts),
                                                   table_run, *self._split_args), self._split_kw))
        if self._merge:
            out_rows = self._out_rows if out is None else out.view(self._out_rows_shape)
            launches.append((_decode_merge, self.shape.merge_grid, (self.partial, self.partial_ml, out_rows,
                                                                    self._lse_rows, *self._merge_tail), self._merge_kw))
        return launches


def _viewed(t: torch.Tensor, shape) -> bool:
    """Whether t views as shape with its last dim contiguous."""
    try:
        return t.stride(-1) == 1 and t.view(shape) is not None
    except RuntimeError:
        return False


def as_kernels_read(batch):
    """A call's tensors (:class:`flashlib.kvcache.Batch`) as stage 1 reads them: the caches' last dims, the
    block table and each sequence's seqlens, new_tokens and starts (int32) contiguous (views like t[::2] copied)."""
    k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (batch.k_cache, batch.v_cache))
    table = None if batch.block_table is None else batch.block_table.contiguous()
    return batch._replace(k_cache=k_cache, v_cache=v_cache, block_table=table, **{
        name: getattr(batch, name).to(torch.int32).contiguous() for name in ("seqlens", "new_tokens", "starts")})
