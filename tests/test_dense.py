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
