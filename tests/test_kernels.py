"""The fused Triton kernels in Triton's CPU interpreter, against float64 dense attention.

On this machine the kernels run interpreted (flashlib.kernels switches TRITON_INTERPRET on
when there is no CUDA device), where tl.dot computes in float32 whatever its
input_precision: float32 results are checked at float32 tolerance. float16 follows
flash-attn's rule: the kernel's error against a float32-or-better reference is at most
twice the error of dense attention computed in float16.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # imported only through flashlib.kernels
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from hypothesis import given, settings, strategies as st  # noqa: E402

import flashlib  # noqa: E402
from flashlib import dense_attention, tiled_attention  # noqa: E402
from flashlib.kernels import FlashConfig, kernel_status  # noqa: E402
from flashlib.kernels import attention as flash_attention  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/test_gpu.py covers CUDA")


def _inputs(batch, heads, seq_q, seq_k, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=g)
    k = torch.randn(batch, heads, seq_k, dim, generator=g)
    v = torch.randn(batch, heads, seq_k, dim, generator=g)
    dout = torch.randn(batch, heads, seq_q, dim, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, causal, scale=None):
    """out, lse, dq, dk, dv in float64 from dense attention and autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, causal=causal, scale=scale)
    out.backward(dout.double())
    s = (q @ k.transpose(-2, -1)).detach() * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~flashlib.causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
    return out.detach(), lse, q.grad, k.grad, v.grad


def _flash(q, k, v, dout, causal, scale=None, config=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, causal=causal, scale=scale, config=config, return_lse=True)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _close(got, want, atol=3e-5, rtol=1e-4):
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, equal_nan=False)


# (batch, heads, seq_q, seq_k, head_dim, causal): odd lengths against 203, odd head dims,
# causal with seq_q <, = and > seq_k (the last has rows that see no key)
CASES = [
    (1, 2, 1, 203, 40, False),
    (2, 1, 17, 203, 59, True),
    (1, 3, 113, 203, 40, True),
    (2, 2, 113, 113, 59, False),
    (1, 2, 113, 113, 40, True),
    (2, 1, 203, 113, 59, True),
    (1, 1, 203, 17, 40, False),
    (3, 1, 33, 5, 8, True),
]


@pytest.mark.parametrize("batch,heads,seq_q,seq_k,dim,causal", CASES)
def test_forward_lse_and_gradients_match_float64_dense(batch, heads, seq_q, seq_k, dim, causal):
    q, k, v, dout = _inputs(batch, heads, seq_q, seq_k, dim)
    got = _flash(q, k, v, dout, causal)
    want = _reference(q, k, v, dout, causal)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        if name == "lse":
            assert torch.equal(torch.isinf(g), torch.isinf(w)), "rows without keys must have lse = -inf"
            g, w = g[~torch.isinf(w)], w[~torch.isinf(w)]
        _close(g, w)


def test_rows_that_see_no_key_give_zero_output_and_zero_gradients():
    q, k, v, dout = _inputs(1, 2, 40, 12, 16)  # causal: the first 28 query rows see nothing
    out, lse, dq, dk, dv = _flash(q, k, v, dout, causal=True)
    empty = ~flashlib.causal_mask(40, 12).any(dim=-1)
    assert empty.sum() == 28
    assert torch.all(out[..., empty, :] == 0) and torch.all(dq[..., empty, :] == 0)
    assert torch.all(lse[..., empty] == -math.inf) and torch.isfinite(lse[..., ~empty]).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_custom_scale_and_small_configs():
    q, k, v, dout = _inputs(1, 2, 50, 70, 24)
    cfg = FlashConfig(block_q=16, block_k=32, bwd_block_q=32, bwd_block_k=16)
    got = _flash(q, k, v, dout, True, scale=0.3, config=cfg)
    want = _reference(q, k, v, dout, True, scale=0.3)
    for g, w in zip(got, want):
        _close(g, w)


def test_strided_inputs_and_other_ranks():
    g = torch.Generator().manual_seed(1)
    # (batch, seq, heads, dim) memory seen as (batch, heads, seq, dim): strided, not copied
    q, k, v = (torch.randn(2, 37, 3, 32, generator=g).transpose(1, 2) for _ in range(3))
    _close(flash_attention(q, k, v), dense_attention(q.double(), k.double(), v.double()))
    q2, k2, v2 = (torch.randn(29, 20, generator=g) for _ in range(3))  # (seq, dim)
    _close(flash_attention(q2, k2, v2, causal=True), dense_attention(q2.double(), k2.double(), v2.double(), causal=True))


