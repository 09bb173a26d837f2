# A worked solution of the lab tiled_forward (notebook 03): FlashAttention-2's loop order in PyTorch.
import math

import torch


def tiled_forward(q, k, v, block_q, block_k, causal):
    """softmax(q kᵀ / sqrt(d)) v, holding one (block_q, block_k) tile of scores at a time; returns (out, lse)."""
    seq_q, seq_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)                      # (batch, heads, seq_q, d)
    lse = q.new_full(q.shape[:-1], float("-inf"))  # (batch, heads, seq_q)
    for q0 in range(0, seq_q, block_q):
        q1 = min(q0 + block_q, seq_q)  # the last block may be shorter
        q_blk = q[..., q0:q1, :]       # stays resident for the whole inner loop
        m_i = q.new_full(q_blk.shape[:-1], float("-inf"))  # (batch, heads, rows)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_blk)
        offs_q = torch.arange(q0, q1)[:, None]
        # causal, bottom-right: query i sees key j when j <= i + seq_k - seq_q; later tiles are skipped
        k_end = min(q1 + seq_k - seq_q, seq_k) if causal else seq_k
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, seq_k)
            s = q_blk @ k[..., k0:k1, :].transpose(-2, -1) * scale  # (batch, heads, rows, cols): one tile
            if causal:
                offs_k = torch.arange(k0, k1)[None, :]
                s = s.masked_fill(offs_k > offs_q + seq_k - seq_q, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: exp(-inf - 0) = 0
            alpha = torch.exp(m_i - shift)  # rescales what was accumulated under the old max
            p = torch.exp(s - shift[..., None])
            l_i = alpha * l_i + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v[..., k0:k1, :]
            m_i = m_new
        seen = l_i > 0  # a row that saw no key keeps out = 0 and lse = -inf
        out[..., q0:q1, :] = acc / torch.where(seen, l_i, 1.0)[..., None]
        lse[..., q0:q1] = torch.where(seen, m_i + torch.log(l_i), float("-inf"))
    return out, lse
