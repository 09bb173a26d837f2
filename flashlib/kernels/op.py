"""``flash_attention``: the fused kernels behind a torch.autograd.Function.

File order as in Triton's fused-attention tutorial: launchers, then the Function, then
the public op. Inputs of any leading shape (..., seq, head_dim) are flattened to
(B*H, seq, head_dim) views; each kernel gets its strides, so only a tensor whose last dim
is not contiguous is copied.
"""
from __future__ import annotations

import math

import torch

from .._checks import check_attention_inputs
from ._mode import interpreting
from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, triton
from .config import FlashConfig, default_config, head_dim_pad
from .forward import LOG2E, _attn_fwd

FN = "flash_attention"
MAX_HEAD_DIM = 256
FORWARDS = ("teaching", "autotuned", "causal-split", "tma", "lean", "lazy-rescale")  # the rungs of kernels/ladder.py
BACKWARDS = ("teaching", "tuned", "atomic", "lean", "bulk")  # kernels/backward.py, kernels/backward_fast.py


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (B*H, seq, d) with a contiguous last dim."""
    t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _capability(device: torch.device):
    return None if device.type != "cuda" else torch.cuda.get_device_capability(device)


def check_kernel_inputs(q: torch.Tensor, config) -> FlashConfig:
    """Errors the fused kernel adds to the shared checks: device, dtype, head dim, config."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{FN}: argument 'q' has head_dim {head_dim}; the fused kernel supports "
                         f"head_dim 1..{MAX_HEAD_DIM} (use flashlib.tiled_attention for larger)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{FN}: argument 'q' has dtype {q.dtype}; the fused kernel supports float16, "
                        "bfloat16 and float32 (use flashlib.tiled_attention for float64)")
    if interpreting():
        if q.dtype == torch.bfloat16:
            raise TypeError(f"{FN}: argument 'q' is bfloat16, which Triton's CPU interpreter cannot compute "
                            "(it has no bfloat16 arithmetic); use float16 or float32 here, bfloat16 on a GPU")
        if q.device.type != "cpu":
            raise ValueError(f"{FN}: Triton runs in its CPU interpreter here (TRITON_INTERPRET=1) but "
                             f"'q' is on {q.device}; pass CPU tensors")
    else:
        if q.device.type != "cuda":
            raise ValueError(f"{FN}: argument 'q' is on {q.device} but Triton compiles for CUDA here; "
                             "move q, k, v to 'cuda' (or set TRITON_INTERPRET=1 before importing "
                             "flashlib.kernels to use the CPU interpreter)")
        capability = _capability(q.device)
        if q.dtype == torch.bfloat16 and capability < (8, 0):
            raise TypeError(f"{FN}: argument 'q' is bfloat16 but {torch.cuda.get_device_name(q.device)} "
                            f"(sm_{capability[0]}{capability[1]}) has no bfloat16 tensor cores; "
                            "use float16 (or a GPU of compute capability >= 8.0)")
    if config is None:
        return default_config(head_dim, q.dtype, _capability(q.device))
    if not isinstance(config, FlashConfig):
        raise TypeError(f"{FN}: argument 'config' must be a flashlib.kernels.FlashConfig or None, "
                        f"got {type(config).__name__}")
    return config


def autotunes(dtype: torch.dtype, config) -> bool:
    """Whether a tuned path times its candidate tiles here: on a GPU (the interpreter cannot
    time kernels), for 16-bit inputs (the candidates are sized for them; float32 doubles
    every tile and would overflow shared memory), unless the caller fixed the tiles."""
    return config is None and not interpreting() and dtype in (torch.float16, torch.bfloat16)


def _launch_forward(q, k, v, causal, scale, cfg):
    """q, k, v: (B*H, seq, d). Returns out (B*H, seq_q, d) and lse (B*H, seq_q) float32."""
    bh, seq_q, d = q.shape
    seq_k = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(bh, seq_q, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seq_q, cfg.block_m), bh)
    _attn_fwd[grid](q, k, v, out, lse, scale * LOG2E,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    out.stride(0), out.stride(1), seq_q, seq_k, d,
                    HEAD_DIM_PAD=head_dim_pad(d), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                    INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def _launch_backward(q, k, v, out, lse, dout, causal, scale, cfg):
    """All (B*H, seq, d) but lse (B*H, seq_q). Returns dq, dk, dv in the input dtype."""
    bh, seq_q, d = q.shape
    seq_k = k.shape[1]
    d_pad = head_dim_pad(d)
    delta = torch.empty_like(lse)
    _attn_bwd_preprocess[(triton.cdiv(seq_q, cfg.bwd_block_m), bh)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), seq_q, d,
        HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.bwd_block_m)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.bwd_block_m, BLOCK_N=cfg.bwd_block_n, CAUSAL=causal,
                  INPUT_PRECISION=cfg.input_precision, num_warps=cfg.bwd_num_warps,
                  num_stages=cfg.bwd_num_stages)
    _attn_bwd_dkdv[(triton.cdiv(seq_k, cfg.bwd_block_n), bh)](
        q, k, v, dout, dk, dv, lse, delta, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        seq_q, seq_k, d, **common)
    _attn_bwd_dq[(triton.cdiv(seq_q, cfg.bwd_block_m), bh)](
        q, k, v, dout, dq, lse, delta, scale * LOG2E, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        seq_q, seq_k, d, **common)
    return dq, dk, dv


