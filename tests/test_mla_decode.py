"""Absorbed MLA decoding (DeepSeek-V2/V3) and a value head dim of its own in flashlib.decode.

DeepSeek's multi-head latent attention written here from its definition in float64 (per head: keys
[c_kv W_UK_h, k_rope], values c_kv W_UV_h), against flashlib's absorbed decoding (queries
[q_nope_h W_UK_hᵀ, q_rope] over one latent cache [c_kv, k_rope], values its first columns, then
W_UV_h): contiguous and paged caches filled with NaN past every sequence's end, the aliasing path
chosen (the value tile taken from the key tile) and the general path equal to it; decode_attention
with dv != d against decode_reference and a float64 loop; the errors; and the kernels compiled at
576 / 512 for sm_80 and sm_90, each spec once, with the Triton that runs it (3.6.0 for sm_90, the
GPU check's H200; the pinned release for sm_80).
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from flashlib import decode
from flashlib.kernels.compile import SHARED_LIMIT

if importlib.util.find_spec("triton") is None:  # the kernels need Triton (Linux only)
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.kernels import decode as kernels  # noqa: E402
from tests.decode_compile import compile_decode, compiled_once, spec, spec_of  # noqa: E402
from tests.triton_versions import side_by_side, triton36_dir  # noqa: E402

F64 = torch.float64
NAN = float("nan")


# ----- DeepSeek's attention, from its definition ------------------------------------------------

def mla_weights(heads, latent, rope, nope, dv, g):
    """Per-head up-projections W_UK (heads, latent, nope) and W_UV (heads, latent, dv), float64, small."""
    return (torch.randn(heads, latent, nope, generator=g, dtype=F64) / math.sqrt(latent),
            torch.randn(heads, latent, dv, generator=g, dtype=F64) / math.sqrt(latent))


def naive_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, seqlens, scale):
    """float64 MLA, one sequence and head at a time: q_nope (B, H, n, nope), q_rope (B, H, n, rope),
    c_kv (B, L, latent), k_rope (B, L, rope); new token i of sequence b sits at seqlens[b] - n + i and
    sees keys 0 .. its position (causal). Returns (B, H, n, dv) = softmax(q kᵀ scale) v per head."""
    batch, heads, n, _ = q_nope.shape
    out = torch.zeros(batch, heads, n, w_uv.shape[-1], dtype=F64)
    for b in range(batch):
        length = int(seqlens[b])
        for h in range(heads):
            k = torch.cat((c_kv[b, :length] @ w_uk[h], k_rope[b, :length]), dim=-1)  # (L, nope + rope)
            v = c_kv[b, :length] @ w_uv[h]  # (L, dv)
            q = torch.cat((q_nope[b, h], q_rope[b, h]), dim=-1)  # (n, nope + rope)
            for i in range(n):
                seen = length - n + i + 1
                if seen <= 0:
                    continue
                p = torch.softmax((q[i] @ k[:seen].T) * scale, dim=-1)
                out[b, h, i] = p @ v[:seen]
    return out


def absorbed(q_nope, q_rope, w_uk):
    """q_abs (B, H, n, latent + rope) = [q_nope_h W_UK_hᵀ, q_rope]: the score against [c_kv, k_rope]."""
    return torch.cat((torch.einsum("bhnd,hcd->bhnc", q_nope, w_uk), q_rope), dim=-1)


def mla_case(batch=3, heads=8, n=1, latent=64, rope=16, nope=32, dv=24, capacity=80, seqlens=(37, 1, 70), seed=0):
    g = torch.Generator().manual_seed(seed)
    w_uk, w_uv = mla_weights(heads, latent, rope, nope, dv, g)
    q_nope = torch.randn(batch, heads, n, nope, generator=g, dtype=F64)
    q_rope = torch.randn(batch, heads, n, rope, generator=g, dtype=F64)
    c_kv = torch.randn(batch, capacity, latent, generator=g, dtype=F64)
    k_rope = torch.randn(batch, capacity, rope, generator=g, dtype=F64)
    lengths = torch.tensor(seqlens[:batch], dtype=torch.int32)
    cache = torch.cat((c_kv, k_rope), dim=-1)[:, None].clone()  # (B, 1, capacity, latent + rope)
    for b, length in enumerate(lengths.tolist()):
        cache[b, :, length:] = NAN  # read past a sequence's end and the output is NaN
    scale = 1 / math.sqrt(nope + rope)
    want = naive_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, lengths, scale)
    return dict(q=absorbed(q_nope, q_rope, w_uk), cache=cache, lengths=lengths, w_uv=w_uv, scale=scale, want=want,
                latent=latent)


def up(out_latent, w_uv):
    """(B, H, n, latent) -> (B, H, n, dv): each head's W_UV_h after the attention."""
    return torch.einsum("bhnc,hcv->bhnv", out_latent.to(F64), w_uv)


