"""Limits a GPU launch meets that the CPU interpreter does not: CUDA's 65,535 programs on grid axes
1 and 2, int32 offsets past 2^31 elements, and Triton's allocator, which is set per thread.

The kernels run here in Triton's interpreter; where a limit belongs to the GPU, the launcher's
logic is checked directly (the rows of each launch, which thread sets the allocator) and the
multi-launch path is run for real with the limit forced down to 3 rows: the dense kernels, the
ladder, packed sequences and decoding."""
from __future__ import annotations

import contextvars
import math
import threading

import pytest
import torch

from flashlib import dense_attention
from flashlib.kernels import triton_installed

if not triton_installed():  # importing triton here first would keep its interpreter off
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.kernels import FlashConfig  # noqa: E402
from flashlib.kernels import attention as teaching_attention  # noqa: E402
from flashlib.kernels import rules as kernel_rules  # noqa: E402
from flashlib.ladder import attention as ladder_attention  # noqa: E402
from flashlib.ladder import forward as ladder_forward  # noqa: E402

SMALL = FlashConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)


def _grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) under the output gradient dout; q, k, v keep their strides
    (detached views, not clones, which would be contiguous)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _check_against_dense(fn, q, k, v, dout, causal, atol=2e-5, rtol=1e-4, **options):
    got = _grads(fn, q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=causal, **options),
                  *(t.double() for t in (q, k, v, dout)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ----- CUDA's grid: at most 65,535 (batch, head) rows a launch -------------------------------------

@pytest.mark.parametrize("rows,multiple", [(1, 1), (65535, 1), (65536, 1), (70000, 1), (70000, 4), (65535 * 3 + 7, 8),
                                        (2**32, 1), (90, 6)])
def test_row_runs_cover_every_row_once_within_the_limit(rows, multiple):
    runs = kernel_rules.row_runs(rows, multiple)
    assert runs[0].start == 0 and runs[-1].stop == rows
    assert all(a.stop == b.start for a, b in zip(runs, runs[1:]))  # in order, no gap, no overlap
    assert all(0 < c.stop - c.start <= 65535 for c in runs)
    unit = math.lcm(16, multiple)  # aligned pointers: one compiled kernel for every launch; groups whole
    assert all(c.start % unit == 0 for c in runs)
    assert len(runs) == -(-rows // (65535 // unit * unit))


def test_row_runs_under_a_small_limit_keep_groups_whole(monkeypatch):
    monkeypatch.setattr(kernel_rules, "MAX_GRID_ROWS", 3)
    assert kernel_rules.row_runs(7) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert kernel_rules.row_runs(8, multiple=2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(ValueError, match="runs of 4"):
        kernel_rules.row_runs(8, multiple=4)


def _record_grids(monkeypatch, kernel):
    """A list that gets (kernel name, grid) of every launch of a kernel of kernel's class."""
    grids = []
    launcher = type(kernel)
    real = launcher.run

    def run(self, *args, **kwargs):
        grid = kwargs["grid"]
        grids.append((self.fn.__name__, grid(kwargs) if callable(grid) else grid))  # meta: the launch's options
        return real(self, *args, **kwargs)

    monkeypatch.setattr(launcher, "run", run)
    return grids


@pytest.mark.parametrize("forward,backward", [("causal-split", "tuned"), ("tma", "lean"), ("lean", "bulk"),
                                              ("teaching", "teaching")])
def test_ladder_launches_at_most_the_limit_of_rows(forward, backward, monkeypatch):
    """B*H = 8 rows under a limit of 3: every kernel launches three times, on rows 0-2, 3-5 and
    6-7, and the answer is dense attention's, forward and backward."""
    monkeypatch.setattr(kernel_rules, "MAX_GRID_ROWS", 3)
    grids = _record_grids(monkeypatch, ladder_forward._attn_fwd_tma)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 21, 16, generator=gen)  # (B, H, N, D): 64-byte rows, descriptors can move them
    k, v = (torch.randn(2, 4, 30, 16, generator=gen) for _ in range(2))
    dout = torch.randn(2, 4, 21, 16, generator=gen)
    for causal in (False, True):
        grids.clear()
        _check_against_dense(lambda a, b, c: ladder_attention(a, b, c, causal=causal, config=SMALL, forward=forward,
                                                              backward=backward), q, k, v, dout, causal)
        assert grids and all(grid[1] <= 3 for _, grid in grids), grids
        assert sorted(grid[1] for _, grid in grids) == sorted([3, 3, 2] * (len(grids) // 3)), grids


def test_packed_sequences_launch_runs_of_whole_sequences(monkeypatch):
    """flash_attention_varlen with batch x heads = 8 query rows and 4 kv rows under a limit of 3:
    the forward and dQ kernels launch one sequence (2 heads) at a time, dK/dV 3 sequences then 1,
    each on its slice of the cumulative lengths, and every sequence equals dense attention."""
    from flashlib import flash_attention_varlen
    from flashlib.kernels import varlen as packed

    monkeypatch.setattr(kernel_rules, "MAX_GRID_ROWS", 3)
    grids = _record_grids(monkeypatch, packed._attn_fwd_varlen)
    lengths = [5, 0, 19, 8]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lengths), 2, 16, generator=gen)
    k, v = (torch.randn(sum(lengths), 1, 16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 5, 5, 24, 32], dtype=torch.int32)
    got = _grads(lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, 19, 19, causal=True), q, k, v, dout)
    seen = sorted((name, grid[1]) for name, grid in grids if name.endswith("_varlen"))  # not delta's, by head
    assert seen == sorted([("_attn_fwd_varlen", 2)] * 4 + [("_attn_bwd_dq_varlen", 2)] * 4
                          + [("_attn_bwd_dkdv_varlen", 3), ("_attn_bwd_dkdv_varlen", 1)]), seen
    for start, stop in zip(cu.tolist(), cu.tolist()[1:]):
        one = (t[start:stop].transpose(0, 1)[None] for t in (q, k, v, dout))
        want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=True), *(t.double() for t in one))
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g[start:stop].double(), w[0].transpose(0, 1), atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("paged", [False, True])
def test_decoding_launches_runs_of_whole_sequences(paged, monkeypatch):
    """decode_attention with batch x kv_heads = 4 under a limit of 3: the split kernel launches 3
    sequences then 1, on views of their queries, lengths, caches or block table, and partials; the
    merge (batch x kv_heads on grid axis 0) launches once."""
    from flashlib.decode import decode_attention, paged_cache
    from flashlib.kernels import decode as kernels

    monkeypatch.setattr(kernel_rules, "MAX_GRID_ROWS", 3)
    grids = _record_grids(monkeypatch, kernels._decode_split)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(4, 2, 2, 16, generator=gen)  # (B, H, new tokens, D), one kv head
    k_cache, v_cache = (torch.randn(4, 1, 70, 16, generator=gen) for _ in range(2))
    lengths = torch.tensor([2, 70, 33, 9], dtype=torch.int32)
    caches, table = (k_cache, v_cache), None
    if paged:
        *caches, table = paged_cache(k_cache, v_cache, 16, generator=torch.Generator().manual_seed(2))
    out = decode_attention(q, *caches, lengths, block_table=table, num_splits=2)
    assert sorted(grid[2] for name, grid in grids if name == "_decode_split") == [1, 3], grids  # (row blocks, splits, rows)
    assert [grid[0] for name, grid in grids if name == "_decode_merge"] == [4], grids
    for b, n in enumerate(lengths.tolist()):
        want = dense_attention(q[b:b + 1].double(), k_cache[b:b + 1, :, :n].double(), v_cache[b:b + 1, :, :n].double(),
                               causal=True)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-6, rtol=0)