def flash_forward(q, k, v, *, causal=False, scale=None, config=None):
    """The fused forward without autograd: returns (out, lse), lse (..., seq_q) float32."""
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    cfg = check_kernel_inputs(q, config)
    return _forward(q, k, v, causal, scale, cfg)


def _forward(q, k, v, causal, scale, cfg):
    lead, seq_q = q.shape[:-2], q.shape[-2]
    if seq_q == 0 or k.shape[-2] == 0 or q.numel() == 0:
        # nothing to attend to: zero output, lse = -inf, as for a fully masked row
        return torch.zeros_like(q), torch.full((*lead, seq_q), -math.inf, dtype=torch.float32, device=q.device)
    out, lse = _launch_forward(_flat(q), _flat(k), _flat(v), causal, scale, cfg)
    return out.reshape(q.shape), lse.reshape(*lead, seq_q)


class FlashAttentionFunction(torch.autograd.Function):
    """Saves (q, k, v, out, lse) — never the (seq_q, seq_k) probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cfg, rung, rung_config, backward):
        if rung == "teaching":
            out, lse = _forward(q, k, v, causal, scale, cfg)
        else:  # a faster forward from the optimisation ladder
            from .forward_fast import forward as ladder_forward

            out, lse = ladder_forward(q, k, v, causal=causal, scale=scale, rung=rung, config=rung_config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.cfg = causal, scale, cfg
        ctx.backward, ctx.rung_config = backward, rung_config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if out.numel() == 0 or k.shape[-2] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *[None] * 6
        args = (_flat(q), _flat(k), _flat(v), _flat(out), lse.reshape(-1, q.shape[-2]), _flat(dout),
                ctx.causal, ctx.scale)
        if ctx.backward == "teaching":
            dq, dk, dv = _launch_backward(*args, ctx.cfg)
        else:
            from .backward_fast import launch_backward

            tuned = autotunes(q.dtype, ctx.rung_config)
            dq, dk, dv = launch_backward(*args, None if tuned else ctx.cfg, backward=ctx.backward)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), *[None] * 6


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    config: FlashConfig | None = None, return_lse: bool = False,
                    forward: str = "teaching", backward: str = "teaching"):
    """Exact attention softmax(q kᵀ · scale) v with the fused Triton kernels; differentiable.

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k, v: (batch, heads, seq_k, head_dim); seq_k may differ from seq_q.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal, as
            flash-attn >= 2.1 and :func:`flashlib.causal_mask`); key blocks entirely above
            the diagonal are skipped. A row that sees no key outputs zeros, zero gradients::

                seq_q=3, seq_k=5      seq_q=5, seq_k=3
                1 1 1 0 0             0 0 0
                1 1 1 1 0             0 0 0
                1 1 1 1 1             1 0 0
                                      1 1 0
                                      1 1 1
        scale: defaults to 1/sqrt(head_dim).
        config: a :class:`FlashConfig` (block sizes, warps, stages, float32 matmul
            precision); defaults to :func:`default_config` for the head dim, dtype and GPU.
        return_lse: also return the log-sum-exp (..., seq_q), float32, -inf for empty rows
            (not differentiable here, unlike :func:`flashlib.tiled_attention`'s).
        forward: the forward kernel, a rung of :mod:`flashlib.kernels.ladder`: "teaching"
            (notebook 06's), "autotuned", "causal-split", "tma", "lean" or "lazy-rescale" (all
            but the first autotune on a GPU for 16-bit inputs unless ``config`` is given).
        backward: "teaching" (notebook 07's kernels with ``config``'s tiles) or "tuned"
            (:mod:`flashlib.kernels.backward_fast`: mask-free interior tiles, dK/dV and dQ
            tiles autotuned on a GPU for 16-bit inputs unless ``config`` is given; float32
            uses the shipped tiles), same gradients, still
            deterministic; or "atomic": the tuned dK/dV kernel also adds each dQ share
            with float32 atomics (one kernel, five matmuls per tile instead of seven, but
            the last bits of dq may change from run to run); or "lean": "tuned" with the
            streamed blocks moved by tensor descriptors (sm_90) and longest-first causal dQ;
            or "bulk": "atomic" with descriptors, each dQ tile added by one bulk reduction
            (sm_90; elsewhere per-element atomics).

    float16, bfloat16 (GPUs of compute capability >= 8.0) and float32 (tf32 matmuls by
    default on a GPU); head_dim 1..256 (padded to a power of two inside the kernel); any
    sequence lengths. Without a CUDA device the kernels run in Triton's CPU interpreter and
    take CPU tensors. The backward pass is deterministic (no atomics) unless backward is
    "atomic" or "bulk".
    """
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    cfg = check_kernel_inputs(q, config)
    if forward not in FORWARDS:
        raise ValueError(f"{FN}: argument 'forward' must be one of {FORWARDS}, got {forward!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"{FN}: argument 'backward' must be one of {BACKWARDS}, got {backward!r}")
    out, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, cfg, forward, config, backward)
    return (out, lse) if return_lse else out
