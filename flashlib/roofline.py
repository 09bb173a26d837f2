"""What attention costs: FLOPs, HBM bytes, arithmetic intensity and the roofline (notebook 08).

The arithmetic is the usual convention of FlashAttention's papers:

    forward FLOPs   4 · B · H · N_q · N_k · d     (two matmuls, 2 FLOPs per multiply-add)
                    halved when causal            (about half the scores are computed)
    backward FLOPs  2.5 × forward                 (five matmuls instead of two)
    forward + backward = 3.5 × forward

A roofline says how fast a kernel could be: at best the larger of FLOPs / matmul rate
and bytes moved / memory bandwidth. The launch model says how evenly a causal launch
fills the machine. Nothing here needs a GPU or a recorded run.
"""
from __future__ import annotations

from . import iomodel

PASSES = ("fwd", "bwd", "fwd_bwd")
_PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"roofline: argument '{name}' must be an int >= 1, got {value!r}")


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, *,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of attention: 4·B·H·N_q·N_k·d forward, halved if causal; mode fwd, bwd or fwd_bwd."""
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k),
                        ("head_dim", head_dim)):
        _positive_int(name, value)
    if mode not in PASSES:
        raise ValueError(f"roofline: argument 'mode' must be one of {PASSES}, got {mode!r}")
    forward = 4.0 * batch * heads * seq_q * seq_k * head_dim / (2 if causal else 1)
    return forward * _PASS_FACTOR[mode]


def tflops(flops: float, milliseconds: float) -> float:
    """Rate in TFLOP/s of ``flops`` done in ``milliseconds``."""
    if not milliseconds > 0:
        raise ValueError(f"roofline: argument 'milliseconds' must be > 0, got {milliseconds!r}")
    return flops / (milliseconds * 1e-3) / 1e12


BYTE_COUNTS = ("standard", "flash2", "minimum")


def attention_bytes(batch: int, heads: int, n: int, head_dim: int, *, element_size: int = 2,
                    block_q: int = 128, method: str = "flash2") -> int:
    """HBM bytes of one forward, for every (batch, head), counted three ways:

    "standard"  S and P written and read back (notebook 01's table);
    "flash2"    the IO model of the kernels' order: Q once, K and V once per query block of
                ``block_q`` rows, O and the log-sum-exp once; every re-read counted as HBM traffic;
    "minimum"   every input read once and every output written once: what no kernel can go
                below, and what a cache that keeps K and V between query blocks approaches.
    """
    _positive_int("batch", batch)
    _positive_int("heads", heads)
    if method == "flash2":
        per_head = iomodel.flash2_attention_io(n, head_dim, block_q, element_size).bytes
    elif method == "standard":
        per_head = iomodel.standard_attention_io(n, head_dim, element_size).bytes
    elif method == "minimum":
        per_head = (4 * n * head_dim + n) * element_size  # Q, K, V read; O and lse written
    else:
        raise ValueError(f"roofline: argument 'method' must be one of {BYTE_COUNTS}, got {method!r}")
    return batch * heads * per_head


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved: above the ridge point (rate / bandwidth) a kernel is compute bound."""
    if not nbytes > 0:
        raise ValueError(f"roofline: argument 'nbytes' must be > 0, got {nbytes!r}")
    return flops / nbytes


def roofline_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """Least possible time in ms: the larger of compute time and memory time."""
    if not peak_tflops > 0 or not bandwidth_gbps > 0:
        raise ValueError(f"roofline: 'peak_tflops' and 'bandwidth_gbps' must be > 0, got "
                         f"{peak_tflops!r} and {bandwidth_gbps!r}")
    return max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)) * 1e3


def launch_makespan(durations, slots: int) -> float:
    """Time to run programs of the given durations, started in launch order, each on the
    first slot to come free: a model of how a GPU hands thread blocks to its SMs."""
    import heapq

    _positive_int("slots", slots)
    free = [0.0] * slots
    end = 0.0
    for duration in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + duration)
        end = max(end, start + duration)
    return end


def causal_launch_model(n: int, *, block: int = 64, tokens: int = 16384, hidden: int = 2048, head_dim: int = 128,
                        slots: int = 264) -> dict:
    """The causal forward's launch, by the model of :func:`launch_makespan`: query block m of a
    square causal problem folds m + 1 key tiles (BLOCK_Q = BLOCK_K = block), one launch holds
    every (batch, head), batch x n = tokens and heads x head_dim = hidden (the ladder's grid).
    Returns the makespan over the ideal (total work / slots) in launch order and with each
    head's longest blocks first (rung 4)."""
    for name, value in (("n", n), ("block", block), ("slots", slots)):
        _positive_int(name, value)
    heads = max(1, tokens // n) * max(1, hidden // head_dim)
    per_head = [m + 1 for m in range(-(-n // block))]
    ideal = heads * sum(per_head) / slots
    return {order: launch_makespan((w for _ in range(heads) for w in blocks), slots) / ideal
            for order, blocks in (("in_order", per_head), ("longest_first", per_head[::-1]))}


# Hopper's warpgroup product (wgmma): four warps compute a tile of at least 64 rows together;
# a product with fewer rows runs on the older per-warp mma.sync
WGMMA_ROWS = 64


def backward_products(block_q: int, block_k: int, head_dim: int, dq_transposed: bool = False) -> list[tuple]:
    """The five matrix products of one (query tile, key tile) pair in the fused backward (dQ
    added from the dK/dV kernel), as (product, rows, columns, inner). S^T, dV, dP^T and dK
    have the key tile's rows; dQ has the query tile's, or, built transposed, the head dim's."""
    m, n, d = block_q, block_k, head_dim
    dq = ("dQ^T = K^T dS^T", d, m, n) if dq_transposed else ("dQ = dS K", m, d, n)
    return [("S^T = K Q^T", n, m, d), ("dV += P^T dO", n, d, m), ("dP^T = V dO^T", n, m, d),
            ("dK += dS^T Q", n, d, m), dq]
