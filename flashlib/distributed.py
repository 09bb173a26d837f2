"""Ring attention: exact attention over a sequence split across processes (notebook 11).

Each of ``world_size`` ranks holds a shard of the queries and, at first, the matching
shard of keys and values. The key/value shards travel around a ring (rank r sends to
r + 1 and receives from r - 1) for ``world_size`` steps; at every step each rank attends
its queries to the shard it holds and folds the result into its running output with
notebook 02's merge of two partial results:

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

After the last step every rank has attention over the whole sequence for its queries.
The next shard is already in flight while the current one is computed: a
:class:`RingComm` posts the send/receive pair (``batch_isend_irecv``) before the local
attention and waits for it only afterwards.

Layouts (``shard``/``unshard``), for a sequence cut into equal chunks:

    contiguous  rank r holds chunk r of world_size          causal: rank r works r + 1 steps
    zigzag      rank r holds chunks r and 2W - 1 - r of 2W  causal: every rank works every step

Under a causal mask a query sees only keys at positions <= its own, so a block whose keys
all come later is empty and is skipped (:func:`ring_block` says which rows and columns a
step computes). Tensors are (batch, heads, local_seq, head_dim); causal masking is by
global position, so the ranks together compute exactly ``dense_attention(..., causal=True)``
over the gathered sequence.

:func:`spawn` starts a ring of CPU processes joined by a gloo process group on 127.0.0.1,
runs a module-level function on each and returns what each returned (or raises with a
failing child's traceback, or after a time limit).
"""
from __future__ import annotations

import datetime
import math
import multiprocessing
import numbers
import pickle
import queue
import socket
import struct
import time
import traceback
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import merge_partials, tiled_backward, tiled_forward
from .machinery.autograd import save, saved
from .machinery.captures import captured_tensors
from .machinery.options import Options, checked_options
from .rules import Visibility, sink_grad, softmax_delta
from .scores import trainable
from .softmax import merge_sink

LAYOUTS = ("contiguous", "zigzag")
NEG_INF = float("-inf")
CPU_BLOCK = 128  # tile size of the tiled reference on a CPU: fewer Python steps per block


# ----- layouts -----------------------------------------------------------------------

