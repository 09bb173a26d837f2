"""Attention sinks (``sinks=``: one learnable logit per query head, GPT-OSS's ``s_aux``).

The reference is transformers' own: GPT-OSS's ``eager_attention_forward``, which appends the sink
as a last column of the scores, takes the softmax and drops the column. Gradients, the sinks'
included, come from autograd through it in float64. Every flashlib path is held to it: the dense
and tiled references, the teaching kernels, the public ops (dense, packed, compiled, exported),
decoding (contiguous and paged caches, any number of splits) and ring attention across processes.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

import flashlib  # noqa: E402
from flashlib import dense_attention, flash_attention, flash_attention_varlen, tiled_attention  # noqa: E402
from flashlib import distributed as fd  # noqa: E402
from flashlib.decode import decode_attention, decode_reference, paged_cache  # noqa: E402
from flashlib.kernels import attention as kernel_attention  # noqa: E402
from flashlib.op import path_for  # noqa: E402

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


class _Module(torch.nn.Module):
    """What GPT-OSS's eager attention reads from its module: the groups and the sinks."""

    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks, self.num_key_value_groups, self.training = sinks, groups, False


def eager(q, k, v, sinks, *, causal=False, window=None, scale=None):
    """GPT-OSS's eager attention with an additive mask of flashlib's rule (bottom-right aligned):
    (batch, heads, seq_q, d) out."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    i = torch.arange(seq_q)[:, None] + (seq_k - seq_q)
    j = torch.arange(seq_k)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    mask = torch.zeros(seq_q, seq_k, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, _ = gpt_oss.eager_attention_forward(_Module(sinks, q.shape[1] // k.shape[1]), q, k, v, mask, scale)
    return out.transpose(1, 2)


def inputs(batch=2, heads=4, kv_heads=2, seq_q=19, seq_k=27, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, d, generator=g)
    k = torch.randn(batch, kv_heads, seq_k, d, generator=g)
    v = torch.randn(batch, kv_heads, seq_k, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    dout = torch.randn(batch, heads, seq_q, d, generator=g)
    return [t.to(dtype) for t in (q, k, v, sinks)], dout.to(dtype)


def grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


def expected(tensors, dout, **options):
    return grads(lambda q, k, v, s: eager(q, k, v, s, **options), [t.double() for t in tensors], dout.double())


NAMES = ("out", "dq", "dk", "dv", "dsinks")
OPTIONS = [dict(), dict(causal=True), dict(causal=True, window=(6, 0)), dict(window=(3, 5))]


def assert_all_close(got, want, atol, rtol=1e-4):
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=rtol, msg=name)


# ----- the references -------------------------------------------------------------------------

@pytest.mark.parametrize("options", OPTIONS)
def test_dense_reference_equals_gpt_oss_eager(options):
    tensors, dout = inputs()
    want = expected(tensors, dout, **options)
    got = grads(lambda q, k, v, s: dense_attention(q, k, v, sinks=s, **options), [t.double() for t in tensors],
                dout.double())
    assert_all_close(got, want, atol=1e-12)


@settings(max_examples=12)
@given(seq_q=st.integers(1, 21), seq_k=st.integers(0, 23), block_q=st.integers(1, 9), block_k=st.integers(1, 9),
       loop=st.sampled_from(["query", "key"]), causal=st.booleans(), seed=st.integers(0, 99))
def test_tiled_reference_equals_gpt_oss_eager(seq_q, seq_k, block_q, block_k, loop, causal, seed):
    tensors, dout = inputs(1, 2, 1, seq_q, seq_k, 8, seed)
    want = expected(tensors, dout, causal=causal)
    got = grads(lambda q, k, v, s: tiled_attention(q, k, v, sinks=s, causal=causal, block_q=block_q, block_k=block_k,
                                                   loop=loop), [t.double() for t in tensors], dout.double())
    assert_all_close(got, want, atol=1e-12)


def test_a_row_that_sees_no_key_gives_the_sink_everything():
    """causal with seq_q > seq_k: the first rows see no key; out = 0 there, lse = the sink, and the
    sink's gradient still counts them (exp(sink - lse) = 1)."""
    tensors, dout = inputs(seq_q=9, seq_k=4)
    q, k, v, sinks = tensors
    out, lse = flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    blind = slice(0, 5)  # rows 0..4 see no key
    assert out[..., blind, :].abs().max() == 0
    torch.testing.assert_close(lse[..., blind], sinks[None, :, None].expand(2, 4, 5))
    assert_all_close(grads(lambda q, k, v, s: flash_attention(q, k, v, causal=True, sinks=s), tensors, dout),
                     expected(tensors, dout, causal=True), atol=2e-5)


