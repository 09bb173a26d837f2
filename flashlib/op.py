"""``flashlib.flash_attention``: the public op, one PyTorch custom op with its own gradient.

Which kernels run is decided per call, from the device, the dtype and the options (:func:`path_for`):

    CUDA GPU, float16/bfloat16, compute capability >= 8.0, no option beyond causal, v's head dim q's
        forward "tma" (rung 3 of :mod:`flashlib.ladder`; rung 2's kernel where tensor
        descriptors cannot be used: before sm_90, or rows not a multiple of 16 bytes) and
        backward "tuned", both with tiles autotuned per head dim, dtype, mask and length
        bucket. The fastest combination a recorded H200 run measured (data/bench/) that the
        compile tests build for sm_80 and sm_90.
    anything else (float32 on a GPU, sm_75, the CPU; grouped-query heads, a window, a
    soft-cap or a mask function on any device; a head dim of v's own (MLA's); packed sequences)
        the teaching kernels of notebooks 06 and 07 with their shipped tiles (the ladder's
        rungs do not have these options); on a machine without a CUDA device they run in
        Triton's CPU interpreter.

Registered with ``torch.library`` as ``flashlib::flash_attention`` (forward) and
``flashlib::flash_attention_backward``, each with a fake implementation, so that
``torch.compile(fullgraph=True)`` and ``torch.export`` see one opaque op whose output shapes
they know, and autograd uses the backward op. The call's options, checked once into one
:class:`flashlib.machinery.options.Options`, cross each op's schema as one list of numbers
(``Options.op_numbers``) and one list of tensors (``Options.tensors``: the sinks), read back by
``Options.from_op``; the backward returns one gradient per tensor of that list. A new option
changes no schema. A mask or score function is not an op argument (it is Python code): with
``mask_mod``, ``block_mask`` or ``score_mod`` the call runs the teaching kernels' autograd Function
directly, eagerly (``torch.compile`` breaks the graph there; ``fullgraph=True`` refuses it, its error
naming the argument and the graph break).
``flashlib::flash_attention_varlen`` and its backward are the packed-sequence op, likewise.
"""
from __future__ import annotations

import torch

from .machinery.autograd import save, saved
from .kernels import function as teaching
from .kernels import varlen as packed
from .kernels.config import lse_base2, lse_natural
from .kernels.function import capability, check_kernel_inputs
from .machinery.options import Options, check_options
from .varlen import check_varlen_values

FN = "flash_attention"
VARLEN_FN = "flash_attention_varlen"
FAST_DTYPES = (torch.float16, torch.bfloat16)


def path_for(q: torch.Tensor, k: torch.Tensor | None = None, options: Options | None = None, v=None,
             **keywords) -> tuple[str, str]:
    """(forward, backward) that :func:`flash_attention` runs for inputs like q (and k: fewer heads
    than q is grouped-query attention; v: a head dim of its own, which only the teaching kernels take) with
    these options (an :class:`~flashlib.machinery.options.Options`,
    or its keywords: window=, softcap=, mask_mod=, score_mod=, sinks=): the options say whether
    anything beyond the causal rule is asked for, so no option can be dropped on the way."""
    if options is None:
        options = Options.of(**{name: value for name, value in keywords.items() if value is not None})
    grouped = k is not None and q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] != q.shape[-3]
    own_value_dim = v is not None and v.shape[-1] != q.shape[-1]
    fast = not grouped and not own_value_dim and not options.beyond_causal and not options.functions
    if fast and q.device.type == "cuda" and q.dtype in FAST_DTYPES and capability(q.device) >= (8, 0):
        return "tma", "tuned"
    return "teaching", "teaching"


def flash_attention_forward(q, k, v, **options):
    """The forward of :func:`flash_attention` without autograd: (out, lse), lse (..., seq_q) float32,
    natural log. Options: causal, scale, window, softcap, mask_mod, sinks, score_mod."""
    out, lse2 = forward_base2(q, k, v, **options)
    return out, lse_natural(lse2)


def forward_base2(q, k, v, **keywords):
    """:func:`flash_attention_forward` with the lse in base 2, as the kernels keep it."""
    options = check_options(FN, q, k, v, value_dim=True, **keywords)
    check_kernel_inputs(FN, q, v)
    return _forward(q, k, v, options)


