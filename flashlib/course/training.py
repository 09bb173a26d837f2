"""A tiny attention model and its training loop, to train with any attention function.

Small enough for Triton's CPU interpreter: notebook 07 trains it twice, with
``flash_attention`` and with ``dense_attention``, from the same seed, and compares losses.
The task: predict, at every position, the token ``shift`` positions earlier (0 at the start),
which causal attention solves by looking back. Notebook 10 generates from the trained model
token by token, with a KV cache (:func:`generate_cached`) and without (:func:`generate`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class TinyAttentionModel(nn.Module):
    """Embedding -> one causal multi-head attention layer -> vocabulary logits."""

    def __init__(self, attention, vocab: int = 16, seq: int = 24, width: int = 32, heads: int = 2):
        super().__init__()
        self.attention, self.heads = attention, heads
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq, width) * 0.1)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens):  # tokens (batch, seq)
        x = self.embed(tokens) + self.position[: tokens.shape[1]]  # (B, N, W)
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v, causal=True)  # (B, H, N, W/H)
        return self.out(x + y.transpose(1, 2).reshape(batch, seq, width))  # (B, N, vocab)


def shifted_copy_batch(generator, batch: int = 8, seq: int = 24, vocab: int = 16, shift: int = 1):
    tokens = torch.randint(1, vocab, (batch, seq), generator=generator)
    targets = torch.zeros_like(tokens)
    targets[:, shift:] = tokens[:, :-shift]
    return tokens, targets


def train(attention, *, steps: int = 40, seed: int = 0, lr: float = 3e-2, device="cpu"):
    """Losses of ``steps`` Adam steps from a fixed initialisation and data stream.

    device: where the model and its batches live; the kernels compiled for a GPU take CUDA
    tensors, the interpreter CPU ones. The initialisation and the data are drawn on the CPU
    either way, so every device starts from the same numbers."""
    return train_model(attention, steps=steps, seed=seed, lr=lr, device=device)[1]


def train_model(attention, *, steps: int = 40, seed: int = 0, lr: float = 3e-2, device="cpu"):
    """:func:`train`, returning the trained model too: (model, losses)."""
    torch.manual_seed(seed)
    model = TinyAttentionModel(attention).to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens, targets = (t.to(device) for t in shifted_copy_batch(data))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return model, losses


# ----- generating with and without a KV cache (notebook 10) ------------------------------------

class KVCache(NamedTuple):
    """The keys and values of the positions generated so far, for every sequence and head."""

    k: torch.Tensor        # (batch, heads, capacity, head_dim); capacity = the model's positions
    v: torch.Tensor
    seqlens: torch.Tensor  # (batch,) int32: positions filled, the same for every sequence here


def empty_cache(model: TinyAttentionModel, batch: int) -> KVCache:
    capacity, width = model.position.shape
    shape = (batch, model.heads, capacity, width // model.heads)
    device = model.position.device
    return KVCache(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device))


def forward_cached(model: TinyAttentionModel, tokens, cache: KVCache, decode):
    """The model's forward for ``tokens`` (batch, new) that follow the cached positions: their keys
    and values are appended to the cache (in place) and their queries attend over the whole cache
    with ``decode(q, k_cache, v_cache, cache_seqlens)``. Returns the logits (batch, new, vocab)."""
    batch, new = tokens.shape
    start = int(cache.seqlens[0])
    x = model.embed(tokens) + model.position[start:start + new]  # (B, new, W)
    width = x.shape[-1]
    q, k, v = model.qkv(x).view(batch, new, 3, model.heads, width // model.heads).permute(2, 0, 3, 1, 4)
    cache.k[:, :, start:start + new] = k  # (B, H, new, W/H) into positions start .. start + new - 1
    cache.v[:, :, start:start + new] = v
    cache.seqlens.add_(new)
    y = decode(q, cache.k, cache.v, cache.seqlens)  # (B, H, new, W/H)
    return model.out(x + y.transpose(1, 2).reshape(batch, new, width))


@torch.no_grad()
def generate(model: TinyAttentionModel, prompt, steps: int):
    """Greedy generation without a cache: every step runs the model over the whole sequence so
    far and appends the most likely next token. prompt (batch, n) -> (batch, n + steps)."""
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@torch.no_grad()
def generate_cached(model: TinyAttentionModel, prompt, steps: int, decode):
    """Greedy generation with a KV cache: the prompt in one call, then one new token per step, each
    step computing q, k, v for its new token only. Same tokens as :func:`generate` (up to ties in
    rounding). decode: e.g. ``flashlib.decode_attention``."""
    if prompt.shape[1] + steps > model.position.shape[0]:
        raise ValueError(f"generate_cached: a prompt of {prompt.shape[1]} tokens and {steps} steps need "
                         f"{prompt.shape[1] + steps} positions; the model has {model.position.shape[0]}")
    cache = empty_cache(model, prompt.shape[0])
    logits = forward_cached(model, prompt, cache, decode)
    tokens = [prompt]
    for step in range(steps):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))  # (B, 1)
        if step + 1 < steps:  # the last token needs no logits of its own
            logits = forward_cached(model, tokens[-1], cache, decode)
    return torch.cat(tokens, dim=1)
