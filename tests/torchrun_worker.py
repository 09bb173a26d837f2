"""One rank of ring attention under torchrun, for tests/test_torchrun.py:

    python -m torch.distributed.run --standalone --nproc_per_node 3 tests/torchrun_worker.py OUT \
        [--fail-rank R --fail-when before|during]

Every rank builds the same seeded float64 (batch, heads, seq, head_dim) q, k, v and upstream
gradient, takes its shard, runs ``flashlib.distributed.ring_attention`` forward and backward
for both layouts, causal and not, and saves its shards of out, dq, dk, dv to OUT/rank<R>.pt;
the test unshards them and compares them with one process's dense attention.

``--fail-rank R`` makes rank R raise on purpose, before the first ring or inside its second
block computation, to show how long the others take to stop.
"""
from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from flashlib import distributed as fd

BATCH, HEADS, CHUNK, DIM = 2, 2, 3, 8  # the sequence is 2 * world_size * CHUNK long
LAYOUTS = ("contiguous", "zigzag")
# A rank blocked on a peer that neither answers nor dies raises after this long; a peer that
# dies closes its connections, and torchrun stops the other ranks at the first failure.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def inputs(world_size: int) -> list[torch.Tensor]:
    """q, k, v, dout: (batch, heads, seq, head_dim) float64, the same on every rank."""
    g = torch.Generator().manual_seed(2000 + world_size)
    seq = 2 * world_size * CHUNK
    return [torch.randn(BATCH, HEADS, seq, DIM, generator=g, dtype=torch.float64) for _ in range(4)]


def fail_inside_the_ring() -> None:
    """Make this rank's second local block raise: the others are then mid-ring."""
    calls, tiled_forward = [], fd.tiled_forward

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(f"rank {dist.get_rank()} fails on purpose inside the ring")
        return tiled_forward(*args, **kwargs)

    fd.tiled_forward = failing


def run(out_dir: Path, fail_rank: int | None, fail_when: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == fail_rank and fail_when == "before":
        raise RuntimeError(f"rank {rank} fails on purpose before the ring")
    if rank == fail_rank:
        fail_inside_the_ring()
    q, k, v, dout = inputs(world_size)
    results = {}
    for layout in LAYOUTS:
        for causal in (False, True):
            parts = [fd.shard(t, rank, world_size, layout=layout).requires_grad_() for t in (q, k, v)]
            out = fd.ring_attention(*parts, causal=causal, layout=layout)
            out.backward(fd.shard(dout, rank, world_size, layout=layout))
            results[f"{layout}-{causal}"] = [out.detach(), *(p.grad for p in parts)]
    torch.save(results, out_dir / f"rank{rank}.pt")


@record  # torchrun's failure summary then carries this rank's exception, not just its exit code
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-when", choices=("before", "during"), default="before")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    interface = fd._loopback_interface()
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # keep gloo's traffic on 127.0.0.1
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    run(args.out_dir, args.fail_rank, args.fail_when)
    dist.destroy_process_group()  # a failing rank skips it: its connections close as it exits


if __name__ == "__main__":
    main()
