"""Score functions (flashlib.scores, flashlib.kernels.scorefn): FlexAttention's ``score_mod`` in
flashlib's ops, forward and backward, with the gradients of the tensors they capture.

References nobody here wrote: ``flex_attention`` (forward, on the CPU) with the same function, and
float64 autograd through the plain formula softmax(score_mod(q kᵀ · scale) masked) v written in
this file, which also differentiates the captured tensors (ALiBi's slopes, a bias table, a
temperature). The kernels run in Triton's interpreter in float32."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import flashlib
from flashlib import scores
from flashlib.kernels import attention
from flashlib.kernels.scorefn import compile_score

B, H, H_KV, D = 2, 4, 2, 16


def _inputs(seq_q, seq_k, heads_kv=H_KV, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq_q, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, heads_kv, seq_k, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def plain_attention(q, k, v, score_mod, causal=False, window=None):
    """softmax(score_mod(scale q kᵀ)) v, every step written out in PyTorch (bottom-right causal)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    s = score_mod(s, b, h, i, j)
    diag = i + k.shape[-2] - q.shape[-2]
    keep = torch.ones_like(s, dtype=torch.bool)
    if causal:
        keep = keep & (j <= diag)
    if window is not None:
        keep = keep & (j >= diag - window[0]) & (j <= diag + window[1])
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def _captured(name, dtype=torch.float64, seed=3):
    """(score function, the tensor it captures or None), a fresh learnable tensor each call."""
    g = torch.Generator().manual_seed(seed)
    if name == "softcap":
        return scores.softcap(2.0), None
    if name == "alibi":
        t = scores.alibi_slopes(H).to(dtype).requires_grad_()
        return scores.alibi(t), t
    if name == "bias":
        t = (torch.randn(2 * 48 - 1, generator=g) * 0.5).to(dtype).requires_grad_()
        return scores.relative_bias(t), t
    if name == "temperature":
        t = (torch.rand(H, generator=g) + 0.5).to(dtype).requires_grad_()
        return scores.temperature(t), t
    raise KeyError(name)


SCORES = ["softcap", "alibi", "bias", "temperature"]


# ----- forward: the same function in flex_attention ------------------------------------------------

def _flex(q, k, v, score_mod, causal):
    mask = None
    if causal:
        offset = k.shape[-2] - q.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: j <= i + offset, B, H, q.shape[-2], k.shape[-2], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True))
    return out, aux.lse


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_equals_flex_attention_with_the_same_function(name, causal):
    q, k, v = _inputs(40, 40, dtype=torch.float32)
    fn, _ = _captured(name, torch.float32)
    want, want_lse = _flex(q, k, v, fn, causal)
    kernel, kernel_lse = attention(q, k, v, causal=causal, score_mod=fn, return_lse=True)
    dense = flashlib.dense_attention(q, k, v, causal=causal, score_mod=fn)
    public = flashlib.flash_attention(q, k, v, causal=causal, score_mod=fn)
    for what, got in (("kernels", kernel), ("dense", dense), ("flash_attention", public)):
        torch.testing.assert_close(got, want, atol=3e-6, rtol=3e-5, msg=lambda m: f"{name} {what}: {m}")
    torch.testing.assert_close(kernel_lse, want_lse, atol=3e-5, rtol=3e-6)


def test_a_function_written_over_lines_with_a_helper_runs_in_flex_and_the_kernels():
    slopes = scores.alibi_slopes(H)

    def distance(a, c):
        return (a - c).abs()

    def penalised(score, b, h, q_idx, kv_idx):
        bonus = torch.where(kv_idx < 4,
                            1.5,
                            0.0)  # the first keys as sinks of a sort
        return (score
                - slopes[h] * distance(q_idx, kv_idx)
                + bonus)

    q, k, v = _inputs(33, 47, dtype=torch.float32, seed=5)
    want, _ = _flex(q, k, v, penalised, causal=True)
    torch.testing.assert_close(flashlib.flash_attention(q, k, v, causal=True, score_mod=penalised), want,
                               atol=3e-6, rtol=3e-5)


# ----- forward and backward: float64 autograd of the plain formula ---------------------------------

CASES = [  # (seq_q, seq_k, kv heads, options)
    (40, 40, H_KV, dict(causal=True)),
    (33, 48, H, dict()),
    (48, 29, 1, dict(causal=True)),
    (41, 41, H_KV, dict(causal=True, window=(9, 0))),
]


# every (case, function) pair once, the two ops alternating so that each meets every case and every
# function twice (the public op runs the same kernels as flashlib.kernels.attention, inside its custom op)
GRADIENT_CASES = [(op, case, name) for i, case in enumerate(CASES) for j, name in enumerate(SCORES)
                  for op in [("flash_attention", "kernels.attention")[(i + j) % 2]]]


