"""The course's first example, replayed in a terminal: ``python -m flashlib demo``.

Six tokens, width four, 2x2 tiles: one query block at a time meets three key/value
tiles while m_i, l_i and acc are carried along. Every check below is computed.
"""
from __future__ import annotations

import torch

from .dense import dense_attention
from .backward import tiled_attention
from .tiled import trace_tiled_attention

TILE_SIZES = ((1, 1), (2, 2), (4, 4), (5, 5), (6, 6))  # 4 and 5 leave uneven last tiles


def example_inputs(seq: int = 6, dim: int = 4, seed: int = 0):
    """q, k, v of shape (1, seq, dim), float32 randn drawn in that order after manual_seed."""
    torch.manual_seed(seed)
    q = torch.randn(1, seq, dim)
    k = torch.randn(1, seq, dim)
    v = torch.randn(1, seq, dim)
    return q, k, v


def check_tile_sizes(q, k, v, tile_sizes=TILE_SIZES):
    """Largest |tiled - dense| over the tile sizes and both loop orders."""
    ref = dense_attention(q, k, v)
    return max((tiled_attention(q, k, v, block_q=bq, block_k=bk, loop=loop) - ref).abs().max().item()
               for bq, bk in tile_sizes for loop in ("query", "key"))


def check_large_logits(q, k, v, magnitude: float = 1e4):
    """Scores of about ±magnitude: naive exp overflows, the running max does not.

    Returns (largest |score|, tiled output finite?, |tiled - float64 dense|, naive exp overflows?)."""
    q_big = q / q.abs().max() * magnitude ** 0.5
    k_big = k / k.abs().max() * magnitude ** 0.5
    s = q_big @ k_big.transpose(-2, -1)
    tiled = tiled_attention(q_big, k_big, v, block_q=2, block_k=2, scale=1.0)
    ref = dense_attention(q_big.double(), k_big.double(), v.double(), scale=1.0)
    overflow = bool(torch.isinf(torch.exp(s)).any())
    return s.abs().max().item(), bool(torch.isfinite(tiled).all()), (tiled.double() - ref).abs().max().item(), overflow


def check_gradients(q, k, v):
    """Largest |grad_tiled - grad_dense| for dq, dk, dv with a random upstream gradient."""
    torch.manual_seed(1)
    dout = torch.randn_like(q)
    grads = []
    for fn in (lambda a, b, c: tiled_attention(a, b, c, block_q=2, block_k=2), dense_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(dout)
        grads.append([t.grad for t in leaves])
    return [(a - b).abs().max().item() for a, b in zip(*grads)]


def run(print_fn=print, tol: float = 1e-5) -> bool:
    q, k, v = example_inputs()
    dense = dense_attention(q, k, v)
    tiled = tiled_attention(q, k, v, block_q=2, block_k=2)
    print_fn("flashlib demo: 6 tokens, width 4, 2x2 tiles (torch.manual_seed(0); q, k, v = randn [1, 6, 4])")
    print_fn(f"stacked dense and tiled outputs: {list(torch.stack([dense, tiled]).shape)}")
    print_fn("")
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2)
    print_fn(f"{'step':>4}  {'query rows':>10}  {'key cols':>8}  {'tile':>4}  {'full':>4}  max|partial - final|")
    for st in trace.steps:
        print_fn(f"{st.index:>4}  {st.rows[0]:>4}-{st.rows[1] - 1:<5}  {st.cols[0]:>3}-{st.cols[1] - 1:<4}  "
                 f"{st.tile_elements:>4}  {st.full_elements:>4}  {st.distance:.4g}")
    print_fn("Earlier score tiles are discarded; only their running statistics and weighted output contribution remain.")
    print_fn("")
    results = []
    err = check_tile_sizes(q, k, v)
    sizes = ", ".join(f"{a}x{b}" for a, b in TILE_SIZES)
    results.append((err <= tol, f"tiled equals dense for tiles {sizes} (4 and 5 leave uneven last tiles), "
                                f"both loop orders: max |diff| = {err:.3g}"))
    smax, finite, err, overflow = check_large_logits(q, k, v)
    results.append((finite and err <= tol and overflow,
                    f"large logits (|score| up to {smax:.4g}; naive exp overflows: {overflow}): tiled output "
                    f"finite: {finite}, max |diff| from float64 dense = {err:.3g}"))
    errs = check_gradients(q, k, v)
    results.append((max(errs) <= tol, "gradients match autograd through dense attention: max |diff| "
                                      + ", ".join(f"{n} {e:.3g}" for n, e in zip(("dq", "dk", "dv"), errs))))
    for ok, text in results:
        print_fn(f"[{'pass' if ok else 'FAIL'}] {text}")
    return all(ok for ok, _ in results)
