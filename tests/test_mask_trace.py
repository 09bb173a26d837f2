"""Mask functions the kernels compile from what they do (a trace on symbolic indices), however
their source is laid out: each construct below runs in the interpreted kernels and must give
``flex_attention``'s forward (out and lse) on the same function, and float64 attention's gradients
on flex's own ``create_mask``; what cannot run on tiles is refused in one line naming mask_mod.

These are the shapes that text-based translation got wrong: a lambda continued on the next line,
lambdas one per line in a dict, a decorated mask (``functools.wraps`` sets ``__wrapped__``), a
helper called with shifted indices, index arithmetic past 2^31, a captured int past 2^31, locals
named like generated code, a lambda given a ``__name__``, a ``functools.partial``, a callable
object.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

from flashlib.kernels import attention
from flashlib.kernels.maskfn import compile_mask, symbol_bounds

from .test_flex import _flex, _inputs, _same_lse, check_gradients

# ----- the constructs --------------------------------------------------------------------------

BLACK = {  # as Black lays out a call's keyword arguments: the lambda's body on the next line
    "mask_mod": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx)
    & (q_idx - kv_idx < 8),
}
PER_LINE = {
    "near": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 3,
    "far": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() > 3,
}


def also_even(mask):
    @functools.wraps(mask)
    def wrapped(b, h, q_idx, kv_idx):
        return mask(b, h, q_idx, kv_idx) & (kv_idx % 2 == 0)
    return wrapped


@also_even
def decorated_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


IDS = torch.arange(80) // 11  # documents of 11 tokens


def same_doc(a, c):
    return IDS[a] == IDS[c]


def shifted_doc(b, h, q_idx, kv_idx):
    return same_doc(q_idx - 5, kv_idx)  # q_idx < 5 reads IDS[-5..-1], counted from the end


def hashed(b, h, q_idx, kv_idx):
    return (q_idx * 10_000_019 + kv_idx) % 7 < 4  # past 2^31 once q_idx > 214


FAR = 2**40


def far_causal(b, h, q_idx, kv_idx):
    return kv_idx + FAR <= q_idx + FAR


def generated_names(b, h, q_idx, kv_idx):
    data = q_idx - kv_idx
    tl = data >= 0
    _gather = (data % 3) != 1
    return tl & _gather


named = lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 5 != 0  # noqa: E731
named.__name__ = "named"


def banded(width, b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= width


class Stripes:
    def __init__(self, every):
        self.every = every

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx % self.every) != (h % self.every)


WRAPPING = (torch.arange(90) % 4).to(torch.int8)


def int8_wraps(b, h, q_idx, kv_idx):
    return WRAPPING[kv_idx] * 100 > 0  # int8 in PyTorch: 200 wraps to -56, 300 to 44


LIMIT = torch.tensor(9)


def methods_and_functions(b, h, q_idx, kv_idx):
    gap = (q_idx - kv_idx).clamp(min=-4, max=LIMIT)
    return torch.logical_and(gap ** 2 <= 30, torch.where(h % 2 == 0, gap >= 0, kv_idx.remainder(3) != 1)) \
        | kv_idx.eq(0)


def floors(b, h, q_idx, kv_idx):
    return ((kv_idx - q_idx) // 3 == -1) | (torch.div(kv_idx - q_idx, 4, rounding_mode="floor") == -3)


CONSTRUCTS = {
    "black_layout": BLACK["mask_mod"], "per_line_near": PER_LINE["near"], "per_line_far": PER_LINE["far"],
    "decorated": decorated_causal, "shifted_helper": shifted_doc, "hashed": hashed, "far_causal": far_causal,
    "generated_names": generated_names, "named_lambda": named, "partial": functools.partial(banded, 6),
    "callable_object": Stripes(3), "int8_wraps": int8_wraps,
    "methods_and_functions": methods_and_functions, "floors": floors,
    "combined": and_masks(or_masks(decorated_causal, PER_LINE["near"]), Stripes(4)),
}


@pytest.mark.parametrize("name", list(CONSTRUCTS))
def test_forward_equals_flex_attention(name):
    shape = (260, 40) if name == "hashed" else (70, 53)
    q, k, v = _inputs(*shape)
    mask_mod = CONSTRUCTS[name]
    out, lse = _flex(q, k, v, mask_mod)
    got, got_lse = attention(q, k, v, mask_mod=mask_mod, return_lse=True)
    torch.testing.assert_close(got, out, atol=2e-6, rtol=2e-5)
    assert _same_lse(got_lse, lse, 2e-5)


@pytest.mark.parametrize("name", ["black_layout", "decorated", "shifted_helper", "far_causal", "int8_wraps",
                                  "methods_and_functions"])
def test_gradients_equal_float64_attention(name):
    check_gradients(CONSTRUCTS[name], name)


def test_arithmetic_is_widened_only_where_the_lengths_need_it():
    def hashed_small(b, h, q_idx, kv_idx):
        return (q_idx * 1_000_003 + kv_idx) % 7 < 4  # q_idx < 2147 stays in int32

    short = compile_mask("here", hashed_small, "cpu", symbol_bounds(1, 1, 1000, 1000)).source
    long = compile_mask("here", hashed_small, "cpu", symbol_bounds(1, 1, 4096, 4096)).source
    causal = compile_mask("here", CONSTRUCTS["black_layout"], "cpu", symbol_bounds(1, 1, 2**20, 2**20)).source
    assert "int64" not in short and "tl.int64" in long and "int64" not in causal


@pytest.mark.parametrize("body, construct", [
    ("(q_idx >= kv_idx) and (kv_idx > 2)", "a Python truth value"),
    ("q_idx if h else kv_idx", "a Python truth value"),
    ("max(q_idx, kv_idx) > 3", "a builtin that compares"),
    ("q_idx.float().sin() > 0", "the method .sin()"),
    ("torch.tensor([1, 2])", "shape (2,) that does not depend on the indices"),
    ("q_idx - kv_idx", "returns int64 values"),
    ("q_idx + 2**70 > 0", "does not fit int64"),
    ("IDS[q_idx, kv_idx] > 0", "2 indices into a captured tensor of 1 dims"),
    ("IDS[:] == 0", "shape (80,) that does not depend on the indices"),
    ("IDS[q_idx:] == 0", "where Python needs an int (a slice bound"),
    ("IDS[1:] == IDS[q_idx]", "shape (79,) used whole"),
    ("IDS.reshape(8, 10)[h][q_idx] == 0", "1 indices into a captured tensor of 2 dims"),
])
def test_what_cannot_run_on_tiles_is_refused_by_name(body, construct):
    mask_mod = eval(f"lambda b, h, q_idx, kv_idx: {body}")  # noqa: S307 (the test's own strings)
    q, k, v = _inputs(8, 8)
    with pytest.raises(TypeError) as info:
        attention(q, k, v, mask_mod=mask_mod)
    message = str(info.value)
    assert message.startswith("flashlib.kernels.attention: argument 'mask_mod': ") and construct in message, message
    assert "\n" not in message


def test_the_same_behaviour_compiles_to_the_same_kernel():
    first = compile_mask("here", PER_LINE["near"], "cpu")
    again = compile_mask("here", lambda b, h, i, j: torch.abs(i - j) <= 3, "cpu")
    assert first.jit is again.jit and first.source == again.source