@pytest.mark.parametrize("op, case, name", GRADIENT_CASES,
                         ids=lambda c: c if isinstance(c, str) else f"{c[0]}x{c[1]}-kv{c[2]}-{'-'.join(c[3]) or 'full'}")
def test_gradients_equal_float64_autograd_captured_tensors_included(op, case, name):
    seq_q, seq_k, heads_kv, options = case
    q, k, v = _inputs(seq_q, seq_k, heads_kv, seed=seq_q)
    fn64, t64 = _captured(name)
    wanted = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())] + ([t64] if t64 is not None else [])
    ref = plain_attention(*wanted[:3], fn64, **options)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = torch.autograd.grad((ref * dout).sum(), wanted)

    fn32, t32 = _captured(name, torch.float32)
    ours = [x.float().requires_grad_() for x in (q, k, v)] + ([t32] if t32 is not None else [])
    run = flashlib.flash_attention if op == "flash_attention" else attention
    out = run(*ours[:3], score_mod=fn32, **options)
    got = torch.autograd.grad((out * dout.float()).sum(), ours)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    for what, g, w in zip(("dq", "dk", "dv", name), got, want):
        scale = w.abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= 2e-6 * max(scale, 1.0), f"{what}: max error {err:.3g} (largest gradient {scale:.3g})"


def test_captured_tensors_gradients_are_the_same_bits_every_run():
    q, k, v = (x.float().requires_grad_() for x in _inputs(37, 37))
    runs = []
    for _ in range(2):
        fn, t = _captured("bias", torch.float32)
        out = flashlib.flash_attention(q, k, v, causal=True, score_mod=fn)
        runs.append(torch.autograd.grad(out.square().sum(), [q, k, v, t]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_softcap_keyword_is_the_softcap_score_function():
    q, k, v = (x.float() for x in _inputs(45, 45, seed=2))
    by_keyword = attention(q * 8, k, v, causal=True, softcap=3.0, return_lse=True)
    by_function = attention(q * 8, k, v, causal=True, score_mod=scores.softcap(3.0), return_lse=True)
    for a, b in zip(by_keyword, by_function):
        assert torch.equal(a, b)


# sha256 (first 16 hex digits) of out, dq, dk, dv bytes from the soft-capping kernel written by hand
# before score functions (commit 7770526, flashlib/kernels/rules.py::_softcap and _softcap_slope), run
# in Triton's interpreter with today's arithmetic (kernels/_mode.py); inputs as _softcap_bits makes them
HAND_WRITTEN_SOFTCAP = {0.001: "529a91c8cde37c21", 1.0: "4a29f28dcb8b477f", 30.0: "cf800ef3f3a605cf",
                        1e7: "f0498b198e8dfeaa"}


@pytest.mark.parametrize("cap", sorted(HAND_WRITTEN_SOFTCAP))
def test_softcap_gives_the_bits_of_the_hand_written_kernel(cap):
    """softcap= (the score function c * tanh(score / c), compiled) computes what the hand-written kernel
    did, rounding for rounding: tanh's argument x * (qk_scale / (c log2 e)), its result times c log2 e,
    and the backward's slope 1 - (s / (c log2 e))², forward and backward, saturated (0.001, 1) and not."""
    import hashlib

    from flashlib.kernels.function import backward_base2, forward_base2

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(4))
    q = q * 3  # scores reach the cap
    out, lse2 = forward_base2(q, k, v, causal=True, softcap=cap)
    grads = backward_base2(q, k, v, out, lse2.float(), dout, causal=True, softcap=cap)[:3]
    digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in (out, *grads))).hexdigest()[:16]
    assert digest == HAND_WRITTEN_SOFTCAP[cap]


def test_numbers_around_a_function_are_folded_and_passed_at_launch():
    """a * f(score / b): a and b leave the source for the data (one kernel for every cap), the scale
    moves into f's argument, log2 e into a; other shapes keep score = x * scale."""
    caps = [compile_score("t", scores.softcap(c), "cpu") for c in (2.0, 50.0)]
    assert caps[0].jit is caps[1].jit and caps[0].source == caps[1].source
    assert caps[0].data == (2.0,) and caps[1].data == (50.0,)
    assert "score = x * scale" not in caps[0].source and "_tanh((x * " in caps[0].source
    two = compile_score("t", lambda score, b, h, q_idx, kv_idx: 5 * torch.sigmoid(score / 4), "cpu")
    assert two.data == (5.0, 4.0)
    alibi = compile_score("t", _captured("alibi", torch.float32)[0], "cpu")
    assert "score = x * scale" in alibi.source and len(alibi.data) == 1


@pytest.mark.parametrize("fn", [lambda score, b, h, q_idx, kv_idx: 5 * torch.sigmoid(score / 4),
                                lambda score, b, h, q_idx, kv_idx: torch.tanh(score / 0.5) * 3,
                                lambda score, b, h, q_idx, kv_idx: 2 * torch.exp(score / 8)],
                         ids=["sigmoid", "tanh-a-ne-b", "exp"])
