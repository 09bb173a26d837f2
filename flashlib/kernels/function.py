"""The teaching kernels of notebooks 06 and 07 behind one autograd Function: ``attention``.

File order as in Triton's fused-attention tutorial: checks, launchers, the Function, the
entry point. Inputs of any leading shape (..., seq, head_dim) are flattened to
(B*H, seq, head_dim) views; each kernel gets its strides, so only a tensor whose last dim
is not contiguous is copied. ``flashlib.flash_attention`` (the public op) runs these kernels
on a CPU, through Triton's interpreter; the faster rungs of :mod:`flashlib.ladder` build on
the same launch conventions.
"""
from __future__ import annotations

import math

import torch

from .._checks import check_attention_inputs
from ._mode import interpreting
from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, triton
from .config import LOG2E, FlashConfig, default_config, head_dim_pad
from .forward import _attn_fwd

FN = "flashlib.kernels.attention"
MAX_HEAD_DIM = 256


def flat(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (B*H, seq, d) with a contiguous last dim."""
    t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def capability(device: torch.device):
    """The CUDA compute capability of ``device``, None for the interpreter's CPU tensors."""
    return None if device.type != "cuda" else torch.cuda.get_device_capability(device)


def check_kernel_inputs(fn: str, q: torch.Tensor) -> None:
    """What the kernels add to the shared checks: head dim, dtype, and a device they can run on."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: argument 'q' has head_dim {head_dim}; the fused kernels support "
                         f"head_dim 1..{MAX_HEAD_DIM} (use flashlib.tiled_attention for larger)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{fn}: argument 'q' has dtype {q.dtype}; the fused kernels support float16, "
                        "bfloat16 and float32 (use flashlib.tiled_attention for float64)")
    if interpreting():
        if q.dtype == torch.bfloat16:
            raise TypeError(f"{fn}: argument 'q' is bfloat16, which Triton's CPU interpreter cannot compute "
                            "(it has no bfloat16 arithmetic); use float16 or float32 here, bfloat16 on a GPU")
        if q.device.type != "cpu":
            raise ValueError(f"{fn}: Triton runs in its CPU interpreter here (TRITON_INTERPRET=1) but "
                             f"'q' is on {q.device}; pass CPU tensors")
        return
    if q.device.type != "cuda":
        raise ValueError(f"{fn}: argument 'q' is on {q.device} but Triton compiles for CUDA here; "
                         "move q, k, v to 'cuda' (or set TRITON_INTERPRET=1 before importing "
                         "flashlib.kernels to use the CPU interpreter)")
    cc = capability(q.device)
    if q.dtype == torch.bfloat16 and cc < (8, 0):
        raise TypeError(f"{fn}: argument 'q' is bfloat16 but {torch.cuda.get_device_name(q.device)} "
                        f"(sm_{cc[0]}{cc[1]}) has no bfloat16 tensor cores; "
                        "use float16 (or a GPU of compute capability >= 8.0)")


def resolve_config(fn: str, q: torch.Tensor, config) -> FlashConfig:
    """``config`` checked, or the shipped one for q's head dim, dtype and device."""
    if config is None:
        return default_config(q.shape[-1], q.dtype, capability(q.device))
    if not isinstance(config, FlashConfig):
        raise TypeError(f"{fn}: argument 'config' must be a flashlib.kernels.FlashConfig or None, "
                        f"got {type(config).__name__}")
    return config


def empty_result(q: torch.Tensor):
    """Nothing to attend to: out = 0 and lse = -inf, as for a row that sees no key."""
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def _launch_forward(q, k, v, causal, scale, cfg):
    """q, k, v: (B*H, seq, d). Returns out (B*H, seq_q, d) and lse (B*H, seq_q) float32."""
    bh, seq_q, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bh, seq_q, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seq_q, cfg.block_q), bh)
    _attn_fwd[grid](q, k, v, out, lse, scale * LOG2E,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    out.stride(0), out.stride(1), seq_q, k.shape[1], d,
                    HEAD_DIM_PAD=head_dim_pad(d), BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, CAUSAL=causal,
                    INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def _launch_backward(q, k, v, out, lse, dout, dlse, causal, scale, cfg):
    """All (B*H, seq, d) but lse and dlse (B*H, seq_q); dlse may be None. Returns dq, dk, dv."""
    bh, seq_q, d = q.shape
    seq_k = k.shape[1]
    d_pad = head_dim_pad(d)
    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(seq_q, cfg.bwd_block_q), bh)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), seq_q, d,
        HEAD_DIM_PAD=d_pad, BLOCK_Q=cfg.bwd_block_q)
    if dlse is not None:
        delta -= dlse  # d lse_i / d s_ij = p_ij: a gradient of lse enters where delta does
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM_PAD=d_pad, BLOCK_Q=cfg.bwd_block_q, BLOCK_K=cfg.bwd_block_k, CAUSAL=causal,
                  INPUT_PRECISION=cfg.input_precision, num_warps=cfg.bwd_num_warps,
                  num_stages=cfg.bwd_num_stages)
    _attn_bwd_dkdv[(triton.cdiv(seq_k, cfg.bwd_block_k), bh)](
        q, k, v, dout, dk, dv, lse, delta, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        seq_q, seq_k, d, **common)
    _attn_bwd_dq[(triton.cdiv(seq_q, cfg.bwd_block_q), bh)](
        q, k, v, dout, dq, lse, delta, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        seq_q, seq_k, d, **common)
    return dq, dk, dv


