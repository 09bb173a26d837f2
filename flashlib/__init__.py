"""flashlib: FlashAttention, tile by tile.

The reference algorithms of notebooks 01-04 (plain PyTorch, any device, differentiable)
import without Triton; ``flash_attention`` and ``flash_attention_varlen``, the public fused ops
(:mod:`flashlib.op`), and ``decode_attention``, split-KV decoding over a KV cache, with ``DecodePlan``,
its launches planned once per batch layout (:mod:`flashlib.decode`), are imported on first use. The rooms of the package:

    flashlib.rules, scores, softmax, iomodel, roofline   the rules the course teaches, written once
    flashlib.dense, tiled, backward   the reference algorithms
    flashlib.masks       mask functions, the dense mask and the block mask (windows, documents, ...)
    flashlib.varlen      packed sequences of different lengths: their layout and reference
    flashlib.splitkv     split-KV decoding over a KV cache (flashlib.kvcache): the reference
    flashlib.op          the public ops flash_attention, flash_attention_varlen (torch.library custom ops)
    flashlib.decode      the public decoding ops: decode_attention and DecodePlan, MLA's, cascades
    flashlib.distributed ring attention across processes (torch.distributed)
    flashlib.hf          flashlib's attention inside Hugging Face transformers; the course's real model
    flashlib.course      figures, widgets and exercise checkers of the notebooks
    flashlib.labs        the labs: the learner writes a piece of FlashAttention, a checker names mistakes
    flashlib.kernels     the Triton kernels the notebooks teach (05-07, and decoding's)
    flashlib.ladder      the faster rungs of notebook 08, forward and backward
    flashlib.bench       the CPU and GPU benchmarks, the GPU check, recorded runs
    flashlib.machinery   what the ops run on: the trace of mask and score functions, the walk over what
                         they capture, the checks of every argument, the options of a call
"""
from . import kernels as _kernels  # noqa: F401  cheap: chooses Triton's interpreter on CPU builds of torch
from .dense import Visibility, attention_mask, causal_mask, dense_attention
from .softmax import (SoftmaxState, merge_partials, merge_states, naive_softmax, online_softmax,
                      online_softmax_state, online_softmax_steps, safe_softmax, softmax_state)
from .tiled import BlockMask, TiledTrace, TileStep, block_mask, tiled_forward, trace_tiled_attention
from .backward import TiledAttentionFunction, tiled_attention, tiled_backward
from .varlen import varlen_reference
from . import masks  # noqa: E402  (the module: flashlib.masks.document, ...)

__version__ = "0.1.0"
# This course's own package: the notebooks' setup cells read this line, without importing, to tell
# it from any other package importable as flashlib (the package index's "flashlib" is another project).
__course__ = "flashlib-course"

__all__ = [
    "Visibility", "attention_mask", "causal_mask", "dense_attention", "BlockMask", "block_mask", "masks",
    "SoftmaxState", "merge_partials", "merge_states", "naive_softmax", "online_softmax", "online_softmax_state",
    "online_softmax_steps", "safe_softmax", "softmax_state",
    "TiledTrace", "TileStep", "tiled_attention", "tiled_forward", "trace_tiled_attention",
    "TiledAttentionFunction", "tiled_backward",
    "varlen_reference", "flash_attention", "flash_attention_varlen", "decode_attention", "decode_reference",
    "DecodePlan",
]


def __getattr__(name):
    # The fused op needs Triton (Linux only); import it only when asked for.
    if name in ("flash_attention", "flash_attention_varlen"):
        from .kernels._mode import require_triton

        require_triton()  # says how to get Triton where it is missing
        from . import op

        return getattr(op, name)
    if name in ("decode_attention", "decode_reference", "DecodePlan"):
        # KV-cache decoding (notebook 10); decode_attention and a plan import their kernels when used
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module 'flashlib' has no attribute {name!r}")