def test_folded_functions_equal_float64_autograd(fn):
    q, k, v = _inputs(33, 33, seed=4)
    wanted = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = plain_attention(*wanted, fn, causal=True)
    want = torch.autograd.grad(ref.square().sum(), wanted)
    ours = [x.float().requires_grad_() for x in (q, k, v)]
    out = attention(*ours, causal=True, score_mod=fn)
    got = torch.autograd.grad(out.square().sum(), ours)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=5e-6, rtol=1e-4)


def test_the_derivative_is_the_chain_rule_through_what_the_function_does():
    """A function mixing where, maximum, exp, log, sigmoid and a division: the kernels' backward
    against float64 autograd of the same function (the derivative was derived, never written)."""
    def odd(score, b, h, q_idx, kv_idx):
        # log's argument kept positive on both sides of the where (both are computed): no NaN thrown away
        bent = torch.where(score > 0, torch.log(1.0 + score.abs()), -torch.sigmoid(-score))
        return torch.maximum(bent, score / 3.0) + torch.exp(-0.1 * (q_idx - kv_idx).abs()) * (h + 1) / 4

    q, k, v = _inputs(36, 36, seed=9)
    wanted = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = plain_attention(*wanted, odd, causal=True)
    want = torch.autograd.grad(ref.square().sum(), wanted)
    ours = [x.float().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(attention(*ours, causal=True, score_mod=odd).square().sum(), ours)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=5e-6, rtol=1e-4)
    source = compile_score("t", odd, "cpu").source
    assert "if GRAD:" in source and "tl.log" in source and "tl.exp" in source


def test_dense_reference_takes_a_score_function_with_autograd():
    q, k, v = _inputs(30, 30)
    fn, t = _captured("alibi")
    out = flashlib.dense_attention(q, k, v, causal=True, score_mod=fn)
    want = plain_attention(q, k, v, fn, causal=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), [t])
    assert grad.abs().max() > 0


# ----- bad input: named ---------------------------------------------------------------------------

def test_bad_score_functions_are_refused_by_name():
    q, k, v = (x.float() for x in _inputs(16, 16))
    with pytest.raises(TypeError, match="'score_mod' must be None or a function"):
        flashlib.flash_attention(q, k, v, score_mod=3.0)
    with pytest.raises(TypeError, match="five arguments"):
        flashlib.flash_attention(q, k, v, score_mod=lambda s, b, h, i: s)
    with pytest.raises(ValueError, match="'softcap' and 'score_mod'"):
        flashlib.flash_attention(q, k, v, softcap=2.0, score_mod=scores.softcap(2.0))
    with pytest.raises(TypeError, match="'score_mod'.*returns bool"):
        attention(q, k, v, score_mod=lambda s, b, h, i, j: i >= j)
    with pytest.raises(TypeError, match="'score_mod'.*truth value"):
        attention(q, k, v, score_mod=lambda s, b, h, i, j: s if i > j else -s)
    with pytest.raises(TypeError, match="'score_mod'.*Python number"):
        import math

        attention(q, k, v, score_mod=lambda s, b, h, i, j: math.tanh(s))
    with pytest.raises(ValueError, match="'cap'"):
        scores.softcap(0.0)
    with pytest.raises(TypeError, match="'slopes'"):
        scores.alibi([0.5, 0.25])


# ----- packed sequences and decoding: positions within each sequence ---------------------------------

