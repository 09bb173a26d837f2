"""Element offsets past 2^31: the kernels compute them in 64 bits.

A key row stride of 2^27 elements puts row 16 at 2^31; computed in int32, the offset wraps
negative and the kernel reads (or writes) outside the tensor. The tensors here live in a sparse
file mapped with ``torch.from_file``: its 8 GiB of address space cost the few pages the kernels
touch, so the test needs neither the memory nor the disk."""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.kernels import attention

pytest.importorskip("triton")

STRIDE = 2**27  # elements between two rows: rows >= 16 start past 2^31
ROWS, D = 20, 8


@pytest.fixture
def spread(tmp_path):
    """spread(shape, seed): a float32 tensor (..., ROWS, D) whose rows are STRIDE elements apart."""
    made = []

    def make(lead: int, seed: int):
        size = (ROWS - 1) * STRIDE + lead * D
        path = tmp_path / f"rows{len(made)}.bin"
        with open(path, "wb") as f:
            f.truncate(size * 4)  # sparse: no block is written until a row is
        store = torch.from_file(str(path), shared=True, size=size, dtype=torch.float32)
        t = torch.as_strided(store, (1, lead, ROWS, D), (0, D, STRIDE, 1))
        t.copy_(torch.randn(1, lead, ROWS, D, generator=torch.Generator().manual_seed(seed)))
        made.append(t)
        return t

    yield make
    made.clear()


def _float64(*ts):
    return [t.detach().double().contiguous() for t in ts]


def test_teaching_kernels_forward_and_backward(spread):
    k, v = spread(2, 1), spread(2, 2)  # (1, 2, ROWS, D), rows 2^27 elements apart
    q = spread(2, 3).requires_grad_(True)
    kk, vv = (t.requires_grad_(True) for t in (k, v))
    out = attention(q, kk, vv, causal=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    ref_inputs = [t.requires_grad_(True) for t in _float64(q, k, v)]
    ref = flashlib.dense_attention(*ref_inputs, causal=True)
    ref.backward(grad.double())
    assert (out.double() - ref).abs().max().item() < 1e-5
    for got, want in zip((q.grad, kk.grad, vv.grad), (t.grad for t in ref_inputs)):
        assert (got.double() - want).abs().max().item() < 1e-5


def test_decode_from_a_cache_with_huge_row_strides(spread):
    k_cache, v_cache = spread(1, 5), spread(1, 6)  # (batch 1, kv_heads 1, capacity ROWS, D)
    q = torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(7))  # two query heads share it
    seqlens = torch.tensor([ROWS], dtype=torch.int32)
    out = flashlib.decode_attention(q, k_cache, v_cache, seqlens)
    ref = flashlib.decode_reference(*_float64(q, k_cache, v_cache), seqlens)
    assert (out.double() - ref).abs().max().item() < 1e-5
