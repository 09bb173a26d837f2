"""The course's rules, written once per language, agree: flashlib.rules (PyTorch) against
flashlib.kernels.rules (Triton, run in the interpreter), element by element and tile by tile, for
random lengths, tiles, windows (0, -1 and sides up to 2^31 - 1) and chunks; soft-capping against float64
for caps from 1e-3 to 1e7, forward and gradient."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlib
from flashlib.kernels.function import kernel_score  # noqa: E402
from flashlib.machinery.options import Options  # noqa: E402
from flashlib import rules
from flashlib.kernels import attention
from flashlib.kernels import rules as kr
from flashlib.kernels.forward import triton

import triton.language as tl  # noqa: E402

BIG = 2**31 - 1


@triton.jit
def _rule_kernel(Mask, KeyRange, QueryRange, SEQ_Q, SEQ_K, mask, BLOCKS, TILES,
                 ROWS: tl.constexpr, COLS: tl.constexpr, COLS_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """Program i: query block i's rows against every key (the element test is elementwise, so one
    row-wide tile asks it what the kernels' tiles ask; the interpreter pays per program), and its key
    range; key tile i's query range."""
    i = tl.program_id(0)
    q0, k0 = i * BLOCK_Q, i * BLOCK_K
    if i < BLOCKS:
        offs_q, offs_k = q0 + tl.arange(0, BLOCK_Q), tl.arange(0, COLS_PAD)
        # the element test as a partial tile of the mask path asks it (a window or chunk alone: its mask bundle)
        visible = kr._visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL, kr._PARTIAL, mask=mask)
        inside = (offs_q[:, None] < ROWS) & (offs_k[None, :] < COLS)
        tl.store(Mask + offs_q[:, None] * COLS + offs_k[None, :], visible.to(tl.int8), mask=inside)
        k_start, k_end = kr._key_range(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, mask)
        tl.store(KeyRange + i * 2, k_start)
        tl.store(KeyRange + i * 2 + 1, k_end)
    if i < TILES:
        q_start, q_end = kr._query_range(k0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL, mask)
        tl.store(QueryRange + i * 2, q_start)
        tl.store(QueryRange + i * 2 + 1, q_end)