def test_packed_sequences_take_score_functions_with_positions_within_each_sequence():
    """flash_attention_varlen against each sequence computed alone by plain float64 attention, with
    ALiBi (positions must be the sequence's own) and a bias indexed by the sequence (b)."""
    lengths = [13, 0, 29, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    total = sum(lengths)
    q, k, v = (torch.randn(total, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    slopes64 = scores.alibi_slopes(H).double().requires_grad_()
    per_seq64 = torch.randn(len(lengths), generator=g, dtype=torch.float64).requires_grad_()

    def make(slopes, per_seq):
        def fn(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) + per_seq[b] * (kv_idx == 0)
        return fn

    wanted = [x.clone().requires_grad_() for x in (q, k, v)] + [slopes64, per_seq64]
    outs = []
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        seq = [t[a:a + n].transpose(0, 1)[None] for t in wanted[:3]]
        one = make(slopes64, per_seq64)
        outs.append(plain_attention(*seq, lambda s, _, h, i, j, b=b, one=one: one(s, b, h, i, j),
                                    causal=True)[0].transpose(0, 1))
    ref = torch.cat(outs)
    want = torch.autograd.grad(ref.square().sum(), wanted)
    ours = [x.float().requires_grad_() for x in (q, k, v)] + [slopes64.detach().float().requires_grad_(),
                                                              per_seq64.detach().float().requires_grad_()]
    out = flashlib.flash_attention_varlen(*ours[:3], cu, cu, max(lengths), max(lengths), causal=True,
                                          score_mod=make(ours[3], ours[4]))
    got = torch.autograd.grad(out.square().sum(), ours)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.double(), w, atol=5e-6, rtol=1e-4)
    reference = flashlib.varlen_reference(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                          score_mod=make(slopes64, per_seq64))
    torch.testing.assert_close(reference, ref, atol=1e-12, rtol=1e-12)


def test_decoding_tells_a_score_function_each_new_tokens_position_in_its_sequence():
    """decode_attention with ALiBi equals the prefill's last rows: q_idx is a position in the sequence."""
    g = torch.Generator().manual_seed(4)
    batch, capacity, new = 2, 40, 3
    lengths = torch.tensor([40, 23], dtype=torch.int32)
    q = torch.randn(batch, H, new, D, generator=g)
    k, v = (torch.randn(batch, H_KV, capacity, D, generator=g) for _ in range(2))
    fn = scores.alibi(scores.alibi_slopes(H))
    out = flashlib.decode_attention(q, k, v, lengths, score_mod=fn)
    for b, n in enumerate(lengths.tolist()):
        want = plain_attention(q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(), fn,
                               causal=True)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-6, rtol=1e-5)
    reference = flashlib.decode_reference(q.double(), k.double(), v.double(), lengths, score_mod=fn)
    torch.testing.assert_close(out.double(), reference, atol=2e-6, rtol=1e-5)


def test_tiled_reference_takes_score_functions_with_captured_gradients():
    q, k, v = _inputs(37, 37, seed=6)
    fn, t = _captured("bias")
    wanted = [x.clone().requires_grad_() for x in (q, k, v)] + [t]
    want = torch.autograd.grad(plain_attention(*wanted[:3], fn, causal=True).square().sum(), wanted)
    fn2, t2 = _captured("bias")
    ours = [x.clone().requires_grad_() for x in (q, k, v)] + [t2]
    for loop in ("query", "key"):
        out = flashlib.tiled_attention(*ours[:3], block_q=8, block_k=16, causal=True, loop=loop, score_mod=fn2)
        got = torch.autograd.grad(out.square().sum(), ours)
        for g_, w in zip(got, want):
            torch.testing.assert_close(g_, w, atol=1e-11, rtol=1e-10)


# ----- ring attention: global positions on every rank ------------------------------------------------

RING_SEQ = 16


def _ring_inputs():
    g = torch.Generator().manual_seed(21)
    q, k, v, dout = (torch.randn(1, 2, RING_SEQ, 8, generator=g, dtype=torch.float64) for _ in range(4))
    table = (torch.randn(2 * RING_SEQ - 1, generator=g, dtype=torch.float64) * 0.5)
    return q, k, v, dout, table


@pytest.fixture(scope="module")
def ring_ranks():
    """Every ring case of this file on one ring of two processes (each start costs seconds)."""
    from flashlib import distributed as fd

    from .ring_workers import score_rings

    return fd.spawn(score_rings, 2, args=_ring_inputs(), timeout=120)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_tells_score_functions_global_positions(layout, ring_ranks):
    from flashlib import distributed as fd

    ranks = [r[layout] for r in ring_ranks]
    q, k, v, dout, table = _ring_inputs()
    wanted = [x.clone().requires_grad_() for x in (q, k, v, table)]
    ref = plain_attention(*wanted[:3], scores.relative_bias(wanted[3]), causal=True)
    want = torch.autograd.grad((ref * dout).sum(), wanted)
    torch.testing.assert_close(fd.unshard([r[0] for r in ranks], layout=layout), ref, atol=1e-12, rtol=0)
    for i in range(3):
        torch.testing.assert_close(fd.unshard([r[1][i] for r in ranks], layout=layout), want[i], atol=1e-12, rtol=0)
    # each rank's share of the table's gradient; a replicated parameter's shares add up
    torch.testing.assert_close(sum(r[2] for r in ranks), want[3], atol=1e-12, rtol=0)


def test_ring_attention_takes_softcap_as_every_op_does(ring_ranks):
    """softcap= on a ring of two processes: float64 autograd of soft-capped dense attention (scores
    up to 6 x 6 x 8 / sqrt(8), well past the cap)."""
    from flashlib import distributed as fd

    ranks = [r["softcap"] for r in ring_ranks]
    q, k, v, dout, _ = _ring_inputs()
    wanted = [(x * 6).requires_grad_() for x in (q, k, v)]
    ref = flashlib.dense_attention(*wanted, causal=True, softcap=2.0)
    want = torch.autograd.grad((ref * dout).sum(), wanted)
    torch.testing.assert_close(fd.unshard([r[0] for r in ranks]), ref, atol=1e-12, rtol=0)
    for i in range(3):
        torch.testing.assert_close(fd.unshard([r[1][i] for r in ranks]), want[i], atol=1e-12, rtol=0)


# ----- a new option is one function: ALiBi as a user would add it -------------------------------

def test_a_users_own_alibi_is_one_function_that_every_op_takes_unchanged():
    """Issue 32's measure: ALiBi written here, in the test, as a user would (flashlib.scores is not
    asked), runs in the reference, the teaching kernels, packed sequences and decoding, forward and
    (where there is one) backward with its slopes' gradient, against flex_attention and float64
    autograd of the plain formula; no signature anywhere needed a new argument."""
    def my_alibi(slopes):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        return score_mod

    q, k, v = _inputs(24, 24)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    want = plain_attention(q, k, v, my_alibi(slopes), causal=True)
    (want_grad,) = torch.autograd.grad(want.sum(), slopes)
    flex_out, _ = _flex(q, k, v, my_alibi(slopes.detach()), causal=True)
    torch.testing.assert_close(flex_out, want, rtol=0, atol=1e-12)
    theirs = slopes.detach().float().requires_grad_()
    out = flashlib.flash_attention(q.float(), k.float(), v.float(), causal=True, score_mod=my_alibi(theirs))
    (grad,) = torch.autograd.grad(out.sum(), theirs)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=2e-6, atol=1e-6)  # sums of ~500 float32 terms
    tiled = flashlib.tiled_attention(q, k, v, causal=True, score_mod=my_alibi(slopes.detach()), block_q=8, block_k=8)
    torch.testing.assert_close(tiled, want.detach(), rtol=0, atol=1e-12)
    # packed: the two batch rows as two sequences, positions within each
    packed = [t.float().transpose(1, 2).reshape(-1, t.shape[1], D) for t in (q, k, v)]
    cu = torch.tensor([0, 24, 48], dtype=torch.int32)
    out = flashlib.flash_attention_varlen(*packed, cu, cu, 24, 24, causal=True, score_mod=my_alibi(theirs.detach()))
    torch.testing.assert_close(out.reshape(B, 24, H, D).transpose(1, 2).double(), want.detach(), rtol=0, atol=2e-6)
    # decoding the last 3 tokens over the whole cache: their rows of the full attention
    with torch.no_grad():
        last = flashlib.decode_attention(q[:, :, -3:].float(), k.float(), v.float(), torch.full((B,), 24, dtype=torch.int32),
                                         score_mod=my_alibi(theirs.detach()))
    torch.testing.assert_close(last.double(), want.detach()[:, :, -3:], rtol=0, atol=2e-6)


