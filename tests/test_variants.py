"""The teaching kernels' variants in Triton's CPU interpreter: grouped-query heads, windows,
soft-capping and mask functions, alone and together, against float64 attention with an explicit
mask (forward, lse and every gradient, the lse's too); the tiles they skip, counted."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # imported only through flashlib.kernels
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from hypothesis import given, settings, strategies as st  # noqa: E402

from flashlib import block_mask, masks  # noqa: E402
from flashlib.kernels import FlashConfig, attention  # noqa: E402

from .variants_reference import assert_matches, explicit_attention  # noqa: E402
from .variants_reference import outputs_and_grads as _grads  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/test_gpu.py covers CUDA")

TILES = FlashConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)


def _inputs(batch, heads, kv_heads, seq_q, seq_k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, d, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq_k, d, generator=g) for _ in range(2))
    return q, k, v


def _check(q, k, v, config=TILES, **kw):
    got = _grads(lambda q, k, v: attention(q, k, v, config=config, return_lse=True, **kw), q, k, v)
    assert_matches(got, _grads(lambda q, k, v: explicit_attention(q, k, v, **kw), q.double(), k.double(), v.double()))


def striped(b, h, q_idx, kv_idx):
    """A mask function that reads the batch row and the head."""
    return ((kv_idx + b) % 3 != h) | (q_idx == kv_idx)


# (batch, heads, kv_heads, seq_q, seq_k, head_dim), options
CASES = [
    ((1, 6, 2, 37, 29, 16), dict(causal=True)),                                    # grouped-query
    ((2, 3, 1, 21, 40, 8), dict()),                                                # multi-query
    ((1, 2, 2, 45, 45, 16), dict(window=(5, 3))),
    ((1, 2, 1, 40, 23, 16), dict(causal=True, window=(7, -1))),                    # rows that see no key
    ((1, 2, 2, 30, 41, 24), dict(window=(-1, 4))),
    ((2, 2, 2, 33, 33, 16), dict(softcap=2.0)),
    ((1, 4, 2, 47, 47, 16), dict(causal=True, window=(20, 0), softcap=1.5)),
    ((1, 2, 2, 40, 40, 16), dict(mask_mod=masks.prefix_lm(9))),
    ((2, 4, 2, 48, 48, 16), dict(causal=True, mask_mod=masks.document(torch.arange(48) // 13))),
    ((2, 3, 3, 35, 35, 16), dict(window=(6, 6), softcap=3.0, mask_mod=striped)),
]


@pytest.mark.parametrize("shape,options", CASES, ids=[",".join(o) or "gqa" for _, o in CASES])
def test_forward_lse_and_gradients_match_float64(shape, options):
    _check(*_inputs(*shape), **options)


@settings(max_examples=6)
@given(kv_heads=st.integers(1, 2), group=st.integers(1, 3), seq_q=st.sampled_from([0, 1, 17, 40]),
       seq_k=st.sampled_from([0, 1, 16, 33]), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.integers(-1, 20), st.integers(-1, 20))),
       softcap=st.one_of(st.none(), st.floats(1.0, 5.0)), seed=st.integers(0, 2**16))
def test_any_shape_group_window_and_length(kv_heads, group, seq_q, seq_k, causal, window, softcap, seed):
    _check(*_inputs(1, kv_heads * group, kv_heads, seq_q, seq_k, 8, seed), causal=causal, window=window,
           softcap=softcap)


def test_float16_within_twice_the_error_of_dense_float16():
    q, k, v = _inputs(1, 4, 2, 50, 50, 32, seed=5)
    kw = dict(causal=True, window=(12, 0), softcap=4.0)
    want = explicit_attention(q, k, v, **kw)[0]
    got = attention(q.half(), k.half(), v.half(), config=TILES, **kw)
    dense16 = explicit_attention(q.half().double(), k.half().double(), v.half().double(), **kw)[0].half()
    err, dense_err = (got.double() - want).abs().max().item(), (dense16.double() - want).abs().max().item()
    assert got.dtype == torch.float16 and err <= 2 * dense_err + 1e-4, (err, dense_err)


class DotCounter:
    """Counts the interpreter's tl.dot calls: the tiles a kernel computes, times its dots per tile."""

    def __init__(self, monkeypatch):
        from triton.runtime.interpreter import InterpreterBuilder

        self.calls, original = 0, InterpreterBuilder.create_dot

        def counted(builder, *args, **kwargs):
            self.calls += 1
            return original(builder, *args, **kwargs)

        monkeypatch.setattr(InterpreterBuilder, "create_dot", counted)


