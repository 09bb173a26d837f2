"""flashlib.decode and flashlib.kernels.decode: decoding with a KV cache.

The plain-PyTorch reference against explicit loops in float64; the split-KV kernels, through
Triton's CPU interpreter, against the reference in float64 (batch, ragged cache_seqlens, 1-4 new
tokens, split counts from 1 to more than the cache has tiles, paged caches with shuffled block
tables, GQA, windows, soft-capping); the split rule; the errors; greedy generation with a growing
cache; and both kernels compiled for sm_75, sm_80 and sm_90, each spec once, with the Triton that runs
it (3.6.0 for sm_90: the GPU check's H200 runs it; the pinned release for the others), and the
launchers bound and compiled for sm_90 by both releases.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlib
from flashlib import decode
from flashlib.kernels.compile import SHARED_LIMIT

if importlib.util.find_spec("triton") is None:  # the kernels need Triton (Linux only)
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.kernels import decode as kernels  # noqa: E402
from flashlib.kernels.function import kernel_score  # noqa: E402
from flashlib.machinery.options import Options  # noqa: E402
from tests.decode_compile import compile_decode, compiled_once, decode_forward, spec, spec_of  # noqa: E402
from tests.triton_versions import side_by_side, triton36_dir  # noqa: E402

F64 = torch.float64


def loop_decode(q, k, v, seqlens, *, scale=None, softcap=0.0, window_left=-1):
    """Float64, one (sequence, query head, new token) at a time, from the definitions; contiguous
    caches (batch, kv_heads, capacity, d)."""
    batch, q_heads, new_tokens, d = q.shape
    group = q_heads // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q.shape, dtype=F64)
    for b in range(batch):
        for h in range(q_heads):
            for i in range(new_tokens):
                pos = int(seqlens[b]) - new_tokens + i
                keys = [j for j in range(pos + 1) if window_left < 0 or j >= pos - window_left]
                s = torch.stack([(q[b, h, i].double() * k[b, h // group, j].double()).sum() * scale for j in keys])
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                p = torch.softmax(s, 0)
                out[b, h, i] = (p[:, None] * v[b, h // group, keys].double()).sum(0)
    return out


def case(batch=2, q_heads=4, kv_heads=2, new_tokens=2, head_dim=16, capacity=40, seed=0, dtype=torch.float32,
         lengths=None):
    """q (B, Hq, Nnew, d), caches (B, Hkv, capacity, d), ragged lengths (B,) int32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, new_tokens, head_dim, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g, dtype=dtype) for _ in range(2))
    if lengths is None:
        lengths = torch.randint(new_tokens, capacity + 1, (batch,), generator=g)
    return q, k, v, torch.as_tensor(lengths, dtype=torch.int32)


def as64(*tensors):
    return [t.double() for t in tensors]


# ----- the reference ------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, dict(window=(5, 0)), dict(softcap=2.5), dict(window=(0, -1), softcap=30.0),
                                     dict(scale=0.3, window=(3, 7))])
@pytest.mark.parametrize("num_splits", [1, 3, 50])
def test_reference_is_attention_over_the_visible_cache(options, num_splits):
    q, k, v, lengths = case(batch=3, q_heads=6, kv_heads=2, new_tokens=3, capacity=30, dtype=F64)
    got = decode.decode_reference(q, k, v, lengths, num_splits=num_splits, **options)
    window_left = options.get("window", (-1, -1))[0]
    want = loop_decode(q, k, v, lengths, scale=options.get("scale"), softcap=options.get("softcap", 0.0),
                       window_left=window_left)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_partials_cover_the_visible_keys_once_and_merge_to_the_whole():
    q, k, v, lengths = case(batch=1, new_tokens=1, capacity=40, lengths=[37], dtype=F64)
    (parts,) = decode.decode_partials(q, k, v, lengths, num_splits=4)
    assert [(start, stop) for start, stop, _, _ in parts] == [(0, 10), (10, 20), (20, 30), (30, 37)]
    out, lse = decode.decode_reference(q, k, v, lengths, return_lse=True)
    weights = torch.stack([torch.exp(part_lse - lse[0]) for _, _, _, part_lse in parts])  # shares of the sum
    torch.testing.assert_close(weights.sum(0), torch.ones_like(lse[0]), rtol=0, atol=1e-12)


