"""The index tensors the kernels read: cu_seqlens_q/k (packed sequences), cache_seqlens and
block_table (decoding).

Any strides are read as they lie (a view such as ``t[::2]`` was read by the kernels as if
contiguous: garbage lengths, a heap corrupted, ``free(): invalid pointer``; so those checks run in a
subprocess, and a regression fails one test instead of aborting the suite); any dtype but int32
is refused by name with the fix. The packed op reads its lengths inside its implementation, so
eager and ``torch.compile(fullgraph=True)`` calls raise the same error (a compiled call with too
small a max_seqlen used to return uninitialised rows). Plain ints the kernels take (windows,
split counts, max_seqlen) are clamped where that is exact; element offsets past 2^31 are computed
in int64 (tests/test_huge_offsets.py); a CUDA grid past its limits is refused by name.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashlib
from flashlib import decode, varlen_reference

triton_missing = importlib.util.find_spec("triton") is None
needs_kernels = pytest.mark.skipif(triton_missing or torch.cuda.is_available(),
                                   reason="interpreter tests (Triton: Linux wheels only; CUDA: tests/test_gpu.py)")
ROOT = Path(__file__).resolve().parent.parent

# ----- strided views, in a subprocess ------------------------------------------------------------

STRIDED_SCRIPT = r'''
import json
import torch
from flashlib import decode_attention, flash_attention_varlen
from flashlib.decode import paged_cache


def views(t):
    """t's values laid out three ways: every other element, a column, a stride of 100000 (as_strided)."""
    spread = torch.zeros((2 * t.shape[0],) + t.shape[1:], dtype=t.dtype)
    spread[::2] = t
    column = torch.stack([t, t + 1000], dim=-1)[..., 0]
    huge = torch.full((100_000 * t.numel(),), 7777, dtype=t.dtype).as_strided(
        t.shape, tuple(100_000 * s for s in t.stride()))
    huge.copy_(t)
    return {"every other": spread[::2], "column": column, "as_strided": huge}


