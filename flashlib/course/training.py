"""A tiny attention model and its training loop, to train with any attention function.

Small enough for Triton's CPU interpreter: notebook 07 trains it twice, with
``flash_attention`` and with ``dense_attention``, from the same seed, and compares losses.
The task: predict, at every position, the token ``shift`` positions earlier (0 at the start),
which causal attention solves by looking back.
"""
from __future__ import annotations

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
    return losses
