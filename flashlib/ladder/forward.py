"""The faster forwards, one rung at a time, from the teaching kernel of :mod:`flashlib.kernels.forward`.

Every rung computes the same thing, softmax(q kᵀ · scale) v with the log-sum-exp, in
FlashAttention-2 order with base-2 exponentials and the scale folded into
qk_scale = scale · log2(e), keeping the teaching kernel's state (m_i, l_i, acc) under its
names. What changes is how the work is launched and fed (what each rung changes and why:
:data:`flashlib.ladder.rungs.LADDER`): rung 1 autotunes the teaching kernel's tiles, rung 2
runs _attn_fwd_split, rung 3 _attn_fwd_tma (rung 2 with tensor descriptors), rungs 4 and 5
the same kernel with the folds _fold_lean and _fold_lazy.

Both kernels take the step that folds one key tile as an argument, FOLD (a ``@triton.jit``
function), and HEAD_DIM as a compile-time constant: one compiled kernel per head dim, so the
head-dim mask disappears whenever the head dim is already a power of two.
"""
from __future__ import annotations

from contextvars import ContextVar

import torch

from ..machinery.checks import check_attention_inputs
from ..kernels._mode import require_triton
from ..kernels.config import LOG2E, FlashConfig, head_dim_pad, lse_natural, seq_bucket
from ..machinery.options import Options
from . import autotune
from .rungs import LADDER, SPLIT_FORWARD, TEACHING_FORWARD, TMA_FORWARD, Rung, kernel_function, rung as rung_named

triton = require_triton()
import triton.language as tl  # noqa: E402

from ..kernels.function import check_kernel_inputs, empty_result, flat, resolve_config  # noqa: E402
from ..kernels.forward import _attn_fwd, _finish, _load_rows, _online_update, _score_tile  # noqa: E402
from ..kernels.rules import _key_tiles, _visible, row_runs  # noqa: E402

FN = "flashlib.ladder.attention"


# ----- loading and ranges -------------------------------------------------------------------