# ----- subgradients at kinks: PyTorch's ------------------------------------------------------------

KINKED = {  # each meets a kink on the zero query row (every score 0) and on ties between its two sides
    "abs": lambda s, b, h, q_idx, kv_idx: torch.abs(s),
    "maximum": lambda s, b, h, q_idx, kv_idx: torch.maximum(s, torch.zeros_like(s)),
    "minimum": lambda s, b, h, q_idx, kv_idx: torch.minimum(s, s * 0.0),
    "max of two": lambda s, b, h, q_idx, kv_idx: torch.max(s, -s),
    "clamp": lambda s, b, h, q_idx, kv_idx: s.clamp(min=0.0, max=0.5),
}


@pytest.mark.parametrize("name", KINKED)
def test_kinks_take_pytorchs_subgradients(name):
    """abs' slope at 0 is 0; maximum and minimum give each side half on a tie; clamp passes the slope at
    its bounds: the kernels' gradients equal float64 autograd's on a query row of zeros (all scores 0)."""
    fn = KINKED[name]
    q, k, v = _inputs(24, 24, seed=9)
    q[:, :, 5] = 0.0
    wanted = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(plain_attention(*wanted, fn).sum(), wanted)
    ours = [x.float().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(flashlib.flash_attention(*ours, score_mod=fn).sum(), ours)
    tiled = torch.autograd.grad(flashlib.tiled_attention(*wanted, score_mod=fn).sum(), wanted)
    for what, g, t, w in zip(("dq", "dk", "dv"), got, tiled, want):
        torch.testing.assert_close(g.double(), w, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name} {what}: {m}")
        torch.testing.assert_close(t, w, atol=1e-12, rtol=1e-10, msg=lambda m: f"{name} tiled {what}: {m}")


def test_a_power_of_zero_is_a_one_of_the_scores_dtype():
    q, k, v = (x.float() for x in _inputs(16, 16))
    for fn in (lambda s, b, h, q_idx, kv_idx: s ** 0, lambda s, b, h, q_idx, kv_idx: s ** 0 + s ** 2):
        torch.testing.assert_close(flashlib.flash_attention(q, k, v, score_mod=fn),
                                   plain_attention(q.double(), k.double(), v.double(), fn).float(), atol=2e-6,
                                   rtol=1e-5)


# ----- T5's relative position bias -----------------------------------------------------------------

def test_t5_buckets_are_transformers_own():
    from transformers.models.t5.modeling_t5 import T5Attention

    distances = torch.arange(-2000, 2001)
    for buckets, reach, both in ((32, 128, True), (32, 128, False), (64, 1000, True), (8, 20, True)):
        assert torch.equal(scores.t5_bucket(distances, num_buckets=buckets, max_distance=reach, bidirectional=both),
                           T5Attention._relative_position_bucket(distances, both, buckets, reach))


def _t5_plain(table, buckets, reach, both):
    """T5's bias as transformers computes it: a (q, k) bucket matrix, then the table's rows."""
    from transformers.models.t5.modeling_t5 import T5Attention

    def t5(score, b, h, q_idx, kv_idx):
        bucket = T5Attention._relative_position_bucket(kv_idx - q_idx, both, buckets, reach)
        return score + table[bucket, h]

    return t5


@pytest.mark.parametrize("both", [True, False])
def test_t5_relative_bias_equals_its_definition_in_float64_forward_and_backward(both):
    """flashlib.scores.t5_relative_bias against T5's own bucket function in float64 autograd, the table's
    gradient included, over distances past max_distance (90 positions, max_distance 40)."""
    q, k, v = _inputs(90, 90, seed=11)
    g = torch.Generator().manual_seed(12)
    table64 = torch.randn(16, H, generator=g, dtype=torch.float64).requires_grad_()
    dout = torch.randn(B, H, 90, D, generator=g, dtype=torch.float64)
    wanted = [x.clone().requires_grad_() for x in (q, k, v)] + [table64]
    ref = plain_attention(*wanted[:3], _t5_plain(table64, 16, 40, both), causal=not both)
    want = torch.autograd.grad((ref * dout).sum(), wanted)
    table = table64.detach().float().requires_grad_()
    ours = [x.float().requires_grad_() for x in (q, k, v)] + [table]
    fn = scores.t5_relative_bias(table, max_distance=40, bidirectional=both)
    out = flashlib.flash_attention(*ours[:3], score_mod=fn, causal=not both)
    got = torch.autograd.grad((out * dout.float()).sum(), ours)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    for what, gr, w in zip(("dq", "dk", "dv", "table"), got, want):
        torch.testing.assert_close(gr.double(), w, atol=2e-6 * max(w.abs().max().item(), 1.0), rtol=1e-5,
                                   msg=lambda m: f"{what}: {m}")


def test_t5_written_as_transformers_writes_it_compiles():
    """T5's bucket function itself (log of the distance, scaled, cast to an integer, clamped) inside a
    score function: the cast's integer has its dtype's range, which torch.where and the clamp narrow;
    the kernels compute its buckets in float32 as transformers does."""
    q, k, v = (x.float() for x in _inputs(200, 200, seed=13))
    table = torch.randn(32, H)
    fn = _t5_plain(table, 32, 128, True)
    torch.testing.assert_close(flashlib.flash_attention(q, k, v, score_mod=fn),
                               plain_attention(q.double(), k.double(), v.double(), fn).float(), atol=2e-6, rtol=1e-5)


def test_t5_relative_bias_refuses_a_table_of_another_shape():
    with pytest.raises(ValueError, match="'num_buckets' is 32 but 'table' has 16 rows"):
        scores.t5_relative_bias(torch.zeros(16, 4), num_buckets=32)
    with pytest.raises(TypeError, match="'table' must be a 2-d floating-point tensor"):
        scores.t5_relative_bias(torch.zeros(32))
    with pytest.raises(ValueError, match="max_distance > 8"):
        scores.t5_relative_bias(torch.zeros(32, 2), max_distance=8)


# ----- a captured tensor indexed past its end: refused where every reference refuses ------------------

def _ops(q, k, v, fn):
    """Each op that takes a score function, on the same (1, H, n, D) problem: packed as one sequence, and
    decoding the last 3 queries against the cache of all n keys."""
    n = q.shape[-2]
    cu = torch.tensor([0, n], dtype=torch.int32)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    return {
        "flash_attention": lambda: flashlib.flash_attention(q, k, v, score_mod=fn),
        "flashlib.kernels.attention": lambda: attention(q, k, v, score_mod=fn),
        "flash_attention_varlen": lambda: flashlib.flash_attention_varlen(*packed, cu, cu, n, n, score_mod=fn),
        "decode_attention": lambda: flashlib.decode_attention(q[..., -3:, :], k, v, torch.tensor([n], dtype=torch.int32),
                                                              score_mod=fn),
        "dense_attention": lambda: flashlib.dense_attention(q, k, v, score_mod=fn),
        "tiled_attention": lambda: flashlib.tiled_attention(q, k, v, score_mod=fn),
        "flex_attention": lambda: flex_attention(q, k, v, score_mod=fn),
    }


@pytest.mark.parametrize("op", ["flash_attention", "flashlib.kernels.attention", "flash_attention_varlen",
                                "decode_attention", "dense_attention", "tiled_attention"])
def test_a_bias_table_built_for_shorter_sequences_is_refused_by_every_op(op):
    """relative_bias of a table for 20 positions (39 distances) on 30: flex_attention raises (IndexError),
    and every op raises the ValueError a mask function gets, naming the op (the kernels), the function
    and the index; a table that covers the distances runs."""
    q, k, v = (x[:1].float() for x in _inputs(30, 30, heads_kv=H, seed=14))
    short = scores.relative_bias(torch.randn(39))
    with pytest.raises(IndexError):
        _ops(q, k, v, short)["flex_attention"]()
    with pytest.raises(ValueError) as info:
        _ops(q, k, v, short)[op]()
    message = str(info.value)
    assert "argument 'score_mod': relative_bias_score indexes a tensor out of its bounds" in message, message
    assert "must cover every index it is given" in message and (op.endswith("_attention") and "kernels" not in op
                                                                 and op not in ("dense_attention", "tiled_attention")
                                                                 ) <= message.startswith(op + ": ")
    _ops(q, k, v, scores.relative_bias(torch.randn(59)))[op]()


@pytest.mark.parametrize("op", ["flash_attention", "flashlib.kernels.attention", "flash_attention_varlen",
                                "decode_attention", "decode_reference", "dense_attention", "tiled_attention"])
def test_a_float64_result_is_cast_to_the_scores_dtype_in_every_op(op):
    """A bias table from torch.from_numpy is float64; on float32 inputs every op casts the function's result to
    the scores' dtype, as flex_attention does, and gives its answer (and float64 attention's) in float32."""
    q, k, v = (x[:1].float() for x in _inputs(24, 24, heads_kv=H, seed=21))
    table = torch.from_numpy(np.random.default_rng(0).standard_normal((24, 24)))

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx]

    ops = _ops(q, k, v, biased)
    for name, run in (("decode_attention", flashlib.decode_attention), ("decode_reference", flashlib.decode_reference)):
        ops[name] = lambda run=run: run(q[..., -3:, :], k, v, torch.tensor([24], dtype=torch.int32), causal=False,
                                        score_mod=biased)
    want = ops["flex_attention"]()
    exact = plain_attention(q.double(), k.double(), v.double(), biased)
    got = ops[op]()
    if op == "flash_attention_varlen":  # packed (total, heads, d)
        got = got.transpose(0, 1)[None]
    if op.startswith("decode"):  # the last three queries, at positions 21..23, each seeing every key
        want, exact = want[..., -3:, :], exact[..., -3:, :]
    assert got.dtype == torch.float32 and want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-6, rtol=3e-5)
    torch.testing.assert_close(got.double(), exact, atol=3e-6, rtol=3e-5)


