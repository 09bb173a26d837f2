"""What the autograd Functions save, as courses' FlashAttention-2 tests look at it.

Those tests take ``out.grad_fn.saved_tensors``, keep the tensors of shape (batch, heads, seq_q),
require exactly one, and compare it with the log-sum-exp of the scores (rtol 1e-2, float32). A
None among the saved tensors breaks the search (it has no shape), so every Function saves tensors
only, with and without attention sinks. The reference here is float64 ``torch.logsumexp`` over
SDPA-style masked scores (top-left for seq_q == seq_k, where both diagonals agree).
"""
import math

import pytest
import torch

import flashlib
from flashlib.kernels import function as teaching

B, H, N, D = 2, 3, 37, 16


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _lse_reference(q, k, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _with_sinks(fn):
    sinks = torch.linspace(-1.0, 1.0, H).requires_grad_()
    return lambda q, k, v, causal: fn(q, k, v, causal, sinks=sinks)


ENTRY_POINTS = {
    "flash_attention": lambda q, k, v, causal, **kw: flashlib.flash_attention(q, k, v, causal=causal, **kw),
    "flash_attention, mask_mod": lambda q, k, v, causal, **kw: flashlib.flash_attention(
        q, k, v, causal=causal, mask_mod=lambda b, h, i, j: (i - j) < 1000, **kw),
    "tiled_attention": lambda q, k, v, causal, **kw: flashlib.tiled_attention(
        q, k, v, causal=causal, block_q=16, block_k=8, **kw),
    "teaching kernels": lambda q, k, v, causal, **kw: teaching.attention(q, k, v, causal=causal, **kw),
}


def _saved(out):
    saved = out.grad_fn.saved_tensors
    assert saved is not None
    assert all(isinstance(t, torch.Tensor) for t in saved), [type(t).__name__ for t in saved]
    return saved


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_exactly_one_saved_lse(name, causal):
    q, k, v = _inputs()
    out = ENTRY_POINTS[name](q, k, v, causal)
    rows = [t for t in _saved(out) if t.shape == (B, H, N)]
    assert len(rows) == 1, [tuple(t.shape) for t in _saved(out)]
    assert rows[0].dtype == torch.float32
    torch.testing.assert_close(rows[0].double(), _lse_reference(q, k, causal), rtol=1e-2, atol=1e-2)
    # and the backward still runs from what was saved
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("name", ["flash_attention", "tiled_attention", "teaching kernels"])
def test_saved_tensors_with_sinks_are_tensors(name):
    q, k, v = _inputs(1)
    out = _with_sinks(ENTRY_POINTS[name])(q, k, v, True)
    _saved(out)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_varlen_saves_tensors_only():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(11, H, D, generator=g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    out = flashlib.flash_attention_varlen(q, k, v, cu, cu, 7, 7, causal=True)
    _saved(out)


@pytest.mark.parametrize("name", ["flash_attention", "tiled_attention", "teaching kernels"])
def test_the_three_dimensional_layout_of_the_course_saves_one_lse(name):
    """The course's own layout, (batch, n_queries, D): the one saved (batch, n_queries) tensor is the lse."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 33, 16, generator=g).requires_grad_() for _ in range(3))
    out = ENTRY_POINTS[name](q, k, v, True)
    rows = [t for t in _saved(out) if t.shape == (4, 33)]
    assert len(rows) == 1
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(16)
    s = s.masked_fill(~torch.ones(33, 33, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(rows[0].double(), torch.logsumexp(s, -1), rtol=1e-2, atol=1e-2)
