"""Independent float64 references for the tests: explicit loops, no flashlib code."""
import math

import torch


def visible(i: int, j: int, seq_q: int, seq_k: int, causal: bool) -> bool:
    """Bottom-right aligned causal rule, written out per pair."""
    return (not causal) or j <= i + seq_k - seq_q


def loop_attention(q, k, v, causal=False, scale=None):
    """Attention for 2-D (seq, dim) float64 tensors, one query row at a time."""
    seq_q, seq_k, d = q.shape[0], k.shape[0], q.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(seq_q, v.shape[1], dtype=torch.float64)
    lse = torch.full((seq_q,), float("-inf"), dtype=torch.float64)
    for i in range(seq_q):
        cols = [j for j in range(seq_k) if visible(i, j, seq_q, seq_k, causal)]
        if not cols:
            continue
        s = torch.stack([(q[i].double() * k[j].double()).sum() * scale for j in cols])
        lse[i] = torch.logsumexp(s, 0)
        w = torch.exp(s - lse[i])
        out[i] = (w[:, None] * v[cols].double()).sum(0)
    return out, lse


def mask_matrix(seq_q, seq_k, causal):
    return torch.tensor([[visible(i, j, seq_q, seq_k, causal) for j in range(seq_k)] for i in range(seq_q)],
                        dtype=torch.bool).reshape(seq_q, seq_k)