def test_same_contract_as_tiled_attention():
    q, k, v, _ = _inputs(2, 2, 45, 31, 12)
    for causal in (False, True):
        _close(flash_attention(q, k, v, causal=causal), tiled_attention(q.double(), k.double(), v.double(), causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_float16_within_twice_the_error_of_dense_float16(causal):
    q, k, v, dout = _inputs(2, 2, 113, 97, 59, seed=3)
    want = _reference(q, k, v, dout, causal)
    got = _flash(*(t.half() for t in (q, k, v, dout)), causal)
    qh, kh, vh = (t.half().requires_grad_() for t in (q, k, v))
    out16 = dense_attention(qh, kh, vh, causal=causal)
    out16.backward(dout.half())
    dense16 = (out16.detach(), None, qh.grad, kh.grad, vh.grad)
    for name, g, d, w in zip(("out", "lse", "dq", "dk", "dv"), got, dense16, want):
        if d is None:
            continue
        assert g.dtype == torch.float16, name
        err, dense_err = (g.double() - w).abs().max().item(), (d.double() - w).abs().max().item()
        assert err <= 2 * dense_err + 1e-5, f"{name}: kernel error {err:.2e}, dense float16 error {dense_err:.2e}"


@pytest.mark.parametrize("forward", ["teaching", "causal-split"])
def test_nan_in_a_query_row_propagates_to_that_row_only(forward):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=gen) for _ in range(3))  # (B, H, N, D)
    q[0, 0, 5, 3] = float("nan")
    ref = dense_attention(q, k, v)
    from flashlib.ladder import attention

    out = attention(q, k, v, forward=forward)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[0, 0, 5]).all()


def test_backward_is_bitwise_deterministic():
    q, k, v, dout = _inputs(2, 2, 77, 90, 40, seed=5)
    first = _flash(q, k, v, dout, True)
    second = _flash(q, k, v, dout, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_empty_sequences():
    q, k, v, _ = _inputs(1, 2, 0, 5, 8)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 8)
    q, k, v, _ = _inputs(1, 2, 4, 0, 8)
    out = flash_attention(q.requires_grad_(), k, v)
    assert torch.equal(out, torch.zeros(1, 2, 4, 8))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def _message(fn, *args, **kwargs):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kwargs)
    return info.type, str(info.value)


@pytest.mark.parametrize("bad", [
    dict(q=[[1.0]]),
    dict(q=torch.randn(4)),
    dict(q=torch.randint(0, 3, (1, 1, 4, 8))),
    dict(k=torch.randn(1, 1, 4, 9)),
    dict(k=torch.randn(2, 1, 4, 8)),
    dict(v=torch.randn(1, 1, 5, 8)),
    dict(v=torch.randn(1, 1, 4, 8, dtype=torch.float16)),
    dict(causal=1),
    dict(scale="0.1"),
    dict(scale=float("nan")),
])
def test_bad_input_fails_as_tiled_attention_does(bad):
    args = dict(q=torch.randn(1, 1, 4, 8), k=torch.randn(1, 1, 4, 8), v=torch.randn(1, 1, 4, 8))
    args.update(bad)
    kind, message = _message(flash_attention, **args)
    tiled_kind, tiled_message = _message(tiled_attention, **args)
    assert kind is tiled_kind
    assert message == tiled_message.replace("tiled_attention", "flashlib.kernels.attention")


def test_kernel_specific_errors_name_the_value_and_the_fix():
    x = torch.randn(1, 1, 4, 300)
    _, message = _message(flash_attention, x, x, x)
    assert "head_dim 300" in message and "256" in message
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    kind, message = _message(flash_attention, x, x, x)
    assert kind is TypeError and "float64" in message and "tiled_attention" in message
    x = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
    kind, message = _message(flash_attention, x, x, x)
    assert kind is TypeError and "bfloat16" in message and "interpreter" in message
    x = torch.randn(1, 1, 4, 8)
    kind, message = _message(flash_attention, x, x, x, config={"block_q": 16})
    assert kind is TypeError and "FlashConfig" in message
    with pytest.raises(ValueError, match="power of two >= 16, got 48"):
        FlashConfig(block_q=48)
    with pytest.raises(ValueError, match="input_precision"):
        FlashConfig(input_precision="fp8")
    with pytest.raises(ValueError, match="'bwd_dq_transposed' must be True or False, got 1"):
        FlashConfig(bwd_dq_transposed=1)


