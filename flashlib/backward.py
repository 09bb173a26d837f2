"""The tiled backward pass: gradients from the log-sum-exp, one tile at a time.

Standard backward keeps P (seq_q x seq_k) from the forward pass. Here only
out and lse (..., seq_q) are kept, and each probability tile is recomputed:

    P_ij  = exp(S_ij - lse_i)                       S = q kᵀ · scale
    dV_j += P_ijᵀ dO_i
    dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ∘ (dP_ij - delta_i)                delta = rowsum(dO ∘ O)
    dQ_i += dS_ij K_j · scale,   dK_j += dS_ijᵀ Q_i · scale

delta_i equals sum_j P_ij dP_ij, the term softmax's Jacobian needs, computed from
(seq_q, D) tensors instead of a (seq_q, seq_k) one.
"""
from __future__ import annotations

import torch

from .dense import expand_kv
from .machinery.autograd import save, saved
from .machinery.captures import captured_tensors
from .machinery.checks import check_block, check_loop
from .machinery.options import Options, check_options
from .rules import sink_grad, softmax_delta
from .scores import trainable
from .tiled import NEG_INF, _compute_dtype, _query_range, _skipped, _tile_visible, canonical, forward_pass


def tiled_backward(q, k, v, out, lse, dout, *, block_q=64, block_k=64, causal=False, scale=None,
                   dlse=None, window=None, softcap=None, mask_mod=None, sinks=None, score_mod=None, captured=(),
                   attention_chunk=None):
    """Gradients (dq, dk, dv) of tiled attention, recomputing P tile by tile from ``lse``; with
    ``sinks``, (dq, dk, dv, dsinks); with ``captured`` (tensors the score function reads), their
    gradients after those.

    Args:
        q, k, v: the forward inputs, (batch, heads, seq, head_dim); k and v may have fewer heads
            (grouped-query attention), and dk, dv sum over the query heads of each group.
        out: the forward output; lse: its log-sum-exp (..., seq_q).
        dout: gradient of the loss with respect to out.
        dlse: optional gradient with respect to lse; since d lse_i / d S_ij = P_ij, it
            enters as delta - dlse.
        window, attention_chunk, softcap, mask_mod, score_mod: as the forward (:func:`tiled_attention`); with a score
            function (soft-capping is one) dS picks up its slope at each score, by autograd on the
            function of each tile (the chain rule through the tile), which also gives each tensor of
            ``captured`` its share.
        sinks: the forward's attention sinks (heads,). The lse already holds them, so P and dq,
            dk, dv need nothing more; a sink's own gradient is -sum over its head's rows of
            exp(sink - lse) * delta (:func:`flashlib.rules.sink_grad`).

    Loop order is FlashAttention-2's dK/dV kernel: outer over key/value tiles, whose
    dK_j and dV_j accumulate locally; dQ accumulates across the outer loop.
    """
    fn = "tiled_backward"
    options = check_options(fn, q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            mask_mod=mask_mod, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk,
                            value_dim=True)
    blocks = check_block(fn, "block_q", block_q), check_block(fn, "block_k", block_k)
    return backward_pass(q, k, v, out, lse, dout, options, blocks, dlse, captured)


def backward_pass(q, k, v, out, lse, dout, options: Options, blocks, dlse=None, captured=()):
    """:func:`tiled_backward` on checked options; blocks: (block_q, block_k)."""
    block_q, block_k = blocks
    rule, scoring, sinks, scale = options.visibility, options.scoring, options.sinks, options.scale
    work = _compute_dtype(q.dtype)
    q_shape, kv_shape, v_shape = q.shape, k.shape, v.shape
    q, out, dout = (canonical(t).to(work) for t in (q, out, dout))
    k, v = (expand_kv(canonical(t), q.shape[1]).to(work) for t in (k, v))  # query head h reads kv head h // group
    lse = lse.reshape(q.shape[:-1]).to(work)
    delta = softmax_delta(out, dout, dlse, work)  # (B, H, Nq): rowsum(dO ∘ O) - dlse
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    # Rows that saw no key have lse = -inf; shifting by +inf makes their P exactly 0.
    lse = torch.where(lse == NEG_INF, float("inf"), lse)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dcaptured = [torch.zeros_like(t, dtype=work) for t in captured]
    for k0 in range(0, seq_k, block_k):
        k1 = min(k0 + block_k, seq_k)
        k_tile, v_tile = k[..., k0:k1, :], v[..., k0:k1, :]
        dk_j, dv_j = torch.zeros_like(k_tile), torch.zeros_like(v_tile)
        q_start, q_end = _query_range(k0, k1, seq_q, seq_k, rule, block_q)
        for q0 in range(q_start, q_end, block_q):
            q1 = min(q0 + block_q, seq_q)
            visible = _tile_visible(rule, q0, q1, k0, k1, seq_q, seq_k, q)
            if _skipped(visible):
                continue
            q_blk, do_blk = q[..., q0:q1, :], dout[..., q0:q1, :]
            s = (q_blk @ k_tile.transpose(-2, -1)) * scale  # (B, H, BLOCK_Q, BLOCK_K), recomputed
            p = torch.exp(scoring.modded(s, q0, k0) - lse[..., q0:q1, None])
            if visible is not None:
                p = p.masked_fill(~visible, 0.0)
            dv_j += p.transpose(-2, -1) @ do_blk
            dp = do_blk @ v_tile.transpose(-2, -1)
            ds = p * (dp - delta[..., q0:q1, None])
            ds, shares = scoring.slope(ds, s, q0, k0, captured)  # the chain rule through the score function
            _add(dcaptured, shares)
            dq[..., q0:q1, :] += (ds @ k_tile) * scale
            dk_j += (ds.transpose(-2, -1) @ q_blk) * scale
        dk[..., k0:k1, :], dv[..., k0:k1, :] = dk_j, dv_j
    grads = dq.reshape(q_shape), _group_sum(dk, kv_shape), _group_sum(dv, v_shape)
    grads = (*grads, *options.tensor_grads(dict(sinks=dsinks)))
    return (*grads, *(g.to(t.dtype) for g, t in zip(dcaptured, captured))) if captured else grads


