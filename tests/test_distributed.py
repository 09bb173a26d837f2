"""Ring attention (flashlib.distributed) against float64 dense attention over the whole sequence.

The ring tests spawn real gloo process groups on 127.0.0.1: one spawn of four processes (each
costs seconds to start), whose default group runs the ring of 4 and whose groups of its first 2
and 3 ranks run the rings of 2 and 3 (ring ranks equal to global ranks; the groups of ranks 1..W-1
give ring ranks that differ). Each ring runs every layout and mask, forward and backward, and
records the order of its communication and computation; the same spawn runs MLA's ring (2) and
the ranks that disagree (4). Every spawned ring has a time limit: a hang fails the test, and a
failing rank's traceback is part of the error.
"""
from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from flashlib import distributed as fd
from flashlib import merge_partials

WORLD_SIZES = (2, 3, 4)
LAYOUTS = ("contiguous", "zigzag")
CHUNK = 3                  # tokens per zigzag chunk: the sequence is 2 * world_size * CHUNK long
RING_CHUNK = 4             # attention_chunk of the chunked rings: not a multiple of a shard's length
BATCH, HEADS, DIM = 2, 2, 8
LIMIT = 120.0              # seconds for one spawned ring before it counts as hung
RING_WORLD = max(WORLD_SIZES)  # processes of the one spawn that runs every ring (rings_worker)
RING_LIMIT = 300.0         # that spawn's limit: it does the work of every ring in turn


# ----- independent references ----------------------------------------------------------

def dense_reference(q, k, v, dout, causal, chunk=0):
    """Float64 softmax(q kᵀ / sqrt(d)) v over the whole sequence, gradients by autograd; chunk > 0:
    position i sees j only when i // chunk == j // chunk (chunked local attention)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    n = q.shape[-2]
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if chunk:
        ids = torch.arange(n) // chunk
        s = s.masked_fill(ids[:, None] != ids[None, :], float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def expected_positions(length, rank, world_size, layout):
    """The layouts as the documentation defines them, written out chunk by chunk."""
    if layout == "contiguous":
        size = length // world_size
        return list(range(rank * size, (rank + 1) * size))
    size = length // (2 * world_size)
    chunks = (rank, 2 * world_size - 1 - rank)
    return [c * size + i for c in chunks for i in range(size)]


def full_inputs(world_size):
    """Seeded (batch, heads, seq, dim) float64 q, k, v and an upstream gradient."""
    g = torch.Generator().manual_seed(1000 + world_size)
    n = 2 * world_size * CHUNK
    return [torch.randn(BATCH, HEADS, n, DIM, generator=g, dtype=torch.float64) for _ in range(4)]


# ----- what every rank runs -----------------------------------------------------------

class RecordingComm(fd.RingComm):
    """The real communication object, logging when a batch has been posted and has arrived."""

    def __init__(self, log, name, group=None):
        super().__init__(group)
        self.log, self.name = log, name

    def commit(self):
        super().commit()
        self.log.append((self.name, "commit"))

    def wait(self):
        super().wait()
        self.log.append((self.name, "wait"))


def recording(block_fn, log):
    """A block computation that logs itself (and its size) before running."""
    def block(q, k, *rest, causal, scale):
        log.append(("compute", q.shape[-2], k.shape[-2], causal))
        return block_fn(q, k, *rest, causal=causal, scale=scale)
    return block


def _recorded_ring(q, k, v, dout, causal, layout, group):
    forward_log, backward_log = [], []
    comm = RecordingComm(forward_log, "kv", group)
    out, lse = fd.ring_forward(q, k, v, causal=causal, layout=layout, comm=comm,
                               block_forward=recording(fd.local_forward, forward_log))
    fd.ring_backward(q, k, v, out, lse, dout, causal=causal, layout=layout,
                     comm=RecordingComm(backward_log, "kv", group),
                     grad_comm=RecordingComm(backward_log, "grad", group),
                     block_backward=recording(fd.local_backward, backward_log))
    return dict(forward_log=forward_log, backward_log=backward_log, sent_bytes=comm.sent_bytes)


def ring_worker(rank, world_size, q, k, v, dout, group=None, others=None):
    """Every layout and mask on this rank of ``group`` (None: the default group): ring_attention forward
    and backward, and a recording; ``others``: the group of its ranks 1..W-1."""
    results = {}
    for layout in LAYOUTS:
        for causal in (False, True):
            parts = [fd.shard(t, rank, world_size, layout=layout).requires_grad_() for t in (q, k, v)]
            local_dout = fd.shard(dout, rank, world_size, layout=layout)
            out = fd.ring_attention(*parts, causal=causal, layout=layout, group=group)
            out.backward(local_dout)
            results[layout, causal] = dict(out=out.detach(), grads=[p.grad for p in parts],
                                           **_recorded_ring(*(p.detach() for p in parts), local_dout,
                                                            causal, layout, group))
    for layout in LAYOUTS:  # chunks of 4 positions across shards of 3 (zigzag: 2 x 3)
        parts = [fd.shard(t, rank, world_size, layout=layout).requires_grad_() for t in (q, k, v)]
        out = fd.ring_attention(*parts, causal=True, layout=layout, attention_chunk=RING_CHUNK, group=group)
        out.backward(fd.shard(dout, rank, world_size, layout=layout))
        results["chunk", layout] = dict(out=out.detach(), grads=[p.grad for p in parts])
    results["subgroup"] = _subgroup_ring(rank, world_size, q, k, v, others)
    results["half"] = _half_ring(rank, world_size, q, k, v, dout, group)
    if world_size == 2:
        results["kernel"] = _kernel_ring(rank, world_size, q, k, v, dout, group)
    return results


def _kernel_ring(rank, world_size, q, k, v, dout, group):
    """The GPU path's block functions (flash_attention's kernels), here in Triton's interpreter."""
    parts = [fd.shard(t.float(), rank, world_size, layout="zigzag") for t in (q, k, v, dout)]
    config = dict(causal=True, layout="zigzag", group=group)
    out, lse = fd.ring_forward(*parts[:3], **config, block_forward=fd.kernel_forward)
    grads = fd.ring_backward(*parts[:3], out, lse, parts[3], **config, block_backward=fd.kernel_backward)
    # chunked: the kernels' mask path, the rule told global positions (fd.block_mask_mod)
    chunked = dict(config, attention_chunk=RING_CHUNK + 1)
    out_c, lse_c = fd.ring_forward(*parts[:3], **chunked, block_forward=fd.kernel_forward)
    grads_c = fd.ring_backward(*parts[:3], out_c, lse_c, parts[3], **chunked, block_backward=fd.kernel_backward)
    return out, grads, out_c, grads_c


