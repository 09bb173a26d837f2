"""Chunked local attention (``attention_chunk=C``, flash-attn FA3's name; Llama 4's chunked layers) in
every op that takes it, against references that share nothing of flashlib's rule: float64 attention on
a mask written out here (query i at p = i + seq_k - seq_q sees key j iff j // C == p // C, floor
division, with causal and window), PyTorch's flex_attention on a mask function written as its users
write one, and autograd. The tiles each path skips are checked too: a chunk is a saving only if the
tiles outside it are never visited."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlib
from flashlib import masks
from flashlib.decode import decode_attention, decode_reference
from flashlib.kernels import attention as kernel_attention
from flashlib.machinery.options import Options, check_options


def chunk_mask(seq_q, seq_k, chunk, causal=False, window=None):
    """(seq_q, seq_k) bool, written out from the definition, position by position."""
    mask = torch.zeros(seq_q, seq_k, dtype=torch.bool)
    for i in range(seq_q):
        p = i + seq_k - seq_q
        for j in range(seq_k):
            ok = math.floor(j / chunk) == math.floor(p / chunk)
            ok = ok and (not causal or j <= p)
            if window is not None:
                ok = ok and (window[0] < 0 or j >= p - window[0]) and (window[1] < 0 or j <= p + window[1])
            mask[i, j] = ok
    return mask


def reference(q, k, v, mask, scale=None):
    """float64 softmax over the visible keys (a row that sees none: zeros), grouped heads repeated."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v


