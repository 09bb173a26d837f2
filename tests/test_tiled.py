import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashlib import dense_attention, tiled_attention, trace_tiled_attention

from .reference import loop_attention


def _inputs(shape_q, seq_k, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, seq_q, d = shape_q
    q = torch.randn(*lead, seq_q, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, seq_k, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, seq_k, d, generator=g, dtype=dtype)
    return q, k, v


def _reference_lse(q, k, causal, scale=None):
    _, s, _ = dense_attention(q, k, k, causal=causal, scale=scale, return_scores=True)
    return torch.logsumexp(s, dim=-1)


@given(batch=st.integers(1, 2), heads=st.integers(1, 2), seq_q=st.integers(1, 37), seq_k=st.integers(1, 37),
       d=st.integers(1, 9), block_q=st.integers(1, 40), block_k=st.integers(1, 40),
       causal=st.booleans(), loop=st.sampled_from(["query", "key"]), seed=st.integers(0, 2**16))
def test_tiled_matches_float64_dense(batch, heads, seq_q, seq_k, d, block_q, block_k, causal, loop, seed):
    q, k, v = _inputs((batch, heads, seq_q, d), seq_k, seed=seed)
    out, lse = tiled_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal, loop=loop,
                               return_lse=True)
    torch.testing.assert_close(out, dense_attention(q, k, v, causal=causal), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, _reference_lse(q, k, causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seq_q,seq_k", [(97, 113), (113, 97), (128, 128), (1, 203)])
@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 7), (128, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_awkward_lengths_against_loop_reference(seq_q, seq_k, block_q, block_k, causal):
    q, k, v = _inputs((seq_q, 59), seq_k, seed=seq_q)
    ref, ref_lse = loop_attention(q, k, v, causal=causal) if seq_q < 100 else (None, None)
    out, lse = tiled_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal, return_lse=True)
    if ref is None:
        ref, ref_lse = dense_attention(q, k, v, causal=causal), _reference_lse(q, k, causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seq_q,seq_k", [(3, 8), (8, 8), (8, 3)])
@pytest.mark.parametrize("loop", ["query", "key"])
def test_rows_without_keys_output_zero(seq_q, seq_k, loop):
    q, k, v = _inputs((2, seq_q, 4), seq_k)
    out, lse = tiled_attention(q, k, v, block_q=2, block_k=3, causal=True, loop=loop, return_lse=True)
    empty = torch.arange(seq_q) + seq_k - seq_q < 0  # query i sees no key when i + seq_k - seq_q < 0
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, empty]).all() and torch.isfinite(lse[:, ~empty]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_within_twice_dense_error(dtype, causal):
    # flash-attn's rule: error vs a float32 reference at most 2x that of dense attention in dtype.
    q, k, v = _inputs((2, 2, 77, 40), 91, dtype=torch.float32, seed=3)
    ref = dense_attention(q, k, v, causal=causal)
    low = [t.to(dtype) for t in (q, k, v)]
    err_dense = (dense_attention(*low, causal=causal).float() - ref).abs().max().item()
    out = tiled_attention(*low, block_q=16, block_k=32, causal=causal)
    assert out.dtype == dtype
    err_tiled = (out.float() - ref).abs().max().item()
    assert err_tiled <= 2 * err_dense + 1e-6, (err_tiled, err_dense)


@pytest.mark.parametrize("loop", ["query", "key"])
def test_large_logits_stay_finite_and_exact(loop):
    q, k, v = _inputs((1, 2, 16, 8), 24, seed=4)
    q, k = q * 40, k * 40  # scores of order 1e4 after scale=1
    s = q @ k.transpose(-2, -1)
    assert s.abs().max() > 5e3
    for dtype in (torch.float32, torch.float64):
        out = tiled_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_q=4, block_k=5, scale=1.0, loop=loop)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), dense_attention(q, k, v, scale=1.0), rtol=0,
                                   atol=1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("loop", ["query", "key"])
def test_nan_propagates_like_dense(loop):
    q, k, v = _inputs((1, 10, 4), 12, seed=5)
    for name in ("q", "k", "v"):
        bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        bad[name][0, 3, 1] = float("nan")
        ref = dense_attention(bad["q"], bad["k"], bad["v"])
        out = tiled_attention(bad["q"], bad["k"], bad["v"], block_q=3, block_k=4, loop=loop)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), name
        assert torch.isnan(out).any()
        torch.testing.assert_close(out[~torch.isnan(ref)], ref[~torch.isnan(ref)], rtol=0, atol=1e-12)
    # a NaN query row spoils only its own row
    bad_q = q.clone()
    bad_q[0, 3, 1] = float("nan")
    nan_rows = torch.isnan(tiled_attention(bad_q, k, v, block_q=3, block_k=4, loop=loop)).any(-1)
    assert nan_rows[0].tolist() == [i == 3 for i in range(10)]


def test_both_loop_orders_and_any_leading_dims():
    q, k, v = _inputs((2, 3, 2, 9, 5), 11)
    a = tiled_attention(q, k, v, block_q=4, block_k=3, loop="query")
    b = tiled_attention(q, k, v, block_q=4, block_k=3, loop="key")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(a, dense_attention(q, k, v), rtol=0, atol=1e-12)


