"""Which tiles the fused kernels visit: the loop bounds of forward.py and backward.py in Python.

Used by notebook 06's picture and checked against the tiled reference's skipping rule, so
a figure of the schedule shows what the kernel does, not a separate idea of it.
"""
from __future__ import annotations

import math


def forward_key_blocks(start_m: int, seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool) -> int:
    """Key tiles the forward (and dQ) program of query block ``start_m`` loops over."""
    hi = seq_k
    if causal:  # as _key_range_end: one past the last key the block's last row sees
        hi = min(max((start_m + 1) * block_q + (seq_k - seq_q), 0), seq_k)
    return math.ceil(hi / block_k)


def schedule(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool):
    """(query blocks, key blocks) boolean grid: True where the forward computes the tile."""
    rows = math.ceil(seq_q / block_q)
    cols = math.ceil(seq_k / block_k)
    return [[j < forward_key_blocks(i, seq_q, seq_k, block_q, block_k, causal) for j in range(cols)]
            for i in range(rows)]
