"""The rules the course teaches, written once in Triton: which keys a query sees, score functions
(soft-capping among them) and their slope, and PyTorch's integer division for mask functions; and the two
bundles a launch hands them, its mask side and its score side.

Every kernel asks these helpers; :mod:`flashlib.rules` is their PyTorch counterpart (its ``Visibility``
states the rule; ``tests/test_rules.py`` checks the two). A kernel gets the rule as the compile-time CAUSAL
and, on its mask path, a :class:`MaskBundle`: the mask function MASK_MOD (``_no_mask`` for a window or chunk
alone) with what it reads, the block mask, and one tuple, ``rule = (window left, window right[, chunk])``
(Options.rule_numbers), run-time integers; without a chunk the tuple has two and the chunk's code is
compiled out. :func:`_key_range` gives the key tiles a query block visits (:func:`_key_split`: split-KV),
:func:`_query_range` the query blocks a key tile visits, :func:`_visible` the pairs that attend;
``diag = i + SEQ_K - SEQ_Q`` is the key on query i's diagonal. The score side, a :class:`ScoreBundle`, holds
the score function SCORE_MOD with what it reads and the attention sinks. Each bundle is None where a launch
has none: its code is then compiled out. :func:`mask_bundle` and :func:`score_bundle` make them, for every
launcher.
"""
from __future__ import annotations

from typing import NamedTuple

from ..rules import FULL, PARTIAL, SKIPPED
from ._mode import require_triton
from .config import LOG2E

triton = require_triton()
import triton.language as tl  # noqa: E402

_LOG2E = tl.constexpr(LOG2E)
# what a block mask (flashlib.masks.BlockMask) says of a tile
_SKIPPED, _PARTIAL, _FULL = tl.constexpr(SKIPPED), tl.constexpr(PARTIAL), tl.constexpr(FULL)
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


# ----- which keys a query sees -------------------------------------------------------------------

@triton.jit
def _side(w, SEQ_Q, SEQ_K):
    """A window side as the helpers use it: -1 (no limit) for any side at least SEQ_Q + SEQ_K
    wide, which limits nothing; so that diag + w cannot overflow int32 for w up to 2^31 - 1."""
    return tl.where(w >= SEQ_Q + SEQ_K, -1, w)


@triton.jit
def _band(offs_q, offs_k, SEQ_Q, SEQ_K, rule):
    """(BLOCK_Q, BLOCK_K): the window's band, i + o - left <= j <= i + o + right."""
    left, right = _side(rule[0], SEQ_Q, SEQ_K), _side(rule[1], SEQ_Q, SEQ_K)
    diag = offs_q[:, None] + (SEQ_K - SEQ_Q)  # the key on query i's diagonal
    keys = offs_k[None, :]
    return ((left < 0) | (keys >= diag - left)) & ((right < 0) | (keys <= diag + right))


@triton.jit
def _chunk_of(rel, chunk, SEQ_Q, SEQ_K):
    """(the first position of each rel's chunk (rel >= 0: Triton's // floors), the size), the size at most
    SEQ_Q + SEQ_K (exact: every position is then in chunk 0, as with more) so that no sum overflows int32."""
    size = tl.minimum(chunk, SEQ_Q + SEQ_K)
    return tl.maximum(rel, 0) // size * size, size


@triton.jit
def _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL: tl.constexpr, kind=_FULL, off_b=0, off_h=0, mask=None, origin=0):
    """(BLOCK_Q, BLOCK_K): the pairs that exist and may attend: the causal rule, and with a mask bundle, in a
    _PARTIAL tile, the window's band, the chunk (counted from ``origin``, a sequence's start) and its MASK_MOD."""
    seen = (offs_q[:, None] < SEQ_Q) & (offs_k[None, :] < SEQ_K)
    if CAUSAL:
        # bottom-right diagonal: query i sees key j when j <= i + SEQ_K - SEQ_Q
        seen = seen & (offs_k[None, :] <= offs_q[:, None] + (SEQ_K - SEQ_Q))
    if mask is not None:
        if kind == _PARTIAL:
            seen = seen & _band(offs_q, offs_k, SEQ_Q, SEQ_K, mask.rule)
            if len(mask.rule) > 2:  # a chunk; a query at diag (rel = diag - origin < 0: in no chunk) sees its own
                rel = offs_q + (SEQ_K - SEQ_Q) - origin
                first, size = _chunk_of(rel, mask.rule[2], SEQ_Q, SEQ_K)
                keys = offs_k[None, :] - origin
                seen = seen & (rel >= 0)[:, None] & (keys >= first[:, None]) & (keys < (first + size)[:, None])
            seen = seen & mask.fn(off_b, off_h, offs_q[:, None], offs_k[None, :], mask.data)
    return seen


