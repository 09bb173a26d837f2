"""Empty inputs: no batch, no heads, no query rows or no keys give empty (or zero) results and zero
gradients, attention sinks included, as PyTorch's SDPA gives for an empty batch or no heads.

A row that sees no key outputs zeros (flashlib's rule for such rows); its sink still takes the whole
row's softmax, and with out = 0 its gradient is 0.
"""
import pytest
import torch
import torch.nn.functional as F

import flashlib
from flashlib.kernels import function as teaching

OPS = {
    "dense_attention": flashlib.dense_attention,
    "tiled_attention": flashlib.tiled_attention,
    "flash_attention": flashlib.flash_attention,
    "teaching kernels": teaching.attention,
}
# (q shape, k shape) with something empty; SDPA answers the first four the same way
SHAPES = {
    "no batch": ((0, 4, 5, 8), (0, 2, 6, 8)),
    "no heads": ((2, 0, 5, 8), (2, 0, 6, 8)),
    "no query heads": ((2, 0, 5, 8), (2, 2, 6, 8)),
    "no query rows": ((2, 4, 0, 8), (2, 2, 6, 8)),
    "no keys": ((2, 4, 5, 8), (2, 2, 0, 8)),
}


def _inputs(q_shape, k_shape):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g).requires_grad_()
    k, v = (torch.randn(k_shape, generator=g).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", list(OPS))
def test_empty_inputs(op, shape, with_sinks):
    q, k, v = _inputs(*SHAPES[shape])
    sinks = torch.linspace(-1, 1, q.shape[1]).requires_grad_() if with_sinks else None
    out = OPS[op](q, k, v, causal=shape != "no keys", sinks=sinks)
    assert out.shape == q.shape
    assert (out == 0).all()  # empty, or rows that see no key
    if shape in ("no batch", "no heads", "no query rows"):
        assert F.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape == out.shape
    (out.sum() + 0.0 * q.sum()).backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and t.grad.shape == t.shape, name
        assert (t.grad == 0).all(), name
    if with_sinks:
        assert sinks.grad.shape == sinks.shape and (sinks.grad == 0).all()


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("shape", ["no query rows", "no heads", "no keys"])
def test_empty_packed(shape, with_sinks):
    heads = 0 if shape == "no heads" else 3
    total_q, total_k = (0, 5) if shape == "no query rows" else (4, 0) if shape == "no keys" else (4, 5)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(total_q, heads, 8, generator=g).requires_grad_()
    k, v = (torch.randn(total_k, heads, 8, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.zeros(heads).requires_grad_() if with_sinks else None
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (total_q, total_k))
    out = flashlib.flash_attention_varlen(q, k, v, cu_q, cu_k, total_q, total_k, sinks=sinks)
    assert out.shape == q.shape and (out == 0).all()
    (out.sum() + 0.0 * q.sum()).backward()
    assert all((t.grad == 0).all() and t.grad.shape == t.shape for t in (q, k, v))
    if with_sinks:
        assert (sinks.grad == 0).all() and sinks.grad.shape == (heads,)


@pytest.mark.parametrize("shape", [(0, 4, 1, 8), (2, 0, 1, 8), (2, 4, 0, 8)])
def test_empty_decoding(shape):
    batch, heads, new, d = shape
    q = torch.randn(shape)
    cache = torch.randn(batch, 2 if heads else 0, 16, d)
    lengths = torch.full((batch,), 7, dtype=torch.int32)
    out = flashlib.decode_attention(q, cache, cache, lengths)
    assert out.shape == q.shape


def test_zero_kv_heads_for_some_query_heads_is_refused_by_name():
    q, k, v = _inputs((2, 4, 5, 8), (2, 0, 6, 8))
    with pytest.raises(ValueError, match=r"argument 'k' has 0 heads but 'q' has 4"):
        flashlib.flash_attention(q, k, v)
