"""HBM traffic of attention, counted exactly (FlashAttention paper, Theorem 2).

N tokens, head dim d, on-chip SRAM of M elements. Counts are elements read from and
written to HBM by one head; ``bytes`` multiplies by the element size.

standard attention (the paper's Algorithm 0):  Θ(N d + N²)
    read Q, K (2Nd)  -> write S (N²)
    read S (N²)      -> write P (N²)
    read P, V (N² + Nd) -> write O (Nd)
FlashAttention (Algorithm 1, key/value tiles outer):  Θ(N² d² / M)
    B_c = ceil(M / 4d),  B_r = min(ceil(M / 4d), d),  T_c = ceil(N / B_c)
    write O, l, m once (Nd + 2N); read every K_j, V_j once (2Nd);
    per key tile, read and write back every Q_i, O_i, l_i, m_i (3Nd + 4N per tile)
FlashAttention-2 (query blocks outer, the order of flashlib's kernel):
    read every Q_i once and K, V once per query block (Nd + T_r 2Nd); write O and lse once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class IOCount:
    """HBM accesses of one attention head, in elements and bytes."""

    reads: int
    writes: int
    element_size: int

    @property
    def total(self) -> int:
        return self.reads + self.writes

    @property
    def bytes(self) -> int:
        return self.total * self.element_size


def _check(n, d, element_size, sram_bytes=None):
    for name, value in (("n", n), ("d", d), ("element_size", element_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"iomodel: argument '{name}' must be an int >= 1, got {value!r}")
    if sram_bytes is not None:
        if isinstance(sram_bytes, bool) or not isinstance(sram_bytes, int) or sram_bytes < 4 * d * element_size:
            raise ValueError(
                f"iomodel: argument 'sram_bytes' must be an int >= 4 * d * element_size = "
                f"{4 * d * element_size} (room for one row of Q, K, V and O), got {sram_bytes!r}")


def standard_attention_io(n: int, d: int, element_size: int = 2) -> IOCount:
    """Algorithm 0: S and P make a round trip through HBM."""
    _check(n, d, element_size)
    reads = 2 * n * d + n * n + n * n + n * d   # Q, K; S; P, V
    writes = n * n + n * n + n * d              # S; P; O
    return IOCount(reads, writes, element_size)


def paper_block_sizes(d: int, sram_bytes: int, element_size: int = 2) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1: B_c = ceil(M / 4d), B_r = min(ceil(M / 4d), d)."""
    _check(1, d, element_size, sram_bytes)
    m = sram_bytes // element_size
    block_c = math.ceil(m / (4 * d))
    return min(block_c, d), block_c


def flash_attention_io(n: int, d: int, sram_bytes: int, element_size: int = 2) -> IOCount:
    """Algorithm 1 with the paper's block sizes; exact for uneven last tiles too."""
    _check(n, d, element_size, sram_bytes)
    _, block_c = paper_block_sizes(d, sram_bytes, element_size)
    t_c = math.ceil(n / block_c)
    reads = 2 * n * d + t_c * (2 * n * d + 2 * n)       # K_j, V_j once; Q_i, O_i, l_i, m_i per tile
    writes = n * d + 2 * n + t_c * (n * d + 2 * n)      # init O, l, m; O_i, l_i, m_i per tile
    return IOCount(reads, writes, element_size)


def flash2_attention_io(n: int, d: int, block_q: int, element_size: int = 2) -> IOCount:
    """Query-block-outer order: Q and O touch HBM once, K and V once per query block."""
    _check(n, d, element_size)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q < 1:
        raise ValueError(f"iomodel: argument 'block_q' must be an int >= 1, got {block_q!r}")
    t_r = math.ceil(n / block_q)
    reads = n * d + t_r * 2 * n * d      # Q once; K, V per query block
    writes = n * d + n                   # O and lse once
    return IOCount(reads, writes, element_size)