def _half_ring(rank, world_size, q, k, v, dout, group):
    """Float16 shards through the real ring: (out, lse, dq, dk, dv) of this rank."""
    parts = [fd.shard(t.half(), rank, world_size, layout="zigzag") for t in (q, k, v, dout)]
    config = dict(causal=True, layout="zigzag", group=group)
    out, lse = fd.ring_forward(*parts[:3], **config)
    return (out, lse, *fd.ring_backward(*parts[:3], out, lse, parts[3], **config))


def _subgroup_ring(rank, world_size, q, k, v, group):
    """Ranks 1..W-1 form a group of their own (``group``, which every rank took part in creating):
    group ranks differ from the ring's ranks."""
    members = list(range(1, world_size))
    if rank not in members:
        return None
    me, n = members.index(rank), 2 * len(members) * CHUNK
    parts = [fd.shard(t[..., :n, :], me, len(members), layout="zigzag") for t in (q, k, v)]
    return fd.ring_attention(*parts, causal=True, layout="zigzag", group=group)


def rings_worker(rank, world_size):
    """Every ring of this module on one spawn's ranks: the ring of 4 on the default group, those of 2
    and 3 on groups of the first ranks, then MLA's ring (2), then the ranks that disagree (4)."""
    # every rank takes part in creating every group, in the same order
    groups = {size: None if size == world_size else dist.new_group(list(range(size))) for size in WORLD_SIZES}
    others = {size: dist.new_group(list(range(1, size))) for size in WORLD_SIZES}
    results = {}
    for size in WORLD_SIZES:
        if rank < size:
            results[size] = ring_worker(rank, size, *full_inputs(size), group=groups[size], others=others[size])
    if rank < 2:
        results["mla"] = mla_worker(rank, 2, *mla_inputs(), group=groups[2])
    results["mismatch"] = mismatch_worker(rank, world_size)
    return results


@functools.cache
def rings_run():
    return fd.spawn(rings_worker, RING_WORLD, timeout=RING_LIMIT)


def ring_run(world_size):
    """What each rank of the ring of ``world_size`` returned."""
    return [r[world_size] for r in rings_run()[:world_size]]


def uneven_worker(rank, world_size):
    q = torch.zeros(1, 1, 8 if rank == 0 else 6, 4)
    return fd.ring_attention(q, q, q)