def _forward(q, k, v, options: Options):
    forward, _ = path_for(q, k, options, v)
    if forward == "teaching":
        return teaching.forward_pass(q, k, v, options, teaching.resolve_config(FN, q, None, v), FN)
    from .ladder.forward import forward_base2 as rung_forward

    options.refuse_beyond(FN, f"the ladder's rung {forward!r}")  # it takes causal and scale alone
    out, lse2 = rung_forward(q, k, v, causal=options.visibility.causal, scale=options.scale, rung=forward)
    return out, lse2.double()  # one dtype for every path: the teaching kernels' float64


def flash_attention_backward(q, k, v, out, lse, dout, **options):
    """(dq, dk, dv) of :func:`flash_attention` from its out and lse (natural log), without autograd,
    and dsinks with ``sinks``; dlse is an optional gradient with respect to lse. The lse is
    converted to base 2 here (an ulp from the forward's own, see :mod:`flashlib.kernels.config`)."""
    return backward_base2(q, k, v, out, lse_base2(lse), dout, **options)


def backward_base2(q, k, v, out, lse2, dout, *, dlse=None, **keywords):
    """:func:`flash_attention_backward` from the forward's base-2 lse, :func:`forward_base2`'s (dq, dk,
    dv and dsinks; the gradients of what a score function captures come from autograd only)."""
    return _backward(q, k, v, out, lse2, dout, check_options(FN, q, k, v, value_dim=True, **keywords), dlse)


def _backward(q, k, v, out, lse2, dout, options: Options, dlse=None):
    _, backward = path_for(q, k, options, v)
    if backward == "teaching":
        return teaching.backward_pass(q, k, v, out, lse2, dout, options, teaching.resolve_config(FN, q, None, v),
                                      dlse, FN)
    from .ladder.function import backward_pass_base2

    options.refuse_beyond(FN, f"the ladder's backward {backward!r}")
    return backward_pass_base2(q, k, v, out, lse2, dout, causal=options.visibility.causal, scale=options.scale,
                               backward=backward, dlse=dlse)


# ----- the custom ops: an Options crosses a schema as one list of numbers and one of tensors ----