@triton.jit
def _no_mask(b, h, q_idx, kv_idx, data):
    """The mask function of a window or chunk alone: every pair the rule's band and chunk leave visible."""
    return True


@triton.jit
def _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key that query rows q0 .. q0 + BLOCK_Q - 1 can see: later tiles are skipped."""
    k_end = SEQ_K
    if CAUSAL:
        k_end = tl.minimum(tl.maximum(q0 + BLOCK_Q + (SEQ_K - SEQ_Q), 0), SEQ_K)
    return k_end


@triton.jit
def _key_range(q0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, mask=None,
               origin=0):
    """[k_start, k_end): the keys rows q0 .. q0 + BLOCK_Q - 1 can see under the causal rule and, with a mask
    bundle, its window and chunks (counted from ``origin``), k_start on a tile boundary."""
    k_start = 0
    k_end = _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    if mask is not None:
        rule = mask.rule
        left, right = _side(rule[0], SEQ_Q, SEQ_K), _side(rule[1], SEQ_Q, SEQ_K)
        diag = q0 + (SEQ_K - SEQ_Q)  # the key on the first row's diagonal
        k_start = tl.where(left >= 0, tl.maximum(diag - left, 0) // BLOCK_K * BLOCK_K, 0)
        k_end = tl.where(right >= 0, tl.minimum(k_end, tl.maximum(diag + BLOCK_Q + right, 0)), k_end)
        if len(rule) > 2:  # a chunk: from the first row's chunk to the end of the last row's
            first, size = _chunk_of(diag - origin, rule[2], SEQ_Q, SEQ_K)
            k_start = tl.maximum(k_start, (first + origin) // BLOCK_K * BLOCK_K)
            last = diag + (BLOCK_Q - 1) - origin
            own, _ = _chunk_of(last, rule[2], SEQ_Q, SEQ_K)
            k_end = tl.minimum(k_end, tl.where(last >= 0, own + size + origin, 0))
    return k_start, k_end


@triton.jit
def _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr):
    """The first query block that sees key k0: blocks above it see none of this key tile."""
    q_start = 0
    if CAUSAL:  # query i sees key j when j <= i + SEQ_K - SEQ_Q
        q_start = tl.maximum(k0 - (SEQ_K - SEQ_Q), 0) // BLOCK_Q * BLOCK_Q
    return q_start


@triton.jit
def _query_range(k0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, mask=None):
    """[q_start, q_end): the query rows that see some key of k0 .. k0 + BLOCK_K - 1 under the causal
    rule and, with a mask bundle, its window and chunks; q_start on a block boundary."""
    q_start = _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    q_end = SEQ_Q
    if mask is not None:  # query i sees keys i + o - left .. i + o + right, o = SEQ_K - SEQ_Q
        rule = mask.rule
        left, right = _side(rule[0], SEQ_Q, SEQ_K), _side(rule[1], SEQ_Q, SEQ_K)
        first = tl.maximum(k0 - (SEQ_K - SEQ_Q) - right, 0) // BLOCK_Q * BLOCK_Q
        q_start = tl.where(right >= 0, tl.maximum(q_start, first), q_start)
        last = k0 + BLOCK_K - (SEQ_K - SEQ_Q) + left  # one past the last row whose window reaches the tile
        q_end = tl.where(left >= 0, tl.minimum(q_end, tl.maximum(last, 0)), q_end)
        if len(rule) > 2:  # a chunk: the rows whose chunk is the first key's, through the last key's
            own, size = _chunk_of(k0, rule[2], SEQ_Q, SEQ_K)
            q_start = tl.maximum(q_start, tl.maximum(own - (SEQ_K - SEQ_Q), 0) // BLOCK_Q * BLOCK_Q)
            own, _ = _chunk_of(k0 + (BLOCK_K - 1), rule[2], SEQ_Q, SEQ_K)
            q_end = tl.minimum(q_end, tl.maximum(own + size - (SEQ_K - SEQ_Q), 0))
    return q_start, q_end


@triton.jit
def _key_split(k_start, k_end, split, NUM_SPLITS, BLOCK_K: tl.constexpr):
    """Split ``split`` of [k_start, k_end) in NUM_SPLITS runs of whole tiles, the last ones possibly empty."""
    run = tl.cdiv(tl.cdiv(k_end - k_start, NUM_SPLITS), BLOCK_K) * BLOCK_K
    lo = tl.minimum(k_start + split * run, k_end)
    return lo, tl.minimum(lo + run, k_end)


@triton.jit
def _mask_row(off_b, off_h, row, mask=None):
    """Where a program's row of the block mask starts: mask.tiles advanced to (batch row off_b, head off_h, row
    ``row``) by mask.strides (none: the launch's one row); 0 without a mask bundle."""
    tiles = 0
    if mask is not None:
        tiles = mask.tiles
        if len(mask.strides) > 0:
            tiles += off_b * mask.strides[0] + off_h * mask.strides[1] + row * mask.strides[2]
    return tiles


@triton.jit
def _tile_kind(Tiles, tile, mask=None):
    """What the block mask says of a tile (Tiles: the program's row, :func:`_mask_row`): _SKIPPED, _PARTIAL or
    _FULL; _FULL without a mask bundle."""
    kind = _FULL
    if mask is not None:
        kind = tl.load(Tiles + tile)
    return kind


# ----- soft-capping ------------------------------------------------------------------------------

@triton.jit
def _tanh(y):
    """tanh in float32 to 1.5 ulps everywhere: its Taylor series to y^19 below |y| = 0.6 (where 1 - 2 / (e^2y
    + 1) loses bits to cancellation; the next term is 4e-9 of tanh there), that quotient above (exact at
    both ends: e^2y = inf gives 1). With 5 terms below 1/4 it was off by 3 ulps, and so was soft-capping."""
    a = tl.abs(y)
    y2 = y * y
    series = (-929569.0 / 638512875.0 + y2 * (6404582.0 / 10854718875.0 + y2 * (-443861162.0 / 1856156927625.0)))
    series = -1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0 + y2 * (
        -1382.0 / 155925.0 + y2 * (21844.0 / 6081075.0 + y2 * series)))))
    small = y * (1.0 + y2 * series)
    large = 1.0 - 2.0 / (tl.math.exp2(a * (2.0 * _LOG2E)) + 1.0)
    return tl.where(a < 0.6, small, tl.where(y < 0, -large, large))