MISMATCH_WORLD = RING_WORLD
SCALE = 1 / math.sqrt(8)   # the default scale of the mismatch cases' head_dim 8
# What the odd rank(s) pass and what rank 0 passes, as the error must name them.
MISMATCHES = {
    "dtype": "dtype torch.bfloat16 but rank 0 has torch.float16",
    "scale": f"scale {math.nextafter(SCALE, 1)!r} but rank 0 has {SCALE!r}",
    "causal": "causal True but rank 0 has False",
    "layout": "layout 'zigzag' but rank 0 has 'contiguous'",
    "batch": "batch 2 (shape (2, 2, 4, 8)) but rank 0 has 1 (shape (1, 2, 4, 8))",
    "heads": "heads 3 (shape (1, 3, 4, 8)) but rank 0 has 2 (shape (1, 2, 4, 8))",
    "local_seq": "local_seq 6 (shape (1, 2, 6, 8)) but rank 0 has 4 (shape (1, 2, 4, 8))",
    "head_dim": "head_dim 9 (shape (1, 2, 4, 9)) but rank 0 has 8 (shape (1, 2, 4, 8))",
    "head_dim_v": "head_dim_v 5 but rank 0 has 8",
    "attention_chunk": "attention_chunk 3 but rank 0 has 0",
    "two ranks": "causal True but rank 0 has False (ranks [1, 2, 3] all differ from rank 0)",
}


def mismatch_call(case, odd):
    """One rank's ring_attention call: the odd rank(s) differ from rank 0 in ``case`` only."""
    shape = dict(batch=1, heads=2, local_seq=4, head_dim=8)
    if odd and case in shape:
        shape[case] += 2 if case == "local_seq" else 1
    dtype = torch.bfloat16 if odd and case == "dtype" else torch.float16
    q = torch.ones(*shape.values(), dtype=dtype)
    v = q[..., :5] if odd and case == "head_dim_v" else q
    return fd.ring_attention(q, q, v, scale=math.nextafter(SCALE, 1) if odd and case == "scale" else None,
                             causal=odd and case in ("causal", "two ranks"),
                             layout="zigzag" if odd and case == "layout" else "contiguous",
                             attention_chunk=3 if odd and case == "attention_chunk" else None)


def mismatch_worker(rank, world_size):
    """Every case in turn, the last rank (every other rank for "two ranks") the odd one out; each rank
    returns the error it raised per case, then one agreed call: the ranks are still in step."""
    errors = {}
    for case in MISMATCHES:
        odd = rank >= 1 if case == "two ranks" else rank == world_size - 1
        try:
            mismatch_call(case, odd)
            errors[case] = None
        except ValueError as error:
            errors[case] = str(error)
    q = torch.ones(1, 2, 4, 8)
    return errors, fd.ring_attention(q, q, q)


def mismatch_run():
    return [r["mismatch"] for r in rings_run()]


