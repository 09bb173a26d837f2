"""Masks: which (query, key) pairs may attend, written as functions of their indices.

A mask function is flex_attention's ``mask_mod``: a plain ``def mask_mod(b, h, q_idx, kv_idx)``
returning a boolean, True where query ``q_idx`` of head ``h`` in batch row ``b`` may attend key
``kv_idx``. Written with arithmetic, comparisons and ``& | ~`` only (never ``and``/``or``/``if``),
the same function runs on PyTorch index tensors (the references, :func:`attention_mask`,
:func:`block_mask`) and compiles into the Triton kernels, which take it as a compile-time
argument. It is ANDed with ``causal`` and ``window`` (:class:`Visibility` says the whole rule)::

    def causal(b, h, q_idx, kv_idx):          attention_mask(4, 4, mask_mod=causal)[0, 0]
        return q_idx >= kv_idx                    1 0 0 0
                                                  1 1 0 0
                                                  1 1 1 0
                                                  1 1 1 1

A mask function's indices are absolute positions, so ``causal`` here is aligned top-left (as
flex_attention's); ``causal=True`` aligns bottom-right: the same when seq_q == seq_k.

At tile granularity the mask becomes a :class:`BlockMask` (flex_attention's
``create_block_mask``): tiles where it is false everywhere are skipped, tiles where it is true
everywhere need no mask. :func:`flashlib.flash_attention` computes one per call.

Ready masks: :func:`causal`, :func:`sliding_window`, :func:`prefix_lm`, :func:`document`. The
ones with a parameter bind it as a module-level name of a copy of their function (a
compile-time constant in a kernel: a new value compiles a new kernel); :func:`document` reads
a tensor, which the kernels get as their mask data.
"""
from __future__ import annotations

import types

import torch

from .dense import Visibility, attention_mask, causal_mask
from .tiled import FULL, PARTIAL, SKIPPED, BlockMask, block_mask

__all__ = ["Visibility", "attention_mask", "causal_mask", "block_mask", "BlockMask", "SKIPPED", "PARTIAL", "FULL",
           "causal", "sliding_window", "prefix_lm", "document", "as_text"]


def causal(b, h, q_idx, kv_idx):
    """Query i sees keys j <= i (top-left aligned: the usual lower triangle when seq_q == seq_k)."""
    return q_idx >= kv_idx


def _sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)  # noqa: F821  (bound by _bind)


def _prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)  # noqa: F821  (bound by _bind)


def _document(b, h, q_idx, kv_idx, ids):
    return LOAD(ids, q_idx) == LOAD(ids, kv_idx)


def LOAD(ids, idx):  # noqa: N802  (the kernels bind their own LOAD: a tl.load of ids + idx)
    """ids[idx] for an index (a tensor of any shape, or an int): a mask function's read of its data."""
    if isinstance(idx, torch.Tensor):
        ids = ids.to(idx.device)
    return ids[idx]


def _with_data(b, h, q_idx, kv_idx):
    return MASK(b, h, q_idx, kv_idx, DATA)  # noqa: F821  (bound by _bind)


def _bind(template, name: str, data=None, **constants):
    """A mask function: ``template`` with ``constants`` as module-level names of a copy (and, for a
    template that reads data, its fifth argument bound to ``data``). The kernels rebuild it from
    the same template (``__mask_template__``) with the constants as ``tl.constexpr``."""
    scope = dict(globals(), **constants)
    fn = types.FunctionType(template.__code__, scope, name)
    if data is not None:
        fn = types.FunctionType(_with_data.__code__, dict(globals(), MASK=fn, DATA=data), name)
    fn.__mask_template__, fn.__mask_constants__, fn.__mask_data__ = template, constants, data
    fn.__qualname__ = name
    return fn


def _non_negative(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{fn}: argument '{name}' must be an int >= 0, got {value!r}")
    return value


def sliding_window(window: int):
    """Causal within a window: query i sees keys i - window .. i (top-left aligned; the option
    ``window=(window, 0)`` with ``causal=True`` is the same bottom-right and runs without a block
    mask)."""
    return _bind(_sliding_window, f"sliding_window({window})", WINDOW=_non_negative("sliding_window", "window", window))


def prefix_lm(prefix: int):
    """A prefix language model: every query sees the first ``prefix`` keys (the prompt, attended
    both ways), and the rest causally."""
    return _bind(_prefix_lm, f"prefix_lm({prefix})", PREFIX=_non_negative("prefix_lm", "prefix", prefix))


def document(ids: torch.Tensor):
    """Packed documents: query i sees key j iff ``ids[i] == ids[j]`` (with ``causal=True``: causal
    within each document). ids: (seq,) integer document ids of the packed positions, covering
    every query and key index (the kernels read it as int32)."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype.is_floating_point or ids.is_complex():
        raise TypeError(f"document: argument 'ids' must be a 1-D integer tensor of document ids, got "
                        f"{type(ids).__name__}{'' if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}")
    return _bind(_document, "document", data=ids)


def as_text(mask: torch.Tensor) -> str:
    """A (seq_q, seq_k) boolean mask (or a BlockMask's (query blocks, key tiles) kinds) as rows
    of digits, as the docstrings draw them."""
    rows = mask.to(torch.int64).tolist()
    return "\n".join(" ".join(str(x) for x in row) for row in rows)
