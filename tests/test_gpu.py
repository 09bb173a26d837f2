"""The fused kernels compiled on a CUDA GPU (run by ``make gpu-check``; skipped without CUDA).

float32 is checked twice: with input_precision="ieee" (exact float32 products) at float32
tolerance, and with the default tf32 tensor-core products at tf32 tolerance. float16 and
bfloat16 follow flash-attn's rule against a float32 reference: the kernel's error is at most
twice that of PyTorch's scaled_dot_product_attention in the same precision.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    pytest.skip("needs a CUDA device and Triton (make gpu-check runs these)", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from flashlib import causal_mask, dense_attention  # noqa: E402
from flashlib import flash_attention  # noqa: E402
from flashlib.kernels import attention as kernel_attention  # noqa: E402
from flashlib.kernels import default_config, kernel_status  # noqa: E402
from flashlib.ladder import attention as ladder_attention  # noqa: E402
from flashlib.ladder import rungs  # noqa: E402
from flashlib.ladder.forward import forward as rung_forward  # noqa: E402

DEVICE = "cuda"
pytestmark = pytest.mark.gpu


def _inputs(batch, heads, seq_q, seq_k, dim, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda n: torch.randn(batch, heads, n, dim, device=DEVICE, generator=g)  # noqa: E731
    return make(seq_q).to(dtype), make(seq_k).to(dtype), make(seq_k).to(dtype), make(seq_q).to(dtype)


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_status_says_gpu():
    assert kernel_status().mode == "gpu"


@pytest.mark.parametrize("seq_q,seq_k,dim,causal", [
    (1, 203, 40, False), (17, 203, 59, True), (113, 203, 64, True), (203, 113, 128, True),
    (1000, 1000, 128, False), (257, 1025, 256, True), (97, 97, 16, False),
])
def test_float32_ieee_matches_float64_dense(seq_q, seq_k, dim, causal):
    q, k, v, dout = _inputs(2, 3, seq_q, seq_k, dim, torch.float32)
    cfg = replace(default_config(dim, torch.float32, torch.cuda.get_device_capability()), input_precision="ieee")
    got = _grads(lambda a, b, c: kernel_attention(a, b, c, causal=causal, config=cfg), q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=causal), *(t.double() for t in (q, k, v, dout)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_tf32_default_within_tf32_error(causal):
    q, k, v, dout = _inputs(2, 4, 777, 1031, 128, torch.float32)
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=causal), *(t.double() for t in (q, k, v, dout)))
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        assert _max_err(g, w) <= 2e-2 * scale  # tf32 keeps 10 mantissa bits: ~1e-3 per product


def _sdpa(causal, seq_q, seq_k):
    if not causal or seq_q == seq_k:
        return lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)
    mask = causal_mask(seq_q, seq_k, device=DEVICE)  # bottom-right, as flash_attention
    return lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,seq_q,seq_k,dim,causal", [
    (2, 4, 1024, 1024, 64, False), (2, 4, 1024, 1024, 128, True), (1, 2, 113, 1025, 128, True),
    (1, 2, 4096, 4096, 64, True), (1, 2, 16384, 16384, 128, False), (1, 2, 16384, 16384, 128, True),
])
def test_half_precision_within_twice_sdpa_error(dtype, batch, heads, seq_q, seq_k, dim, causal):
    q, k, v, dout = _inputs(batch, heads, seq_q, seq_k, dim, dtype)
    want = _grads(_sdpa(causal, seq_q, seq_k), *(t.float() for t in (q, k, v, dout)))
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, dout)
    sdpa = _grads(_sdpa(causal, seq_q, seq_k), q, k, v, dout)
    for name, g, s, w in zip(("out", "dq", "dk", "dv"), got, sdpa, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err, sdpa_err = _max_err(g, w), _max_err(s, w)
        assert err <= 2 * sdpa_err + 1e-4, f"{name}: kernel error {err:.3e}, SDPA {dtype} error {sdpa_err:.3e}"


# each shape compiles every candidate tile of the kernels of each pair (lengths that are not
# multiples of 16 bind, so compile, apart from those that are)
FASTEST_SHAPES = [(torch.bfloat16, 1, 2, 113, 1025, 128, True), (torch.bfloat16, 1, 4, 4096, 4096, 128, True),
                  (torch.float16, 2, 4, 1000, 1000, 64, False)]
FASTEST_PAIRS = [("tma", "tuned"), ("lean", "lean"), ("lean", "bulk")]


@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead():
    """The autotuned tests compile about a hundred binaries between them: compile them first,
    on all cores (flashlib.bench.ahead, as the GPU check does for its benchmark), so each
    test only loads them. Changes time only: a kernel that fails to compile fails in its test."""
    import warnings

    from flashlib.bench import ahead

    def launches():
        for dtype, batch, heads, seq_q, seq_k, dim, causal in FASTEST_SHAPES:
            q, k, v, dout = _inputs(batch, heads, seq_q, seq_k, dim, dtype)
            for forward, backward in FASTEST_PAIRS:
                _grads(lambda a, b, c: ladder_attention(a, b, c, causal=causal, forward=forward, backward=backward),
                       q, k, v, dout)
        q, k, v, _ = _inputs(1, 4, 2048, 2048, 128, torch.bfloat16)
        for causal in (False, True):
            for name in ("lean", "lazy-rescale"):
                rung_forward(q, k, v, causal=causal, rung=name)

    try:
        with ahead.recording() as notes:
            launches()
        ahead.compile_notes(notes)
    except Exception as exc:  # noqa: BLE001  the tests then compile as they go, and report any failure
        warnings.warn(f"compiling ahead failed: {type(exc).__name__}: {exc}")
    yield


@pytest.mark.parametrize("dtype,batch,heads,seq_q,seq_k,dim,causal", FASTEST_SHAPES)
@pytest.mark.parametrize("forward,backward", FASTEST_PAIRS)
def test_fastest_path_within_twice_sdpa_error(dtype, batch, heads, seq_q, seq_k, dim, causal, forward, backward):
    """The ladder's last forward rungs with the tuned, lean or bulk backward, autotuned here."""
    q, k, v, dout = _inputs(batch, heads, seq_q, seq_k, dim, dtype, seed=1)
    want = _grads(_sdpa(causal, seq_q, seq_k), *(t.float() for t in (q, k, v, dout)))
    fn = lambda a, b, c: ladder_attention(a, b, c, causal=causal, forward=forward, backward=backward)  # noqa: E731
    got = _grads(fn, q, k, v, dout)
    sdpa = _grads(_sdpa(causal, seq_q, seq_k), q, k, v, dout)
    for name, g, s, w in zip(("out", "dq", "dk", "dv"), got, sdpa, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err, sdpa_err = _max_err(g, w), _max_err(s, w)
        assert err <= 2 * sdpa_err + 1e-4, f"{name}: kernel error {err:.3e}, SDPA {dtype} error {sdpa_err:.3e}"
    again = _grads(fn, q, k, v, dout)
    if "fused" not in rungs.backward(backward).tiles:  # autotuned tiles, still no atomics: bitwise repeatable
        assert all(torch.equal(a, b) for a, b in zip(got, again))
    else:  # atomics: dq may differ in its last bits, dk and dv may not
        assert torch.equal(got[2], again[2]) and torch.equal(got[3], again[3])
        torch.testing.assert_close(got[1], again[1])


@pytest.mark.parametrize("forward,backward,dq_t", [("lazy-rescale", "lean", False), ("lean", "bulk", False),
                                                   ("lean", "bulk", True)])
def test_descriptors_clip_a_padded_head_dim_and_ragged_rows(forward, backward, dq_t):
    """head_dim 80 runs in 128-wide tiles: descriptor loads pad the extra columns with zeros,
    and stores and bulk reductions must drop them, as they must drop rows past the end (dq_t:
    dQ's bulk reductions transposed, its rows the head dim and its columns the queries)."""
    from flashlib.kernels import FlashConfig

    cfg = FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=3,
                      bwd_block_q=64, bwd_block_k=64, bwd_num_warps=8, bwd_num_stages=2, bwd_dq_transposed=dq_t)
    q, k, v, dout = _inputs(1, 3, 300, 333, 80, torch.bfloat16, seed=3)
    want = _grads(_sdpa(True, 300, 333), *(t.float() for t in (q, k, v, dout)))
    got = _grads(lambda a, b, c: ladder_attention(a, b, c, causal=True, config=cfg, forward=forward,
                                                  backward=backward), q, k, v, dout)
    sdpa = _grads(_sdpa(True, 300, 333), q, k, v, dout)
    for name, g, s_, w in zip(("out", "dq", "dk", "dv"), got, sdpa, want):
        assert torch.isfinite(g).all(), name
        err, sdpa_err = _max_err(g, w), _max_err(s_, w)
        assert err <= 2 * sdpa_err + 1e-4, f"{name}: kernel error {err:.3e}, SDPA error {sdpa_err:.3e}"


