"""Input checks shared by every attention entry point.

Each error names the function, the argument, the value seen and what was expected,
so that a wrong call fails loudly instead of returning something silently wrong.
"""
from __future__ import annotations

import inspect
import math
import numbers

import torch

from .captures import captured, describe

LOOP_ORDERS = ("query", "key")
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def batch_and_heads(shape) -> tuple[int, int]:
    """(batch, heads) of a (..., heads, seq, head_dim) shape: the last leading dim is the heads,
    the others together the batch; (1, 1) for (seq, head_dim)."""
    lead = tuple(shape[:-2])
    if not lead:
        return 1, 1
    return math.prod(lead[:-1]), lead[-1]


def check_attention_inputs(fn: str, q, k, v, *, causal, scale, groups: bool = False, value_dim: bool = False) -> float:
    """Validate (..., seq, head_dim) inputs; return the softmax scale to use.

    groups: k and v may have fewer heads (dim -3) than q, a divisor of q's (grouped-query
    attention); otherwise every leading dim must match. value_dim: v may have a head dim of its
    own (MLA's 192 for q and k, 128 for v), as the references and the teaching kernels allow."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(
                f"{fn}: argument '{name}' must have shape (batch, heads, seq, head_dim) or at least "
                f"(seq, head_dim); got rank {t.ndim} with shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{fn}: argument '{name}' must be a floating-point tensor "
                f"(float16, bfloat16, float32 or float64); got {t.dtype}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.ndim != q.ndim:
            raise ValueError(
                f"{fn}: argument '{name}' has rank {t.ndim} (shape {tuple(t.shape)}) but 'q' has rank "
                f"{q.ndim} (shape {tuple(q.shape)}); q, k and v must have the same rank"
            )
        if groups and t.ndim >= 3:
            _check_heads(fn, name, t, q)
        elif t.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"{fn}: argument '{name}' has leading (batch, heads) dims {tuple(t.shape[:-2])} but 'q' has "
                f"{tuple(q.shape[:-2])}; they must match exactly"
            )
        if name == "v" and value_dim:
            if t.shape[-1] < 1:
                raise ValueError(f"{fn}: argument 'v' must have head_dim >= 1; got shape {tuple(t.shape)}")
        elif t.shape[-1] != q.shape[-1]:
            rule = ("q and k must share head_dim" if name == "k" else
                    "v must share it here (flashlib.dense_attention, tiled_attention, flash_attention, "
                    "flash_attention_varlen, ring_attention and decode_attention take a head dim of v's own, as MLA "
                    "has)")
            raise ValueError(f"{fn}: argument '{name}' has head_dim {t.shape[-1]} but 'q' has head_dim "
                             f"{q.shape[-1]}; {rule}")
        if t.dtype != q.dtype:
            raise TypeError(
                f"{fn}: argument '{name}' has dtype {t.dtype} but 'q' has {q.dtype}; "
                "cast q, k and v to one dtype"
            )
        if t.device != q.device:
            raise ValueError(
                f"{fn}: argument '{name}' is on {t.device} but 'q' is on {q.device}; "
                "move q, k and v to one device"
            )
    if groups:
        check_same_heads(fn, k, v)
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{fn}: arguments 'k' and 'v' must have the same sequence length; "
            f"got k with {k.shape[-2]} and v with {v.shape[-2]}"
        )
    if q.shape[-1] < 1:
        raise ValueError(f"{fn}: argument 'q' must have head_dim >= 1; got shape {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: argument 'causal' must be True or False, got {causal!r}")
    return resolve_scale(fn, scale, q.shape[-1])


def _check_heads(fn: str, name: str, t, q) -> None:
    """(batch, heads): the batch dims equal q's and the heads divide q's."""
    if t.shape[:-3] != q.shape[:-3]:
        raise ValueError(f"{fn}: argument '{name}' has batch dims {tuple(t.shape[:-3])} but 'q' has "
                         f"{tuple(q.shape[:-3])}; they must match exactly")
    heads, q_heads = t.shape[-3], q.shape[-3]
    if q_heads == 0:
        return  # no query heads: an empty result, as with an empty batch
    if heads == 0:
        raise ValueError(f"{fn}: argument '{name}' has 0 heads but 'q' has {q_heads}; each query head needs a "
                         "key/value head to read (give k and v at least one head, or q none)")
    if q_heads % heads:
        raise ValueError(f"{fn}: argument '{name}' has {heads} heads but 'q' has {q_heads}; the query heads "
                         "must be a multiple of the key/value heads (grouped-query attention)")


def check_same_heads(fn: str, k, v) -> None:
    """k and v share their heads (grouped-query attention groups q's heads, never k's against v's)."""
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"{fn}: arguments 'k' and 'v' must have the same leading (batch, heads) dims; "
                         f"got k {tuple(k.shape[:-2])} and v {tuple(v.shape[:-2])}")


