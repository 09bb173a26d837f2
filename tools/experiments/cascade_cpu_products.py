"""Why cascade decoding runs faster on a CPU than plain decoding although both do the same arithmetic.

    OMP_NUM_THREADS=1 python tools/experiments/cascade_cpu_products.py [--threads N] [--repeats N]

``python -m flashlib bench cascade`` (notebook 14) times plain decoding, every request's 4 query rows
per kv head over its own copy of a 16k prefix, against cascade decoding, the group's rows stacked
into one product over one copy. The FLOPs are the same. Two things differ: the bytes (plain reads B
copies of the prefix, cascade one) and the size of each matrix product (B products of 4 rows against
one of 4B rows). This script separates them on the prefix pass (the bench's shape: 16384 keys, 2 kv
heads of 64, 4 rows per kv head, float32, one tile, no mask):

  plain          one batched call, each request's 4 rows over its own copy  (B copies, 4-row products)
  shared copy    a call per request, 4 rows over the one shared copy         (1 copy,  4-row products)
  own copies     a call per request, 4 rows over its own copy                (B copies, 4-row products)
  stacked        one call, the 4B rows over the one copy: cascade's prefix   (1 copy, 4B-row products)

and, for each, the milliseconds of the scores' product (q k^T), of the softmax (max, exp, sum) and
of the output's product (p v), summed over its calls. Then the matrix products' rate alone (GFLOP/s)
as the rows per product grow, over one copy of the prefix. Medians of interleaved repeats.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flashlib.bench.cascade import measure_group

PREFIX, KV_HEADS, HEAD_DIM, ROWS = 16384, 2, 64, 4  # the bench's shape: 8 query heads over 2 kv heads


def _attend(q, k, v, scores, out, clock):
    """One tile of attention, q (..., rows, d) over all of k, v (..., keys, d), into buffers made once
    (scores (..., rows, keys), out (..., rows, d)): the seconds of each stage, the allocator left out."""
    t0 = clock()
    torch.matmul(q, k.transpose(-1, -2), out=scores).mul_(HEAD_DIM ** -0.5)
    t1 = clock()
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    l = scores.sum(-1, keepdim=True)
    t2 = clock()
    torch.matmul(scores, v, out=out).div_(l)
    t3 = clock()
    return t1 - t0, t2 - t1, t3 - t2


def _variants(batch: int, g: torch.Generator):
    q = torch.randn(batch, KV_HEADS, ROWS, HEAD_DIM, generator=g)  # a request's rows per kv head
    k, v = (torch.randn(1, KV_HEADS, PREFIX, HEAD_DIM, generator=g) for _ in range(2))  # the shared prefix
    own_k, own_v = (t.expand(batch, -1, -1, -1).contiguous() for t in (k, v))  # plain: a copy per request
    stacked = q.transpose(0, 1).reshape(1, KV_HEADS, batch * ROWS, HEAD_DIM)  # cascade's rows, kv head by kv head
    calls = {
        "plain": [(q, own_k, own_v)],
        "shared copy": [(q[b:b + 1], k, v) for b in range(batch)],
        "own copies": [(q[b:b + 1], own_k[b:b + 1], own_v[b:b + 1]) for b in range(batch)],
        "stacked": [(stacked, k, v)],
    }
    return {name: [(q, k, v, q.new_empty(*q.shape[:-1], PREFIX), torch.empty_like(q)) for q, k, v in parts]
            for name, parts in calls.items()}


def stages(batch: int, repeats: int, clock=time.perf_counter) -> dict:
    """{variant: (total, scores, softmax, output) median milliseconds} for a group of ``batch`` requests."""
    calls = _variants(batch, torch.Generator().manual_seed(0))
    times = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first round warms up
            for name, parts in calls.items():
                spent = [sum(stage) for stage in zip(*(_attend(*call, clock) for call in parts))]
                times[name].append(spent)
    result = {}
    for name, rounds in times.items():
        kept = rounds[1:]
        parts = [1e3 * statistics.median(r[i] for r in kept) for i in range(3)]
        result[name] = (1e3 * statistics.median(sum(r) for r in kept), *parts)
    return result


def product_rates(rows_list, repeats: int, clock=time.perf_counter) -> list:
    """[(rows, GFLOP/s of q k^T, GFLOP/s of p v)] over one copy of the prefix."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(KV_HEADS, PREFIX, HEAD_DIM, generator=g) for _ in range(2))
    out = []
    with torch.no_grad():
        for rows in rows_list:
            q = torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g)
            p = torch.rand(KV_HEADS, rows, PREFIX, generator=g)
            flops = 2 * KV_HEADS * rows * PREFIX * HEAD_DIM
            seconds = []
            for _ in range(repeats + 1):
                t0 = clock()
                torch.matmul(q, k.transpose(-1, -2))
                t1 = clock()
                torch.matmul(p, v)
                seconds.append((t1 - t0, clock() - t1))
            s1, s2 = (statistics.median(s[i] for s in seconds[1:]) for i in range(2))
            out.append((rows, flops / s1 / 1e9, flops / s2 / 1e9))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores; prefix {PREFIX}, {KV_HEADS} kv heads of {HEAD_DIM}, {ROWS} rows per request and "
          f"kv head, float32; median of {args.repeats}")
    for batch in args.groups:
        bench = measure_group(batch, repeats=args.repeats)
        print(f"\n{batch} requests. The bench (prefix and suffixes): plain {1e3 * bench['plain_s']:.2f} ms, cascade "
              f"{1e3 * bench['cascade_s']:.2f} ms, {bench['speedup']:.2f}x. The prefix pass, milliseconds:")
        print(f"  {'':12s} {'total':>7} {'products':>9} {'softmax':>8}   (q k^T, p v)")
        for name, (total, s, sm, o) in stages(batch, args.repeats).items():
            print(f"  {name:12s} {total:7.2f} {s + o:9.2f} {sm:8.2f}   ({s:.2f}, {o:.2f})")
    print(f"load {os.getloadavg()[0]:.2f}")
    print("\nmatrix products over one copy of the prefix: GFLOP/s as the rows per product grow")
    print(f"{'rows':>5} {'q k^T':>7} {'p v':>7}")
    for rows, a, b in product_rates((4, 8, 16, 32, 64, 128), args.repeats):
        print(f"{rows:5d} {a:7.1f} {b:7.1f}")


if __name__ == "__main__":
    main()
