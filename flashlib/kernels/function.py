"""The teaching kernels of notebooks 06 and 07 behind one autograd Function: ``attention``.

File order as in Triton's fused-attention tutorial: checks, launchers, the Function, the
entry point. Inputs of any leading shape (..., seq, head_dim) are flattened to
(B*H, seq, head_dim) views; each kernel gets its strides, so only a tensor whose last dim
is not contiguous is copied. ``flashlib.flash_attention`` (the public op) runs these kernels
on a CPU, through Triton's interpreter; the faster rungs of :mod:`flashlib.ladder` build on
the same launch conventions.
"""
from __future__ import annotations

import math

import torch

from ..dense import batch_and_heads, expand_kv, head_indices
from ..machinery.autograd import save, saved
from ..machinery.options import Options, check_options
from ..scores import captured_grads, trainable
from ..rules import PARTIAL, sink_grad, softmax_delta
from ..softmax import merge_sink
from ..tiled import block_mask
from ._mode import interpreting
from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, triton
from .config import LOG2E, FlashConfig, default_config, head_dim_pad, lse_base2, lse_natural, value_dim
from .forward import _attn_fwd
from .maskfn import compile_mask, symbol_bounds
from .scorefn import check_indices, compile_score, score_bounds, score_tensors
from .tracememo import TraceMemo, contents_guard
from .rules import mask_bundle, row_runs, score_bundle


FN = "flashlib.kernels.attention"
MAX_HEAD_DIM = 256


