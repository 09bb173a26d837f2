"""Launch configurations: block sizes, warps and pipeline stages, chosen per head dim.

A :class:`FlashConfig` is plain data, so a caller (or a benchmark) can pass its own to
``flash_attention(..., config=...)``; :func:`default_config` is the table that ships and
that the compile tests build for every GPU target.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass

INPUT_PRECISIONS = ("tf32", "ieee")
# 1 / ln(2): exp(x) = 2^(x * LOG2E). The kernels fold it into the softmax scale and use exp2,
# which GPUs compute in one instruction; every kernel reads it from here.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# The kernels keep the log-sum-exp in base 2, lse2 = m_i + log2(l_i), from the forward that
# writes it to the backward that reads it: a row that sees one key has lse2 = its score exactly,
# so the backward's p = 2^(s - lse2) is exactly 1. Converting to the natural log and back would
# move lse2 by an ulp, and every p of the row by several of theirs. Functions named *_base2 take
# or return lse2; every other function, and everything public, speaks the natural log.
def lse_natural(lse2: torch.Tensor) -> torch.Tensor:
    """The natural-log lse of the kernels' base-2 one, float32 as callers see it (-inf stays -inf);
    the teaching kernels' lse2 is float64 (forward._finish says why): converted, then rounded once."""
    return (lse2 * LN2).float()


def lse_base2(lse: torch.Tensor) -> torch.Tensor:
    """The kernels' base-2 lse from a natural-log one (one rounding: within an ulp of the forward's)."""
    return lse.float() * LOG2E


@dataclass(frozen=True)
class FlashConfig:
    """Tile sizes and launch options of the forward and the two backward kernels.

    block_q / block_k: query rows (BLOCK_Q) and key rows (BLOCK_K) per tile, powers of two
    >= 16 (tl.dot's minimum). input_precision: how a float32 ``tl.dot`` multiplies on a GPU,
    "tf32" (tensor cores, ~1e-3 relative error) or "ieee" (exact float32 on CUDA cores: for
    checking, not speed; the shipped tiles are sized for tensor cores and spill registers in
    this mode). 16-bit inputs always use tensor cores; the CPU interpreter computes in float32.
    bwd_dq_transposed: in the ladder's backward that adds dQ from the dK/dV kernel ("bulk"),
    compute each dQ tile transposed (K^T dS^T, whose long side is the head dim rather than the
    few query rows) into a transposed float32 dQ; the other backwards have no such tile.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    input_precision: str = "tf32"
    bwd_dq_transposed: bool = False

    def __post_init__(self):
        def whole(value):
            return isinstance(value, int) and not isinstance(value, bool)

        checks = ((("block_q", "block_k", "bwd_block_q", "bwd_block_k"),
                   lambda v: whole(v) and v >= 16 and not v & (v - 1), "a power of two >= 16"),
                  (("num_warps", "bwd_num_warps"), lambda v: v in (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16"),
                  (("num_stages", "bwd_num_stages"), lambda v: whole(v) and v >= 1, "an int >= 1"),
                  (("bwd_dq_transposed",), lambda v: isinstance(v, bool), "True or False"),
                  (("input_precision",), lambda v: v in INPUT_PRECISIONS, f"one of {INPUT_PRECISIONS}"))
        for names, ok, want in checks:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"FlashConfig: '{name}' must be {want}, got {getattr(self, name)!r}")


def seq_bucket(seq_q: int, seq_k: int) -> int:
    """The sequence-length bucket an autotuned choice is kept for: the power of two at or above the
    longer sequence, clamped to [1024, 16384] (the best tiles change with N: two H200 runs' tiles chosen
    at N = 16k lost at 4k; why not one per length: :mod:`flashlib.ladder.autotune`)."""
    n = max(int(seq_q), int(seq_k), 1)
    return min(max(1 << (n - 1).bit_length(), 1024), 16384)


def head_dim_pad(head_dim: int) -> int:
    """The power of two >= head_dim (and >= 16) the kernels compute with; the pad is masked."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


def value_dim(head_dim: int, head_dim_v: int) -> dict:
    """The kernels' HEAD_DIM_V and HEAD_DIM_V_PAD for v's head dim: HEAD_DIM_V None where it is q's,
    so that v's columns are masked with HEAD_DIM itself and the kernels compile as they did before v
    had a head dim of its own (a second run-time dim moved registers by up to 27: data/bench/LOG.md)."""
    return dict(HEAD_DIM_V=None if head_dim_v == head_dim else int(head_dim_v),
                HEAD_DIM_V_PAD=head_dim_pad(head_dim_v))


