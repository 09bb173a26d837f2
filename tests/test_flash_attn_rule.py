"""flash-attn's own accuracy rule, on flashlib's kernels in Triton's CPU interpreter (float32).

flash-attn checks its kernel against a reference computed in higher precision and allows it
at most twice the error of PyTorch attention computed in the kernel's own precision. Ported
one precision up (the interpreter computes in float32; it has no bfloat16), for each of out,
dq, dk and dv, with err(x) = max |x - reference| over the whole tensor:

    err(flashlib) <= 2 * err(PyTorch SDPA, float32, CPU) + 4 ulp32(max |reference|)

    reference   float64 attention from the same float32 inputs, written independently of
                flashlib (tests/flash_attn_rule.py), causal aligned bottom-right (query i
                sees key j iff j <= i + seq_k - seq_q), gradients by float64 autograd
    baseline    torch.nn.functional.scaled_dot_product_attention in float32 on the CPU, on
                PyTorch's fused CPU kernel, with an explicit bottom-right boolean mask (its
                is_causal aligns top-left); rows that see no key are zeroed in the baseline
    K = 2       flash-attn's factor
    4 ulps      of float32 at the largest reference entry: "a few ulps"; flash-attn's own
                absolute terms are sized for float16/bfloat16 (tests/flash_attn_rule.py)

The fixed seed (0, as flash-attn's) passes every check. Where seq_q <= 3 the maxima come from a few
rows, where float32 rounding of a handful of scores decides them, so these cases also run over the
seeds that once missed, 2, 4 and 7 (flash-attn's grid over seeds 0-9 at seq_q <= 3, 1,040 checks,
was measured with 1 and 2 threads and with PyTorch on its AVX2 kernels: no miss, err/bound at most
0.87). Two things make that hold on any
CPU: the interpreter's tl.dot is exactly rounded (flashlib.kernels._mode; numpy's float32 matmul
rounded a score by the shape of its tile and by the CPU's BLAS kernel, 4-20 ulps at seq_q = 1), and
the lse stays in base 2 from the forward to the backward, which recomputes the forward's scores on
the forward's tiles, so a row that sees one key gets p = 1 exactly (it was 1 + 4..6 ulps, and
(799, 3) causal missed on dv for seeds 2 and 4).

Failure messages also show the error of flash-attn's own low-precision PyTorch reference
(attention_ref(upcast=False, reorder_ops=True), here in float32), which is not asserted.

Cases: flash-attn's awkward lengths (seq_q, seq_k) = (113, 203), (1, 239), (3, 799), (128, 217)
at head dims 40 and 59, causal and not (a pairwise covering of that grid), heads 2, batch 2 for seq_q <= 3 and 1 otherwise,
forward and backward through ``flashlib.flash_attention`` (the public op), plus seq_q = 1 at
head dim 64 (a case a review found close to the bound) and (799, 3) causal, whose rows mostly
see no key.
``flashlib.kernels.attention`` (the teaching kernels' own autograd Function, not the custom op)
is checked on one case per length pair.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # imported only through flashlib.kernels
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

import flashlib  # noqa: E402
from flashlib import kernels  # noqa: E402

from .flash_attn_rule import K, ULPS, checks, inputs, sdpa32  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="interpreter tests: on a GPU the float32 kernels multiply in tf32")

HEADS = 2
LENGTHS = [(113, 203), (1, 239), (3, 799), (128, 217)]
# flash-attn's grid is lengths x head dims x causal; here a covering of it: every length pair at both
# head dims and both ways, every head dim both ways (two cases per pair, the diagonal flipping with the
# pair), so that a fault tied to any two of the three still meets a case
CASES = ([(sq, sk, d, causal) for i, (sq, sk) in enumerate(LENGTHS) for d, causal in
          (((40, False), (59, True)) if i % 2 else ((40, True), (59, False)))]
         + [(1, 239, 64, False), (1, 239, 64, True), (799, 3, 40, True)])


def _batch(seq_q):
    """2 where a tensor's maxima come from a handful of query rows (seq_q = 1, 3), else 1: the
    interpreter's time grows with batch * heads * tiles."""
    return 2 if seq_q <= 3 else 1


def _id(case):
    sq, sk, d, causal = case
    return f"{sq}x{sk}-d{d}-{'causal' if causal else 'full'}"


def _assert_rule(op, case):
    seq_q, seq_k, dim, causal = case
    q, k, v, dout = inputs(_batch(seq_q), HEADS, seq_q, seq_k, dim)
    results = checks(op, q, k, v, dout, causal)
    report = "\n  ".join(c.line() for c in results)
    assert all(c.ok for c in results), (
        f"{_id(case)}: err(flashlib) > {K} * err(sdpa32) + {ULPS} ulp32(max|ref|) for "
        f"{[c.name for c in results if not c.ok]}\n  {report}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_flash_attention_within_twice_pytorch_float32_error(case):
    _assert_rule(flashlib.flash_attention, case)


@pytest.mark.parametrize("case", [(113, 203, 59, True), (1, 239, 40, False), (3, 799, 59, True),
                                  (128, 217, 40, False)], ids=_id)
def test_kernels_attention_within_twice_pytorch_float32_error(case):
    _assert_rule(kernels.attention, case)


SMALL_SEQ_Q = [(1, 239, 59, False), (1, 239, 64, True), (1, 147, 40, False), (3, 799, 40, True),
               (799, 3, 40, True)]


# each missed once: 2 and 4 on dv at (799, 3), 7 at (1, 239); (3, 799), never missed and the costliest in the
# interpreter by four (800 keys, batch 2), takes one of them
SEEDED = [(case, seed) for case in SMALL_SEQ_Q for seed in ((2,) if case[:2] == (3, 799) else (2, 4, 7))]


@pytest.mark.parametrize("case, seed", SEEDED, ids=lambda c: _id(c) if isinstance(c, tuple) else str(c))
def test_few_query_rows_within_the_rule_over_seeds(case, seed):
    seq_q, seq_k, dim, causal = case
    q, k, v, dout = inputs(_batch(seq_q), HEADS, seq_q, seq_k, dim, seed=seed)
    results = checks(flashlib.flash_attention, q, k, v, dout, causal)
    assert all(c.ok for c in results), "\n  ".join(c.line() for c in results)


def test_the_rule_rejects_an_error_of_a_few_dozen_float32_ulps():
    """The rule has teeth: the baseline itself scaled by 1 + 2^-18 (output and gradients off by
    2^-18 relative, 16 to 32 float32 ulps of each entry) fails all four checks."""
    q, k, v, dout = inputs(1, HEADS, 128, 217, 40)
    results = checks(lambda q, k, v, causal: sdpa32(q, k, v, causal) * (1 + 2 ** -18), q, k, v, dout, False)
    assert not any(c.ok for c in results), "\n".join(c.line() for c in results)