# ----- int32 offsets: a head's rows past 2^31 elements --------------------------------------------

def test_int32_rows_copies_only_heads_whose_rows_pass_2_31_elements():
    fits = torch.empty(2, 17, 16, device="meta")
    assert ladder_forward.int32_rows(fits) is fits
    wide = torch.empty(2**31 + 64, device="meta").as_strided((1, 17, 16), (0, 2**27, 1))  # row 16 at 2^31
    copied = ladder_forward.int32_rows(wide)
    assert copied.shape == wide.shape and copied.stride()[1:] == (16, 1)
    assert ladder_forward.empty_rows(wide).stride()[1:] == (16, 1)
    assert ladder_forward.empty_rows(fits).shape == fits.shape
    huge = torch.empty(1, 2**24, 128, device="meta")  # one head of 2^31 elements even contiguous
    with pytest.raises(ValueError, match="flashlib.kernels.attention"):
        ladder_forward.int32_rows(huge)


ROW_STRIDE = 2**28  # elements: rows 8 to 15 of a head start past 2^31, row 16 at 2^32
SEQ = 17  # one whole tile of 16 rows, so that the unmasked loads meet rows 8 to 15 too


@pytest.fixture(scope="module")
def wide_rows():
    """q, k, v (1, 1, 17, 16) float16 whose rows are 2^28 elements apart, in one storage of 9 GiB of
    address space of which only their rows are touched (the interpreter copies a storage back onto
    itself after each launch, which touches nothing), and dout."""
    d = 16
    try:
        storage = torch.empty(SEQ * ROW_STRIDE, dtype=torch.float16)
    except RuntimeError:  # no room for the address space here
        pytest.skip("needs 9 GiB of address space (a storage of 17 * 2^28 elements)")
    gen = torch.Generator().manual_seed(5)
    views = []
    for i in range(3):  # q, k, v interleaved: row j of each at j * ROW_STRIDE + i * d
        view = storage.as_strided((1, 1, SEQ, d), (SEQ * ROW_STRIDE, SEQ * ROW_STRIDE, ROW_STRIDE, 1), i * d)
        view.copy_(torch.randn(1, 1, SEQ, d, generator=gen))
        views.append(view)
    dout = torch.randn(1, 1, SEQ, d, generator=gen).half()
    yield (*views, dout)
    del views, storage


