import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashlib import dense_attention, tiled_attention, tiled_backward, tiled_forward
from flashlib.bench import peak_allocated_bytes


def _leaves(shape_q, seq_k, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    *lead, seq_q, d = shape_q
    return [torch.randn(*lead, n, d, generator=g, dtype=dtype).requires_grad_() for n in (seq_q, seq_k, seq_k)]


@pytest.mark.parametrize("seq_q,seq_k", [(5, 5), (4, 7), (7, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("loop", ["query", "key"])
def test_gradcheck_float64(seq_q, seq_k, causal, loop):
    q, k, v = _leaves((1, 2, seq_q, 3), seq_k)
    # rows that see no key have lse = -inf, which finite differences cannot probe
    first_seen = max(seq_q - seq_k, 0) if causal else 0

    def fn(q, k, v):
        out, lse = tiled_attention(q, k, v, block_q=2, block_k=3, causal=causal, loop=loop, return_lse=True)
        return out, lse[..., first_seen:]

    assert torch.autograd.gradcheck(fn, (q, k, v))


@given(seq_q=st.integers(1, 24), seq_k=st.integers(1, 24), d=st.integers(1, 8), block_q=st.integers(1, 30),
       block_k=st.integers(1, 30), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_grads_match_autograd_through_dense(seq_q, seq_k, d, block_q, block_k, causal, seed):
    q, k, v = _leaves((2, seq_q, d), seq_k, seed=seed)
    dout = torch.randn(2, seq_q, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ref = torch.autograd.grad(dense_attention(q, k, v, causal=causal), (q, k, v), dout)
    got = torch.autograd.grad(tiled_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal),
                              (q, k, v), dout)
    for name, a, b in zip("qkv", got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}")


def test_rows_without_keys_get_zero_grad():
    q, k, v = _leaves((1, 6, 4), 3)
    tiled_attention(q, k, v, block_q=2, block_k=2, causal=True).sum().backward()
    assert torch.equal(q.grad[:, :3], torch.zeros(1, 3, 4, dtype=torch.float64))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_lse_gradient_is_softmax():
    # d lse_i / d s_ij = P_ij, so sum(lse) back-propagates P k · scale into q.
    q, k, v = _leaves((1, 5, 4), 6)
    _, lse = tiled_attention(q, k, v, block_q=2, block_k=4, return_lse=True)
    _, s, _ = dense_attention(q, k, v, return_scores=True)
    ref = torch.autograd.grad(torch.logsumexp(s, -1).sum(), q)[0]
    torch.testing.assert_close(torch.autograd.grad(lse.sum(), q)[0], ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_grads_follow_twice_rule(dtype):
    q, k, v = _leaves((1, 2, 45, 32), 53, dtype=torch.float32, seed=7)
    dout = torch.randn(1, 2, 45, 32, generator=torch.Generator().manual_seed(8))
    ref = torch.autograd.grad(dense_attention(q, k, v, causal=True), (q, k, v), dout)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    dense_low = torch.autograd.grad(dense_attention(*low, causal=True), low, dout.to(dtype))
    tiled_low = torch.autograd.grad(tiled_attention(*low, block_q=16, block_k=16, causal=True), low, dout.to(dtype))
    for a, b, r in zip(tiled_low, dense_low, ref):
        assert a.dtype == dtype
        assert (a.float() - r).abs().max() <= 2 * (b.float() - r).abs().max() + 1e-5


def test_backward_never_holds_the_score_matrix():
    n, d, block = 1024, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1, n, d, generator=g) for _ in range(4))
    out, lse = tiled_forward(q, k, v, block_q=block, block_k=block)
    tiled_peak = peak_allocated_bytes(tiled_backward, q, k, v, out, lse, dout, block_q=block, block_k=block)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def dense_backward():
        torch.autograd.grad(dense_attention(*leaves), leaves, dout)

    dense_peak = peak_allocated_bytes(dense_backward)
    full = n * n * 4  # one float32 (N, N) matrix
    assert dense_peak >= 2 * full      # dense keeps S-sized and P-sized tensors
    assert tiled_peak < full / 4       # tiles and (N, d) gradients only


def test_backward_peak_is_its_gradients_and_a_few_tiles():
    """Counted from the algorithm: dq, dk, dv (each N x d), two N-vectors (delta and the shifted
    lse), and the tile work (s, p, dp, ds and their temporaries, dk_j, dv_j) in at most 10 tiles'
    worth. A copy of a gradient more (a view that became a copy) breaks the bound."""
    n, d, block = 2048, 64, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1, n, d, generator=g) for _ in range(4))
    out, lse = tiled_forward(q, k, v, block_q=block, block_k=block)
    peak = peak_allocated_bytes(tiled_backward, q, k, v, out, lse, dout, block_q=block, block_k=block)
    grads, rows, tiles = 3 * n * d * 4, 2 * n * 4, 10 * block * block * 4
    assert grads <= peak <= grads + rows + tiles


# ----- variants: grouped heads, windows, soft-capping, mask functions -----------------------------

from flashlib import masks  # noqa: E402

from .variants_reference import explicit_attention  # noqa: E402


@given(kv_heads=st.integers(1, 2), group=st.integers(1, 3), seq_q=st.integers(0, 17), seq_k=st.integers(0, 17),
       d=st.integers(1, 5), block_q=st.integers(1, 8), block_k=st.integers(1, 8), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6))),
       softcap=st.one_of(st.none(), st.floats(0.5, 4.0)), prefix=st.one_of(st.none(), st.integers(0, 5)),
       seed=st.integers(0, 2**16))
def test_variant_grads_match_autograd_through_an_explicit_mask(kv_heads, group, seq_q, seq_k, d, block_q, block_k,
                                                               causal, window, softcap, prefix, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, kv_heads * group, seq_q, d, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, kv_heads, seq_k, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64)
    kw = dict(causal=causal, window=window, softcap=softcap, mask_mod=None if prefix is None else masks.prefix_lm(prefix))

    def loss(out, lse):  # through out and through lse (rows without keys: lse -inf, no gradient)
        return (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()

    want = torch.autograd.grad(loss(*explicit_attention(q, k, v, **kw)), (q, k, v), allow_unused=True)
    got = torch.autograd.grad(loss(*tiled_attention(q, k, v, block_q=block_q, block_k=block_k, return_lse=True, **kw)),
                              (q, k, v), allow_unused=True)
    for name, a, b in zip("qkv", got, want):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}")


def test_softcap_gradcheck():
    q, k, v = _leaves((1, 2, 5, 3), 6)
    assert torch.autograd.gradcheck(
        lambda q, k, v: tiled_attention(q * 4, k, v, block_q=2, block_k=4, softcap=1.5, window=(2, 1)), (q, k, v))
