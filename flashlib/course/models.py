"""Notebook 12: flashlib inside a real architecture, and the attention sink's gradient.

A tiny, randomly initialised GPT-OSS (transformers' own code: learned attention sinks, alternating
sliding-window and full layers, grouped-query heads; nothing downloaded) generates text two ways:

    eager       transformers' ``generate`` with its own attention and cache
    flashlib    :func:`generate_paged`: the prompt through :func:`flashlib.flash_attention`, then
                one token per step through :func:`flashlib.decode_attention` over a paged KV cache
                (:class:`PagedKVCache`) that the attention function fills itself

and the tokens must agree one for one. The lab, ``sink_grad``, is :mod:`flashlib.labs.sink_lab`.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch


NAME = "paged"  # a name without "flash": transformers takes those for kernels to download

_CACHE: contextvars.ContextVar = contextvars.ContextVar("flashlib_paged_cache", default=None)


def tiny_gpt_oss(seed: int = 0):
    """A GPT-OSS of two layers (sliding window of 4, then full), 4 query heads on 2 kv heads of
    width 16, 2 experts, a vocabulary of 97; random weights from ``seed``, float32, eval mode.
    The sinks are drawn larger than the default initialisation so that they matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                          pad_token_id=0, eos_token_id=None, bos_token_id=None,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


class PagedKVCache:
    """Every layer's keys and values in pages of ``page_size`` positions, scattered at random:
    pages (num_pages, kv_heads, page_size, head_dim) per layer, one block table (batch,
    pages per sequence) int32 shared by the layers, and each sequence's filled positions."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, *,
                 page_size: int = 8, seed: int = 0, dtype=torch.float32, device="cpu"):
        per_sequence = -(-capacity // page_size)
        order = torch.randperm(batch * per_sequence, generator=torch.Generator().manual_seed(seed))
        self.block_table = order.reshape(batch, per_sequence).to(device=device, dtype=torch.int32)
        shape = (batch * per_sequence, kv_heads, page_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.page_size = page_size
        self.mistake = None  # one of MISTAKES: what generate_paged(..., mistake=) gets wrong on purpose

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write key, value (batch, kv_heads, new, head_dim) at each sequence's next positions."""
        new = key.shape[2]
        positions = self.lengths[:, None].long() + torch.arange(new, device=key.device)  # (batch, new)
        pages = self.block_table.long().gather(1, positions // self.page_size)
        slots = positions % self.page_size
        # pages[b, t], :, slots[b, t] -> (batch, new, kv_heads, head_dim)
        self.k[layer][pages, :, slots] = key.transpose(1, 2)
        self.v[layer][pages, :, slots] = value.transpose(1, 2)

    def advance(self, new: int) -> None:
        self.lengths += new


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature, run over :class:`PagedKVCache`: the new tokens'
    keys and values are appended to the cache; a prompt attends with ``flash_attention``, a step of
    one token with ``decode_attention`` on the pages. Sinks (``s_aux``), the sliding window and the
    scale are the layer's own. For one batch of unpadded sequences of one length."""
    from ..decode import decode_attention
    from ..hf import _options
    from ..op import flash_attention

    cache = _CACHE.get()
    if cache is None:
        raise RuntimeError("paged_attention runs inside generate_paged, which holds its cache")
    # transformers' keywords in flashlib's terms, as flashlib.hf reads them (sliding_window w: window (w - 1, 0))
    options = _options(module, query, dropout, scaling, kwargs.get("is_causal"), kwargs.get("sliding_window"),
                       kwargs.get("softcap"), kwargs.get("s_aux")).keywords()
    options.pop("causal")  # a prompt is causal; a step's one query sees the whole cache
    window = options.get("window")
    if cache.mistake == "sinks dropped":
        options["sinks"] = None
    elif cache.mistake == "window one key wider" and window is not None:
        options["window"] = (window[0] + 1, 0)
    layer = module.layer_idx
    cache.append(layer, key, value)
    if key.shape[2] > 1:  # the prompt: every position at once
        out = flash_attention(query, key, value, causal=True, **options)
    else:
        out = decode_attention(query, cache.k[layer], cache.v[layer], cache.lengths + 1, block_table=cache.block_table,
                               **options)
    return out.transpose(1, 2), None  # (batch, seq, heads, head_dim), no weights


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)
    return NAME


@contextlib.contextmanager
def _attention(model, name):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


MISTAKES = ("sinks dropped", "window one key wider")


def generate_paged(model, prompt: torch.Tensor, steps: int, *, page_size: int = 8, seed: int = 0,
                   mistake: str | None = None):
    """Greedy generation of ``steps`` tokens after ``prompt`` (batch, length) with flashlib's attention
    over a paged cache: the prompt in one forward pass, then one token per pass at its position.
    Returns (tokens (batch, length + steps), the cache). mistake: one of :data:`MISTAKES`, made on
    purpose in every layer, to see what it changes."""
    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"generate_paged: argument 'mistake' is {mistake!r}; expected None or one of {MISTAKES}")
    config = model.config
    batch, length = prompt.shape
    cache = PagedKVCache(config.num_hidden_layers, batch, config.num_key_value_heads, config.head_dim,
                         length + steps, page_size=page_size, seed=seed, dtype=model.dtype, device=prompt.device)
    cache.mistake = mistake
    tokens, new = prompt, prompt
    token = _CACHE.set(cache)
    try:
        with _attention(model, register()), torch.no_grad():
            for _ in range(steps):
                start = int(cache.lengths[0])
                positions = torch.arange(start, start + new.shape[1], device=prompt.device)[None].expand(batch, -1)
                logits = model(input_ids=new, position_ids=positions, use_cache=False).logits
                cache.advance(new.shape[1])
                new = logits[:, -1].argmax(-1, keepdim=True)
                tokens = torch.cat((tokens, new), dim=1)
    finally:
        _CACHE.reset(token)
    return tokens, cache


def generate_eager(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """transformers' own greedy generation with its eager attention and its own cache."""
    with _attention(model, "eager"), torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False)
