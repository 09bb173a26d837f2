"""The public op ``flashlib.flash_attention`` on a CPU: Triton's interpreter behind one custom op.

Checked against float64 dense attention and PyTorch autograd (the lse's gradient too),
inside ``torch.compile(fullgraph=True)`` and ``torch.export``, and for its errors.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

import flashlib  # noqa: E402
from flashlib import causal_mask, flash_attention  # noqa: E402
from flashlib.op import path_for  # noqa: E402
from flashlib.machinery.options import Options  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/test_gpu.py covers CUDA")


def _inputs(shape_q, seq_k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    *lead, seq_q, d = shape_q
    q = torch.randn(*lead, seq_q, d, generator=g, dtype=dtype)
    k, v = (torch.randn(*lead, seq_k, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _loss(out, lse):
    """Uses both outputs, so that the gradient flows through out and through lse."""
    weights = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (out * weights).square().sum() + 0.3 * finite.sum()


def _reference(q, k, v, causal):
    """out, lse and the gradients of _loss in float64, from scores written out densely."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = p @ v
    _loss(out, lse).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _ours(fn, q, k, v, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, causal)
    _loss(out, lse).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _eager(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal, return_lse=True)


CASES = [((2, 3, 17, 8), 17, True), ((1, 2, 9, 16), 23, True), ((1, 2, 23, 16), 9, True), ((3, 20, 40), 33, False)]


@pytest.mark.parametrize("shape_q,seq_k,causal", CASES)
def test_output_lse_and_gradients_match_float64(shape_q, seq_k, causal):
    q, k, v = _inputs(shape_q, seq_k)
    got, want = _ours(_eager, q, k, v, causal), _reference(q, k, v, causal)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4, msg=name)


def test_torch_compile_fullgraph_gives_the_eager_result_forward_and_backward():
    q, k, v = _inputs((2, 3, 17, 8), 17, seed=1)
    compiled = torch.compile(_eager, fullgraph=True)
    eager, jit = _ours(_eager, q, k, v, True), _ours(compiled, q, k, v, True)
    for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), eager, jit):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-6, msg=name)
    want = _reference(q, k, v, True)
    torch.testing.assert_close(jit[2].double(), want[2], atol=2e-5, rtol=1e-4)


def test_torch_export_sees_one_op():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attention(q, k, v, causal=True)

    q, k, v = _inputs((1, 2, 12, 16), 12, seed=2)
    exported = torch.export.export(Attention(), (q, k, v))
    calls = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.flashlib.flash_attention.default in calls
    assert not any("softmax" in str(t) or "matmul" in str(t) for t in calls)
    torch.testing.assert_close(exported.module()(q, k, v), flash_attention(q, k, v, causal=True))


def test_the_op_is_registered_with_its_fake():
    q, k, v = _inputs((2, 1, 5, 8), 7)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse, lse2 = torch.ops.flashlib.flash_attention(fq, fk, fv, Options(scale=0.5).op_numbers(), [])
    assert out.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert lse2.shape == (*q.shape[:-1], 1) and lse2.dtype == torch.float64  # the lse2 the backward reads: float64


def test_rows_that_see_no_key_give_zeros_and_zero_gradients():
    q, k, v = _inputs((1, 1, 6, 8), 3, seed=3)  # bottom-right: the first 3 rows see no key
    q.requires_grad_()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[..., :3, :], torch.zeros(1, 1, 3, 8)) and torch.isneginf(lse[..., :3]).all()
    out.sum().backward()
    assert torch.equal(q.grad[..., :3, :], torch.zeros(1, 1, 3, 8))


def test_on_a_cpu_the_teaching_kernels_run():
    x = torch.randn(1, 1, 4, 8)
    assert path_for(x) == ("teaching", "teaching") and path_for(x.half()) == ("teaching", "teaching")


def _message(*args, **kwargs):
    with pytest.raises((TypeError, ValueError)) as info:
        flash_attention(*args, **kwargs)
    return str(info.value)


