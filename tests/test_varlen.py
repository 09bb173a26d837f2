"""Packed sequences: flashlib.varlen's reference against per-sequence float64 attention, and the op
flash_attention_varlen (the teaching kernels, in Triton's CPU interpreter) against the reference:
empty sequences, grouped heads, windows, soft-capping, gradients, no FLOPs on padding, errors."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashlib import varlen_reference

from .variants_reference import assert_matches, explicit_attention
from .variants_reference import outputs_and_grads as _grads

triton_missing = importlib.util.find_spec("triton") is None
needs_kernels = pytest.mark.skipif(triton_missing or torch.cuda.is_available(),
                                   reason="interpreter tests (Triton: Linux wheels only; CUDA: tests/test_gpu.py)")


def _packed(lengths_q, lengths_k, heads=4, kv_heads=2, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) if n else
                  torch.zeros(1, dtype=torch.int32) for n in (lengths_q, lengths_k))
    q = torch.randn(int(cu_q[-1]), heads, d, generator=g, dtype=dtype)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lengths_q, default=0), max(lengths_k, default=0)


def _per_sequence(q, k, v, cu_q, cu_k, **kw):
    """(out (total_q, heads, d), lse (heads, total_q)) from float64 attention on each sequence alone."""
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        out, lse = explicit_attention(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                      v[k0:k1].transpose(0, 1)[None], **kw)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


LENGTHS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4)
WINDOWS = st.one_of(st.none(), st.tuples(st.integers(-1, 5), st.integers(-1, 5)))


@given(lengths=LENGTHS, group=st.integers(1, 3), causal=st.booleans(), window=WINDOWS,
       softcap=st.one_of(st.none(), st.floats(0.5, 4.0)), seed=st.integers(0, 2**16))
def test_reference_is_attention_on_each_sequence(lengths, group, causal, window, softcap, seed):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([a for a, _ in lengths], [b for _, b in lengths], heads=2 * group,
                                                seed=seed, dtype=torch.float64)
    kw = dict(causal=causal, window=window, softcap=softcap)
    out, lse = varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    want, want_lse = _per_sequence(q, k, v, cu_q, cu_k, **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def _compare(lengths_q, lengths_k, fn=None, **kw):
    from flashlib import flash_attention_varlen

    q, k, v, cu_q, cu_k, max_q, max_k = _packed(lengths_q, lengths_k)
    run = fn or (lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw))
    want = _grads(lambda q, k, v: varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw),
                  q.double(), k.double(), v.double())
    assert_matches(_grads(run, q, k, v), want)


# lengths of the queries and keys of each sequence: empty ones, one token, more queries than keys
PACKS = [([37, 0, 1, 70], [29, 5, 0, 70]), ([1], [1]), ([0, 0], [3, 0]), ([66, 3], [2, 90])]


@needs_kernels
@pytest.mark.parametrize("lengths_q,lengths_k", PACKS)
@pytest.mark.parametrize("options", [dict(), dict(causal=True, window=(9, -1), softcap=2.0), dict(window=(4, 6))],
                         ids=lambda o: ",".join(o) or "full")
def test_kernels_match_the_reference(lengths_q, lengths_k, options):
    _compare(lengths_q, lengths_k, **options)


@needs_kernels
@settings(max_examples=5)
@given(lengths=LENGTHS, causal=st.booleans(), window=WINDOWS)
def test_kernels_on_any_lengths(lengths, causal, window):
    _compare([a * 5 for a, _ in lengths], [b * 5 for _, b in lengths], causal=causal, window=window)


@needs_kernels
def test_an_empty_batch_and_inside_torch_compile():
    from flashlib import flash_attention_varlen

    q, k, v, cu_q, cu_k, _, _ = _packed([], [])
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([20, 0, 7], [11, 4, 30], seed=3)

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window=(5, 0), return_lse=True)

    eager, jit = _grads(run, q, k, v), _grads(torch.compile(run, fullgraph=True), q, k, v)
    for e, c in zip(eager, jit):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-6)


@needs_kernels
def test_padding_costs_no_flops(monkeypatch):
    from flashlib import flash_attention_varlen
    from flashlib.kernels import FlashConfig

    from .test_variants import DotCounter

    cfg = FlashConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([64, 1, 0, 17], [64, 1, 5, 17])
    counter = DotCounter(monkeypatch)
    import flashlib.kernels.varlen as packed
    from flashlib.machinery.options import Options

    with torch.no_grad():
        packed.varlen_forward_base2(q, k, v, cu_q, cu_k, max_q, max_k, Options(scale=0.1), config=cfg)
    per_head = 4 * 4 + 1 * 1 + 0 + 2 * 2  # tiles of each sequence alone: 64 x 64, 1 x 1, none, 17 x 17
    assert counter.calls == 2 * 4 * per_head  # two dots per tile, four heads
    assert flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k).shape == q.shape


BAD = [
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), ValueError,
     ["'cu_seqlens_q'", "decreases from 5 to 3", "non-decreasing"]),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError, ["'cu_seqlens_q'", "torch.int64", "torch.int32"]),
    (dict(cu_seqlens_k=torch.tensor([1, 4, 9], dtype=torch.int32)), ValueError, ["'cu_seqlens_k'", "start at 0"]),
    (dict(cu_seqlens_k=torch.tensor([0, 9], dtype=torch.int32)), ValueError, ["same batch"]),
    (dict(max_seqlen_q=2), ValueError, ["'max_seqlen_q'", "is 2", "4 tokens"]),
    (dict(k=torch.randn(9, 3, 8)), ValueError, ["'k' has 3 heads", "'q' has 4"]),
    (dict(q=torch.randn(7, 8)), ValueError, ["'q'", "(total_tokens, heads, head_dim)"]),
    (dict(softcap=0.0), ValueError, ["'softcap'"]),
    (dict(window=(3, -2)), ValueError, ["'window'"]),
]


@pytest.mark.parametrize("change,exc,words", BAD)
def test_bad_input_is_named(change, exc, words):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 4], [4, 5])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    options = {key: change.pop(key) for key in ("softcap", "window") if key in change}
    args.update(change)
    entry_points = [("varlen_reference", varlen_reference)]
    if not triton_missing:
        from flashlib import flash_attention_varlen

        entry_points.append(("flash_attention_varlen", flash_attention_varlen))
    for name, fn in entry_points:
        with pytest.raises(exc) as info:
            fn(**args, **options)
        for w in [name, *words]:
            assert w in str(info.value), (w, str(info.value))