def test_teaching_kernels_offset_rows_past_2_31_elements(wide_rows):
    q, k, v, dout = wide_rows
    for causal in (False, True):
        _check_against_dense(lambda a, b, c: teaching_attention(a, b, c, causal=causal, config=SMALL),
                             q, k, v, dout, causal, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("forward,backward", [("causal-split", "tuned"), ("tma", "lean")])
def test_ladder_offsets_rows_past_2_31_elements(wide_rows, forward, backward):
    q, k, v, dout = wide_rows
    _check_against_dense(lambda a, b, c: ladder_attention(a, b, c, causal=True, config=SMALL, forward=forward,
                                                          backward=backward), q, k, v, dout, True,
                         atol=4e-3, rtol=4e-3)


# ----- Triton's allocator: a ContextVar, so one per thread ---------------------------------------

def test_tma_allocator_is_set_once_in_each_thread(monkeypatch):
    """Autograd runs a CUDA backward on a thread of its own: a flag set by the forward's thread
    must not keep the backward's from setting Triton's allocator."""
    calls = []
    monkeypatch.setattr(ladder_forward.triton, "set_allocator", lambda allocator: calls.append(threading.get_ident()))

    def twice():
        ladder_forward.ensure_allocator(torch.device("cuda"))
        ladder_forward.ensure_allocator(torch.device("cuda"))
        ladder_forward.ensure_allocator(torch.device("cpu"))  # the interpreter needs none

    contextvars.copy_context().run(twice)  # this thread, in a copy of its context: nothing leaks
    worker = threading.Thread(target=twice)
    worker.start()
    worker.join()
    assert calls == [threading.get_ident(), worker.ident]


def test_triton_sees_the_allocator_in_a_second_thread():
    allocation = pytest.importorskip("triton.runtime._allocation")
    if not hasattr(allocation, "_allocator"):
        pytest.skip("this Triton keeps its allocator elsewhere")
    seen = []

    def launch_setup():
        ladder_forward.ensure_allocator(torch.device("cuda"))
        seen.append(allocation._allocator.get() is not allocation._NULL_ALLOCATOR)

    contextvars.copy_context().run(launch_setup)
    worker = threading.Thread(target=launch_setup)
    worker.start()
    worker.join()
    assert seen == [True, True]