def _add(totals, shares):
    """Each captured tensor's share of one tile added to its total (None: the tile did not use it)."""
    for total, share in zip(totals, shares):
        if share is not None:
            total += share


def _group_sum(grad, kv_shape):
    """(B, H, N, d) gradients of the expanded keys or values -> kv_shape: each kv head gets the sum
    over the query heads of its group (grouped-query attention)."""
    batch, heads = grad.shape[:2]
    kv_heads = kv_shape[-3] if len(kv_shape) >= 3 else 1
    if kv_heads == heads:
        return grad.reshape(kv_shape)  # no group: a view, no second copy alive at the peak
    return grad.unflatten(1, (kv_heads, heads // kv_heads)).sum(dim=2).reshape(kv_shape)


class TiledAttentionFunction(torch.autograd.Function):
    """Autograd around the tiled pair: saves (q, k, v, out, lse), never P. options: the call's, checked
    (flashlib.machinery.options); tiles: (block_q, block_k, loop); tensors: the options' tensors, then those the
    score function reads that require grad (inputs, so that autograd returns their gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, options: Options, tiles, *tensors):
        held = len(options.tensors)
        options = options.with_tensors(tensors[:held])
        out, lse = forward_pass(q, k, v, options, tiles)
        save(ctx, q, k, v, out, lse, *tensors)
        ctx.options, ctx.blocks, ctx.held = options, tiles[:2], held
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = saved(ctx)
        options = ctx.options.with_tensors(tensors[:ctx.held])
        dq, dk, dv, *rest = backward_pass(q, k, v, out, lse, dout, options, ctx.blocks, dlse, tensors[ctx.held:])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, *rest


def tiled_attention(q, k, v, *, block_q: int = 64, block_k: int = 64, causal: bool = False,
                    scale: float | None = None, loop: str = "query", window=None, softcap: float | None = None,
                    mask_mod=None, sinks=None, score_mod=None, return_lse: bool = False, attention_chunk=None):
    """Exact attention computed tile by tile with online softmax; differentiable.

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k, v: (batch, kv_heads, seq_k, head_dim); seq_k may differ from seq_q; kv_heads divides
            heads (grouped-query attention: query head h reads kv head h // (heads // kv_heads),
            and dk, dv sum over each group); v may have a head dim of its own (MLA's), which the
            output has.
        block_q: query rows per block (BLOCK_Q); need not divide seq_q.
        block_k: key/value rows per tile (BLOCK_K); need not divide seq_k.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal,
            see :func:`flashlib.causal_mask`); a row that sees no key outputs zeros and gets
            zero gradients. Tiles entirely above the diagonal are skipped, not computed.
        scale: defaults to 1/sqrt(head_dim).
        loop: "query" (FlashAttention-2 order) or "key" (the paper's Algorithm 1).
        window: (left, right): query i sees keys i + o - left .. i + o + right (o = seq_k -
            seq_q; -1: no limit on a side). Each query block visits only the key tiles its
            rows' windows reach, so the cost is O(seq_q * window), not O(seq_q * seq_k).
        attention_chunk: C > 0: chunked local attention (Llama 4's chunked layers): query i, at
            p = i + seq_k - seq_q, sees key j only when j // C == p // C; each query block visits
            only the key tiles of its rows' chunks. 0 or None: no chunks.
        softcap: c > 0: scores become c * tanh(scale * q kᵀ / c), with their gradient.
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool tensor (see :mod:`flashlib.masks`), ANDed
            with causal and window; tiles where it is false everywhere are skipped.
        sinks: attention sinks (heads,), learnable: one score sinks[h] with no value in every row's
            softmax of head h. Each query block starts from it (m_i = sink, l_i = 1), so it enters
            the denominator only; the lse includes it.
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`), applied
            to each tile's scaled scores before the mask, q_idx and kv_idx the pairs' positions; the
            tensors it captures that require grad get their gradient. Not with softcap.
        return_lse: also return the log-sum-exp (..., seq_q), float32 (float64 for float64
            inputs); -inf for rows that see no key.

    The backward pass recomputes probabilities tile by tile from
    the saved lse and never stores the (seq_q, seq_k) matrix.
    """
    fn = "tiled_attention"
    options = check_options(fn, q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            mask_mod=mask_mod, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk,
                            value_dim=True)
    tiles = check_block(fn, "block_q", block_q), check_block(fn, "block_k", block_k), check_loop(fn, loop)
    captured = []
    if score_mod is not None and torch.is_grad_enabled():  # what the function reads, found by tracing it
        captured = trainable(captured_tensors(fn, score_mod, compiles=False))
    out, lse = TiledAttentionFunction.apply(q, k, v, options, tiles, *options.tensors, *captured)
    return (out, lse) if return_lse else out