MLA_DIMS = (DIM, DIM // 2 + 1)  # q and k's head dim, v's: its own (MLA's 192/128, small)


def mla_inputs(world_size=2):
    """Seeded float64 q, k (batch, heads, seq, 8), v and dout (batch, heads, seq, 5)."""
    g = torch.Generator().manual_seed(2000 + world_size)
    n = 2 * world_size * CHUNK
    d, dv = MLA_DIMS
    return [torch.randn(BATCH, HEADS, n, dim, generator=g, dtype=torch.float64) for dim in (d, d, dv, dv)]


def mla_worker(rank, world_size, q, k, v, dout, group=None):
    """v with a head dim of its own: ring_attention (tiled blocks) per layout and mask, and the
    kernel blocks once, in float32."""
    results = {}
    for layout in LAYOUTS:
        for causal in (False, True):
            parts = [fd.shard(t, rank, world_size, layout=layout).requires_grad_() for t in (q, k, v)]
            out = fd.ring_attention(*parts, causal=causal, layout=layout, group=group)
            out.backward(fd.shard(dout, rank, world_size, layout=layout))
            results[layout, causal] = out.detach(), [p.grad for p in parts]
    results["kernel"] = _kernel_ring(rank, world_size, q, k, v, dout, group)
    return results


def failing_worker(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError("rank one divides by zero")
    dist.barrier()  # rank 0 waits for rank 1 forever: the launcher must not


def sleeping_worker(rank, world_size):
    time.sleep(600)


# ----- layouts ----------------------------------------------------------------------------

@given(world_size=st.integers(1, 5), chunk=st.integers(1, 4), layout=st.sampled_from(LAYOUTS),
       dim=st.sampled_from([-2, 0, 1, 2]), seed=st.integers(0, 2**16))
def test_shard_unshard_round_trip(world_size, chunk, layout, dim, seed):
    length = 2 * world_size * chunk
    shape = [2, 3, 5]
    shape[dim if dim >= 0 else 1] = length
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    shards = [fd.shard(x, r, world_size, layout=layout, dim=dim) for r in range(world_size)]
    assert all(s.shape[dim] == length // world_size for s in shards)
    assert torch.equal(fd.unshard(shards, layout=layout, dim=dim), x)


@given(world_size=st.integers(1, 6), chunk=st.integers(1, 4), layout=st.sampled_from(LAYOUTS))
def test_shards_hold_the_documented_positions(world_size, chunk, layout):
    length = 2 * world_size * chunk
    seq = torch.arange(length).reshape(1, 1, length, 1)
    held = []
    for r in range(world_size):
        expected = expected_positions(length, r, world_size, layout)
        assert fd.shard(seq, r, world_size, layout=layout).flatten().tolist() == expected
        assert fd.positions(length, r, world_size, layout=layout).tolist() == expected
        held += expected
    assert sorted(held) == list(range(length))  # every token on exactly one rank


def test_zigzag_example():
    x = torch.arange(8).reshape(8, 1)
    assert fd.shard(x, 0, 2, layout="zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert fd.shard(x, 1, 2, layout="zigzag").flatten().tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout, length, world_size, pieces", [
    ("contiguous", 10, 4, "4"), ("zigzag", 12, 4, "8"), ("zigzag", 6, 2, "4")])
def test_uneven_length_raises(layout, length, world_size, pieces):
    with pytest.raises(ValueError, match=rf"length {length}.*{pieces} equal chunks.*{layout}"):
        fd.shard(torch.zeros(1, 1, length, 2), 0, world_size, layout=layout)


def test_shard_argument_errors():
    x = torch.zeros(1, 1, 8, 2)
    with pytest.raises(ValueError, match="'rank' must be < world_size = 2, got 2"):
        fd.shard(x, 2, 2)
    with pytest.raises(ValueError, match="'layout' must be one of"):
        fd.shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="'dim'"):
        fd.shard(x, 0, 2, dim=4)
    with pytest.raises(ValueError, match="one shape"):
        fd.unshard([x, x[..., :4, :]])
    with pytest.raises(ValueError, match="even"):
        fd.unshard([x[..., :3, :]] * 2, layout="zigzag")


# ----- which blocks are computed ----------------------------------------------------------

@given(world_size=st.integers(1, 6), chunk=st.integers(1, 3), layout=st.sampled_from(LAYOUTS),
       causal=st.booleans())
def test_blocks_cover_exactly_the_visible_pairs(world_size, chunk, layout, causal):
    """Each step computes exactly the (query, key) pairs the global mask shows, no more."""
    length = 2 * world_size * chunk
    local = length // world_size
    for rank in range(world_size):
        rows = torch.tensor(expected_positions(length, rank, world_size, layout))
        for origin in range(world_size):
            cols = torch.tensor(expected_positions(length, origin, world_size, layout))
            visible = rows[:, None] >= cols[None, :] if causal else torch.ones(local, local, dtype=torch.bool)
            block = fd.ring_block(rank, origin, local, causal=causal, layout=layout)
            covered = torch.zeros(local, local, dtype=torch.bool)
            if block is not None:
                part = covered[block.q, block.k]
                covered[block.q, block.k] = torch.ones_like(part).tril() if block.causal else True
            assert torch.equal(covered, visible), (rank, origin, block)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_idle_steps(world_size):
    assert fd.idle_steps(world_size, layout="contiguous") == world_size * (world_size - 1) // 2
    assert fd.idle_steps(world_size, layout="zigzag") == 0
    assert fd.idle_steps(world_size, layout="contiguous", causal=False) == 0


# ----- the ring over gloo: values ---------------------------------------------------------

CASES = [(w, layout, causal) for w in WORLD_SIZES for layout in LAYOUTS for causal in (False, True)]


@pytest.mark.parametrize("world_size, layout, causal", CASES)
def test_ring_forward_matches_dense(world_size, layout, causal):
    q, k, v, dout = full_inputs(world_size)
    expected = dense_reference(q, k, v, dout, causal)[0]
    ranks = ring_run(world_size)
    out = fd.unshard([r[layout, causal]["out"] for r in ranks], layout=layout)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world_size, layout, causal", CASES)
def test_ring_backward_matches_dense(world_size, layout, causal):
    q, k, v, dout = full_inputs(world_size)
    expected = dense_reference(q, k, v, dout, causal)[1:]
    ranks = ring_run(world_size)
    for i, name in enumerate("qkv"):
        grad = fd.unshard([r[layout, causal]["grads"][i] for r in ranks], layout=layout)
        torch.testing.assert_close(grad, expected[i], rtol=0, atol=1e-12, msg=f"d{name}")


def test_ring_with_the_kernel_blocks():
    """What a GPU runs per block (flash_attention's forward and backward), in float32."""
    q, k, v, dout = full_inputs(2)
    expected = dense_reference(q, k, v, dout, True)
    outs, grads, chunked_outs, chunked_grads = zip(*[r["kernel"] for r in ring_run(2)])
    torch.testing.assert_close(fd.unshard(list(outs), layout="zigzag").double(), expected[0], rtol=0, atol=1e-5)
    for i in range(3):
        grad = fd.unshard([g[i] for g in grads], layout="zigzag").double()
        torch.testing.assert_close(grad, expected[1 + i], rtol=0, atol=1e-4)
    expected = dense_reference(q, k, v, dout, True, chunk=RING_CHUNK + 1)
    out = fd.unshard(list(chunked_outs), layout="zigzag").double()
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-5)
    for i in range(3):
        grad = fd.unshard([g[i] for g in chunked_grads], layout="zigzag").double()
        torch.testing.assert_close(grad, expected[1 + i], rtol=0, atol=1e-4)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_chunked_ring_matches_dense(world_size, layout):
    """attention_chunk by global position, forward and backward, whatever the shards' boundaries."""
    q, k, v, dout = full_inputs(world_size)
    expected = dense_reference(q, k, v, dout, True, chunk=RING_CHUNK)
    ranks = ring_run(world_size)
    out = fd.unshard([r["chunk", layout]["out"] for r in ranks], layout=layout)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for i, name in enumerate("qkv"):
        grad = fd.unshard([r["chunk", layout]["grads"][i] for r in ranks], layout=layout)
        torch.testing.assert_close(grad, expected[1 + i], rtol=0, atol=1e-12, msg=f"d{name}")


def test_ring_with_a_head_dim_of_vs_own():
    """MLA's shapes, small: v and the output have their own head dim; the scale stays q's."""
    q, k, v, dout = mla_inputs()
    ranks = [r["mla"] for r in rings_run()[:2]]
    for layout in LAYOUTS:
        for causal in (False, True):
            expected = dense_reference(q, k, v, dout, causal)
            out = fd.unshard([r[layout, causal][0] for r in ranks], layout=layout)
            assert out.shape[-1] == MLA_DIMS[1]
            torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
            for i, name in enumerate("qkv"):
                grad = fd.unshard([r[layout, causal][1][i] for r in ranks], layout=layout)
                torch.testing.assert_close(grad, expected[1 + i], rtol=0, atol=1e-12, msg=f"d{name}")
    expected = dense_reference(q, k, v, dout, True)
    outs, grads, *_ = zip(*[r["kernel"] for r in ranks])
    torch.testing.assert_close(fd.unshard(list(outs), layout="zigzag").double(), expected[0], rtol=0, atol=1e-5)
    for i in range(3):
        grad = fd.unshard([g[i] for g in grads], layout="zigzag").double()
        torch.testing.assert_close(grad, expected[1 + i], rtol=0, atol=1e-4)


@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_on_a_subgroup(world_size):
    q, k, v, dout = full_inputs(world_size)
    n = 2 * (world_size - 1) * CHUNK  # a sequence the W-1 members can split
    q, k, v, dout = (t[..., :n, :] for t in (q, k, v, dout))
    expected = dense_reference(q, k, v, dout, True)[0]
    ranks = ring_run(world_size)
    assert ranks[0]["subgroup"] is None
    out = fd.unshard([r["subgroup"] for r in ranks[1:]], layout="zigzag")
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


# ----- half precision: partial results merged in float32 -----------------------------------

class LoopbackComm:
    """RingComm's interface in one process: rank 0 of a ring whose every hop brings back what
    was sent. The ring then attends each query to world_size copies of the same keys, which
    gives one process's output and gradients (lse larger by log(world_size)) after
    world_size - 1 merges. ``sent`` holds the dtype of every tensor sent."""

    def __init__(self, world_size):
        self.rank, self.world_size, self.sent = 0, world_size, []

    def send_recv(self, tensor):
        self.sent.append(tensor.dtype)
        return tensor.clone()

    def commit(self):
        pass

    def wait(self):
        pass


def half_inputs(dtype, seq=32, dim=16):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 2, seq, dim, generator=g).to(dtype) for _ in range(4)]