def _check_layout(fn: str, layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: argument 'layout' must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_count(fn: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: argument '{name}' must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{fn}: argument '{name}' must be >= {minimum}, got {value}")
    return int(value)


def _chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def _chunk_size(fn: str, length: int, world_size: int, layout: str) -> int:
    """Length of one chunk; ValueError if ``length`` does not split evenly."""
    pieces = world_size * _chunks_per_rank(layout)
    if length % pieces:
        what = f"2 · world_size = {pieces}" if layout == "zigzag" else f"world_size = {pieces}"
        raise ValueError(
            f"{fn}: a sequence of length {length} cannot be cut into {what} equal chunks for the "
            f"{layout!r} layout; pad or trim the sequence to a multiple of {pieces}")
    return length // pieces


def chunk_ids(rank: int, world_size: int, layout: str = "contiguous") -> tuple[int, ...]:
    """Which chunks of the sequence ``rank`` holds, in the order it stores them."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def positions(length: int, rank: int, world_size: int, *, layout: str = "contiguous") -> torch.Tensor:
    """Global token positions (local_seq,) that ``rank`` holds, in its local order."""
    fn = "positions"
    _check_layout(fn, layout)
    chunk = _chunk_size(fn, length, world_size, layout)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                      for c in chunk_ids(rank, world_size, layout)])


def shard(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "contiguous",
          dim: int = -2) -> torch.Tensor:
    """The part of ``x`` (e.g. (batch, heads, seq, head_dim)) that ``rank`` holds along ``dim``.

    "contiguous": chunk ``rank`` of ``world_size`` equal chunks. "zigzag": the sequence is
    cut into 2 · world_size chunks and rank r holds chunks r and 2 · world_size - 1 - r,
    concatenated, so that under a causal mask every rank has the same amount of work.
    """
    fn = "shard"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    world_size = _check_count(fn, "world_size", world_size, 1)
    rank = _check_count(fn, "rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"{fn}: argument 'rank' must be < world_size = {world_size}, got {rank}")
    _check_layout(fn, layout)
    dim = _check_dim(fn, x, dim)
    chunk = _chunk_size(fn, x.shape[dim], world_size, layout)
    parts = [x.narrow(dim, c * chunk, chunk) for c in chunk_ids(rank, world_size, layout)]
    return torch.cat(parts, dim=dim)


def unshard(shards, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Reassemble the whole sequence from every rank's shard (``shards[r]`` from rank r)."""
    fn = "unshard"
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"{fn}: argument 'shards' must be a non-empty list of tensors, one per "
                        f"rank; got {type(shards).__name__}")
    _check_layout(fn, layout)
    dim = _check_dim(fn, shards[0], dim)
    shapes = [tuple(s.shape) for s in shards]
    if len(set(shapes)) != 1:
        raise ValueError(f"{fn}: argument 'shards' must hold tensors of one shape, got {shapes}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    length = shards[0].shape[dim]
    if length % 2:
        raise ValueError(f"{fn}: zigzag shards hold two equal chunks, so their length must be "
                         f"even; got length {length} along dim {dim}")
    halves = [s.split(length // 2, dim=dim) for s in shards]
    # Chunks 0..W-1 are the first halves of ranks 0..W-1; chunks W..2W-1 the second halves
    # of ranks W-1..0.
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def _check_dim(fn: str, x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{fn}: argument 'dim' must be an int in [-{x.ndim}, {x.ndim}) for a tensor "
                         f"of shape {tuple(x.shape)}, got {dim!r}")
    return int(dim) % x.ndim


# ----- which part of a block a step computes -----------------------------------------

class RingBlock(NamedTuple):
    """The part of (local queries) x (a key/value shard) that one step computes.

    ``q`` and ``k`` slice the local query rows and the held key rows; ``causal`` says
    whether the block straddles the diagonal (then the local causal mask applies).
    """

    q: slice
    k: slice
    causal: bool


def ring_block(rank: int, origin: int, local_seq: int, *, causal: bool,
               layout: str = "contiguous") -> RingBlock | None:
    """What ``rank`` computes with the key/value shard that started on rank ``origin``.

    None when the causal mask hides the whole block (the step is idle). Without a mask
    every block is full. With one:

        contiguous  origin == rank: the diagonal block, causal; origin < rank: full;
                    origin > rank: empty (all keys come after all queries)
        zigzag      origin == rank: diagonal, causal; origin < rank: every query sees the
                    first half of the keys (chunk origin) and none of the second;
                    origin > rank: only the second half of the queries (chunk 2W-1-rank)
                    sees the keys, and sees all of them
    """
    everything = slice(0, local_seq)
    if not causal:
        return RingBlock(everything, everything, False)
    if origin == rank:
        return RingBlock(everything, everything, True)
    if layout == "contiguous":
        return RingBlock(everything, everything, False) if origin < rank else None
    half = local_seq // 2
    if origin < rank:
        return RingBlock(everything, slice(0, half), False)
    return RingBlock(slice(half, local_seq), everything, False)


def idle_steps(world_size: int, *, layout: str = "contiguous", causal: bool = True) -> int:
    """How many (rank, step) pairs compute nothing: empty blocks skipped by the ring."""
    return sum(ring_block(r, (r - t) % world_size, 2, causal=causal, layout=layout) is None
               for r in range(world_size) for t in range(world_size))


# ----- communication -----------------------------------------------------------------

class RingComm:
    """Queues send/receive pairs to the ring neighbours and posts them as one batch.

    ``send_recv(t)`` queues "send t to rank + 1" and "receive a tensor like t from
    rank - 1" and returns the receive buffer; ``commit()`` posts the batch without
    waiting (``batch_isend_irecv``); ``wait()`` blocks until it has arrived. Work placed
    between commit and wait overlaps with the transfer. ``sent_bytes`` holds the bytes
    posted by each commit.
    """

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "ring attention: argument 'group' is None and no default process group is "
                "initialised; call torch.distributed.init_process_group (gloo on CPUs, nccl on "
                "GPUs) on every rank first, or use flashlib.distributed.spawn")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ring = group if group is not None else dist.group.WORLD
        # P2POp takes global ranks: translate the neighbours' ranks within the group.
        self._next = dist.get_global_rank(ring, (self.rank + 1) % self.world_size)
        self._previous = dist.get_global_rank(ring, (self.rank - 1) % self.world_size)
        self._ops: list = []
        self._requests = None
        self.sent_bytes: list[int] = []

    def send_recv(self, tensor: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(tensor)
        tag = len(self._ops) // 2  # one tag per pair: each tensor meets its own buffer
        self._ops.append(dist.P2POp(dist.isend, tensor, self._next, self.group, tag))
        self._ops.append(dist.P2POp(dist.irecv, received, self._previous, self.group, tag))
        return received

    def commit(self) -> None:
        if self._requests is not None:
            raise RuntimeError("RingComm.commit: the previous batch was not waited for")
        self.sent_bytes.append(sum(op.tensor.numel() * op.tensor.element_size()
                                   for op in self._ops if op.op is dist.isend))
        self._requests = dist.batch_isend_irecv(self._ops)

    def wait(self) -> None:
        if self._requests is None:
            raise RuntimeError("RingComm.wait: nothing was committed")
        for request in self._requests:
            request.wait()
        self._requests, self._ops = None, []


# What every rank must agree on, one int64 each in the one all_gather of a call.
_AGREED = ("batch", "heads", "local_seq", "head_dim", "head_dim_v", "dtype", "causal", "layout", "scale",
           "attention_chunk")
# Floating dtypes by name: the same codes in every process of one PyTorch version.
_FLOAT_DTYPES = tuple(sorted({d for d in vars(torch).values()
                              if isinstance(d, torch.dtype) and d.is_floating_point}, key=str))


def _float_to_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]  # the float64's bits: compared exactly


def _bits_to_float(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", code))[0]


def _encode(q, head_dim_v: int, causal: bool, layout: str, scale: float, chunk: int) -> list[int]:
    return [*q.shape, head_dim_v, _FLOAT_DTYPES.index(q.dtype), int(causal), LAYOUTS.index(layout),
            _float_to_bits(scale), chunk]


_DECODE = {"dtype": _FLOAT_DTYPES.__getitem__, "causal": bool, "layout": LAYOUTS.__getitem__,
           "scale": _bits_to_float}
_FIXES = {
    "dtype": "every rank must pass q, k, v of one dtype (a shard of another dtype would be "
             "read as the wrong bits)",
    "causal": "every rank must pass the same causal",
    "layout": "every rank must pass the same layout, the one the sequence was sharded with",
    "scale": "every rank must pass the same scale (or None everywhere: 1/sqrt(head_dim))",
    "attention_chunk": "every rank must pass the same attention_chunk",
}
_SHAPE_FIX = ("every rank must hold q, k, v of one shape (batch, heads, local_seq, head_dim; v head_dim_v); cut "
              "the sequence with shard(x, rank, world_size, layout=...) so that all hold one length")


def _check_same_everywhere(q, head_dim_v: int, causal: bool, layout: str, scale: float, group, chunk: int = 0) -> None:
    """One small all_gather: mismatched ranks all raise the same error instead of hanging or
    silently computing garbage (a float16 rank reading a bfloat16 rank's bits)."""
    local = torch.tensor(_encode(q, head_dim_v, causal, layout, scale, chunk), dtype=torch.int64, device=q.device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    rows = [t.tolist() for t in gathered]
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if not differ:
        return
    rank = differ[0]
    field = next(i for i, (a, b) in enumerate(zip(rows[rank], rows[0])) if a != b)
    name = _AGREED[field]
    seen, expected = (_DECODE.get(name, int)(row[field]) for row in (rows[rank], rows[0]))
    if name == "layout":
        seen, expected = repr(seen), repr(expected)
    if field < 4:
        seen, expected = f"{seen} (shape {tuple(rows[rank][:4])})", f"{expected} (shape {tuple(rows[0][:4])})"
    also = f" (ranks {differ} all differ from rank 0)" if len(differ) > 1 else ""
    of = "" if group is None else " of the group"
    raise ValueError(f"ring_attention: rank {rank}{of} has {name} {seen} but rank 0 has {expected}{also}; "
                     f"{_FIXES.get(name, _SHAPE_FIX)}")


# ----- the local block: fused kernel on a GPU, tiled reference on a CPU ----------------

def block_score(score_mod, q_positions: torch.Tensor, k_positions: torch.Tensor):
    """score_mod as one block of the ring sees it: its local query row i sits at global position
    q_positions[i] and its key j at k_positions[j], so that ALiBi or a bias table means what it means
    on the whole sequence (an index into captured tensors: the kernels compile it as any other)."""
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_positions[q_idx], k_positions[kv_idx])


def block_mask_mod(chunk: int, q_positions: torch.Tensor, k_positions: torch.Tensor):
    """Chunked attention on one block of the ring, as a mask function: local query row i sees local key j
    when their global positions q_positions[i], k_positions[j] lie in one chunk of ``chunk``: the rule
    of :class:`flashlib.rules.Visibility`, on one sequence (seq_q = seq_k), asked at global positions."""
    rule = Visibility(chunk=chunk)
    return lambda b, h, q_idx, kv_idx: rule.pairs(q_positions[q_idx], k_positions[kv_idx], 1, 1)


def local_forward(q, k, v, *, causal: bool, scale: float, score_mod=None, mask_mod=None):
    """(out, lse) of one block: ``flash_attention``'s forward on a GPU, tiled otherwise."""
    if q.is_cuda:
        return kernel_forward(q, k, v, causal=causal, scale=scale, score_mod=score_mod, mask_mod=mask_mod)
    return tiled_forward(q, k, v, block_q=CPU_BLOCK, block_k=CPU_BLOCK, causal=causal, scale=scale,
                         score_mod=score_mod, mask_mod=mask_mod)


def local_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float, score_mod=None, captured=(),
                   mask_mod=None):
    """(dq, dk, dv) of one block given the *final* out and lse of its query rows; with captured (the
    tensors score_mod reads that require grad), their gradients' shares from this block after those."""
    if q.is_cuda:
        return kernel_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, score_mod=score_mod,
                               captured=captured, mask_mod=mask_mod)
    return tiled_backward(q, k, v, out, lse, dout, block_q=CPU_BLOCK, block_k=CPU_BLOCK, causal=causal,
                          scale=scale, score_mod=score_mod, captured=captured, mask_mod=mask_mod)


def kernel_forward(q, k, v, *, causal: bool, scale: float, score_mod=None, mask_mod=None):
    """One block through ``flash_attention``'s forward kernel: (out, lse). The GPU path;
    on a CPU it runs in Triton's interpreter (slow: for tests)."""
    from .op import flash_attention_forward  # needs Triton: imported only when used

    # A zigzag block is half a shard: a strided view, made dense for the kernel.
    q, k, v = (t.contiguous() for t in (q, k, v))
    return flash_attention_forward(q, k, v, causal=causal, scale=scale, score_mod=score_mod, mask_mod=mask_mod)


def kernel_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float, score_mod=None, captured=(),
                    mask_mod=None):
    """One block through ``flash_attention``'s backward kernels: (dq, dk, dv), and with captured
    their gradients' shares (:func:`flashlib.kernels.function.score_grads`)."""
    from .op import flash_attention_backward

    q, k, v, out, lse, dout = (t.contiguous() for t in (q, k, v, out, lse, dout))
    grads = flash_attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, score_mod=score_mod,
                                     mask_mod=mask_mod)
    if not captured:
        return grads
    from .kernels.function import score_grads

    return (*grads, *score_grads(q, k, v, out, lse, dout, None,
                                 Options.of(causal=causal, scale=scale, mask_mod=mask_mod, score_mod=score_mod),
                                 captured))


