"""A sliding window's cost in the plain-PyTorch reference, against full attention, on this CPU.

``python -m flashlib.bench.variants [--sizes N ...] [--window W] [--repeats R]``: the tiled
reference (:func:`flashlib.tiled_attention`, forward and backward, float32, B = H = 1, d = 64)
causal with window=(W, 0) beside causal attention without a window, at N = 4k, 8k, 16k and
W = 256, in one process, point after point: the median time of R runs, the peak memory of one
(:func:`flashlib.bench.peak_allocated_bytes`), and the tiles each computes (from its block mask).
The window's tiles, and so its time, grow like N·W, full attention's like N²; both keep O(N)
memory, since neither holds an N x N matrix.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..backward import tiled_attention
from ..tiled import block_mask
from .cpu import peak_allocated_bytes

SIZES = (4096, 8192, 16384)
WINDOW = 256
BLOCK = 256  # block_q = block_k: large enough that Python's per-tile overhead stays small
HEAD_DIM = 64


def _step(q, k, v, dout, window):
    """One forward and backward of the tiled reference, causal, with the window or without."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = tiled_attention(*leaves, block_q=BLOCK, block_k=BLOCK, causal=True, window=window)
    torch.autograd.grad(out, leaves, dout)


def tiles(n: int, window) -> int:
    """Tiles one pass computes: the block mask's partial and full ones."""
    counts = block_mask(n, n, block_q=BLOCK, block_k=BLOCK, causal=True, window=window).counts()
    return counts["partial"] + counts["full"]


def measure(n: int, window, repeats: int) -> dict:
    """Median seconds of ``repeats`` forward + backward steps, peak bytes of one, tiles computed."""
    g = torch.Generator().manual_seed(n)
    q, k, v, dout = (torch.randn(1, 1, n, HEAD_DIM, generator=g) for _ in range(4))  # (B, H, N, d)
    _step(q, k, v, dout, window)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(q, k, v, dout, window)
        times.append(time.perf_counter() - start)
    return dict(n=n, window=window, seconds=statistics.median(times),
                peak_bytes=peak_allocated_bytes(_step, q, k, v, dout, window), tiles=tiles(n, window))


def run(sizes=SIZES, window: int = WINDOW, repeats: int = 3, log=print) -> list[dict]:
    """[{n, full, window}] measured side by side, each a :func:`measure` row."""
    rows = []
    for n in sizes:
        full, windowed = measure(n, None, repeats), measure(n, (window, 0), repeats)
        rows.append(dict(n=n, full=full, window=windowed))
        log(format_row(rows[-1], window))
    return rows


HEADER = ("     N   full s  window s  time ratio  tiles ratio  N·w/(N²/2)   full MiB  window MiB")


def format_row(row: dict, window: int) -> str:
    full, windowed, n = row["full"], row["window"], row["n"]
    mib = 1 << 20
    return (f"{n:6d} {full['seconds']:8.2f} {windowed['seconds']:9.2f} {windowed['seconds'] / full['seconds']:11.3f}"
            f" {windowed['tiles'] / full['tiles']:12.3f} {n * window / (n * n / 2):11.3f}"
            f" {full['peak_bytes'] / mib:10.1f} {windowed['peak_bytes'] / mib:11.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench.variants", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="sequence lengths (default 4k 8k 16k)")
    parser.add_argument("--window", type=int, default=WINDOW, help="keys before each query (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (default 3)")
    args = parser.parse_args(argv)
    print(f"tiled reference, forward + backward, causal, float32, B = H = 1, d = {HEAD_DIM}, "
          f"tiles {BLOCK} x {BLOCK}: window ({args.window}, 0) against no window, {torch.get_num_threads()} threads")
    print(HEADER)
    run(args.sizes, args.window, args.repeats)


if __name__ == "__main__":
    main()
