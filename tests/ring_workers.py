"""What the ring-attention tests run on each rank (flashlib.distributed.spawn). Every rank is a fresh
process that imports the module of its function: this one imports only torch and flashlib (a test
module importing transformers cost each rank seconds). The inputs come from the tests, as arguments."""
from __future__ import annotations

from flashlib import distributed as fd
from flashlib import scores


def _ring_grads(rank, world_size, q, k, v, dout, layout="contiguous", leaf=None, **options):
    """This rank's output, its shards' gradients and its share of ``leaf``'s gradient (None without one)."""
    shards = [fd.shard(t, rank, world_size, layout=layout).detach().requires_grad_() for t in (q, k, v)]
    out = fd.ring_attention(*shards, causal=True, layout=layout, **options)
    out.backward(fd.shard(dout, rank, world_size, layout=layout))
    return out.detach(), [s.grad for s in shards], None if leaf is None else leaf.grad


def score_rings(rank, world_size, q, k, v, dout, table):
    """tests/test_scores.py's rings: a relative-bias table on both layouts, and softcap= on scaled inputs."""
    results = {}
    for layout in ("contiguous", "zigzag"):
        leaf = table.detach().requires_grad_()
        results[layout] = _ring_grads(rank, world_size, q, k, v, dout, layout, leaf,
                                      score_mod=scores.relative_bias(leaf))
    results["softcap"] = _ring_grads(rank, world_size, q * 6, k * 6, v * 6, dout, softcap=2.0)[:2]
    return results


def sinks_ring(rank, world_size, q, k, v, sinks, dout):
    """tests/test_sinks.py's ring: learned sinks on the zigzag layout."""
    leaf = sinks.detach().requires_grad_()
    return _ring_grads(rank, world_size, q, k, v, dout, "zigzag", leaf, sinks=leaf)
