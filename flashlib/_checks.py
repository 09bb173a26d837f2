"""Input checks shared by every attention entry point.

Each error names the function, the argument, the value seen and what was expected,
so that a wrong call fails loudly instead of returning something silently wrong.
"""
from __future__ import annotations

import math
import numbers

import torch

LOOP_ORDERS = ("query", "key")


def check_attention_inputs(fn: str, q, k, v, *, causal, scale) -> float:
    """Validate (..., seq, head_dim) inputs; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(
                f"{fn}: argument '{name}' must have shape (batch, heads, seq, head_dim) or at least "
                f"(seq, head_dim); got rank {t.ndim} with shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{fn}: argument '{name}' must be a floating-point tensor "
                f"(float16, bfloat16, float32 or float64); got {t.dtype}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.ndim != q.ndim:
            raise ValueError(
                f"{fn}: argument '{name}' has rank {t.ndim} (shape {tuple(t.shape)}) but 'q' has rank "
                f"{q.ndim} (shape {tuple(q.shape)}); q, k and v must have the same rank"
            )
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"{fn}: argument '{name}' has leading (batch, heads) dims {tuple(t.shape[:-2])} but 'q' has "
                f"{tuple(q.shape[:-2])}; they must match exactly"
            )
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"{fn}: argument '{name}' has head_dim {t.shape[-1]} but 'q' has head_dim {q.shape[-1]}; "
                "q, k and v must share head_dim"
            )
        if t.dtype != q.dtype:
            raise TypeError(
                f"{fn}: argument '{name}' has dtype {t.dtype} but 'q' has {q.dtype}; "
                "cast q, k and v to one dtype"
            )
        if t.device != q.device:
            raise ValueError(
                f"{fn}: argument '{name}' is on {t.device} but 'q' is on {q.device}; "
                "move q, k and v to one device"
            )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{fn}: arguments 'k' and 'v' must have the same sequence length; "
            f"got k with {k.shape[-2]} and v with {v.shape[-2]}"
        )
    if q.shape[-1] < 1:
        raise ValueError(f"{fn}: argument 'q' must have head_dim >= 1; got shape {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: argument 'causal' must be True or False, got {causal!r}")
    return resolve_scale(fn, scale, q.shape[-1])


def resolve_scale(fn: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"{fn}: argument 'scale' must be a finite real number or None, got {scale!r}")
    return float(scale)


def check_block(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: argument '{name}' must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{fn}: argument '{name}' must be >= 1, got {value}")
    return int(value)


def check_loop(fn: str, loop) -> str:
    if loop not in LOOP_ORDERS:
        raise ValueError(f"{fn}: argument 'loop' must be one of {LOOP_ORDERS}, got {loop!r}")
    return loop
