"""Masks: which (query, key) pairs may attend, written as functions of their indices.

A mask function is flex_attention's ``mask_mod``: a plain ``def mask_mod(b, h, q_idx, kv_idx)``
returning a boolean, True where query ``q_idx`` of head ``h`` in batch row ``b`` may attend key
``kv_idx``. Written with arithmetic, comparisons and ``& | ~`` only (never ``and``/``or``/``if``),
the same function runs on PyTorch index tensors (the references, :func:`attention_mask`,
:func:`block_mask`, ``flex_attention``) and compiles into the Triton kernels, which take it as a
compile-time argument. It is ANDed with ``causal`` and ``window`` (:class:`Visibility` says the whole rule)::

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

Ready masks: :func:`causal`, :func:`sliding_window`, :func:`prefix_lm`, :func:`document`, and
flex_attention's combinators :func:`and_masks`, :func:`or_masks`. They are closures, the way
attention-gym writes masks, so each runs unchanged in ``flex_attention`` too.

Writing a mask function that the kernels compile (:mod:`flashlib.kernels.maskfn` traces what it
does, calling it once on symbolic indices, however its source is laid out): use the four indices,
numbers and tensors it captures (a closure cell, a global, an attribute of a callable object),
indexing such a tensor by the indices in one subscript (``document_id[q_idx]``, ``bias[h, q_idx]``,
``ids[q_idx - 5]``); ``& | ^ ~`` to combine, arithmetic, comparisons, ``//`` and ``%`` (rounded
toward -inf, as PyTorch), ``torch.where``/``abs``/``minimum``/``maximum``/``clamp`` and their
methods; helpers, decorators, ``functools.partial`` and the combinators trace through. What it
captures is read afresh at every call: a number it captures is given to the kernel at launch and a
tensor's values are read by it, so neither compiles a new kernel (a call that reads what the last one
read reuses its trace, however the values were written: :mod:`flashlib.kernels.tracememo`). The
tensors it reads live on q's device (``torch.tensor(..., device=q.device)``): every op refuses one on
another device by name before anything runs (:mod:`flashlib.machinery.captures` finds them). Not compiled (a TypeError says what to write instead): anything that needs one Python truth
value (``and``/``or``/``not``, ``if``, ``x if c else y``, ``a < b < c``, ``min``/``max``), loops over
the indices, conversions to Python numbers, other libraries.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

from .dense import attention_mask, causal_mask
from .rules import FULL, PARTIAL, SKIPPED, Visibility
from .tiled import BlockMask, block_mask

__all__ = ["Visibility", "attention_mask", "causal_mask", "block_mask", "BlockMask", "SKIPPED", "PARTIAL", "FULL",
           "causal", "sliding_window", "prefix_lm", "document", "and_masks", "or_masks", "create_block_mask",
           "as_text"]


def causal(b, h, q_idx, kv_idx):
    """Query i sees keys j <= i (top-left aligned: the usual lower triangle when seq_q == seq_k)."""
    return q_idx >= kv_idx


def _non_negative(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{fn}: argument '{name}' must be an int >= 0, got {value!r}")
    return value


def _named(fn, name: str):
    fn.__name__ = fn.__qualname__ = name
    return fn


def sliding_window(window: int):
    """Causal within a window: query i sees keys i - window .. i (top-left aligned; the option
    ``window=(window, 0)`` with ``causal=True`` is the same bottom-right and runs without a block
    mask)."""
    window = _non_negative("sliding_window", "window", window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return _named(sliding_window_mask, f"sliding_window({window})")


def prefix_lm(prefix: int):
    """A prefix language model: every query sees the first ``prefix`` keys (the prompt, attended
    both ways), and the rest causally."""
    prefix = _non_negative("prefix_lm", "prefix", prefix)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return _named(prefix_lm_mask, f"prefix_lm({prefix})")


def document(ids: torch.Tensor):
    """Packed documents: query i sees key j iff ``ids[i] == ids[j]`` (with ``causal=True``: causal
    within each document). ids: (seq,) integer document ids of the packed positions, of any integer
    dtype and strides, covering every query and key index; the kernels read it as it is."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype.is_floating_point or ids.is_complex():
        raise TypeError(f"document: argument 'ids' must be a 1-D integer tensor of document ids, got "
                        f"{type(ids).__name__}{'' if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}")

    def document_mask(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return _named(document_mask, "document")


def create_block_mask(mask_mod, B, H, Q_LEN: int, KV_LEN: int, device=None, *, causal: bool = False, window=None,
                      block_size: int = 16, attention_chunk=None) -> BlockMask:
    """flex_attention's ``create_block_mask`` for flashlib: the block mask of ``mask_mod`` (ANDed
    with ``causal``, ``window`` and ``attention_chunk``), built once and passed again as ``block_mask=`` to
    :func:`flashlib.flash_attention` and :func:`flashlib.kernels.attention`, which then skip
    evaluating it per call. Built at ``block_size`` tiles, of which the kernels' tiles must be
    multiples (every shipped configuration's are multiples of 16). B, H: the batch and heads the
    mask depends on, or None when it depends on neither (as flex's: evaluated at b = 0, h = 0)."""
    fn = "create_block_mask"
    if mask_mod is None:
        raise TypeError(f"{fn}: argument 'mask_mod' must be a mask function mask_mod(b, h, q_idx, kv_idx), got None")
    return block_mask(Q_LEN, KV_LEN, block_q=block_size, block_k=block_size, causal=causal, window=window,
                      attention_chunk=attention_chunk, mask_mod=mask_mod, batch=B or 1, heads=H or 1, device=device)


def as_text(mask: torch.Tensor) -> str:
    """A (seq_q, seq_k) boolean mask (or a BlockMask's (query blocks, key tiles) kinds) as rows
    of digits, as the docstrings draw them."""
    rows = mask.to(torch.int64).tolist()
    return "\n".join(" ".join(str(x) for x in row) for row in rows)