def dense_with_lse(q, k, v, dout, causal=False):
    """Float64 (out, lse, dq, dk, dv) of the (already rounded) inputs."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out, dq, dk, dv = dense_reference(q, k, v, dout, causal)
    return out, torch.logsumexp(s, dim=-1), dq, dk, dv


def errors(results, reference):
    return [(r.double() - e).abs().max().item() for r, e in zip(results, reference)]


BLOCK_FUNCTIONS = {"tiled": (fd.local_forward, fd.local_backward),
                   "kernel": (fd.kernel_forward, fd.kernel_backward)}
HALF_CASES = [(torch.float16, "tiled"), (torch.bfloat16, "tiled"), (torch.float16, "kernel")]


@pytest.mark.parametrize("dtype, blocks", HALF_CASES)
def test_half_precision_is_merged_in_float32(dtype, blocks, monkeypatch):
    """out, lse and the dq, dk, dv accumulators are float32 for float16/bfloat16 shards,
    on the CPU path and on the kernels' (run here in Triton's interpreter)."""
    merged = []

    def merge(*parts):
        merged.append({t.dtype for t in parts})
        return merge_partials(*parts)

    monkeypatch.setattr(fd, "merge_partials", merge)
    block_forward, block_backward = BLOCK_FUNCTIONS[blocks]
    q, k, v, dout = half_inputs(dtype, seq=16, dim=8)
    comm, grad_comm = LoopbackComm(3), LoopbackComm(3)
    out, lse = fd.ring_forward(q, k, v, comm=comm, block_forward=block_forward)
    grads = fd.ring_backward(q, k, v, out, lse, dout, comm=LoopbackComm(3), grad_comm=grad_comm,
                             block_backward=block_backward)
    assert merged == [{torch.float32}] * 3 and lse.dtype == torch.float32
    assert set(comm.sent) == {dtype}            # K and V travel in their own dtype
    assert set(grad_comm.sent) == {torch.float32}  # dK and dV travel as float32 accumulators
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


@pytest.mark.parametrize("dtype, blocks", HALF_CASES)
def test_half_precision_ring_is_as_accurate_as_one_process(dtype, blocks):
    """Against float64 attention of the same rounded inputs, eight merged copies of a block are
    at most twice as far off as that block alone: merges in the input dtype are 5-10x worse."""
    block_forward, block_backward = BLOCK_FUNCTIONS[blocks]
    q, k, v, dout = half_inputs(dtype, seq=16 if blocks == "kernel" else 32)
    world = 4 if blocks == "kernel" else 8
    reference = dense_with_lse(q, k, v, dout)
    out, lse = block_forward(q, k, v, causal=False, scale=1 / math.sqrt(q.shape[-1]))
    grads = block_backward(q, k, v, out, lse, dout, causal=False, scale=1 / math.sqrt(q.shape[-1]))
    alone = errors((out, lse, *(g.to(dtype) for g in grads)), reference)  # rounded as the ring returns them
    out, lse = fd.ring_forward(q, k, v, comm=LoopbackComm(world), block_forward=block_forward)
    grads = fd.ring_backward(q, k, v, out, lse, dout, comm=LoopbackComm(world), grad_comm=LoopbackComm(world),
                             block_backward=block_backward)
    ring = errors((out, lse - math.log(world), *grads), reference)
    for name, error, bound in zip(("out", "lse", "dq", "dk", "dv"), ring, alone):
        assert error <= 2 * bound + 1e-7, (name, error, bound)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_half_precision_ring_over_gloo(world_size):
    """Float16 zigzag causal shards on real ranks, against one process's blocks in float16."""
    q, k, v, dout = (t.half() for t in full_inputs(world_size))
    reference = dense_with_lse(q, k, v, dout, causal=True)
    scale = 1 / math.sqrt(DIM)
    out, lse = fd.local_forward(q, k, v, causal=True, scale=scale)
    grads = fd.local_backward(q, k, v, out, lse, dout, causal=True, scale=scale)
    alone = errors((out, lse, *(g.half() for g in grads)), reference)
    ranks = ring_run(world_size)
    ring = [fd.unshard([r["half"][i] for r in ranks], layout="zigzag", dim=-1 if i == 1 else -2)
            for i in range(5)]
    assert ring[1].dtype == torch.float32
    for name, error, bound in zip(("out", "lse", "dq", "dk", "dv"), errors(ring, reference), alone):
        assert error <= 2 * bound + 1e-6, (name, error, bound)