def _work_dtype(dtype):
    # Half-precision blocks are merged and accumulated in float32, as the kernels do.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class RingStep:
    """One step of the ring on one rank, as :func:`ring_forward`'s ``on_step`` sees it."""

    step: int
    rank: int
    origin: int                 # the rank whose key/value shard is held at this step
    block: RingBlock | None     # what was computed; None if the step was idle
    out: torch.Tensor           # (batch, heads, local_seq, head_dim_v) running output after it
    lse: torch.Tensor           # (batch, heads, local_seq) running log-sum-exp after it


def ring_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                 layout: str = "contiguous", group=None, comm: RingComm | None = None,
                 block_forward: Callable = local_forward, on_step: Callable | None = None, score_mod=None,
                 attention_chunk: int = 0):
    """The ring's forward pass without autograd: returns this rank's (out, lse).

    q, k, v: this rank's shards, (batch, heads, local_seq, head_dim), v's head dim its own. ``comm`` (default a
    :class:`RingComm` on ``group``) and ``block_forward`` are what the loop uses to talk
    and to compute; ``on_step`` gets a :class:`RingStep` after every step. score_mod: told
    global positions (:func:`block_score`); attention_chunk: chunks of global positions
    (:func:`block_mask_mod`; a block whose positions share no chunk is skipped).
    """
    comm = comm if comm is not None else RingComm(group)
    rank, world = comm.rank, comm.world_size
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = _work_dtype(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=work, device=q.device)  # (batch, heads, local_seq, dv)
    lse = torch.full(q.shape[:-1], NEG_INF, dtype=work, device=q.device)  # nothing seen yet
    for step in range(world):
        last = step + 1 == world
        if not last:  # post the next shard's transfer before computing on this one
            next_k, next_v = comm.send_recv(k), comm.send_recv(v)
            comm.commit()
        origin = (rank - step) % world
        block, told = _block(q, rank, origin, world, causal, layout, score_mod, attention_chunk)
        if block is not None:
            rows, cols = (..., block.q, slice(None)), (..., block.k, slice(None))
            out_b, lse_b = block_forward(q[rows], k[cols], v[cols], causal=block.causal, scale=scale, **told)
            out[rows], lse[..., block.q] = merge_partials(out[rows], lse[..., block.q],
                                                          out_b.to(work), lse_b.to(work))
        if on_step is not None:
            on_step(RingStep(step, rank, origin, block, out, lse))
        if not last:
            comm.wait()
            k, v = next_k, next_v
    return out.to(q.dtype), lse


