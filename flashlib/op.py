"""``flashlib.flash_attention``: the public op, one PyTorch custom op with its own gradient.

Which kernels run is decided per call, from the device and dtype (:func:`path_for`):

    CUDA GPU, float16/bfloat16, compute capability >= 8.0
        forward "tma" (rung 3 of :mod:`flashlib.ladder`; rung 2's kernel where tensor
        descriptors cannot be used: before sm_90, or rows not a multiple of 16 bytes) and
        backward "tuned", both with tiles autotuned per head dim, dtype, mask and length
        bucket. The fastest combination a recorded H200 run measured (data/bench/) that the
        compile tests build for sm_80 and sm_90.
    anything else (float32 on a GPU, sm_75, the CPU)
        the teaching kernels of notebooks 06 and 07 with their shipped tiles; on a machine
        without a CUDA device they run in Triton's CPU interpreter.

Registered with ``torch.library`` as ``flashlib::flash_attention`` (forward) and
``flashlib::flash_attention_backward``, each with a fake implementation, so that
``torch.compile(fullgraph=True)`` and ``torch.export`` see one opaque op whose output shapes
they know, and autograd uses the backward op.
"""
from __future__ import annotations

import torch

from ._checks import check_attention_inputs
from .kernels import function as teaching
from .kernels.function import capability, check_kernel_inputs

FN = "flash_attention"
FAST_DTYPES = (torch.float16, torch.bfloat16)


def path_for(q: torch.Tensor) -> tuple[str, str]:
    """(forward, backward) that :func:`flash_attention` runs for inputs like q."""
    if q.device.type == "cuda" and q.dtype in FAST_DTYPES and capability(q.device) >= (8, 0):
        return "tma", "tuned"
    return "teaching", "teaching"


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """The forward of :func:`flash_attention` without autograd: (out, lse), lse (..., seq_q) float32."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(FN, q)
    forward, _ = path_for(q)
    if forward == "teaching":
        return teaching.forward(q, k, v, causal=causal, scale=scale, fn=FN)
    from .ladder.forward import forward as rung_forward

    return rung_forward(q, k, v, causal=causal, scale=scale, rung=forward)


def flash_attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                             dlse=None):
    """(dq, dk, dv) of :func:`flash_attention` from its out and lse, without autograd; dlse is an
    optional gradient with respect to lse."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    _, backward = path_for(q)
    if backward == "teaching":
        return teaching.backward(q, k, v, out, lse, dout, causal=causal, scale=scale, dlse=dlse)
    from .ladder.function import backward_pass

    return backward_pass(q, k, v, out, lse, dout, causal=causal, scale=scale, backward=backward, dlse=dlse)


@torch.library.custom_op("flashlib::flash_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale)
    return out.contiguous(), lse.contiguous()  # the layout the fake implementation promises


@_attention_op.register_fake
def _(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flashlib::flash_attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout.contiguous(), causal=causal, scale=scale,
                                          dlse=dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # never the (seq_q, seq_k) probabilities
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv = _attention_backward_op(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """Exact attention softmax(q kᵀ · scale) v, fused, differentiable (the lse too).

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k, v: (batch, heads, seq_k, head_dim); seq_k may differ from seq_q.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal, as
            flash-attn >= 2.1 and :func:`flashlib.causal_mask`; PyTorch's SDPA aligns
            top-left, the same when seq_q == seq_k). A row that sees no key outputs zeros,
            with zero gradients::

                seq_q=3, seq_k=5      seq_q=5, seq_k=3
                1 1 1 0 0             0 0 0
                1 1 1 1 0             0 0 0
                1 1 1 1 1             1 0 0
                                      1 1 0
                                      1 1 1
        scale: defaults to 1/sqrt(head_dim).
        return_lse: also return the log-sum-exp of each score row, (..., seq_q) float32,
            -inf for rows that see no key.

    Runs the fastest path measured for the device and dtype (see :func:`path_for`): on a
    CUDA GPU in float16/bfloat16, rung 3's forward and the tuned backward; otherwise the
    teaching kernels (tf32 matmuls for float32 on a GPU; Triton's CPU interpreter without a
    GPU, where inputs are CPU tensors and bfloat16 is not available). head_dim 1..256, any
    sequence lengths. Works inside ``torch.compile(fullgraph=True)`` and ``torch.export``.
    """
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(FN, q)
    out, lse = _attention_op(q, k, v, causal, scale)
    return (out, lse) if return_lse else out