# ----- the ring over gloo: what it computes and when it talks -------------------------------

def _computed(log):
    return [entry[1:] for entry in log if entry[0] == "compute"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_causal_blocks_are_skipped(world_size, layout):
    ranks = ring_run(world_size)
    local = 2 * CHUNK
    length = world_size * local
    areas = []
    for rank, result in enumerate(ranks):
        rows = torch.tensor(expected_positions(length, rank, world_size, layout))
        nonempty = sum(bool((rows[:, None] >= torch.tensor(
            expected_positions(length, origin, world_size, layout))[None, :]).any())
            for origin in range(world_size))
        for log in ("forward_log", "backward_log"):
            blocks = _computed(result[layout, True][log])
            assert len(blocks) == nonempty
            assert len(_computed(result[layout, False][log])) == world_size
        areas.append(sum(q * k / (2 if causal else 1) for q, k, causal in blocks))
    if layout == "contiguous":
        assert [len(_computed(r[layout, True]["forward_log"])) for r in ranks] == list(range(1, world_size + 1))
    else:  # every rank computes at every step, and all ranks the same area
        assert nonempty == world_size and len(set(areas)) == 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout, causal", [("contiguous", False), ("contiguous", True), ("zigzag", True)])
def test_transfers_are_posted_before_the_computation(world_size, layout, causal):
    """Forward: at each step the next K, V are posted, then the block is computed, then waited for.
    Backward: dK, dV leave after a step and are waited for only after the next step's block."""
    for rank, result in enumerate(ranks := ring_run(world_size)):
        forward, backward = [], []
        for step in range(world_size):
            last = step + 1 == world_size
            computes = fd.ring_block(rank, (rank - step) % world_size, 2 * CHUNK, causal=causal,
                                     layout=layout) is not None
            forward += [("kv", "commit")] * (not last) + [("compute",)] * computes + [("kv", "wait")] * (not last)
            backward += ([("kv", "commit")] * (not last) + [("compute",)] * computes
                         + [("grad", "wait")] * (step > 0) + [("grad", "commit")] + [("kv", "wait")] * (not last))
        backward.append(("grad", "wait"))
        recorded = ranks[rank][layout, causal]
        assert [e[:1] if e[0] == "compute" else e for e in recorded["forward_log"]] == forward
        assert [e[:1] if e[0] == "compute" else e for e in recorded["backward_log"]] == backward


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_sent_per_step_match_the_model(world_size):
    local = 2 * CHUNK
    model = 2 * BATCH * HEADS * local * DIM * 8  # K and V, float64
    for result in ring_run(world_size):
        assert result["zigzag", True]["sent_bytes"] == [model] * (world_size - 1)


# ----- errors -----------------------------------------------------------------------------

def test_missing_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="no default process group.*init_process_group"):
        fd.ring_attention(q, q, q)


