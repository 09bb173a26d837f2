"""Checkers for the exercises of the kernel notebooks (05-07).

Each checker takes the student's answer, never raises, prints PASS or NOT YET with a hint,
and returns True or False. Expected values come from definitions, not from the code the
exercise is about.
"""
from __future__ import annotations

import math
import numbers

import torch

PASS, RETRY = "PASS", "NOT YET"


def _passed(message):
    print(f"{PASS}: {message}")
    return True


def _failed(message, hint):
    print(f"{RETRY}: {message}\n  hint: {hint}")
    return False


def _number(answer, expected, *, kind, hint, rel=1e-6):
    if answer is None or answer is Ellipsis:
        return _failed(f"no answer yet; expected {kind}.", hint)
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer):
        return _failed(f"expected {kind}, got {answer!r}.", hint)
    if math.isclose(answer, expected, rel_tol=rel, abs_tol=0.0):
        return _passed(f"{answer:g} is right.")
    return _failed(f"{answer:g} is {'too large' if answer > expected else 'too small'}.", hint)


def check_program_count(answer, n: int = 1000, block: int = 128) -> bool:
    """How many programs does vector_add launch for n elements, BLOCK elements each?"""
    return _number(answer, -(-n // block), kind="a whole number of programs",
                   hint=f"every program covers BLOCK = {block} elements; the last one may be partly masked "
                        "(round up, not down)")


def check_scale_launcher(scale, sizes=(1, 17, 256, 1000)) -> bool:
    """``scale(x, alpha)`` must return x * alpha for 1-D float32 CPU tensors of any length."""
    if not callable(scale):
        return _failed(f"expected a function scale(x, alpha), got {scale!r}.",
                       "launch a kernel over triton.cdiv(n, BLOCK) programs and mask offs < n")
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=generator)
        try:
            got = scale(x, 2.5)
        except Exception as exc:  # the student's code: report, never raise
            return _failed(f"scale(x, 2.5) with n = {n} raised {type(exc).__name__}: {exc}",
                           "check the grid and the mask on tl.load and tl.store")
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return _failed(f"for n = {n} expected a tensor of shape {tuple(x.shape)}, got {got!r}.",
                           "allocate the output with torch.empty_like(x)")
        if not torch.allclose(got, x * 2.5, rtol=1e-6, atol=0.0):
            bad = int((~torch.isclose(got, x * 2.5)).nonzero()[0])
            return _failed(f"for n = {n}, element {bad} is {got[bad].item():.4f}, expected "
                           f"{2.5 * x[bad].item():.4f}.",
                           "elements past a multiple of BLOCK need the same program logic: check the offsets")
    return _passed(f"scale is right for n in {sizes}.")


def check_tensor_core_instruction(answer) -> bool:
    """Which PTX instruction family runs the matrix products on sm_90 (Hopper)?"""
    hint = "search the PTX printed above for the instruction that contains 'mma'"
    if not isinstance(answer, str) or not answer.strip():
        return _failed("expected the instruction's name as a string.", hint)
    word = answer.strip().lower()
    if word.startswith("wgmma"):
        return _passed("wgmma: warpgroup matrix multiply-accumulate, asynchronous, Hopper's tensor cores.")
    if word.startswith("mma"):
        return _failed("mma.sync is Ampere's (sm_80) tensor-core instruction.", hint)
    return _failed(f"{answer!r} is not a tensor-core instruction.", hint)


def check_qk_scale(answer, head_dim: int = 64) -> bool:
    """The one multiplier the forward kernel applies to q kᵀ, for the default scale."""
    return _number(answer, (1 / math.sqrt(head_dim)) / math.log(2), kind="a float",
                   hint="exp(x) = 2^(x · log2(e)), and log2(e) = 1 / ln(2); fold in scale = 1/sqrt(head_dim)")


def check_causal_tiles(answer, seq: int = 1000, block_q: int = 128, block_k: int = 64) -> bool:
    """Total key tiles all forward programs compute for causal attention, seq_q = seq_k = seq."""
    total = 0
    for start in range(0, seq, block_q):
        last_row = min(start + block_q, seq) - 1
        total += last_row // block_k + 1  # tiles 0 .. the one holding the last row's diagonal key
    return _number(answer, total, kind="a whole number of tiles",
                   hint="query block i sees keys up to its last row, (i + 1)·BLOCK_Q - 1; count the key tiles "
                        "up to the one holding that key, and add over the blocks")


def check_natural_lse(fn) -> bool:
    """``fn(m2, l)``: natural-log lse from the kernel's base-2 running max m2 and denominator l."""
    hint = "lse = ln(l) + m2 · ln(2): m2 is in base-2 units (scores times log2 e); -inf where l == 0"
    if not callable(fn):
        return _failed(f"expected a function fn(m2, l), got {fn!r}.", hint)
    m2 = torch.tensor([0.0, 3.5, -2.0, 1000.0, float("-inf")], dtype=torch.float64)
    l = torch.tensor([1.0, 2.0, 7.5, 3.0, 0.0], dtype=torch.float64)
    want = torch.tensor([0.0, 3.5 * math.log(2) + math.log(2.0), -2 * math.log(2) + math.log(7.5),
                         1000 * math.log(2) + math.log(3.0), float("-inf")], dtype=torch.float64)
    try:
        got = torch.as_tensor(fn(m2, l), dtype=torch.float64)
    except Exception as exc:
        return _failed(f"fn raised {type(exc).__name__}: {exc}", hint)
    if got.shape != want.shape:
        return _failed(f"expected shape {tuple(want.shape)}, got {tuple(got.shape)}.", hint)
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=False):
        return _failed(f"got {[round(x, 4) for x in got.tolist()]}, expected "
                       f"{[round(x, 4) for x in want.tolist()]}.", hint)
    return _passed("base-2 statistics converted to the natural log-sum-exp, empty rows included.")


def check_backward_matmuls(answer) -> bool:
    """How many (tile x tile) matrix products per (query block, key tile) pair in both backward kernels?"""
    return _number(answer, 7, kind="a whole number",
                   hint="dK/dV kernel: S, dV, dP, dK; dQ kernel recomputes S and dP, then dQ")


def check_backward_flops_ratio(answer) -> bool:
    """Backward FLOPs over forward FLOPs of attention (matmuls only), as benchmarks count them."""
    return _number(answer, 2.5, kind="a ratio",
                   hint="forward: 2 products (S, O); backward in principle: 5 (S again, dV, dP, dQ, dK)")