def _block(q, rank: int, origin: int, world: int, causal: bool, layout: str, score_mod, attention_chunk: int):
    """(the block of rank's queries and origin's keys, or None where the causal rule or the chunks hide
    it whole; the keywords that tell its functions global positions: block_score, block_mask_mod)."""
    block = ring_block(rank, origin, q.shape[-2], causal=causal, layout=layout)
    if block is None or (score_mod is None and not attention_chunk):
        return block, {}
    total = q.shape[-2] * world
    q_pos = positions(total, rank, world, layout=layout)[block.q]
    k_pos = positions(total, origin, world, layout=layout)[block.k]
    told = {}
    if attention_chunk:
        if not bool(torch.isin(q_pos // attention_chunk, k_pos // attention_chunk).any()):
            return None, {}  # no query of the block shares a chunk with a key of it
        told["mask_mod"] = block_mask_mod(attention_chunk, q_pos.to(q.device), k_pos.to(q.device))
    if score_mod is not None:
        told["score_mod"] = block_score(score_mod, q_pos.to(q.device), k_pos.to(q.device))
    return block, told


def ring_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                  layout: str = "contiguous", group=None, comm: RingComm | None = None,
                  grad_comm: RingComm | None = None, block_backward: Callable = local_backward, score_mod=None,
                  captured=(), attention_chunk: int = 0):
    """This rank's (dq, dk, dv), with dK and dV travelling around the ring beside K and V; with
    captured (tensors score_mod reads that require grad), this rank's share of their gradients after.

    At step t the rank holds K, V from rank ``origin`` and the dK, dV accumulated for
    them by the ranks before it; it adds its block's contribution and passes both on.
    One more hop after the last step brings every rank the complete dK, dV of its own
    shard. ``out`` and ``lse`` are the final forward results: each block's P is
    recomputed from the global lse, so the blocks' gradients simply add up.
    """
    comm = comm if comm is not None else RingComm(group)
    grad_comm = grad_comm if grad_comm is not None else RingComm(group)
    rank, world = comm.rank, comm.world_size
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = _work_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    dcaptured = [torch.zeros_like(t) for t in captured]
    for step in range(world):
        last = step + 1 == world
        if not last:
            next_k, next_v = comm.send_recv(k), comm.send_recv(v)
            comm.commit()
        origin = (rank - step) % world
        block, told = _block(q, rank, origin, world, causal, layout, score_mod, attention_chunk)
        grads = None
        if block is not None:
            rows, cols = (..., block.q, slice(None)), (..., block.k, slice(None))
            if score_mod is not None:
                told["captured"] = captured
            grads = block_backward(q[rows], k[cols], v[cols], out[rows], lse[..., block.q],
                                   dout[rows], causal=block.causal, scale=scale, **told)
            for total, share in zip(dcaptured, grads[3:]):
                total += share
        if step == 0:
            dk = torch.zeros(k.shape, dtype=work, device=k.device)
            dv = torch.zeros(v.shape, dtype=work, device=v.device)
        else:  # the accumulators for `origin`, sent by rank - 1 after its previous step
            grad_comm.wait()
            dk, dv = next_dk, next_dv
        if grads is not None:
            dq[rows] += grads[0].to(work)
            dk[cols] += grads[1].to(work)
            dv[cols] += grads[2].to(work)
        if world > 1:  # sent on now, received while the next block is computed
            next_dk, next_dv = grad_comm.send_recv(dk), grad_comm.send_recv(dv)
            grad_comm.commit()
        if not last:
            comm.wait()
            k, v = next_k, next_v
    if world > 1:
        grad_comm.wait()
        dk, dv = next_dk, next_dv
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dcaptured)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd around the ring pair: saves this rank's (q, k, v, out, lse). options: the call's
    (flashlib.machinery.options: causal, scale, score_mod, sinks); ring: (layout, group); tensors: the options'
    tensors (Options.tensors), then those the score function reads that require grad."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options, ring: dict, *tensors):
        held = len(options.tensors)
        options = options.with_tensors(tensors[:held])
        keywords = dict(causal=options.visibility.causal, scale=options.scale, score_mod=options.score_function,
                        attention_chunk=options.visibility.chunk, **ring)
        out, lse = ring_forward(q, k, v, **keywords)
        sinks = options.sinks
        if sinks is not None:  # merged once, after the ring, like one more partial with no value
            out, lse = merge_sink(out.to(lse.dtype), lse, sinks)
            out = out.to(q.dtype)
        save(ctx, q, k, v, out, lse, *tensors)
        ctx.keywords, ctx.held = keywords, held
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *tensors = saved(ctx)
        sinks, captured = (tensors[0] if ctx.held else None), tensors[ctx.held:]
        dout = dout.contiguous()
        # every block's P comes from the final lse, which holds the sinks: the ring is unchanged
        dq, dk, dv, *dcaptured = ring_backward(q, k, v, out, lse, dout, captured=captured, **ctx.keywords)
        dheld = []
        if sinks is not None:  # this rank's rows' share; summed over ranks where sinks are replicated
            delta = softmax_delta(out, dout, dtype=lse.dtype)
            dheld = [sink_grad(sinks, lse, delta)]
        return dq, dk, dv, None, None, *dheld, *dcaptured


