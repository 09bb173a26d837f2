"""Decoding with a KV cache: a few new queries against a long cache, cut into splits and merged.

A model that generates text runs one step per new token. The keys and values of earlier positions never
change, so they are kept in a **KV cache**: each step computes q, k, v for its new tokens only, appends k and
v to the cache and attends over all of it, a few query rows against L cached keys. The cache is read once and
each byte of it takes part in only a few multiply-adds, so decoding is bound by memory bandwidth.

Conventions (flash-attn's ``flash_attn_with_kvcache``, vLLM's paged cache):

    q              (batch, q_heads, new_tokens, head_dim)   the new tokens' queries
    k/v cache      (batch, kv_heads, capacity, head_dim)    contiguous: a slot per position
                   (num_pages, kv_heads, page_size, head_dim) with block_table (batch, max_pages)
                   int32: position j of sequence b lives in page block_table[b, j // page_size]
    cache_seqlens  (batch,) int32: valid positions of each sequence, its new tokens included; query i
                   sits at position cache_seqlens[b] - new_tokens + i (:func:`decode_attention`)
    GQA            q_heads a multiple of kv_heads; query head h reads kv head h // (q_heads // kv_heads)

Split-KV (Flash-Decoding): each sequence's visible keys are cut into ``num_splits`` splits
(:func:`flashlib.splitkv.split_bounds`), each giving a partial output and its log-sum-exp, which notebook 02's
:func:`flashlib.merge_partials` combines: :func:`flashlib.splitkv.decode_reference` in plain PyTorch (a loop
over splits), :func:`decode_attention` with the two Triton kernels of :mod:`flashlib.kernels.decode` (imported
on first use). Here: the public ops (:func:`decode_attention` and :class:`DecodePlan`, absorbed MLA's
:func:`mla_decode_attention`, shared prefixes' :func:`cascade_attention` and :class:`CascadePlan`); their
reference in :mod:`flashlib.splitkv`, their checks in :mod:`flashlib.machinery.decode_checks`.
"""
from __future__ import annotations

import numbers
import threading

import torch

from . import kvcache
from .kvcache import Batch
from .machinery.decode_checks import (DecodeArgs, _check_caches, _check_num_splits, _check_tensor,
                                      check_decode_values, decode_options)
from .machinery.decode_checks import check_decode_inputs  # noqa: F401  (re-exported: flashlib.decode's names)
from .machinery.options import Options, checked_options
from .rules import Visibility
from .softmax import merge_partials, merge_sink
from .splitkv import _prepared, split_bounds
from .splitkv import (KVCACHE_ARGUMENTS, decode_partials, decode_reference, gather_cache,  # noqa: F401  (re-exported)
                      kv_cache_bytes, paged_cache, split_attention)

FN = "decode_attention"


# ----- the public function ------------------------------------------------------------------

MAX_HEAD_DIM = 576  # the decoding kernels' widest q and k: absorbed MLA's latent 512 + rope 64


def _check_kernel_q(fn, q):
    """The fused kernels' checks of q (dtype, device, Triton there) with decoding's own head-dim limit: the
    split kernel takes absorbed MLA's 576 (one query row block's tile, never a whole sequence's)."""
    from .kernels._mode import require_triton

    require_triton()
    from .kernels.function import check_kernel_inputs

    if isinstance(q, torch.Tensor) and q.dtype == torch.float64:
        raise TypeError(f"{fn}: argument 'q' is float64, which the kernels do not compute; use float16, "
                        "bfloat16 or float32 (or flashlib.decode_reference for float64)")
    if not isinstance(q, torch.Tensor) or q.ndim < 1:  # named by the shared checks
        return
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: argument 'q' has head_dim {head_dim}; the decoding kernels support head_dim "
                         f"1..{MAX_HEAD_DIM} (use flashlib.decode_reference for larger)")
    check_kernel_inputs(fn, q[..., :min(head_dim, 1)])  # the rest of its checks, on one column