def inputs(batch, heads, kv_heads, seq_q, seq_k, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, d, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq_k, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return (out.detach(), q.grad, k.grad, v.grad)


OPS = {
    "dense": lambda q, k, v, **kw: flashlib.dense_attention(q, k, v, **kw),
    "tiled": lambda q, k, v, **kw: flashlib.tiled_attention(q, k, v, block_q=16, block_k=16, **kw),
    "kernels": lambda q, k, v, **kw: kernel_attention(q, k, v, **kw),
    "flash_attention": lambda q, k, v, **kw: flashlib.flash_attention(q, k, v, **kw),
}
CASES = [  # (seq_q, seq_k, chunk, causal, window)
    (40, 40, 8, True, None),
    (37, 53, 16, True, None),  # fewer queries than keys: p = i + 16
    (53, 37, 10, False, None),  # more queries than keys: rows with p < 0 lie in no chunk, see nothing
    (64, 64, 24, True, (20, 0)),  # a window inside each chunk
    (30, 45, 7, False, (5, 3)),
    (33, 33, 1, True, None),  # every key its own chunk: each query sees itself
    (20, 20, 1000, True, None),  # a chunk longer than the sequence: plain causal
]


# the references on every case; the kernels on every case once, through their own autograd Function or the
# public op (which runs the same kernels on a CPU) by turns
OP_CASES = [(op, *case) for i, case in enumerate(CASES)
            for op in ("dense", "tiled", ("kernels", "flash_attention")[i % 2])]


@pytest.mark.parametrize("op, seq_q, seq_k, chunk, causal, window", OP_CASES)
def test_forward_and_backward_equal_float64_on_the_written_out_mask(op, seq_q, seq_k, chunk, causal, window):
    q, k, v = inputs(2, 4, 2, seq_q, seq_k, 16, seed=seq_q + chunk)
    dout = torch.randn(2, 4, seq_q, 16, generator=torch.Generator().manual_seed(1))
    mask = chunk_mask(seq_q, seq_k, chunk, causal, window)
    want = grads(lambda *t: reference(*t, mask), q, k, v, dout)
    got = grads(lambda *t: OPS[op](*t, causal=causal, window=window, attention_chunk=chunk), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{op} {name}: {m}")


def chunked_flex(chunk, offset):
    """Chunked attention as a flex_attention user writes it (Llama 4's rule), bottom-right aligned."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // chunk == (q_idx + offset) // chunk) & (kv_idx <= q_idx + offset)

    return mask_mod


@pytest.mark.parametrize("seq_q, seq_k, chunk", [(48, 48, 16), (40, 72, 12), (64, 64, 5)])
def test_forward_equals_flex_attention(seq_q, seq_k, chunk):
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    q, k, v = inputs(2, 4, 2, seq_q, seq_k, 16, seed=3)
    block_mask = create_block_mask(chunked_flex(chunk, seq_k - seq_q), 2, 4, seq_q, seq_k, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
        want, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    for name, op in OPS.items():
        torch.testing.assert_close(op(q, k, v, causal=True, attention_chunk=chunk), want, atol=2e-6, rtol=2e-5,
                                   msg=lambda m: f"{name}: {m}")
    _, lse = flashlib.flash_attention(q, k, v, causal=True, attention_chunk=chunk, return_lse=True)
    torch.testing.assert_close(lse, aux.lse, atol=2e-5, rtol=0)


@settings(max_examples=12, deadline=None)
@given(seq_q=st.integers(1, 40), seq_k=st.integers(1, 40), chunk=st.integers(1, 24), causal=st.booleans(),
       block=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 99))
def test_any_shape_tile_and_chunk(seq_q, seq_k, chunk, causal, block, dtype, seed):
    """The tiled reference at any tile size and the kernels, in float32 and float64, forward."""
    q, k, v = inputs(1, 2, 1, seq_q, seq_k, 8, seed=seed, dtype=dtype)
    want = reference(q, k, v, chunk_mask(seq_q, seq_k, chunk, causal))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    tiled = flashlib.tiled_attention(q, k, v, block_q=block, block_k=block, causal=causal, attention_chunk=chunk)
    torch.testing.assert_close(tiled.double(), want, atol=tol, rtol=tol)
    if dtype == torch.float32:
        got = flashlib.flash_attention(q, k, v, causal=causal, attention_chunk=chunk)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_tiles_outside_every_chunk_are_skipped():
    """The tiled trace computes exactly the tiles that hold a visible pair (counted here from the mask),
    so with chunks of 16 and causal, 64 tokens in 8 x 8 tiles compute 4 chunks x 3 tiles, not 36."""
    q, k, v = inputs(1, 1, 1, 64, 64, 8)
    trace = flashlib.trace_tiled_attention(q, k, v, block_q=8, block_k=8, causal=True, attention_chunk=16)
    mask = chunk_mask(64, 64, 16, causal=True)
    seen = {(i, j) for i in range(8) for j in range(8) if bool(mask[8 * i:8 * i + 8, 8 * j:8 * j + 8].any())}
    computed = {(step.rows[0] // 8, step.cols[0] // 8) for step in trace.steps}
    assert computed == seen and len(seen) == 4 * 3


def test_the_block_mask_carries_the_chunk():
    q, k, v = inputs(1, 2, 2, 48, 48, 16)
    everything = masks.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 48, 48,
                                         attention_chunk=16, causal=True)
    # chunks of 16 in 16-tiles, causal: the diagonal tiles partial (causal within them), the rest skipped
    assert everything.counts() == {"skipped": 6, "partial": 3, "full": 0}
    want = reference(q, k, v, chunk_mask(48, 48, 16, causal=True))
    got = flashlib.flash_attention(q, k, v, block_mask=everything)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="'attention_chunk' differs from the block mask's"):
        flashlib.flash_attention(q, k, v, block_mask=everything, attention_chunk=8)


def test_packed_sequences_chunk_each_sequence_from_its_start():
    lengths = [5, 19, 0, 33]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 4, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    dout = torch.randn(total, 4, 16, generator=g)
    got = grads(lambda *t: flashlib.flash_attention_varlen(*t, cu, cu, 33, 33, causal=True, attention_chunk=8),
                q, k, v, dout)

    def per_sequence(q, k, v):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            n = b - a
            mask = chunk_mask(n, n, 8, causal=True)
            outs.append(reference(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                  v[a:b].transpose(0, 1)[None], mask)[0].transpose(0, 1))
        return torch.cat(outs)

    want = grads(per_sequence, q.double(), k.double(), v.double(), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


# each kind of step once, the split counts by turns (three splits both ways, one split causal)
@pytest.mark.parametrize("new_tokens, causal, splits", [(1, True, 3), (4, True, 1), (3, False, 3)])
def test_decoding_equals_float64_and_counts_chunks_from_the_sequences_start(splits, new_tokens, causal):
    """Four sequences, one left-padded (cache_leftpad): each sequence's chunks start at its first valid
    position, as transformers counts them; float64 over the sequence alone, and decode_reference."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(4, 4, new_tokens, 16, generator=g)
    k, v = (torch.randn(4, 2, 70, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([70, 33, 9, 50], dtype=torch.int32)
    leftpad = torch.tensor([0, 0, 0, 7], dtype=torch.int32)
    kw = dict(causal=causal, attention_chunk=12, num_splits=splits)
    got = decode_attention(q, k, v, lengths, cache_leftpad=leftpad, **kw)
    torch.testing.assert_close(decode_reference(q, k, v, lengths, cache_leftpad=leftpad, **kw), got, atol=2e-6,
                               rtol=2e-5)
    for b in range(4):
        start, end = int(leftpad[b]), int(lengths[b])
        mask = chunk_mask(new_tokens, end - start, 12, causal)
        want = reference(q[b:b + 1], k[b:b + 1, :, start:end], v[b:b + 1, :, start:end], mask)
        torch.testing.assert_close(got[b:b + 1].double(), want, atol=2e-6, rtol=2e-5, msg=lambda m: f"row {b}: {m}")


def test_a_plan_takes_the_chunk():
    from flashlib.decode import DecodePlan

    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([40, 21], dtype=torch.int32)
    plan = DecodePlan(q, k, v, lengths, attention_chunk=8, num_splits=2)
    torch.testing.assert_close(plan.run(q, k, v, lengths), decode_attention(q, k, v, lengths, attention_chunk=8,
                                                                            num_splits=2), atol=0, rtol=0)


@pytest.mark.parametrize("bad, error, match", [
    (-1, ValueError, "'attention_chunk' is -1; it must be >= 1"),
    (True, TypeError, "'attention_chunk' must be None or an int"),
    (2.0, TypeError, "'attention_chunk' must be None or an int"),
])
def test_a_bad_chunk_is_named(bad, error, match):
    q, k, v = inputs(1, 1, 1, 8, 8, 8)
    for op in (flashlib.dense_attention, flashlib.flash_attention, flashlib.tiled_attention):
        with pytest.raises(error, match=match):
            op(q, k, v, attention_chunk=bad)
    with pytest.raises(error, match=match):
        decode_attention(q, k, v, torch.tensor([8], dtype=torch.int32), attention_chunk=bad)


def test_the_options_carry_the_chunk_across_an_op_and_a_path_refuses_what_it_lacks():
    q, k, v = inputs(1, 2, 2, 8, 8, 8)
    options = check_options("f", q, k, v, causal=True, attention_chunk=4)
    assert Options.from_op(options.op_numbers(), options.tensors) == options
    assert options.beyond_causal and options.masked and options.given() == ["causal", "scale", "attention_chunk"]
    with pytest.raises(ValueError, match="f: rung 3 does not implement 'attention_chunk'"):
        options.refuse_beyond("f", "rung 3")
    assert Options.of(causal=True, scale=0.5).refuse_beyond("f", "rung 3") == Options.of(causal=True, scale=0.5)


def test_a_compiled_graph_keeps_the_chunk():
    q, k, v = inputs(1, 2, 2, 24, 24, 8)
    compiled = torch.compile(lambda q, k, v: flashlib.flash_attention(q, k, v, causal=True, attention_chunk=8),
                             fullgraph=True, backend="eager")
    want = reference(q, k, v, chunk_mask(24, 24, 8, causal=True))
    torch.testing.assert_close(compiled(q, k, v).double(), want, atol=2e-6, rtol=2e-5)