@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescale_rung_on_growing_maxima(causal):
    """Rung 5 skips rescales behind a branch for the whole block: keys whose norms grow
    along the sequence make row maxima jump mid-row, so both sides of the branch run on the
    GPU. Within twice SDPA's bfloat16 error of a float32 reference, and no worse than rung 4."""
    q, k, v, _ = _inputs(1, 4, 2048, 2048, 128, torch.bfloat16, seed=2)
    k = (k.float() * torch.linspace(1.0, 6.0, 2048, device=DEVICE)[:, None]).to(torch.bfloat16)
    want = _sdpa(causal, 2048, 2048)(q.float(), k.float(), v.float())
    sdpa_err = _max_err(_sdpa(causal, 2048, 2048)(q, k, v), want)
    for name in ("lean", "lazy-rescale"):
        out, lse = rung_forward(q, k, v, causal=causal, rung=name)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), name
        assert _max_err(out, want) <= 2 * sdpa_err + 1e-4, (name, _max_err(out, want), sdpa_err)


def test_rows_without_keys_and_lse():
    q, k, v, dout = _inputs(1, 2, 300, 100, 64, torch.float16)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    empty = ~causal_mask(300, 100, device=DEVICE).any(dim=-1)
    assert torch.all(out[..., empty, :] == 0) and torch.all(lse[..., empty] == -math.inf)
    s = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(64)
    want = torch.logsumexp(s.masked_fill(~causal_mask(300, 100, device=DEVICE), -math.inf), dim=-1)
    torch.testing.assert_close(lse[..., ~empty], want[..., ~empty], atol=2e-2, rtol=1e-3)