@given(seqlen=st.integers(0, 300), new_tokens=st.integers(0, 4), num_splits=st.integers(1, 40),
       window_left=st.integers(-1, 50), block=st.sampled_from([1, 16, 32]), chunk=st.sampled_from([0, 1, 7, 64]),
       start=st.integers(0, 20))
def test_split_bounds_cut_the_visible_span_into_whole_tiles(seqlen, new_tokens, num_splits, window_left, block, chunk,
                                                            start):
    """The first key any new token sees: its window's left edge, its chunk's start (chunks counted from the
    sequence's start), the sequence's start; rounded down to a tile."""
    new_tokens, start = min(new_tokens, seqlen), min(start, seqlen)
    rule = flashlib.rules.Visibility(True, (window_left, -1), chunk=chunk)
    bounds = decode.split_bounds(seqlen, new_tokens, num_splits, rule=rule, block=block, start=start)
    position = seqlen - new_tokens  # the first new token's
    first = max(start, 0 if window_left < 0 else position - window_left)
    if chunk and position >= start:
        first = max(first, start + (position - start) // chunk * chunk)
    first = first // block * block
    assert len(bounds) == num_splits and bounds[0][0] == first and bounds[-1][1] == seqlen
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, disjoint, in order
    assert all(start % block == 0 or start == seqlen for start, _ in bounds)


def test_a_paged_cache_holds_the_same_keys():
    _, k, v, _ = case(batch=3, capacity=37)
    k_pages, v_pages, table = decode.paged_cache(k, v, 8, spare_pages=4, generator=torch.Generator().manual_seed(1))
    assert k_pages.shape == (3 * 5 + 4, 2, 8, 16) and table.shape == (3, 5) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) != list(range(15))  # scattered, not in order
    torch.testing.assert_close(decode.gather_cache(k_pages, table, 37), k, rtol=0, atol=0)
    torch.testing.assert_close(decode.gather_cache(v_pages, table, 20), v[:, :, :20], rtol=0, atol=0)


def test_cache_bytes():
    # 32 layers, 8 kv heads of 128, bf16: 128 KiB per token
    assert decode.kv_cache_bytes(layers=32, batch=1, kv_heads=8, tokens=1, head_dim=128) == 128 * 1024


# ----- the kernels against float64 ----------------------------------------------------------------

def run_kernels(q, k, v, lengths, *, table=None, num_splits=None, block_k=16, **options):
    scale = options.get("scale") or 1 / math.sqrt(q.shape[-1])
    score = kernel_score(Options(softcap=options.get("softcap") or 0.0), q.device)  # soft-capping: a score function
    window = options.get("window") or (-1, -1)
    return decode_forward(q, k, v, lengths, options=Options.of(causal=True, scale=scale, window=(window[0], -1)), block_table=table,
                          score=score, num_splits=num_splits, config=kernels.DecodeConfig(block_k, 4, 1))


@pytest.mark.parametrize("page_size", [None, 8, 16, 32])
def test_every_split_count_gives_the_same_output(page_size):
    # 70 keys in tiles of 16: 5 tiles; 1 to 9 splits, the last ones more splits than tiles; pages of 8 (a
    # tile spans two: a page number per key), 16 and 32 (a tile lies in one page: one page number per tile)
    q, k, v, lengths = case(batch=3, q_heads=4, kv_heads=1, new_tokens=4, capacity=70, lengths=[70, 4, 41])
    want, want_lse = decode.decode_reference(*as64(q, k, v), lengths, return_lse=True)
    table = None
    if page_size:
        k, v, table = decode.paged_cache(k, v, page_size, spare_pages=5, generator=torch.Generator().manual_seed(0))
    for num_splits in (1, 2, 3, 5, 9):
        out, lse = run_kernels(q, k, v, lengths, table=table, num_splits=num_splits)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)


