"""flashlib.masks: the visibility rule, dense masks, block masks and the ready mask functions,
against the rule written out pair by pair."""
import pytest
import torch
from hypothesis import given, strategies as st

from flashlib import masks
from flashlib.masks import FULL, PARTIAL, SKIPPED, attention_mask, block_mask

from .variants_reference import pairwise


windows = st.tuples(st.integers(-1, 6), st.integers(-1, 6))


@given(seq_q=st.integers(0, 12), seq_k=st.integers(0, 12), causal=st.booleans(), window=windows)
def test_attention_mask_is_the_rule_pair_by_pair(seq_q, seq_k, causal, window):
    got = attention_mask(seq_q, seq_k, causal=causal, window=window)
    assert got.shape == (1, 1, seq_q, seq_k)
    assert torch.equal(got[0, 0], pairwise(seq_q, seq_k, causal=causal, window=window))


def test_ready_masks_are_their_definitions():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    cases = {masks.causal: lambda i, j: j <= i,
             masks.sliding_window(2): lambda i, j: i - 2 <= j <= i,
             masks.prefix_lm(3): lambda i, j: j < 3 or j <= i,
             masks.document(ids): lambda i, j: ids[i] == ids[j]}
    for fn, definition in cases.items():
        want = torch.tensor([[definition(i, j) for j in range(9)] for i in range(9)], dtype=torch.bool)
        assert torch.equal(attention_mask(9, 9, mask_mod=fn)[0, 0], want), fn.__name__


def test_mask_functions_see_batch_and_head_and_combine_with_causal_and_window():
    def striped(b, h, q_idx, kv_idx):
        return (kv_idx + b + h) % 3 != 0

    got = attention_mask(7, 9, causal=True, window=(3, -1), mask_mod=striped, batch=2, heads=3)
    assert got.shape == (2, 3, 7, 9)
    for b in range(2):
        for h in range(3):
            want = pairwise(7, 9, causal=True, window=(3, -1), mask_mod=lambda b_, h_, i, j: striped(b, h, i, j))
            assert torch.equal(got[b, h], want)


@given(seq_q=st.integers(0, 20), seq_k=st.integers(0, 20), block_q=st.integers(1, 7), block_k=st.integers(1, 7),
       causal=st.booleans(), window=windows, prefix=st.integers(0, 5))
def test_block_mask_kinds_are_any_and_all_of_each_tile(seq_q, seq_k, block_q, block_k, causal, window, prefix):
    mask_mod = masks.prefix_lm(prefix) if prefix else None
    dense = attention_mask(seq_q, seq_k, causal=causal, window=window, mask_mod=mask_mod)[0, 0]
    bm = block_mask(seq_q, seq_k, block_q=block_q, block_k=block_k, causal=causal, window=window, mask_mod=mask_mod)
    assert bm.kinds.shape == (1, 1, -(-seq_q // block_q), -(-seq_k // block_k)) and bm.kinds.dtype == torch.uint8
    for r in range(bm.kinds.shape[2]):
        for c in range(bm.kinds.shape[3]):
            tile = dense[r * block_q:(r + 1) * block_q, c * block_k:(c + 1) * block_k]
            want = FULL if tile.all() else PARTIAL if tile.any() else SKIPPED
            assert bm.kinds[0, 0, r, c] == want, (r, c)
    assert torch.equal(bm.by_key_tile()[0, 0], bm.kinds[0, 0].T)
    assert sum(bm.counts().values()) == bm.kinds.numel()


def test_block_mask_keeps_only_the_dims_the_mask_reads_and_is_the_same_in_chunks(monkeypatch):
    def per_head(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + h

    whole = block_mask(40, 40, block_q=8, block_k=8, mask_mod=per_head, batch=2, heads=3)
    assert whole.kinds.shape == (1, 3, 5, 5)  # no batch dependence: one copy for every batch row
    monkeypatch.setattr("flashlib.tiled._CHUNK_PAIRS", 8 * 40)  # one query block per chunk
    assert torch.equal(block_mask(40, 40, block_q=8, block_k=8, mask_mod=per_head, batch=2, heads=3).kinds,
                       whole.kinds)


def test_a_window_leaves_tiles_linear_in_the_length():
    counts = [block_mask(n, n, block_q=16, block_k=16, causal=True, window=(32, 0)).counts() for n in (256, 512)]
    computed = [c["partial"] + c["full"] for c in counts]
    assert computed[1] <= 2 * computed[0] + 4  # O(N w) tiles, not O(N^2)
    assert counts[1]["skipped"] > 3 * counts[0]["skipped"]


def test_document_masks_skip_the_tiles_between_documents():
    ids = torch.arange(256) // 64  # four documents of 64 tokens
    bm = block_mask(256, 256, block_q=32, block_k=32, causal=True, mask_mod=masks.document(ids))
    assert bm.counts() == {"skipped": 64 - 4 * 3, "partial": 8, "full": 4}


@pytest.mark.parametrize("bad,exc,words", [
    (lambda b, h, q_idx, kv_idx: 1, TypeError, ["must return a boolean tensor", "int"]),
    (lambda b, h, q_idx, kv_idx: q_idx - kv_idx, TypeError, ["boolean tensor", "torch.int64"]),
    (lambda q_idx, kv_idx: q_idx >= kv_idx, TypeError, ["four arguments", "(q_idx, kv_idx)"]),
    ("causal", TypeError, ["'mask_mod'", "str"]),
])
def test_bad_mask_functions_are_named(bad, exc, words):
    with pytest.raises(exc) as info:
        attention_mask(4, 4, mask_mod=bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_ready_mask_arguments_are_named():
    with pytest.raises(ValueError, match="'window'.*-1"):
        masks.sliding_window(-1)
    with pytest.raises(ValueError, match="'prefix'"):
        masks.prefix_lm(2.5)
    with pytest.raises(TypeError, match="'ids'.*integer"):
        masks.document(torch.zeros(4))


def test_as_text_draws_rows_of_digits():
    assert masks.as_text(attention_mask(3, 3, causal=True)[0, 0]) == "1 0 0\n1 1 0\n1 1 1"