def test_kernel_status_here_is_the_interpreter():
    status = kernel_status()
    assert status.can_run and status.mode == "interpreter" and "interpreter" in str(status)
    assert os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize("capability, name, timed, rungs", [
    ((7, 5), "Tesla T4", "float16", True), ((8, 0), "NVIDIA A100", "bfloat16", True),
    ((9, 0), "NVIDIA H200", "bfloat16", False)])
def test_gpu_plan_names_the_gpu_and_the_dtype_the_notebooks_time_in(monkeypatch, capability, name, timed, rungs):
    from flashlib.bench.point import measure_ceilings  # noqa: F401  (imports as on a GPU)
    from flashlib.kernels import gpu_plan, half_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    plan = gpu_plan()
    assert half_dtype() == getattr(torch, timed)
    assert f"{name} (compute capability {capability[0]}.{capability[1]})" in plan
    assert f"time them in {timed}" in plan
    assert ("bfloat16 needs compute capability 8.0" in plan) == (capability < (8, 0))
    assert ("TMA rungs need 9.0" in plan) == rungs


def test_a_runs_matmul_ceiling_is_read_in_either_half_dtype():
    from flashlib.bench.point import matmul_ceiling

    assert matmul_ceiling({"bf16_matmul_tflops": 700.0, "copy_gbps": 1.0}) == (700.0, "bf16")
    assert matmul_ceiling({"fp16_matmul_tflops": 65.0, "copy_gbps": 1.0}) == (65.0, "fp16")
    with pytest.raises(KeyError, match="no matmul rate"):
        matmul_ceiling({"copy_gbps": 1.0})


def _python(code):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