def test_input_errors_come_before_any_communication():
    q = torch.zeros(1, 1, 6, 2)
    with pytest.raises(ValueError, match=r"'q' must be this rank's shard of shape \(batch, heads"):
        fd.ring_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="local_seq must be even; got 3"):
        fd.ring_attention(q[..., :3, :], q[..., :3, :], q[..., :3, :], layout="zigzag")
    with pytest.raises(ValueError, match="one shape and dtype"):
        fd.ring_attention(q, q[..., :4, :], q)
    with pytest.raises(ValueError, match="one shape and dtype"):
        fd.ring_attention(q, q[..., :1], q)  # k's head dim is q's; v's may be its own
    with pytest.raises(ValueError, match="'layout' must be one of"):
        fd.ring_attention(q, q, q, layout="ring")
    with pytest.raises(TypeError, match="'causal' must be True or False"):
        fd.ring_attention(q, q, q, causal=1)


def test_shards_of_different_lengths_across_ranks():
    with pytest.raises(fd.RingProcessError) as caught:
        fd.spawn(uneven_worker, 2, timeout=LIMIT)
    message = str(caught.value)
    assert "rank 1 has local_seq 6 (shape (1, 1, 6, 4)) but rank 0 has 8 (shape (1, 1, 8, 4))" in message
    assert "Traceback" in message and "uneven_worker" in message  # the child's own traceback


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_ranks_that_disagree_all_raise_naming_the_rank(case):
    """One all_gather per call: every rank raises the same error naming the odd rank, its value
    and rank 0's, instead of hanging or reading a float16 rank's bits as bfloat16."""
    odd = "rank 1" if case == "two ranks" else f"rank {MISMATCH_WORLD - 1}"
    messages = [errors[case] for errors, _ in mismatch_run()]
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1  # every rank, the same words
    assert messages[0].startswith(f"ring_attention: {odd} has {MISMATCHES[case]}; every rank must")


def test_ranks_stay_in_step_after_a_mismatch():
    for _, out in mismatch_run():
        torch.testing.assert_close(out, torch.ones(1, 2, 4, 8))


def test_a_failing_rank_is_reported_without_waiting_for_the_others():
    start = time.monotonic()
    with pytest.raises(fd.RingProcessError, match="(?s)rank 1 of 2 failed.*ZeroDivisionError: rank one"):
        fd.spawn(failing_worker, 2, timeout=LIMIT)
    assert time.monotonic() - start < LIMIT / 2