def test_backward_is_bitwise_deterministic_on_gpu():
    q, k, v, dout = _inputs(2, 8, 2048, 2048, 128, torch.bfloat16)
    fn = lambda a, b, c: flash_attention(a, b, c, causal=True)  # noqa: E731
    first, second = _grads(fn, q, k, v, dout), _grads(fn, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_public_op_runs_the_fastest_measured_path_here():
    from flashlib.op import path_for

    x = torch.randn(1, 1, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    assert path_for(x) == ("tma", "tuned") and path_for(x.float()) == ("teaching", "teaching")


def test_torch_compile_fullgraph_matches_eager_on_gpu():
    """flash_attention is one custom op to the compiler: the compiled step, forward and
    backward, gives the eager gradients (bitwise: the same kernels run)."""
    q, k, v, dout = _inputs(2, 4, 1000, 1000, 64, torch.bfloat16)

    def step(a, b, c):
        out, lse = flash_attention(a, b, c, causal=True, return_lse=True)
        return out, lse

    eager = _grads(lambda a, b, c: step(a, b, c)[0], q, k, v, dout)
    compiled = _grads(lambda a, b, c: torch.compile(step, fullgraph=True)(a, b, c)[0], q, k, v, dout)
    for name, e, c in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(e, c), name


def test_the_peak_of_a_training_step_counts_its_gradients():
    """The benchmark's peak of a forward + backward call, measured twice (the second call frees
    the first one's gradients): never below the bytes of O, dQ, dK and dV that it holds at its end."""
    from flashlib.bench import point

    q, k, v, _ = _inputs(1, 16, 4096, 4096, 128, torch.bfloat16)
    call = point._call(lambda a, b, c, causal: flash_attention(a, b, c, causal=causal), q, k, v,
                       dict(mode="fwd_bwd", causal=True))
    call()
    held = 4 * q.numel() * q.element_size()  # O, dQ, dK, dV
    assert point.peak_bytes(call) >= held and point.peak_bytes(call) >= held


@pytest.mark.parametrize("paged", [False, True])
def test_decoding_against_its_reference_in_bfloat16(paged):
    """Split-KV decoding compiled for the GPU: GQA, ragged cache lengths, a window, soft-capping, chunks,
    a few new tokens, contiguous or paged (shuffled block table), within bfloat16's rounding of
    the float32 reference; every split count gives the same output up to rounding."""
    from flashlib import decode_attention, decode_reference
    from flashlib.decode import paged_cache

    g = torch.Generator(device=DEVICE).manual_seed(5)
    batch, q_heads, kv_heads, new, capacity, dim = 3, 8, 2, 3, 3000, 128
    q = torch.randn(batch, q_heads, new, dim, device=DEVICE, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, capacity, dim, device=DEVICE, generator=g).to(torch.bfloat16)
            for _ in range(2))
    seqlens = torch.tensor([3000, 1234, 7], device=DEVICE, dtype=torch.int32)
    options = dict(window=(1000, 0), softcap=30.0, attention_chunk=700)
    table = None
    if paged:
        k, v, table = paged_cache(k, v, 64, spare_pages=5, generator=torch.Generator().manual_seed(1))
    want = decode_reference(q.float(), k.float(), v.float(), seqlens, block_table=table, **options)
    for splits in (None, 1, 7):
        got = decode_attention(q, k, v, seqlens, block_table=table, num_splits=splits, **options)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_cpu_tensors_are_refused_with_the_fix():
    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="move q, k, v to 'cuda'"):
        flash_attention(x, x, x)


