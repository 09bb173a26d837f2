"""A mask or score function that reads a tensor on another device than q is refused by every op
before anything runs, with a ValueError naming the function, the tensor and both devices.

On a GPU such a function (``ids[q_idx]`` with ``ids`` built on the CPU) fails deep inside PyTorch;
on a CPU, a tensor on the meta device stands for "another device", and a CUDA q is faked with
FakeTensorMode (the check runs before any computation, so a fake q reaches it). The tensor is read
from a closure, a global, a default argument, or through a helper function the mask calls."""
from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
from torch.nn.attention.flex_attention import flex_attention

import flashlib
from flashlib import masks
from flashlib.machinery.checks import check_mask_mod
from flashlib.machinery.options import check_options

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton ships Linux wheels only")

HEADS, SEQ, D = 2, 8, 4


# ----- functions reading a tensor, in each of the ways a function can read one ---------------------

GLOBAL_IDS = GLOBAL_TEMPS = None  # set by the test: what the global_* functions read


def global_mask(b, h, q_idx, kv_idx):
    return GLOBAL_IDS[q_idx] == GLOBAL_IDS[kv_idx]


def global_score(score, b, h, q_idx, kv_idx):
    return score * GLOBAL_TEMPS[h]


def closure_functions(ids, temps):
    def closure_mask(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    def closure_score(score, b, h, q_idx, kv_idx):
        return score * temps[h]

    return closure_mask, closure_score


def default_functions(ids, temps):
    def default_mask(b, h, q_idx, kv_idx, ids=ids):
        return ids[q_idx] == ids[kv_idx]

    def default_score(score, b, h, q_idx, kv_idx, temps=temps):
        return score * temps[h]

    return default_mask, default_score


def helper_functions(ids, temps):
    def doc_of(i):
        return ids[i]

    def temp_of(h):
        return temps[h]

    def helper_mask(b, h, q_idx, kv_idx):
        return doc_of(q_idx) == doc_of(kv_idx)

    def helper_score(score, b, h, q_idx, kv_idx):
        return score * temp_of(h)

    return helper_mask, helper_score


# kind -> (the tensors' names, where the message says they are read, for the mask and the score)
WHERE = {
    "closure": (("ids", "in its closure"), ("temps", "in its closure")),
    "global": (("GLOBAL_IDS", "a global"), ("GLOBAL_TEMPS", "a global")),
    "default": (("ids", "a default argument"), ("temps", "a default argument")),
    "helper": (("ids", "in the closure of doc_of, which it calls"),
               ("temps", "in the closure of temp_of, which it calls")),
}


def functions(kind, ids, temps, monkeypatch):
    """(mask_mod, score_mod) of ``kind`` reading ``ids`` (SEQ,) and ``temps`` (HEADS,)."""
    if kind == "global":
        monkeypatch.setattr(sys.modules[__name__], "GLOBAL_IDS", ids)
        monkeypatch.setattr(sys.modules[__name__], "GLOBAL_TEMPS", temps)
        return global_mask, global_score
    return {"closure": closure_functions, "default": default_functions, "helper": helper_functions}[kind](ids, temps)


def tensors(device):
    return torch.arange(SEQ, device=device) // 3, torch.ones(HEADS, device=device)


# ----- every op that takes a mask or score function ----------------------------------------------

def _qkv(device="cpu"):
    return tuple(torch.zeros(1, HEADS, SEQ, D, device=device) for _ in range(3))


def _tiled_backward(q, k, v, **kw):
    return flashlib.tiled_backward(q, k, v, q, q[..., 0], q, **kw)


def _kernels_attention(q, k, v, **kw):
    from flashlib.kernels import attention

    return attention(q, k, v, **kw)


def _flash_attention(q, k, v, **kw):
    return flashlib.flash_attention(q, k, v, **kw)


def _flash_attention_forward(q, k, v, **kw):
    from flashlib.op import flash_attention_forward

    return flash_attention_forward(q, k, v, **kw)


def _varlen(q, k, v, **kw):
    packed = q[0].transpose(0, 1)  # (SEQ, HEADS, D): one sequence
    cu = torch.tensor([0, SEQ], dtype=torch.int32, device=q.device)
    return flashlib.flash_attention_varlen(packed, packed, packed, cu, cu, SEQ, SEQ, **kw)


def _varlen_reference(q, k, v, **kw):
    packed = q[0].transpose(0, 1)
    cu = torch.tensor([0, SEQ], dtype=torch.int32, device=q.device)
    return flashlib.varlen_reference(packed, packed, packed, cu, cu, SEQ, SEQ, **kw)


def _decode(q, k, v, **kw):
    lengths = q.new_full((1,), SEQ, dtype=torch.int32)
    return flashlib.decode_attention(q[..., :1, :], k, v, lengths, **kw)


def _decode_reference(q, k, v, **kw):
    lengths = q.new_full((1,), SEQ, dtype=torch.int32)
    return flashlib.decode_reference(q[..., :1, :], k, v, lengths, **kw)


def _ring(q, k, v, **kw):
    from flashlib.distributed import ring_attention

    return ring_attention(q, k, v, **kw)  # refused before it looks for a process group


# name as the error starts -> the call; (mask ops, score ops)
MASK_OPS = {
    "dense_attention": flashlib.dense_attention,
    "tiled_attention": flashlib.tiled_attention,
    "tiled_forward": flashlib.tiled_forward,
    "tiled_backward": _tiled_backward,
    "flash_attention": pytest.param(_flash_attention, marks=needs_triton),
    "flash_attention_forward": pytest.param(_flash_attention_forward, marks=needs_triton),
    "flashlib.kernels.attention": pytest.param(_kernels_attention, marks=needs_triton),
}
SCORE_OPS = {
    **MASK_OPS,
    "flash_attention_varlen": pytest.param(_varlen, marks=needs_triton),
    "varlen_reference": _varlen_reference,
    "decode_attention": pytest.param(_decode, marks=needs_triton),
    "decode_reference": _decode_reference,
    "ring_attention": _ring,
}
KINDS = list(WHERE)


def _params(ops):
    """pytest params (name, call) of an ops table, each with its marks."""
    out = []
    for name, op in ops.items():
        call, marks = (op.values[0], op.marks) if hasattr(op, "values") else (op, ())
        out.append(pytest.param(name, call, marks=marks, id=name))
    return out


def _assert_names(message, op, function, name, where, seen, q_device):
    op = {"flash_attention_forward": "flash_attention"}.get(op, op)  # its errors are flash_attention's
    assert message.startswith(f"{op}: argument "), message
    for part in (function.__qualname__, f"tensor '{name}' ({where})", f"on {seen}", f"'q' is on {q_device}",
                 "device=q.device"):
        assert part in message, (part, message)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op, call", _params(MASK_OPS))
def test_a_mask_function_reading_a_tensor_on_another_device_is_refused_by_name(op, call, kind, monkeypatch):
    mask_mod, _ = functions(kind, *tensors("meta"), monkeypatch)
    with pytest.raises(ValueError, match="argument 'mask_mod'") as info:
        call(*_qkv(), mask_mod=mask_mod)
    _assert_names(str(info.value), op, mask_mod, *WHERE[kind][0], "meta", "cpu")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op, call", _params(SCORE_OPS))
def test_a_score_function_reading_a_tensor_on_another_device_is_refused_by_name(op, call, kind, monkeypatch):
    _, score_mod = functions(kind, *tensors("meta"), monkeypatch)
    with pytest.raises(ValueError, match="argument 'score_mod'") as info:
        call(*_qkv(), score_mod=score_mod)
    _assert_names(str(info.value), op, score_mod, *WHERE[kind][1], "meta", "cpu")


CUDA_OPS = {"dense_attention": flashlib.dense_attention, "tiled_attention": flashlib.tiled_attention,
            "flash_attention": pytest.param(_flash_attention, marks=needs_triton),
            "flashlib.kernels.attention": pytest.param(_kernels_attention, marks=needs_triton),
            "ring_attention": _ring}


@pytest.mark.parametrize("op, call", _params(CUDA_OPS))
def test_a_cpu_tensor_read_with_q_on_a_gpu_is_refused_as_a_student_writes_it(op, call):
    # notebook 09's mistake: the tensors built on the CPU, q on the GPU (faked: no kernel runs)
    ids, temps = tensors("cpu")
    mask_mod, score_mod = closure_functions(ids, temps)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _qkv("cuda")
        for argument, function, (name, where) in (("score_mod", score_mod, WHERE["closure"][1]),
                                                  ("mask_mod", mask_mod, WHERE["closure"][0])):
            if argument == "mask_mod" and op == "ring_attention":
                continue  # score functions only
            with pytest.raises(ValueError, match=f"argument '{argument}'") as info:
                call(q, k, v, **{argument: function})
            _assert_names(str(info.value), op, function, name, where, "cpu", "cuda:0")


def test_tensors_on_q_s_device_and_numbers_pass_the_check():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _qkv("cuda")
        ids, temps = tensors("cuda")
        for kind in ("closure", "default", "helper"):
            mask_mod, score_mod = functions(kind, ids, temps, None)
            options = check_options("t", q, k, v, mask_mod=mask_mod, score_mod=score_mod)
            assert options.visibility.mask_mod is mask_mod and options.score_mod is score_mod
        mask_mod = masks.document(ids)  # on cuda:0, a mask built for "cuda" (no index)
        assert check_mask_mod("attention_mask", mask_mod, "cuda", built_on=True) is mask_mod
    # numbers, a dtype and a device are no tensors
    shift, dtype, device = 2, torch.int64, torch.device("cpu")

    def numbers_mask(b, h, q_idx, kv_idx):
        return (q_idx + shift).to(dtype) >= kv_idx.to(device)

    q, k, v = _qkv()
    assert flashlib.dense_attention(q, k, v, mask_mod=numbers_mask).shape == q.shape


def uses_torch_where(b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, True, False)


def test_an_attribute_named_as_a_global_is_not_read_as_the_global(monkeypatch):
    # torch.where reads no global 'where': a tensor of that name beside the function is not its
    monkeypatch.setattr(sys.modules[__name__], "where", torch.zeros(1, device="meta"), raising=False)
    q, k, v = _qkv()
    assert flashlib.dense_attention(q, k, v, mask_mod=uses_torch_where).shape == q.shape


class Opaque:
    """An object the key of the trace memo cannot look into."""


def test_what_cannot_be_looked_into_does_not_hide_a_tensor_beside_it():
    ids = tensors("meta")[0]
    thing = Opaque()

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) | (thing is None)

    with pytest.raises(ValueError, match="reads the tensor 'ids'"):
        flashlib.dense_attention(*_qkv(), mask_mod=mask_mod)


