"""transformers' own decoder architectures on flashlib's attention, against the same model's eager attention.

Tiny random models (tests/hf_models.py: Llama, Mistral, Qwen3, Gemma 2, Gemma 3, GPT-OSS; nothing
downloaded), float32. Each must give eager's logits with and without padding, eager's gradient for
every parameter in a training step (GPT-OSS's attention sinks included), and eager's greedy tokens and
logits at every step, one prompt and a left-padded batch, with a KV cache. The tolerances are float32 rounding: logits
within 2e-5 (measured: at most 4.6e-6 on logits of size ~6), each parameter's gradient within 2e-5 of
its largest entry (measured: at most 2.1e-6). test_each_option_changes_the_logits shows that an option
dropped or misread (a window one key too wide, no soft-cap, no sinks, the default scale) moves the
logits by 0.35 to 6.5, so these tests would catch it.
"""
from __future__ import annotations

import importlib.util

from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs Triton (Linux wheels only) and transformers", allow_module_level=True)

import flashlib.decode  # noqa: E402
import flashlib.op  # noqa: E402
from flashlib import hf  # noqa: E402

from .hf_models import ARCHITECTURES, PAD, WINDOW, build, padded, tokens  # noqa: E402

NAME = hf.register()
LOGITS_TOL = 2e-5
GRAD_TOL = 2e-5  # relative to each gradient's largest entry
SEQ = 12
PROMPT, NEW_TOKENS = 5, 5  # greedy generation: prompt tokens, new tokens


def logits(model, impl, ids, mask=None, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def assert_logits_equal(got, want, mask=None):
    """Equal at the valid positions (a padding position's output is no token's)."""
    valid = torch.ones(got.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=LOGITS_TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_equal_eager(arch):
    model = build(arch)
    ids = tokens(1, SEQ, seed=1)
    assert_logits_equal(logits(model, NAME, ids), logits(model, "eager", ids))
    ids, mask = padded(SEQ, left=(7,), right=(3,), seed=2)
    assert_logits_equal(logits(model, NAME, ids, mask), logits(model, "eager", ids, mask), mask)


def gradients(model, impl, ids, mask, labels):
    model.set_attn_implementation(impl)
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


# Each family once, padded or not; both for the families with an option no other family has (Gemma 2's soft-cap,
# GPT-OSS's sinks, Llama 4's chunks): every option then meets both backward paths (flash_attention's, the packed
# op's), windows and Gemma's scale included; layer 1 of every family but Mistral is plain causal attention.
TRAINING = [("llama", False), ("mistral", True), ("qwen3", False), ("gemma3", True),
            *((arch, pad) for arch in ("gemma2", "gpt_oss", "llama4") for pad in (False, True))]


@pytest.mark.parametrize("arch, pad", TRAINING, ids=[f"{a}-{'padded' if p else 'unpadded'}" for a, p in TRAINING])
def test_training_step_gradients_equal_eager(arch, pad):
    """Training mode (dropout 0) through flash_attention's or the packed op's backward. Padded: one row
    padded on the left, one on the right; the labels skip the padding and a left-padded row's first token,
    which only a padding position would predict."""
    model = build(arch)
    if pad:
        ids, mask = padded(SEQ, left=(4,), right=(5,), seed=3)
        labels = ids.masked_fill(mask == 0, -100)
        labels[1, 4] = -100
    else:
        ids, mask = tokens(2, SEQ, seed=3), None
        labels = ids
    want = gradients(model, "eager", ids, mask, labels)
    got = gradients(model, NAME, ids, mask, labels)
    assert set(got) == set(want) == {name for name, p in model.named_parameters() if p.requires_grad}
    for name, grad in want.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(got[name], grad, atol=GRAD_TOL * scale + 1e-12, rtol=0, msg=name)
    if arch == "gpt_oss":
        assert all(want[n].abs().max() > 0 for n in want if n.endswith("sinks"))


@pytest.fixture
def op_calls(monkeypatch):
    """How often flashlib.hf called each public op."""
    calls = {"flash_attention": 0, "flash_attention_varlen": 0, "decode_attention": 0}
    for module, name in ((flashlib.op, "flash_attention"), (flashlib.op, "flash_attention_varlen"),
                         (flashlib.decode, "decode_attention")):
        real = getattr(module, name)

        def counted(*args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def greedy(model, impl, ids, mask=None, new_tokens=NEW_TOKENS):
    """(tokens, each step's logits). Llama 4 keeps every key (DynamicCache() without the config): its chunked
    layers' default cache keeps only the last chunk's keys, which this attention refuses
    (test_a_chunked_layers_sliding_cache_is_refused)."""
    from transformers import DynamicCache

    model.set_attn_implementation(impl)
    cache = dict(past_key_values=DynamicCache()) if model.config.model_type == "llama4_text" else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True, **cache)
    return out.sequences, torch.stack(out.logits, dim=1)  # (batch, prompt + new), (batch, new, vocab)


def test_a_chunked_layers_sliding_cache_is_refused():
    model = build("llama4")
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="keys start at position .*DynamicCache"):
        model.generate(tokens(1, 8, seed=4), max_new_tokens=4, do_sample=False, pad_token_id=PAD)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_equal_eager(arch, op_calls):
    """5 new tokens with a KV cache: the prompt's prefill, then one token per step through decode_attention;
    one prompt, and a batch of two prompts, one padded on the left. 5 + 5 tokens: windows of 4 slide in the
    prefill and in every step, Llama 4's chunk boundaries fall at 4 (in the prefill) and 8 (a step). Eager's
    tokens, and every step's logits within the logits tolerance (a misread option moves them 1000x past it)."""
    model = build(arch)
    for ids, mask in ((tokens(1, PROMPT, seed=4), None), padded(PROMPT, left=(3,), seed=5)):
        (got, got_logits), (want, want_logits) = greedy(model, NAME, ids, mask), greedy(model, "eager", ids, mask)
        assert torch.equal(got, want)
        torch.testing.assert_close(got_logits, want_logits, atol=LOGITS_TOL, rtol=0)
    steps = NEW_TOKENS - 1
    assert op_calls["decode_attention"] >= 2 * steps * 2  # the steps after each prefill, 2 layers
    assert op_calls["flash_attention_varlen"] >= 2  # the padded prefill


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_chunked_prefill_with_padding_equals_eager(arch):
    """A left-padded prompt fed in two chunks to one KV cache: the second chunk's 5 queries sit after
    7 cached keys (fewer valid ones where padded; a windowed layer's cache keeps only its last keys)."""
    from transformers import DynamicCache

    model = build(arch)
    ids, mask = padded(SEQ, left=(3, 9), seed=6)
    results = {}
    for impl in (NAME, "eager"):
        cache = DynamicCache(config=model.config)
        logits(model, impl, ids[:, :7], mask[:, :7], past_key_values=cache, use_cache=True)
        results[impl] = logits(model, impl, ids[:, 7:], mask, past_key_values=cache, use_cache=True)
    assert_logits_equal(results[NAME], results["eager"], mask[:, 7:])


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]  # (1, total): restarts at each sequence


