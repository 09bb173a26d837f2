"""A head dim of v's own (DeepSeek's MLA: 192 for q and k, 128 for v in prefill and training) in the
fused teaching kernels, forward and backward, dense and packed: against float64 autograd of the
formula written here and against PyTorch's scaled_dot_product_attention (which takes v of its own
head dim on a CPU). The scale stays q's: 1/sqrt(192) at MLA's shapes."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

import flashlib  # noqa: E402
from flashlib import scores  # noqa: E402

DIMS = [(192, 128), (24, 16), (16, 40)]  # MLA's; odd dims; v wider than q


def _inputs(seed=0, *, batch=1, heads=4, kv_heads=2, seq_q=20, seq_k=20, d=24, dv=16):
    """float32 q (batch, heads, seq_q, d), k (batch, kv_heads, seq_k, d), v (.., dv), dout (.., seq_q, dv)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, d, generator=g)
    k = torch.randn(batch, kv_heads, seq_k, d, generator=g)
    v = torch.randn(batch, kv_heads, seq_k, dv, generator=g)
    dout = torch.randn(batch, heads, seq_q, dv, generator=g)
    return q, k, v, dout


def formula(q, k, v, *, causal=False, scale=None, window=None, softcap=None):
    """softmax(q kᵀ · scale) v as written, bottom-right causal, window (left, right) with -1 for no
    limit, soft-capping c · tanh(s / c); a row that sees no key gives 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = (q @ k.transpose(-1, -2)) * scale  # (batch, heads, seq_q, seq_k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[-2])[:, None] + k.shape[-2] - q.shape[-2]  # the diagonal, bottom-right
    j = torch.arange(k.shape[-2])[None, :]
    visible = torch.ones_like(j >= i)
    left, right = window if window is not None else (-1, -1)
    if causal:
        visible &= j <= i
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    return p @ v


def _grads(fn, tensors, dout):
    """(out, dq, dk, dv) of fn on fresh leaves of tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _check_against_formula(fn, tensors, dout, atol=2e-5, **options):
    want = _grads(lambda *t: formula(*t, **options), [t.double() for t in tensors], dout.double())
    got = _grads(fn, tensors, dout)
    assert got[0].shape == want[0].shape
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", DIMS)
def test_flash_attention_matches_the_formula(d, dv, causal):
    q, k, v, dout = _inputs(d=d, dv=dv, seq_q=13 if causal else 20)  # grouped heads; causal: seq_q < seq_k
    _check_against_formula(lambda *t: flashlib.flash_attention(*t, causal=causal), (q, k, v), dout, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", [(192, 128), (16, 40)])
def test_flash_attention_matches_sdpa(d, dv, causal):
    q, k, v, dout = _inputs(1, d=d, dv=dv, heads=2, kv_heads=2)  # seq_q = seq_k: SDPA's diagonal is ours
    got = _grads(lambda *t: flashlib.flash_attention(*t, causal=causal), (q, k, v), dout)
    want = _grads(lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=causal), (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("d, dv", [(24, 16), (16, 40)])
def test_a_score_function_and_a_window_still_work(d, dv):
    q, k, v, dout = _inputs(2, d=d, dv=dv, seq_q=17, seq_k=23)
    capped = lambda *t: flashlib.flash_attention(*t, score_mod=scores.softcap(3.0))  # noqa: E731
    _check_against_formula(capped, (q, k, v), dout, softcap=3.0)
    windowed = lambda *t: flashlib.flash_attention(*t, causal=True, window=(5, 0), softcap=3.0)  # noqa: E731
    _check_against_formula(windowed, (q, k, v), dout, causal=True, window=(5, 0), softcap=3.0)


def test_mla_shapes_with_a_window_and_the_scale_given():
    q, k, v, dout = _inputs(3, d=192, dv=128, seq_q=19, seq_k=19)
    fn = lambda *t: flashlib.flash_attention(*t, window=(4, 3), scale=0.07)  # noqa: E731
    _check_against_formula(fn, (q, k, v), dout, window=(4, 3), scale=0.07)


def test_awkward_layouts():
    """v as a transposed view (its last dim not contiguous: copied) and as every other column of a
    wider tensor; q and dout sliced out of larger ones."""
    q, k, v, dout = _inputs(4, d=24, dv=16, seq_q=18, seq_k=18)
    g = torch.Generator().manual_seed(5)
    v_t = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # (batch, kv_heads, seq_k, dv), strides (.., 1, seq_k)
    assert v_t.stride(-1) != 1
    v_wide = torch.randn(*v.shape[:-1], 2 * v.shape[-1], generator=g)
    v_wide[..., ::2] = v
    q_big = torch.randn(1, 4, 30, 40, generator=g)
    q_big[:, :, 5:23, 3:27] = q
    for view in (v_t, v_wide[..., ::2]):
        _check_against_formula(flashlib.flash_attention, (q_big[:, :, 5:23, 3:27], k, view), dout)


def test_the_lse_and_empty_keys():
    q, k, v, _ = _inputs(6, d=24, dv=16)
    out, lse = flashlib.flash_attention(q, k, v, return_lse=True)
    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 24 ** -0.5
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-5)
    out = flashlib.flash_attention(q, k[..., :0, :], v[..., :0, :])
    assert out.shape == (*q.shape[:-1], 16) and not out.any()


def test_the_custom_ops_fake_implementation_knows_vs_head_dim():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(1, 2, 8, 192), torch.empty(1, 2, 8, 192), torch.empty(1, 2, 8, 128)
        out, lse = flashlib.flash_attention(q, k, v, causal=True, return_lse=True)
        assert out.shape == (1, 2, 8, 128) and lse.shape == (1, 2, 8)
        packed = flashlib.flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                 torch.tensor([0, 8], dtype=torch.int32),
                                                 torch.tensor([0, 8], dtype=torch.int32), 8, 8)
        assert packed.shape == (8, 2, 128)


