"""Which tiles the fused kernels visit: the loop bounds of forward.py and backward.py in Python.

Used by notebook 06's picture and checked against the tiled reference's skipping rule, so
a figure of the schedule shows what the kernel does, not a separate idea of it.
"""
from __future__ import annotations

import math

from ..rules import Visibility, key_range_end


def schedule(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool):
    """(query blocks, key blocks) boolean grid: True where the forward computes the tile. A query block's
    program (the forward's, dQ's) loops over key tiles up to one past the last key its last row sees
    (the rule of flashlib.rules, as _key_range_end in Triton)."""
    ends = [math.ceil(key_range_end(q0, min(q0 + block_q, seq_q), seq_q, seq_k, Visibility(causal=causal)) / block_k)
            for q0 in range(0, seq_q, block_q)]
    return [[j < end for j in range(math.ceil(seq_k / block_k))] for end in ends]
