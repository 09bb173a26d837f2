"""Packed sequences of different lengths (flash-attn's varlen layout) in the teaching kernels.

The kernels are the dense ones' blocks (:func:`_attn_fwd_block`, :func:`_attn_bwd_dkdv_block`,
:func:`_attn_bwd_dq_block`) behind a prologue that reads where the program's sequence starts
and how long it is::

    q (total_q, heads, d), k (total_k, kv_heads, d)      packed, as flashlib.varlen describes
    v (total_k, kv_heads, dv), out (total_q, heads, dv)  v's head dim may differ (MLA's 192/128)
    lse, delta (heads, total_q) float32                  flash-attn's layout of the lse
    grid (ceil(max_seqlen / BLOCK), batch * heads)       a program whose block starts past its
                                                         sequence's end does nothing: no FLOPs
                                                         on padding

Grouped-query attention, score functions (soft-capping among them), sinks, windows and chunks work as in the
dense kernels, through the same two bundles (a window or chunk's block mask is one row, every tile of its key
range partial); a score function is told positions within each sequence, never within the packed buffer.
"""
from __future__ import annotations

import torch

from ..machinery.autograd import save, saved
from ..rules import PARTIAL, sink_grad, softmax_delta
from ..varlen import check_varlen_inputs, sequence_score, sequences
from .backward import _attn_bwd_dkdv_block, _attn_bwd_dq_block
from .config import LOG2E, head_dim_pad, lse_natural, value_dim
from .forward import _attn_fwd_block, triton
from .rules import _batch_head, mask_bundle, row_runs, score_bundle
from ..machinery.options import Options, checked_options
from .function import (DEFAULT, _strides, check_kernel_inputs, kernel_score, preprocess, resolve_config, save_lse,
                       score_grads)

import triton.language as tl  # noqa: E402  (after the kernels: they chose the interpreter mode)

VARLEN_FN = "flash_attention_varlen"


@triton.jit
def _sequence(CuSeqlens, off_b):
    """(first token, length) of sequence off_b, from cumulative lengths."""
    start = tl.load(CuSeqlens + off_b)
    return start.to(tl.int64), tl.load(CuSeqlens + off_b + 1) - start


@triton.jit
def _at(Ptr, stride, token, head):
    """Ptr's element of this token and head; stride: the tensor's (token, head) strides."""
    return Ptr + token * stride[0] + head * stride[1]


@triton.jit
def _attn_fwd_varlen(Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, qk_scale, scale, stride_q, stride_k, stride_v,
                     stride_o, TOTAL_Q, HEADS, GROUP, HEAD_DIM, HEAD_DIM_V,
                     HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, mask=None,
                     score=None, B0=0):
    """One query block of one sequence and head: the grid is (ceil(max_seqlen_q / BLOCK_Q), batch * HEADS);
    each tensor's strides one tuple, (token, head). mask, score: the launch's bundles (kernels/rules.py) or
    None, the block mask one row; sinks (HEADS,). B0: the launch's first sequence in the batch (a score
    function is told b = B0 + the sequence's index in this launch)."""
    q0 = tl.program_id(0) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)  # int64: heads x total tokens (the lse offset) can pass 2^31
    off_b, off_h = _batch_head(off_z, HEADS, 0)
    q_start, seq_q = _sequence(CuSeqlensQ, off_b)
    if q0 < seq_q:  # a block past its sequence's end computes nothing
        k_start, seq_k = _sequence(CuSeqlensK, off_b)
        off_kv = off_h // GROUP  # grouped-query attention: query head h reads kv head h // GROUP
        _attn_fwd_block(_at(Q, stride_q, q_start, off_h), _at(K, stride_k, k_start, off_kv),
                        _at(V, stride_v, k_start, off_kv), _at(Out, stride_o, q_start, off_h),
                        Lse + off_h * TOTAL_Q + q_start, qk_scale, scale, stride_q[0], stride_k[0], stride_v[0],
                        stride_o[0], q0, SEQ_Q=seq_q, SEQ_K=seq_k, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                        off_b=off_b + B0, off_h=off_h, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
                        BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, mask=mask,
                        score=score)