@triton.jit
def _no_score(x, scale, qk_scale, b, h, q_idx, kv_idx, data, GRAD: tl.constexpr):
    """The score function of attention sinks alone: the scaled score, x * qk_scale (slope 1)."""
    if GRAD:
        return x * qk_scale, 1.0
    else:
        return x * qk_scale


@triton.jit
def _mod_scores(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score=None):
    """Scores in base-2 units from x = q.k: x * qk_scale (qk_scale = scale * log2 e), or the score bundle's
    SCORE_MOD's (flashlib.kernels.scorefn), which takes x and both scales: it may fold them."""
    if score is not None:
        s = score.fn(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score.data, False)
    else:
        s = x * qk_scale
    return s


@triton.jit
def _mod_scores_slope(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score=None):
    """(the scores of :func:`_mod_scores`, the score function's slope at x * scale: 1 without one)."""
    if score is not None:
        s, slope = score.fn(x, scale, qk_scale, off_b, off_h, q_idx, kv_idx, score.data, True)
    else:
        s = x * qk_scale
        slope = 1.0
    return s, slope


@triton.jit
def _visible_slope(slope, visible, score=None):
    """The slope where the pair may attend, 0 elsewhere (p = 0 there, but a slope may be inf or NaN):
    masked where P is, so that the mask need not stay alive until dS."""
    if score is not None:
        slope = tl.where(visible, slope, 0.0)
    return slope


