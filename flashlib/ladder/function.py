"""Any forward rung with any backward of the ladder, behind one autograd Function."""
from __future__ import annotations

import torch

from ..machinery.checks import check_attention_inputs
from ..machinery.autograd import save, saved
from ..kernels import function as teaching
from ..kernels.function import flat, resolve_config, save_lse
from ..machinery.options import Options
from .autotune import autotunes
from .backward import launch_backward
from .forward import FN, RUNGS, forward_base2 as rung_forward
from .rungs import BACKWARD_BY_NAME, backward as backward_named

BACKWARDS = tuple(BACKWARD_BY_NAME)


def backward_pass_base2(q, k, v, out, lse2, dout, *, causal: bool, scale: float, backward: str = "tuned",
                        config=None, dlse=None):
    """(dq, dk, dv) of one backward of the ladder from the forward's out and base-2 lse2 (no
    autograd). config None: tiles autotuned on a GPU for 16-bit inputs, the shipped ones elsewhere."""
    if not backward_named(backward).tiles:  # the teaching kernels, with the shipped tiles
        return teaching.backward_base2(q, k, v, out, lse2, dout, causal=causal, scale=scale, config=config,
                                       dlse=dlse)
    if out.numel() == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cfg = None if autotunes(q.dtype, config) else resolve_config(FN, q, config)
    seq_q = q.shape[-2]
    # float32, as the ladder's kernels read it (the teaching kernels' float64 lse2 rounded once)
    dq, dk, dv = launch_backward(flat(q), flat(k), flat(v), flat(out), lse2.reshape(-1, seq_q).float(), flat(dout),
                                 causal, scale, cfg, backward=backward,
                                 dlse=None if dlse is None else dlse.reshape(-1, seq_q).float())
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


class LadderFunction(torch.autograd.Function):
    """Saves (q, k, v, out, lse, lse2), never the probabilities, like every FlashAttention."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options, forward, backward, config):
        out, lse2 = rung_forward(q, k, v, causal=options.visibility.causal, scale=options.scale, rung=forward,
                                 config=config)
        lse, column = save_lse(lse2)
        save(ctx, q, k, v, out, lse, column)
        ctx.options, ctx.backward, ctx.config = options, backward, config
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, _, column = saved(ctx)
        grads = backward_pass_base2(q, k, v, out, column.squeeze(-1), dout, causal=ctx.options.visibility.causal,
                                    scale=ctx.options.scale, backward=ctx.backward, config=ctx.config, dlse=dlse)
        return *grads, None, None, None, None


def attention(q, k, v, *, causal=False, scale=None, forward="tma", backward="tuned", config=None,
              return_lse=False):
    """See :func:`flashlib.ladder.attention`."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)  # the forward checks the rest
    for argument, name, known in (("forward", forward, RUNGS), ("backward", backward, BACKWARDS)):
        if name not in known:
            raise ValueError(f"{FN}: argument '{argument}' must be one of {known}, got {name!r}")
    out, lse = LadderFunction.apply(q, k, v, Options.of(causal=causal, scale=scale), forward, backward, config)
    return (out, lse) if return_lse else out