@pytest.mark.parametrize("arch", ["mistral"])
def test_packed_sequences_equal_eager(arch):
    """Sequences packed into one row, told apart by position_ids (eager, without a cache, masks across them),
    or by flash-attn's cu_seq_lens_q/k: attention stays within each sequence, windowed inside it."""
    model = build(arch)
    lengths = (5, 7)
    ids, positions = tokens(1, sum(lengths), seed=7), packed_positions(lengths)
    want = logits(model, "eager", ids, position_ids=positions, use_cache=False)
    assert_logits_equal(logits(model, NAME, ids, position_ids=positions, use_cache=False), want)
    cu = torch.tensor([0, 5, 12])
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    assert_logits_equal(logits(model, NAME, ids, position_ids=positions, use_cache=False, **flash_kwargs), want)


class _Unchunked:
    """A layer whose config says no layer is chunked: what an attention that ignored the chunk would see."""

    def __init__(self, module, size):
        self.module, self.layer_idx, self.is_causal = module, module.layer_idx, module.is_causal
        self.config = SimpleNamespace(layer_types=module.config.layer_types if size else [], attention_chunk_size=size)


def dropping(keyword, replace=None):
    """flashlib's attention with one keyword dropped (or replaced by replace(value)); "chunk": the layer's
    chunk (config.attention_chunk_size, which transformers passes to no attention function)."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        if keyword == "chunk":
            size = 0 if replace is None else replace(module.config.attention_chunk_size)
            return hf.attention_forward(_Unchunked(module, size), query, key, value, attention_mask, **kwargs)
        if replace is None:
            kwargs.pop(keyword)
        else:
            kwargs[keyword] = replace(kwargs[keyword])
        return hf.attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@pytest.mark.parametrize("arch, keyword, replace", [
    ("mistral", "sliding_window", None),
    ("mistral", "sliding_window", lambda w: w + 1),  # one key more than transformers' window
    ("qwen3", "sliding_window", None),
    ("gemma2", "softcap", None),
    ("gemma2", "scaling", None),
    ("gemma3", "sliding_window", None),
    ("gpt_oss", "s_aux", None),
    ("llama4", "chunk", None),
    ("llama4", "chunk", lambda c: c + 1),  # chunks one position longer than transformers' mask's
])
def test_each_option_changes_the_logits(arch, keyword, replace):
    """The equality tests can fail: each option, dropped or misread, moves the logits 1000x past the tolerance."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model = build(arch)
    probe = "tiled-probe"
    AttentionInterface.register(probe, dropping(keyword, replace))
    AttentionMaskInterface.register(probe, hf.padding_mask)
    ids = tokens(1, SEQ, seed=8)
    difference = (logits(model, probe, ids) - logits(model, "eager", ids)).abs().max().item()
    assert difference > 1000 * LOGITS_TOL, difference


