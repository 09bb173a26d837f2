"""Checkers for the exercises of the kernel notebooks (05-07).

Each checker takes the student's answer, never raises, prints PASS or NOT YET (with a hint
once there is an answer to react to), and returns True or False. A number's checker keeps a
digest of the answer, not the answer (:func:`flashlib.course.exercises.digest`); a function's
checker computes what it expects from definitions, not from the code the exercise is about.
"""
from __future__ import annotations

import math

import torch

from ..roofline import WGMMA_ROWS  # a Hopper warpgroup product (wgmma) covers at least 64 rows
from .exercises import Digest, _check_number, _failed, _passed, _unanswered

PROGRAM_COUNT = dict(n=1000, block=128)


def check_program_count(answer) -> bool:
    """How many programs does vector_add launch for n = 1000 elements, BLOCK = 128 elements each?"""
    return _check_number(answer, Digest("program_count:576cf4d074f73a27"), kind="a whole number of programs",
                         exact=True,
                         hint=f"every program covers BLOCK = {PROGRAM_COUNT['block']} elements; the last one may be "
                              "partly masked (round up, not down)",
                         known_mistakes=[(Digest("program_count:4b5aaa342dddeb21"),
                                          "the last, partly filled block needs a "
                                          "program too.")])


def check_scale_launcher(scale, sizes=(1, 17, 256, 1000)) -> bool:
    """``scale(x, alpha)`` must return x * alpha for 1-D float32 CPU tensors of any length."""
    hint = "launch a kernel over triton.cdiv(n, BLOCK) programs and mask offs < n"
    unanswered = _unanswered(scale, "a function scale(x, alpha)")
    if unanswered is not None:
        return unanswered
    if not callable(scale):
        return _failed(f"expected a function scale(x, alpha), got {scale!r}.", hint)
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=generator)
        try:
            got = scale(x, 2.5)
        except NotImplementedError:  # the notebook's stub: nothing tried yet, so no hint yet
            print("NOT YET: no answer yet; expected scale(x, alpha) to launch scale_kernel.")
            return False
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





def check_tensor_core_instruction(answer, rows: int = 16) -> bool:
    """Which tensor-core instruction family runs a product of ``rows`` x 64 by 64 x 128 on sm_90?"""
    hint = (f"a warpgroup (four warps) shares one wgmma product of at least {WGMMA_ROWS} rows; a product "
            "with fewer rows cannot fill it")
    unanswered = _unanswered(answer, "the instruction family's name, 'wgmma' or 'mma.sync'")
    if unanswered is not None:
        return unanswered
    if not isinstance(answer, str) or not answer.strip():
        return _failed("expected the instruction's name as a string.", hint)
    word = answer.strip().lower()
    right = "wgmma" if rows >= WGMMA_ROWS else "mma"
    if word.startswith(right) and not (right == "mma" and word.startswith("wgmma")):
        return _passed(f"{'wgmma' if right == 'wgmma' else 'mma.sync'}: a {rows}-row product "
                       f"{'fills' if rows >= WGMMA_ROWS else 'is too short for'} a warpgroup's {WGMMA_ROWS} rows.")
    if word.startswith(("wgmma", "mma")):
        return _failed(f"{answer!r} is the other family: compare the product's {rows} rows with the "
                       f"{WGMMA_ROWS} a warpgroup needs.", hint)
    return _failed(f"{answer!r} is not a tensor-core instruction.", hint)


def check_qk_scale(answer) -> bool:
    """The one multiplier the forward kernel applies to q kᵀ, for the default scale and head dim 64."""
    return _check_number(answer, Digest("qk_scale:fa778bcbe6c4d7be"), kind="a float", rel=1e-6,
                         hint="exp(x) = 2^(x · log2(e)), and log2(e) = 1 / ln(2); fold in scale = 1/sqrt(head_dim)",
                         known_mistakes=[(Digest("qk_scale:0a177c636d66a56c"), "that is the scale alone: the kernel's "
                                          "exp2 needs it in base-2 units, times log2(e)."),
                                         (Digest("qk_scale:5acf5137d3a8ae0a"), "multiply by log2(e) = 1 / ln 2, not "
                                          "by ln 2.")])


def check_causal_tiles(answer) -> bool:
    """Total key tiles all forward programs compute for causal attention, seq_q = seq_k = 1500, BLOCK_Q = 128,
    BLOCK_K = 64."""
    return _check_number(answer, Digest("causal_tiles:03618ebced9c8d5d"), kind="a whole number of tiles", exact=True,
                         hint="query block i sees keys up to its last row, (i + 1)·BLOCK_Q - 1; count the key "
                              "tiles up to the one holding that key, and add over the blocks",
                         known_mistakes=[(Digest("causal_tiles:ed7982a3aabc1104"),
                                          "that is every tile: causal programs "
                                          "stop at their diagonal."),
                                         (Digest("causal_tiles:b245b41bc531c9b4"),
                                          "half the grid is close but not it: count the diagonal "
                                          "tiles in full.")])


def check_natural_lse(fn) -> bool:
    """``fn(m2, l)``: natural-log lse from the kernel's base-2 running max m2 and denominator l."""
    hint = "lse = ln(l) + m2 · ln(2): m2 is in base-2 units (scores times log2 e); -inf where l == 0"
    unanswered = _unanswered(fn, "a function fn(m2, l)")
    if unanswered is not None:
        return unanswered
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
    return _check_number(answer, Digest("backward_matmuls:72c3892cf27a430c"), kind="a whole number", exact=True,
                         hint="dK/dV kernel: S, dV, dP, dK; dQ kernel recomputes S and dP, then dQ",
                         known_mistakes=[(Digest("backward_matmuls:4c60a997ae0a4926"),
                                          "five is what the math needs; the two kernels each recompute S "
                                          "and dP.")])


def check_backward_flops_ratio(answer) -> bool:
    """Backward FLOPs over forward FLOPs of attention (matmuls only), as benchmarks count them."""
    return _check_number(answer, Digest("backward_flops_ratio:180531566c0ec6bb"), kind="a ratio", rel=1e-6,
                         hint="forward: 2 products (S, O); backward in principle: 5 (S again, dV, dP, dQ, dK)",
                         known_mistakes=[(Digest("backward_flops_ratio:5ff6c82eeb3001f9"),
                                          "that is forward + backward over "
                                          "forward."),
                                         (Digest("backward_flops_ratio:da44d3e2a87a166a"),
                                          "count the backward's products again: S, dV, dP, dQ, dK.")])