def _check_kernel_call(fn, **tensors):
    """A call on the kernels: no tensor requires grad (decoding is inference only); q as :func:`_check_kernel_q`."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:  # not a tensor: named by its own check
                raise ValueError(f"{fn}: argument '{name}' requires grad, but decoding is inference only "
                                 "(there is no backward); call it under torch.no_grad() or "
                                 f"torch.inference_mode(), or pass {name}.detach()")
    _check_kernel_q(fn, tensors["q"])



# ----- plan once, run many ---------------------------------------------------------------------------

def _layout(t):
    """What a plan's launches fix of a tensor: its shape, strides, dtype and device (and that it needs no grad)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _describe(layout) -> str:
    if layout is None:
        return "None"
    shape, stride, dtype, device, grad = layout
    return f"shape {tuple(shape)}, strides {stride}, {dtype} on {device}" + (", requiring grad" if grad else "")


def _planned(fn, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, prefix: dict, options: Options):
    """A plan's checks of its example call, on a cache already written and read in place: (its Batch, its
    DecodeArgs); prefix: a cascade's shared prefix_k and prefix_v, checked alike; options: checked already."""
    args = check_decode_inputs(fn, q, k_cache, v_cache, cache_seqlens, block_table=block_table, num_splits=num_splits,
                               options=options)
    for name, t in dict(prefix, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                        block_table=block_table).items():
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{fn}: argument '{name}' has strides {t.stride()}; a plan reads it in place, so its "
                             f"last dim must be contiguous: pass {name}.contiguous()")
    batch = kvcache.prepare(fn, q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                            rule=options.visibility).write()
    check_decode_values(fn, batch, args, k_cache.shape[0])
    return batch, args


class _Plan:
    """What both plans share: made for a call already checked (:meth:`_of`), a run's tensors held to the
    layouts the plan was made for (``NAMES``, ``_layouts``), and one run at a time (``_lock``)."""

    def _made(self, layouts: tuple, launches: tuple):
        """The end of a build: the layouts runs must have, the launches whose copies each run refreshes."""
        self._layouts, self._lock = layouts, threading.Lock()
        self._refresh = [launch.refresh for launch in launches if launch.copies]

    def _run(self, launch):
        """launch() under the plan's lock, after its copies are made again (they read this run's values)."""
        with self._lock:
            for refresh in self._refresh:
                refresh()
            return launch()

    @classmethod
    def _of(cls, fn, *args, **kwargs):
        """The plan of a call that names itself ``fn`` (decode_attention, cascade_attention)."""
        plan = cls.__new__(cls)
        plan._build(fn, *args, **kwargs)
        return plan

    def _check_run(self, tensors, out):
        """The ValueError of a run given tensors (or an ``out``) of another layout than the plan's: the first named."""
        got = tuple(map(_layout, (*tensors, out)))
        want = (*self._layouts, None if out is None else _layout(self.out))
        if got != want:
            name, g, w = next((n, g, w) for n, g, w in zip((*self.NAMES, "out"), got, want) if g != w)
            fn = type(self).__name__
            raise ValueError(f"{fn}.run: argument '{name}' has {_describe(g)}, but the plan was made for "
                             f"{_describe(w)}; make a {fn} for this layout (its launches carry the shapes and "
                             "strides it was made with)")