def shuffled_pages(cache, page_size, spare, seed=0):
    """cache (B, 1, capacity, W) in pages scattered by a shuffled table; unused pages and the tail of
    the last page hold NaN."""
    batch, heads, capacity, width = cache.shape
    per_seq = -(-capacity // page_size)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * per_seq + spare, generator=g)[:batch * per_seq]
    pages = torch.full((batch * per_seq + spare, heads, page_size, width), NAN, dtype=cache.dtype)
    padded = torch.full((batch, heads, per_seq * page_size, width), NAN, dtype=cache.dtype)
    padded[:, :, :capacity] = cache
    pages[order] = padded.reshape(batch, heads, per_seq, page_size, width).transpose(1, 2).reshape(
        batch * per_seq, heads, page_size, width)
    return pages, order.reshape(batch, per_seq).to(torch.int32)


# ----- absorbed decoding against the definition ---------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorbed_decoding_equals_deepseek_attention(n, dtype):
    c = mla_case(n=n)
    out = decode.mla_decode_attention(c["q"].to(dtype), c["cache"].to(dtype), c["lengths"], head_dim_v=c["latent"],
                                      scale=c["scale"], num_splits=3)
    assert out.shape == (3, 8, n, c["latent"]) and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(up(out, c["w_uv"]), c["want"], rtol=tol, atol=tol)
    ref = decode.mla_decode_attention(c["q"], c["cache"], c["lengths"], head_dim_v=c["latent"], scale=c["scale"],
                                      reference=True)
    torch.testing.assert_close(up(ref, c["w_uv"]), c["want"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("page_size", [8, 16])
def test_absorbed_decoding_over_shuffled_pages(page_size):
    c = mla_case(n=2, seed=1)
    pages, table = shuffled_pages(c["cache"].float(), page_size, spare=5)
    out = decode.mla_decode_attention(c["q"].float(), pages, c["lengths"], head_dim_v=c["latent"], scale=c["scale"],
                                      block_table=table, num_splits=2)
    torch.testing.assert_close(up(out, c["w_uv"]), c["want"], rtol=2e-5, atol=2e-5)


def test_deepseek_widths_576_and_512_at_a_tiny_length():
    # the real widths: latent 512 + rope 64, values 512; few heads, a short cache
    c = mla_case(batch=2, heads=4, latent=512, rope=64, nope=32, dv=16, capacity=40, seqlens=(33, 9), seed=2)
    out = decode.mla_decode_attention(c["q"].float(), c["cache"].float(), c["lengths"], scale=c["scale"])
    assert out.shape == (2, 4, 1, 512)
    torch.testing.assert_close(up(out, c["w_uv"]), c["want"], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("options", [dict(softcap=20.0), dict(window=(9, -1)), dict(causal=False, n=3),
                                     dict(sinks=True), dict(cache_leftpad=True)], ids=str)
def test_absorbed_decoding_takes_the_rest_of_the_contract(options):
    # the one-read path against the reference at the same inputs: score functions, windows, sinks, padding
    options = dict(options)
    c = mla_case(n=options.pop("n", 2), seed=6)
    q, cache = c["q"].float(), torch.nan_to_num(c["cache"].float())
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, 8)
    if options.pop("cache_leftpad", False):
        options["cache_leftpad"] = torch.tensor([5, 0, 30], dtype=torch.int32)
    common = dict(head_dim_v=c["latent"], scale=c["scale"], **options)
    out = decode.mla_decode_attention(q, cache, c["lengths"], num_splits=2, **common)
    ref = decode.mla_decode_attention(q.double(), cache.double(), c["lengths"], reference=True, **common)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_the_value_tile_is_taken_from_the_key_tile(monkeypatch):
    c = mla_case(seed=3)
    cache, latent = c["cache"].float(), c["latent"]
    assert kernels.values_in_keys(cache, cache[..., :latent])
    assert kernels.values_in_keys(cache, cache)  # the same tensor: dv == d, read once too
    assert not kernels.values_in_keys(cache, cache[..., :latent].clone())  # a copy: a storage of its own
    assert not kernels.values_in_keys(cache, cache[..., 8:8 + latent])  # not the leading columns
    assert not kernels.values_in_keys(cache, cache[:2, :, :, :latent])  # not every sequence
    launched = []
    real = kernels._decode_split

    class Spy:  # notes each stage-1 launch's V_FROM_K and runs it
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["V_FROM_K"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "_decode_split", Spy())
    q, lengths = c["q"].float(), c["lengths"]
    shared = decode.decode_attention(q, cache, cache[..., :latent], lengths, scale=c["scale"])
    separate = decode.decode_attention(q, cache, cache[..., :latent].clone(), lengths, scale=c["scale"])
    assert launched == [True, False]
    torch.testing.assert_close(shared, separate, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(up(shared, c["w_uv"]), c["want"], rtol=2e-5, atol=2e-5)
    # v_cache is k_cache: every column shared, none of the key's own
    same = decode.decode_attention(q, cache, cache, lengths, scale=c["scale"])
    assert launched == [True, False, True]
    ref = decode.decode_reference(q.double(), cache.double(), cache.double(), lengths, scale=c["scale"])
    torch.testing.assert_close(same.double(), ref, rtol=2e-5, atol=2e-5)


def test_absorbed_decoding_appends_latent_rows_in_place():
    c = mla_case(n=2, seqlens=(37, 5, 70), seed=4)
    cache, lengths = c["cache"].float(), c["lengths"]
    before = lengths - 2  # each sequence's last two rows arrive as kv_new
    kv_new = torch.stack([cache[b, :, n - 2:n] for b, n in enumerate(lengths.tolist())])  # (B, 1, 2, W)
    gapped = cache.clone()
    for b, n in enumerate(before.tolist()):
        gapped[b, :, n:] = NAN
    out = decode.mla_decode_attention(c["q"].float(), gapped, before, head_dim_v=c["latent"], scale=c["scale"],
                                      kv_new=kv_new)
    torch.testing.assert_close(up(out, c["w_uv"]), c["want"], rtol=2e-5, atol=2e-5)
    for b, n in enumerate(lengths.tolist()):  # written in place, the values' columns with the keys'
        torch.testing.assert_close(gapped[b, :, :n], cache[b, :, :n], rtol=0, atol=0)


# ----- a value head dim of its own, decode_attention ------------------------------------------------

def loop_decode(q, k, v, seqlens, scale):
    """float64, one (sequence, query head, new token) at a time; contiguous caches, GQA."""
    batch, q_heads, n, _ = q.shape
    group = q_heads // k.shape[1]
    out = torch.zeros(batch, q_heads, n, v.shape[-1], dtype=F64)
    for b in range(batch):
        for h in range(q_heads):
            for i in range(n):
                seen = int(seqlens[b]) - n + i + 1
                if seen > 0:
                    p = torch.softmax(q[b, h, i].double() @ k[b, h // group, :seen].double().T * scale, dim=-1)
                    out[b, h, i] = p @ v[b, h // group, :seen].double()
    return out


@pytest.mark.parametrize("d, dv", [(48, 24), (16, 40)])
def test_decode_attention_with_a_value_head_dim_of_its_own(d, dv):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 2, d, generator=g)
    k = torch.randn(2, 2, 50, d, generator=g)
    v = torch.randn(2, 2, 50, dv, generator=g)
    lengths = torch.tensor([45, 7], dtype=torch.int32)
    k[0, :, 45:], v[0, :, 45:], k[1, :, 7:], v[1, :, 7:] = NAN, NAN, NAN, NAN
    want = loop_decode(q, k, v, lengths, d ** -0.5)
    out, lse = decode.decode_attention(q, k, v, lengths, num_splits=3, return_lse=True)
    assert out.shape == (2, 4, 2, dv) and lse.shape == (2, 4, 2)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    ref, ref_lse = decode.decode_reference(q.double(), k.double(), v.double(), lengths, num_splits=3, return_lse=True)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)
    # paged, with new keys and values of their own widths appended in place
    k_pages, v_pages, table = decode.paged_cache(torch.nan_to_num(k), torch.nan_to_num(v), 16, spare_pages=2,
                                                 generator=torch.Generator().manual_seed(0))
    k_new, v_new = torch.randn(2, 2, 2, d, generator=g), torch.randn(2, 2, 2, dv, generator=g)
    k2, v2 = torch.nan_to_num(k).clone(), torch.nan_to_num(v).clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, :, n:n + 2], v2[b, :, n:n + 2] = k_new[b], v_new[b]
    out = decode.decode_attention(q, k_pages, v_pages, lengths, block_table=table, k_new=k_new, v_new=v_new)
    torch.testing.assert_close(out.double(), loop_decode(q, k2, v2, lengths + 2, d ** -0.5), rtol=2e-5, atol=2e-5)


def test_empty_batches_give_the_values_width():
    q, k, v = torch.zeros(0, 4, 1, 32), torch.zeros(0, 1, 8, 32), torch.zeros(0, 1, 8, 16)
    lengths = torch.zeros(0, dtype=torch.int32)
    assert decode.decode_attention(q, k, v, lengths).shape == (0, 4, 1, 16)
    assert decode.decode_reference(q, k, v, lengths).shape == (0, 4, 1, 16)


# ----- errors -----------------------------------------------------------------------------------

def test_errors_name_the_argument():
    q, cache = torch.zeros(1, 4, 1, 24), torch.zeros(1, 1, 16, 24)
    lengths = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="'head_dim_v' is 32.*1..24"):
        decode.mla_decode_attention(q, cache, lengths, head_dim_v=32)
    with pytest.raises(ValueError, match="'head_dim_v'"):
        decode.mla_decode_attention(q, cache, lengths, head_dim_v=0)
    with pytest.raises(ValueError, match="'q' is 16 wide but 'kv_cache' 24"):
        decode.mla_decode_attention(q[..., :16], cache, lengths, head_dim_v=16)
    with pytest.raises(ValueError, match="'k_new'.*kv_new"):
        decode.mla_decode_attention(q, cache, lengths, head_dim_v=16, k_new=cache[:, :, :1])
    with pytest.raises(ValueError, match="'rotary_cos'"):
        decode.mla_decode_attention(q, cache, lengths, head_dim_v=16, rotary_cos=torch.zeros(8, 4))
    with pytest.raises(ValueError, match="'v_new' has shape \\(1, 1, 1, 24\\); expected \\(1, 1, 1, 16\\)"):
        decode.decode_attention(q, cache, cache[..., :16], lengths, k_new=cache[:, :, :1], v_new=cache[:, :, :1])
    with pytest.raises(ValueError, match="'k_cache' .* and 'v_cache' .* same shape but for the head dim"):
        decode.decode_attention(q, cache, torch.zeros(1, 1, 8, 16), lengths)
    with pytest.raises(ValueError, match="'q' has head_dim 640.*1..576"):
        decode.decode_attention(torch.zeros(1, 4, 1, 640), torch.zeros(1, 1, 16, 640), torch.zeros(1, 1, 16, 8),
                                lengths)


def test_the_bytes_model_counts_the_latent_cache_once():
    got = decode.mla_bytes(batch=2, tokens=100, q_heads=4)
    assert got["shared"] == 2 * 100 * 576 * 2 + 2 * 4 * (576 + 512) * 2
    assert got["separate"] - got["shared"] == 2 * 100 * 512 * 2  # the value cache a separate copy adds
    assert 1.8 < decode.mla_bytes(batch=64, tokens=4096)["ratio"] < 1.9  # (576 + 512) / 576, almost


# ----- compiled for GPU targets at DeepSeek's widths ------------------------------------------------

# each target's two stage-1 shapes (128 rows paged, 16 contiguous) once, float16 and bfloat16 spread over
# them so that each dtype meets each target and each shape: the two dtypes compile alike (registers, shared
# memory, mma/wgmma counts identical in all 8 pairs with 3.7.1 and with 3.6.0; data/bench/LOG.md, 2026-12-08)
MLA_SPECS = [spec("split", cap, dtype, 576, head_dim_v=512, v_from_k=True, rows=rows, paged=paged)
             for cap, dtypes in (((8, 0), ("float16", "bfloat16")), ((9, 0), ("bfloat16", "float16")))
             for dtype, (rows, paged) in zip(dtypes, ((128, True), (16, False)))]
MLA_SPECS += [spec("merge", cap, "bfloat16", 576, head_dim_v=512, rows=128) for cap in ((8, 0), (9, 0))]


@pytest.fixture(scope="module")
def compiled_mla():
    """{version: {"reports": one per spec it compiled}}: each spec by the release that runs its target
    (side_by_side's by_target: 3.6.0 sm_90, the pinned Triton sm_80)."""
    return side_by_side(lambda specs, triton_path: compile_decode(specs, triton_path=triton_path), MLA_SPECS,
                        by_target=True)


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_mla_kernels_compile_without_spilling_for_sm80_and_sm90(compiled_mla, version):
    if version not in compiled_mla:
        triton36_dir()  # skips (locally) or fails (CI) with the reason
    reports = compiled_mla[version]["reports"]
    assert reports and compiled_once(compiled_mla, MLA_SPECS)  # 3.6.0 the sm_90 specs where it is installed
    for r in reports:
        s = spec_of(r, MLA_SPECS)
        assert r["ok"], (s, r["error"])
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0), (s, r["registers"])
        assert r["shared"] <= SHARED_LIMIT[tuple(s["capability"])], s
        if s["kernel"] == "split":
            assert r["mma_sync_ops"] + r["wgmma_ops"] > 0, s
