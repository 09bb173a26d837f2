"""The ladder's split of the tiles a block sees into full ones (folded without a mask) and partial
ones, written once in Triton (flashlib/kernels/rules.py: _key_tiles, _query_tiles) and once in
PyTorch (flashlib/rules.py: key_tiles, query_tiles): the two agree, run in a small kernel in
Triton's interpreter, and the tiles called full hold only visible pairs, the skipped ones none,
and no tile that could go without a mask pays for one."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlib.kernels import triton_installed
from flashlib.rules import Visibility, key_tiles, query_tiles

if not triton_installed():  # importing triton here first would keep its interpreter off
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.kernels.rules import _key_tiles, _query_tiles, triton  # noqa: E402
import triton.language as tl  # noqa: E402

# the split needs no power of two: odd sizes check the arithmetic, not only the shipped tiles
BLOCKS = [1, 3, 5, 16, 32, 64]


@triton.jit
def _probe(Keys, Queries, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """Program i: the key tiles of query block i, the query blocks of key tile i."""
    i = tl.program_id(0)
    k_full_end, k_end = _key_tiles(i * BLOCK_Q, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    tl.store(Keys + 2 * i, k_full_end)
    tl.store(Keys + 2 * i + 1, k_end)
    q_start, q_full_start, q_full_end = _query_tiles(i * BLOCK_K, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    tl.store(Queries + 3 * i, q_start)
    tl.store(Queries + 3 * i + 1, q_full_start)
    tl.store(Queries + 3 * i + 2, q_full_end)


def _triton_tiles(seq_q, seq_k, causal, block_q, block_k):
    """([(k_full_end, k_end)] per query block, [(q_start, q_full_start, q_full_end)] per key tile)."""
    q_blocks, k_tiles = -(-seq_q // block_q), -(-seq_k // block_k)
    n = max(q_blocks, k_tiles)
    keys = torch.full((n, 2), -7, dtype=torch.int32)
    queries = torch.full((n, 3), -7, dtype=torch.int32)
    _probe[(n,)](keys, queries, seq_q, seq_k, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal)
    return [tuple(r) for r in keys[:q_blocks].tolist()], [tuple(r) for r in queries[:k_tiles].tolist()]


def _torch_tiles(seq_q, seq_k, causal, block_q, block_k):
    return ([key_tiles(q0, seq_q, seq_k, causal, block_q, block_k) for q0 in range(0, seq_q, block_q)],
            [query_tiles(k0, seq_q, seq_k, causal, block_q, block_k) for k0 in range(0, seq_k, block_k)])


def _visible(seq_q, seq_k, causal):
    """(seq_q, seq_k): which pairs may attend, from the rule itself."""
    q_idx, kv_idx = torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :]
    visible = Visibility(causal=causal).pairs(q_idx, kv_idx, seq_q, seq_k)
    return torch.ones(seq_q, seq_k, dtype=torch.bool) if visible is None else visible


def _check_key_split(visible, q0, block_q, block_k, k_full_end, k_end):
    """Query block q0's rows (those that exist): tiles before k_full_end are whole keys, all seen;
    keys from k_end on are seen by none; the tile at k_full_end could not go without a mask."""
    seq_k = visible.shape[1]
    rows = visible[q0:q0 + block_q]
    assert k_full_end % block_k == 0 and 0 <= k_full_end <= k_end <= seq_k
    assert rows[:, :k_full_end].all()
    assert not rows[:, k_end:].any()
    nxt = rows[:, k_full_end:k_full_end + block_k]
    assert k_full_end + block_k > seq_k or not nxt.all()


def _check_query_split(visible, k0, block_q, block_k, q_start, q_full_start, q_full_end):
    """Key tile k0: blocks before q_start see none of it; [q_full_start, q_full_end) are whole
    blocks of rows, inside the keys, that see all of it; the block before q_full_start could not
    go without a mask, and the one at q_full_end has padding rows."""
    seq_q, seq_k = visible.shape
    cols = visible[:, k0:k0 + block_k]
    assert q_start % block_q == 0 and q_full_start % block_q == 0 and q_full_end % block_q == 0
    assert 0 <= q_start <= q_full_start <= q_full_end <= seq_q
    assert not cols[:q_start].any()
    if q_full_end > q_full_start:
        assert k0 + block_k <= seq_k and cols[q_full_start:q_full_end].all()
    inside = k0 + block_k <= seq_k
    if inside and q_full_start > q_start:
        assert not cols[q_full_start - block_q:q_full_start].all()
    if inside:
        assert q_full_end + block_q > seq_q or not cols[q_full_end:q_full_end + block_q].all()


@settings(deadline=None, max_examples=60)
@given(seq_q=st.integers(1, 90), seq_k=st.integers(1, 90), causal=st.booleans(),
       block_q=st.sampled_from(BLOCKS), block_k=st.sampled_from(BLOCKS))
def test_triton_and_pytorch_splits_agree_and_hold(seq_q, seq_k, causal, block_q, block_k):
    case = (seq_q, seq_k, causal, block_q, block_k)
    by_key, by_query = _torch_tiles(*case)
    assert _triton_tiles(*case) == (by_key, by_query), case
    visible = _visible(seq_q, seq_k, causal)
    for q0, (k_full_end, k_end) in zip(range(0, seq_q, block_q), by_key):
        _check_key_split(visible, q0, block_q, block_k, k_full_end, k_end)
    for k0, tiles in zip(range(0, seq_k, block_k), by_query):
        _check_query_split(visible, k0, block_q, block_k, *tiles)


@pytest.mark.parametrize("seq_q,seq_k", [(64, 64), (37, 100), (100, 37), (1, 1), (128, 16)])
def test_awkward_lengths_at_the_shipped_tiles(seq_q, seq_k):
    """The tiles the ladder ships (16 to 128 rows), lengths equal, ragged, and far apart both ways
    (rows that see no key, keys no row sees)."""
    for causal in (False, True):
        for block_q, block_k in ((16, 16), (64, 32), (128, 64), (32, 128)):
            case = (seq_q, seq_k, causal, block_q, block_k)
            assert _triton_tiles(*case) == _torch_tiles(*case), case


def test_causal_square_split_by_hand():
    """seq 64 in tiles of 16, causal: query block 32..47 sees key tiles 0 and 1 whole and tile 2
    (its diagonal) in part; key tile 16..31 is crossed by block 16 and seen whole from block 32."""
    assert key_tiles(32, 64, 64, True, 16, 16) == (32, 48)
    assert query_tiles(16, 64, 64, True, 16, 16) == (16, 32, 64)
    assert key_tiles(32, 64, 64, False, 16, 16) == (64, 64)
    assert query_tiles(48, 50, 60, False, 16, 16) == (0, 0, 0)  # a ragged key tile: masked throughout