@settings(max_examples=max(4, settings.default.max_examples // 3))
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       new_tokens=st.integers(1, 4), head_dim=st.sampled_from([8, 16, 40]), capacity=st.integers(4, 90),
       num_splits=st.integers(1, 9), page_size=st.sampled_from([None, 1, 5, 16]), block_k=st.sampled_from([16, 32]),
       window_left=st.sampled_from([-1, 0, 3, 20]), softcap=st.sampled_from([None, 1.5]), seed=st.integers(0, 99))
def test_kernels_match_float64(batch, kv_heads, group, new_tokens, head_dim, capacity, num_splits, page_size,
                               block_k, window_left, softcap, seed):
    new_tokens = min(new_tokens, capacity)
    q, k, v, lengths = case(batch, kv_heads * group, kv_heads, new_tokens, head_dim, capacity, seed)
    options = dict(window=(window_left, 0), softcap=softcap)
    want = decode.decode_reference(*as64(q, k, v), lengths, **options)
    table = None
    if page_size is not None:
        k, v, table = decode.paged_cache(k, v, page_size, spare_pages=2, generator=torch.Generator().manual_seed(seed))
    out, _ = run_kernels(q, k, v, lengths, table=table, num_splits=num_splits, block_k=block_k, **options)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-6)


def test_the_public_function_in_float16_within_rounding():
    q, k, v, lengths = case(batch=2, q_heads=8, kv_heads=2, new_tokens=1, head_dim=64, capacity=100)
    want = decode.decode_reference(*as64(q, k, v), lengths)
    got = flashlib.decode_attention(q.half(), k.half(), v.half(), lengths, num_splits=4)
    assert got.dtype == torch.float16
    # float16 rounding of the inputs and output: about 1e-3 of the values
    torch.testing.assert_close(got.double(), want, rtol=0, atol=4e-3)
    k_pages, v_pages, table = decode.paged_cache(k.half(), v.half(), 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(flashlib.decode_attention(q.half(), k_pages, v_pages, lengths, block_table=table), got,
                               rtol=0, atol=1e-3)


def test_nothing_to_do_gives_empty_outputs():
    q, k, v, _ = case(batch=2, new_tokens=1)
    empty = q[:, :, :0]  # no new tokens
    assert flashlib.decode_attention(empty, k, v, torch.tensor([0, 5], dtype=torch.int32)).shape == empty.shape
    assert flashlib.decode_attention(q[:0], k[:0], v[:0], torch.zeros(0, dtype=torch.int32)).shape == (0, 4, 1, 16)


# ----- the split rule -----------------------------------------------------------------------------

def test_the_split_rule():
    h200 = 132
    # one wave of two programs per multiprocessor: 264 programs at most, never a second, part-filled wave
    assert kernels.choose_num_splits(1 * 8, 65536, h200) == 33  # 264 programs
    assert kernels.choose_num_splits(8 * 8, 65536, h200) == 4  # 256, where ceil would give 5: 320, 1.2 waves
    assert kernels.choose_num_splits(100, 65536, h200) == 2
    assert kernels.choose_num_splits(8, 1024, h200) == 4  # at least 256 keys per split
    assert kernels.choose_num_splits(1, 10 ** 6, h200) == kernels.MAX_SPLITS
    assert kernels.choose_num_splits(300, 65536, h200) == 1  # enough programs already
    assert kernels.choose_num_splits(8, 65536, None) == 1  # the interpreter runs programs one by one
    q, k, _, _ = case()
    assert kernels.default_num_splits(q, k) == 1  # CPU tensors: the interpreter


# ----- errors -------------------------------------------------------------------------------------

def _bad(name):
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=2, capacity=10, lengths=[5, 10])
    k_pages, v_pages, table = decode.paged_cache(k, v, 4, generator=torch.Generator().manual_seed(0))
    paged = dict(k_cache=k_pages, v_cache=v_pages, block_table=table)
    calls = {
        "long": (dict(cache_seqlens=torch.tensor([5, 11], dtype=torch.int32)), ValueError, "cache_seqlens"),
        "long paged": (dict(paged, cache_seqlens=torch.tensor([13, 5], dtype=torch.int32)), ValueError,
                       "cache_seqlens"),
        "page out of range": (dict(paged, block_table=table.index_fill(1, torch.tensor([1]), 99)), ValueError,
                              "block_table"),
        "negative page": (dict(paged, block_table=table.index_fill(1, torch.tensor([0]), -1)), ValueError,
                          "block_table"),
        "table dtype": (dict(paged, block_table=table.long()), TypeError, "block_table"),
        "lengths dtype": (dict(cache_seqlens=lengths.long()), TypeError, "cache_seqlens"),
        "lengths shape": (dict(cache_seqlens=lengths[:1]), ValueError, "cache_seqlens"),
        "heads": (dict(q=torch.randn(2, 3, 2, 16)), ValueError, "heads"),
        "head_dim": (dict(k_cache=k[..., :8], v_cache=v[..., :8]), ValueError, "head_dim"),
        "cache dtype": (dict(k_cache=k.half()), TypeError, "k_cache"),
        "caches differ": (dict(v_cache=v[:, :, :8]), ValueError, "v_cache"),
        "batch": (dict(k_cache=k[:1], v_cache=v[:1]), ValueError, "k_cache"),
        "rank": (dict(q=q[0]), ValueError, "'q'"),
        "float64": (dict(q=q.double(), k_cache=k.double(), v_cache=v.double()), TypeError, "float64"),
        "integer q": (dict(q=q.long(), k_cache=k.long(), v_cache=v.long()), TypeError, "'q'"),
        "window": (dict(window=(-2, 0)), ValueError, "window"),
        "window type": (dict(window=5), TypeError, "window"),
        "softcap": (dict(softcap=-1.0), ValueError, "softcap"),
        "splits": (dict(num_splits=0), ValueError, "num_splits"),
        "splits type": (dict(num_splits=2.0), TypeError, "num_splits"),
        "scale": (dict(scale=float("nan")), TypeError, "scale"),
    }
    kwargs, error, word = calls[name]
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths)
    args.update(kwargs)
    return args, error, word


