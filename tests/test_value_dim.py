"""A head dim of v's own (DeepSeek's MLA: 192 for q and k, 128 for v in prefill and training) in the
references, forward and backward, against float64 autograd of the formula written here; the fused
kernels' tests are tests/test_value_dim_kernels.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import flashlib


def _inputs(seed=0, *, heads=4, kv_heads=2, seq_q=20, seq_k=20, d=24, dv=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq_k, dv, generator=g, dtype=torch.float64)
    return q, k, v


def formula(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        s = s.masked_fill(j > i + k.shape[-2] - q.shape[-2], float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["dense", "tiled-query", "tiled-key"])
def test_the_references_take_v_with_its_own_head_dim(op, causal):
    q, k, v = _inputs(seq_q=13 if causal else 20)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = 192 ** -0.5  # MLA's: the q/k head dim's, whatever v's is
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = formula(*leaves, causal, scale)
    want_grads = torch.autograd.grad(want, leaves, dout)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    if op == "dense":
        out = flashlib.dense_attention(*mine, causal=causal, scale=scale)
    else:
        out = flashlib.tiled_attention(*mine, causal=causal, scale=scale, block_q=8, block_k=8, loop=op.split("-")[1])
    grads = torch.autograd.grad(out, mine, dout)
    assert out.shape == (*q.shape[:-1], 16)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12, msg=name)


def test_k_must_still_match_q():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="'k' has head_dim 16.*q and k must share head_dim"):
        flashlib.dense_attention(q, k[..., :16], v)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton ships Linux wheels only")
def test_the_fused_kernels_take_it_too():
    """flash_attention, flash_attention_varlen and ring_attention take it (tests/test_value_dim_kernels.py,
    tests/test_distributed.py); what still refuses it is checked there."""
    q, k, v = (t.float() for t in _inputs())
    out = flashlib.flash_attention(q, k, v)
    torch.testing.assert_close(out.double(), formula(q.double(), k.double(), v.double(), False, 24 ** -0.5),
                               rtol=0, atol=1e-5)
