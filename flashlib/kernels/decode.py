"""Split-KV decoding (Flash-Decoding) in two kernels, in the words of notebook 06's forward.

Decoding has a few query rows per sequence and a long cache. FlashAttention-2's schedule (one
program per query block) would launch batch x kv_heads programs, 8 for one sequence of a model
with 8 kv heads, on a GPU with 132 multiprocessors. So the cache is cut into chunks as well:

    stage 1, ``_decode_split``   grid (num_splits, batch * kv_heads, row blocks): each program
        streams its chunk of one sequence's cache past its query rows, keeping (m_i, l_i, acc)
        as ``_attn_fwd`` does, and writes a partial output and its log-sum-exp (float32);
    stage 2, ``_decode_merge``   grid (batch * kv_heads, row blocks): folds the splits'
        partials into the output with notebook 02's merge (each partial is a state whose
        max is its lse and whose denominator is 1), starting from the attention sinks' state
        where there are sinks (a partial with no value).

Grouped-query attention: the q_heads // kv_heads query heads that share a kv head, and their
new tokens, are stacked into the rows of one query block, (batch * kv_heads, group * new_tokens,
head_dim), so every cached key and value is read once per kv head, not once per query head.
Row r is the query of new token r % new_tokens.

Where a position's key lives is a compile-time function argument, ``KEY_ROWS``: returning, for
each position of a tile, its block of the cache and its row in that block. ``_contiguous_rows``:
block b (the sequence), row j; ``_paged_rows``: block table[b, j // PAGE_SIZE], row j % PAGE_SIZE.
The rest of the kernel is the same for both caches.

Values may have a head dim of their own (HEAD_DIM_V: MLA's). Absorbed MLA keeps one latent cache
whose first HEAD_DIM_V columns are the values too; the launcher sees v_cache as a view of k_cache's
leading columns (:func:`values_in_keys`) and passes V_FROM_K, so each cached row is loaded once, in
two pieces: [value columns | the key's own], q split the same way and the two dots summed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_grid
from ..options import Options
from ._mode import interpreting
from .config import LOG2E, head_dim_pad, lse_natural
from .forward import _finish, _finite, _load_rows, _online_update, _scores, triton
from .rules import _band, _batch_head, _key_range, _mod_scores, _sink_state, _stacked_head, _visible, row_chunks
from .scorefn import score_args

import triton.language as tl  # noqa: E402  (after forward: it chose the interpreter mode)

DECODE_FN = "decode_attention"
MAX_BLOCK_Q = 64
# The split rule (choose_num_splits): about two programs per streaming multiprocessor, each
# reading at least MIN_KEYS_PER_SPLIT keys (shorter chunks spend more on their partial output
# and its merge than they save), and never more than MAX_SPLITS partial outputs to merge.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2


# ----- stage 1: one chunk of the cache per program -----------------------------------------------

@triton.jit
def _contiguous_rows(Table, stride_table, off_b, offs_k, valid, PAGE_SIZE):
    """Contiguous cache (batch, kv_heads, capacity, d): position j of sequence b is row j of block b."""
    return tl.zeros_like(offs_k).to(tl.int64) + off_b, offs_k


@triton.jit
def _paged_rows(Table, stride_table, off_b, offs_k, valid, PAGE_SIZE):
    """Paged cache (num_pages, kv_heads, PAGE_SIZE, d): position j of sequence b is row j % PAGE_SIZE
    of page Table[b, j // PAGE_SIZE]."""
    page = tl.load(Table + off_b.to(tl.int64) * stride_table + offs_k // PAGE_SIZE, mask=valid, other=0)
    return page.to(tl.int64), offs_k % PAGE_SIZE  # int64: pages x their size can pass 2^31 elements


@triton.jit
def _load_cache_rows(Ptr, stride_block, stride_row, blocks, rows, valid, offs_d, HEAD_DIM):
    """A (BLOCK_K, HEAD_DIM_PAD) tile gathered row by row; invalid rows and the pad read as 0."""
    rows = rows[:, None].to(tl.int64) * stride_row  # int64: a row stride times a row can pass 2^31
    ptrs = Ptr + blocks[:, None] * stride_block + rows + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _split_range(split, NUM_SPLITS, seqlen, new_tokens, start, window_left, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi) of this split: the keys any row can see, [first, seqlen), cut into NUM_SPLITS
    chunks of whole tiles (flashlib.decode.split_bounds with block = BLOCK_K). The new tokens are the
    last new_tokens queries of the cache, so the rule is the forward's with seq_q = new_tokens,
    seq_k = seqlen: the first row's key range under the window's left side, and none before the
    sequence's start (its left padding); the last row sits at seqlen - 1, so every split ends by seqlen."""
    first, _ = _key_range(0, new_tokens, seqlen, window_left, -1, 1, BLOCK_K, False, True)
    first = tl.maximum(first, start // BLOCK_K * BLOCK_K)
    chunk = tl.cdiv(tl.cdiv(seqlen - first, NUM_SPLITS), BLOCK_K) * BLOCK_K
    k_lo = tl.minimum(first + split * chunk, seqlen)
    return k_lo, tl.minimum(k_lo + chunk, seqlen)


@triton.jit
def _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal, window_left,
                    window_right):
    """(BLOCK_Q, BLOCK_K) pairs that exist and may attend: row r is the query of new token
    r % NEW_TOKENS (the rows' stride; this sequence has new_tokens of them, the rest are padding),
    which sees the keys of this split by the forward's rule with seq_q = new_tokens and seq_k =
    seqlen: up to its own position if causal (a runtime flag: decoding is bound by memory, not by
    this test), inside its window, and from the sequence's start (its left padding) on."""
    tok = offs_r % NEW_TOKENS  # (BLOCK_Q,) each row's new token
    visible = tl.where(causal != 0, _visible(tok, offs_k, new_tokens, seqlen, True),
                       _visible(tok, offs_k, new_tokens, seqlen, False))
    visible = visible & _band(tok, offs_k, new_tokens, seqlen, window_left, window_right) & (offs_k[None, :] >= start)
    return visible & (offs_r[:, None] < ROWS) & (offs_k[None, :] < k_hi)


@triton.jit
def _shared_scores(q_blk, q_own, v_tile, k_own, qk_scale, visible, INPUT_PRECISION: tl.constexpr, scale, off_b,
                   off_h, q_idx, kv_idx, ScoreData, SCORE_MOD: tl.constexpr):
    """_scores for a key tile held in two pieces, [shared | own]: q.k = q_blk.v_tileᵀ + q_own.k_ownᵀ, the
    columns the values share and the key's own (MLA's latent 512 and rope 64)."""
    x = tl.dot(q_blk, tl.trans(v_tile), input_precision=INPUT_PRECISION)
    x = tl.dot(q_own, tl.trans(k_own), x, input_precision=INPUT_PRECISION)
    s = _mod_scores(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, ScoreData, SCORE_MOD)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _decode_inner(m_i, l_i, acc, q_blk, q_own, K, V, Table, stride_table, off_b, stride_kb, stride_kn,
                  stride_vb, stride_vn, offs_r, offs_d, offs_dv, k_lo, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen,
                  start, causal, window_left, window_right, qk_scale, scale, heads, positions, ScoreData, HEAD_DIM,
                  HEAD_DIM_V, PAGE_SIZE, BLOCK_K: tl.constexpr, KEY_ROWS: tl.constexpr, SCORE_MOD: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, V_FROM_K: tl.constexpr):
    """Fold every key/value tile of [k_lo, k_hi) into (m_i, l_i, acc); q_blk stays in registers. heads,
    positions (BLOCK_Q, 1): each row's query head and position in its sequence, for SCORE_MOD (a
    key's position in its sequence is its cache position less the sequence's start). V_FROM_K: the
    values are the keys' first HEAD_DIM_V columns (absorbed MLA), so each key row is read once, as
    two pieces, the shared columns (the value tile, against q_blk) and the key's own (offs_d, from
    column HEAD_DIM_V, against q_own); else K (offs_d) and V (offs_dv) are read apart, q_own unused."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid = offs_k < k_hi
        blocks, rows = KEY_ROWS(Table, stride_table, off_b, offs_k, valid, PAGE_SIZE)
        if V_FROM_K:  # one read of each key row: its first HEAD_DIM_V columns are its value
            v_tile = _load_cache_rows(K, stride_kb, stride_kn, blocks, rows, valid, offs_dv, HEAD_DIM_V)
            k_own = _load_cache_rows(K + HEAD_DIM_V, stride_kb, stride_kn, blocks, rows, valid, offs_d,
                                     HEAD_DIM - HEAD_DIM_V)
            visible = _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal,
                                      window_left, window_right)
            s = _shared_scores(q_blk, q_own, v_tile, k_own, qk_scale, visible, INPUT_PRECISION, scale, off_b,
                               heads, positions, offs_k[None, :] - start, ScoreData, SCORE_MOD)
        else:
            k_tile = _load_cache_rows(K, stride_kb, stride_kn, blocks, rows, valid, offs_d, HEAD_DIM)
            v_tile = _load_cache_rows(V, stride_vb, stride_vn, blocks, rows, valid, offs_dv, HEAD_DIM_V)
            visible = _decode_visible(offs_r, offs_k, k_hi, ROWS, NEW_TOKENS, new_tokens, seqlen, start, causal,
                                      window_left, window_right)
            s = _scores(q_blk, k_tile, qk_scale, visible, INPUT_PRECISION, scale, off_b, heads, positions,
                        offs_k[None, :] - start, ScoreData, SCORE_MOD)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_split(Q, K, V, Partial, PartialML, SeqLens, NewTokens, Starts, Table, qk_scale, scale, causal,
                  window_left, window_right,
                  stride_qz, stride_qr, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                  stride_table, stride_pz, stride_pr, KV_HEADS, NUM_SPLITS, ROWS, NEW_TOKENS, HEAD_DIM, HEAD_DIM_V,
                  PAGE_SIZE, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, KEY_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  SCORE_MOD: tl.constexpr = None, ScoreData=None, V_FROM_K: tl.constexpr = False):
    """Q: (batch * kv_heads, ROWS, HEAD_DIM), a kv head's query heads and new tokens stacked;
    K, V: caches (blocks, kv_heads, rows per block, HEAD_DIM and HEAD_DIM_V); Partial: (batch * kv_heads *
    NUM_SPLITS, ROWS, HEAD_DIM_V) float32, each split's normalised output; PartialML: (batch * kv_heads *
    NUM_SPLITS, ROWS, 2) float32, its rows' base-2 max m and denominator l. SeqLens, NewTokens, Starts:
    (batch,) int32, each sequence's valid positions (its new tokens included), its new tokens (at most
    NEW_TOKENS, the rows' stride) and its first position (left padding before it is never seen).
    V_FROM_K: V is K's first HEAD_DIM_V columns (absorbed MLA's latent cache), read with the keys; then
    HEAD_DIM_PAD pads the key's own columns, HEAD_DIM - HEAD_DIM_V (the rope's), not HEAD_DIM."""
    split = tl.program_id(0)
    off_z = tl.program_id(1).to(tl.int64)  # batch * KV_HEADS + kv head; int64: offsets from it can pass 2^31
    q0 = tl.program_id(2) * BLOCK_Q
    off_b, kv_head = _batch_head(off_z, KV_HEADS, 0)
    seqlen = tl.load(SeqLens + off_b)
    new_tokens = tl.load(NewTokens + off_b)
    start = tl.load(Starts + off_b)
    offset = seqlen - new_tokens  # cache position of the first new token (< 0: rows before 0 see nothing)
    k_lo, k_hi = _split_range(split, NUM_SPLITS, seqlen, new_tokens, start, window_left, BLOCK_K)
    Q += off_z * stride_qz
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    offs_r = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    if V_FROM_K:  # q = [q_blk | q_own], against the columns the values share and the key's own
        q_blk = _load_rows(Q, stride_qr, offs_r, offs_dv, ROWS, HEAD_DIM_V)
        q_own = _load_rows(Q + HEAD_DIM_V, stride_qr, offs_r, offs_d, ROWS, HEAD_DIM - HEAD_DIM_V)
    else:
        q_blk = _load_rows(Q, stride_qr, offs_r, offs_d, ROWS, HEAD_DIM)
        q_own = q_blk  # not read
    # what a score function is told of each row: its query head and its position in the sequence
    heads = _stacked_head(kv_head, offs_r, ROWS, NEW_TOKENS)[:, None]
    positions = (offset - start + offs_r % NEW_TOKENS)[:, None]

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_V_PAD], dtype=tl.float32)
    m_i, l_i, acc = _decode_inner(m_i, l_i, acc, q_blk, q_own, K, V, Table, stride_table, off_b, stride_kb,
                                  stride_kn, stride_vb, stride_vn, offs_r, offs_d=offs_d, offs_dv=offs_dv, k_lo=k_lo,
                                  k_hi=k_hi, ROWS=ROWS,
                                  NEW_TOKENS=NEW_TOKENS, new_tokens=new_tokens, seqlen=seqlen, start=start,
                                  causal=causal, window_left=window_left, window_right=window_right, qk_scale=qk_scale,
                                  scale=scale, heads=heads, positions=positions, ScoreData=ScoreData,
                                  HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, PAGE_SIZE=PAGE_SIZE, BLOCK_K=BLOCK_K,
                                  KEY_ROWS=KEY_ROWS, SCORE_MOD=SCORE_MOD, INPUT_PRECISION=INPUT_PRECISION,
                                  V_FROM_K=V_FROM_K)

    out, _ = _finish(m_i, l_i, acc)  # an empty chunk: out = 0, m = -inf, l = 0, a weight of 0 in the merge
    part = off_z * NUM_SPLITS + split
    o_mask = (offs_r[:, None] < ROWS) & (offs_dv[None, :] < HEAD_DIM_V)
    rows = offs_r[:, None].to(tl.int64) * stride_pr
    tl.store(Partial + part * stride_pz + rows + offs_dv[None, :], out, mask=o_mask)
    # the split's state as notebook 02 merges two: its max and denominator, not their lse, whose ulp
    # at scores near 72 (base 2) is 8e-6, an error every split's weight would carry into the merge
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
def _decode_merge(Partial, PartialML, Out, Lse, stride_pz, stride_pr, stride_oz, stride_or,
                  NUM_SPLITS, ROWS, HEAD_DIM, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  Sinks=None, KV_HEADS=1, NEW_TOKENS=1):
    """Out: (batch * kv_heads, ROWS, HEAD_DIM) in q's dtype, HEAD_DIM the values' (as Partial's);
    Lse: (batch * kv_heads, ROWS) float32;
    Sinks: (q_heads,) attention sinks or None (row r of kv head h belongs to query head
    h * ROWS // NEW_TOKENS + r // NEW_TOKENS)."""
    off_z = tl.program_id(0).to(tl.int64)  # int64: offsets from it can pass 2^31
    offs_r = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    _, kv_head = _batch_head(off_z, KV_HEADS, 0)
    heads = _stacked_head(kv_head, tl.minimum(offs_r, ROWS - 1), ROWS, NEW_TOKENS)
    m_i, l_i = _sink_state(Sinks, heads)  # (-inf, 0) without sinks
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    for split in range(0, NUM_SPLITS):
        part = off_z * NUM_SPLITS + split
        stats = PartialML + (part * ROWS + offs_r) * 2
        m_s = tl.load(stats, mask=offs_r < ROWS, other=float("-inf"))
        l_s = tl.load(stats + 1, mask=offs_r < ROWS, other=0.0)
        out_s = _load_rows(Partial + part * stride_pz, stride_pr, offs_r, offs_d, ROWS, HEAD_DIM)
        m_i, l_i, acc = _merge_partial(m_i, l_i, acc, m_s, l_s, out_s)
    out, lse = _finish(m_i, l_i, acc)
    Out += off_z * stride_oz
    o_mask = (offs_r[:, None] < ROWS) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_r[:, None].to(tl.int64) * stride_or
    tl.store(Out + rows + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(Lse + off_z * ROWS + offs_r, lse, mask=offs_r < ROWS)


# ----- the launcher ---------------------------------------------------------------------------

class DecodeConfig(NamedTuple):
    """Stage 1's launch: BLOCK_K keys per tile, warps, pipeline stages (stage 2: :func:`merge_warps`, 1 stage)."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


# absorbed MLA's widths (576 / 512), measured by tests/decode_compile.py (data/bench/LOG.md, 2026-12-02)
WIDE_CONFIG = DecodeConfig(32, 8, 3)


def decode_config(head_dim: int, dtype: torch.dtype, capability=None, head_dim_v: int | None = None) -> DecodeConfig:
    """The shipped tiles: about 32 KB of K and V per tile (memory-bound: bytes in flight are what
    count), three stages from sm_80 on (96 KB of shared memory at most), two on sm_75 (64 KB), with
    8 warps there (4 spilled registers at head dim 64 with a soft-cap). Head dims past 256 (absorbed
    MLA's 576 for q and k, head_dim_v 512): :data:`WIDE_CONFIG`, the accumulator alone (BLOCK_Q x 512
    float32) needing eight warps."""
    if capability is None:  # the interpreter: tiles small enough that short test caches span several
        return DecodeConfig(32, 4, 1)
    if max(head_dim, head_dim_v or head_dim) > 256:
        return WIDE_CONFIG
    per_tile = 128 if head_dim_pad(head_dim) <= 64 else 64 if head_dim_pad(head_dim) <= 128 else 32
    if dtype == torch.float32:
        per_tile //= 2
    if tuple(capability) < (8, 0):
        return DecodeConfig(max(16, per_tile // 2), 8, 2)
    return DecodeConfig(per_tile, 4, 3)


def choose_num_splits(programs: int, keys: int, sm_count: int | None) -> int:
    """The number of splits ``num_splits=None`` picks.

    programs: the programs one split launches (batch x kv_heads x query row blocks); keys: the
    longest span a query can see (the cache's capacity, or the window's); sm_count: the GPU's
    streaming multiprocessors, None for Triton's CPU interpreter (which runs programs one at a
    time, so splitting gains nothing there: 1). On a GPU, enough splits for about
    PROGRAMS_PER_SM programs per multiprocessor, no more than keys / MIN_KEYS_PER_SPLIT, at most
    MAX_SPLITS:

        num_splits = clamp(min(ceil(2 * sm_count / programs), ceil(keys / 256)), 1, 64)

    e.g. an H200 (132 multiprocessors), 8 kv heads, one query row block, 64k keys: batch 1
    gives 33 splits (264 programs), batch 8 gives 5 (320 programs).
    """
    if sm_count is None or programs < 1:
        return 1
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    return max(1, min(wanted, -(-keys // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def default_num_splits(q, k_cache, block_table=None, window_left: int = -1, head_dim_v: int = 0) -> int:
    """What ``num_splits=None`` gives for these inputs (:func:`choose_num_splits`): the programs of
    one split, batch x kv_heads x row blocks, and the longest span a query can see, the cache's
    capacity (no lengths are read on the host) or the window's."""
    batch, q_heads, new_tokens, _ = q.shape
    kv_heads = k_cache.shape[1]
    rows = q_heads // kv_heads * new_tokens
    keys = k_cache.shape[2] * (block_table.shape[1] if block_table is not None else 1)
    if window_left >= 0:
        keys = min(keys, window_left + new_tokens)
    programs = batch * kv_heads * -(-rows // row_block(rows, head_dim_v))
    return choose_num_splits(programs, keys, sm_count(q.device))


def row_block(rows: int, head_dim_v: int = 0) -> int:
    """BLOCK_Q for ``rows`` stacked query rows: a power of two, >= 16 (tl.dot's minimum), <= 64, or <= 32
    where the values are wider than 256 (absorbed MLA's 512: a 64 x 512 float32 accumulator spills on
    sm_80 at any warp count, data/bench/LOG.md 2026-12-02)."""
    most = MAX_BLOCK_Q if head_dim_v <= 256 else MAX_BLOCK_Q // 2
    return min(most, max(16, 1 << max(rows - 1, 0).bit_length()))


_SM_COUNTS: dict = {}


def sm_count(device: torch.device):
    """Streaming multiprocessors of a CUDA device (cached); None for the interpreter's CPU tensors."""
    if device.type != "cuda" or interpreting():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def values_in_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether v_cache is a view of k_cache's leading columns (absorbed MLA: ``v_cache =
    kv_cache[..., :512]`` of a 576-wide latent cache): one storage, one start, the same strides and
    leading sizes, a last dim no wider. Then stage 1 reads each cached row once (V_FROM_K): the
    value tile is the key tile's first columns."""
    same_storage = v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
    return (same_storage and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_cache.shape[:-1] == k_cache.shape[:-1] and v_cache.shape[-1] <= k_cache.shape[-1]
            and k_cache.stride(-1) == 1)


def _contiguous_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_offsets(q_rows, k_cache, v_cache, block_table, num_splits, block_q):
    """The grid's limits on a CUDA GPU (the kernels compute their element offsets in int64; batch x
    kv_heads, on axis 1, is launched in runs that fit)."""
    bz, rows, d = q_rows.shape
    check_grid(DECODE_FN, (num_splits, 1, triton.cdiv(rows, block_q)), q_rows.device,
               ("num_splits", "batch x kv_heads", "query row blocks (query heads per kv head x new tokens)"))


class Sequences(NamedTuple):
    """Where each sequence of a decoding batch stands, (batch,) int32 contiguous each, as stage 1 reads it:
    its valid positions (its new tokens included), its new tokens (up to q's new_tokens, the rows'
    stride: fewer in a mixed batch) and its first position (keys before it, left padding, are not seen)."""

    seqlens: torch.Tensor
    new_tokens: torch.Tensor
    starts: torch.Tensor

    def __getitem__(self, index):
        if isinstance(index, slice):  # a run of sequences: each tensor's slice
            return Sequences(*(t[index] for t in self))
        return tuple.__getitem__(self, index)


def uniform_sequences(cache_seqlens, new_tokens: int) -> Sequences:
    """Every sequence with ``new_tokens`` new tokens and no left padding."""
    lengths = cache_seqlens.to(torch.int32).contiguous()
    return Sequences(lengths, torch.full_like(lengths, new_tokens), torch.zeros_like(lengths))


def _launch_split(q_rows, k_cache, v_cache, sequences: Sequences, block_table, partial, partial_ml, options: Options,
                  score, new_tokens, num_splits, block_q, cfg, input_precision):
    """Stage 1 on q_rows (batch * kv_heads, rows, d); fills partial and partial_ml. Grid axis 1 holds
    batch x kv_heads and CUDA takes at most 65,535 (rules.row_chunks): a larger batch is launched in
    runs of whole sequences, on views of what the kernel indexes by sequence (its queries, lengths,
    block table or contiguous cache, and partials). options: the call's (flashlib.options: its causal
    rule, scale and window are read here); score: its score function compiled, or None."""
    bz, rows, d = q_rows.shape
    kv_heads, dv = k_cache.shape[1], v_cache.shape[-1]
    paged = block_table is not None
    left, right = options.window
    shared = values_in_keys(k_cache, v_cache)
    # V_FROM_K: HEAD_DIM_PAD pads the key's own columns, past the dv it shares with the values
    pad = head_dim_pad(d - dv) if shared else head_dim_pad(d)
    for run in row_chunks(bz, kv_heads):
        seqs = slice(run.start // kv_heads, run.stop // kv_heads)
        parts = slice(run.start * num_splits, run.stop * num_splits)
        at = sequences[seqs]
        table = block_table[seqs] if paged else at.seqlens  # not read by _contiguous_rows
        k_run, v_run = (k_cache, v_cache) if paged else (k_cache[seqs], v_cache[seqs])
        grid = (num_splits, run.stop - run.start, triton.cdiv(rows, block_q))
        _decode_split[grid](q_rows[run], k_run, v_run, partial[parts], partial_ml[parts], *at, table,
                            options.scale * LOG2E, options.scale, int(options.causal), left, right,
                            q_rows.stride(0), q_rows.stride(1), k_cache.stride(0),
                            k_cache.stride(1), stride_kn=k_cache.stride(2), stride_vb=v_cache.stride(0),
                            stride_vh=v_cache.stride(1), stride_vn=v_cache.stride(2),
                            stride_table=table.stride(0) if paged else 0, stride_pz=partial.stride(0),
                            stride_pr=partial.stride(1), KV_HEADS=kv_heads, NUM_SPLITS=num_splits, ROWS=rows,
                            NEW_TOKENS=new_tokens, HEAD_DIM=d, HEAD_DIM_V=dv, PAGE_SIZE=k_cache.shape[2],
                            HEAD_DIM_PAD=pad, HEAD_DIM_V_PAD=head_dim_pad(dv), BLOCK_Q=block_q, BLOCK_K=cfg.block_k,
                            KEY_ROWS=_paged_rows if paged else _contiguous_rows, INPUT_PRECISION=input_precision,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, V_FROM_K=shared, **score_args(score))


def merge_warps(head_dim_v: int) -> int:
    """Stage 2's warps: 4, or 8 where the values are wider than 256 (a 32 x 512 float32 accumulator and
    a partial beside it spill at 4 warps; data/bench/LOG.md 2026-12-02)."""
    return 4 if head_dim_v <= 256 else 8


def _launch_merge(partial, partial_ml, out, lse, num_splits, block_q, options: Options, kv_heads=1, new_tokens=1):
    """Stage 2; its grid's batch x kv_heads is on axis 0, which takes 2^31 - 1. The options' sinks
    join as one more partial with no value."""
    bz, rows, d = out.shape
    sinks = options.sinks
    with_sinks = {} if sinks is None else dict(Sinks=sinks.to(torch.float32).contiguous(), KV_HEADS=kv_heads,
                                               NEW_TOKENS=new_tokens)
    _decode_merge[(bz, triton.cdiv(rows, block_q))](
        partial, partial_ml, out, lse, partial.stride(0), partial.stride(1), out.stride(0), out.stride(1),
        num_splits, rows, d, HEAD_DIM_PAD=head_dim_pad(d), BLOCK_Q=block_q, num_warps=merge_warps(d), num_stages=1,
        **with_sinks)


def decode_forward(q, k_cache, v_cache, cache_seqlens, *, options: Options, score=None, block_table=None,
                   num_splits: int | None = None, config: DecodeConfig | None = None, input_precision: str = "tf32",
                   sequences: Sequences | None = None):
    """Both stages, on inputs :func:`flashlib.decode_attention` has checked (nothing here reads the
    lengths or the block table on the host, so the call can be captured in a CUDA graph).

    Returns out (batch, q_heads, new_tokens, dv) in q's dtype (dv: v_cache's head dim; a v_cache that
    is a view of k_cache's first dv columns is read with the keys, :func:`values_in_keys`) and lse
    (batch, q_heads, new_tokens) float32. options: the call's (flashlib.options: causal, scale, window, sinks; the sinks merged as
    one more partial with no value); score: its score function compiled
    (:func:`flashlib.kernels.function.kernel_score`: soft-capping is one), told each new token's
    position in its sequence; config: stage 1's tiles (default :func:`decode_config`);
    input_precision: how a float32 ``tl.dot`` multiplies on a GPU ("tf32" or "ieee"); sequences: each
    sequence's new tokens and start where they differ (a mixed batch, left padding), else every
    sequence has q's new_tokens from position 0 (:func:`uniform_sequences` of cache_seqlens)."""
    batch, q_heads, new_tokens, d = q.shape
    kv_heads, dv = k_cache.shape[1], v_cache.shape[-1]
    if q.numel() == 0:  # no batch, heads or new tokens
        return (q.new_zeros(*q.shape[:-1], dv),
                torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))
    rows = q_heads // kv_heads * new_tokens
    # (B, Hq, Nnew, d) -> (B * Hkv, group * Nnew, d): the query heads of a kv head, stacked
    q_rows = _contiguous_last_dim(q.reshape(batch * kv_heads, rows, d))
    k_cache, v_cache = _contiguous_last_dim(k_cache), _contiguous_last_dim(v_cache)
    # the lengths and the block table as the kernels read them: contiguous (views such as t[::2] copied)
    if sequences is None:
        sequences = uniform_sequences(cache_seqlens, new_tokens)
    sequences = Sequences(*(t.to(torch.int32).contiguous() for t in sequences))
    block_table = None if block_table is None else block_table.contiguous()
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    cfg = config or decode_config(d, q.dtype, capability, head_dim_v=dv)
    block_q = row_block(rows, dv)
    if num_splits is None:
        num_splits = default_num_splits(q, k_cache, block_table, options.window[0], dv)
    # exact, and small enough for the kernels' integers: a window as wide as the cache limits nothing,
    # and splits past the cache's last tile would be empty
    keys = k_cache.shape[2] * (block_table.shape[1] if block_table is not None else 1)
    options = options.window_within(keys + new_tokens)
    num_splits = min(num_splits, max(1, triton.cdiv(keys, cfg.block_k)))
    _check_offsets(q_rows, k_cache, v_cache, block_table, num_splits, block_q)
    partial = torch.empty(batch * kv_heads * num_splits, rows, dv, dtype=torch.float32, device=q.device)
    partial_ml = torch.empty(batch * kv_heads * num_splits, rows, 2, dtype=torch.float32, device=q.device)
    _launch_split(q_rows, k_cache, v_cache, sequences, block_table, partial, partial_ml, options, score,
                  new_tokens, num_splits, block_q, cfg, input_precision)
    out = q_rows.new_empty(batch * kv_heads, rows, dv)
    lse = torch.empty(batch * kv_heads, rows, dtype=torch.float32, device=q.device)
    _launch_merge(partial, partial_ml, out, lse, num_splits, block_q, options, kv_heads, new_tokens)
    # base 2 until here
    return out.reshape(*q.shape[:-1], dv), lse_natural(lse).reshape(q.shape[:-1])