@torch.library.custom_op("flashlib::flash_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, numbers: list[float],
                  tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, lse2): the natural lse callers see, and the base-2 one the backward reads, as
    (..., seq_q, 1) (kernels.function.save_lse). numbers, tensors: Options.op_numbers() and
    Options.tensors."""
    out, lse2 = _forward(q, k, v, Options.from_op(numbers, tensors))
    lse, column = teaching.save_lse(lse2.contiguous())
    return out.contiguous(), lse, column  # the layouts the fake implementation promises


@_attention_op.register_fake
def _(q, k, v, numbers, tensors):
    rows = q.shape[:-1]
    return (q.new_empty((*rows, v.shape[-1])), q.new_empty(rows, dtype=torch.float32),
            q.new_empty((*rows, 1), dtype=torch.float64))


def _held_grads(grads, tensors) -> list:
    """The gradients of the options' tensors from a backward's (dq, dk, dv, *theirs), one per tensor."""
    return [g.contiguous() for g in grads[3:3 + len(tensors)]]


def _fake_grads(q, k, v, tensors):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), [t.new_empty(t.shape) for t in tensors]


@torch.library.custom_op("flashlib::flash_attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse2: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, numbers: list[float],
                           tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 list[torch.Tensor]]:
    """(dq, dk, dv, the gradients of the options' tensors) from the forward's base-2 lse2 (..., seq_q)."""
    grads = _backward(q, k, v, out, lse2, dout.contiguous(), Options.from_op(numbers, tensors), dlse)
    dq, dk, dv = (g.contiguous() for g in grads[:3])
    return dq, dk, dv, _held_grads(grads, tensors)


@_attention_backward_op.register_fake
def _(q, k, v, out, lse2, dout, dlse, numbers, tensors):
    return _fake_grads(q, k, v, tensors)


def _setup_context(ctx, inputs, output):
    q, k, v, numbers, tensors = inputs
    out, lse, column = output
    ctx.mark_non_differentiable(column)
    save(ctx, q, k, v, out, lse, column, *tensors)  # never the (seq_q, seq_k) probabilities
    ctx.numbers = numbers


def _backward_op(ctx, dout, dlse, _):
    q, k, v, out, lse, column, *tensors = saved(ctx)
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv, dtensors = _attention_backward_op(q, k, v, out, column.squeeze(-1), dout, dlse, ctx.numbers,
                                                  tensors)
    return dq, dk, dv, None, list(dtensors)


_attention_op.register_autograd(_backward_op, setup_context=_setup_context)


# what torch.compile(fullgraph=True) reports (as the disabled function's reason) for a call with a function
_GRAPH_BREAK = ("{fn}: a score_mod, mask_mod or block_mask is Python code, which no custom op takes as an argument, "
                "so the call runs eagerly, outside the graph (a graph break); with torch.compile(fullgraph=True), call "
                "{fn} outside the compiled function, or compile with fullgraph=False (the graph breaks around it)")


@torch.compiler.disable(reason=_GRAPH_BREAK.format(fn=FN))
def _eager(q, k, v, keywords: dict):
    """A mask or score function is Python code, not an op argument: the call checked and run through the
    teaching kernels' autograd Function, eagerly, all of it (so that torch.compile meets one call it
    cannot trace, whose reason names the arguments, rather than the checks' inner workings); the
    tensors a score function captures are the Function's inputs, for their gradients."""
    options = check_options(FN, q, k, v, value_dim=True, **keywords)
    check_kernel_inputs(FN, q, v)
    cfg = teaching.resolve_config(FN, q, None, v)
    return teaching.AttentionFunction.apply(q, k, v, cfg, options, FN, *options.tensors,
                                            *teaching.captured_inputs(options, q, k, FN))


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
                    softcap: float | None = None, mask_mod=None, block_mask=None, sinks=None,
                    score_mod=None, return_lse: bool = False, attention_chunk=None):
    """Exact attention softmax(q kᵀ · scale) v, fused, differentiable (the lse too).

    Args:
        q: (batch, heads, seq_q, head_dim); any leading dims, at least (seq_q, head_dim).
        k: (batch, kv_heads, seq_k, head_dim); seq_k may differ from seq_q. kv_heads divides
            heads: grouped-query attention (multi-query with one kv head), query head h reads kv
            head h // (heads // kv_heads); dk and dv sum over each group.
        v: (batch, kv_heads, seq_k, head_dim_v); head_dim_v may differ from head_dim (DeepSeek's
            MLA in prefill and training: 192 for q and k, 128 for v); out has head_dim_v.
        causal: query i sees key j when j <= i + seq_k - seq_q (bottom-right diagonal, as
            flash-attn >= 2.1 and :func:`flashlib.causal_mask`; PyTorch's SDPA aligns
            top-left, the same when seq_q == seq_k). A row that sees no key outputs zeros,
            with zero gradients::

                seq_q=3, seq_k=5      seq_q=5, seq_k=3      seq 6, window=(2, 0), causal
                1 1 1 0 0             0 0 0                 1 0 0 0 0 0
                1 1 1 1 0             0 0 0                 1 1 0 0 0 0
                1 1 1 1 1             1 0 0                 1 1 1 0 0 0
                                      1 1 0                 0 1 1 1 0 0
                                      1 1 1                 0 0 1 1 1 0
                                                            0 0 0 1 1 1
        scale: defaults to 1/sqrt(head_dim), q's head dim whatever v's is.
        window: (left, right): with o = seq_k - seq_q, query i sees key j iff i + o - left <= j <=
            i + o + right; -1: no limit on a side (flash-attn's convention); ANDed with causal. Key
            tiles outside the window are never visited: the cost is O(seq * window).
        attention_chunk: C > 0: chunked local attention (FA3's name; Llama 4's chunked layers):
            query i, at p = i + seq_k - seq_q, sees key j only when j // C == p // C (a row with p < 0
            sees nothing); ANDed with causal, window and mask_mod. Tiles outside the rows' chunks
            are never visited. 0 or None: no chunks.
        softcap: c > 0: scores c * tanh(scale * q.k / c) (Gemma 2), the score function
            ``flashlib.scores.softcap(c)``; the lse is that of the capped scores.
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score, as flex_attention takes one,
            applied to each scaled score before the mask (:mod:`flashlib.scores`); q_idx, kv_idx
            are positions within the sequences. Compiled into the kernels with its derivative; the
            tensors it captures that require grad get gradients (deterministic). Not with softcap.
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool, as flex_attention takes one (a def, a
            lambda or a closure over tensors it indexes: :mod:`flashlib.masks`), ANDed with causal
            and window; tiles where it is false everywhere are skipped, the rest compile it.
        block_mask: that block mask built once (:func:`flashlib.masks.create_block_mask`); it
            carries the mask function, causal, window and chunk, which the call may repeat, not change.
        sinks: attention sinks (GPT-OSS's), (heads,), learnable: one more score sinks[h] with no
            value in each row of head h; the lse includes it; its gradient is -sum over the head's
            rows of exp(sink - lse) * (rowsum(dout * out) - dlse). A row that sees no key outputs 0.
        return_lse: also return the log-sum-exp of each score row, (..., seq_q) float32,
            -inf for rows that see no key.

    Paths (:func:`path_for`): on a CUDA GPU in float16/bfloat16 without options, rung 3's forward
    and the tuned backward; with any option, and otherwise (float32 on a GPU: tf32 matmuls; the
    CPU: Triton's interpreter, no bfloat16; a head dim of v's own) the teaching kernels. head_dim and
    head_dim_v 1..256, any lengths. Works inside ``torch.compile(fullgraph=True)`` and ``torch.export`` with
    every option but ``score_mod``, ``mask_mod`` and ``block_mask``: eager, a graph break (which fullgraph names).
    """
    keywords = dict(causal=causal, scale=scale, window=window, softcap=softcap, mask_mod=mask_mod,
                    block_mask=block_mask, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk)
    if mask_mod is not None or block_mask is not None or score_mod is not None:
        out, lse = _eager(q, k, v, keywords)
    else:
        options = check_options(FN, q, k, v, value_dim=True, **keywords)
        check_kernel_inputs(FN, q, v)
        out, lse, _ = _attention_op(q, k, v, options.op_numbers(), options.tensors)
    return (out, lse) if return_lse else out


