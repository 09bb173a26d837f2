# A worked solution of the lab tiled_backward (notebook 04): gradients from lse, one tile of P at a time.
import math

import torch


def tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal):
    """(dq, dk, dv) of attention, recomputing each (block_q, block_k) tile of P from lse; never the whole P."""
    seq_q, seq_k, scale = q.shape[-2], k.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(dim=-1)  # (batch, heads, seq_q): rowsum(dO ∘ O), softmax's Jacobian term
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key: p = exp(-inf - inf) = 0
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for k0 in range(0, seq_k, block_k):  # outer loop over key tiles, as the dK/dV kernel does
        k1 = min(k0 + block_k, seq_k)
        k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]
        offs_k = torch.arange(k0, k1)[None, :]
        for q0 in range(0, seq_q, block_q):
            q1 = min(q0 + block_q, seq_q)
            q_blk, do_blk = q[..., q0:q1, :], dout[..., q0:q1, :]
            s = q_blk @ k_tile.transpose(-2, -1) * scale  # (batch, heads, rows, cols)
            if causal:  # bottom-right: query i sees key j when j <= i + seq_k - seq_q
                offs_q = torch.arange(q0, q1)[:, None]
                s = s.masked_fill(offs_k > offs_q + seq_k - seq_q, float("-inf"))
            p = torch.exp(s - lse[..., q0:q1, None])  # exactly the forward's probabilities
            dv[..., k0:k1, :] += p.transpose(-2, -1) @ do_blk
            dp = do_blk @ v_tile.transpose(-2, -1)
            ds = p * (dp - delta[..., q0:q1, None])
            dq[..., q0:q1, :] += ds @ k_tile * scale
            dk[..., k0:k1, :] += ds.transpose(-2, -1) @ q_blk * scale
    return dq, dk, dv
