"""flashlib: FlashAttention, tile by tile.

The reference algorithms (plain PyTorch, any device, differentiable) import without
Triton; ``flash_attention`` (the fused Triton kernels) is imported on first use.
"""
from .dense import causal_mask, dense_attention
from .softmax import (SoftmaxState, merge_partials, merge_states, naive_softmax, online_softmax,
                      online_softmax_state, online_softmax_steps, safe_softmax, softmax_state)
from .tiled import TiledTrace, TileStep, tiled_attention, tiled_forward, trace_tiled_attention
from .backward import TiledAttentionFunction, tiled_backward

__version__ = "0.1.0"

__all__ = [
    "causal_mask", "dense_attention",
    "SoftmaxState", "merge_partials", "merge_states", "naive_softmax", "online_softmax", "online_softmax_state",
    "online_softmax_steps", "safe_softmax", "softmax_state",
    "TiledTrace", "TileStep", "tiled_attention", "tiled_forward", "trace_tiled_attention",
    "TiledAttentionFunction", "tiled_backward",
    "flash_attention",
]


def __getattr__(name):
    # The fused op needs Triton (Linux only); import it only when asked for.
    if name == "flash_attention":
        from .kernels import flash_attention
        return flash_attention
    raise AttributeError(f"module 'flashlib' has no attribute {name!r}")