# ----- packed sequences -----------------------------------------------------------------------

@torch.compiler.disable(reason=_GRAPH_BREAK.format(fn=VARLEN_FN).replace(", mask_mod or block_mask", ""))
def _varlen_eager(q, k, v, cu_q, cu_k, max_q, max_k, keywords: dict):
    """With a score function: the call checked and run through the packed kernels' autograd Function,
    eagerly, all of it (as :func:`_eager`), the lengths checked here."""
    options = packed.check_inputs(VARLEN_FN, q, k, v, cu_q, cu_k, max_q, max_k, read_values=False, **keywords)
    max_q, max_k = min(max_q, q.shape[0]), min(max_k, k.shape[0])
    options = options.window_within(max_q + max_k)
    check_varlen_values(VARLEN_FN, q, k, cu_q, cu_k, max_q, max_k)
    batch, heads = cu_q.shape[0] - 1, q.shape[1]
    captured = teaching.captured_inputs(options, q.new_empty(batch, heads, max_q, 0), k.new_empty(1, 1, max_k, 0),
                                        VARLEN_FN)
    return packed.VarlenFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, options, *options.tensors, *captured)


def _check_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The checks that read the cumulative lengths, in the op's own implementation: eager and
    compiled calls alike reach it with real tensors (a trace cannot read values, so the checks
    cannot live in flash_attention_varlen). Skipped while a CUDA graph is captured, where no
    transfer to the host is allowed."""
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    check_varlen_values(VARLEN_FN, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@torch.library.custom_op("flashlib::flash_attention_varlen", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, numbers: list[float],
               tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, lse2), the lses (heads, total_q) and (heads, total_q, 1), as flashlib::flash_attention's."""
    _check_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse2 = packed.varlen_forward_base2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            Options.from_op(numbers, tensors))
    return (out.contiguous(), *teaching.save_lse(lse2.contiguous()))


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, numbers, tensors):
    rows = (q.shape[1], q.shape[0])
    return (q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(rows, dtype=torch.float32),
            q.new_empty((*rows, 1), dtype=torch.float64))