def test_import_flashlib_never_imports_triton_and_missing_triton_says_how_to_run():
    done = _python(
        "import sys\n"
        "import flashlib, flashlib.kernels\n"
        "assert 'triton' not in sys.modules, 'import flashlib imported triton'\n"
        "sys.modules['triton'] = None  # as on macOS or Windows, where Triton has no wheels\n"
        "s = flashlib.kernels.kernel_status()\n"
        "assert not s.can_run and s.mode is None and 'Linux' in s.reason, s\n"
        "try:\n"
        "    from flashlib import flash_attention\n"
        "except ImportError as e:\n"
        "    assert 'WSL2' in str(e) and 'Colab' in str(e), e\n"
        "    print('ok')\n"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_interpreter_is_chosen_automatically_but_a_user_setting_wins():
    done = _python("import os, flashlib.kernels as fk; fk.kernel_status(); print(os.environ['TRITON_INTERPRET'])")
    assert done.stdout.strip() == "1", done.stderr
    done = _python("import os; os.environ['TRITON_INTERPRET'] = '0'\n"
                   "import flashlib.kernels as fk; print(fk.kernel_status().mode)")
    assert done.stdout.strip() == "gpu", done.stderr


@settings(max_examples=12, deadline=None)
@given(seq_q=st.integers(1, 40), seq_k=st.integers(1, 40), dim=st.integers(1, 20), causal=st.booleans(),
       block_q=st.sampled_from([16, 32]), block_k=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_property_any_shape_and_block_sizes(seq_q, seq_k, dim, causal, block_q, block_k, seed):
    q, k, v, dout = _inputs(1, 2, seq_q, seq_k, dim, seed=seed)
    cfg = FlashConfig(block_q=block_q, block_k=block_k, bwd_block_q=block_k, bwd_block_k=block_q)
    got = _flash(q, k, v, dout, causal, config=cfg)
    want = _reference(q, k, v, dout, causal)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name == "lse":
            g, w = g[~torch.isinf(w)], w[~torch.isinf(w)]
        _close(g, w)


@pytest.mark.parametrize("seq_q,seq_k,causal", [(1000, 1000, True), (300, 1000, True), (1000, 300, True), (77, 300, False)])
def test_schedule_skips_exactly_the_tiles_the_reference_skips(seq_q, seq_k, causal):
    from flashlib import block_mask
    from flashlib.kernels.schedule import schedule
    from flashlib.masks import SKIPPED

    grid = schedule(seq_q, seq_k, 128, 64, causal)
    kinds = block_mask(seq_q, seq_k, block_q=128, block_k=64, causal=causal).kinds[0, 0]
    for i, row in enumerate(grid):
        for j, computed in enumerate(row):
            assert computed == bool(kinds[i, j] != SKIPPED), (i, j)


def test_exercise_checkers_accept_right_answers_and_reject_wrong_ones(capsys):
    from flashlib.course import kernel_exercises as ex

    assert ex.check_program_count(8) and not ex.check_program_count(7) and not ex.check_program_count(None)
    assert ex.check_qk_scale(0.125 * 1.4426950408889634) and not ex.check_qk_scale(0.125)
    # causal, N = 1500, 128 x 64 tiles: block i sees key tiles 0 .. ceil(min(128 (i+1), 1500) / 64) - 1
    assert ex.check_causal_tiles(sum(-(-min(128 * (i + 1), 1500) // 64) for i in range(12)))
    assert not ex.check_causal_tiles(12 * 24)
    assert ex.check_natural_lse(lambda m2, l: torch.where(l > 0, m2 * math.log(2) + torch.log(l), -math.inf))
    assert not ex.check_natural_lse(lambda m2, l: m2 + torch.log(l))
    assert ex.check_tensor_core_instruction("mma.sync") and not ex.check_tensor_core_instruction("wgmma")
    assert ex.check_tensor_core_instruction("wgmma", rows=128) and not ex.check_tensor_core_instruction("mma", rows=64)
    assert ex.check_backward_matmuls(7) and ex.check_backward_flops_ratio(2.5) and not ex.check_backward_flops_ratio(2)
    assert ex.check_scale_launcher(lambda x, a: x * a)
    assert not ex.check_scale_launcher(lambda x, a: torch.cat([x[:256] * a, x[256:]]))
    assert not ex.check_scale_launcher(lambda x, a: 1 / 0)
    out = capsys.readouterr().out
    assert out.count("PASS") == 9 and "NOT YET" in out


def test_tiny_model_trains_the_same_with_flash_and_dense_attention():
    from flashlib.course.training import train

    flash, dense = train(flash_attention, steps=3), train(dense_attention, steps=3)
    assert max(abs(a - b) for a, b in zip(flash, dense)) < 1e-5
    assert flash[-1] < flash[0]


def test_expanded_output_gradient_from_sum():
    # out.sum().backward() hands the kernel a dout with zero strides
    q, k, v, _ = _inputs(2, 3, 33, 41, 20, seed=7)
    got = _flash(q, k, v, torch.ones(1).expand(2, 3, 33, 20), True)
    want = _reference(q, k, v, torch.ones(2, 3, 33, 20), True)
    for g, w in zip(got[2:], want[2:]):
        _close(g, w)


def test_more_rows_than_a_cuda_grid_axis_takes(monkeypatch):
    """CUDA takes at most 65,535 programs on grid axes 1 and 2, where the kernels keep batch x heads:
    with the limit forced down to 5 rows, every launch covers at most 5 (a kv head's query heads
    together; with a mask function, whole batches), and the answer is dense attention's, forward
    and backward, with grouped heads and a mask function told each row's own batch and head."""
    from flashlib.kernels import rules

    monkeypatch.setattr(rules, "MAX_GRID_ROWS", 5)
    grids = []
    launcher = type(flashlib.kernels.function._attn_fwd)
    real = launcher.run
    monkeypatch.setattr(launcher, "run", lambda self, *a, **kw: (grids.append(kw["grid"]), real(self, *a, **kw))[1])
    shift = torch.tensor([[0, 5, 2, 9], [7, 1, 4, 3], [6, 0, 8, 2]])  # (B, H): a diagonal of each head's own

    def shifted(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift[b, h]

    gen = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(3, 4, 21, 16, generator=gen) for _ in range(2))  # (B, H, N, D), B*H = 12 rows
    k, v = (torch.randn(3, 2, 30, 16, generator=gen) for _ in range(2))  # six kv heads, each read by two
    cfg = FlashConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)
    # rows per launch: forward and dQ (runs of 4: whole groups, or whole batches), delta (5), dK/dV
    for options, runs in ((dict(causal=True), [4] * 6 + [5, 5, 2] + [5, 1]),
                          (dict(mask_mod=shifted), [4] * 6 + [5, 5, 2] + [4, 2])):
        grids.clear()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, config=cfg, **options)
        got = (out, *torch.autograd.grad(out, leaves, dout))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = dense_attention(*leaves, **options)
        want = (ref, *torch.autograd.grad(ref, leaves, dout.double()))
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g.double(), w, atol=3e-5, rtol=1e-4, msg=lambda m: f"{options} {name}: {m}")
        assert sorted(grid[1] for grid in grids) == sorted(runs), grids