class DecodePlan(_Plan):
    """:func:`decode_attention` for one batch layout, planned once; :meth:`run` only launches.

    A decoding step calls attention once per layer, every step with the same layout. What depends on the
    layout alone is done here, once: the checks, the score function's trace, the split count, the kernels'
    grids and arguments, the scratch buffers and the output. :meth:`run` launches the two kernels and nothing
    else (no allocation, no synchronisation, no value read on the host: a CUDA graph can capture it;
    FlashInfer's ``plan``/``run``, vLLM's metadata builders)::

        plan = DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table=table)   # once per layout
        for layer in range(layers):                                                  # every step
            out = plan.run(q_of[layer], k_of[layer], v_of[layer], cache_seqlens, table)

    Args: :func:`decode_attention`'s for a cache already written (no append, rotation, pooled rows, left
    padding or packed q). The example call's values are checked here (lengths within the capacity, pages in
    range), a later step's by :meth:`check` (one synchronisation), not by :meth:`run`.

    Fixed when the plan is made:

    * the layout of q, the caches, cache_seqlens and block_table (shapes, strides, dtypes, devices), the
      split count, the grids and the buffers;
    * causal, scale, window, attention_chunk and softcap;
    * the score function's code and the numbers it reads (a new temperature needs a new plan), and which
      tensors it reads: the objects themselves (rebinding a name to a new tensor is not seen);
    * which tensor holds the sinks.

    Read at every run:

    * the values in the tensors :meth:`run` is given;
    * the values in the tensors the score function reads, whatever their dtype (an int64 one whose values
      fit int32 is copied into an int32 buffer of the plan's at every run, as the kernel reads it); an integer
      one's within what the plan's kernel serves (it was written for the values the tensor held when the plan
      was made: :meth:`check` traces the function again where they left those, and says if it needs another
      kernel). A tensor read by position must cover the cache's capacity (a plan serves every length up to it);
    * the sinks' values, whatever their dtype and strides (copied into a float32 buffer at every run where
      they are not float32 and contiguous).

    :meth:`run` takes tensors of the plan's layout, any values. The output goes to ``out`` or to ``plan.out``,
    which the next run overwrites (copy it, or pass ``out``, to keep it); the lse (natural log) to ``plan.lse``.
    Runs of one plan take turns (a lock: they share its scratch buffers), so threads may share a plan,
    each passing its own ``out``; ``plan.out`` and ``plan.lse`` hold whichever run was last. The lock orders
    launches, not their execution on a GPU: threads on different CUDA streams need a plan each.
    """

    NAMES = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")

    def __init__(self, q, k_cache, v_cache, cache_seqlens, *, causal: bool = True, scale=None, softcap=None,
                 window=None, block_table=None, num_splits=None, sinks=None, score_mod=None, attention_chunk=None):
        _check_kernel_call("DecodePlan", q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks)
        options = decode_options("DecodePlan", q, causal=causal, scale=scale, window=window, softcap=softcap,
                                 score_mod=score_mod, sinks=sinks, attention_chunk=attention_chunk)
        batch, args = _planned("DecodePlan", q, k_cache, v_cache, cache_seqlens, block_table, num_splits, {}, options)
        self._build("DecodePlan", batch, args, num_splits, regions=None)
        from .machinery.trace import value_bounds

        # the values of the integer tensors the score function reads that its kernel was written for (check())
        tensors = () if self._score is None else self._score.captured
        self._integers = [(t, value_bounds(t)) for t in tensors if not (t.is_floating_point() or t.dtype is torch.bool)]

    def _build(self, fn, batch: Batch, args: DecodeArgs, num_splits, regions):
        from .kernels.decode import DecodeLaunch
        from .kernels.function import kernel_score

        size, heads = batch.q.shape[:2]
        self._compile_score = lambda: kernel_score(args.options, batch.q.device, batch=size, heads=heads,
                                                   seq_q=args.capacity, seq_k=args.capacity, fn=fn, regions=regions)
        self._score = score = self._compile_score()
        self._integers = []  # (tensor, the values its kernel serves): set by __init__, for check()
        self.args, self._starts = args, batch.starts
        self._launch = DecodeLaunch(batch.q, batch.k_cache, batch.v_cache, options=args.options, score=score,
                                    block_table=batch.block_table, num_splits=num_splits,
                                    new_tokens=batch.new_tokens, starts=batch.starts)
        self.out, self.lse = self._launch.out, self._launch.lse
        self._made(tuple(map(_layout, (batch.q, batch.k_cache, batch.v_cache, batch.seqlens, batch.block_table))),
                   (self._launch,))

    @property
    def launch_shape(self):
        """Both kernels' tiles, split count and grids (:class:`flashlib.kernels.decode.LaunchShape`); None if empty."""
        return getattr(self._launch, "shape", None)

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table=None, *, out=None, return_lse: bool = False):
        """Launch both kernels on this step's tensors (the plan's layout, any values); see the class."""
        self._check_run((q, k_cache, v_cache, cache_seqlens, block_table), out)
        out, lse = self._run(lambda: self._launch(q, k_cache, v_cache, cache_seqlens, block_table, out))
        return (out, lse) if return_lse else out

    def bound(self, q, k_cache, v_cache, cache_seqlens, block_table=None) -> list:
        """What :meth:`run` launches on these tensors, [(kernel, grid, args, kwargs)]: to inspect or time them bare."""
        return self._launch.bound(q, k_cache, v_cache, cache_seqlens, block_table)

    def check(self, cache_seqlens, block_table=None):
        """This step's values checked as the plan's were (lengths within the capacity, pages in range):
        one synchronisation, once per step rather than per layer."""
        batch = Batch(None, None, None, block_table, cache_seqlens, None, self._starts, None, None)
        pages = self._layouts[1][0][0]  # k_cache's pages (or sequences)
        check_decode_values("DecodePlan", batch, self.args, pages)
        self._check_integers()

    def _check_integers(self):
        """Where an integer tensor the score function reads left the values its kernel was written for, the
        function traced again for the values it holds now: the same kernel (the same source and int32 copies)
        serves them, else a ValueError."""
        from .machinery.trace import value_bounds

        now = [value_bounds(t) for t, _ in self._integers]
        if all(lo <= n_lo and n_hi <= hi for (_, (lo, hi)), (n_lo, n_hi) in zip(self._integers, now)):
            return
        again = self._compile_score()  # its indices checked for the values now too
        if again.source != self._score.source or [d.dtype for d in again.data[:len(again.captured)]] != [
                d.dtype for d in self._score.data[:len(self._score.captured)]]:
            t, _ = next(i for i, n in zip(self._integers, now) if not i[1][0] <= n[0] <= n[1] <= i[1][1])
            raise ValueError(f"DecodePlan: argument 'score_mod' reads a {t.dtype} tensor of shape {tuple(t.shape)} "
                             "whose values now need another kernel than the plan's (made for the values it held "
                             "then: int32 or int64 arithmetic, which indices need guards); make a new DecodePlan")
        self._integers = [(t, (min(lo, n[0]), max(hi, n[1]))) for (t, (lo, hi)), n in zip(self._integers, now)]


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, causal: bool = True, scale=None, softcap=None, window=None,
                     block_table=None, num_splits=None, sinks=None, score_mod=None, k_new=None, v_new=None,
                     rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = False, cache_batch_idx=None,
                     cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None, return_lse: bool = False,
                     attention_chunk=None):
    """Attention of a few new tokens per sequence over a KV cache, with split-KV kernels: flash-attn's
    ``flash_attn_with_kvcache`` in flashlib's (batch, heads, seq, dim) layout.

    Args:
        q: (batch, q_heads, new_tokens, head_dim); with ``cu_seqlens_q`` packed, (total_q, q_heads, head_dim).
        k_cache, v_cache: (batch, kv_heads, capacity, head_dim); with ``block_table`` a paged cache (num_pages,
            kv_heads, page_size, head_dim), vLLM's; with ``cache_batch_idx`` a pool of rows. Query head h reads
            kv head h // (q_heads // kv_heads); v_cache's head dim (and v_new's) may differ (MLA's).
        cache_seqlens: (batch,) int32, each sequence's valid positions, its new tokens included (before
            the call when ``k_new`` brings them: flash-attn's convention). With L the positions after
            the call and n the new tokens, query i sees the keys j <= L - n + i (causal)::

                n = 3, L = 6                               keys 0 1 2 3 4 5
                query 0 (position 3)                            1 1 1 1 0 0
                query 1 (position 4)                            1 1 1 1 1 0
                query 2 (position 5)                            1 1 1 1 1 1

            With L < n the first n - L rows see no key and give zeros (lse -inf), as flash-attn's.
        causal: False: every new token sees all L keys (cross-attention, a prefix-LM's prompt, drafted tokens
            verified). window (left, right), either way: L - n + i - left <= j <= L - n + i + right, -1: no limit.
        attention_chunk: C > 0 (0 or None: none): chunked local attention (Llama 4's), either way too: query i
            sees key j only when j // C == (L - n + i) // C, positions from the sequence's start (``cache_leftpad``).
        scale, softcap, sinks: as :func:`flashlib.flash_attention` (scale 1/sqrt(head_dim) by default).
        num_splits: splits per sequence, each read by its own program and merged by a second kernel;
            None chooses (:func:`flashlib.kernels.decode.choose_num_splits`; 1 in the interpreter).
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`) on the scaled
            scores before the mask; q_idx and kv_idx: positions in the sequence (L - n + i, not i) from its
            start, as in the prefill (flash-attn's ``alibi_slopes``: ``s - slope[b, h] * |q_idx - kv_idx|``).
        k_new, v_new, rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad, cu_seqlens_q,
            max_seqlen_q: the rest of flash-attn's contract (:mod:`flashlib.kvcache`): new keys and values appended
            in place (rotated), pooled caches, left padding, a mixed batch (prefill chunks beside steps) packed like q.
        return_lse: also return the lse, (batch, q_heads, new_tokens) float32 ((q_heads, total_q)
            packed), -inf for rows that see no key.

    Returns the output in q's layout and dtype, v_cache's head dim wide. Inference only. float16, bfloat16
    (sm_80 on) and float32, head_dim 1..576; without a CUDA device in Triton's CPU interpreter;
    :func:`decode_reference` in PyTorch, any dtype. A v_cache that is a view of k_cache's first columns
    (:func:`mla_decode_attention`) is read with the keys.
    """
    _check_kernel_call(FN, q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks, k_new=k_new, v_new=v_new)
    from .kernels.decode import as_kernels_read

    options = decode_options(FN, q, causal=causal, scale=scale, softcap=softcap, window=window, sinks=sinks,
                             score_mod=score_mod, attention_chunk=attention_chunk)
    batch, args = _prepared(FN, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, options, dict(
        k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q))
    ready = as_kernels_read(batch)
    plan = DecodePlan._of(FN, ready, args, num_splits, regions=lambda: _positions(ready, args.options.visibility))
    out, lse = batch.unpack(*plan._launch(ready.q, ready.k_cache, ready.v_cache, ready.seqlens, ready.block_table))
    return (out, lse) if return_lse else out


