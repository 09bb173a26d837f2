"""Which tiles the fused kernels visit: the loop bounds of forward.py and backward.py in Python.

Used by notebook 06's picture and checked against the tiled reference's skipping rule, so
a figure of the schedule shows what the kernel does, not a separate idea of it.
"""
from __future__ import annotations

import math

from ..rules import Visibility, key_range_end


def forward_key_blocks(start_m: int, seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool) -> int:
    """Key tiles the forward (and dQ) program of query block ``start_m`` loops over: up to one past
    the last key the block's last row sees (the rule of flashlib.rules, as _key_range_end in Triton)."""
    q0 = start_m * block_q
    hi = key_range_end(q0, min(q0 + block_q, seq_q), seq_q, seq_k, Visibility(causal=causal))
    return math.ceil(hi / block_k)


def schedule(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool):
    """(query blocks, key blocks) boolean grid: True where the forward computes the tile."""
    rows = math.ceil(seq_q / block_q)
    cols = math.ceil(seq_k / block_k)
    return [[j < forward_key_blocks(i, seq_q, seq_k, block_q, block_k, causal) for j in range(cols)]
            for i in range(rows)]