@triton.jit
def _load_full_rows(Ptr, stride, offs_rows, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """A (rows, HEAD_DIM_PAD) tile of rows known to be in bounds: columns are masked only when
    the head dim is padded (HEAD_DIM is a constant, so this is decided when compiling). Row
    offsets in int32 (int32_rows says why)."""
    ptrs = Ptr + offs_rows[:, None] * stride + offs_d[None, :]
    if HEAD_DIM == HEAD_DIM_PAD:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _store_rows(Ptr, stride, offs_rows, offs_d, n_rows, tile, HEAD_DIM: tl.constexpr):
    mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(Ptr + offs_rows[:, None] * stride + offs_d[None, :], tile.to(Ptr.dtype.element_ty), mask=mask)


@triton.jit
def _query_block(CAUSAL: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """This program's query block. Causal blocks further down see more keys; LONGEST_FIRST
    launches them first, so the last wave of programs holds the short ones."""
    if LONGEST_FIRST and CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


# ----- the folds: one key tile into (m_i, l_i, acc) -----------------------------------------

@triton.jit
def _fold(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Rungs 2 and 3: a masked tile folds as in the teaching kernel. A tile every row sees in
    full has only finite scores, so its max is finite too and needs no guard for rows that
    saw no key: the shift is the new max itself."""
    if MASKED:
        s = _score_tile(q_blk, k_tile, qk_scale, _visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL), INPUT_PRECISION)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, s, v_tile, INPUT_PRECISION)
    else:
        s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_Q, BLOCK_K)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=INPUT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fold_lean(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Rung 4 (needs qk_scale > 0): s holds raw scores; the max is scaled once per row
    (max(c s) = c max(s) for c > 0) and the scale rides in exp2's argument, where it fuses
    with the subtraction: one multiply fewer per score."""
    s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION)  # raw scores (BLOCK_Q, BLOCK_K)
    if MASKED:
        s = tl.where(_visible(offs_q, offs_k, SEQ_Q, SEQ_K, CAUSAL), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        # kernels.forward._finite written out: called here, it costs rung 5's loops 10 to 15
        # more integer instructions per tile with Triton 3.7.1 (register moves; 3.6 compiles both alike)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new  # finite: see _fold
    alpha = tl.math.exp2(m_i - shift)
    p = tl.math.exp2(s * qk_scale - shift[:, None])  # one fused multiply-add per score
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fold_lazy(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Rung 5 (needs qk_scale > 0): masked tiles fold as rung 4. acc and l_i may be kept
    relative to any reference m_i, not only the running max: out = acc / l_i and lse = m_i +
    log2(l_i) come out the same. So on a tile seen in full the rescale, a multiply of every
    acc element, is skipped unless some row's max has grown by more than 8 (base 2) since its
    reference: terms 2^(c s - m_i) then stay below 2^8 = 256, far from overflow. The test is
    one number for the whole block (a branch cannot differ between rows); when it passes,
    every row moves its reference to its own max, exactly as rung 4 does."""
    if MASKED:
        m_i, l_i, acc = _fold_lean(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
                                   True, CAUSAL, INPUT_PRECISION)
    else:
        s = tl.dot(q_blk, tl.trans(k_tile), input_precision=INPUT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if tl.max(m_new - m_i, 0) > 8.0:  # the first tile always passes: m_i = -inf there
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.math.exp2(s * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=INPUT_PRECISION)
    return m_i, l_i, acc


# FOLD steps by their name in the rung table, and whether each needs scale > 0
FOLDS = {"_fold": (_fold, False), "_fold_lean": (_fold_lean, True), "_fold_lazy": (_fold_lazy, True)}


# ----- the kernels ----------------------------------------------------------------------------

@triton.jit
def _attn_fwd_split(Q, K, V, Out, Lse, qk_scale,
                    stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om,
                    SEQ_Q, SEQ_K,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    FOLD: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """As kernels.forward._attn_fwd, with the key loop split into a part seen in full, folded
    and loaded without masks, and the diagonal and ragged tiles, masked; FOLD folds a tile."""
    q_block = _query_block(CAUSAL, LONGEST_FIRST)
    off_z = tl.program_id(1).to(tl.int64)
    Q += off_z * stride_qz
    K += off_z * stride_kz
    V += off_z * stride_vz
    Out += off_z * stride_oz
    Lse += off_z * SEQ_Q
    q0 = q_block * BLOCK_Q
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_blk = _load_rows(Q, stride_qm, offs_q, offs_d, SEQ_Q, HEAD_DIM)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_full, k_end = _key_tiles(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    for k0 in range(0, k_full, BLOCK_K):  # off the diagonal, inside the keys: no masks
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_tile = _load_full_rows(K, stride_kn, offs_k, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        v_tile = _load_full_rows(V, stride_vn, offs_k, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        m_i, l_i, acc = FOLD(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
                             False, CAUSAL, INPUT_PRECISION)
    for k0 in range(k_full, k_end, BLOCK_K):  # the diagonal and the last, ragged tile
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_tile = _load_rows(K, stride_kn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        v_tile = _load_rows(V, stride_vn, offs_k, offs_d, SEQ_K, HEAD_DIM)
        m_i, l_i, acc = FOLD(m_i, l_i, acc, q_blk, k_tile, v_tile, offs_q, offs_k, qk_scale, SEQ_Q, SEQ_K,
                             True, CAUSAL, INPUT_PRECISION)

    out, lse = _finish(m_i, l_i, acc)
    _store_rows(Out, stride_om, offs_q, offs_d, SEQ_Q, out, HEAD_DIM)
    tl.store(Lse + offs_q, lse, mask=offs_q < SEQ_Q)


@triton.jit
def _attn_fwd_tma(Q, K, V, Out, Lse, qk_scale,
                  stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om, SEQ_Q, SEQ_K,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  FOLD: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """_attn_fwd_split with every tile moved by a descriptor of one (batch, head)'s (seq,
    HEAD_DIM) matrix: rows past seq and columns past HEAD_DIM arrive as zeros, stores are clipped."""
    q_block = _query_block(CAUSAL, LONGEST_FIRST)
    off_z = tl.program_id(1).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + off_z * stride_qz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    k_desc = tl.make_tensor_descriptor(K + off_z * stride_kz, shape=[SEQ_K, HEAD_DIM], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_K, HEAD_DIM_PAD])
    v_desc = tl.make_tensor_descriptor(V + off_z * stride_vz, shape=[SEQ_K, HEAD_DIM], strides=[stride_vn, 1],
                                       block_shape=[BLOCK_K, HEAD_DIM_PAD])
    o_desc = tl.make_tensor_descriptor(Out + off_z * stride_oz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_om, 1],
                                       block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    q0 = q_block * BLOCK_Q
    offs_q = q0 + tl.arange(0, BLOCK_Q)
    q_blk = q_desc.load([q0, 0])

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    k_full, k_end = _key_tiles(q0, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    for k0 in range(0, k_full, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m_i, l_i, acc = FOLD(m_i, l_i, acc, q_blk, k_desc.load([k0, 0]), v_desc.load([k0, 0]), offs_q, offs_k,
                             qk_scale, SEQ_Q, SEQ_K, False, CAUSAL, INPUT_PRECISION)
    for k0 in range(k_full, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m_i, l_i, acc = FOLD(m_i, l_i, acc, q_blk, k_desc.load([k0, 0]), v_desc.load([k0, 0]), offs_q, offs_k,
                             qk_scale, SEQ_Q, SEQ_K, True, CAUSAL, INPUT_PRECISION)

    out, lse = _finish(m_i, l_i, acc)
    o_desc.store([q0, 0], out.to(Out.dtype.element_ty))
    Lse += off_z * SEQ_Q
    tl.store(Lse + offs_q, lse, mask=offs_q < SEQ_Q)


# ----- launching --------------------------------------------------------------------------

def tma_eligible(*tensors: torch.Tensor) -> bool:
    """A descriptor's base address and row strides must be multiples of 16 bytes, its last
    dim contiguous; checked on the (B*H, seq, d) views the kernels receive. Rows must not
    overlap either: an expanded tensor (a gradient of out.sum(), say) repeats one row with
    stride 0, which the pointer kernels read correctly and a descriptor need not."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(-2) >= t.shape[-1]
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]) for t in tensors)