def _positions(batch: Batch, rule: Visibility) -> list[dict]:
    """The (b, h, q_idx, kv_idx) ranges the reference tells a score function for each sequence: to check the
    indices it reads where the cache's capacity fails it."""
    where = zip(*(t.tolist() for t in (batch.seqlens, batch.new_tokens, batch.starts)))
    return [{"b": (b, b), "h": (0, batch.q.shape[1] - 1), "q_idx": (seqlen - n - start, seqlen - 1 - start),
             "kv_idx": (split_bounds(seqlen, n, 1, rule=rule, start=start)[0][0] - start, seqlen - 1 - start)}
            for b, (seqlen, n, start) in enumerate(where)]


# ----- absorbed MLA: one latent cache, its first columns the values --------------------------------

def mla_decode_attention(q, kv_cache, cache_seqlens, *, head_dim_v: int = 512, block_table=None, scale=None,
                         kv_new=None, reference: bool = False, **options):
    """DeepSeek-V2/V3's multi-head latent attention decoding, absorbed: one latent cache holds the keys,
    and the values are its first ``head_dim_v`` columns, read once (with the keys).

    Each cached position keeps c_kv, its latent (512 wide in DeepSeek-V3), and k_rope, its rotated key part
    (64), shared by all query heads. With the up-projections absorbed, query head h's score is [q_nope W_UK_h,
    q_rope] . [c_kv, k_rope] and its output (softmax . c_kv) W_UV_h: MQA over one "kv head" of width 576
    whose values are the keys' first 512 columns::

        kv_cache row   | c_kv (latent)  0 .. head_dim_v - 1     | k_rope  head_dim_v .. width - 1 |
        key            |<------------------------ all width columns -------------------------->|
        value          |<------ the first head_dim_v ---------->|
        q row          | q_nope W_UK_h (absorbed)               | q_rope                          |
        out row        | softmax(q kᵀ scale) . values: head_dim_v wide (multiply by W_UV_h after)  |

    Args:
        q: (batch, q_heads, new_tokens, width), the absorbed queries (width 576 for DeepSeek).
        kv_cache: (batch, kv_heads, capacity, width), kv_heads 1 for DeepSeek (all query heads share it);
            with ``block_table`` paged, (num_pages, kv_heads, page_size, width).
        cache_seqlens, block_table: as :func:`decode_attention`.
        head_dim_v: the latent's width, the values' head dim (512), at most width.
        scale: 1/sqrt(width) by default; DeepSeek's is its un-absorbed head dim's (1/sqrt(128 + 64), times its
            YaRN mscale squared): pass it.
        kv_new: (batch, kv_heads, n_new, width) new latent rows to append in place (flash-attn's k_new, the
            values their first columns); rotate k_rope yourself (the rotary tables would rotate the latent).
        reference: compute with :func:`decode_reference` (PyTorch, any dtype) instead of the kernels.
        options: the rest of :func:`decode_attention`'s (causal, window, softcap, sinks, num_splits,
            cache_leftpad, cache_batch_idx, cu_seqlens_q, return_lse, ...).

    Returns out (batch, q_heads, new_tokens, head_dim_v) (and the lse with ``return_lse``); the kernel sees
    v_cache = kv_cache[..., :head_dim_v], a view of the keys' leading columns, and reads each row once.
    """
    fn = "mla_decode_attention"
    _check_tensor(fn, "kv_cache", kv_cache, 4)
    width = kv_cache.shape[-1]
    if isinstance(q, torch.Tensor) and q.ndim >= 1 and q.shape[-1] != width:
        raise ValueError(f"{fn}: argument 'q' is {q.shape[-1]} wide but 'kv_cache' {width}; the absorbed queries "
                         "[q_nope W_UK, q_rope] have the latent cache's width (576 for DeepSeek)")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral) or not 1 <= head_dim_v <= width:
        raise ValueError(f"{fn}: argument 'head_dim_v' is {head_dim_v!r}; the values are the latent cache's first "
                         f"head_dim_v columns, so it must be an int in 1..{width} (the cache's width)")
    for name in ("k_new", "v_new", "rotary_cos", "rotary_sin"):
        if options.get(name) is not None:
            hint = ("pass the new latent rows as 'kv_new' (keys and values are one row)" if name in ("k_new", "v_new")
                    else "rotate the rope columns of q and kv_new yourself (the tables would rotate the latent's)")
            raise ValueError(f"{fn}: argument '{name}' is not taken here; {hint}")
    if kv_new is not None:
        _check_tensor(fn, "kv_new", kv_new, 4 if options.get("cu_seqlens_q") is None else 3)
        options.update(k_new=kv_new, v_new=kv_new[..., :head_dim_v])
    run = decode_reference if reference else decode_attention
    return run(q, kv_cache, kv_cache[..., :head_dim_v], cache_seqlens, block_table=block_table, scale=scale, **options)