def test_the_lse_holds_the_sink():
    tensors, _ = inputs()
    q, k, v, sinks = tensors
    _, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4
    want = torch.logsumexp(torch.cat((scores, sinks.double()[None, :, None, None].expand(2, 4, 19, 1)), -1), -1)
    torch.testing.assert_close(lse.double(), want, atol=2e-6, rtol=0)


def test_a_sink_of_minus_infinity_is_no_sink():
    tensors, _ = inputs()
    q, k, v, _ = tensors
    none = torch.full((4,), float("-inf"))
    out, lse = flash_attention(q, k, v, causal=True, sinks=none, return_lse=True)
    plain, plain_lse = flash_attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, plain_lse, atol=1e-6, rtol=0)


# ----- the kernels and the public ops ---------------------------------------------------------

@pytest.mark.parametrize("options", OPTIONS)
def test_the_public_op_equals_gpt_oss_eager(options):
    tensors, dout = inputs()
    got = grads(lambda q, k, v, s: flash_attention(q, k, v, sinks=s, **options), tensors, dout)
    assert_all_close(got, expected(tensors, dout, **options), atol=2e-5)


def test_the_teaching_kernels_with_sinks_and_soft_capping():
    """Soft-capping caps the scores, not the sink: the kernels against flashlib's dense reference
    (GPT-OSS has no soft-cap), in float64 there."""
    tensors, dout = inputs(seed=3)
    options = dict(causal=True, softcap=2.5)
    got = grads(lambda q, k, v, s: kernel_attention(q, k, v, sinks=s, **options), tensors, dout)
    want = grads(lambda q, k, v, s: dense_attention(q, k, v, sinks=s, **options), [t.double() for t in tensors],
                 dout.double())
    assert_all_close(got, want, atol=2e-5)


def test_a_mask_function_with_sinks():
    tensors, dout = inputs(seed=4)
    doc = flashlib.masks.document(torch.arange(27) // 9)
    got = grads(lambda q, k, v, s: flash_attention(q, k, v, sinks=s, mask_mod=doc), tensors, dout)
    want = grads(lambda q, k, v, s: dense_attention(q, k, v, sinks=s, mask_mod=doc), [t.double() for t in tensors],
                 dout.double())
    assert_all_close(got, want, atol=2e-5)


def test_float16_inputs_with_float32_sinks():
    tensors, dout = inputs(seed=5)
    q, k, v = (t.half() for t in tensors[:3])
    got = grads(lambda q, k, v, s: flash_attention(q, k, v, causal=True, sinks=s), [q, k, v, tensors[3]], dout.half())
    want = expected([q.float(), k.float(), v.float(), tensors[3]], dout.half().float(), causal=True)
    assert got[4].dtype == torch.float32  # each gradient in its input's dtype
    assert_all_close(got, want, atol=3e-3, rtol=1e-2)


def test_the_sinks_gradient_is_deterministic():
    tensors, dout = inputs(batch=3, seq_q=40, seed=6)
    first, second = (grads(lambda q, k, v, s: flash_attention(q, k, v, causal=True, sinks=s), tensors, dout)[4]
                     for _ in range(2))
    assert torch.equal(first, second)


def test_sinks_take_the_teaching_path_and_stay_one_op_under_compile_and_export():
    tensors, dout = inputs(seed=7)
    q, k, v, sinks = tensors
    assert path_for(q.half(), k.half(), sinks=sinks) == ("teaching", "teaching")

    def fn(q, k, v, s):
        return flash_attention(q, k, v, causal=True, sinks=s)

    compiled = grads(torch.compile(fn, fullgraph=True), tensors, dout)
    assert_all_close(compiled, grads(fn, tensors, dout), atol=0, rtol=0)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, s):
            return fn(q, k, v, s)

    graph = torch.export.export(Attention(), (q, k, v, sinks)).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert targets.count("flashlib.flash_attention.default") == 1, targets


