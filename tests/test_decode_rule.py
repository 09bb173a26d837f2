"""flash-attn's accuracy rule for decoding with a KV cache, ported to float32 on the CPU.

flash-attn's ``test_flash_attn_kvcache`` asks of its kernel, against a reference in higher precision,
at most twice PyTorch's largest error (plus 1e-5) and at most 1.5 times PyTorch's mean error, where
"PyTorch" is its ``attention_ref(upcast=False, reorder_ops=True)`` in the kernel's own precision
(q divided by sqrt(d) first; soft-capping as (s / cap).tanh() * cap). One precision up here, as in
tests/flash_attn_rule.py: the split-KV kernels run in Triton's interpreter in float32, the reference
is float64, the baseline that PyTorch attention in float32.

The hard case is soft-capping at 50 with queries scaled by 50 / 4, so that the capped logits reach
50 (72 in the kernels' base-2 units, where a float32 ulp is 8e-6): the scores' rounding and tanh's
accuracy decide the error, and merging the splits must not add to it. The splits' states are merged
as notebook 02 merges two, from their maxima and denominators: merged through their lse (one
rounding at 72 per split) the mean error grew with the number of splits, 1.23x PyTorch's at one
split to 1.61x at four (one seed). Measured one seed at a time over seeds 0-9 (4 shapes, 1-8
splits): at most 1.28x here, 1.51x with PyTorch on MKL's AVX2 kernels. The test holds the mean over
three seeds together: 0.78-0.99x PyTorch's for 1-8 splits, the same with PyTorch on AVX2; at the
shapes below (the full-head one at 264 keys, 2026-12-08, an AMD EPYC) 1.07x and 0.61x for every split
count 1-8, the largest error at most 0.36 of its bound.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import flashlib

if importlib.util.find_spec("triton") is None:  # the kernels need Triton (Linux only)
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: float32 exactly")

CAP = 50.0
# (batch, q_heads, kv_heads, cache length, head_dim): grouped heads, full heads at head dim 128 (flash-attn's
# test has 799 and more keys; here the interpreter pays per program and per 32-key tile, and the lengths
# drawn, 48 to 309 keys, already leave splits of whole tiles empty at the largest counts)
SHAPES = [(2, 6, 2, 339, 64), (2, 6, 6, 264, 128)]
SEEDS = (0, 1, 2)


def attention_ref(q, k, v, lengths, dtype):
    """flash-attn's attention_ref(upcast=False, reorder_ops=True) with a soft-cap, in dtype, for one new
    token per sequence ((batch, heads, 1, d) layout); query b sees cache positions < lengths[b]."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)
    s = (s / CAP).tanh() * CAP
    seen = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
    return torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v


def _case(seed, shape):
    batch, heads, kv_heads, length, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, d, generator=g) * CAP / 4  # logits up to the cap
    k, v = (torch.randn(batch, kv_heads, length, d, generator=g) for _ in range(2))
    lengths = torch.randint(1, length + 1, (batch,), generator=g).to(torch.int32)
    return q, k, v, lengths


# A split is a run of whole 32-key tiles (kernels.rules._key_split): at the grouped shape's lengths (309, 128,
# 50, 156, 90, 137 keys) 6, 7 and 8 splits cut each sequence into the runs 5 splits cut it into, 8 adding
# empty splits to the merge; so every distinct cut, 1 to 5, and the most. At the full-head shape one split,
# an odd count and the most.
SPLITS = {SHAPES[0]: (1, 2, 3, 4, 5, 8), SHAPES[1]: (1, 3, 8)}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}-h{s[1]}:{s[2]}-L{s[3]}-d{s[4]}")
def test_softcap_50_within_flash_attns_kvcache_rule_for_1_to_8_splits(shape):
    """Each seed's largest error within 2x PyTorch's + 1e-5; the mean error over the seeds' outputs
    together within 1.5x PyTorch's. One seed's mean rests on a few hundred roundings, and PyTorch's
    own float32 kernels differ from one CPU to the next (MKL's AVX2 path moved one seed's ratio from
    1.28 to 1.51): over several seeds the ratio measures the kernels, not the CPU."""
    cases = [_case(seed, shape) for seed in SEEDS]
    refs = [attention_ref(q, k, v, n.long(), torch.float64) for q, k, v, n in cases]
    torch_errs = [(attention_ref(q, k, v, n.long(), torch.float32).double() - r).abs() for (q, k, v, n), r in
                  zip(cases, refs)]
    torch_mean = torch.cat([e.flatten() for e in torch_errs]).mean().item()
    for splits in SPLITS[shape]:
        errs = [(flashlib.decode_attention(q, k, v, n, softcap=CAP, num_splits=splits).double() - r).abs()
                for (q, k, v, n), r in zip(cases, refs)]
        for seed, err, torch_err in zip(SEEDS, errs, torch_errs):
            assert err.max() <= 2 * torch_err.max() + 1e-5, (splits, seed, err.max().item(), torch_err.max().item())
        ratio = torch.cat([e.flatten() for e in errs]).mean().item() / torch_mean
        assert ratio <= 1.5, f"{splits} splits: mean error {ratio:.3f}x PyTorch's"


def test_the_rule_rejects_a_merge_off_by_a_few_ulps():
    """The rule has teeth: the 4-split output with each split's weight off by 8e-6 relative (one ulp
    of a base-2 lse near 72), simulated by scaling every output by 1 + 8e-6, misses the mean bound."""
    q, k, v, lengths = _case(0, SHAPES[1])
    ref = attention_ref(q, k, v, lengths.long(), torch.float64)
    torch_err = (attention_ref(q, k, v, lengths.long(), torch.float32).double() - ref).abs()
    out = flashlib.decode_attention(q, k, v, lengths, softcap=CAP, num_splits=4).double() * (1 + 8e-6)
    assert (out - ref).abs().mean().item() > 1.5 * torch_err.mean().item()