def test_a_kernel_fault_is_told_from_an_ordinary_error():
    """The benchmark's recovery (perf_bench.continue_after_device_lost) rests on telling a fault
    that leaves the process without a usable GPU from an error it can go on after. A kernel
    that stores far outside any allocation (tests/gpu_fault_probe.py: Triton reads a kernel's
    source from its file), in a subprocess so that this one keeps its GPU."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.join(root, "tests", "gpu_fault_probe.py")], capture_output=True,
                          text=True, timeout=300, cwd=root, env=env)
    lines = done.stdout.strip().splitlines()
    assert lines, f"no result (exit {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(lines[-1])
    assert result["before"] is True and result["lost"] == "faulty", result
    assert result["after"] is False and result["error"].startswith(("RuntimeError", "AcceleratorError")), result


def _document_ids(seq, device):
    return torch.repeat_interleave(torch.arange(4, device=device), torch.tensor([300, 41, 500, seq - 841],
                                                                                device=device))


@pytest.mark.parametrize("kv_heads,options", [  # options combined: each case compiles kernels of its own
    (2, dict(causal=True, window=(100, 0), softcap=20.0)),
    (1, dict(window=(37, 250), mask_doc=True)),
    (2, dict(causal=True, attention_chunk=300)),  # Llama 4's chunks, across tiles
    (1, dict(attention_chunk=256, window=(100, 40), mask_doc=True)),
])
def test_variants_compiled_match_float64(kv_heads, options):
    """Grouped-query heads, windows, soft-capping and mask functions compiled for this GPU
    (the teaching kernels with exact float32 products) against float64 dense attention."""
    from flashlib import masks

    options = dict(options)
    seq = 1200
    if options.pop("mask_doc", False):
        options["mask_mod"] = masks.document(_document_ids(seq, DEVICE))
    q, _, _, dout = _inputs(2, 4, seq, seq, 64, torch.float32, seed=3)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    k, v = (torch.randn(2, kv_heads, seq, 64, device=DEVICE, generator=g) for _ in range(2))
    cfg = replace(default_config(64, torch.float32, torch.cuda.get_device_capability()), input_precision="ieee")
    got = _grads(lambda a, b, c: kernel_attention(a, b, c, config=cfg, **options), q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, **options), *(t.double() for t in (q, k, v, dout)))
    for name, g_, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _max_err(g_, w) <= 2e-4 * max(1.0, w.abs().max().item()), name


def test_packed_sequences_compiled_match_float64():
    """flash_attention_varlen compiled for this GPU: grouped heads, a causal window, an empty
    sequence, forward and backward, within tf32 rounding of the float64 reference."""
    from flashlib import flash_attention_varlen, varlen_reference

    lens = [700, 0, 1, 333, 1029]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    q = torch.randn(sum(lens), 8, 64, device=DEVICE, generator=g)
    k, v = (torch.randn(sum(lens), 2, 64, device=DEVICE, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    options = dict(causal=True, window=(256, 0))
    call = lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, max(lens), max(lens), **options)  # noqa: E731
    reference = lambda a, b, c: varlen_reference(a, b, c, cu, cu, max(lens), max(lens), **options)  # noqa: E731
    got = _grads(call, q, k, v, dout)
    want = _grads(reference, *(t.double() for t in (q, k, v, dout)))
    for name, g_, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _max_err(g_, w) <= 2e-2 * max(1.0, w.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sinks_compiled_match_float64(dtype):
    """Attention sinks compiled for this GPU (the teaching kernels: a query block starts from the
    sink) with grouped heads and a causal window, out and every gradient, the sinks' included,
    against float64 dense attention; float32 with exact products, half precision within its
    rounding."""
    seq = 700
    q, _, _, dout = _inputs(2, 4, seq, seq, 64, torch.float32, seed=7)
    g = torch.Generator(device=DEVICE).manual_seed(8)
    k, v = (torch.randn(2, 2, seq, 64, device=DEVICE, generator=g) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, generator=g) * 2
    options = dict(causal=True, window=(300, 0))
    cfg = replace(default_config(64, dtype, torch.cuda.get_device_capability()), input_precision="ieee")

    def run(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    got = run(lambda a, b, c, s: kernel_attention(a, b, c, config=cfg, sinks=s, **options),
              [t.to(dtype) for t in (q, k, v)] + [sinks])
    want = run(lambda a, b, c, s: dense_attention(a, b, c, sinks=s, **options),
               [t.to(dtype).double() for t in (q, k, v)] + [sinks.double()])
    tolerance = 2e-4 if dtype == torch.float32 else 2e-2
    for name, g_, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert _max_err(g_, w) <= tolerance * max(1.0, w.abs().max().item()), name


def test_sinks_in_packed_sequences_and_decoding_compiled():
    from flashlib import decode_attention, decode_reference, flash_attention_varlen
    from flashlib.decode import paged_cache

    lens = [300, 0, 1, 129]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(9)
    q = torch.randn(sum(lens), 4, 64, device=DEVICE, generator=g, dtype=torch.float16)
    k, v = (torch.randn(sum(lens), 2, 64, device=DEVICE, generator=g, dtype=torch.float16) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, generator=g)
    out = flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, sinks=sinks)
    for b, (s0, s1) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if s1 == s0:
            continue  # the empty sequence: no rows
        one = (t[s0:s1].transpose(0, 1).double() for t in (q, k, v))
        want = dense_attention(*one, causal=True, sinks=sinks.double()).transpose(0, 1)
        assert _max_err(out[s0:s1], want) <= 2e-3, b
    qd = torch.randn(3, 4, 2, 64, device=DEVICE, generator=g, dtype=torch.bfloat16)
    caches = [torch.randn(3, 2, 4096, 64, device=DEVICE, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    lengths = torch.tensor([2, 4096, 1777], dtype=torch.int32, device=DEVICE)
    *pages, table = paged_cache(*caches, 64, generator=torch.Generator().manual_seed(1))
    for args, extra in ((caches, {}), (pages, dict(block_table=table))):
        got = decode_attention(qd, *args, lengths, num_splits=8, sinks=sinks, **extra)
        want = decode_reference(qd.double(), *(a.double() for a in args), lengths, sinks=sinks.double(), **extra)
        assert _max_err(got, want) <= 2e-2


def test_more_rows_than_a_grid_axis_compiled(monkeypatch):
    """The launches split to fit CUDA's 65,535 rows per grid axis, run for real: the limit forced
    down to 5 rows, the dense kernels, packed sequences and decoding against their references."""
    from flashlib import decode_attention, decode_reference, flash_attention_varlen, varlen_reference
    from flashlib.kernels import rules as kernel_rules

    monkeypatch.setattr(kernel_rules, "MAX_GRID_ROWS", 5)
    q, k, v, dout = _inputs(3, 4, 77, 77, 64, torch.float32, seed=10)
    cfg = replace(default_config(64, torch.float32, torch.cuda.get_device_capability()), input_precision="ieee")
    got = _grads(lambda a, b, c: kernel_attention(a, b, c, causal=True, config=cfg), q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=True), *(t.double() for t in (q, k, v, dout)))
    for name, g_, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _max_err(g_, w) <= 2e-4 * max(1.0, w.abs().max().item()), name
    lens = [40, 0, 77, 5, 19, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    qp, kp, vp = (t[0].transpose(0, 1).reshape(-1, 64)[:sum(lens)].reshape(sum(lens), 1, 64).expand(-1, 2, -1)
                  .contiguous() for t in (q, k, v))
    call = lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, 77, 77, causal=True)  # noqa: E731
    reference = lambda a, b, c: varlen_reference(a, b, c, cu, cu, 77, 77, causal=True)  # noqa: E731
    got = _grads(call, qp, kp, vp, torch.ones_like(qp))
    want = _grads(reference, *(t.double() for t in (qp, kp, vp, torch.ones_like(qp))))
    for name, g_, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _max_err(g_, w) <= 2e-2 * max(1.0, w.abs().max().item()), name
    qd = torch.randn(7, 2, 1, 64, device=DEVICE)
    cache = torch.randn(7, 1, 300, 64, device=DEVICE)
    lengths = torch.tensor([1, 300, 17, 256, 2, 99, 150], dtype=torch.int32, device=DEVICE)
    got = decode_attention(qd, cache, cache, lengths, num_splits=3)
    assert _max_err(got, decode_reference(qd.double(), cache.double(), cache.double(), lengths)) <= 2e-2


# ----- score functions, a head dim of v's own, serving: compiled -----------------------------------

HALF = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16  # Triton: no bf16 on a T4

@pytest.mark.parametrize("which", ["alibi", "relative_bias"])
def test_score_functions_and_their_captured_gradients_compiled(which):
    """Score functions compiled for this GPU, with the gradients of the tensors they capture (ALiBi's
    slopes, a bias table by distance): float32 with exact products against float64 autograd of dense
    attention, and the same bits on a second run (the captured gradients use no atomics)."""
    from flashlib import scores

    heads, seq = 4, 600
    q, k, v, dout = _inputs(2, heads, seq, seq, 64, torch.float32, seed=11)
    g = torch.Generator(device=DEVICE).manual_seed(12)
    make = scores.alibi if which == "alibi" else scores.relative_bias
    captured = (torch.rand(heads, device=DEVICE, generator=g) if which == "alibi"
                else torch.randn(2 * seq - 1, device=DEVICE, generator=g) * 0.5)
    cfg = replace(default_config(64, torch.float32, torch.cuda.get_device_capability()), input_precision="ieee")

    def run(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves[:3], make(leaves[3]))
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    ours = lambda a, b, c, s: kernel_attention(a, b, c, causal=True, score_mod=s, config=cfg)  # noqa: E731
    got, again = run(ours, (q, k, v, captured)), run(ours, (q, k, v, captured))
    want = run(lambda a, b, c, s: dense_attention(a, b, c, causal=True, score_mod=s),
               [t.double() for t in (q, k, v, captured)])
    for name, g_, a, w in zip(("out", "dq", "dk", "dv", "d" + which), got, again, want):
        assert torch.equal(g_, a), f"{name}: two runs differ"
        assert _max_err(g_, w) <= 2e-4 * max(1.0, w.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_head_dim_of_vs_own_compiled(dtype):
    """MLA's prefill and training shapes (q and k 192 wide, v 128) through flash_attention, forward and
    backward, causal, within flash-attn's rule: at most twice the error of PyTorch's
    scaled_dot_product_attention in the same precision (plus a little), against float32."""
    g = torch.Generator(device=DEVICE).manual_seed(13)
    q, k = (torch.randn(2, 4, 777, 192, device=DEVICE, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 777, 128, device=DEVICE, generator=g)
    dout = torch.randn(2, 4, 777, 128, device=DEVICE, generator=g)
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    want = _grads(sdpa, q, k, v, dout)
    baseline = _grads(sdpa, *(t.to(dtype) for t in (q, k, v, dout)))
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=True), *(t.to(dtype) for t in (q, k, v, dout)))
    assert got[0].shape == (2, 4, 777, 128)
    for name, g_, b, w in zip(("out", "dq", "dk", "dv"), got, baseline, want):
        assert _max_err(g_, w) <= 2 * _max_err(b, w) + 1e-3 * max(1.0, w.abs().max().item()), name


@pytest.mark.parametrize("paged", [False, True])
def test_absorbed_mla_decoding_compiled(paged):
    """DeepSeek's absorbed decoding on this GPU: 128 query heads over one 576-wide latent cache whose
    first 512 columns are the values, read once; the cache past each sequence's end is NaN (a read out
    of bounds would show), contiguous and in pages, against the float64 reference."""
    from flashlib.decode import mla_decode_attention, paged_cache

    g = torch.Generator(device=DEVICE).manual_seed(14)
    lengths = torch.tensor([1, 1000, 2048, 77], dtype=torch.int32, device=DEVICE)
    cache = torch.randn(4, 1, 2048, 576, device=DEVICE, generator=g).to(HALF)
    for b, n in enumerate(lengths.tolist()):
        cache[b, :, n:] = float("nan")
    q = torch.randn(4, 128, 1, 576, device=DEVICE, generator=g).to(HALF)
    extra = {}
    if paged:
        cache, _, table = paged_cache(cache, cache, 64, generator=torch.Generator().manual_seed(2))
        extra = dict(block_table=table)
    scale = 192 ** -0.5
    got = mla_decode_attention(q, cache, lengths, scale=scale, **extra)
    want = mla_decode_attention(q.double(), cache.double(), lengths, scale=scale, reference=True, **extra)
    assert got.shape == (4, 128, 1, 512) and not got.isnan().any()
    assert _max_err(got, want) <= 2e-2


def test_the_kvcache_contract_compiled():
    """flash-attn's KV-cache arguments on this GPU: new keys and values appended in place with rotary
    embeddings, a left-padded and pooled cache, then a mixed batch (cu_seqlens_q) with a window, in
    bfloat16, against decode_reference in float64 given the same arguments (both write their caches)."""
    from flashlib import decode_attention, decode_reference

    g = torch.Generator(device=DEVICE).manual_seed(15)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g)  # noqa: E731
    angles = torch.arange(4096, device=DEVICE)[:, None].double() * 10000.0 ** (-torch.arange(32, device=DEVICE) / 32)
    rope = dict(rotary_cos=angles.cos().float(), rotary_sin=angles.sin().float())
    pool_k, pool_v = rand(6, 2, 4096, 64), rand(6, 2, 4096, 64)
    q, k_new, v_new = rand(3, 8, 3, 64), rand(3, 2, 3, 64), rand(3, 2, 3, 64)
    args = dict(cache_seqlens=torch.tensor([5, 4000, 1200], dtype=torch.int32, device=DEVICE),
                cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE),
                cache_leftpad=torch.tensor([3, 0, 700], dtype=torch.int32, device=DEVICE))
    for interleaved in (False, True):
        caches = [pool_k.to(HALF), pool_v.to(HALF)]
        wanted = [c.double() for c in caches]
        got = decode_attention(q.to(HALF), *caches, k_new=k_new.to(HALF),
                               v_new=v_new.to(HALF), rotary_interleaved=interleaved, **rope, **args)
        want = decode_reference(q.to(HALF).double(), *wanted, k_new=k_new.to(HALF).double(),
                                v_new=v_new.to(HALF).double(), rotary_interleaved=interleaved,
                                **rope, **args)
        assert _max_err(got, want) <= 2e-2, interleaved
        for ours, theirs in zip(caches, wanted):  # the appended rows, rotated as the reference rotated them
            assert _max_err(ours, theirs) <= 1e-2, interleaved
    counts = [700, 1, 0, 1, 37]
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    before = torch.tensor([0, 3000, 9, 4000, 500], dtype=torch.int32, device=DEVICE)
    caches = [rand(5, 2, 4096, 64).to(HALF) for _ in range(2)]
    qp, kp, vp = (rand(sum(counts), h, 64).to(HALF) for h in (8, 2, 2))
    mixed = dict(cu_seqlens_q=cu, max_seqlen_q=max(counts), window=(1024, 0))
    got = decode_attention(qp, *[c.clone() for c in caches], before, k_new=kp, v_new=vp, **mixed)
    want = decode_reference(qp.double(), *[c.double() for c in caches], before, k_new=kp.double(), v_new=vp.double(),
                            **mixed)
    assert _max_err(got, want) <= 2e-2


def test_cascade_equals_plain_decoding_compiled():
    """A shared prefix read once for eight requests, merged with each one's own keys: within twice the
    error of plain decoding over every request's whole cache (contiguous and paged suffixes), both
    against float64."""
    from flashlib import decode_attention, decode_reference
    from flashlib.decode import cascade_attention, paged_cache

    g = torch.Generator(device=DEVICE).manual_seed(16)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g).to(HALF)  # noqa: E731
    q, prefix_k, prefix_v = rand(8, 32, 1, 128), rand(8, 3000, 128), rand(8, 3000, 128)
    k_cache, v_cache = rand(8, 8, 512, 128), rand(8, 8, 512, 128)
    lengths = torch.tensor([1, 512, 100, 7, 300, 64, 65, 511], dtype=torch.int32, device=DEVICE)
    whole = [torch.cat((p[None].expand(8, -1, -1, -1), c), dim=2) for p, c in ((prefix_k, k_cache), (prefix_v, v_cache))]
    plain = decode_attention(q, *whole, lengths + 3000)
    want = decode_reference(q.double(), *(t.double() for t in whole), lengths + 3000)
    k_pages, v_pages, table = paged_cache(k_cache, v_cache, 64, generator=torch.Generator().manual_seed(3))
    for suffix, extra in (((k_cache, v_cache), {}), ((k_pages, v_pages), dict(block_table=table))):
        got = cascade_attention(q, prefix_k, prefix_v, *suffix, lengths, **extra)
        assert _max_err(got, want) <= 2 * _max_err(plain, want) + 1e-3, bool(extra)


def test_plans_run_from_a_cuda_graph():
    """DecodePlan.run and CascadePlan.run captured in a CUDA graph (nothing in them waits for the GPU or
    allocates) and replayed after the caches and lengths change in place: the replay's output equals a fresh
    call's, paged and contiguous, and an MLA step's."""
    from flashlib.decode import CascadePlan, DecodePlan, cascade_attention, decode_attention, paged_cache

    g = torch.Generator(device=DEVICE).manual_seed(17)
    rand = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g).to(HALF)  # noqa: E731
    q, k, v = rand(4, 32, 1, 128), rand(4, 8, 2048, 128), rand(4, 8, 2048, 128)
    lengths = torch.tensor([2048, 1, 700, 1500], dtype=torch.int32, device=DEVICE)
    k_pages, v_pages, table = paged_cache(k, v, 16, generator=torch.Generator().manual_seed(4))
    prefix_k, prefix_v = rand(8, 1000, 128), rand(8, 1000, 128)
    latent = rand(4, 1, 2048, 576)
    q_mla = rand(4, 128, 1, 576)
    docs = torch.arange(2048, device=DEVICE) // 300
    sinks = torch.randn(64, device=DEVICE, dtype=torch.float64, generator=g)

    def same_document(score, b, h, q_idx, kv_idx):
        return score + (docs[q_idx] == docs[kv_idx]).float()

    cases = {
        "contiguous": ((q, k, v, lengths), DecodePlan(q, k, v, lengths), lambda: decode_attention(q, k, v, lengths)),
        "paged": ((q, k_pages, v_pages, lengths, table), DecodePlan(q, k_pages, v_pages, lengths, block_table=table),
                  lambda: decode_attention(q, k_pages, v_pages, lengths, block_table=table)),
        "mla": ((q_mla, latent, latent[..., :512], lengths), DecodePlan(q_mla, latent, latent[..., :512], lengths),
                lambda: decode_attention(q_mla, latent, latent[..., :512], lengths)),
        "cascade": ((q, prefix_k, prefix_v, k, v, lengths), CascadePlan(q, prefix_k, prefix_v, k, v, lengths),
                    lambda: cascade_attention(q, prefix_k, prefix_v, k, v, lengths)),
        # int64 ids (the kernel reads an int32 copy) and float64 strided sinks: copied again at every replay
        "copies": ((q, k, v, lengths), DecodePlan(q, k, v, lengths, score_mod=same_document, sinks=sinks[::2]),
                   lambda: decode_attention(q, k, v, lengths, score_mod=same_document, sinks=sinks[::2])),
    }
    for name, (args, plan, fresh) in cases.items():
        plan.run(*args)  # compiles, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = plan.run(*args)
        for tensor in (q, k, v, k_pages, v_pages, prefix_k, latent, q_mla):
            tensor.copy_(torch.randn(tensor.shape, device=DEVICE, generator=g))
        lengths.copy_(torch.tensor([5, 2000, 1, 1024], dtype=torch.int32))
        docs.copy_(torch.randint(0, 9, (2048,), device=DEVICE, generator=g))
        sinks.copy_(torch.randn(64, device=DEVICE, dtype=torch.float64, generator=g))
        graph.replay()
        assert _max_err(out, fresh()) <= 1e-2, name