def packed(cu_q, cu_k):
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, dtype=torch.float64).float().requires_grad_() for n in (20, 30, 30))
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 8, 13, causal=True)
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def gap(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def report(case, got, want):  # one line per case, at once: an abort later keeps the cases before it
    print("RESULT " + json.dumps([case, gap(got, want)]), flush=True)


torch.manual_seed(1)
q, k, v = torch.randn(3, 4, 2, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
lengths = torch.tensor([7, 40, 2], dtype=torch.int32)
k_pages, v_pages, table = paged_cache(k, v, 8, spare_pages=3, generator=torch.Generator().manual_seed(2))
want = decode_attention(q, k, v, lengths)
want_paged = decode_attention(q, k_pages, v_pages, lengths, block_table=table)
for view, t in views(lengths).items():
    report(f"cache_seqlens, {view}", [decode_attention(q, k, v, t)], [want])
for view, t in views(table).items():
    report(f"block_table, {view}", [decode_attention(q, k_pages, v_pages, lengths, block_table=t)], [want_paged])

cu = {"cu_seqlens_q": torch.tensor([0, 5, 12, 12, 20], dtype=torch.int32),
      "cu_seqlens_k": torch.tensor([0, 9, 10, 17, 30], dtype=torch.int32)}
want = packed(cu["cu_seqlens_q"], cu["cu_seqlens_k"])
for name in cu:
    for view, t in views(cu[name]).items():
        args = dict(cu, **{name: t})
        report(f"{name}, {view}", packed(args["cu_seqlens_q"], args["cu_seqlens_k"]), want)
'''
STRIDED_CASES = [f"{name}, {view}" for name in ("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table")
                 for view in ("every other", "column", "as_strided")]


@pytest.fixture(scope="module")
def strided_results():
    """{case: largest difference from the contiguous call} and what the subprocess said."""
    run = subprocess.run([sys.executable, "-c", STRIDED_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    results = dict(json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return results, f"exit status {run.returncode}; stderr:\n{run.stderr[-3000:]}"


@needs_kernels
@pytest.mark.parametrize("case", STRIDED_CASES)
def test_a_strided_index_tensor_gives_the_contiguous_result(strided_results, case):
    # decoding with a contiguous and a paged cache, the packed op forward and backward: exactly equal
    results, said = strided_results
    assert case in results, f"the subprocess ended before {case!r}: {said}"
    assert results[case] == 0.0, (case, results[case])


# ----- dtypes ------------------------------------------------------------------------------------

OTHER_DTYPES = [torch.int8, torch.int16, torch.int64, torch.uint8, torch.bool, torch.float32, torch.float16]


def _packed_args():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=g) for n in (7, 9, 9))
    return dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=5)


def _decode_args():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g), torch.randn(2, 2, 10, 16)
    k_pages, v_pages, table = decode.paged_cache(k, v, 4, generator=g)
    return dict(q=q, k_cache=k_pages, v_cache=v_pages, cache_seqlens=torch.tensor([5, 10], dtype=torch.int32),
                block_table=table)


def _entry_points(kind):
    if kind == "packed":
        points = [("varlen_reference", varlen_reference)]
        if not triton_missing:
            points.append(("flash_attention_varlen", flashlib.flash_attention_varlen))
        return points
    points = [("decode_reference", decode.decode_reference)]
    if not triton_missing:
        points.append(("decode_attention", flashlib.decode_attention))
    return points


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("kind,name", [("packed", "cu_seqlens_q"), ("packed", "cu_seqlens_k"),
                                       ("decode", "cache_seqlens"), ("decode", "block_table")])
def test_any_other_dtype_is_refused_by_name_with_the_fix(kind, name, dtype):
    for fn_name, fn in _entry_points(kind):
        args = _packed_args() if kind == "packed" else _decode_args()
        args[name] = args[name].to(dtype)
        with pytest.raises(TypeError) as info:
            fn(**args)
        message = str(info.value)
        fix = "integer" if dtype == torch.bool or dtype.is_floating_point else f"{name}.to(torch.int32)"
        for word in (f"{fn_name}: argument '{name}'", str(dtype), "it must be torch.int32", fix):
            assert word in message, (word, message)


# ----- the lengths' checks inside torch.compile --------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k", "cu_seqlens_k"])
def test_eager_and_compiled_calls_raise_the_same_error(name):
    from flashlib import flash_attention_varlen

    args = _packed_args()
    args.update({"max_seqlen_q": 3, "max_seqlen_k": 4} if name.startswith("max") else {})
    if name != "max_seqlen_q":
        args["max_seqlen_q"] = 4
    if name == "cu_seqlens_k":  # ends past k's 9 tokens: the kernels would read past k
        args["cu_seqlens_k"] = torch.tensor([0, 4, 12], dtype=torch.int32)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, **args)

    with pytest.raises(ValueError) as eager:
        run(q, k, v)
    with pytest.raises(ValueError) as compiled:
        torch.compile(run, fullgraph=True)(q, k, v)
    assert str(compiled.value) == str(eager.value)
    assert f"flash_attention_varlen: argument '{name}'" in str(eager.value)


def test_a_negative_max_seqlen_is_refused():
    args = _packed_args()
    with pytest.raises(ValueError, match="'max_seqlen_k' is -1; .* >= 0"):
        varlen_reference(**dict(args, max_seqlen_k=-1))


# ----- plain ints: clamped where exact, refused by name where not ---------------------------------

@needs_kernels
def test_huge_windows_and_max_seqlens_act_as_their_exact_bounds():
    from flashlib import flash_attention_varlen

    args = _packed_args()
    want = flash_attention_varlen(**args, window=(20, 20))  # wider than any sequence: no limit
    # past int64 (the op's arguments) and a grid of 2^40 query blocks, both clamped exactly
    got = flash_attention_varlen(**dict(args, max_seqlen_q=2 ** 40, max_seqlen_k=2 ** 70), window=(2 ** 63, 2 ** 64))
    assert torch.equal(got, want)


@needs_kernels
def test_decode_clamps_a_huge_window_and_split_count_exactly():
    args = _decode_args()
    want = flashlib.decode_attention(**args, num_splits=2)  # 10 positions x 4 pages: 2 tiles of 32 keys
    assert torch.equal(flashlib.decode_attention(**args, num_splits=10 ** 9), want)  # was 10^9 programs
    assert torch.equal(flashlib.decode_attention(**args, num_splits=2, window=(2 ** 70, 0)), want)


def test_a_cuda_grid_past_its_limits_is_refused_before_launch():
    from flashlib.machinery.checks import check_grid

    check_grid("f", (10, 70_000), torch.device("cpu"), ("a", "b"))  # the interpreter has no such limit
    check_grid("f", (2 ** 31 - 1, 65_535, 65_535), torch.device("cuda"), ("a", "b", "c"))
    with pytest.raises(ValueError, match="f: batch x heads is 65536, more than the 65535 .* smaller batches"):
        check_grid("f", (1, 65_536), torch.device("cuda"), ("", "batch x heads"))
