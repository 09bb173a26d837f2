"""Packed sequences of different lengths (flash-attn's varlen layout), in plain PyTorch.

A batch of sequences of lengths n_0, n_1, ... is packed without padding, one token after
another, and described by cumulative lengths::

    q             (total_q, q_heads, head_dim)     total_q = n_0 + n_1 + ...
    k, v          (total_k, kv_heads, head_dim)    kv_heads divides q_heads; v's head dim may be its own
    cu_seqlens_q  (batch + 1,) int32: 0, n_0, n_0 + n_1, ..., total_q   (likewise cu_seqlens_k);
                  any strides (a view such as t[::2] is read as it lies, copied where a kernel reads it)

Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and attend only to its
own keys; causal masks and windows align bottom-right within each sequence. A sequence may
be empty. :func:`varlen_reference` runs :func:`flashlib.tiled_attention` on each sequence;
:func:`flashlib.flash_attention_varlen` is the fused op (one launch, no FLOPs on padding).
"""
from __future__ import annotations

import torch

from .backward import tiled_attention
from .machinery.checks import (check_attention_inputs, check_chunk, check_cu_seqlens, check_max_seqlen,
                               check_score_mod, check_softcap, check_window)

FN = "varlen_reference"


def _check_packed(fn, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{fn}: argument '{name}' must have shape (total_tokens, heads, head_dim), the "
                             f"packed layout; got shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{fn}: arguments 'k' and 'v' must hold the same tokens; got k with {k.shape[0]} "
                         f"and v with {v.shape[0]}")


def check_varlen_inputs(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                        scale=None, window=None, softcap=None, read_values: bool = True) -> float:
    """The checks of a packed call, its lengths too with read_values (one transfer from the
    device each); returns the scale."""
    _check_packed(fn, q, k, v)
    # (tokens, heads, d) seen as (heads, tokens, d): the shared checks of heads, head dim, dtype, device
    scale = check_attention_inputs(fn, q[:0].transpose(0, 1), k[:0].transpose(0, 1), v[:0].transpose(0, 1),
                                   causal=causal, scale=scale, groups=True, value_dim=True)
    check_window(fn, window)
    check_softcap(fn, softcap)
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, read_values=False)
    check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, read_values=False)
    check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, 0)
    check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, 0)
    if read_values:
        check_varlen_values(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return scale


def check_varlen_values(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """The checks that read the cumulative lengths (both in one transfer from the device) and that
    they describe one batch, on tensors whose dtypes and devices are already checked; returns the
    longest sequences."""
    values = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()  # any strides: cat reads each as it lies
    n = cu_seqlens_q.shape[0]
    longest_q = check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, values=values[:n])
    longest_k = check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, values=values[n:])
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{fn}: arguments 'cu_seqlens_q' {tuple(cu_seqlens_q.shape)} and 'cu_seqlens_k' "
                         f"{tuple(cu_seqlens_k.shape)} must describe the same batch (batch + 1 entries each)")
    check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, longest_q)
    check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, longest_k)
    return longest_q, longest_k


def sequences(cu_seqlens) -> list[tuple[int, int]]:
    """[(start, stop)] of each packed sequence."""
    bounds = cu_seqlens.tolist()
    return list(zip(bounds, bounds[1:]))


def sequence_score(score_mod, b: int):
    """score_mod as sequence b of a packed batch sees it when computed alone: batch row b (its
    positions are already within the sequence). The references and the kernels' gradient pass ask it."""
    return lambda score, _, h, q_idx, kv_idx: score_mod(score, b, h, q_idx, kv_idx)


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, scale: float | None = None, window=None, softcap: float | None = None,
                     sinks=None, score_mod=None, return_lse: bool = False, attention_chunk=None):
    """:func:`flashlib.flash_attention_varlen` in plain PyTorch: tiled attention on each sequence
    in turn; differentiable. Returns out (total_q, q_heads, v's head_dim) and, with return_lse, the
    lse (q_heads, total_q) (float32, float64 for float64 inputs; -inf for rows that see no key)."""
    check_varlen_inputs(FN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                        scale=scale, window=window, softcap=softcap)
    check_score_mod(FN, score_mod, softcap, q.device)  # here, not per sequence: before anything runs
    check_chunk(FN, attention_chunk)
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(sequences(cu_seqlens_q), sequences(cu_seqlens_k)):
        # (tokens, heads, d) -> (heads, tokens, d): one sequence, every head
        # a score function is told the sequence's index b and positions within it, as the kernels tell it
        told = None if score_mod is None else sequence_score(score_mod, len(outs))
        out, lse = tiled_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
                                   causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                                   attention_chunk=attention_chunk,
                                   score_mod=told, return_lse=True)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.cat(outs) if outs else q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(q.shape[1], 0, dtype=work, device=q.device)
    return (out, lse) if return_lse else out