def mla_bytes(*, batch: int, tokens: int, width: int = 576, head_dim_v: int = 512, kv_heads: int = 1,
              q_heads: int = 128, new_tokens: int = 1, element_size: int = 2) -> dict:
    """Bytes one absorbed MLA decoding step moves (notebook 10's model: each cached row read once per
    kv head, queries read and outputs written once): ``shared``, the latent cache read once (values
    are its first columns), and ``separate``, a value cache of its own read beside it."""
    cache = batch * kv_heads * tokens * element_size
    queries = batch * q_heads * new_tokens * (width + head_dim_v) * element_size  # q read, out written
    shared = cache * width + queries
    separate = cache * (width + head_dim_v) + queries
    return dict(shared=shared, separate=separate, ratio=separate / shared)


# ----- shared prefixes: read once for a group, merged with each sequence's own suffix -------------

def _stack_queries(q, kv_heads: int):
    """(batch, q_heads, n, d) -> (1, kv_heads, batch * group * n, d): every query that reads kv head h,
    of every sequence, as the rows of one long query block (a prefill's shape, not a decoding step's)."""
    batch, q_heads, n, d = q.shape
    group = q_heads // kv_heads
    return q.reshape(batch, kv_heads, group, n, d).transpose(0, 1).reshape(1, kv_heads, batch * group * n, d)