def test_empty_sequences():
    q, k, v = _inputs((1, 0, 4), 5)
    assert tiled_attention(q, k, v).shape == (1, 0, 4)
    q, k, v = _inputs((1, 3, 4), 0)
    assert torch.equal(tiled_attention(q, k, v), torch.zeros(1, 3, 4, dtype=torch.float64))


@pytest.mark.parametrize("loop", ["query", "key"])
@pytest.mark.parametrize("causal", [False, True])
def test_trace_partial_outputs_are_attention_over_keys_seen(loop, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2, loop=loop, causal=causal)
    final = dense_attention(q, k, v, causal=causal)[0]
    torch.testing.assert_close(trace.out, final, rtol=0, atol=1e-12)
    n_tiles = 9 if not causal else 6
    assert len(trace.steps) == n_tiles and len(trace.skipped) == 9 - n_tiles
    for step in trace.steps:
        (q0, q1), (k0, k1) = step.rows, step.cols
        # after key tile k0:k1, the partial output is exact attention over keys 0..k1-1
        sub = dense_attention(q[0, q0:q1], k[0, :k1], v[0, :k1], causal=False,
                              scale=1 / math.sqrt(4)) if not causal else None
        if sub is not None:
            torch.testing.assert_close(step.partial, sub, rtol=0, atol=1e-12)
        assert step.tile_elements == (q1 - q0) * (k1 - k0) and step.full_elements == 36
        expected = (step.partial - final[q0:q1]).abs().max().item()
        assert step.distance == pytest.approx(expected)
    last = {}
    for step in trace.steps:
        last[step.rows] = step
    for (q0, q1), step in last.items():
        torch.testing.assert_close(step.partial, final[q0:q1], rtol=0, atol=1e-12)


def test_trace_key_loop_visits_key_tiles_outer():
    q, k, v = _inputs((1, 6, 4), 6)
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=3, loop="key")
    assert [step.cols for step in trace.steps] == [(0, 3)] * 3 + [(3, 6)] * 3
    assert [step.rows for step in trace.steps] == [(0, 2), (2, 4), (4, 6)] * 2


# ----- variants: grouped heads, windows, soft-capping, mask functions -----------------------------

from flashlib import masks  # noqa: E402

from .variants_reference import explicit_attention  # noqa: E402

WINDOWS = st.one_of(st.none(), st.tuples(st.integers(-1, 9), st.integers(-1, 9)))


@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.integers(1, 3), seq_q=st.integers(0, 23),
       seq_k=st.integers(0, 23), d=st.integers(1, 6), block_q=st.integers(1, 9), block_k=st.integers(1, 9),
       causal=st.booleans(), window=WINDOWS, softcap=st.one_of(st.none(), st.floats(0.5, 5.0)),
       documents=st.booleans(), loop=st.sampled_from(["query", "key"]), seed=st.integers(0, 2**16))
def test_tiled_variants_match_an_explicit_float64_mask(batch, kv_heads, group, seq_q, seq_k, d, block_q, block_k,
                                                       causal, window, softcap, documents, loop, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, seq_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, seq_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    mask_mod = masks.document(torch.arange(max(seq_q, seq_k)) // 5) if documents else None
    kw = dict(causal=causal, window=window, softcap=softcap, mask_mod=mask_mod)
    out, lse = tiled_attention(q, k, v, block_q=block_q, block_k=block_k, loop=loop, return_lse=True, **kw)
    want, want_lse = explicit_attention(q, k, v, **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("loop", ["query", "key"])
def test_a_window_computes_tiles_linear_in_the_length(loop):
    steps = {}
    for n in (64, 128):
        q = torch.randn(1, 1, n, 4, dtype=torch.float64)
        trace = trace_tiled_attention(q, q, q, block_q=8, block_k=8, causal=True, window=(16, 0), loop=loop)
        steps[n] = len(trace.steps)
        assert len(trace.steps) + len(trace.skipped) == (n // 8) ** 2
        for step in trace.steps:  # every computed tile holds a visible pair
            assert torch.isfinite(step.scores).any()
    # each query block of 8 rows sees its diagonal tile and the two before it (16 keys back): the
    # first two blocks fewer; O(N * window) tiles instead of the (N / 8)^2 / 2 of causal attention
    assert steps == {64: 3 * 64 // 8 - 3, 128: 3 * 128 // 8 - 3}


def test_mask_function_tiles_false_everywhere_are_skipped():
    ids = torch.arange(32) // 8  # four documents of 8 tokens
    q = torch.randn(1, 2, 32, 4, dtype=torch.float64)
    trace = trace_tiled_attention(q, q, q, block_q=8, block_k=8, mask_mod=masks.document(ids))
    assert sorted((s.rows, s.cols) for s in trace.steps) == [((i, i + 8), (i, i + 8)) for i in range(0, 32, 8)]
    torch.testing.assert_close(trace.out, explicit_attention(q, q, q, mask_mod=masks.document(ids))[0][0, 0])