# ----- what is refused ---------------------------------------------------------------------------

class Module(torch.nn.Module):
    is_causal = True


def qkv(batch=2, seq_q=5, seq_k=5):
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(batch, 4, seq_q, 8, generator=generator)
    k, v = (torch.randn(batch, 2, seq_k, 8, generator=generator) for _ in range(2))
    return q, k, v


def call(mask=None, q_k_v=None, **kwargs):
    return hf.attention_forward(Module(), *(q_k_v or qkv()), mask, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout=0.1), ValueError, "'dropout' is 0.1.*attention_dropout"),
    (dict(output_attentions=True), ValueError, "'output_attentions'.*eager"),
    (dict(head_mask=torch.ones(4)), TypeError, "'head_mask'.*refused"),
    (dict(position_bias=torch.zeros(1)), TypeError, "'position_bias'"),
    (dict(sliding_window=0), ValueError, "'sliding_window' is 0"),
    (dict(sliding_window=True), ValueError, "'sliding_window' is True"),
    (dict(sliding_window=3, is_causal=False), ValueError, "'sliding_window' is 3 with is_causal=False"),
    (dict(s_aux=torch.zeros(2)), ValueError, r"'s_aux'.*\(2,\); expected .*\(4,\)"),
    (dict(cu_seq_lens_q=torch.tensor([0, 5])), ValueError, "without cu_seq_lens_k"),
])
def test_arguments_it_cannot_honour_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        call(**kwargs)


def test_ignored_arguments_change_nothing():
    want = call()
    ignored = dict(use_cache=True, output_router_logits=False, output_hidden_states=True, num_items_in_batch=3,
                   return_dict=True, encoder_hidden_states=torch.zeros(2, 3, 8), output_attentions=False, dropout=0.0,
                   head_mask=None, position_bias=None)
    assert set(ignored) - {"output_attentions", "dropout", "head_mask", "position_bias"} == set(hf.IGNORED)
    torch.testing.assert_close(call(**ignored)[0], want[0], atol=0, rtol=0)


def test_masks_it_cannot_read_are_refused():
    with pytest.raises(ValueError, match="'attention_mask' has shape \\(2, 1, 5, 5\\)"):
        call(torch.ones(2, 1, 5, 5, dtype=torch.bool))
    gap = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match="padding between the valid tokens of sequence 1"):
        call(gap)
    with pytest.raises(ValueError, match="causal attention with 5 queries and 3 keys"):
        call(q_k_v=qkv(seq_q=5, seq_k=3))
    out, _ = hf.attention_forward(Module(), *qkv(), gap, is_causal=False)  # without causality, any mask
    assert out.shape == (2, 5, 4, 8)


def test_mask_functions_it_cannot_reproduce_are_refused():
    from transformers.masking_utils import (and_masks, causal_mask_function, chunked_causal_mask_function,
                                            or_masks, sliding_window_causal_mask_function)

    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    sizes = dict(batch_size=1, q_length=4, kv_length=4, attention_mask=mask)
    for fine in (causal_mask_function, sliding_window_causal_mask_function(WINDOW)):
        assert torch.equal(hf.padding_mask(mask_function=fine, **sizes), mask)
    image_tokens = or_masks(causal_mask_function, lambda b, h, q, k: q >= 0)
    with pytest.raises(ValueError, match="built from or_masks"):
        hf.padding_mask(mask_function=image_tokens, **sizes)
    # Llama 4's chunks: the attention reads config.attention_chunk_size, so the mask's chunk must be it
    chunked = chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))
    config = SimpleNamespace(attention_chunk_size=3)
    assert torch.equal(hf.padding_mask(mask_function=chunked, local_size=3, config=config, **sizes), mask)
    with pytest.raises(ValueError, match="chunked by 3 but its config's attention_chunk_size.* is None"):
        hf.padding_mask(mask_function=chunked, local_size=3, config=SimpleNamespace(), **sizes)
    with pytest.raises(ValueError, match="or_mask_function/and_mask_function"):
        hf.padding_mask(mask_function=and_masks(causal_mask_function), use_vmap=True, **sizes)