@triton.jit
def _attn_bwd_dkdv_varlen(Q, K, V, DO, DK, DV, Lse, Delta, CuSeqlensQ, CuSeqlensK, qk_scale, scale,
                          stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv,
                          TOTAL_Q, KV_HEADS, HEAD_DIM, HEAD_DIM_V,
                          HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, CAUSAL: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, mask=None, score=None, B0=0):
    """One key tile of one sequence and kv head: the grid is (ceil(max_seqlen_k / BLOCK_K), batch * KV_HEADS);
    BLOCK_H: the query heads of a kv head; each tensor's strides one tuple, (token, head)."""
    k0 = tl.program_id(0) * BLOCK_K
    off_z = tl.program_id(1).to(tl.int64)  # int64: heads x total tokens (the lse offset) can pass 2^31
    off_b, off_kv = _batch_head(off_z, KV_HEADS, 0)
    k_start, seq_k = _sequence(CuSeqlensK, off_b)
    if k0 < seq_k:  # a tile past its sequence's end computes nothing
        q_start, seq_q = _sequence(CuSeqlensQ, off_b)
        off_h = off_kv * BLOCK_H  # the first query head of its group
        _attn_bwd_dkdv_block(_at(Q, stride_q, q_start, off_h), _at(K, stride_k, k_start, off_kv),
                             _at(V, stride_v, k_start, off_kv), _at(DO, stride_do, q_start, off_h),
                             _at(DK, stride_dk, k_start, off_kv), _at(DV, stride_dv, k_start, off_kv),
                             Lse + off_h * TOTAL_Q + q_start, Delta + off_h * TOTAL_Q + q_start, qk_scale, scale,
                             (stride_q[1], stride_q[0]), (stride_do[1], stride_do[0]), stride_lh=TOTAL_Q,
                             stride_kv=(stride_k[0], stride_v[0]), stride_dkv=(stride_dk[0], stride_dv[0]), k0=k0,
                             SEQ_Q=seq_q, SEQ_K=seq_k,
                             HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, off_b=off_b + B0, off_h=off_h,
                             HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
                             BLOCK_H=BLOCK_H, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, mask=mask, score=score)


@triton.jit
def _attn_bwd_dq_varlen(Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, qk_scale, scale,
                        stride_q, stride_k, stride_v, stride_do, stride_dq, TOTAL_Q, HEADS, GROUP, HEAD_DIM, HEAD_DIM_V,
                        HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                        BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, mask=None,
                        score=None, B0=0):
    """One query block of one sequence and head: the grid is (ceil(max_seqlen_q / BLOCK_Q), batch * HEADS);
    each tensor's strides one tuple, (token, head)."""
    q0 = tl.program_id(0) * BLOCK_Q
    off_z = tl.program_id(1).to(tl.int64)  # int64: heads x total tokens (the lse offset) can pass 2^31
    off_b, off_h = _batch_head(off_z, HEADS, 0)
    q_start, seq_q = _sequence(CuSeqlensQ, off_b)
    if q0 < seq_q:
        k_start, seq_k = _sequence(CuSeqlensK, off_b)
        off_kv = off_h // GROUP
        _attn_bwd_dq_block(_at(Q, stride_q, q_start, off_h), _at(K, stride_k, k_start, off_kv),
                           _at(V, stride_v, k_start, off_kv), _at(DO, stride_do, q_start, off_h),
                           _at(DQ, stride_dq, q_start, off_h), Lse + off_h * TOTAL_Q + q_start,
                           Delta + off_h * TOTAL_Q + q_start, qk_scale, scale, stride_q[0], stride_k[0],
                           stride_vn=stride_v[0], stride_dom=stride_do[0], stride_dqm=stride_dq[0], q0=q0,
                           SEQ_Q=seq_q, SEQ_K=seq_k, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, off_b=off_b + B0,
                           off_h=off_h, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_Q=BLOCK_Q,
                           BLOCK_K=BLOCK_K, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, mask=mask, score=score)


# ----- launchers ------------------------------------------------------------------------------

def _mask(options: Options, tiles: int, device):
    """The mask side of a launch over ``tiles`` tiles: a window or chunk's block mask is one row, every tile
    partial (its key range skips the rest); None without a window or chunk."""
    row = torch.full((max(tiles, 1),), PARTIAL, dtype=torch.uint8, device=device) if options.masked else None
    return mask_bundle(options, row)


def _positions(cu_q, cu_k, heads: int):
    """regions() of the positions each packed sequence's pairs take (b, h, q_idx, kv_idx), one per sequence:
    what a score function is told, for the check of the indices it reads (asked only where the longest
    lengths fail it; one transfer of the lengths from the device)."""
    def regions():
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        return [{"b": (b, b), "h": (0, heads - 1), "q_idx": (0, starts_q[b + 1] - starts_q[b] - 1),
                 "kv_idx": (0, starts_k[b + 1] - starts_k[b] - 1)} for b in range(len(starts_q) - 1)]
    return regions