def test_errors_name_the_public_function_the_argument_and_the_fix():
    x = torch.randn(1, 1, 4, 8)
    assert _message(x, x, torch.randn(1, 1, 4, 300)).startswith("flash_attention: argument 'v' has head_dim 300")
    assert _message(x, x, torch.randn(1, 1, 5, 8)).startswith("flash_attention: arguments 'k' and 'v'")
    assert "head_dim 300" in _message(*(torch.randn(1, 1, 4, 300),) * 3)
    assert "tiled_attention for float64" in _message(*(x.double(),) * 3)
    assert "bfloat16" in _message(*(x.bfloat16(),) * 3) and "interpreter" in _message(*(x.bfloat16(),) * 3)
    assert "'scale'" in _message(x, x, x, scale=float("nan"))
    with pytest.raises(TypeError, match="forward"):
        flash_attention(x, x, x, forward="tma")  # rung choices live in flashlib.ladder.attention


def test_the_package_exports_the_op():
    assert flashlib.flash_attention is flash_attention


# ----- variants: grouped heads, windows, soft-capping, mask functions -----------------------------

from flashlib import masks, scores  # noqa: E402

from .variants_reference import explicit_attention  # noqa: E402


def _grouped(seed=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 19, 16, generator=g)  # (batch, heads, seq, d)
    k, v = (torch.randn(2, 2, 23, 16, generator=g) for _ in range(2))  # (batch, kv_heads, seq, d)
    return q, k, v


VARIANTS = [dict(causal=True, window=(6, 0), softcap=2.5), dict(window=(-1, 3)), dict(softcap=1.0, causal=True)]


def _with(options):
    return lambda q, k, v, causal: flash_attention(q, k, v, return_lse=True, **options)


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(o))
def test_options_through_the_op_match_float64(options):
    q, k, v = _grouped()
    got = _ours(_with(options), q, k, v, None)
    want = _ours(lambda q, k, v, _: explicit_attention(q, k, v, **options), q.double(), k.double(), v.double(), None)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, atol=3e-5, rtol=1e-4, msg=name)


def test_options_inside_torch_compile_fullgraph_give_the_eager_result():
    q, k, v = _grouped(seed=5)
    options = VARIANTS[0]
    eager = _ours(_with(options), q, k, v, None)
    jit = _ours(torch.compile(_with(options), fullgraph=True), q, k, v, None)
    for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), eager, jit):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-6, msg=name)


def test_the_op_takes_its_options_as_one_list_of_numbers_and_one_of_tensors_and_fakes_grouped_shapes():
    # the schema is the one place the options cross: a new option adds no argument to it
    for op in (torch.ops.flashlib.flash_attention, torch.ops.flashlib.flash_attention_backward,
               torch.ops.flashlib.flash_attention_varlen, torch.ops.flashlib.flash_attention_varlen_backward):
        schema = str(op.default._schema)
        assert "float[] numbers, Tensor[] tensors)" in schema, schema
        assert not any(word in schema for word in ("causal", "scale", "window", "softcap", "sinks")), schema
    q, k, v = _grouped()
    from torch._subclasses.fake_tensor import FakeTensorMode

    options = Options.of(causal=True, scale=0.25, window=(4, 0), softcap=30.0)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse, lse2 = torch.ops.flashlib.flash_attention(fq, fk, fv, options.op_numbers(), [])
        dq, dk, dv, none = torch.ops.flashlib.flash_attention_backward(fq, fk, fv, out, lse, out, lse,
                                                                       options.op_numbers(), [])
        fs = mode.from_tensor(torch.zeros(q.shape[1]))
        with_sinks = options._replace(sinks=fs)
        *_, (sink_grad,) = torch.ops.flashlib.flash_attention_backward(fq, fk, fv, out, lse, out, lse,
                                                                       with_sinks.op_numbers(), with_sinks.tensors)
    assert out.shape == q.shape and lse.shape == q.shape[:-1] and dk.shape == k.shape and dv.shape == v.shape
    assert lse2.shape == (*q.shape[:-1], 1)  # the base-2 lse the backward reads
    assert none == [] and sink_grad.shape == (q.shape[1],)  # a gradient for each tensor the options hold