def _triton_rule(seq_q, seq_k, block_q, block_k, causal, window, chunk=0):
    blocks, tiles = max(1, -(-seq_q // block_q)), max(1, -(-seq_k // block_k))
    mask = torch.zeros(max(seq_q, 1), max(seq_k, 1), dtype=torch.int8)
    key_range = torch.zeros(blocks, 2, dtype=torch.int32)
    query_range = torch.zeros(tiles, 2, dtype=torch.int32)
    bundle = kr.mask_bundle(Options.of(window=window, attention_chunk=chunk), always=True)  # as the launchers make it
    _rule_kernel[(max(blocks, tiles),)](mask, key_range, query_range, seq_q, seq_k, bundle, blocks, tiles,
                                       ROWS=max(seq_q, 1), COLS=max(seq_k, 1),
                                       COLS_PAD=triton.next_power_of_2(max(seq_k, 1)), BLOCK_Q=block_q,
                                       BLOCK_K=block_k, CAUSAL=causal)
    return mask[:seq_q, :seq_k].bool(), key_range.tolist(), query_range.tolist()


def _visited(start, end, block):
    """The tiles of [start, end) that a loop `for t0 in range(start, end, block)` visits."""
    return set(range(start // block, -(-end // block))) if end > start else set()


def _windows():
    side = st.one_of(st.just(-1), st.just(0), st.integers(0, 40), st.integers(2**20, BIG), st.just(BIG))
    return st.tuples(side, side)


def _chunks():
    return st.one_of(st.just(0), st.integers(1, 40), st.integers(2**20, BIG), st.just(BIG))


@settings(max_examples=40, deadline=None)
@given(seq_q=st.integers(1, 50), seq_k=st.integers(1, 50), block_q=st.sampled_from([1, 4, 16]),
       block_k=st.sampled_from([2, 8, 16]), causal=st.booleans(), window=_windows(), chunk=_chunks())
def test_the_triton_rule_is_the_pytorch_rule(seq_q, seq_k, block_q, block_k, causal, window, chunk):
    rule = rules.Visibility(causal, window, chunk=chunk)
    visible, key_range, query_range = _triton_rule(seq_q, seq_k, block_q, block_k, causal, window, chunk)
    rows, cols = torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :]
    expected = rule.pairs(rows, cols, seq_q, seq_k)
    expected = torch.ones(seq_q, seq_k, dtype=torch.bool) if expected is None else expected.expand(seq_q, seq_k)
    assert torch.equal(visible, expected), "element by element"
    # tile by tile: each query block visits exactly the key tiles with a visible pair, in both
    # languages; each key tile the query blocks with one
    for bq, (k_start, k_end) in enumerate(key_range):
        q0, q1 = bq * block_q, min(bq * block_q + block_q, seq_q)
        seen = {j // block_k for j in range(seq_k) if bool(expected[q0:q1, j].any())}
        assert _visited(k_start, k_end, block_k) == seen
        py_start = rules.key_range_start(q0, seq_q, seq_k, rule, block_k)
        py_end = rules.key_range_end(q0, q1, seq_q, seq_k, rule)
        assert _visited(py_start, py_end, block_k) == seen
    for bk, (q_start, q_end) in enumerate(query_range):
        k0, k1 = bk * block_k, min(bk * block_k + block_k, seq_k)
        seen = {i // block_q for i in range(seq_q) if bool(expected[i, k0:k1].any())}
        assert _visited(q_start, q_end, block_q) == seen
        assert _visited(*rules.query_range(k0, k1, seq_q, seq_k, rule, block_q), block_q) == seen


def test_an_unbounded_window_written_as_the_largest_int_is_no_window():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 16) for _ in range(3))
    for window in ((-1, BIG), (BIG, BIG), (BIG, -1)):
        out = attention(q, k, v, causal=True, window=window)
        torch.testing.assert_close(out, attention(q, k, v, causal=True), atol=1e-6, rtol=1e-6)
        out = attention(q, k, v, window=window)
        torch.testing.assert_close(out, attention(q, k, v), atol=1e-6, rtol=1e-6)


# ----- soft-capping ------------------------------------------------------------------------------

@triton.jit
def _softcap_kernel(X, Out, scale, qk_scale, score, N: tl.constexpr):
    offs = tl.arange(0, N)
    # soft-capping as the kernels compute it: the score function flashlib.scores.softcap, compiled
    capped = kr._mod_scores(tl.load(X + offs), scale, qk_scale, 0, 0, offs, offs, score)
    tl.store(Out + offs, capped)


CAPS = [1e-3, 1e-2, 0.3, 1.0, 30.0, 1e3, 1e5, 1e7]


@pytest.mark.parametrize("cap", CAPS)
def test_the_kernels_softcap_is_float32_rounding_from_float64(cap):
    torch.manual_seed(1)
    x = torch.cat([torch.randn(288) * 30, torch.logspace(-8, 3, 112), -torch.logspace(-8, 3, 112)]).float()
    scale = 0.125
    out = torch.empty(512)
    score = kernel_score(Options(softcap=cap), "cpu")
    _softcap_kernel[(1,)](x, out, scale, scale * math.log2(math.e), kr.score_bundle(score), N=512)
    exact = cap * torch.tanh(x.double() * scale / cap) * math.log2(math.e)
    ulp = torch.finfo(torch.float32).eps
    err = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-30))
    assert err.max().item() <= 8 * ulp, f"cap {cap}: relative error {err.max().item():.3g}"


def _loss_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cap", [1e-3, 1.0, 1e5, 1e7])
def test_softcapped_attention_forward_and_gradient_at_float32_rounding(cap):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 37, 16) * 3 for _ in range(3))
    exact = _loss_grads(lambda q, k, v: flashlib.dense_attention(q, k, v, causal=True, softcap=cap),
                        q.double(), k.double(), v.double())
    fp32 = _loss_grads(lambda q, k, v: flashlib.dense_attention(q, k, v, causal=True, softcap=cap), q, k, v)
    ours = _loss_grads(lambda q, k, v: attention(q, k, v, causal=True, softcap=cap), q, k, v)
    for name, e, p, o in zip(("out", "dq", "dk", "dv"), exact, fp32, ours):
        bound = 4 * (p.double() - e).abs().max().item() + 1e-6
        assert (o.double() - e).abs().max().item() <= bound, f"{name} at cap {cap}"


def test_a_cap_below_float32s_normal_numbers_is_refused():
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="argument 'softcap' is 1e-40, below float32's smallest normal"):
        attention(q, k, v, softcap=1e-40)
    with pytest.raises(ValueError, match="argument 'softcap'"):
        flashlib.dense_attention(q, k, v, softcap=1e-40)


def test_a_window_side_wider_than_int64_is_no_window():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    for window in ((2**70, 0), (2**64, 2**63)):
        causal = window[1] == 0
        want = flashlib.dense_attention(q, k, v, causal=causal)
        torch.testing.assert_close(flashlib.dense_attention(q, k, v, causal=causal, window=window), want)
        torch.testing.assert_close(flashlib.flash_attention(q, k, v, causal=causal, window=window), want,
                                   atol=1e-6, rtol=1e-6)
