"""Standard attention: materialise the (seq_q, seq_k) scores S and probabilities P.

This is the reference every faster path in flashlib is checked against, and the
algorithm whose memory traffic FlashAttention removes: S and P are N x N.
"""
from __future__ import annotations

import torch

from ._checks import check_attention_inputs


def causal_mask(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """Boolean (seq_q, seq_k) mask, True where query i may attend to key j.

    Aligned to the bottom-right diagonal (flash-attn >= 2.1, ``causal_lower_right``):
    query i sees key j when ``j <= i + seq_k - seq_q``. For seq_q == seq_k this is the
    usual lower triangle. With seq_q > seq_k the first ``seq_q - seq_k`` rows see no key::

        seq_q=4, seq_k=6          seq_q=6, seq_k=4
        1 1 1 0 0 0               0 0 0 0
        1 1 1 1 0 0               0 0 0 0
        1 1 1 1 1 0               1 0 0 0
        1 1 1 1 1 1               1 1 0 0
                                  1 1 1 0
                                  1 1 1 1
    """
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    return cols <= rows + (seq_k - seq_q)


def dense_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    return_scores: bool = False):
    """softmax(q kᵀ · scale) v, materialising the full score matrix.

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k: (batch, heads, seq_k, head_dim).
        v: (batch, heads, seq_k, head_dim).
        causal: mask with :func:`causal_mask` (bottom-right aligned). A query row that
            sees no key gets an all-zero probability row and a zero output.
        scale: multiplies the scores; defaults to 1/sqrt(head_dim).
        return_scores: also return S (masked entries -inf) and P, both (..., seq_q, seq_k).

    Returns:
        out (..., seq_q, head_dim), or (out, S, P) if ``return_scores``.
    """
    scale = check_attention_inputs("dense_attention", q, k, v, causal=causal, scale=scale)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk): the N^2 memory
    if causal:
        visible = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        s = s.masked_fill(~visible, float("-inf"))
        # Rows with no visible key would be softmax(-inf, ..., -inf) = NaN; define them as 0.
        empty_row = ~visible.any(dim=-1, keepdim=True)  # (Nq, 1)
        p = torch.softmax(s.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)
    else:
        p = torch.softmax(s, dim=-1)  # (B, H, Nq, Nk): a second N^2 tensor
    out = p @ v  # (B, H, Nq, D)
    return (out, s, p) if return_scores else out