def forward(q, k, v, *, causal=False, scale=None, config=None, fn=FN):
    """The teaching forward without autograd: (out, lse), lse (..., seq_q) float32, -inf for
    rows that see no key. Same conventions as :func:`attention`."""
    scale = check_attention_inputs(fn, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(fn, q)
    cfg = resolve_config(fn, q, config)
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.numel() == 0:
        return empty_result(q)
    out, lse = _launch_forward(flat(q), flat(k), flat(v), causal, scale, cfg)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def backward(q, k, v, out, lse, dout, *, causal=False, scale=None, config=None, dlse=None):
    """(dq, dk, dv) from the forward's out and lse, recomputing P tile by tile (no autograd).
    dlse: an optional gradient with respect to lse (..., seq_q)."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    cfg = resolve_config(FN, q, config)
    if out.numel() == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seq_q = q.shape[-2]
    dq, dk, dv = _launch_backward(flat(q), flat(k), flat(v), flat(out), lse.reshape(-1, seq_q), flat(dout),
                                  None if dlse is None else dlse.reshape(-1, seq_q).float(), causal, scale, cfg)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


class AttentionFunction(torch.autograd.Function):
    """Saves (q, k, v, out, lse) — never the (seq_q, seq_k) probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cfg):
        out, lse = forward(q, k, v, causal=causal, scale=scale, config=cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.cfg = causal, scale, cfg
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = backward(q, k, v, out, lse, dout, causal=ctx.causal, scale=ctx.scale, config=ctx.cfg, dlse=dlse)
        return *grads, None, None, None


def attention(q, k, v, *, causal: bool = False, scale: float | None = None,
              config: FlashConfig | None = None, return_lse: bool = False):
    """Exact attention softmax(q kᵀ · scale) v with notebook 06's forward and notebook 07's
    backward kernels; differentiable (the lse too).

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k, v: (batch, heads, seq_k, head_dim); seq_k may differ from seq_q.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal, as
            :func:`flashlib.causal_mask`); key tiles entirely above it are skipped. A row that
            sees no key outputs zeros, with zero gradients.
        scale: defaults to 1/sqrt(head_dim).
        config: a :class:`FlashConfig` (tile sizes, warps, stages, float32 matmul precision);
            defaults to :func:`default_config` for the head dim, dtype and GPU.
        return_lse: also return the log-sum-exp (..., seq_q), float32, -inf for empty rows.

    float16, bfloat16 (GPUs of compute capability >= 8.0) and float32 (tf32 matmuls by
    default on a GPU); head_dim 1..256; any sequence lengths. Without a CUDA device the
    kernels run in Triton's CPU interpreter and take CPU tensors. The backward is
    deterministic: every program writes only its own rows of dq, dk or dv.
    """
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(FN, q)
    cfg = resolve_config(FN, q, config)
    out, lse = AttentionFunction.apply(q, k, v, causal, scale, cfg)
    return (out, lse) if return_lse else out