# a window side this wide limits nothing that fits in memory: wider ones are clamped to it, so that
# every side fits the ops' int64 arguments and PyTorch's int64 index arithmetic
WINDOW_MAX = 2**62


def check_chunk(fn: str, attention_chunk) -> int:
    """Chunked local attention's chunk size C (a query sees the keys of its own chunk of C positions), 0
    for none; None gives 0."""
    if attention_chunk is None:
        return 0
    if not isinstance(attention_chunk, numbers.Integral) or isinstance(attention_chunk, bool):
        raise TypeError(f"{fn}: argument 'attention_chunk' must be None or an int (keys per chunk), got "
                        f"{attention_chunk!r}")
    if attention_chunk < 0:
        raise ValueError(f"{fn}: argument 'attention_chunk' is {attention_chunk}; it must be >= 1 key per chunk, "
                         "or 0 for no chunks")
    return min(int(attention_chunk), WINDOW_MAX)


def check_window(fn: str, window) -> tuple[int, int]:
    """(left, right) of a sliding window, -1 for no limit on a side; None gives (-1, -1)."""
    if window is None:
        return -1, -1
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window))
    if not ok:
        raise TypeError(f"{fn}: argument 'window' must be None or a pair of ints (left, right), got {window!r}")
    left, right = (min(int(w), WINDOW_MAX) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"{fn}: argument 'window' is {(left, right)}; each side must be >= 0 keys, or -1 "
                         "for no limit on that side (flash-attn's convention)")
    return left, right


def check_softcap(fn: str, softcap) -> float:
    """The soft-cap c > 0, or 0.0 for none (softcap=None)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap):
        raise TypeError(f"{fn}: argument 'softcap' must be None or a finite number > 0, got {softcap!r}")
    if softcap <= 0:
        raise ValueError(f"{fn}: argument 'softcap' is {softcap}; it must be > 0 (scores become "
                         "softcap * tanh(score / softcap)), or None for no capping")
    if softcap < _FLOAT32_TINY:  # the kernels compute in float32, where such a cap is subnormal or 0
        raise ValueError(f"{fn}: argument 'softcap' is {softcap}, below float32's smallest normal number "
                         f"{_FLOAT32_TINY:.3g}; every score would be capped to 0: pass a larger cap")
    return float(softcap)


def check_sinks(fn: str, sinks, heads: int, device):
    """Attention sinks: None, or one logit per query head, (heads,) floating point on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{fn}: argument 'sinks' must be None or a torch.Tensor of one logit per query head, "
                        f"got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{fn}: argument 'sinks' has dtype {sinks.dtype}; expected a floating-point dtype "
                        "(a logit per query head)")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{fn}: argument 'sinks' has shape {tuple(sinks.shape)}; expected ({heads},), one logit "
                         "per query head")
    if sinks.device != device:
        raise ValueError(f"{fn}: argument 'sinks' is on {sinks.device} but 'q' is on {device}; move it to q's "
                         "device")
    return sinks


def check_mask_mod(fn: str, mask_mod, device=None, *, built_on: bool = False):
    """None, or a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor; with ``device`` (q's), one whose
    tensors are all on it; built_on: ``device`` is the one a mask is built on (None: the default)."""
    if mask_mod is None:
        return None
    if not callable(mask_mod):
        raise TypeError(f"{fn}: argument 'mask_mod' must be None or a function mask_mod(b, h, q_idx, kv_idx) "
                        f"-> bool, got {type(mask_mod).__name__}")
    _check_arity(fn, "mask_mod", mask_mod, ("b", "h", "q_idx", "kv_idx"), "mask")
    if device is not None or built_on:
        check_captured_devices(fn, "mask_mod", mask_mod, device, built_on=built_on)
    return mask_mod


