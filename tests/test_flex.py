"""flashlib against PyTorch's FlexAttention on the same mask functions, written as FlexAttention
users write them: the FlexAttention blog's idioms (a captured document_id indexed by the indices,
per-batch lengths) and attention-gym's (``generate_*`` closures, ``and_masks``/``or_masks``).

Forward: ``flex_attention`` on the CPU (eager) gives out and lse for the same mask_mod; flashlib's
dense and tiled references, its kernels (interpreter) and the public op must agree with it.
Gradients: flex cannot differentiate on a CPU, so they are checked against float64 attention
built from flex's own ``create_mask`` (nothing of flashlib's in it)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import (AuxRequest, and_masks, create_block_mask, create_mask,
                                               flex_attention, or_masks)

import flashlib
from flashlib import masks
from flashlib.kernels import attention

B, H, H_KV, D = 2, 4, 2, 16


# ----- masks, as the FlexAttention blog and attention-gym write them ------------------------------

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size: int):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    return and_masks(sliding_window, causal)


def generate_prefix_lm_mask(prefix_length: int):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    return or_masks(prefix_mask, causal)


def generate_doc_mask(document_id: torch.Tensor):
    def doc_mask(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    return doc_mask


def generate_doc_causal_mask(document_id: torch.Tensor):
    return and_masks(causal, generate_doc_mask(document_id))


def generate_length_mask(lengths: torch.Tensor):
    """Per-batch lengths (padding): batch row b sees its first lengths[b] keys."""
    def length_mask(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return length_mask


def generate_dilated_mask(dilation: int):
    def dilated(b, h, q_idx, kv_idx):
        return (kv_idx - q_idx) % dilation == dilation - 1

    return dilated


def chunked(b, h, q_idx, kv_idx):
    return q_idx // 16 == kv_idx // 16


def floor_band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) // 8 == 0  # negative differences floor to -1: only 0 <= q - kv < 8


def near(b, h, q_idx, kv_idx):
    return torch.abs(q_idx - kv_idx) <= 5


def alternating_heads(b, h, q_idx, kv_idx):
    return torch.where(h % 2 == 0, q_idx >= kv_idx, torch.abs(q_idx - kv_idx) <= 3)


def clamped(b, h, q_idx, kv_idx):
    return torch.minimum(q_idx, torch.maximum(kv_idx, q_idx - 9)) == kv_idx


def _per_head_windows():
    windows = torch.tensor([2, 5, 11, 40])

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

    return per_head


def _masks(seq: int):
    document_id = torch.arange(seq) * 7 // seq  # 7 documents of uneven lengths
    return {
        "causal": causal, "sliding_window": generate_sliding_window(6), "prefix_lm": generate_prefix_lm_mask(10),
        "document": generate_doc_mask(document_id), "document_causal": generate_doc_causal_mask(document_id),
        "lengths": generate_length_mask(torch.tensor([seq - 11, seq])), "dilated": generate_dilated_mask(3),
        "chunked": chunked, "floor_band": floor_band, "near": near, "alternating_heads": alternating_heads,
        "clamped": clamped, "per_head_windows": _per_head_windows(),
        "flashlib.sliding_window": masks.sliding_window(4), "flashlib.prefix_lm": masks.prefix_lm(7),
        "flashlib.document": masks.document(document_id.to(torch.int16)),
    }


NAMES = list(_masks(8))
# lengths that are not tile multiples, seq_q != seq_k (a mask function's indices are absolute), and
# for a few masks seq_q == seq_k as well
CASES = [(name, (70, 53)) for name in NAMES] + [(name, (37, 37)) for name in
                                                 ("causal", "document_causal", "floor_band", "dilated", "lengths")]


def _inputs(seq_q, seq_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq_q, D, generator=g)
    k, v = (torch.randn(B, H_KV, seq_k, D, generator=g) for _ in range(2))
    return q, k, v


def _flex(q, k, v, mask_mod):
    block_mask = create_block_mask(mask_mod, B, H, q.shape[-2], k.shape[-2], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
        out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _same_lse(a, b, atol):
    both_empty = torch.isneginf(a) & torch.isneginf(b)
    return torch.where(both_empty, 0.0, (a - b).abs()).max().item() <= atol


@pytest.mark.parametrize("name, shape", CASES)
def test_forward_equals_flex_attention(name, shape):
    q, k, v = _inputs(*shape)
    mask_mod = _masks(max(shape))[name]
    out, lse = _flex(q, k, v, mask_mod)
    kernel_out, kernel_lse = attention(q, k, v, mask_mod=mask_mod, return_lse=True)  # the public op's path here
    dense = flashlib.dense_attention(q, k, v, mask_mod=mask_mod)
    tiled = flashlib.tiled_attention(q, k, v, block_q=16, block_k=16, mask_mod=mask_mod)
    for what, got in (("kernels", kernel_out), ("dense", dense), ("tiled", tiled)):
        torch.testing.assert_close(got, out, atol=2e-6, rtol=2e-5, msg=lambda m: f"{name} {what}: {m}")
    assert _same_lse(kernel_lse, lse, 2e-5), name


def _reference_grads(q, k, v, mask_mod):
    """float64 attention with flex's create_mask, autograd: nothing of flashlib's."""
    visible = create_mask(mask_mod, B, H, q.shape[-2], k.shape[-2], device="cpu")
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    kk, vv = (t.repeat_interleave(H // H_KV, dim=1) for t in (k, v))
    s = (q @ kk.transpose(-2, -1)) / D ** 0.5
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    out = p @ vv
    out.backward(_upstream(out))
    return out.detach(), q.grad, k.grad, v.grad


def _upstream(out):
    return torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document_causal", "lengths", "floor_band",
                                  "alternating_heads", "per_head_windows", "flashlib.document"])
def test_gradients_equal_float64_attention_on_flex_masks(name):
    check_gradients(_masks(61)[name], name)


def check_gradients(mask_mod, name):
    """flash_attention's out and gradients against float64 attention on flex's create_mask."""
    q, k, v = _inputs(45, 61, seed=3)
    expected = _reference_grads(q, k, v, mask_mod)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flashlib.flash_attention(q, k, v, mask_mod=mask_mod)
    out.backward(_upstream(out))
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), f"{name} {what}: {err:.3g}"


def test_a_changed_global_is_read_again():
    q, k, v = _inputs(40, 40)
    global _LIMIT
    results = []
    for _LIMIT in (5, 30):
        out = attention(q, k, v, mask_mod=_global_limit)
        results.append((out, _flex(q, k, v, _global_limit)[0]))
    for out, flex_out in results:
        torch.testing.assert_close(out, flex_out, atol=2e-6, rtol=2e-5)
    assert not torch.allclose(results[0][0], results[1][0])


_LIMIT = 5


def _global_limit(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= _LIMIT)


def test_a_captured_tensor_is_read_at_every_call():
    q, k, v = _inputs(40, 40)
    document_id = torch.zeros(40, dtype=torch.int64)
    mask_mod = generate_doc_mask(document_id)
    first = attention(q, k, v, mask_mod=mask_mod)
    document_id[20:] = 2**40  # in place: the same mask function, new values (beyond 32 bits)
    second = attention(q, k, v, mask_mod=mask_mod)
    torch.testing.assert_close(first, _flex(q, k, v, generate_doc_mask(torch.zeros(40, dtype=torch.int64)))[0],
                               atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(second, _flex(q, k, v, mask_mod)[0], atol=2e-6, rtol=2e-5)


def test_captured_tensors_of_any_stride_and_dtype():
    q, k, v = _inputs(40, 40)
    base = (torch.arange(80) // 30).to(torch.int8)
    strided = base[::2]  # a view with stride 2
    huge = torch.as_strided(torch.arange(3, dtype=torch.int64).repeat_interleave(1), (40,), (0,))  # stride 0
    for ids in (strided, huge, (torch.arange(40) // 9).to(torch.uint8), torch.arange(40) % 4 == 0):
        mask_mod = generate_doc_mask(ids)
        torch.testing.assert_close(attention(q, k, v, mask_mod=mask_mod), _flex(q, k, v, mask_mod)[0],
                                   atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("body, construct", [
    ("return (q_idx >= kv_idx) and (kv_idx > 2)", "write (a) & (b)"),
    ("return not (q_idx >= kv_idx)", "write ~(x)"),
    ("return q_idx >= kv_idx if h == 0 else q_idx <= kv_idx", "torch.where(c, x, y)"),
    ("return (q_idx - kv_idx) ** 0.5 < 9", "'**' with this exponent"),
    ("return 0 <= q_idx - kv_idx < 4", "compare two values at a time"),
    ("return min(q_idx, kv_idx) > 2", "torch.minimum(a, b)"),
    ("return [0, 1, 2][h] < kv_idx", "torch.tensor(values)[q_idx]"),
    ("return int(q_idx) > kv_idx", "turned into a Python number"),
    ("return torch.sin(q_idx) > kv_idx", "the call torch.sin"),
    ("return q_idx.sin() > kv_idx", "the method .sin()"),
])
def test_constructs_the_kernels_cannot_compile_get_one_short_error(body, construct, tmp_path):
    namespace = {"torch": torch}
    path = tmp_path / "user_masks.py"
    path.write_text(f"import torch\n\n\ndef user_mask(b, h, q_idx, kv_idx):\n    {body}\n")
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    q, k, v = _inputs(20, 20)
    with pytest.raises(TypeError) as info:
        attention(q, k, v, mask_mod=namespace["user_mask"])
    message = str(info.value)
    assert "argument 'mask_mod'" in message and construct in message and "user_mask, line 5" in message
    assert "\n" not in message and len(message) < 400, message


def test_flashlibs_ready_masks_run_in_flex_attention_unchanged():
    q, k, v = _inputs(33, 33)
    for mask_mod in (masks.causal, masks.sliding_window(3), masks.prefix_lm(5), masks.document(torch.arange(33) // 8),
                     masks.and_masks(masks.causal, masks.document(torch.arange(33) // 8))):
        torch.testing.assert_close(_flex(q, k, v, mask_mod)[0], flashlib.dense_attention(q, k, v, mask_mod=mask_mod),
                                   atol=2e-6, rtol=2e-5)


# ----- a block mask built once, passed again ----------------------------------------------------

@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (64, 48), (16, 64)])
def test_a_fine_block_mask_coarsens_to_the_one_built_at_the_kernels_tiles(tiles):
    mask_mod = generate_doc_causal_mask(torch.arange(150) * 5 // 150)
    fine = masks.create_block_mask(mask_mod, None, None, 150, 130)
    direct = masks.block_mask(150, 130, block_q=tiles[0], block_k=tiles[1], mask_mod=mask_mod)
    assert torch.equal(fine.coarsen(*tiles), direct.kinds)


def test_a_block_mask_passed_again_is_not_evaluated_again(monkeypatch):
    from flashlib.kernels import function

    q, k, v = (t.requires_grad_(True) for t in _inputs(70, 70))
    mask_mod = generate_sliding_window(9)
    block_mask = masks.create_block_mask(mask_mod, None, None, 70, 70)
    built = []
    monkeypatch.setattr(function, "block_mask", lambda *a, **kw: built.append(1) or masks.block_mask(*a, **kw))
    out = flashlib.flash_attention(q, k, v, block_mask=block_mask)  # the public op, and through it the kernels
    out.backward(_upstream(out))
    assert built == [], "neither the forward nor the backward built a block mask again"
    expected = _reference_grads(*(t.detach() for t in (q, k, v)), mask_mod)
    for got, want in zip((out, q.grad, k.grad, v.grad), expected):
        assert (got.double() - want).abs().max().item() <= 1e-5
    attention(q, k, v, mask_mod=mask_mod)
    assert built == [1], "without one, a call builds its own"


def test_a_block_mask_that_does_not_fit_the_call_is_refused():
    q, k, v = _inputs(40, 40)
    block_mask = masks.create_block_mask(causal, None, None, 40, 40)
    with pytest.raises(ValueError, match="'block_mask' was built for .*seq_q 40, seq_k 40.*but the call has"):
        attention(q[..., :30, :], k, v, block_mask=block_mask)
    with pytest.raises(ValueError, match="argument 'mask_mod' differs from the block mask's"):
        attention(q, k, v, block_mask=block_mask, mask_mod=near)
    with pytest.raises(ValueError, match="tiles must be multiples"):
        masks.create_block_mask(causal, None, None, 40, 40, block_size=24).coarsen(64, 64)
    with pytest.raises(TypeError, match="'block_mask' must be a flashlib BlockMask"):
        attention(q, k, v, block_mask=create_block_mask(causal, B, H, 40, 40, device="cpu"))