def flat(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (B*H, seq, d) with a contiguous last dim."""
    t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def capability(device: torch.device):
    """The CUDA compute capability of ``device``, None for the interpreter's CPU tensors."""
    return None if device.type != "cuda" else torch.cuda.get_device_capability(device)


def check_kernel_inputs(fn: str, q: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """What the kernels add to the shared checks: head dims (q's, and v's where given), dtype, and a
    device they can run on."""
    for name, t in (("q", q), ("v", v)):
        if t is not None and t.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(f"{fn}: argument '{name}' has head_dim {t.shape[-1]}; the fused kernels support "
                             f"head_dim 1..{MAX_HEAD_DIM} (use flashlib.tiled_attention for larger)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{fn}: argument 'q' has dtype {q.dtype}; the fused kernels support float16, "
                        "bfloat16 and float32 (use flashlib.tiled_attention for float64)")
    if interpreting():
        if q.dtype == torch.bfloat16:
            raise TypeError(f"{fn}: argument 'q' is bfloat16, which Triton's CPU interpreter cannot compute "
                            "(it has no bfloat16 arithmetic); use float16 or float32 here, bfloat16 on a GPU")
        if q.device.type != "cpu":
            raise ValueError(f"{fn}: Triton runs in its CPU interpreter here (TRITON_INTERPRET=1) but "
                             f"'q' is on {q.device}; pass CPU tensors")
        return
    if q.device.type != "cuda":
        raise ValueError(f"{fn}: argument 'q' is on {q.device} but Triton compiles for CUDA here; "
                         "move q, k, v to 'cuda' (or set TRITON_INTERPRET=1 before importing "
                         "flashlib.kernels to use the CPU interpreter)")
    cc = capability(q.device)
    if q.dtype == torch.bfloat16 and cc < (8, 0):
        raise TypeError(f"{fn}: argument 'q' is bfloat16 but {torch.cuda.get_device_name(q.device)} "
                        f"(sm_{cc[0]}{cc[1]}) has no bfloat16 tensor cores; "
                        "use float16 (or a GPU of compute capability >= 8.0)")


def resolve_config(fn: str, q: torch.Tensor, config, v: torch.Tensor | None = None) -> FlashConfig:
    """``config`` checked, or the shipped one for the head dims (q's, and v's where given), dtype and
    device (:func:`~flashlib.kernels.config.default_config`)."""
    if config is None:
        return default_config(q.shape[-1], q.dtype, capability(q.device),
                              head_dim_v=None if v is None else v.shape[-1])
    if not isinstance(config, FlashConfig):
        raise TypeError(f"{fn}: argument 'config' must be a flashlib.kernels.FlashConfig or None, "
                        f"got {type(config).__name__}")
    return config


def empty_result(q: torch.Tensor, head_dim_v: int | None = None):
    """Nothing to attend to: out = 0 (head_dim_v wide, q's head dim if None) and lse = -inf, as for a
    row that sees no key."""
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    dv = q.shape[-1] if head_dim_v is None else head_dim_v
    return q.new_zeros((*q.shape[:-1], dv)), lse


DEFAULT = Options()


def kernel_score(options: Options, device, *, batch=None, heads=None, seq_q=None, seq_k=None, fn: str = FN,
                 regions=None):
    """The options' score function compiled for the kernels (:mod:`flashlib.kernels.scorefn`), for
    indices within these sizes; None without one. Where the sizes are given, a function that reads a
    tensor it captures outside its bounds for them is refused, naming fn, the op called; regions: as
    :func:`~flashlib.kernels.scorefn.check_indices` takes them, where the sizes are wider than the call's
    positions (decoding's capacity, packed sequences' longest)."""
    function = options.score_function
    if function is None:
        return None
    score = compile_score(fn, function, device, score_bounds(batch, heads, seq_q, seq_k))
    if None not in (batch, heads, seq_q, seq_k):
        ranges = {"b": (0, batch - 1), "h": (0, heads - 1), "q_idx": (0, seq_q - 1), "kv_idx": (0, seq_k - 1)}
        check_indices(fn, options.score_mod or function, score, ranges, regions)
    return score


def _kinds(options: Options, batch, heads, seq_q, seq_k, block_q, block_k, device):
    """The block mask's kinds for these tiles (flashlib.masks.block_mask), (B or 1, H or 1, query
    blocks, key tiles); for a window or chunk alone, every tile partial: its key range skips the rest."""
    rule = options.visibility
    if rule.mask_mod is None:
        shape = (1, 1, triton.cdiv(seq_q, block_q), triton.cdiv(seq_k, block_k))
        return torch.full(shape, PARTIAL, dtype=torch.uint8, device=device)
    if options.block_mask is not None:  # built once, by the caller
        return options.block_mask.coarsen(block_q, block_k).to(device)

    def build():  # O(seq_q * seq_k) evaluations of the mask function: kept while it reads the same values
        return block_mask(seq_q, seq_k, block_q=block_q, block_k=block_k, causal=rule.causal, window=rule.window,
                          attention_chunk=rule.chunk, mask_mod=rule.mask_mod, batch=batch, heads=heads,
                          device=device).kinds, ()

    call = ("kinds", seq_q, seq_k, block_q, block_k, rule.causal, rule.window, rule.chunk, batch, heads,
            torch.device(device))
    return KINDS.get(rule.mask_mod, call, build)[0]


# a block mask is (B or 1, H or 1, query blocks, key tiles) bytes: 16k tokens in 64-tiles, 32 heads,
# 2 MiB; at most 16 MiB are kept, so what a call leaves alive stays small beside its inputs. It depends on
# every value the mask function reads: guarded by their digest (tracememo)
KINDS = TraceMemo(size=64, weigh=lambda kinds: kinds.numel() * kinds.element_size(), budget=16 << 20,
                  guard=contents_guard)


def rows_of_16(kinds: torch.Tensor) -> torch.Tensor:
    """kinds (..., rows, tiles) with rows 16 bytes apart: Triton's JIT specialises an integer
    argument on whether it is a multiple of 16, so a row stride that is one for every length
    binds every length to the same compiled kernel (as compiling ahead assumes)."""
    tiles = kinds.shape[-1]
    padded = kinds.new_zeros(*kinds.shape[:-1], -(-tiles // 16) * 16)
    padded[..., :tiles] = kinds
    return padded[..., :tiles]


def variant_args(options: Options, *, group: int = 1, heads: int = 1, kinds=None, data=None, sinks=None,
                 score=None) -> dict:
    """The keyword arguments a kernel launch adds for grouped heads and the variants (none for the
    defaults, so that their launch is the one it always was): the mask and score bundles
    (:func:`~flashlib.kernels.rules.mask_bundle`, :func:`~flashlib.kernels.rules.score_bundle`). kinds: (B or 1,
    H or 1, rows, tiles) as the kernel walks them; data: the mask function compiled (a
    :class:`~flashlib.kernels.maskfn.KernelMask`), None for a window alone; sinks: the forward's attention sinks
    (H,), float32 contiguous, or None; score: the score function compiled (:func:`kernel_score`), or None."""
    args = {}
    if group > 1 or options.visibility.mask_mod is not None or sinks is not None or score is not None:
        args.update(GROUP=group, HEADS=heads)  # the kernels tell mask and score functions the head
    mask, score = mask_bundle(options, kinds, data), score_bundle(score, sinks)
    return dict(args, **({} if mask is None else dict(mask=mask)), **({} if score is None else dict(score=score)))


def _tells_head(options: Options, sinks=None, score=None) -> bool:
    """Whether a launch's programs are told their batch row and head (masks, sinks and score functions
    read them): its launches then start at a batch's first row. The backward passes no sinks: it reads
    them through the lse, so its kernels are those without sinks."""
    return options.masked or sinks is not None or score is not None


# ----- launchers ------------------------------------------------------------------------------

def _launch_forward(q, k, v, cfg, options=DEFAULT, heads=1, masks=None, fn=FN):
    """q: (B*H, seq_q, d), k: (B*H_kv, seq_k, d), v: (B*H_kv, seq_k, dv). Returns out (B*H, seq_q, dv) and
    lse2 (B*H, seq_q) float64, in base 2. heads: H (query heads per batch row); masks: (kinds, data) for the mask path."""
    bh, seq_q, d = q.shape
    dv = v.shape[-1]
    group = bh // k.shape[0]
    out = q.new_empty(bh, seq_q, dv)
    lse = torch.empty(bh, seq_q, dtype=torch.float64, device=q.device)  # float64: forward._finish says why
    kinds, data = masks or (None, None)
    scale, sinks = options.scale, options.sinks
    sinks = None if sinks is None else sinks.detach().to(torch.float32).contiguous()  # as the kernels read them
    score = kernel_score(options, q.device, batch=bh // heads, heads=heads, seq_q=seq_q, seq_k=k.shape[1], fn=fn)
    switches = dict(HEAD_DIM_PAD=head_dim_pad(d), **value_dim(d, dv), BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k,
                    CAUSAL=options.visibility.causal, INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, **variant_args(options, group=group, heads=heads, kinds=kinds, data=data,
                                                              sinks=sinks, score=score))
    # grid axis 1 holds a launch's rows (CUDA takes at most 65,535), from a batch's first where the
    # kernel is told the head (masks, sinks and score functions)
    for rows in row_runs(bh, heads if _tells_head(options, sinks, score) else group):
        kv = slice(rows.start // group, rows.stop // group)
        _attn_fwd[(triton.cdiv(seq_q, cfg.block_q), rows.stop - rows.start)](
            q[rows], k[kv], v[kv], out[rows], lse[rows], scale * LOG2E, *_strides(q, k, v, out), seq_q, k.shape[1], d,
            scale=scale, ROW0=rows.start, **switches)
    return out, lse


def preprocess(out, dout, dlse, cfg):
    """delta = rowsum(dO * O) - dlse, (rows, seq) float32: out and dout (B*H, seq_q, dv), or a packed
    layout's (H, total_q, dv) views."""
    bh, seq_q, d = out.shape
    delta = torch.empty(bh, seq_q, dtype=torch.float32, device=out.device)
    for rows in row_runs(bh):  # grid axis 1 holds a launch's rows: CUDA takes at most 65,535
        _attn_bwd_preprocess[(triton.cdiv(seq_q, cfg.bwd_block_q), rows.stop - rows.start)](
            out[rows], dout[rows], delta[rows], *_strides(out, dout), seq_q, d, HEAD_DIM_PAD=head_dim_pad(d),
            BLOCK_Q=cfg.bwd_block_q)
    if dlse is not None:
        delta -= dlse  # d lse_i / d s_ij = p_ij: a gradient of lse enters where delta does
    return delta


def _launch_backward(q, k, v, out, lse, dout, dlse, cfg, options=DEFAULT, heads=1, masks=None, fn=FN):
    """All (B*H or B*H_kv, seq, d) (v, out, dout: dv) but lse (base 2, as the forward wrote it) and dlse (of the
    natural lse) (B*H, seq_q); dlse may be None. Returns dq, dk, dv
    and dsinks (None without sinks). masks: (kinds by query block, kinds by key tile, data) for the
    mask path. The lse holds the sinks, so the three kernels are the same with and without them."""
    bh, seq_q, d = q.shape
    seq_k, d_v = k.shape[1], v.shape[-1]
    causal, scale, sinks = options.visibility.causal, options.scale, options.sinks
    delta = preprocess(out, dout, dlse, cfg)  # over v's head dim
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM_PAD=head_dim_pad(d), **value_dim(d, d_v), BLOCK_Q=cfg.bwd_block_q, BLOCK_K=cfg.bwd_block_k,
                  CAUSAL=causal, INPUT_PRECISION=cfg.input_precision, num_warps=cfg.bwd_num_warps,
                  num_stages=cfg.bwd_num_stages)
    by_query, by_key, data = masks or (None, None, None)
    group = bh // k.shape[0]
    score = kernel_score(options, q.device, batch=bh // heads, heads=heads, seq_q=seq_q, seq_k=seq_k, fn=fn)
    told = _tells_head(options, score=score)
    by_key = variant_args(options, group=group, heads=heads, kinds=by_key, data=data, score=score)
    if "GROUP" in by_key:  # dK/dV sums over its block of query heads, BLOCK_H: compile-time, one trip gone without GQA
        by_key["BLOCK_H"] = by_key.pop("GROUP")
    # grid axis 1 holds a launch's rows (CUDA takes at most 65,535), from a batch's first where masked
    for kv in row_runs(k.shape[0], heads // group if told else 1):
        rows = slice(kv.start * group, kv.stop * group)  # the query heads that read these kv heads
        _attn_bwd_dkdv[(triton.cdiv(seq_k, cfg.bwd_block_k), kv.stop - kv.start)](
            q[rows], k[kv], v[kv], dout[rows], dk[kv], dv[kv], lse[rows], delta[rows], scale * LOG2E, scale,
            *_strides(q, k, v, dout, dk, dv), SEQ_Q=seq_q, SEQ_K=seq_k, HEAD_DIM=d, ROW0=kv.start, **common, **by_key)
    by_query = variant_args(options, group=group, heads=heads, kinds=by_query, data=data, score=score)
    for rows in row_runs(bh, heads if told else group):
        kv = slice(rows.start // group, rows.stop // group)
        _attn_bwd_dq[(triton.cdiv(seq_q, cfg.bwd_block_q), rows.stop - rows.start)](
            q[rows], k[kv], v[kv], dout[rows], dq[rows], lse[rows], delta[rows], scale * LOG2E, scale,
            *_strides(q, k, v, dout, dq), SEQ_Q=seq_q, SEQ_K=seq_k, HEAD_DIM=d, ROW0=rows.start, **common, **by_query)
    dsinks = None if sinks is None else sink_grad(sinks, lse_natural(lse).reshape(-1, heads, seq_q),
                                                  delta.reshape(-1, heads, seq_q))
    return dq, dk, dv, dsinks


def _strides(*tensors) -> list[tuple[int, int]]:
    """Each tensor's first two strides as the kernels take them, one tuple: (head, row) of a (rows of heads,
    seq, d) tensor, (token, head) of a packed (tokens, heads, d) one."""
    return [(t.stride(0), t.stride(1)) for t in tensors]


def _masks(options: Options, q, seq_k, block_q, block_k, backward=False, fn=FN):
    """(kinds, data) of a forward launch, or (kinds by query block, kinds by key tile, data) of a
    backward one, for q (..., H, seq_q, d); None without a window or mask function."""
    if not options.masked:
        return None
    batch, heads = batch_and_heads(q.shape)
    # traced before the block mask evaluates it: a construct the kernels cannot compile is named by
    # the trace, not by PyTorch's error on index tensors
    bounds = symbol_bounds(batch, heads, q.shape[-2], seq_k)
    mask_mod = options.visibility.mask_mod
    data = None if mask_mod is None else compile_mask(fn, mask_mod, q.device, bounds)
    kinds = _kinds(options, batch, heads, q.shape[-2], seq_k, block_q, block_k, q.device)
    if backward:
        return rows_of_16(kinds), rows_of_16(kinds.transpose(-1, -2)), data
    return rows_of_16(kinds), data


def forward_base2(q, k, v, *, config=None, fn=FN, **keywords):
    """The teaching forward without autograd: (out, lse2), the lse in base 2 as the kernels keep it for the
    backward, float64 (:func:`flashlib.kernels.forward._finish` says why), -inf for rows that see no key.
    keywords: the options of :func:`attention`."""
    options = check_options(fn, q, k, v, value_dim=True, **keywords)
    check_kernel_inputs(fn, q, v)
    return forward_pass(q, k, v, options, resolve_config(fn, q, config, v), fn)


def forward_pass(q, k, v, options: Options, cfg: FlashConfig, fn: str = FN):
    """:func:`forward_base2` on checked inputs and options (flashlib.machinery.options); fn: the op called, as
    refusals name it."""
    sinks = options.sinks
    if q.numel() == 0 or (q.shape[-2] > 0 and k.shape[-2] == 0 and sinks is None):
        out, lse = empty_result(q, v.shape[-1])
        return out, lse.double()
    if k.shape[-2] == 0:  # nothing to attend to but the sinks: out = 0, lse = sink
        out, lse = merge_sink(*empty_result(q, v.shape[-1]), sinks)
        return out, lse_base2(lse).double()
    masks = _masks(options, q, k.shape[-2], cfg.block_q, cfg.block_k, fn=fn)
    out, lse = _launch_forward(flat(q), flat(k), flat(v), cfg, options, batch_and_heads(q.shape)[1], masks, fn)
    return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


def backward_base2(q, k, v, out, lse2, dout, *, config=None, dlse=None, **keywords):
    """(dq, dk, dv) from the forward's out and base-2 lse (:func:`forward_base2`'s), recomputing P tile by tile
    (no autograd); with ``sinks``, (dq, dk, dv, dsinks). dlse: an optional gradient of the natural lse."""
    options = check_options(FN, q, k, v, value_dim=True, **keywords)
    return backward_pass(q, k, v, out, lse2, dout, options, resolve_config(FN, q, config, v), dlse)


def backward_pass(q, k, v, out, lse2, dout, options: Options, cfg: FlashConfig, dlse=None, fn: str = FN):
    """:func:`backward_base2` on checked options: (dq, dk, dv), and dsinks after them with sinks."""
    sinks = options.sinks
    if out.numel() == 0 or k.shape[-2] == 0:
        zeros = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dsinks = None if sinks is None else sink_grad(sinks, lse_natural(lse2), softmax_delta(out, dout, dlse))
        return (*zeros, *options.tensor_grads(dict(sinks=dsinks)))  # rows with no key still give the sink a share
    seq_q = q.shape[-2]
    masks = _masks(options, q, k.shape[-2], cfg.bwd_block_q, cfg.bwd_block_k, backward=True, fn=fn)
    dq, dk, dv, dsinks = _launch_backward(flat(q), flat(k), flat(v), flat(out), lse2.reshape(-1, seq_q), flat(dout),
                                          None if dlse is None else dlse.reshape(-1, seq_q).float(), cfg, options,
                                          batch_and_heads(q.shape)[1], masks, fn)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), *options.tensor_grads(dict(sinks=dsinks))


def save_lse(lse2):
    """(lse, lse2 as saved): the natural lse that callers see, and the kernels' base-2 one as a
    (..., seq_q, 1) column, so that the saved tensors hold exactly one (..., seq_q) tensor, the lse,
    where courses' tests look for it, while the backward reads the forward's lse2 unrounded."""
    return lse_natural(lse2), lse2.unsqueeze(-1)


def score_grads(q, k, v, out, lse, dout, dlse, options: Options, tensors):
    """The gradients of the tensors the options' score function captures (:func:`flashlib.scores.
    captured_grads`), from the forward's out and natural lse; q, k, v (..., heads, seq, d)."""
    batch, heads = batch_and_heads(q.shape)
    shape = (batch, heads, q.shape[-2])
    q4, out4, dout4 = (t.reshape(*shape, t.shape[-1]) for t in (q, out, dout))
    k4, v4 = (expand_kv(t.reshape(batch, -1, *t.shape[-2:]), heads) for t in (k, v))
    delta = softmax_delta(out4, dout4, dlse)
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    rule = options.visibility
    b, h = head_indices(batch, heads, q.device)
    cols = torch.arange(seq_k, device=q.device)[None, :]

    def visible_of(q0, q1):
        return None if rule.everything else rule.pairs(torch.arange(q0, q1, device=q.device)[:, None], cols, seq_q,
                                                        seq_k, b, h)

    return captured_grads(options.score_mod, tensors, q4, k4, v4, lse.reshape(shape), dout4, delta, scale=options.scale,
                          visible_of=visible_of)


class AttentionFunction(torch.autograd.Function):
    """Saves (q, k, v, out, lse, lse2) — never the (seq_q, seq_k) probabilities. options: the call's,
    checked (flashlib.machinery.options); fn: the op called (refusals name it); tensors: the options' tensors (Options.tensors), then those the score
    function reads that require grad, inputs so that autograd returns their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, cfg, options: Options, fn: str, *tensors):
        held = len(options.tensors)
        options = options.with_tensors(tensors[:held])
        out, lse2 = forward_pass(q, k, v, options, cfg, fn)
        lse, column = save_lse(lse2)
        save(ctx, q, k, v, out, lse, column, *tensors)
        ctx.cfg, ctx.options, ctx.held, ctx.fn = cfg, options, held, fn
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, lse2, *tensors = saved(ctx)
        options, captured = ctx.options.with_tensors(tensors[:ctx.held]), tensors[ctx.held:]
        dq, dk, dv, *dheld = backward_pass(q, k, v, out, lse2.squeeze(-1), dout, options, ctx.cfg, dlse, ctx.fn)
        dcaptured = score_grads(q, k, v, out, lse, dout, dlse, options, captured) if captured else []
        return dq, dk, dv, None, None, None, *dheld, *dcaptured


def captured_inputs(options: Options, q, k, fn: str = FN) -> list:
    """The tensors the score function reads that autograd must differentiate (none without one, or
    without grad mode). The function is traced either way: what cannot compile is refused here,
    naming fn, the op that was called."""
    if options.score_mod is None:
        return []
    batch, heads = batch_and_heads(q.shape)
    tensors = score_tensors(fn, options.score_mod, score_bounds(batch, heads, q.shape[-2], k.shape[-2]))
    return trainable(tensors) if torch.is_grad_enabled() else []


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
              softcap: float | None = None, mask_mod=None, block_mask=None, config: FlashConfig | None = None,
              sinks=None, score_mod=None, return_lse: bool = False, attention_chunk=None):
    """Exact attention softmax(q kᵀ · scale) v with notebook 06's forward and notebook 07's
    backward kernels; differentiable (the lse too).

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k: (batch, kv_heads, seq_k, head_dim); seq_k may differ from seq_q; kv_heads divides
            heads (grouped-query attention: query head h reads kv head h // (heads // kv_heads)).
        v: (batch, kv_heads, seq_k, head_dim_v); head_dim_v may differ (MLA's 192/128); out has it.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal, as
            :func:`flashlib.causal_mask`); key tiles entirely above it are skipped. A row that
            sees no key outputs zeros, with zero gradients.
        scale: defaults to 1/sqrt(head_dim), q's head dim.
        window: (left, right), -1 for no limit on a side: query i sees keys i + o - left ..
            i + o + right (o = seq_k - seq_q); each query block visits only its window's key tiles.
        attention_chunk: C > 0: query i, at p = i + o, sees key j only when j // C == p // C (chunked
            local attention); each query block visits only its rows' chunks. 0 or None: none.
        softcap: c > 0: scores c * tanh(scale * q.k / c), the score function flashlib.scores.softcap(c).
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score (:mod:`flashlib.scores`), applied to
            each scaled score before the mask, compiled into the kernels with its derivative; the
            tensors it captures that require grad get their gradient (deterministic).
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool (:mod:`flashlib.masks`), compiled into the
            kernels; tiles its block mask skips are not computed.
        block_mask: a block mask built once (:func:`flashlib.masks.create_block_mask`), so that a
            training loop does not evaluate the mask function on every pair at every step; it
            carries the mask (its mask function, causal and window), which the call may repeat.
        config: a :class:`FlashConfig` (tile sizes, warps, stages, float32 matmul precision);
            defaults to :func:`default_config` for the head dims, dtype and GPU.
        sinks: attention sinks (heads,), learnable: a score per head with no value in every row's
            softmax. Each query block starts from it (m_i = sink, l_i = 1); the lse includes it, so
            the backward kernels are unchanged and dsinks = -sum of exp(sink - lse) * delta.
        return_lse: also return the log-sum-exp (..., seq_q), float32, -inf for empty rows.

    float16, bfloat16 (GPUs of compute capability >= 8.0) and float32 (tf32 matmuls by
    default on a GPU); head_dim 1..256; any sequence lengths. Without a CUDA device the
    kernels run in Triton's CPU interpreter and take CPU tensors. The backward is
    deterministic: every program writes only its own rows of dq, dk or dv.
    """
    options = check_options(FN, q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            mask_mod=mask_mod, block_mask=block_mask, sinks=sinks, score_mod=score_mod,
                            attention_chunk=attention_chunk, value_dim=True)
    check_kernel_inputs(FN, q, v)
    cfg = resolve_config(FN, q, config, v)
    out, lse = AttentionFunction.apply(q, k, v, cfg, options, FN, *options.tensors, *captured_inputs(options, q, k))
    return (out, lse) if return_lse else out