@triton.jit
def _mod_slope(ds, slope, score=None):
    """dS times the score function's slope: the gradient of the scaled scores before it (the chain rule)."""
    if score is not None:
        ds = ds * slope
    return ds


# ----- PyTorch's integer division, for mask functions ---------------------------------------------

@triton.jit
def _batch_head(row, HEADS, ROW0):
    """(batch row, head) of row ``row`` (batch * HEADS + head) of a launch whose rows start at ROW0, a batch
    boundary (row_runs): what mask and score functions are told, and which kv head a program reads."""
    row = row + ROW0
    return row // HEADS, row % HEADS


@triton.jit
def _stacked_head(kv_head, offs_r, ROWS, NEW_TOKENS):
    """The query head of each stacked row of decoding: a kv head's query heads, NEW_TOKENS rows each,
    one after another in its ROWS rows (flashlib.kernels.decode). Padding rows (past ROWS) are given the
    last row's head: what they read (a sink, a score function's table) stays inside the tensor."""
    return kv_head * (ROWS // NEW_TOKENS) + tl.minimum(offs_r, ROWS - 1) // NEW_TOKENS


@triton.jit
def _sink_state(Sinks, heads):
    """(m_i, l_i) of query rows before their first key tile, heads the query head of each row,
    (BLOCK_Q,): nothing seen, (-inf, 0); or with attention sinks (Sinks: one logit per query
    head) the sink already counted as one score with no value, m_i = sink in base-2 units and
    l_i = 2^(sink - m_i) = 1, so that it enters the denominator only (acc starts at 0 either way).
    The PyTorch side: flashlib.tiled._start, and flashlib.softmax.merge_sink for finished results."""
    if Sinks is None:
        m_i = tl.zeros(heads.shape, dtype=tl.float32) - float("inf")
        l_i = tl.zeros(heads.shape, dtype=tl.float32)
    else:
        m_i = tl.load(Sinks + heads).to(tl.float32) * _LOG2E
        l_i = tl.zeros(heads.shape, dtype=tl.float32) + 1.0
    return m_i, l_i


@triton.jit
def _start_state(heads, score=None):
    """:func:`_sink_state` of a forward's query rows, from the sinks its score bundle holds (none without)."""
    if score is None:
        m_i, l_i = _sink_state(None, heads)
    elif len(score.sinks) == 0:
        m_i, l_i = _sink_state(None, heads)
    else:
        m_i, l_i = _sink_state(score.sinks[0], heads)
    return m_i, l_i


@triton.jit
def _floordiv(a, b):
    """a // b rounded toward -inf, as PyTorch and Python do (Triton's // rounds toward zero)."""
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def _floormod(a, b):
    """a % b with the sign of b, as PyTorch and Python do (Triton's % takes the sign of a)."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


# ----- the ladder's split: tiles seen whole, folded without a mask ---------------------------------

@triton.jit
def _key_tiles(q0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """flashlib.rules.key_tiles: (k_full_end, k_end) for query rows q0 .. q0 + BLOCK_Q - 1 under the causal
    rule alone; the tiles before k_full_end need no mask, [k_full_end, k_end) need one."""
    k_end = _key_range_end(q0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    seen_by_all = SEQ_K
    if CAUSAL:  # the block's first row, and so every row, sees keys j <= q0 + SEQ_K - SEQ_Q
        seen_by_all = tl.minimum(tl.maximum(q0 + (SEQ_K - SEQ_Q) + 1, 0), SEQ_K)
    return (seen_by_all // BLOCK_K) * BLOCK_K, k_end


@triton.jit
def _query_tiles(k0, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """flashlib.rules.query_tiles: (q_start, q_full_start, q_full_end) for the key tile at k0 under the causal
    rule alone; blocks [q_full_start, q_full_end) need no mask, the others from q_start need one."""
    q_start = _query_range_start(k0, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    q_rows_full = (SEQ_Q // BLOCK_Q) * BLOCK_Q  # where the whole query blocks end
    if CAUSAL:  # the first block whose first row sees this tile's last key
        first_full = tl.cdiv(tl.maximum(k0 + BLOCK_K - 1 - (SEQ_K - SEQ_Q), 0), BLOCK_Q) * BLOCK_Q
    else:
        first_full = 0
    q_full_start = tl.minimum(tl.maximum(first_full, q_start), q_rows_full)
    q_full_end = tl.where(k0 + BLOCK_K <= SEQ_K, q_rows_full, q_full_start)  # a ragged key tile: masked throughout
    return q_start, q_full_start, q_full_end


# ----- the two bundles a launch passes: its mask side and its score side --------------------------------

class MaskBundle(NamedTuple):
    """A launch's mask side, one kernel argument (``mask``): what its mask path reads. Nothing in it is None
    (Triton 3.6 cannot test a tuple that holds a None): what is absent is an empty tuple."""

    fn: object      # MASK_MOD(b, h, q_idx, kv_idx, data) -> bool, compiled (maskfn); _no_mask: a window or chunk alone
    data: tuple     # what fn reads: the tensors it captures, then its numbers; () for none
    rule: tuple     # (window left, window right[, chunk]): Options.rule_numbers
    tiles: object   # the block mask's kinds, uint8 (B or 1, H or 1, rows, tiles) or one row; () for none (decoding)
    strides: tuple  # tiles' (batch, head, row) strides, 0 where broadcast; () for one row or none


class ScoreBundle(NamedTuple):
    """A launch's score side, one kernel argument (``score``): what its scores get besides q.k and the scale."""

    fn: object      # SCORE_MOD(x, scale, qk_scale, b, h, q_idx, kv_idx, data, GRAD), compiled (scorefn); _no_score
    data: tuple     # what fn reads: the tensors it captures, then its numbers; () for none
    sinks: tuple    # (the attention sinks, (H,) float32 contiguous,) that start each row's softmax, or ()


def mask_bundle(options, kinds=None, compiled=None, always: bool = False) -> MaskBundle | None:
    """The mask side of a launch with ``options`` (flashlib.machinery.options): None without a window, chunk or mask
    function, unless ``always`` (decoding's one kernel takes the rule, whatever it is). compiled: the mask
    function compiled (a :class:`~flashlib.kernels.maskfn.KernelMask`); a window or chunk alone takes the mask
    path with ``_no_mask``, every pair its band and chunk leave visible. kinds: the block mask's kinds, (B or 1,
    H or 1, rows, tiles) broadcast by zero strides, or one row every program reads; None: no block mask."""
    if not (options.masked or always):
        return None
    tiles, strides = () if kinds is None else kinds, ()
    if kinds is not None and kinds.dim() > 1:
        strides = tuple(s if n > 1 else 0 for s, n in zip(kinds.stride(), kinds.shape[:2])) + (kinds.stride(2),)
    fn, data = (_no_mask, ()) if compiled is None else (compiled.jit, compiled.data or ())
    return MaskBundle(fn, data, options.rule_numbers, tiles, strides)


def score_bundle(compiled=None, sinks=None) -> ScoreBundle | None:
    """The score side of a launch: a score function compiled (a :class:`~flashlib.kernels.scorefn.KernelScore`)
    and the attention sinks ((H,) float32 contiguous, as the kernels read them); None without either. Sinks
    alone take the score path with ``_no_score``, the scaled score itself."""
    if compiled is None and sinks is None:
        return None
    fn, data = (_no_score, ()) if compiled is None else (compiled.jit, compiled.data or ())
    return ScoreBundle(fn, data, () if sinks is None else (sinks,))


# ----- which (batch, head) rows a launch owns ---------------------------------------------------------

MAX_GRID_ROWS = 65535  # CUDA's limit on grid axes 1 and 2 (axis 0 takes 2^31 - 1)


def row_runs(rows: int, multiple: int = 1) -> list[slice]:
    """The kernels' (batch, head) rows, on grid axis 1, in runs of at most MAX_GRID_ROWS (a launch each, on
    views): runs start on multiples of ``multiple`` (a kv head's query heads; a batch's heads for a mask
    function) and, where the limit allows, of 16, keeping the 16-byte alignment Triton specialises on."""
    from math import lcm

    unit = lcm(16, multiple) if lcm(16, multiple) <= MAX_GRID_ROWS else multiple
    step = MAX_GRID_ROWS // unit * unit
    if step == 0:
        raise ValueError(f"runs of {multiple} rows (heads that one launch must keep together) do not fit a CUDA "
                         f"grid's {MAX_GRID_ROWS}")
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]
