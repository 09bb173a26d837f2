import pytest
import torch

from flashlib import dense_attention, tiled_attention, trace_tiled_attention

ENTRY_POINTS = [dense_attention, tiled_attention, trace_tiled_attention]


def qkv(*shapes, dtype=torch.float32):
    return [torch.randn(*s).to(dtype) for s in shapes]


CASES = [
    # (arguments, keyword arguments, exception, words the message must contain)
    (qkv((4,), (4, 3), (4, 3)), {}, ValueError, ["'q'", "rank 1"]),
    (qkv((1, 4, 3), (4, 3), (4, 3)), {}, ValueError, ["'k'", "rank 2", "same rank"]),
    (qkv((2, 4, 3), (3, 4, 3), (3, 4, 3)), {}, ValueError, ["'k'", "3 heads", "'q' has 2", "grouped-query"]),
    (qkv((2, 2, 4, 3), (3, 2, 4, 3), (3, 2, 4, 3)), {}, ValueError, ["'k'", "batch dims (3,)", "(2,)"]),
    (qkv((4, 4, 3), (2, 4, 3), (1, 4, 3)), {}, ValueError, ["'k' and 'v'", "(2,)", "(1,)"]),
    (qkv((4, 3), (4, 5), (4, 5)), {}, ValueError, ["'k'", "head_dim 5", "head_dim 3"]),
    (qkv((4, 3), (4, 3), (4, 0)), {}, ValueError, ["'v'", "head_dim >= 1"]),  # its own head dim, >= 1
    (qkv((4, 3), (4, 3), (5, 3)), {}, ValueError, ["'k' and 'v'", "k with 4", "v with 5"]),
    (qkv((4, 3), (4, 3), (4, 3), dtype=torch.int64), {}, TypeError, ["'q'", "floating-point", "torch.int64"]),
    ([torch.randn(4, 3), torch.randn(4, 3).double(), torch.randn(4, 3)], {}, TypeError,
     ["'k'", "torch.float64", "torch.float32"]),
    ([torch.randn(4, 3), torch.randn(4, 3, device="meta"), torch.randn(4, 3)], {}, ValueError, ["'k'", "meta", "cpu"]),
    ([[1.0], torch.randn(4, 3), torch.randn(4, 3)], {}, TypeError, ["'q'", "torch.Tensor", "list"]),
    (qkv((4, 3), (4, 3), (4, 3)), {"causal": 1}, TypeError, ["'causal'"]),
    (qkv((4, 3), (4, 3), (4, 3)), {"scale": float("nan")}, TypeError, ["'scale'", "nan"]),
]


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("args,kwargs,exc,words", CASES)
def test_bad_input_is_named(fn, args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert fn.__name__ in message
    for w in words:
        assert w in message, (w, message)


@pytest.mark.parametrize("fn", [tiled_attention, trace_tiled_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs,exc,words", [
    ({"block_q": 0}, ValueError, ["'block_q'", ">= 1", "0"]),
    ({"block_k": -3}, ValueError, ["'block_k'", "-3"]),
    ({"block_k": 2.5}, TypeError, ["'block_k'", "2.5"]),
    ({"block_q": True}, TypeError, ["'block_q'"]),
    ({"loop": "row"}, ValueError, ["'loop'", "'row'", "'query'", "'key'"]),
])
def test_bad_tiling_is_named(fn, kwargs, exc, words):
    with pytest.raises(exc) as info:
        fn(*qkv((4, 3), (4, 3), (4, 3)), **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs,exc,words", [
    ({"window": (-2, 3)}, ValueError, ["'window'", "(-2, 3)", "-1 for no limit"]),
    ({"window": 4}, TypeError, ["'window'", "pair of ints"]),
    ({"window": (1.5, 0)}, TypeError, ["'window'"]),
    ({"softcap": 0.0}, ValueError, ["'softcap'", "> 0", "None"]),
    ({"softcap": -1}, ValueError, ["'softcap'", "-1"]),
    ({"softcap": "30"}, TypeError, ["'softcap'"]),
    ({"mask_mod": 3}, TypeError, ["'mask_mod'", "int"]),
    ({"mask_mod": lambda b, h, q: q}, TypeError, ["'mask_mod'", "four arguments"]),
])
def test_bad_variant_options_are_named(fn, kwargs, exc, words):
    with pytest.raises(exc) as info:
        fn(*qkv((4, 3), (4, 3), (4, 3)), **kwargs)
    assert fn.__name__ in str(info.value)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
