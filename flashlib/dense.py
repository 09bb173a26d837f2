"""Standard attention: materialise the (seq_q, seq_k) scores S and probabilities P.

This is the reference every faster path in flashlib is checked against, and the
algorithm whose memory traffic FlashAttention removes: S and P are N x N.

Which pairs may attend is said once, by :class:`flashlib.rules.Visibility`: the causal rule, a sliding
window and a mask function, ANDed. :func:`attention_mask` writes it out densely; the tiled
reference, the block masks (:mod:`flashlib.masks`) and the kernels' tests all ask it.
"""
from __future__ import annotations

import math

import torch

from .machinery.checks import batch_and_heads, check_chunk, check_mask_mod, check_window  # noqa: F401 (re-exported)
from .machinery.options import check_options
from .rules import Visibility


def head_indices(batch: int, heads: int, device=None):
    """(b, h) index tensors shaped (batch, 1, 1, 1) and (1, heads, 1, 1), as a mask function gets them."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    return b, torch.arange(heads, device=device).view(1, -1, 1, 1)


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
    return Visibility(causal=True).pairs(rows, cols, seq_q, seq_k)


def attention_mask(seq_q: int, seq_k: int, *, causal: bool = False, window=None, mask_mod=None,
                   batch: int = 1, heads: int = 1, device=None, attention_chunk=None) -> torch.Tensor:
    """Boolean (batch, heads, seq_q, seq_k) mask, True where query i of head h in batch row b
    may attend to key j (see :class:`Visibility`); an expanded view, for inspection::

        seq_q = seq_k = 6, causal, window=(2, 0)      prefix_lm(2): mask_mod
        1 0 0 0 0 0                                   1 1 0 0 0 0
        1 1 0 0 0 0                                   1 1 0 0 0 0
        1 1 1 0 0 0                                   1 1 1 0 0 0
        0 1 1 1 0 0                                   1 1 1 1 0 0
        0 0 1 1 1 0                                   1 1 1 1 1 0
        0 0 0 1 1 1                                   1 1 1 1 1 1
    """
    fn = "attention_mask"
    rule = Visibility(bool(causal), check_window(fn, window), check_mask_mod(fn, mask_mod, device, built_on=True),
                      check_chunk(fn, attention_chunk))
    b, h = head_indices(batch, heads, device)
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    visible = rule.pairs(rows, cols, seq_q, seq_k, b, h)
    if visible is None:
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    return visible.expand(batch, heads, seq_q, seq_k)


def expand_kv(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Grouped-query attention: (..., kv_heads, seq, d) -> (..., q_heads, seq, d), query head h
    reading kv head h // (q_heads // kv_heads). A tensor with q's heads is returned as it is."""
    if t.ndim < 3 or t.shape[-3] == q_heads:
        return t
    return t.repeat_interleave(q_heads // t.shape[-3], dim=-3)


def dense_attention(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
                    softcap: float | None = None, mask_mod=None, sinks=None, score_mod=None,
                    return_scores: bool = False, attention_chunk=None):
    """softmax(q kᵀ · scale) v, materialising the full score matrix.

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k: (batch, kv_heads, seq_k, head_dim); kv_heads divides heads (grouped-query attention:
            query head h reads kv head h // (heads // kv_heads)).
        v: (batch, kv_heads, seq_k, head_dim_v); head_dim_v may differ from q's and k's (MLA's
            128 beside 192); the output has it.
        causal: mask with :func:`causal_mask` (bottom-right aligned). A query row that
            sees no key gets an all-zero probability row and a zero output.
        scale: multiplies the scores; defaults to 1/sqrt(head_dim).
        window: (left, right): query i sees keys i + o - left .. i + o + right, o = seq_k -
            seq_q; -1 for no limit on a side. ANDed with causal and mask_mod (:class:`Visibility`).
        attention_chunk: C > 0: chunked local attention (Llama 4): query i, at p = i + o, sees
            key j only when j // C == p // C, ANDed with the rest; 0 or None for no chunks.
        softcap: c > 0 caps the scores: s = c * tanh(scale * q kᵀ / c) (Gemma 2).
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool tensor, called once on index tensors.
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`), called
            once on the scaled scores and index tensors, before the mask; differentiable, the
            tensors it captures included (plain autograd). Not with softcap (compose them).
        sinks: attention sinks, (heads,): one more score per row, sinks[h] for every row of head
            h, with no value: it joins each softmax as an extra column that is dropped afterwards
            (so the row's probabilities sum to less than 1). Differentiable.
        return_scores: also return S (masked entries -inf) and P, both (..., seq_q, seq_k), the
            sink's column dropped.

    Returns:
        out (..., seq_q, head_dim), or (out, S, P) if ``return_scores``.
    """
    options = check_options("dense_attention", q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            mask_mod=mask_mod, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk,
                            value_dim=True)
    rule, scoring, sinks, scale = options.visibility, options.scoring, options.sinks, options.scale
    heads = q.shape[-3] if q.ndim >= 3 else 1
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk): the N^2 memory
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    if scoring.score_mod is not None:  # on a (B, H, Nq, Nk) view of s, as flex_attention calls it
        s = scoring.modded(s.reshape(*batch_and_heads(q.shape), seq_q, seq_k)).reshape(s.shape)
    if not rule.everything:  # (without a rule no index tensor is made: notebook 01 measures this peak)
        rows, cols = torch.arange(seq_q, device=q.device)[:, None], torch.arange(seq_k, device=q.device)[None, :]
        visible = rule.pairs(rows, cols, seq_q, seq_k, *head_indices(*batch_and_heads(q.shape), q.device))
    if not rule.everything:
        visible = visible.expand(*batch_and_heads(q.shape), seq_q, seq_k).reshape(*q.shape[:-2], seq_q, seq_k)
        s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink's column, sinks[h] on every row of head h, dropped after the softmax
        column = sinks.to(s.dtype).reshape((heads, 1, 1)[3 - min(s.ndim, 3):]).expand(*s.shape[:-1], 1)
        scores = torch.cat((s, column), dim=-1)
        empty_row = (scores == float("-inf")).all(dim=-1, keepdim=True)  # only with a sink of -inf
        p = torch.softmax(scores.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)[..., :seq_k]
    elif not rule.everything:
        # Rows with no visible key would be softmax(-inf, ..., -inf) = NaN; define them as 0.
        empty_row = ~visible.any(dim=-1, keepdim=True)
        p = torch.softmax(s.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)
    else:
        p = torch.softmax(s, dim=-1)  # (B, H, Nq, Nk): a second N^2 tensor
    out = p @ v  # (B, H, Nq, D)
    return (out, s, p) if return_scores else out