# ----- packed sequences -----------------------------------------------------------------------

def _packed(seed, lengths_q, lengths_k, *, heads=4, kv_heads=2, d=24, dv=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, d, generator=g)
    k = torch.randn(sum(lengths_k), kv_heads, d, generator=g)
    v = torch.randn(sum(lengths_k), kv_heads, dv, generator=g)
    dout = torch.randn(sum(lengths_q), heads, dv, generator=g)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, dout, cu


def _packed_formula(q, k, v, cu_q, cu_k, **options):
    """formula on each sequence, (tokens, heads, d) as (1, heads, tokens, d)."""
    outs = []
    for b in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [t[part].transpose(0, 1)[None] for t, part in ((q, rows), (k, keys), (v, keys))]
        outs.append(formula(*seq, **options)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window=(3, 0), softcap=4.0), dict()])
@pytest.mark.parametrize("d, dv", [(192, 128), (16, 40)])
def test_flash_attention_varlen_matches_the_formula(d, dv, options):
    q, k, v, dout, (cu_q, cu_k) = _packed(7, [5, 0, 11], [9, 3, 11], d=d, dv=dv)
    want = _grads(lambda *t: _packed_formula(*t, cu_q, cu_k, **options), [t.double() for t in (q, k, v)],
                  dout.double())
    got = _grads(lambda *t: flashlib.flash_attention_varlen(*t, cu_q, cu_k, 11, 11, **options), (q, k, v), dout)
    assert got[0].shape == (q.shape[0], q.shape[1], dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5, msg=name)


def test_flash_attention_varlen_with_a_score_function_and_v_as_a_view():
    q, k, v, dout, (cu_q, cu_k) = _packed(8, [6, 10], [6, 10], d=24, dv=16)
    v_view = v.transpose(0, 1).contiguous().transpose(0, 1)  # (total_k, kv_heads, dv), heads outermost
    fn = lambda *t: flashlib.flash_attention_varlen(*t, cu_q, cu_k, 10, 10, causal=True,  # noqa: E731
                                                    score_mod=scores.softcap(2.5))
    want = _grads(lambda *t: _packed_formula(*t, cu_q, cu_k, causal=True, softcap=2.5),
                  [t.double() for t in (q, k, v)], dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), _grads(fn, (q, k, v_view), dout), want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5, msg=name)


def test_the_packed_reference_takes_it_too():
    q, k, v, _, (cu_q, cu_k) = _packed(9, [4, 7], [5, 7], d=24, dv=16)
    got = flashlib.varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 7, 7, causal=True)
    torch.testing.assert_close(got, _packed_formula(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True),
                               rtol=0, atol=1e-12)


# ----- what still refuses it ------------------------------------------------------------------

def test_the_ladder_still_refuses_it_and_decoding_takes_it():
    """The ladder's rungs (one head dim for q, k and v) have no head dim of v's own; decoding has one
    (tests/test_mla_decode.py holds it to its references): here only that it runs to v's width."""
    from flashlib.ladder.forward import forward as rung_forward

    q, k, v, _ = _inputs(d=24, dv=16, heads=2, kv_heads=2)
    out = flashlib.decode_attention(q[:, :, :1], k, v, torch.tensor([20], dtype=torch.int32))
    want = flashlib.decode_reference(q[:, :, :1], k, v, torch.tensor([20], dtype=torch.int32))
    assert out.shape[-1] == 16
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="'v' has head_dim 16.*flash_attention, flash_attention_varlen, "
                                         "ring_attention and decode_attention take a head dim of v's own"):
        rung_forward(q, k, v, rung="teaching")