@pytest.mark.parametrize("name", ["long", "long paged", "page out of range", "negative page", "table dtype",
                                  "lengths dtype", "lengths shape", "heads", "head_dim", "cache dtype",
                                  "caches differ", "batch", "rank", "float64", "integer q", "window", "window type",
                                  "softcap", "splits", "splits type", "scale"])
def test_bad_input_names_the_argument(name):
    args, error, word = _bad(name)
    with pytest.raises(error, match=word):
        flashlib.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"),
                                  **args)


def test_inference_only():
    q, k, v, lengths = case()
    with pytest.raises(ValueError, match="'q' requires grad.*no_grad"):
        flashlib.decode_attention(q.requires_grad_(), k, v, lengths)
    with torch.no_grad():
        flashlib.decode_attention(q, k, v, lengths)


def test_the_package_exports_it():
    assert flashlib.decode_attention is decode.decode_attention
    assert flashlib.decode_reference is decode.decode_reference
    assert {"decode_attention", "decode_reference"} <= set(flashlib.__all__)


# ----- generation with a growing cache ----------------------------------------------------------

def test_greedy_generation_with_a_cache_gives_the_same_tokens():
    from flashlib.course.training import generate, generate_cached, train_model

    model, _ = train_model(flashlib.dense_attention, steps=30, seed=0)
    prompt = torch.randint(1, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    without = generate(model, prompt, 12)
    assert without.shape == (2, 17)
    assert torch.equal(generate_cached(model, prompt, 12, flashlib.decode_attention), without)
    assert torch.equal(generate_cached(model, prompt, 12, flashlib.decode_reference), without)
    with pytest.raises(ValueError, match="positions"):
        generate_cached(model, prompt, 20, flashlib.decode_reference)


# ----- compiled for GPU targets -------------------------------------------------------------------

SPECS = [spec("split", (9, 0), "bfloat16", 128), spec("split", (9, 0), "bfloat16", 128, paged=True),
         spec("split", (8, 0), "float16", 64, paged=True, softcap=True, rows=8),
         spec("split", (8, 0), "float32", 128), spec("split", (9, 0), "bfloat16", 256, paged=True, rows=16),
         spec("merge", (9, 0), "bfloat16", 128), spec("merge", (8, 0), "float16", 64, rows=8, sinks=True),
         # Colab's T4 (sm_75) in float16: notebook 10's decoding there
         spec("split", (7, 5), "float16", 64, paged=True, softcap=True, rows=8), spec("merge", (7, 5), "float16", 64),
         # Llama 4's chunked layers: the rule tuple's chunk given, paged
         spec("split", (9, 0), "bfloat16", 128, paged=True, chunk=True)]


def _has_triton36() -> bool:
    try:
        triton36_dir()
    except (pytest.skip.Exception, pytest.fail.Exception):
        return False
    return True


@pytest.fixture(scope="module")
def compiled():
    """{version: {"reports": one per spec it compiled, "launch": the launch path's result}}, both Triton releases
    side by side: each spec compiled by the release that runs its target (side_by_side's by_target); the
    launchers' binding by both, the decoding benchmark's compiling ahead by the release of the machine it runs
    on (the GPU check's H200: 3.6.0; the pinned release where 3.6.0 is missing)."""
    has36 = _has_triton36()

    def compile_and_launch(specs, triton_path=None):
        return compile_decode(specs, triton_path=triton_path, launch=True, bench=triton_path is not None or not has36)

    return side_by_side(compile_and_launch, SPECS, by_target=True)


def _version(compiled, version):
    if version not in compiled:
        triton36_dir()  # skips (locally) or fails (CI) with the reason
    return compiled[version]


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_kernels_compile_for_sm75_sm80_and_sm90(compiled, version):
    reports = _version(compiled, version)["reports"]
    assert reports and compiled_once(compiled, SPECS)  # 3.6.0 the sm_90 specs where it is installed
    for r in reports:
        s = spec_of(r, SPECS)
        assert r["ok"], (s, r["error"])
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0), (s, r["registers"])
        assert r["shared"] <= SHARED_LIMIT[tuple(s["capability"])]
        if s["kernel"] == "split" and tuple(s["capability"]) >= (8, 0):  # mma.sync: too few rows for wgmma
            assert r["mma_sync_ops"] > 0 and r["wgmma_ops"] == 0, s
    want = "3.6.0" if version == "3.6" else importlib.metadata.version("triton")
    assert {r["triton_version"] for r in reports} == {want}


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_the_launchers_bind_and_compile_as_on_an_h200(compiled, version):
    # decode_forward's own launches through Triton's JIT (contiguous with 33 splits; paged, soft-capped,
    # windowed, one split), compiled for sm_90 with a stand-in driver
    launch = _version(compiled, version)["launch"]
    assert launch["notes"] == ["_decode_split", "_decode_merge"] * 2
    assert launch["compiled"]["failed"] == 0, launch["compiled"]["errors"]
    # the decoding benchmark compiles what it will launch before its first point (on the H200: with 3.6.0)
    if version == "pinned" and "3.6" in compiled:
        assert launch["runs"] is launch["bench_ahead"] is None
        return
    assert [r[:3] for r in launch["runs"]] == [["contiguous", "16", "1"], ["paged", "16", "1"],
                                               ["contiguous", "16", "1"], ["contiguous", "16", "8"],
                                               ["paged", "16", "1"]]  # splits: 1 without a GPU, or as asked
    assert launch["runs"][-1][3].startswith("DecodeConfig(block_k=128, num_warps=8, num_stages=5)")  # a paged tile
    ahead = launch["bench_ahead"]
    # 4 distinct runs of two launches; a cascade group's plain plan (2) and cascade plan (3); an MLA step's two plans
    assert ahead["failed"] == 0 and ahead["kernels"] >= 1 and ahead["launches_noted"] == 2 * 4 + 2 + 3 + 2 * 2, ahead