def test_packed_sequences_with_sinks():
    """flash_attention_varlen: each sequence against GPT-OSS's eager attention on it alone, an empty
    sequence and one with queries but no keys among them."""
    lens_q, lens_k = [5, 0, 9, 3, 7], [7, 4, 9, 0, 12]
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(sum(n), h, 16, generator=g) for n, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2)))
    sinks = torch.randn(4, generator=g)
    dout = torch.randn_like(q)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))

    def packed(q, k, v, s):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, sinks=s)

    def per_sequence(q, k, v, s):
        outs = []
        for b in range(len(lens_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            one = (t[None].transpose(1, 2) for t in (q[rows], k[keys], v[keys]))
            outs.append(eager(*one, s, causal=True)[0].transpose(0, 1))  # no keys: out 0, the sink takes all
        return torch.cat(outs)

    got = grads(packed, [q, k, v, sinks], dout)
    want = grads(per_sequence, [t.double() for t in (q, k, v, sinks)], dout.double())
    assert_all_close(got, want, atol=2e-5)


@pytest.mark.parametrize("new_tokens, num_splits, paged", [(1, 1, False), (1, 3, True), (3, 2, False), (3, 1, True)])
def test_decoding_with_sinks(new_tokens, num_splits, paged):
    """decode_attention and decode_reference: the sink merged after the splits, as one more partial
    with no value; against GPT-OSS's eager attention over each sequence's valid prefix."""
    g = torch.Generator().manual_seed(9)
    batch, heads, kv_heads, capacity, d = 3, 4, 2, 90, 16
    q = torch.randn(batch, heads, new_tokens, d, generator=g)
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, d, generator=g) for _ in range(2))
    lengths = torch.tensor([new_tokens, 41, 90], dtype=torch.int32)
    sinks = torch.randn(heads, generator=g)
    caches, table = (k_cache, v_cache), None
    if paged:
        *caches, table = paged_cache(k_cache, v_cache, 16, generator=torch.Generator().manual_seed(1))
    got = decode_attention(q, *caches, lengths, block_table=table, num_splits=num_splits, sinks=sinks)
    ref = decode_reference(q.double(), *(c.double() for c in caches), lengths, block_table=table,
                           num_splits=num_splits, sinks=sinks.double())
    for b, n in enumerate(lengths.tolist()):
        want = eager(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(), v_cache[b:b + 1, :, :n].double(),
                     sinks.double(), causal=True)
        torch.testing.assert_close(got[b:b + 1].double(), want, atol=2e-6, rtol=0)
        torch.testing.assert_close(ref[b:b + 1], want, atol=1e-12, rtol=0)


# ----- ring attention -------------------------------------------------------------------------

RING_WORLD = 2


def test_ring_attention_with_sinks():
    from .ring_workers import sinks_ring

    tensors, dout = inputs(batch=1, heads=2, kv_heads=2, seq_q=12, seq_k=12, d=8, seed=10, dtype=torch.float64)
    ranks = fd.spawn(sinks_ring, RING_WORLD, args=(*tensors, dout), timeout=120)
    want = expected(tensors, dout, causal=True)
    out = fd.unshard([r[0] for r in ranks], layout="zigzag")
    torch.testing.assert_close(out, want[0], atol=1e-12, rtol=0)
    for i in range(3):
        grad = fd.unshard([r[1][i] for r in ranks], layout="zigzag")
        torch.testing.assert_close(grad, want[1 + i], atol=1e-12, rtol=0)
    # each rank's share of the sinks' gradient; a replicated parameter's shares add up
    torch.testing.assert_close(sum(r[2] for r in ranks), want[4], atol=1e-12, rtol=0)


# ----- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, error, words", [
    (torch.zeros(3), ValueError, "expected (4,), one logit per query head"),
    (torch.zeros(4, dtype=torch.int64), TypeError, "expected a floating-point dtype"),
    ([0.0] * 4, TypeError, "must be None or a torch.Tensor"),
    (torch.zeros(4, device="meta"), ValueError, "move it to q's device"),
])
def test_bad_sinks_are_named(bad, error, words):
    (q, k, v, _), _ = inputs()
    step, lengths = q[..., -1:, :], torch.full((2,), 27, dtype=torch.int32)  # decoding: one new token, a full cache
    for call in (lambda: flash_attention(q, k, v, sinks=bad), lambda: dense_attention(q, k, v, sinks=bad),
                 lambda: tiled_attention(q, k, v, sinks=bad), lambda: decode_attention(step, k, v, lengths, sinks=bad),
                 lambda: flashlib.decode_reference(step, k, v, lengths, sinks=bad),
                 lambda: flashlib.DecodePlan(step, k, v, lengths, sinks=bad),
                 lambda: flashlib.decode.cascade_attention(step, k[0], v[0], k, v, lengths, sinks=bad)):
        with pytest.raises(error, match="argument 'sinks'") as info:
            call()
        assert words in str(info.value)


def test_decoding_refuses_sinks_that_require_grad():
    q = torch.randn(1, 2, 1, 8)
    cache = torch.randn(1, 2, 4, 8)
    sinks = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="argument 'sinks' requires grad"):
        decode_attention(q, cache, cache, torch.tensor([4], dtype=torch.int32), sinks=sinks)
    assert math.isfinite(float(decode_attention(q, cache, cache, torch.tensor([4], dtype=torch.int32),
                                                sinks=sinks.detach()).sum()))