def test_a_tensor_in_a_container_or_behind_a_combinator_is_named_by_its_place():
    windows = [torch.tensor([2, 5]), torch.tensor([2, 5], device="meta")]

    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= windows[1][h]

    with pytest.raises(ValueError, match=r"reads the tensor 'windows\[1\]' \(in its closure\)"):
        flashlib.dense_attention(*_qkv(), mask_mod=window_mask)
    both = masks.document(tensors("meta")[0])
    with pytest.raises(ValueError, match=r"'ids' \(in the closure of document, which it calls\)"):
        flashlib.tiled_attention(*_qkv(), mask_mod=lambda b, h, q_idx, kv_idx: both(b, h, q_idx, kv_idx) & (q_idx >= 0))


def test_the_mask_builders_name_their_device_argument():
    mask_mod = masks.document(tensors("meta")[0])
    for build in (lambda: flashlib.attention_mask(SEQ, SEQ, mask_mod=mask_mod),
                  lambda: masks.create_block_mask(mask_mod, 1, HEADS, SEQ, SEQ),
                  lambda: flashlib.block_mask(SEQ, SEQ, mask_mod=mask_mod, device="cpu")):
        with pytest.raises(ValueError, match=r"'ids' \(in its closure\), which is on meta, but the mask is built on "
                                             r"cpu \(argument 'device'\)"):
            build()
    assert flashlib.attention_mask(SEQ, SEQ, mask_mod=mask_mod, device="meta").device.type == "meta"


@needs_triton
def test_a_block_mask_s_function_is_checked_when_the_call_passes_only_the_block_mask():
    ids = tensors("meta")[0]
    block = masks.create_block_mask(masks.document(ids), 1, HEADS, SEQ, SEQ, device="meta")
    with pytest.raises(ValueError, match=r"flash_attention: argument 'mask_mod': document reads the tensor 'ids'"):
        flashlib.flash_attention(*_qkv(), block_mask=block)


@needs_triton
def test_functions_reading_tensors_on_q_s_device_still_agree_with_flex_attention(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, 40, 16, generator=g) for _ in range(3))
    ids, temps = torch.arange(40) // 7, torch.tensor([0.5, 2.0])
    for kind in KINDS:
        mask_mod, score_mod = functions(kind, ids, temps, monkeypatch)
        block = flex_block_mask(mask_mod, 1, HEADS, 40, 40, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
            want = flex_attention(q, k, v, block_mask=block, score_mod=score_mod)
        for op in (flashlib.dense_attention, flashlib.flash_attention):
            torch.testing.assert_close(op(q, k, v, mask_mod=mask_mod, score_mod=score_mod), want, atol=2e-6,
                                       rtol=2e-5, msg=f"{op.__name__}, {kind}")