def _unstack(t, batch: int, q_heads: int, n: int):
    """The inverse of :func:`_stack_queries` for (1, kv_heads, rows, ...) results."""
    kv_heads, tail = t.shape[1], t.shape[3:]
    return t.reshape(kv_heads, batch, q_heads // kv_heads, n, *tail).transpose(0, 1).reshape(batch, q_heads, n, *tail)


def _check_cascade(fn, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table, prefix_splits):
    _check_caches(fn, q, k_cache, v_cache, block_table)
    if v_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"{fn}: argument 'v_cache' has head_dim {v_cache.shape[-1]} but 'q' has {q.shape[-1]}; "
                         "cascade decoding takes one head dim for q, k and v")
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        _check_tensor(fn, name, t, 3)
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{fn}: argument '{name}' is {t.dtype} on {t.device}; expected q's {q.dtype} on {q.device}")
        if t.shape[0] != k_cache.shape[1] or t.shape[2] != q.shape[-1] or t.shape != prefix_k.shape:
            raise ValueError(f"{fn}: argument '{name}' has shape {tuple(t.shape)}; the shared prefix is "
                             f"(kv_heads {k_cache.shape[1]}, prefix_len, head_dim {q.shape[-1]}), k and v alike")
    if isinstance(cache_seqlens, torch.Tensor) and (cache_seqlens.long() < q.shape[2]).any():
        raise ValueError(f"{fn}: argument 'cache_seqlens' is below the {q.shape[2]} new tokens for a sequence; the new "
                         "tokens follow the prefix, so each sequence's own cache holds them all")
    _check_num_splits(fn, prefix_splits, "prefix_splits")