def tma_hardware(device: torch.device) -> bool:
    """The TMA exists on sm_90 and newer; the interpreter emulates descriptors anywhere."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def _rows_fit(t: torch.Tensor) -> bool:
    """Whether one head's rows of t (B*H, seq, d) span fewer than 2^31 elements; an error where
    even contiguous rows would not."""
    if (t.shape[-2] - 1) * t.stride(-2) + t.shape[-1] < 2**31:
        return True
    if t.shape[-2] * t.shape[-1] >= 2**31:
        raise ValueError(f"{FN}: one head of {t.shape[-2]} rows of {t.shape[-1]} holds 2^31 elements or more, "
                         "more than the ladder's kernels offset; use flashlib.kernels.attention")
    return False


def int32_rows(t: torch.Tensor) -> torch.Tensor:
    """t (B*H, seq, d) as the pointer loads can offset its rows, in int32 (int64 in the inner loops
    costs sm_80 some 40 registers and spills): t itself or, where one head's rows span 2^31 elements
    (a row stride of thousands at long sequences), an O(seq) copy with contiguous rows."""
    return t if _rows_fit(t) else t.contiguous()


def empty_rows(t: torch.Tensor) -> torch.Tensor:
    """An output like t (B*H, seq, d) whose rows the stores can offset in int32: empty_like(t), with
    contiguous rows where t's would span 2^31 elements."""
    return torch.empty_like(t) if _rows_fit(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


# Triton keeps its allocator in a ContextVar (triton.set_allocator sets it for the calling thread or
# task only: autograd's backward runs on a thread of its own); this flag lives in the same scope
_ALLOCATOR_SET: ContextVar[bool] = ContextVar("flashlib_allocator_set", default=False)


def ensure_allocator(device: torch.device):
    """Descriptors made inside a kernel live in a small global scratch buffer that Triton
    asks the caller to allocate; set on first use on a GPU in each thread (never at import)."""
    if device.type == "cuda" and not _ALLOCATOR_SET.get():
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET.set(True)


def variant(rung: Rung, descriptors: bool, scale: float = 1.0):
    """(kernel, compile-time options, autotuner variant) that run ``rung`` here: its own
    kernel, or rung 2's where descriptors cannot be used, with rung 3's fold and launch order
    where its fold needs scale > 0 and scale is not."""
    if rung.kernel == TEACHING_FORWARD:
        return kernel_function(rung.kernel), {}, (rung.kernel,)
    fold, longest_first = rung.fold, rung.longest_first
    if FOLDS[fold][1] and scale <= 0:
        fold, longest_first = "_fold", False
    place = rung.kernel if descriptors else SPLIT_FORWARD
    options = dict(FOLD=FOLDS[fold][0], LONGEST_FIRST=longest_first)
    return kernel_function(place), options, (place, fold, longest_first)


def _launch(kernel, switches, tuner_variant, tiles, q, k, v, out, lse, options: Options, cfg):
    """kernel with the tiles of cfg, or autotuned over ``tiles`` (GPU only) when cfg is None. options:
    the call's (flashlib.machinery.options; a rung has the causal rule and the scale only)."""
    bh, seq_q, d = q.shape
    strides = [t.stride()[:2] for t in (q, k, v, out)]  # (head, row) each
    head_dim = dict(HEAD_DIM_PAD=head_dim_pad(d))
    if kernel is _attn_fwd:  # the teaching kernel takes a tuple a tensor, and HEAD_DIM at run time
        rest = (*strides, seq_q, k.shape[1], d)
        head_dim.update(HEAD_DIM_V=None, HEAD_DIM_V_PAD=head_dim["HEAD_DIM_PAD"])  # v's head dim is q's
    else:
        rest = (*(s for pair in strides for s in pair), seq_q, k.shape[1])
        head_dim["HEAD_DIM"] = d
    if cfg is None:
        kernel, fixed = autotune.tuner(kernel, tuner_variant, seq_bucket(seq_q, k.shape[1]), tiles), {}
    else:
        fixed = dict(BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for rows in row_runs(bh):  # grid axis 1 holds a launch's rows: CUDA takes at most 65,535
        kernel[lambda meta, n=rows.stop - rows.start: (triton.cdiv(seq_q, meta["BLOCK_Q"]), n)](
            q[rows], k[rows], v[rows], out[rows], lse[rows], options.scale * LOG2E, *rest, **head_dim,
            CAUSAL=options.visibility.causal, INPUT_PRECISION=cfg.input_precision if cfg else "tf32", **switches,
            **fixed)


def autotuned_choice(q, causal: bool, rung: str = "autotuned", seq: int | None = None):
    """The tiles the autotuner kept for inputs like q of a rung (None before the first GPU
    call), with descriptors or, where they could not be used, without; seq: the sequence
    length whose bucket to look in (default q's)."""
    bucket = seq_bucket(seq or q.shape[-2], seq or q.shape[-2])
    kept = (autotune.kept(variant(rung_named(rung), descriptors)[2], bucket, q.shape[-1], causal, q.dtype)
            for descriptors in (True, False))
    return next((chosen for chosen in kept if chosen), None)


RUNGS = tuple(r.name for r in LADDER)


def forward(q, k, v, **options):
    """The forward of one rung: (out, lse), out like q, lse (..., seq_q) float32, natural log;
    the options of :func:`forward_base2`."""
    out, lse2 = forward_base2(q, k, v, **options)
    return out, lse_natural(lse2)


def forward_base2(q, k, v, *, causal: bool = False, scale: float | None = None, rung: str = "tma",
                  config: FlashConfig | None = None):
    """The forward of one rung: returns (out, lse2), out like q, lse2 (..., seq_q) float32, the lse
    in base 2 as the backward reads it (:mod:`flashlib.kernels.config`).

    Same contract as :func:`flashlib.kernels.function.forward_base2` (bottom-right causal diagonal,
    zeros and lse = -inf for rows that see no key). ``config`` fixes the tiles; by default
    rung "teaching" uses :func:`default_config` and the other rungs autotune on a GPU for
    16-bit inputs, keeping one choice per sequence bucket (:func:`seq_bucket`); float32
    inputs, and the interpreter, which cannot time kernels, use :func:`default_config` too.
    Where descriptors cannot be used (rows or addresses not multiples of 16 bytes, a GPU older
    than sm_90), and where scale <= 0, a rung runs what its ``falls_back`` says.
    """
    if rung not in RUNGS:
        raise ValueError(f"forward: argument 'rung' must be one of {RUNGS}, got {rung!r}")
    scale = check_attention_inputs(FN, q, k, v, causal=causal, scale=scale)
    check_kernel_inputs(FN, q)
    fixed = resolve_config(FN, q, config)
    lead, seq_q = q.shape[:-2], q.shape[-2]
    if seq_q == 0 or k.shape[-2] == 0 or q.numel() == 0:
        return empty_result(q)
    qf, kf, vf = flat(q), flat(k), flat(v)  # (B*H, seq, d)
    out = empty_rows(qf)
    lse = torch.empty(qf.shape[0], seq_q, dtype=torch.float32, device=q.device)
    r = rung_named(rung)
    descriptors = r.kernel == TMA_FORWARD and tma_eligible(qf, kf, vf) and tma_hardware(q.device)
    if descriptors:
        ensure_allocator(q.device)
    else:  # pointer loads: offsets inside one head in int32
        qf, kf, vf = int32_rows(qf), int32_rows(kf), int32_rows(vf)
    kernel, switches, tuner_variant = variant(r, descriptors, scale)
    cfg = None if r.tiles and autotune.autotunes(q.dtype, config) else fixed  # None: autotune
    _launch(kernel, switches, tuner_variant, r.tiles, qf, kf, vf, out, lse, Options.of(causal=causal, scale=scale), cfg)
    return out.reshape(q.shape), lse.reshape(*lead, seq_q)