def _check_shards(fn: str, q, k, v, causal, scale, layout) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{fn}: argument '{name}' must be a floating-point torch.Tensor, "
                            f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.ndim != 4:
            raise ValueError(f"{fn}: argument '{name}' must be this rank's shard of shape (batch, heads, "
                             f"local_seq, head_dim); got shape {tuple(t.shape)}")
    if not (q.shape == k.shape and q.shape[:-1] == v.shape[:-1]) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k and v must be shards of one shape and dtype (each rank holds the "
                         f"same positions of all three; v may have a head dim of its own); got q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
    if v.shape[-1] < 1:
        raise ValueError(f"{fn}: argument 'v' must have head_dim >= 1; got shape {tuple(v.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: argument 'causal' must be True or False, got {causal!r}")
    _check_layout(fn, layout)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{fn}: a zigzag shard holds two equal chunks, so local_seq must be even; "
                         f"got {q.shape[-2]} (cut the sequence with shard(..., layout='zigzag'))")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"{fn}: argument 'scale' must be a finite real number or None, got {scale!r}")
    return float(scale)


def ring_attention(q, k, v, *, causal: bool = False, scale: float | None = None, group=None,
                   layout: str = "contiguous", sinks=None, score_mod=None, softcap=None,
                   attention_chunk=None) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``; differentiable.

    Args:
        q, k: this rank's shards, (batch, heads, local_seq, head_dim), equal on every
            rank; take them with ``shard(x, rank, world_size, layout=layout)``.
        v: (batch, heads, local_seq, head_dim_v); head_dim_v may differ from head_dim (MLA's
            192/128); the output has it.
        causal: query at global position i sees keys at positions j <= i. Blocks that
            the mask hides entirely are skipped (see :func:`ring_block`).
        scale: defaults to 1/sqrt(head_dim), q's head dim.
        group: a process group (gloo on CPUs, nccl on GPUs); default: the world group,
            which ``torch.distributed.init_process_group`` must have initialised. With
            nccl, call ``torch.cuda.set_device`` on each rank first (one GPU per rank).
        layout: "contiguous" or "zigzag", how the sequence was sharded.
        sinks: attention sinks (heads,) as in :func:`flashlib.flash_attention`, applied to this
            rank's rows: merged once after the ring as a partial with no value. Their gradient is
            this rank's rows' share (a replicated parameter's gradients add up across ranks, as
            DistributedDataParallel's all-reduce does).
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`), told
            global positions (the queries' and keys' places in the whole sequence, whatever the
            layout), as on one device. The tensors it captures that require grad get this rank's
            share of their gradient (replicated: they add up across ranks, as the sinks' do).
        softcap: soft-capping, the score function ``flashlib.scores.softcap(softcap)``, as in
            :func:`flashlib.flash_attention`. Every rank passes the same score_mod and softcap.
        attention_chunk: C > 0: chunked local attention by global position, a query at i sees the
            keys j with j // C == i // C (and j <= i if causal); a block whose positions share no
            chunk is skipped, and the rest skip the tiles outside the chunks (the rule runs as a mask
            function told global positions, :func:`block_mask_mod`).

    Returns this rank's shard (batch, heads, local_seq, head_dim_v) of
    ``dense_attention(gathered q, k, v)``, in the same layout. The local blocks run
    ``flash_attention``'s forward and backward on a GPU and the tiled reference on a CPU;
    float16 and bfloat16 partial results are merged, and dQ, dK, dV summed, in float32.

    Every rank must pass the same shapes, dtype, causal, layout and scale: one small
    all_gather per call compares them, and on a mismatch every rank raises ValueError
    naming the first rank that differs, its value and rank 0's.
    """
    fn = "ring_attention"
    scale = _check_shards(fn, q, k, v, causal, scale, layout)
    options = checked_options(fn, q.shape[1], q.device, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
                              score_mod=score_mod, attention_chunk=attention_chunk)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{fn}: argument 'group' is None and no default process group is initialised; call "
            "torch.distributed.init_process_group (gloo on CPUs, nccl on GPUs) on every rank first "
            "(flashlib.distributed.spawn does it for a ring of CPU processes)")
    score = options.score_function
    captured = trainable(captured_tensors(fn, score)) if score is not None and torch.is_grad_enabled() else []
    _check_same_everywhere(q, v.shape[-1], causal, layout, scale, group, options.visibility.chunk)
    return RingAttentionFunction.apply(q, k.contiguous(), v.contiguous(), options, dict(layout=layout, group=group),
                                       *options.tensors, *captured)


# ----- a ring of CPU processes ---------------------------------------------------------

class RingProcessError(RuntimeError):
    """A process of :func:`spawn` raised or died; the message holds its traceback."""


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else None


def _child(fn, rank: int, world_size: int, port: int, args, limit: float, results) -> None:
    import os

    try:
        torch.set_num_threads(1)  # ranks share the machine's cores
        interface = _loopback_interface()
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface  # keep gloo's traffic on 127.0.0.1
        timeout = datetime.timedelta(seconds=limit)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        # Plain pickle: tensors travel by value, not as shared memory that dies with the child.
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        # Report before the connections close (at exit), so that this traceback, not a peer's
        # "connection closed", is the first failure the parent reads.
        results.put((rank, False, traceback.format_exc()))
        return
    dist.destroy_process_group()
    results.put((rank, True, payload))


def _check_spawnable(fn) -> None:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if not callable(fn) or module in (None, "__main__") or "<" in name:
        raise TypeError(
            f"spawn: argument 'fn' must be a function defined at the top level of an importable "
            f"module, got {name!r} from module {module!r}; new processes import it by name, so a "
            "function defined in a notebook cell or inside another function cannot run there")


def spawn(fn: Callable, world_size: int, *, args: tuple = (), timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined by gloo.

    The processes meet through a store this process opens on a free port of 127.0.0.1;
    each gets the default process group, one CPU thread and ``timeout`` seconds (also the
    process group's timeout, so a stuck transfer raises). Returns the list of what each
    rank returned. Raises :class:`RingProcessError` with the child's traceback if a rank
    fails, and TimeoutError naming the ranks still running after ``timeout`` seconds;
    either way every child is stopped.
    """
    _check_spawnable(fn)
    world_size = _check_count("spawn", "world_size", world_size, 1)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"spawn: argument 'timeout' must be a positive number of seconds, got {timeout!r}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))  # port 0: the OS picks a free one
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    children = [context.Process(target=_child, daemon=True,
                                args=(fn, r, world_size, store.port, args, float(timeout), results))
                for r in range(world_size)]
    for child in children:
        child.start()
    try:
        return _collect(children, results, world_size, time.monotonic() + timeout, timeout)
    finally:
        _stop(children)
        del store


def _collect(children, results, world_size: int, deadline: float, timeout: float) -> list:
    values, failures, first_failure = {}, {}, None
    while len(values) + len(failures) < world_size:
        if first_failure is not None and time.monotonic() > first_failure + 2.0:
            break  # the other ranks are probably blocked on the failed one
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(values) - set(failures))
            raise TimeoutError(f"spawn: rank(s) {missing} of {world_size} did not finish within "
                               f"{timeout:g} s; they were stopped")
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            _note_dead(children, values, failures)
        else:
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures.setdefault(rank, payload)
        if failures and first_failure is None:
            first_failure = time.monotonic()
    if failures:
        rank = next(iter(failures))  # the first to fail; the others often failed because of it
        later = sorted(set(failures) - {rank})
        others = f" (then also rank(s) {later})" if later else ""
        raise RingProcessError(f"rank {rank} of {world_size} failed{others}; its traceback:\n"
                               f"{failures[rank]}")
    return [values[r] for r in range(world_size)]


def _note_dead(children, values, failures) -> None:
    """A child that exited without reporting (killed, crashed in C) counts as failed."""
    for rank, child in enumerate(children):
        if child.exitcode not in (None, 0) and rank not in values and rank not in failures:
            failures[rank] = (f"the process exited with code {child.exitcode} before returning a result; "
                             "what it printed went to this process's standard error\n")


def _stop(children) -> None:
    for child in children:
        child.join(timeout=0.5)
        if child.is_alive():
            child.terminate()
            child.join(timeout=2.0)
        if child.is_alive():
            child.kill()
            child.join()


# ----- what the notebook replays ----------------------------------------------------------

def trace_worker(rank: int, world_size: int, q, k, v, causal: bool, layouts=LAYOUTS,
                 dout=None) -> dict:
    """Run on each rank by :func:`spawn` for notebook 11: shard the whole (batch, heads, seq,
    head_dim) q, k, v, run the ring forward once per layout and return, per layout, every
    :class:`RingStep` (with copies of the running out and lse) and the bytes posted per
    step; with ``dout`` also this rank's (dq, dk, dv) from :func:`ring_attention`."""
    traces = {}
    for layout in layouts:
        parts = [shard(t, rank, world_size, layout=layout) for t in (q, k, v)]
        steps, comm = [], RingComm()

        def record(s: RingStep):
            steps.append(RingStep(s.step, s.rank, s.origin, s.block, s.out.clone(), s.lse.clone()))

        ring_forward(*parts, causal=causal, layout=layout, comm=comm, on_step=record)
        traces[layout] = dict(steps=steps, sent_bytes=comm.sent_bytes)
        if dout is not None:
            leaves = [p.clone().requires_grad_() for p in parts]
            out = ring_attention(*leaves, causal=causal, layout=layout)
            out.backward(shard(dout, rank, world_size, layout=layout))
            traces[layout]["grads"] = [leaf.grad for leaf in leaves]
    return traces
