"""flash-attn's KV-cache contract in ``decode_attention``, against flash-attn's own reference.

The grid is ``test_flash_attn_kvcache``'s (causal or not, a window, ALiBi as a score function, new
keys and values appended, rotary embeddings of 0, half or all the head dim, interleaved or not,
fewer new keys than queries, paged caches, left padding, pooled caches by cache_batch_idx, MHA, MQA
and GQA), at the interpreter's sizes, checked with its rule (at most 3x, with ALiBi 5x, PyTorch's
own largest error in the kernel's precision, plus 1e-5) against its reference rewritten in
tests/kvcache_reference.py, and the cache as the call must leave it. What the CPU cannot run of
that grid: bfloat16 (the interpreter has none), 128k caches and head dim 256 at its lengths (time).
Mixed batches (cu_seqlens_q) are checked sequence by sequence against the same reference, cascade
decoding against decoding over the concatenated cache.
"""
from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

import flashlib
from flashlib import decode
from flashlib.rotary import apply_rotary

from .kvcache_reference import kvcache_reference, rotate

needs_kernels = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton ships Linux wheels only")


def _case(seed, *, seq_q=3, cap=37, d=32, mha="gqa", new_kv=True, causal=True, local=False, same_new=True,
          rotary_fraction=0.0, interleaved=False, paged=False, leftpad=False, batch_idx=False, alibi=False,
          slopes_dtype=torch.float32):
    """One case of flash-attn's grid, drawn as its test draws it: (kwargs for decode_attention, the
    reference's kwargs, q, caches, lengths)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads = 2, 6
    kv_heads = {"mha": 6, "mqa": 1, "gqa": 3}[mha]
    q = torch.randn(batch, heads, seq_q, d, generator=g)
    n_new = seq_q if same_new else int(torch.randint(1, seq_q + 1, (1,), generator=g))
    pool = 2 * batch if batch_idx else batch
    k_cache, v_cache = (torch.randn(pool, kv_heads, cap, d, generator=g) for _ in range(2))
    k_new = v_new = None
    if new_kv:
        k_new, v_new = (torch.randn(batch, kv_heads, n_new, d, generator=g) for _ in range(2))
    rotary_dim = int(rotary_fraction * d) // 2 * 2
    high = (cap - (seq_q if (causal or local) and rotary_dim > 1 else n_new) + 1) if new_kv else cap + 1
    lengths = torch.randint(0 if new_kv else 1, high, (batch,), generator=g, dtype=torch.int32)
    pads = None
    if leftpad:
        pads = torch.stack([torch.randint(0, int(n), (1,), generator=g)[0] if n > 0 else torch.tensor(0)
                            for n in lengths]).to(torch.int32)
    idx = torch.randperm(pool, generator=g)[:batch].to(torch.int32) if batch_idx else None
    window = (-1, -1) if not local else tuple(int(x) for x in torch.randint(0, cap, (2,), generator=g))
    ours = dict(k_new=k_new, v_new=v_new, causal=causal, window=window, cache_batch_idx=idx, cache_leftpad=pads)
    ref = dict(k_new=k_new, v_new=v_new, causal=causal, window=window, cache_batch_idx=idx, cache_leftpad=pads)
    if rotary_dim:
        angle = torch.rand(cap, rotary_dim // 2, generator=g) * 2 * torch.pi
        ours.update(rotary_cos=angle.cos(), rotary_sin=angle.sin(), rotary_interleaved=interleaved)
        ref.update(rotary=(angle.cos(), angle.sin()), interleaved=interleaved)
    if alibi:  # flash-attn's ALiBi: -slope * |i - j| per (batch row, head), a score function here
        slopes = (torch.rand(batch, heads, generator=g) * 0.3).to(slopes_dtype)
        ours["score_mod"] = lambda s, b, h, q_idx, kv_idx: s - slopes[b, h] * (q_idx - kv_idx).abs()
        ref["bias"] = lambda b, h, i, j: -slopes.double()[b, h] * (i - j).abs()
    return ours, ref, q, k_cache, v_cache, lengths


def _pytorch_error(q, k_cache, v_cache, lengths, ref, want):
    """flash-attn's baseline: its reference in the kernel's precision (float32) against float64."""
    out32, _ = kvcache_reference(q, k_cache, v_cache, lengths, dtype=torch.float32, **ref)
    return (out32.double() - want).abs().max().item()


# flash-attn's grid, pruned as its test prunes it and sampled to the CPU's time: every option
# appears with and without each other one in a seeded draw of the full product
_FLAGS = dict(mha=["mha", "mqa", "gqa"], new_kv=[False, True], causal=[False, True], local=[False, True],
              same_new=[True, False], rotary_fraction=[0.0, 0.5, 1.0], interleaved=[False, True],
              paged=[False, True], leftpad=[False, True], batch_idx=[False, True], alibi=[False, True])


def _grid():
    cases = []
    for values in itertools.product(*_FLAGS.values()):
        c = dict(zip(_FLAGS, values))
        if (not c["new_kv"] and c["rotary_fraction"] > 0) or (c["batch_idx"] and c["paged"]) or \
                (c["rotary_fraction"] == 0 and c["interleaved"]):
            continue
        cases.append(c)
    picked = torch.randperm(len(cases), generator=torch.Generator().manual_seed(0))[:40].tolist()
    shapes = [(1, 37, 32), (3, 37, 59), (5, 64, 16), (3, 23, 40)]  # (seq_q, capacity, head_dim)
    return [dict(cases[i], **dict(zip(("seq_q", "cap", "d"), shapes[n % len(shapes)]))) for n, i in enumerate(picked)]


GRID = _grid()


@needs_kernels
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if v not in (False, 0.0)))
def test_flash_attn_kvcache_grid(case):
    ours, ref, q, k_cache, v_cache, lengths = _case(sum(map(ord, str(case))) % 1000, **case)
    want, (k_want, v_want) = kvcache_reference(q, k_cache, v_cache, lengths, **ref)
    baseline = _pytorch_error(q, k_cache, v_cache, lengths, ref, want)
    table = None
    if case["paged"]:
        k_cache, v_cache, table = decode.paged_cache(k_cache, v_cache, 8, spare_pages=3,
                                                     generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = flashlib.decode_attention(q, k_cache, v_cache, lengths, block_table=table, **ours)
    error = (out.double() - want).abs().max().item()
    assert error <= (5 if case["alibi"] else 3) * baseline + 1e-5, (error, baseline)
    if case["new_kv"]:  # the cache as flash-attn leaves it: the new (rotated) keys written in place
        if table is not None:
            k_seen, v_seen = (decode.gather_cache(c, table, k_want.shape[2]) for c in (k_cache, v_cache))
        elif case["batch_idx"]:
            k_seen, v_seen = (c[ours["cache_batch_idx"].long()] for c in (k_cache, v_cache))
        else:
            k_seen, v_seen = k_cache, v_cache
        torch.testing.assert_close(k_seen.double(), k_want, rtol=1e-5, atol=1e-5)
        assert torch.equal(v_seen.double(), v_want)


@needs_kernels
@pytest.mark.parametrize("mha", ["gqa", "mqa"])
def test_padding_rows_read_nothing_past_a_score_functions_table(mha):
    # decoding stacks a kv head's query heads into one tile, padded to a power of two: the padding rows
    # must not index past the heads. The table is a view whose neighbours are inf, so a read past it
    # gives inf * 0 (an error under the interpreter) and a wrong row on a GPU
    g = torch.Generator().manual_seed(3)
    heads, kv_heads = 6, {"gqa": 3, "mqa": 1}[mha]
    q = torch.randn(2, heads, 3, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, 20, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([17, 9], dtype=torch.int32)
    room = torch.full((2, 32), float("inf"))
    room[:, :heads] = torch.rand(2, heads, generator=g) * 0.3
    slopes = room[:, :heads]
    with torch.no_grad():
        out = flashlib.decode_attention(q, k, v, lengths, causal=True,
                                        score_mod=lambda s, b, h, q_idx, kv_idx: s - slopes[b, h] * (q_idx - kv_idx).abs())
    want, _ = kvcache_reference(q, k, v, lengths, causal=True,
                                bias=lambda b, h, i, j: -slopes.double()[b, h] * (i - j).abs())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("index", ["q_idx", "kv_idx"])
def test_positions_outside_the_sequence_read_nothing_before_a_score_functions_table(index):
    # keys before a sequence's start (left padding not on a tile's edge) and rows before the cache
    # (fewer keys than new tokens) have negative positions; they see nothing, and a score function must
    # not read before its table for them: its neighbour is inf, and inf * (index + 1) = inf * 0 at -1
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k, v = (torch.randn(2, 2, 24, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([17, 3], dtype=torch.int32)
    pads = torch.tensor([3, 0], dtype=torch.int32)
    room = torch.full((40,), float("inf"))
    room[8:32] = torch.rand(24, generator=g) * 0.1
    table = room[8:32]
    if index == "kv_idx":
        score_mod = lambda s, b, h, q_idx, kv_idx: s - table[kv_idx] * (kv_idx + 1)  # noqa: E731
        bias = lambda b, h, i, j: -table.double()[j.clamp(min=0)] * (j + 1)  # noqa: E731
    else:
        score_mod = lambda s, b, h, q_idx, kv_idx: s - table[q_idx] * (q_idx + 1)  # noqa: E731
        bias = lambda b, h, i, j: -table.double()[i.clamp(min=0)] * (i + 1)  # noqa: E731
    with torch.no_grad():
        out = flashlib.decode_attention(q, k, v, lengths, causal=True, cache_leftpad=pads, score_mod=score_mod)
    want, _ = kvcache_reference(q, k, v, lengths, causal=True, cache_leftpad=pads, bias=bias)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)


@needs_kernels
def test_rows_before_the_cache_see_nothing_and_give_zeros():
    # cache_seqlens below the new tokens: flash-attn's zero rows (and lse -inf), here with 2 of 5
    q = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(0))
    k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    lengths = torch.tensor([3], dtype=torch.int32)
    with torch.no_grad():
        out, lse = flashlib.decode_attention(q, k, v, lengths, return_lse=True)
    want, _ = kvcache_reference(q, k, v, lengths)
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 16)) and torch.isneginf(lse[:, :, :2]).all()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("append", [False, True])
def test_a_mixed_batch_is_each_sequence_alone(append):
    # a prefill chunk of 6 tokens, two decoding steps, an empty sequence and one of 3: one launch
    g = torch.Generator().manual_seed(3)
    counts, heads, kv_heads, d, cap = [6, 1, 0, 1, 3], 4, 2, 16, 40
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    total, batch = int(cu[-1]), len(counts)
    q = torch.randn(total, heads, d, generator=g)
    k_cache, v_cache = (torch.randn(batch, kv_heads, cap, d, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(total, kv_heads, d, generator=g) for _ in range(2))
    lengths = torch.tensor([10, 30, 5, 0, 3], dtype=torch.int32) + (0 if append else torch.tensor(counts,
                                                                                                  dtype=torch.int32))
    angle = torch.rand(cap, 4, generator=g)
    extra = dict(k_new=k_new, v_new=v_new, rotary_cos=angle.cos(), rotary_sin=angle.sin()) if append else {}
    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        out, lse = flashlib.decode_attention(q, k_ours, v_ours, lengths, cu_seqlens_q=cu[::1], return_lse=True,
                                             **extra)
    assert out.shape == q.shape and lse.shape == (heads, total)
    for b, n in enumerate(counts):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = q[rows].transpose(0, 1)[None]
        ref = {}
        if append:
            ref = dict(k_new=k_new[rows].transpose(0, 1)[None], v_new=v_new[rows].transpose(0, 1)[None],
                       rotary=(angle.cos(), angle.sin()))
        want, (k_want, _) = kvcache_reference(one, k_cache[b:b + 1], v_cache[b:b + 1], lengths[b:b + 1], **ref)
        torch.testing.assert_close(out[rows].transpose(0, 1)[None].double(), want, rtol=0, atol=2e-6)
        torch.testing.assert_close(k_ours[b:b + 1].double(), k_want, rtol=0, atol=1e-6)


def test_the_reference_takes_the_same_contract():
    # decode_reference in float64 against flash-attn's reference, every argument at once
    ours, ref, q, k_cache, v_cache, lengths = _case(5, seq_q=4, mha="gqa", causal=True, local=True, same_new=False,
                                                    rotary_fraction=0.5, interleaved=True, leftpad=True,
                                                    batch_idx=True, alibi=True, slopes_dtype=torch.float64)
    want, _ = kvcache_reference(q, k_cache, v_cache, lengths, **ref)
    doubled = {name: value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
               for name, value in ours.items()}
    got = decode.decode_reference(q.double(), k_cache.double(), v_cache.double(), lengths, num_splits=3, **doubled)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rotary_matches_transformers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 12, generator=g, dtype=torch.float64)
    angle = torch.rand(20, 4, generator=g, dtype=torch.float64) * 6
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 9]])
    for interleaved in (False, True):  # 8 of 12 dims turn: Llama's halves, GPT-J's pairs
        want = rotate(x, angle.cos(), angle.sin(), positions, interleaved)
        got = apply_rotary(x, angle.cos(), angle.sin(), positions[:, None, :], interleaved=interleaved)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
        assert torch.equal(got[..., 8:], x[..., 8:])


def _contract_error(name):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 16, generator=g)
    k, v = (torch.randn(2, 2, 10, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([5, 8], dtype=torch.int32)
    k_new = torch.randn(2, 2, 2, 16, generator=g)
    cos = torch.ones(10, 4)
    calls = {
        "k_new alone": (dict(k_new=k_new), ValueError, "'k_new' and 'v_new'"),
        "k_new shape": (dict(k_new=k_new[:, :1], v_new=k_new[:, :1]), ValueError, "'k_new'"),
        "k_new dtype": (dict(k_new=k_new.double(), v_new=k_new.double()), TypeError, "'k_new'"),
        "appended past the capacity": (dict(k_new=k_new, v_new=k_new, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32)),
                                       ValueError, "cache_seqlens"),
        "rotary without k_new": (dict(rotary_cos=cos, rotary_sin=cos), ValueError, "'rotary_cos'"),
        "rotary alone": (dict(k_new=k_new, v_new=k_new, rotary_cos=cos), ValueError, "'rotary_sin'"),
        "rotary too short": (dict(k_new=k_new, v_new=k_new, rotary_cos=cos[:6], rotary_sin=cos[:6]), ValueError,
                             "'rotary_cos'"),
        "rotary too wide": (dict(k_new=k_new, v_new=k_new, rotary_cos=torch.ones(10, 9), rotary_sin=torch.ones(10, 9)),
                            ValueError, "rotary_dim"),
        "batch idx dtype": (dict(cache_batch_idx=torch.tensor([0, 1])), TypeError, "'cache_batch_idx'"),
        "batch idx range": (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                            "'cache_batch_idx'"),
        "batch idx and table": (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32),
                                     block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "'block_table'"),
        "leftpad past the length": (dict(cache_leftpad=torch.tensor([6, 0], dtype=torch.int32)), ValueError,
                                    "'cache_leftpad'"),
        "leftpad shape": (dict(cache_leftpad=torch.tensor([0], dtype=torch.int32)), ValueError, "'cache_leftpad'"),
        "cu_seqlens_q with a 4-d q": (dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError,
                                      "packed"),
        "max_seqlen_q": (dict(q=q[0].transpose(0, 1), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                              max_seqlen_q=0), ValueError, "'max_seqlen_q'"),
        "causal": (dict(causal=1), TypeError, "'causal'"),
    }
    kwargs, error, word = calls[name]
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths)
    args.update(kwargs)
    return args, error, word


@needs_kernels
@pytest.mark.parametrize("name", ["k_new alone", "k_new shape", "k_new dtype", "appended past the capacity",
                                  "rotary without k_new", "rotary alone", "rotary too short", "rotary too wide",
                                  "batch idx dtype", "batch idx range", "batch idx and table",
                                  "leftpad past the length", "leftpad shape", "cu_seqlens_q with a 4-d q",
                                  "max_seqlen_q", "causal"])
def test_bad_contract_arguments_are_named_and_write_nothing(name):
    args, error, word = _contract_error(name)
    cache = args["k_cache"]
    before = cache.clone()
    with pytest.raises(error, match=word), torch.no_grad():
        flashlib.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"),
                                  **args)
    assert torch.equal(cache, before)  # checked before anything is written


# ----- shared prefixes ------------------------------------------------------------------------------

def _group(seed=0, *, batch=3, heads=4, kv_heads=2, n=2, d=16, prefix=50, cap=20, lengths=(20, 2, 11)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g)
    prefix_k, prefix_v = (torch.randn(kv_heads, prefix, d, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, kv_heads, cap, d, generator=g) for _ in range(2))
    return q, prefix_k, prefix_v, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32)


def _concatenated(prefix_k, prefix_v, k_cache, v_cache):
    batch = k_cache.shape[0]
    return [torch.cat((p[None].expand(batch, -1, -1, -1), c), dim=2) for p, c in ((prefix_k, k_cache),
                                                                                    (prefix_v, v_cache))]


@needs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_cascade_decoding_is_decoding_over_the_concatenated_cache(paged):
    q, pk, pv, kc, vc, lengths = _group()
    full_k, full_v = _concatenated(pk, pv, kc, vc)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    plain, _ = kvcache_reference(q, full_k, full_v, lengths + pk.shape[1])
    want_out, want_lse = decode.decode_reference(q.double(), full_k.double(), full_v.double(), lengths + pk.shape[1],
                                                 softcap=3.0, sinks=sinks, return_lse=True)
    table = None
    if paged:
        kc, vc, table = decode.paged_cache(kc, vc, 4, spare_pages=2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = decode.cascade_attention(q, pk, pv, kc, vc, lengths, block_table=table)
        torch.testing.assert_close(out.double(), plain, rtol=0, atol=1e-6)
        out, lse = decode.cascade_attention(q, pk, pv, kc, vc, lengths, block_table=table, softcap=3.0, sinks=sinks,
                                            return_lse=True)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-6)


def test_cascade_reference_in_float64():
    q, pk, pv, kc, vc, lengths = _group(1, batch=4, heads=6, kv_heads=3, n=3, lengths=(20, 3, 9, 14))
    full_k, full_v = _concatenated(pk, pv, kc, vc)
    want, _ = kvcache_reference(q, full_k, full_v, lengths + pk.shape[1])
    got = decode.cascade_attention(q.double(), pk.double(), pv.double(), kc.double(), vc.double(), lengths,
                                   reference=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_cascade_reads_the_prefix_once_per_block_of_stacked_rows():
    # 32 requests sharing 4096 positions, 8 kv heads of 128 with 4 query heads each, one new token
    counts = decode.cascade_bytes(batch=32, kv_heads=8, rows_per_kv_head=4, prefix=4096, suffix=256, head_dim=128)
    per_position = 2 * 8 * 128 * 2
    assert counts["prefix_reads"] == 2  # 128 stacked rows per kv head: two blocks of 64
    assert counts["plain"] == 32 * (4096 + 256) * per_position
    assert counts["cascade"] == (2 * 4096 + 32 * 256) * per_position
    assert decode.cascade_bytes(batch=1, kv_heads=8, rows_per_kv_head=4, prefix=4096, suffix=256,
                                head_dim=128)["ratio"] == 1.0  # one request: nothing shared


def test_cascade_errors_name_the_argument():
    q, pk, pv, kc, vc, lengths = _group()
    with pytest.raises(ValueError, match="'prefix_k'"):
        decode.cascade_attention(q, pk[:1], pv[:1], kc, vc, lengths, reference=True)
    with pytest.raises(TypeError, match="'prefix_v'"):
        decode.cascade_attention(q, pk, pv.double(), kc, vc, lengths, reference=True)
    with pytest.raises(ValueError, match="'cache_seqlens'"):
        decode.cascade_attention(q, pk, pv, kc, vc, torch.tensor([20, 1, 11], dtype=torch.int32), reference=True)


@needs_kernels
def test_every_new_argument_may_be_a_strided_view():
    # index tensors taken every other element, k_new and v_new transposed views, rotary tables sliced
    ours, ref, q, k_cache, v_cache, lengths = _case(11, seq_q=3, mha="gqa", same_new=True, rotary_fraction=0.5,
                                                    leftpad=True, batch_idx=True)
    want, _ = kvcache_reference(q, k_cache, v_cache, lengths, **ref)
    strided = dict(ours)
    for name in ("cache_leftpad", "cache_batch_idx"):
        strided[name] = torch.stack((ours[name], torch.zeros_like(ours[name])), dim=1).flatten()[::2]
    strided["k_new"], strided["v_new"] = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in
                                          (ours["k_new"], ours["v_new"]))
    for name in ("rotary_cos", "rotary_sin"):
        strided[name] = torch.stack((ours[name], ours[name]), dim=2).flatten(1)[:, ::2]  # the same table
    assert not strided["cache_leftpad"].is_contiguous() and not strided["k_new"].is_contiguous()
    long_lengths = torch.stack((lengths, lengths), dim=1).flatten()[::2]
    with torch.no_grad():
        out = flashlib.decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache,
                                        long_lengths, **strided)
    baseline = _pytorch_error(q, k_cache, v_cache, lengths, ref, want)
    assert (out.double() - want).abs().max().item() <= 3 * baseline + 1e-5
