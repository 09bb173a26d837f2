import pytest
import torch
import torch.nn.functional as F

from flashlib import causal_mask, dense_attention

from .reference import loop_attention, mask_matrix


@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (5, 5), (3, 7), (7, 3), (6, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_loop_reference(seq_q, seq_k, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(seq_q, 5), torch.randn(seq_k, 5), torch.randn(seq_k, 5)
    ref, _ = loop_attention(q, k, v, causal=causal)
    out = dense_attention(q.double(), k.double(), v.double(), causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seq_q,seq_k", [(4, 4), (3, 9), (9, 3), (16, 16)])
def test_causal_mask_is_bottom_right(seq_q, seq_k):
    assert torch.equal(causal_mask(seq_q, seq_k), mask_matrix(seq_q, seq_k, True))
    if seq_q <= seq_k:  # every row sees at least one key
        assert causal_mask(seq_q, seq_k).any(dim=-1).all()
    # torch's own lower-right causal bias agrees
    from torch.nn.attention.bias import causal_lower_right
    q = torch.randn(1, 1, seq_q, 8, dtype=torch.float64)
    k, v = torch.randn(1, 1, seq_k, 8, dtype=torch.float64), torch.randn(1, 1, seq_k, 8, dtype=torch.float64)
    rows = causal_mask(seq_q, seq_k).any(-1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(seq_q, seq_k))
    torch.testing.assert_close(dense_attention(q, k, v, causal=True)[..., rows, :], ref[..., rows, :])


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_sdpa(causal):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 33, 16, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(dense_attention(q, k, v, causal=causal), ref)


def test_rows_without_keys_are_zero_and_have_zero_grad():
    q = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    out, s, p = dense_attention(q, k, v, causal=True, return_scores=True)
    assert torch.equal(out[:, :3], torch.zeros(1, 3, 4, dtype=torch.float64))
    assert torch.equal(p[:, :3], torch.zeros(1, 3, 3, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q.grad[:, :3], torch.zeros(1, 3, 4, dtype=torch.float64))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_scale_is_applied():
    torch.manual_seed(2)
    q, k, v = (torch.randn(4, 8, dtype=torch.float64) for _ in range(3))
    ref, _ = loop_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(dense_attention(q, k, v, scale=0.3), ref)


# ----- variants: grouped heads, windows, soft-capping, mask functions -----------------------------

from hypothesis import given, strategies as st  # noqa: E402

from flashlib import masks  # noqa: E402

from .variants_reference import explicit_attention  # noqa: E402


@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.integers(1, 3), seq_q=st.integers(0, 9),
       seq_k=st.integers(0, 9), d=st.integers(1, 5), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
       softcap=st.one_of(st.none(), st.floats(0.5, 5.0)), prefix=st.one_of(st.none(), st.integers(0, 4)),
       seed=st.integers(0, 2**16))
def test_dense_variants_match_an_explicit_float64_mask(batch, kv_heads, group, seq_q, seq_k, d, causal, window,
                                                       softcap, prefix, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, seq_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, seq_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    mask_mod = None if prefix is None else masks.prefix_lm(prefix)
    kw = dict(causal=causal, window=window, softcap=softcap, mask_mod=mask_mod)
    out = dense_attention(q, k, v, **kw)
    torch.testing.assert_close(out, explicit_attention(q, k, v, **kw)[0], rtol=0, atol=1e-12)


def test_grouped_heads_are_repeated_kv_heads():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    wide = dense_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=True)
    torch.testing.assert_close(dense_attention(q, k, v, causal=True), wide, rtol=0, atol=0)


def test_softcap_bounds_the_scores():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    _, s, _ = dense_attention(q, q, q, softcap=5.0, return_scores=True)
    assert 0 < s.abs().max() < 5.0  # c * tanh(x / c) stays inside (-c, c)


def test_dense_forward_peak_is_scores_probabilities_and_output():
    """Notebook 01 measures this peak: without a mask, S and P (N x N each) and the output, nothing
    of N's size more (a pair of index vectors would be 16 N bytes)."""
    from flashlib.bench import peak_allocated_bytes

    n, d = 256, 64
    q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))
    peak = peak_allocated_bytes(dense_attention, q, k, v)
    assert 2 * 4 * n * n <= peak < 2 * 4 * n * n + 4 * n * d + 8 * n