def test_options_cross_the_schema_and_come_back_the_same():
    sinks = torch.randn(3)
    for options in (Options(), Options.of(causal=True, scale=0.125, window=(7, -1), softcap=2.5),
                    Options.of(scale=3.0, window=(-1, 0), sinks=sinks)):
        back = Options.from_op(options.op_numbers(), options.tensors)
        assert back._replace(sinks=None) == options._replace(sinks=None)
        assert (back.sinks is None) == (options.sinks is None) and (back.sinks is None or back.sinks is sinks)
    with pytest.raises(ValueError, match="Python code"):
        Options(score_mod=lambda s, b, h, q, k: s).op_numbers()


def test_a_mask_function_runs_eagerly_outside_the_op():
    q, k, v = _grouped(seed=6)
    doc = masks.document(torch.arange(23) // 7)
    options = dict(causal=True, mask_mod=doc)
    got = _ours(_with(options), q, k, v, None)
    want = _ours(lambda q, k, v, _: explicit_attention(q, k, v, **options), q.double(), k.double(), v.double(), None)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, atol=3e-5, rtol=1e-4, msg=name)
    compiled = _ours(torch.compile(_with(options)), q, k, v, None)  # a graph break, then the same result
    for e, c in zip(got, compiled):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-6)
    with pytest.raises(Exception, match="flash_attention: a score_mod, mask_mod or block_mask is Python code.*graph "
                                        r"break.*fullgraph=True\), call flash_attention outside the compiled function"):
        torch.compile(_with(options), fullgraph=True)(q, k, v, None)


@pytest.mark.parametrize("score_mod", [scores.alibi(scores.alibi_slopes(4)), lambda s, b, h, q_idx, kv_idx: s * 0.5])
def test_a_score_function_leaves_the_graph_and_fullgraph_names_it(score_mod):
    """A score function is Python code, as a mask function is: torch.compile breaks the graph around the
    call (the same result), and fullgraph=True refuses it with an error naming score_mod and the graph
    break, not the inner workings of the checks it would otherwise have tried to trace."""
    q, k, v = _grouped(seed=7)
    options = dict(causal=True, score_mod=score_mod)
    eager = _ours(_with(options), q, k, v, None)
    for e, c in zip(eager, _ours(torch.compile(_with(options)), q, k, v, None)):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1e-6)
    with pytest.raises(Exception, match="score_mod.*Python code.*a graph break"):
        torch.compile(_with(options), fullgraph=True)(q, k, v, None)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    cu = torch.tensor([0, q.shape[-2]], dtype=torch.int32)
    with pytest.raises(Exception, match="flash_attention_varlen: a score_mod is Python code.*a graph break"):
        torch.compile(lambda *t: flashlib.flash_attention_varlen(*t, cu, cu, q.shape[-2], q.shape[-2],
                                                                 score_mod=score_mod), fullgraph=True)(*packed)


def test_every_option_takes_the_teaching_kernels():
    x, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    for options in (dict(window=(4, 0)), dict(softcap=30.0), dict(mask_mod=masks.causal), dict()):
        assert path_for(x, k, **options) == ("teaching", "teaching")
    assert path_for(x, x, window=(-1, -1)) == path_for(x)


def test_option_errors_name_the_public_function():
    q, k, v = _grouped()
    assert _message(q, k[:, :1].expand(2, 3, 23, 16), v).startswith("flash_attention: argument 'k' has 3 heads")
    assert "'softcap'" in _message(q, k, v, softcap=-2.0)
    assert "'window'" in _message(q, k, v, window=(-5, 0))
    assert "'mask_mod'" in _message(q, k, v, mask_mod=True)