# ----- notebook 10's figures, slider and checkers ----------------------------------------------

def test_the_split_kv_picture_merges_to_attention_over_every_key():
    from flashlib.course import inference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, generator=g, dtype=F64)
    k, v = (torch.randn(40, 8, generator=g, dtype=F64) for _ in range(2))
    for num_splits in (1, 3, 8):
        parts, merged, full = inference.split_kv_parts(q, k, v, 37, num_splits)
        assert len(parts) == num_splits and parts[-1][1] == 37
        torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)
    stepper = inference.SplitKVStepper(q, k, v, 37, num_splits=2, max_splits=6)
    before = stepper.image.value
    stepper.num_splits.value = 5  # the slider redraws
    assert stepper.image.value != before and repr(stepper) == "SplitKVStepper(seqlen=37, num_splits=5 of 1..6)"


def test_the_figures_draw():
    from flashlib.course import inference

    k = torch.zeros(3, 1, 12, 2)
    _, _, table = decode.paged_cache(k, k, 4, spare_pages=3, generator=torch.Generator().manual_seed(0))
    table[1, 2] = -1
    figures = [inference.paged_cache_figure(table, [11, 5, 8], 12, 4), inference.prediction_figure(4000.0, "a GPU"),
               inference.occupancy_figure()]
    row = dict(batch=1, kv_heads=8, head_dim=128, ms=0.02)
    methods = (("flashlib", "contiguous"), ("flashlib", "paged"), ("sdpa:flash", "contiguous"))
    result = {"points": [dict(row, method=m, layout=lay, length=n) for n in (4096, 8192) for m, lay in methods]}
    figures.append(inference.measured_figure(result, 4000.0))
    assert all(len(f.axes) >= 1 for f in figures)
    seconds = inference.step_seconds(batch=1, kv_heads=8, length=4096, head_dim=128, gbps=1.0)
    assert seconds == 2 * 8 * 4096 * 128 * 2 / 1e9


