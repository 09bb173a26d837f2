"""flash-attn's accuracy rule, ported to float32 on the CPU (used by tests/test_flash_attn_rule.py).

flash-attn (Dao-AILab/flash-attention, tests/test_flash_attn.py) does not compare its kernel with
a fixed tolerance. It measures two errors against one reference computed in float32 from upcast
inputs: its kernel's, and that of plain PyTorch attention computed in the kernel's own low
precision, and asks that the kernel be at most twice as far off as PyTorch, plus a small
absolute term (1e-5 on the output, 2e-4 on dq, dk, dv in float16/bfloat16; the Hopper tests
use twice the rounding error of ``ref + 0.3``, about two ulps of the working dtype).

Here the kernels run in Triton's CPU interpreter, where the working precision is float32
(the interpreter has no bfloat16), so every level moves up one precision:

    reference   :func:`reference64`: softmax(q kᵀ · scale) v in float64 from the same float32
                inputs, written here without flashlib; causal aligned bottom-right (query i
                sees key j iff j <= i + seq_k - seq_q); a row that sees no key outputs 0 with
                zero gradients. Gradients by float64 autograd.
    baseline    :func:`sdpa32`: ``torch.nn.functional.scaled_dot_product_attention`` in float32
                on the CPU, forced onto PyTorch's fused CPU kernel (the flash backend; like
                flashlib's backward it recomputes the probabilities from a stored log-sum-exp).
                Its ``is_causal`` aligns top-left, so the causal cases pass an explicit
                bottom-right boolean mask; rows that see no key are made harmless in the
                baseline (given a mask row of all True, their output set to 0 so that no
                gradient flows from them) rather than in the assertion.
    also shown  :func:`math32`: flash-attn's own ``attention_ref(upcast=False, reorder_ops=True)``
                idea in float32 (scale applied to k, plain softmax, autograd through it):
                reported in the failure messages, not asserted.

The rule, for each of out, dq, dk, dv (err = max |x - reference|, over the whole tensor):

    err(flashlib) <= K * err(sdpa32) + ULPS * ulp32(max |reference|)

with K = 2 (flash-attn's factor) and ULPS = 4, ulp32(m) the spacing of float32 numbers at m
(2^(floor(log2 m) - 23)). flash-attn's absolute terms are not ported as numbers: 1e-5 and 2e-4
are small beside float16/bfloat16 rounding, but hundreds to thousands of float32 ulps here. Its
Hopper tests' term, 2 * max |fl(ref + 0.3) - 0.3 - ref|, comes to one or two ulps of max |ref|
in float32 for these tensors; four is twice to four times that. The term decides only tensors
whose maxima come from a handful of query rows (seq_q = 1 or 3), where one rounding sets them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

K = 2  # flash-attn's factor over PyTorch's own error
ULPS = 4  # the absolute term, in float32 ulps at the largest reference entry
NAMES = ("out", "dq", "dk", "dv")


def visible(seq_q: int, seq_k: int, causal: bool) -> torch.Tensor:
    """(seq_q, seq_k) bool: query i sees key j iff j <= i + seq_k - seq_q when causal."""
    i = torch.arange(seq_q)[:, None]
    j = torch.arange(seq_k)[None, :]
    if not causal:
        return torch.ones(seq_q, seq_k, dtype=torch.bool)
    return j <= i + (seq_k - seq_q)


def _probabilities(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over visible keys; rows that see no key get probabilities 0 (and zero gradients)."""
    has_key = mask.any(-1, keepdim=True)
    safe = mask | ~has_key  # an empty row is softmaxed over everything, then multiplied by 0
    p = torch.softmax(scores.masked_fill(~safe, -math.inf), dim=-1)
    return p * has_key


def reference64(q, k, v, causal: bool) -> torch.Tensor:
    """Attention in float64 (inputs are upcast), scale 1/sqrt(head_dim)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return _probabilities(scores, visible(q.shape[-2], k.shape[-2], causal)) @ v


def math32(q, k, v, causal: bool) -> torch.Tensor:
    """flash-attn's low-precision PyTorch reference in float32: the scale on k (reorder_ops)."""
    scores = q @ (k / math.sqrt(q.shape[-1])).transpose(-2, -1)
    return _probabilities(scores, visible(q.shape[-2], k.shape[-2], causal)) @ v


def sdpa32(q, k, v, causal: bool) -> torch.Tensor:
    """PyTorch's fused CPU attention in float32, bottom-right causal by an explicit mask."""
    mask = visible(q.shape[-2], k.shape[-2], causal)
    has_key = mask.any(-1, keepdim=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(mask | ~has_key) if causal else None)
    return out * has_key  # rows that see no key: 0, and no gradient flows back from them


def forward_backward(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) with dout as the output's gradient."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return out.detach(), dq, dk, dv


def ulp32(m: float) -> float:
    """The spacing of float32 numbers at m > 0 (normal range)."""
    _, exponent = math.frexp(m)  # m = f * 2**exponent, 0.5 <= f < 1
    return math.ldexp(1.0, exponent - 1 - 23)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


@dataclass(frozen=True)
class Check:
    """One tensor's errors against the float64 reference and the rule's bound."""

    name: str
    err: float  # flashlib's
    err_sdpa: float  # the asserted baseline
    err_math: float  # shown only
    ref_max: float

    @property
    def bound(self) -> float:
        return K * self.err_sdpa + ULPS * ulp32(self.ref_max)

    @property
    def ok(self) -> bool:
        return self.err <= self.bound

    def line(self) -> str:
        return (f"{self.name}: err {self.err:.3e}  sdpa32 {self.err_sdpa:.3e} ({self.err / self.err_sdpa:.2f}x)  "
                f"math32 {self.err_math:.3e} ({self.err / self.err_math:.2f}x)  bound {self.bound:.3e}  "
                f"max|ref| {self.ref_max:.3f}  {'ok' if self.ok else 'MISS'}")


def inputs(batch, heads, seq_q, seq_k, dim, seed=0):
    """q, k, v, dout: standard normal float32, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, seq_q, dim), (batch, heads, seq_k, dim), (batch, heads, seq_k, dim),
              (batch, heads, seq_q, dim))
    return [torch.randn(*s, generator=g) for s in shapes]


def checks(op, q, k, v, dout, causal: bool) -> list[Check]:
    """The rule's four checks of op(q, k, v, causal=...) on these float32 inputs."""
    got = forward_backward(lambda q, k, v: op(q, k, v, causal=causal), q, k, v, dout)
    ref = forward_backward(lambda q, k, v: reference64(q, k, v, causal), q.double(), k.double(), v.double(),
                           dout.double())
    fused = forward_backward(lambda q, k, v: sdpa32(q, k, v, causal), q, k, v, dout)
    plain = forward_backward(lambda q, k, v: math32(q, k, v, causal), q, k, v, dout)
    return [Check(name, max_err(a, r), max_err(s, r), max_err(m, r), r.abs().max().item())
            for name, a, r, s, m in zip(NAMES, got, ref, fused, plain)]