def cascade_attention(q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, *, scale=None, softcap=None,
                      block_table=None, num_splits=None, prefix_splits=None, sinks=None, return_lse: bool = False,
                      reference: bool = False):
    """Decoding for a group of sequences that share a prefix (a system prompt), the prefix read once.

    FlashInfer's cascade attention: every sequence's keys are the shared prefix (positions 0 .. P - 1), then
    its own suffix. The prefix is attended by all the group's new queries at once, stacked as the rows of
    query blocks per kv head (a prefill's shape: its keys are read once per block of rows, not once per
    sequence), its keys split across programs as decoding splits a cache; each suffix by split-KV decoding;
    one merge folds both sets of splits with notebook 02's merge (:class:`CascadePlan`: three launches) and
    the sinks, if any, as one more partial::

        out = e^(lse_p - lse) out_prefix + e^(lse_s - lse) out_suffix,  lse = log(e^lse_p + e^lse_s)

    Args:
        q: (batch, q_heads, new_tokens, head_dim), as :func:`decode_attention` takes it.
        prefix_k, prefix_v: (kv_heads, prefix_len, head_dim), the shared prefix's keys and values;
            every new token sees all of it (it precedes them).
        k_cache, v_cache, cache_seqlens, block_table, num_splits: each sequence's own suffix as
            :func:`decode_attention` takes a cache; suffix position j is sequence position prefix_len + j;
            cache_seqlens >= new_tokens (the new tokens follow the prefix).
        prefix_splits: splits of the prefix's keys, each read by its own programs (None chooses, as num_splits).
        scale, softcap, sinks, return_lse: as :func:`decode_attention`. A score function of the
            positions is not taken (the prefix's rows would each need their sequence's offset).
        reference: compute in PyTorch (:func:`flashlib.tiled_forward` over the prefix,
            :func:`decode_reference` over the suffixes), any dtype and device.

    Equal to decoding over the concatenated cache (prefix, then suffix) up to rounding; reads the prefix
    ceil(batch * q_heads / kv_heads * new_tokens / BLOCK_Q) times instead of batch times (:func:`cascade_bytes`).
    """
    fn = "cascade_attention"
    if not reference:
        plan = CascadePlan._of(fn, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, scale=scale,
                               softcap=softcap, block_table=block_table, num_splits=num_splits,
                               prefix_splits=prefix_splits, sinks=sinks)
        return plan.run(q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table, return_lse=return_lse)
    _check_cascade(fn, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table, prefix_splits)
    from .tiled import tiled_forward

    batch, q_heads, n, _ = q.shape
    stacked = _stack_queries(q, k_cache.shape[1])  # the prefix's pass in one tile: a matmul and a softmax
    out_p, lse_p = tiled_forward(stacked, prefix_k[None], prefix_v[None], block_q=max(stacked.shape[2], 1),
                                 block_k=max(prefix_k.shape[1], 1), scale=scale, softcap=softcap)
    out_s, lse_s = decode_reference(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                    num_splits=num_splits or 1, return_lse=True, scale=scale, softcap=softcap)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_p, lse_p = _unstack(out_p, batch, q_heads, n).to(work), _unstack(lse_p[..., None], batch, q_heads, n)[..., 0]
    out, lse = merge_partials(out_p, lse_p.to(work), out_s.to(work), lse_s.to(work))
    out, lse = merge_sink(out, lse, checked_options(fn, q_heads, q.device, scale=1.0, sinks=sinks).sinks)
    return (out.to(q.dtype), lse.float() if work != torch.float64 else lse) if return_lse else out.to(q.dtype)