@torch.library.custom_op("flashlib::flash_attention_varlen_backward", mutates_args=())
def _varlen_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse2: torch.Tensor,
                        dout: torch.Tensor, dlse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, numbers: list[float],
                        tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                              list[torch.Tensor]]:
    """(dq, dk, dv, the gradients of the options' tensors) from the forward's base-2 lse2."""
    grads = packed.varlen_backward_base2(q, k, v, out, lse2, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, Options.from_op(numbers, tensors), dlse=dlse)
    dq, dk, dv = (g.contiguous() for g in grads[:3])
    return dq, dk, dv, _held_grads(grads, tensors)


@_varlen_backward_op.register_fake
def _(q, k, v, out, lse2, dout, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, numbers, tensors):
    return _fake_grads(q, k, v, tensors)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, numbers, tensors = inputs
    ctx.mark_non_differentiable(output[2])
    save(ctx, q, k, v, *output, cu_q, cu_k, *tensors)
    ctx.numbers, ctx.lengths = numbers, (max_q, max_k)


def _varlen_backward(ctx, dout, dlse, _):
    q, k, v, out, lse, column, cu_q, cu_k, *tensors = saved(ctx)
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv, dtensors = _varlen_backward_op(q, k, v, out, column.squeeze(-1), dout, dlse, cu_q, cu_k,
                                               *ctx.lengths, ctx.numbers, tensors)
    return dq, dk, dv, None, None, None, None, None, list(dtensors)


_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, scale: float | None = None, window=None,
                           softcap: float | None = None, sinks=None, score_mod=None, return_lse: bool = False,
                           attention_chunk=None):
    """Attention over packed sequences of different lengths (flash-attn's varlen layout,
    :mod:`flashlib.varlen`), fused, differentiable (the lse too).

    Args:
        q: (total_q, heads, head_dim), the batch's sequences one after another, no padding.
        k: (total_k, kv_heads, head_dim); kv_heads divides heads (grouped-query attention).
        v: (total_k, kv_heads, head_dim_v); head_dim_v may differ from head_dim (MLA's 192/128); out
            has head_dim_v.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 cumulative lengths: 0 first, total last,
            non-decreasing; sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
            and attend to its keys only. A sequence may be empty. Any strides (views are copied
            where the kernels read them); other dtypes are refused.
        max_seqlen_q, max_seqlen_k: the longest sequences (they size the grid; programs past a
            sequence's end compute nothing, so padding costs no FLOPs).
        causal, scale, window, attention_chunk, softcap, sinks: as :func:`flash_attention`, aligned bottom-right
            within each sequence (sinks (heads,): one logit per query head, the same in every sequence).
        score_mod: as :func:`flash_attention`; b is the sequence's index in the batch and q_idx,
            kv_idx positions within the sequence (not rows of the packed tensors). It runs the
            kernels' autograd Function eagerly (a score function is not an op argument).
        return_lse: also return the lse, (heads, total_q) float32 (flash-attn's layout).

    Runs the teaching kernels (:mod:`flashlib.kernels.varlen`) on every device; registered as
    the custom op ``flashlib::flash_attention_varlen``, so it works inside
    ``torch.compile(fullgraph=True)``. The checks that read the lengths run in the op's
    implementation, so eager and compiled calls raise the same errors (one transfer from the
    device per call; none while a CUDA graph is captured).
    """
    keywords = dict(causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks, score_mod=score_mod,
                    attention_chunk=attention_chunk)
    if score_mod is not None:
        out, lse = _varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, keywords)
        return (out, lse) if return_lse else out
    options = packed.check_inputs(VARLEN_FN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  read_values=False, **keywords)
    # exact, and within the op's numbers: no sequence is longer than its packed tensor, and a window
    # side as wide as both sequences limits nothing (-1 stays -1)
    max_q, max_k = min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])
    options = options.window_within(max_q + max_k)
    out, lse, _ = _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, options.op_numbers(), options.tensors)
    return (out, lse) if return_lse else out
