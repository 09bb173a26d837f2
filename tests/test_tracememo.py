"""The memo of traced mask and score functions: a second call with nothing changed traces nothing, any
change to what the function reads traces again (and the kernels then agree with flex_attention and
dense attention on the function as it is now), and the memo keeps no tensor alive."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import flashlib
from flashlib import masks, scores
from flashlib.kernels import attention, function, maskfn, scorefn, tracememo
from flashlib.kernels.maskfn import compile_mask, symbol_bounds
from flashlib.kernels.scorefn import compile_score, score_bounds

from .test_flex import _flex, _inputs


@pytest.fixture
def traces(monkeypatch):
    """How many times the mask and score functions were traced, from here on."""
    count = {"mask": 0, "score": 0, "block mask": 0}

    def counting(kind, real):
        def traced(*args, **kwargs):
            count[kind] += 1
            return real(*args, **kwargs)
        return traced

    monkeypatch.setattr(maskfn, "trace", counting("mask", maskfn.trace))
    monkeypatch.setattr(scorefn, "trace_score", counting("score", scorefn.trace_score))
    monkeypatch.setattr(function, "block_mask", counting("block mask", function.block_mask))
    tracememo.clear_all()
    return count


def test_the_same_function_is_traced_once(traces):
    first = compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 64))
    again = compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 64))  # a new closure, same reads
    assert traces["score"] == 1 and again.jit is first.jit and again.data == first.data
    compile_score("t", scores.softcap(31.0), "cpu", score_bounds(1, 2, 64, 64))
    compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 4096))  # other bounds
    assert traces["score"] == 3
    for _ in range(2):
        compile_mask("t", masks.sliding_window(8), "cpu", symbol_bounds(1, 2, 64, 64))
    assert traces["mask"] == 1


def test_a_captured_tensor_changed_in_place_is_traced_again(traces):
    slopes = scores.alibi_slopes(4)
    alibi = scores.alibi(slopes)
    first = compile_score("t", alibi, "cpu")
    assert compile_score("t", alibi, "cpu").captured[0] is slopes and traces["score"] == 1
    slopes.mul_(2)  # a new version: the trace may read values (an integer tensor's bounds)
    compile_score("t", alibi, "cpu")
    assert traces["score"] == 2 and first.data[0] is not None


def test_the_kernels_follow_every_change_of_what_a_function_reads(traces):
    q, k, v = _inputs(40, 40)
    width = 3

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    document_id = torch.arange(40) // 7
    doc = masks.document(document_id)
    for step in range(3):
        for mask_mod in (near, doc):
            torch.testing.assert_close(attention(q, k, v, mask_mod=mask_mod), _flex(q, k, v, mask_mod)[0],
                                       atol=2e-6, rtol=2e-5, msg=lambda m: f"step {step}: {m}")
        width += 4  # a closure's number rebound
        document_id.copy_(torch.arange(40) // (5 + 6 * step) + 2**40 * step)  # values past int32: new bounds
    assert traces["mask"] == 6 and traces["block mask"] == 6


def test_a_mask_functions_block_mask_is_evaluated_once(traces):
    q, k, v = _inputs(64, 64)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    for _ in range(3):
        attention(q, k, v, mask_mod=masks.sliding_window(9)).sum().backward()
    assert traces["block mask"] == 1 and traces["mask"] == 1  # the backward tiles as the forward does here


class Window:
    """A mask function read through an object's attribute: such a read cannot be keyed."""

    def __init__(self, size):
        self.size = size

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.size)


def test_what_cannot_be_keyed_is_traced_at_every_call(traces):
    q, k, v = _inputs(40, 40)
    window = Window(2)
    attribute = lambda b, h, q_idx, kv_idx: window(b, h, q_idx, kv_idx)  # noqa: E731
    assert tracememo.reads(window) is None and tracememo.reads(attribute) is None
    for size in (2, 9):
        window.size = size
        torch.testing.assert_close(attention(q, k, v, mask_mod=attribute), _flex(q, k, v, attribute)[0],
                                   atol=2e-6, rtol=2e-5)
    with torch.inference_mode():
        ids = torch.arange(40) // 9  # an inference tensor keeps no version
    assert tracememo.reads(masks.document(ids)) is None
    assert traces["mask"] >= 2


def test_the_memo_keeps_no_tensor_alive(traces):
    ids = torch.arange(4096) // 100
    table = torch.randn(2 * 64 - 1)
    compile_mask("t", masks.document(ids), "cpu")
    compile_score("t", scores.relative_bias(table), "cpu", score_bounds(1, 1, 64, 64))
    alive = [weakref.ref(ids), weakref.ref(table)]
    del ids, table
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_a_new_tensor_at_a_dead_ones_address_is_traced_again(monkeypatch):
    """The key holds a tensor's id; if it died and a new tensor took its address, the weak reference
    the entry kept tells them apart (forced here: both calls see the same key)."""
    memo = tracememo.TraceMemo()
    old, new = torch.arange(4), torch.arange(4)
    reads = iter([(("same key",), [old]), (("same key",), [new]), (("same key",), [new])])
    monkeypatch.setattr(tracememo, "reads", lambda fn: next(reads))
    built = []

    def build(t):
        return lambda: (built.append(t) or "kernel", [t])

    assert memo.get(None, (), build(old)) == ("kernel", (old,))
    del old
    gc.collect()
    assert memo.get(None, (), build(new)) == ("kernel", (new,)) and len(built) == 2
    assert memo.get(None, (), build(new))[1][0] is new and len(built) == 2  # kept now, with the new tensor


def test_softcap_calls_trace_once_through_every_op(traces):
    q, k, v = _inputs(24, 24)
    for _ in range(3):
        out = flashlib.flash_attention(q, k, v, softcap=20.0)
    torch.testing.assert_close(out, flashlib.dense_attention(q.double(), k.double(), v.double(), softcap=20.0).float(),
                               atol=2e-6, rtol=2e-5)
    assert traces["score"] <= 2  # the forward's kernel, and the captured tensors (none) asked once


def test_the_calls_benchmark_checks_each_case_and_restores_the_launches(tmp_path):
    from triton.runtime.interpreter import InterpretedFunction

    from flashlib.bench import calls

    run = InterpretedFunction.run
    path = calls.run_calls_bench("cpu", out_dir=tmp_path, log=lambda *_: None, calls=2, repeats=1)
    assert InterpretedFunction.run is run
    result = json.loads(path.read_text())
    assert [p["case"] for p in result["points"]] == list(calls.cases("cpu"))
    for point in result["points"]:
        assert point["max_error"] < 1e-5, point  # real launches, against dense attention and decode_reference
        assert point["kept_us"] > 0 and point["traced_us"] > 0


def test_a_weighed_memo_keeps_within_its_budget():
    memo = tracememo.TraceMemo(size=10, weigh=len, budget=10)
    built = []

    def get(fn, kept):
        return memo.get(fn, (), lambda: (built.append(kept) or kept, []))[0]

    first, second, big = (lambda b, h, q, k: q >= k), (lambda b, h, q, k: q > k), (lambda b, h, q, k: q < k)
    get(first, "abcdef"), get(first, "abcdef")
    assert built == ["abcdef"]  # kept
    get(second, "ghijkl")  # 12 bytes in all: the least recent goes
    get(second, "ghijkl"), get(first, "abcdef")
    assert built == ["abcdef", "ghijkl", "abcdef"]
    get(big, "x" * 11), get(big, "x" * 11)  # heavier than the whole budget: never kept
    assert built[-2:] == ["x" * 11] * 2