def _forward_tiles(monkeypatch, q, k, v, **kw):
    counter = DotCounter(monkeypatch)
    with torch.no_grad():
        attention(q, k, v, config=TILES, **kw)
    return counter.calls // 2  # q kᵀ and p v per computed tile


def test_a_window_visits_key_tiles_linear_in_the_length(monkeypatch):
    tiles = {n: _forward_tiles(monkeypatch, *_inputs(1, 1, 1, n, n, 16), causal=True, window=(32, 0))
             for n in (128, 256)}
    # each block of 16 rows: its diagonal tile and the two before it (32 keys back), the first two blocks fewer
    assert tiles == {128: 3 * 128 // 16 - 3, 256: 3 * 256 // 16 - 3}
    causal = _forward_tiles(monkeypatch, *_inputs(1, 1, 1, 256, 256, 16), causal=True)
    assert causal == 16 * 17 // 2


def test_the_block_mask_skips_tiles_forward_and_backward(monkeypatch):
    q, k, v = _inputs(1, 2, 2, 96, 96, 16)
    doc = masks.document(torch.arange(96) // 32)  # three documents of 32 tokens
    bm = block_mask(96, 96, block_q=16, block_k=16, causal=True, mask_mod=doc)
    computed = bm.counts()["partial"] + bm.counts()["full"]
    assert computed == 3 * 3 and _forward_tiles(monkeypatch, q, k, v, causal=True, mask_mod=doc) == 2 * computed
    counter = DotCounter(monkeypatch)
    out = attention(*(t.requires_grad_() for t in (q, k, v)), config=TILES, causal=True, mask_mod=doc)
    forward = counter.calls
    out.sum().backward()
    # backward: 4 dots per tile in the dK/dV kernel (s, dv, dp, dk), 3 in the dQ kernel (s, dp, dq)
    assert forward == 2 * 2 * computed and counter.calls - forward == 2 * (4 + 3) * computed


def test_grouped_backward_is_deterministic():
    q, k, v = _inputs(1, 6, 2, 40, 40, 16, seed=9)
    first, second = (_grads(lambda q, k, v: attention(q, k, v, config=TILES, causal=True, window=(9, 2),
                                                      return_lse=True), q, k, v) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_mask_function_is_compiled_once_per_source():
    from flashlib.kernels.maskfn import compile_mask

    assert compile_mask("t", striped, "cpu").jit is compile_mask("t", striped, "cpu").jit
    # a number a closure captures is given to the kernel at launch: another window, the same kernel
    four, five = (compile_mask("t", masks.sliding_window(n), "cpu") for n in (4, 5))
    assert four.jit is five.jit and four.data == (4,) and five.data == (5,)


def test_mask_functions_of_a_window_equal_the_window_option():
    q, k, v = _inputs(1, 2, 2, 40, 40, 16, seed=2)
    a = attention(q, k, v, config=TILES, causal=True, window=(6, 0))
    b = attention(q, k, v, config=TILES, mask_mod=masks.sliding_window(6))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(window=(0, -3)), ValueError, ["'window'", "(0, -3)"]),
    (dict(softcap=0), ValueError, ["'softcap'", "> 0"]),
    (dict(mask_mod="document"), TypeError, ["'mask_mod'"]),
])
def test_bad_options_are_named(kwargs, exc, words):
    q, k, v = _inputs(1, 2, 2, 4, 4, 8)
    with pytest.raises(exc) as info:
        attention(q, k, v, **kwargs)
    for w in ["flashlib.kernels.attention", *words]:
        assert w in str(info.value), (w, str(info.value))


def test_heads_that_do_not_divide_are_named():
    q, k, v = _inputs(1, 8, 3, 4, 4, 8)
    with pytest.raises(ValueError, match=r"argument 'k' has 3 heads but 'q' has 8; the query heads must be a "
                                         r"multiple of the key/value heads \(grouped-query attention\)"):
        attention(q, k, v)
    assert math.isfinite(attention(q, k[:, :2], v[:, :2]).sum().item())


def test_mask_functions_the_kernels_cannot_compile_are_named():
    q, k, v = _inputs(1, 2, 2, 20, 20, 8)
    with pytest.raises(TypeError, match="'mask_mod': a Python truth value.*in <lambda>, line"):
        attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx and q_idx < kv_idx + 3)
    with pytest.raises(ValueError, match="'mask_mod': document indexes a tensor out of its bounds.*20 queries"):
        attention(q, k, v, mask_mod=masks.document(torch.zeros(12, dtype=torch.long)))