def check_score_mod(fn: str, score_mod, softcap=None, device=None):
    """None, or a function score_mod(score, b, h, q_idx, kv_idx) -> score; not with softcap too
    (softcap is the score function flashlib.scores.softcap: compose the two in one); with ``device``
    (q's), one whose tensors are all on it."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        raise TypeError(f"{fn}: argument 'score_mod' must be None or a function score_mod(score, b, h, q_idx, "
                        f"kv_idx) -> score, got {type(score_mod).__name__}")
    if softcap is not None:
        raise ValueError(f"{fn}: arguments 'softcap' and 'score_mod' were both given; softcap is the score "
                         "function flashlib.scores.softcap(c): apply it inside yours, "
                         "lambda s, b, h, q, k: cap(mine(s, b, h, q, k), b, h, q, k)")
    _check_arity(fn, "score_mod", score_mod, ("score", "b", "h", "q_idx", "kv_idx"), "score")
    if device is not None:
        check_captured_devices(fn, "score_mod", score_mod, device)
    return score_mod


def _check_arity(fn: str, argument: str, function, names: tuple, kind: str) -> None:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: calling it will tell
        return
    if len([p for p in params if p.default is inspect.Parameter.empty]) != len(names):
        words = {4: "four", 5: "five"}[len(names)]
        raise TypeError(f"{fn}: argument '{argument}' must take {words} arguments ({', '.join(names)}), as "
                        f"flex_attention's {kind} functions do; {getattr(function, '__name__', function)} takes "
                        f"({', '.join(p.name for p in params)})")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)  # "cuda" is cuda:0's


def check_captured_devices(fn: str, argument: str, function, device, *, built_on: bool = False) -> None:
    """Every tensor a mask or score function reads besides its arguments (in its closure, defaults or
    globals, or those of the functions it calls: flashlib.machinery.captures) is on ``device``, q's; one on
    another device is refused by name before anything runs, not moved (which would copy it between
    devices at every call). built_on: ``device`` is the one a mask is built on (argument 'device'; None:
    the default device)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    for path, t in captured(function):
        if _same_device(t.device, device):
            continue
        name, where = describe(path)
        function_name = (getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
                         or type(function).__name__)
        seen, target = ((f"the mask is built on {device} (argument 'device')", "that device") if built_on else
                        (f"'q' is on {device}", "q's device"))
        raise ValueError(f"{fn}: argument '{argument}': {function_name} reads the tensor '{name}' ({where}), "
                         f"which is on {t.device}, but {seen}; build it on {target}, e.g. torch.tensor(..., "
                         f"device=q.device), or move it once with .to(q.device) before the calls (it is not "
                         "moved for you: that would copy it at every call)")


INT32_MAX = 2**31 - 1


def check_index_tensor(fn: str, name: str, t, device, *, what: str = "positions") -> None:
    """An index tensor a kernel reads (cumulative lengths, cache lengths, a block table): a
    torch.Tensor of dtype torch.int32 on ``device``; any strides (the launchers make it contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        fix = (f"convert with {name}.to(torch.int32)" if not (t.dtype == torch.bool or t.is_floating_point()
                                                              or t.is_complex())
               else f"it holds integer {what}: build it with dtype=torch.int32")
        raise TypeError(f"{fn}: argument '{name}' has dtype {t.dtype}; it must be torch.int32 ({fix})")
    if t.device != device:
        raise ValueError(f"{fn}: argument '{name}' is on {t.device} but 'q' is on {device}; move it to {device}")


def check_cu_seqlens(fn: str, name: str, cu_seqlens, total: int, device, *, read_values: bool = True,
                     values: list | None = None) -> int:
    """cu_seqlens: int32 (batch + 1,) on device, 0 first, ``total`` last, non-decreasing; returns
    the longest sequence (0 when read_values is False: under tracing no value can be read).
    values: its values already read (cu_seqlens.tolist()), to spare a transfer from the device."""
    check_index_tensor(fn, name, cu_seqlens, device, what="cumulative lengths")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{fn}: argument '{name}' must have shape (batch + 1,), got {tuple(cu_seqlens.shape)}")
    if not read_values:
        return 0
    values = cu_seqlens.tolist() if values is None else values
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{fn}: argument '{name}' runs from {values[0]} to {values[-1]}; it must start at 0 "
                         f"and end at the {total} tokens of the packed tensor (flash-attn's layout)")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{fn}: argument '{name}' decreases from {values[i]} to {values[i + 1]} (sequence {i}); "
                         "it holds cumulative lengths, so it must be non-decreasing")
    return max(lengths, default=0)


def check_max_seqlen(fn: str, name: str, value, longest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: argument '{name}' must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{fn}: argument '{name}' is {value}; it is the longest sequence's length, so it must be "
                         ">= 0")
    if value < longest:
        raise ValueError(f"{fn}: argument '{name}' is {value} but the longest sequence has {longest} tokens; "
                         "it sizes the grid, so it must be at least that")
    return int(value)


# CUDA's limit on a launch's second and third grid dimensions (the first may reach 2^31 - 1)
CUDA_GRID_YZ_MAX = 65535


def check_grid(fn: str, grid, device, names) -> None:
    """A launch grid a CUDA GPU accepts; names: what each dimension counts, as the caller's error says it."""
    if device.type != "cuda" or torch.version.hip:
        return
    for limit, n, name in zip((INT32_MAX, CUDA_GRID_YZ_MAX, CUDA_GRID_YZ_MAX), grid, names):
        if n > limit:
            raise ValueError(f"{fn}: {name} is {n}, more than the {limit} programs a CUDA launch allows along "
                             "that grid dimension; split the call into smaller batches")


def resolve_scale(fn: str, scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"{fn}: argument 'scale' must be a finite real number or None, got {scale!r}")
    return float(scale)


def check_block(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: argument '{name}' must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{fn}: argument '{name}' must be >= 1, got {value}")
    return int(value)


def check_loop(fn: str, loop) -> str:
    if loop not in LOOP_ORDERS:
        raise ValueError(f"{fn}: argument 'loop' must be one of {LOOP_ORDERS}, got {loop!r}")
    return loop