def test_the_checkers_name_the_usual_mistakes():
    from flashlib.course import inference

    assert repr(inference.check_step_time(None)) == "NOT YET: no answer yet; expected a number of microseconds."
    right = 2 * 4 * 8 * 100_000 * 128 * 2 / 3000e9 * 1e6
    assert inference.check_step_time(right) and not inference.check_step_time(right / 2)
    assert "values" in inference.check_step_time(right / 2).message
    assert inference.check_cache_gib(10) and "kv" in inference.check_cache_gib(80).message
    assert "GB" in inference.check_cache_gib(10 * 2 ** 30 / 1e9).message

    def split_kv(q, k, v, num_splits, shift=True, average=False):
        size = -(-k.shape[0] // num_splits)
        outs, lses = [], []
        for a in range(0, k.shape[0], size):
            s = k[a:a + size] @ q / math.sqrt(q.shape[0])
            outs.append(torch.softmax(s, 0) @ v[a:a + size])
            lses.append(torch.logsumexp(s, 0))
        outs, lses = torch.stack(outs), torch.stack(lses)
        if average:
            return outs.mean(0)
        weights = torch.exp(lses - torch.logsumexp(lses, 0)) if shift else torch.exp(lses) / torch.exp(lses).sum()
        return (weights[:, None] * outs).sum(0)

    from flashlib import labs

    assert labs.check("split_kv", split_kv)
    assert "averages" in labs.check("split_kv", lambda *a: split_kv(*a, average=True)).message
    assert "overflows" in labs.check("split_kv", lambda *a: split_kv(*a, shift=False)).message
    assert "raised" in labs.check("split_kv", lambda *a: 1 / 0).message
    assert inference.check_gather(lambda pages, table, n: pages[table.long()].reshape(-1, pages.shape[-1])[:n])
    in_storage_order = inference.check_gather(lambda pages, table, n: pages.reshape(-1, pages.shape[-1])[:n])
    assert "order memory" in in_storage_order.message


def test_without_triton_the_reference_runs_and_the_kernels_say_how_to_run():
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, flashlib\n"
            "q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 6, 4)\n"
            "lengths = torch.tensor([6], dtype=torch.int32)\n"
            "print(tuple(flashlib.decode_reference(q, k, k, lengths, num_splits=2).shape))\n"
            "try:\n    flashlib.decode_attention(q, k, k, lengths)\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("(1, 2, 1, 4)") and "Linux" in out, out