def test_a_negative_index_within_the_tensor_reads_from_its_end_as_pytorch_does():
    q, k, v = (x.float() for x in _inputs(20, 20, seed=15))
    table = torch.randn(20)
    fn = lambda s, b, h, q_idx, kv_idx: s + table[kv_idx - 19]  # -19 .. 0  # noqa: E731
    torch.testing.assert_close(flashlib.flash_attention(q, k, v, score_mod=fn),
                               plain_attention(q.double(), k.double(), v.double(), fn).float(), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="index -21 is out of bounds"):
        flashlib.flash_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[kv_idx - 21])


def test_decoding_checks_the_positions_each_sequence_has_not_the_caches_capacity():
    """A table covering the distances the sequences' real lengths give runs, though the cache could hold
    more; one too short for the longest sequence is refused, at that sequence."""
    g = torch.Generator().manual_seed(16)
    q = torch.randn(2, H, 1, D, generator=g)
    k, v = (torch.randn(2, H_KV, 64, D, generator=g) for _ in range(2))
    lengths = torch.tensor([20, 33], dtype=torch.int32)
    fits = scores.relative_bias(torch.randn(65))  # distances 0..32 from the center 32
    torch.testing.assert_close(flashlib.decode_attention(q, k, v, lengths, score_mod=fits),
                               flashlib.decode_reference(q, k, v, lengths, score_mod=fits), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"decode_attention: .*out of its bounds .* at b=1"):
        flashlib.decode_attention(q, k, v, lengths, score_mod=scores.relative_bias(torch.randn(61)))