def _launch(kernel, blocks, heads, cu_q, cu_k, before, after, **switches):
    """kernel on grid (blocks, sequences x heads) with the lengths between its arguments before and after: grid
    axis 1 holds batch x heads rows and CUDA takes at most 65,535 (rules.row_runs), so a larger batch is
    launched in runs of whole sequences. The kernels read absolute token offsets, so a run is just its slice
    of the lengths; a score function is told the run's first sequence, B0."""
    for rows in row_runs((cu_q.shape[0] - 1) * heads, heads):
        b0, b1 = rows.start // heads, rows.stop // heads
        if switches.get("score") is not None:
            switches.update(B0=b0)
        kernel[(blocks, (b1 - b0) * heads)](*before, cu_q[b0:b1 + 1], cu_k[b0:b1 + 1], *after, **switches)


def _launch_forward(q, k, v, cu_q, cu_k, max_q, max_k, cfg, options: Options):
    total_q, heads, d = q.shape
    dv = v.shape[-1]
    scale, sinks = options.scale, options.sinks
    out = q.new_empty(total_q, heads, dv)  # (total_q, heads, dv)
    lse = torch.empty(heads, total_q, dtype=torch.float64, device=q.device)  # float64: forward._finish says why
    compiled = kernel_score(options, q.device, batch=cu_q.shape[0] - 1, heads=heads, seq_q=max_q, seq_k=max_k,
                            fn=VARLEN_FN, regions=_positions(cu_q, cu_k, heads))
    score = score_bundle(compiled, None if sinks is None else sinks.detach().to(torch.float32).contiguous())
    _launch(_attn_fwd_varlen, triton.cdiv(max_q, cfg.block_q), heads, cu_q, cu_k, (q, k, v, out, lse),
            (scale * LOG2E, scale, *_strides(q, k, v, out), total_q, heads, heads // k.shape[1], d),
            HEAD_DIM_PAD=head_dim_pad(d), **value_dim(d, dv), BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k,
            CAUSAL=options.visibility.causal, INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, mask=_mask(options, triton.cdiv(max_k, cfg.block_k), q.device), score=score)
    return out, lse


def _launch_backward(q, k, v, out, lse, dout, dlse, cu_q, cu_k, max_q, max_k, cfg, options: Options):
    total_q, heads, d = q.shape
    scale, sinks = options.scale, options.sinks
    kv_heads, group = k.shape[1], heads // k.shape[1]
    # delta = rowsum(dO * O) in lse's (heads, total_q) layout: the dense preprocess on (heads, tokens, d) views
    delta = preprocess(out.transpose(0, 1), dout.transpose(0, 1), dlse, cfg)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    score = score_bundle(kernel_score(options, q.device, batch=cu_q.shape[0] - 1, heads=heads, seq_q=max_q,
                                      seq_k=max_k, fn=VARLEN_FN, regions=_positions(cu_q, cu_k, heads)))
    common = dict(HEAD_DIM_PAD=head_dim_pad(d), **value_dim(d, v.shape[-1]), BLOCK_Q=cfg.bwd_block_q,
                  BLOCK_K=cfg.bwd_block_k, CAUSAL=options.visibility.causal, INPUT_PRECISION=cfg.input_precision,
                  num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages, score=score)
    _launch(_attn_bwd_dkdv_varlen, triton.cdiv(max_k, cfg.bwd_block_k), kv_heads, cu_q, cu_k,
            (q, k, v, dout, dk, dv, lse, delta), (scale * LOG2E, scale, *_strides(q, k, v, dout, dk, dv), total_q,
                                                  kv_heads, d), BLOCK_H=group,
            mask=_mask(options, triton.cdiv(max_q, cfg.bwd_block_q), q.device), **common)
    _launch(_attn_bwd_dq_varlen, triton.cdiv(max_q, cfg.bwd_block_q), heads, cu_q, cu_k,
            (q, k, v, dout, dq, lse, delta), (scale * LOG2E, scale, *_strides(q, k, v, dout, dq), total_q, heads,
                                              group, d), mask=_mask(options, triton.cdiv(max_k, cfg.bwd_block_k),
                                                                    q.device), **common)
    # the lse (heads, total_q) holds the sinks: the kernels are unchanged; the sinks' gradient from delta
    dsinks = None if sinks is None else sink_grad(sinks, lse_natural(lse), delta)
    return dq, dk, dv, dsinks


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def varlen_forward_base2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: Options = DEFAULT,
                         config=None):
    """(out (total_q, heads, dv), lse2 (heads, total_q) float64, the lse in base 2) on inputs and
    options already checked (:func:`check_inputs`)."""
    sinks = options.sinks
    cfg = resolve_config(VARLEN_FN, q, config, v)
    rows = (q.shape[1], q.shape[0])
    out_shape = (*q.shape[:-1], v.shape[-1])  # (total_q, heads, dv)
    if q.numel() == 0 or max_seqlen_q == 0:  # no rows, or no heads
        return q.new_zeros(out_shape), torch.full(rows, float("-inf"), dtype=torch.float64, device=q.device)
    if max_seqlen_k == 0 and sinks is not None:  # no keys anywhere: out = 0, the lse of every row its sink
        return q.new_zeros(out_shape), (sinks.detach().double() * LOG2E)[:, None].expand(rows).clone()
    # a last dim of stride 1, as the kernels read them: for the cumulative lengths, contiguous (t[::2] is copied)
    q, k, v, cu_seqlens_q, cu_seqlens_k = (_last_dim_contiguous(t) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    return _launch_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cfg, options)


