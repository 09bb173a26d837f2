"""Two small kernels for the Triton primer (notebook 05): vector add and fused softmax.

A Triton program handles one block of data; ``tl.program_id`` says which. Loads and stores
take a mask, so the last, partial block reads nothing past the end and writes nothing there.
"""
from __future__ import annotations

import torch

from ._mode import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402


@triton.jit
def _add_kernel(X, Y, Out, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements  # the last block may run past the end
    x = tl.load(X + offs, mask=mask)
    y = tl.load(Y + offs, mask=mask)
    tl.store(Out + offs, x + y, mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor, *, block: int = 256) -> torch.Tensor:
    """x + y for 1-D tensors of one shape, one program per ``block`` elements."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise TypeError(f"vector_add: arguments 'x' and 'y' must be tensors, got {type(x).__name__} "
                        f"and {type(y).__name__}")
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"vector_add: 'x' and 'y' must be 1-D of one shape, got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    out = torch.empty_like(x)
    n = x.numel()
    _add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


@triton.jit
def _softmax_kernel(X, Out, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    """One program per row: read the row once, write it once (unfused: four passes over memory)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)  # BLOCK: n_cols rounded up to a power of two
    x = tl.load(X + row * stride_x + offs, mask=offs < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)  # safe softmax: subtract the row max before exp
    e = tl.exp(x - m)
    l = tl.sum(e, 0)
    tl.store(Out + row * stride_out + offs, (e / l).to(Out.dtype.element_ty), mask=offs < n_cols)


def fused_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of a 2-D tensor in one kernel: each row lives in registers once."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"fused_softmax: argument 'x' must be a 2-D tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    block = max(16, triton.next_power_of_2(x.shape[1]))
    _softmax_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK=block)
    return out