def test_an_index_computed_from_the_score_must_be_clamped():
    q, k, v = (x.float() for x in _inputs(16, 16))
    table = torch.randn(8)
    with pytest.raises(ValueError, match="computed from the score.*clamp it into 0..7"):
        flashlib.flash_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[(s * 4).long()])
    clamped = lambda s, b, h, i, j: s + table[(s * 4).long().clamp(0, 7)]  # noqa: E731
    torch.testing.assert_close(flashlib.flash_attention(q, k, v, score_mod=clamped),
                               plain_attention(q.double(), k.double(), v.double(), clamped).float(),
                               atol=2e-6, rtol=1e-5)


@settings(max_examples=60)
@given(st.integers(-3, 3), st.integers(-3, 3), st.integers(-40, 40), st.integers(1, 50), st.sampled_from(
    ["affine", "mod", "where", "clamp", "nested"]), st.integers(1, 30), st.integers(1, 30))
def test_the_index_check_refuses_exactly_what_pytorch_refuses(a, c, shift, size, form, seq_q, seq_k):
    """For index expressions of many forms, IndexCheck finds an index outside the tensor exactly when
    PyTorch's indexing of the same function on every (q_idx, kv_idx) raises IndexError."""
    from flashlib.machinery.trace import IndexCheck, trace

    table = torch.arange(size)
    inner = torch.arange(size) - size // 2
    bodies = {"affine": lambda i, j: table[a * i + c * j + shift],
              "mod": lambda i, j: table[(a * i + c * j + shift) % 7],
              "where": lambda i, j: table[torch.where(i > j, i - j + shift, c * j)],
              "clamp": lambda i, j: table[(a * i - j).clamp(-size, size - 1 + shift)],
              "nested": lambda i, j: table[inner[(i + j) % size] + shift]}
    fn = lambda s, b, h, i, j: s + bodies[form](i, j)  # noqa: E731
    graph = trace(fn, {"score": (None, None), "b": (0, 0), "h": (0, 0), "q_idx": (0, seq_q - 1),
                       "kv_idx": (0, seq_k - 1)}, floats=("score",))
    found = IndexCheck(graph).outside({"b": (0, 0), "h": (0, 0), "q_idx": (0, seq_q - 1), "kv_idx": (0, seq_k - 1)},
                                      graph.tensors)
    try:
        fn(torch.zeros(seq_q, seq_k), 0, 0, torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :])
        raised = False
    except IndexError:
        raised = True
    assert (found is not None) == raised, (found, raised)


