"""Any forward rung with any backward of the ladder, behind one autograd Function."""
from __future__ import annotations

import torch

from .._checks import check_attention_inputs
from ..kernels import function as teaching
from ..kernels.function import check_kernel_inputs, flat, resolve_config
from .autotune import autotunes
from .backward import launch_backward
from .forward import FN, RUNGS
from .forward import forward as rung_forward
from .rungs import BACKWARD_BY_NAME
from .rungs import backward as backward_named

BACKWARDS = tuple(BACKWARD_BY_NAME)


def backward_pass(q, k, v, out, lse, dout, *, causal: bool, scale: float, backward: str = "tuned",
                  config=None, dlse=None):
    """(dq, dk, dv) of one backward of the ladder from the forward's out and lse (no autograd).
    config None: tiles autotuned on a GPU for 16-bit inputs, the shipped ones elsewhere."""
    if not backward_named(backward).tiles:  # the teaching kernels, with the shipped tiles
        return teaching.backward(q, k, v, out, lse, dout, causal=causal, scale=scale, config=config, dlse=dlse)
    if out.numel() == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cfg = None if autotunes(q.dtype, config) else resolve_config(FN, q, config)
    seq_q = q.shape[-2]
    dq, dk, dv = launch_backward(flat(q), flat(k), flat(v), flat(out), lse.reshape(-1, seq_q), flat(dout),
                                 causal, scale, cfg, backward=backward,
                                 dlse=None if dlse is None else dlse.reshape(-1, seq_q).float())
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


class LadderFunction(torch.autograd.Function):
    """Saves (q, k, v, out, lse), never the probabilities, like every FlashAttention."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, forward, backward, config):
        out, lse = rung_forward(q, k, v, causal=causal, scale=scale, rung=forward, config=config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backward, ctx.config = causal, scale, backward, config
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = backward_pass(q, k, v, out, lse, dout, causal=ctx.causal, scale=ctx.scale, backward=ctx.backward,
                              config=ctx.config, dlse=dlse)
        return *grads, None, None, None, None, None


def attention(q, k, v, *, causal=False, scale=None, forward="tma", backward="tuned", config=None,
              return_lse=False):
    """See :func:`flashlib.ladder.attention`."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(FN, q)
    resolve_config(FN, q, config)  # a wrong type fails here, not inside the backward
    if forward not in RUNGS:
        raise ValueError(f"{FN}: argument 'forward' must be one of {RUNGS}, got {forward!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"{FN}: argument 'backward' must be one of {BACKWARDS}, got {backward!r}")
    out, lse = LadderFunction.apply(q, k, v, causal, scale, forward, backward, config)
    return (out, lse) if return_lse else out