class CascadePlan(_Plan):
    """:func:`cascade_attention` on the kernels for one layout, planned once (as :class:`DecodePlan`);
    :meth:`run` launches three kernels and nothing else:

        the prefix's pass   stage 1 of split-KV decoding over the prefix's keys, its query rows every
                            sequence's queries of a kv head (read in place), its keys cut into
                            ``prefix_splits`` splits so that the launch fills the GPU
        the suffixes' pass  stage 1 over each sequence's own cache
        the merge           each sequence's splits and the prefix's, and the sinks, folded into one output

    :meth:`run` takes tensors of the plan's layout, any values; what is fixed when the plan is made and what
    is read at every run (the sinks' values, whatever their dtype and strides, among them), ``out``/``plan.out``
    and runs taking turns: as :class:`DecodePlan`'s.
    """

    NAMES = ("q", "prefix_k", "prefix_v", "k_cache", "v_cache", "cache_seqlens", "block_table")

    def __init__(self, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, *, scale=None, softcap=None,
                 block_table=None, num_splits=None, prefix_splits=None, sinks=None):
        self._build("CascadePlan", q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, scale=scale, softcap=softcap,
                    block_table=block_table, num_splits=num_splits, prefix_splits=prefix_splits, sinks=sinks)

    def _build(self, fn, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, *, scale, softcap, block_table,
               num_splits, prefix_splits, sinks):
        _check_cascade(fn, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table, prefix_splits)
        prefix = dict(prefix_k=prefix_k, prefix_v=prefix_v)
        _check_kernel_call(fn, q=q, **prefix, k_cache=k_cache, v_cache=v_cache, sinks=sinks)
        options = decode_options(fn, q, scale=scale, softcap=softcap, sinks=sinks)
        _, args = _planned(fn, q, k_cache, v_cache, cache_seqlens, block_table, num_splits, prefix, options)
        from .kernels.decode import DecodeLaunch
        from .kernels.function import kernel_score

        score = kernel_score(args.options, q.device)  # soft-capping, or nothing
        # every new token sees the whole prefix: no causal rule there; the sinks join once, in the merge
        self._prefix = DecodeLaunch(q, prefix_k[None], prefix_v[None], options=args.options.with_rule(
            causal=False)._replace(sinks=None), score=score, num_splits=prefix_splits, stacked=True)
        self._suffix = DecodeLaunch(q, k_cache, v_cache, options=args.options, score=score, block_table=block_table,
                                    num_splits=num_splits, prefix=self._prefix)
        self._prefix_len = torch.full((1,), prefix_k.shape[1], dtype=torch.int32, device=q.device)
        self.out, self.lse = self._suffix.out, self._suffix.lse
        self._made(tuple(map(_layout, (q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table))),
                   (self._prefix, self._suffix))

    @property
    def launch_shapes(self) -> dict:
        """{"prefix": , "suffix": } each launch's tiles, splits and grids (None for an empty batch)."""
        return {"prefix": getattr(self._prefix, "shape", None), "suffix": getattr(self._suffix, "shape", None)}

    def run(self, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table=None, *, out=None,
            return_lse: bool = False):
        """Launch the three kernels on this step's tensors (the plan's layout, any values); see the class."""
        self._check_run((q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table), out)

        def launch():
            self._prefix(q, prefix_k, prefix_v, self._prefix_len)
            return self._suffix(q, k_cache, v_cache, cache_seqlens, block_table, out)

        out, lse = self._run(launch)
        return (out, lse) if return_lse else out

    def bound(self, q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, block_table=None) -> list:
        """What :meth:`run` launches on these tensors, [(kernel, grid, args, kwargs)] (as :meth:`DecodePlan.bound`)."""
        return (self._prefix.bound(q, prefix_k, prefix_v, self._prefix_len)
                + self._suffix.bound(q, k_cache, v_cache, cache_seqlens, block_table))


def cascade_bytes(*, batch: int, kv_heads: int, rows_per_kv_head: int, prefix: int, suffix: int, head_dim: int,
                  element_size: int = 2, block_q: int = 64) -> dict:
    """Bytes of keys and values one decoding step reads (notebook 10's model: each cached vector once per program
    that needs it), plain and cascaded, for ``batch`` sequences that share ``prefix`` positions and hold ``suffix``
    of their own; rows_per_kv_head: the query rows that read one kv head per sequence (q_heads / kv_heads x n)."""
    per_position = 2 * kv_heads * head_dim * element_size  # a key and a value, every kv head
    plain = batch * (prefix + suffix) * per_position
    prefix_reads = -(-batch * rows_per_kv_head // block_q)  # query blocks of the stacked rows
    cascade = (prefix_reads * prefix + batch * suffix) * per_position
    return dict(plain=plain, cascade=cascade, prefix_reads=prefix_reads, ratio=plain / cascade)