# ----- refusals name the op called, the function and the fix ---------------------------------------

def test_tiled_attention_takes_what_dense_attention_takes():
    """Functions the kernels cannot compile (a Python branch, a function outside the kernels' table, a
    captured tensor used whole) run in both references alike, the captured tensor's gradient included."""
    q, k, v = _inputs(20, 20, seed=17)
    bias = torch.randn(20, 20, dtype=torch.float64, requires_grad=True)
    for fn in (lambda s, b, h, i, j: torch.sin(s) if s.ndim else s,
               lambda s, b, h, i, j: s + torch.log1p(s.abs()),
               lambda s, b, h, i, j: s + torch.log1p(bias[i, j].abs())):
        dense = flashlib.dense_attention(q, k, v, score_mod=fn)
        tiled = flashlib.tiled_attention(q, k, v, score_mod=fn, block_q=8, block_k=8)
        torch.testing.assert_close(tiled, dense, atol=1e-12, rtol=1e-10)
    grads = [torch.autograd.grad(run(q, k, v, score_mod=fn).sum(), bias)[0]
             for run in (flashlib.dense_attention, flashlib.tiled_attention)]
    torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=1e-10)


def test_refusals_name_the_op_called_and_the_function():
    q, k, v = (x.float() for x in _inputs(16, 16))
    cache = torch.tensor([16, 16], dtype=torch.int32)

    def integer_score(score, b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def branching(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score

    for run, op in ((lambda fn: flashlib.decode_attention(q[..., :1, :], k, v, cache, score_mod=fn), "decode_attention"),
                    (lambda fn: flashlib.flash_attention(q, k, v, score_mod=fn), "flash_attention"),
                    (lambda fn: attention(q, k, v, score_mod=fn), "flashlib.kernels.attention")):
        with pytest.raises(TypeError, match=rf"^{op}: argument 'score_mod': .*returns int64 values \(in "
                                            r"integer_score\) cannot be compiled into the kernels; return a float"):
            run(integer_score)
        with pytest.raises(TypeError, match=rf"^{op}: argument 'score_mod': .*truth value.*\(in branching, line \d+"):
            run(branching)

    def on_the_score(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return score / 2

    def overlapping(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx and q_idx < kv_idx + 3

    for function, argument in ((branching, "score_mod"), (on_the_score, "score_mod"), (overlapping, "mask_mod")):
        with pytest.raises(TypeError) as kernels:
            attention(q, k, v, **{argument: function})
        for run in (flashlib.dense_attention, flashlib.tiled_attention):  # the references, in the same words
            with pytest.raises(TypeError) as reference:
                run(q, k, v, **{argument: function})
            assert f"flashlib.kernels.attention: {reference.value}" == str(kernels.value)
            assert f"argument '{argument}': a Python truth value" in str(reference.value)
            assert f"(in {function.__name__}, line" in str(reference.value) and "torch.where" in str(reference.value)
    with pytest.raises(TypeError, match=r"^flash_attention: argument 'mask_mod': .*truth value.*\(in <lambda>"):
        flashlib.flash_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j and i < j + 3)
