"""Ring attention on CPU processes with gloo: world sizes 1-4 for one fixed total length.

    python -m flashlib.bench.ring [--seq 1152] [--heads 4] [--dim 64] [--layout zigzag]

For every world size a fresh ring of processes (:func:`flashlib.distributed.spawn`) runs
the forward and backward pass of ``ring_attention`` on the same seeded inputs. Reported:

  diff_out, diff_grad  largest |difference| to the one-process run (out; dq, dk, dv),
                       gathered over the ranks: the same attention, only rounded differently
  sent/step, model     bytes each rank posted per forward step, counted from the tensors
                       handed to isend, against 2 · batch · heads · local_seq · head_dim ·
                       element size (one K and one V shard)
  forward, backward    median seconds over ``repeats``, the slowest rank's (a ring is as slow
                       as its slowest member); the processes share this machine's cores

The times say little about a real cluster: here every "device" is a process on the same
CPU, and gloo copies through the loopback interface.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import distributed as ring


@dataclass
class RingPoint:
    """One world size of the measurement."""

    world_size: int
    local_seq: int
    diff_out: float          # max |out - out of one process|
    diff_grad: float         # max over dq, dk, dv of the same
    sent_per_step: list      # bytes each rank posted per forward step (rank 0; all ranks equal)
    model_per_step: int      # 2 · batch · heads · local_seq · head_dim · element size
    forward_s: float
    backward_s: float


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()  # start together: the ring waits for its slowest member anyway
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_worker(rank: int, world_size: int, q, k, v, dout, causal: bool, layout: str,
                 repeats: int) -> dict:
    """Run on each rank: one traced forward for the bytes, then timed forward and backward."""
    parts = [ring.shard(t, rank, world_size, layout=layout) for t in (q, k, v, dout)]
    comm = ring.RingComm()
    ring.ring_forward(*parts[:3], causal=causal, layout=layout, comm=comm)
    leaves = [p.clone().requires_grad_() for p in parts[:3]]

    def forward():
        return ring.ring_attention(*leaves, causal=causal, layout=layout)

    def backward():
        for leaf in leaves:
            leaf.grad = None
        forward().backward(parts[3])

    forward_s = _timed(forward, repeats)
    backward_s = _timed(backward, repeats) - forward_s  # backward() reruns the forward
    out = forward().detach()
    backward()
    return dict(out=out, grads=[leaf.grad for leaf in leaves], sent=comm.sent_bytes,
                forward_s=forward_s, backward_s=max(backward_s, 0.0))


def _max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def measure_ring(*, seq: int = 1152, batch: int = 1, heads: int = 4, head_dim: int = 64,
                 world_sizes=(1, 2, 3, 4), causal: bool = True, layout: str = "zigzag",
                 dtype=torch.float32, repeats: int = 3, seed: int = 0, timeout: float = 300.0):
    """Spawn one ring per world size on the same inputs; return a :class:`RingPoint` each."""
    pieces = math.lcm(*(w * (2 if layout == "zigzag" else 1) for w in world_sizes))
    if seq % pieces:
        raise ValueError(f"measure_ring: argument 'seq' must split evenly for every world size in "
                         f"{tuple(world_sizes)} with the {layout!r} layout, i.e. be a multiple of "
                         f"{pieces}; got {seq}")
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype) for _ in range(4))
    gathered = {}
    for world_size in world_sizes:
        ranks = ring.spawn(bench_worker, world_size, timeout=timeout,
                           args=(q, k, v, dout, causal, layout, repeats))
        out = ring.unshard([r["out"] for r in ranks], layout=layout)
        grads = [ring.unshard([r["grads"][i] for r in ranks], layout=layout) for i in range(3)]
        gathered[world_size] = (out, grads, ranks)
    base_out, base_grads, _ = gathered[min(world_sizes)]
    points = []
    for world_size, (out, grads, ranks) in gathered.items():
        local = seq // world_size
        points.append(RingPoint(
            world_size, local, _max_diff(out, base_out),
            max(_max_diff(a, b) for a, b in zip(grads, base_grads)), ranks[0]["sent"],
            2 * batch * heads * local * head_dim * q.element_size(),
            max(r["forward_s"] for r in ranks), max(r["backward_s"] for r in ranks)))
    return points


def format_points(points) -> str:
    """The measurement as a text table."""
    lines = [f"{'ranks':>5} {'local_seq':>9} {'diff_out':>9} {'diff_grad':>9} {'sent/step':>10} "
             f"{'model':>10} {'forward':>9} {'backward':>9}"]
    for p in points:
        sent = f"{p.sent_per_step[0]:,}" if p.sent_per_step else "-"
        model = f"{p.model_per_step:,}" if p.world_size > 1 else "-"  # one rank sends nothing
        same = all(s == p.model_per_step for s in p.sent_per_step)
        lines.append(f"{p.world_size:>5} {p.local_seq:>9} {p.diff_out:>9.2e} {p.diff_grad:>9.2e} "
                     f"{sent:>10} {model:>10} {p.forward_s:>8.3f}s {p.backward_s:>8.3f}s"
                     + ("" if same else "  (sent differs from the model)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1152,
                        help="total sequence length; a multiple of 24 splits for 1-4 ranks in both layouts")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="head_dim")
    parser.add_argument("--layout", choices=ring.LAYOUTS, default="zigzag")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    # Run as `python -m`, this file is __main__; the new processes need the worker by its
    # importable name, so measure through the module itself.
    from flashlib.bench import ring as module

    points = module.measure_ring(seq=args.seq, heads=args.heads, head_dim=args.dim, layout=args.layout,
                          causal=args.causal, repeats=args.repeats)
    print(f"ring attention on CPU processes (gloo), seq {args.seq}, heads {args.heads}, head_dim "
          f"{args.dim}, {args.layout}, causal={args.causal}, float32")
    print(module.format_points(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