# (BLOCK_Q, BLOCK_K, warps, stages) of the forward, then of both backward kernels, per padded
# head dim, chosen so that no kernel spills registers (checked by tests/test_kernel_compile.py).
# Hopper's wgmma needs the rows of a dot (BLOCK_Q forward and dQ, BLOCK_K for dK/dV) to be
# >= 64; where such tiles would spill or overflow shared memory, 32-row tiles use mma.sync.
_AMPERE_16BIT = {32: ((128, 64, 4, 3), (64, 64, 4, 2)),
                 64: ((128, 64, 4, 3), (64, 64, 4, 1)),
                 128: ((128, 64, 8, 2), (64, 64, 8, 2)),
                 256: ((64, 32, 8, 1), (32, 32, 8, 1))}
# float32 at head dim 128 on 4 warps: with 8, a tile this short is held by two warps at once
# and every score's exponential is computed twice or more (compile.exponentials_per_score)
_AMPERE_FP32 = {64: ((64, 32, 4, 3), (32, 32, 4, 1)),
                128: ((64, 32, 4, 2), (32, 32, 4, 1)),
                256: ((32, 16, 8, 1), (16, 16, 8, 1))}
_HOPPER_16BIT = {64: ((128, 64, 4, 3), (64, 64, 8, 2)),
                 128: ((128, 64, 8, 2), (64, 64, 8, 2)),
                 256: ((64, 32, 8, 1), (32, 32, 8, 1))}
_HOPPER_FP32 = {64: ((64, 32, 4, 3), (32, 64, 4, 2)),
                128: ((64, 32, 4, 2), (32, 32, 4, 1)),
                256: ((64, 16, 8, 1), (32, 32, 8, 1))}
# MLA's q/k 192 (pad 256), v 128 on Hopper in 16 bits: the 256 row's backward (32, 32, 8, 1) held
# 128 registers a thread in the causal dQ kernel and spilled (4 bytes, both Tritons); on 4 warps
# dK/dV takes 236 and dQ 196, no spill (data/bench/LOG.md, 2026-12-02)
_HOPPER_16BIT_MLA_BACKWARD = (32, 32, 4, 1)
# Turing: Triton emits no tensor-core instructions there (its dot falls back to FMA), and a
# block has 64 KiB of shared memory: small tiles, no pipelining. At head dim 64, 8 warps and 16-row
# backward tiles: with 4 warps and 32 rows a mask function that reads data (notebook 09's
# documents) spilled registers in all three kernels (tests/test_kernel_compile.py's T4 specs).
_TURING = {64: ((32, 32, 8, 1), (16, 16, 8, 1)),
           128: ((32, 16, 4, 1), (16, 16, 8, 1)),
           256: ((16, 16, 4, 1), (16, 16, 16, 1))}


def default_config(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None = None,
                   head_dim_v: int | None = None) -> FlashConfig:
    """The shipped configuration for this head dim, dtype and GPU (capability None: interpreter);
    head_dim_v: v's head dim where it is its own (None: head_dim's)."""
    # the larger pad sizes the tiles: q and k tiles are (rows, pad of head_dim), v, acc, dO and dV
    # (rows, pad of head_dim_v), so the row of the larger one holds every tile at most that wide
    # (MLA's 192/128: the 256 row; tests/test_kernel_compile.py compiles it)
    pads = (head_dim_pad(head_dim), head_dim_pad(head_dim if head_dim_v is None else head_dim_v))
    wide = dtype == torch.float32
    if capability is not None and tuple(capability) < (8, 0):
        table = _TURING
    elif capability is not None and tuple(capability) >= (9, 0):
        table = _HOPPER_FP32 if wide else _HOPPER_16BIT
    else:  # Ampere and Ada; the interpreter uses their forward tiles (bigger tiles, fewer Python steps)
        table = _AMPERE_FP32 if wide else _AMPERE_16BIT
    (bm, bn, w, st), (bbm, bbn, bw, bst) = table.get(max(pads), table[max(64, *pads)])
    if table is _HOPPER_16BIT and pads == (256, 128):
        bbm, bbn, bw, bst = _HOPPER_16BIT_MLA_BACKWARD
    if capability is None:
        # the backward's tiles are the forward's: the interpreter's dot (numpy's) rounds a score
        # by the shape of its tile, and the backward must recompute exactly the forward's scores
        # (a row that sees one key then has p = 2^(s - lse2) = 1 exactly)
        bbm, bbn = bm, bn
    return FlashConfig(block_q=bm, block_k=bn, num_warps=w, num_stages=st,
                       bwd_block_q=bbm, bwd_block_k=bbn, bwd_num_warps=bw, bwd_num_stages=bst)