def test_a_hung_ring_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 did not finish within 3 s"):
        fd.spawn(sleeping_worker, 2, timeout=3)
    assert time.monotonic() - start < 10


def test_spawn_needs_an_importable_function():
    with pytest.raises(TypeError, match="top level of an importable module"):
        fd.spawn(lambda rank, world_size: rank, 2)


# ----- the CPU measurement ------------------------------------------------------------------

def test_cpu_measurement_compares_world_sizes_with_one_process():
    from flashlib.bench import ring as bench

    points = bench.measure_ring(seq=24, heads=2, head_dim=8, world_sizes=(1, 2), repeats=1, timeout=LIMIT)
    assert [(p.world_size, p.local_seq) for p in points] == [(1, 24), (2, 12)]
    assert points[0].sent_per_step == []  # one process: nothing travels
    assert points[1].sent_per_step == [points[1].model_per_step] == [2 * 1 * 2 * 12 * 8 * 4]
    assert points[0].diff_out == points[0].diff_grad == 0.0
    assert points[1].diff_out < 1e-5 and points[1].diff_grad < 1e-5
    assert "local_seq" in bench.format_points(points)
    with pytest.raises(ValueError, match="multiple of 24; got 20"):
        bench.measure_ring(seq=20)


# ----- notebook 11's support --------------------------------------------------------------

def test_traced_demo_replays_the_ring():
    from flashlib.course import ring as course

    demos = course.run_ring_demo(2, chunk=2, timeout=LIMIT)
    for layout, demo in demos.items():
        torch.testing.assert_close(demo.out, demo.reference, rtol=0, atol=1e-12)
        for grad, expected in zip(demo.grads, demo.reference_grads):
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
        assert max(demo.distances[-1]) < course.ROUNDING
        assert demo.origins == [[0, 1], [1, 0]]
        final = course.pair_states(demo, 1)
        visible = torch.ones(8, 8).tril().bool().numpy()
        assert ((final == course.viz.DONE_STATE) | (final == course.viz.CURRENT_STATE)).sum() == visible.sum()
        assert (final[~visible] == course.viz.MASKED_STATE).all()
        assert demo.sent_bytes == [[2 * 1 * 1 * 4 * 4 * 8]] * 2
    stepper = course.RingStepper(demos, step=1)
    assert repr(stepper) == "RingStepper(world_size=2, layout='contiguous', step=1 of 0..1)"
    stepper.layout_toggle.value = "zigzag"
    assert stepper.image.value[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="'step' must be an int in 0..1, got 2"):
        course.ring_step_figure(demos["zigzag"], 2)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_halves_the_causal_critical_path(world_size):
    from flashlib.course import ring as course

    assert course.critical_path(world_size, layout="contiguous") == world_size - 0.5
    assert course.critical_path(world_size, layout="zigzag") == world_size / 2
    assert course.step_work(world_size, layout="zigzag").sum() == course.step_work(
        world_size, layout="contiguous").sum()  # the same work, spread evenly


def _zigzag_right(rank, origin, local):
    return (slice(0, local), slice(0, local // 2)) if origin < rank else (slice(local // 2, local), slice(0, local))


def test_hiding_length():
    from flashlib.course import ring as course

    # 2-byte elements, 1e15 FLOP/s, 1e12 B/s: L = 2 * 1e15 / 2e12 = 1000; half blocks need twice as long
    assert course.hiding_length(1e15, 1e12, 2) == 1000
    assert course.hiding_length(1e15, 1e12, 2, share=0.5) == 2000


def test_exercise_checkers():
    from flashlib.course import ring as course

    unanswered = course.check_idle_steps(None)
    assert not unanswered and repr(unanswered).startswith("NOT YET: no answer yet") and "hint" not in repr(unanswered)
    assert course.check_idle_steps(15)
    assert "diagonal" in repr(course.check_idle_steps(21))
    assert "off the diagonal" in repr(course.check_idle_steps(30))
    assert not course.check_idle_steps("15")
    assert not course.check_zigzag_block(None) and "hint" not in repr(course.check_zigzag_block(None))
    assert course.check_zigzag_block(_zigzag_right)
    swapped = course.check_zigzag_block(lambda r, s, n: _zigzag_right(s, r, n))
    assert not swapped and "swapped" in repr(swapped)
    assert "half as big" in repr(course.check_zigzag_block(lambda r, s, n: (slice(0, n), slice(0, n))))
    assert "raised ZeroDivisionError" in repr(course.check_zigzag_block(lambda r, s, n: 1 / 0))