def varlen_backward_base2(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          options: Options = DEFAULT, config=None, dlse=None):
    """(dq, dk, dv, dsinks) of :func:`varlen_forward_base2` from its base-2 lse, recomputing P tile by
    tile (dsinks None without sinks); dlse: an optional gradient with respect to the natural lse
    (heads, total_q)."""
    cfg = resolve_config(VARLEN_FN, q, config, v)
    sinks = options.sinks
    if q.numel() == 0 or k.numel() == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dsinks = None
        if sinks is not None:  # rows with no key still give the sink a share
            delta = softmax_delta(out.transpose(0, 1), dout.transpose(0, 1), dlse)
            dsinks = sink_grad(sinks, lse_natural(lse), delta)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsinks
    q, k, v, out, dout = (_last_dim_contiguous(t) for t in (q, k, v, out, dout))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    return _launch_backward(q, k, v, out, lse.contiguous(), dout, None if dlse is None else dlse.float(),
                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cfg, options)


def check_inputs(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, read_values: bool = True,
                 **options) -> Options:
    """Everything a packed call's arguments say, checked once: its Options (options: the call's keywords)."""
    scale = check_varlen_inputs(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=options.get("causal", False), scale=options.pop("scale", None),
                                read_values=read_values)
    check_kernel_inputs(fn, q, v)
    return checked_options(fn, q.shape[1], q.device, scale=scale, **options)


def varlen_score_grads(q, k, v, out, lse, dout, dlse, cu_q, cu_k, options: Options, captured):
    """The gradients of the tensors the score function captures, sequence by sequence in order
    (:func:`flashlib.kernels.function.score_grads` on each: positions within the sequence, b its index)."""
    grads = [torch.zeros_like(t) for t in captured]
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(sequences(cu_q), sequences(cu_k))):
        if q1 == q0 or k1 == k0:
            continue
        seq = [t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], dout[q0:q1])]
        parts = score_grads(*seq[:4], lse[None, :, q0:q1], seq[4], None if dlse is None else dlse[None, :, q0:q1],
                            options._replace(score_mod=sequence_score(options.score_mod, b)), captured)
        for total, part in zip(grads, parts):
            total += part
    return grads


class VarlenFunction(torch.autograd.Function):
    """The packed kernels with a score function (Python code, not a custom op's argument), eagerly:
    saves (q, k, v, out, lse, lse2, the lengths); tensors: the options' own (Options.tensors), then
    those the score function reads that require grad, inputs so that autograd returns their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, options: Options, *tensors):
        held = len(options.tensors)
        options = options.with_tensors(tensors[:held])
        out, lse2 = varlen_forward_base2(q, k, v, cu_q, cu_k, max_q, max_k, options)
        lse, column = save_lse(lse2)
        save(ctx, q, k, v, out, lse, column, cu_q, cu_k, *tensors)
        ctx.lengths, ctx.options, ctx.held = (max_q, max_k), options, held
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, column, cu_q, cu_k, *tensors = saved(ctx)
        options, captured = ctx.options.with_tensors(tensors[:ctx.held]), tensors[ctx.held:]
        dout = dout.contiguous()
        dq, dk, dv, dsinks = varlen_backward_base2(q, k, v, out, column.squeeze(-1), dout, cu_q, cu_k, *ctx.lengths,
                                                   options, dlse=dlse)
        dheld = options.tensor_grads(dict(sinks=dsinks))
        dcaptured = varlen_score_grads(q, k, v, out, lse, dout, dlse, cu_q, cu_k, options, captured) if captured else []
        return dq, dk, dv, None, None, None, None, None, *dheld, *dcaptured
