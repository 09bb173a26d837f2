"""The tuned forward, one rung at a time, from the teaching kernel of ``forward.py``.

Every rung computes the same thing, softmax(q kᵀ · scale) v with the log-sum-exp, in
FlashAttention-2 order with base-2 exponentials and the scale folded into
qk_scale = scale · log2(e). What changes is how the work is launched and fed:

    rung 1 "autotuned"     the teaching kernel, unchanged; the block sizes, warps and
                           pipeline stages are timed on the GPU and the fastest is kept
                           (a fixed configuration in the interpreter: autotuning needs a driver),
                           once per sequence-length bucket; rungs 2 to 5 are autotuned the same
                           way, so each rung's gain is its own change, not a change of tiles
    rung 2 "causal-split"  key tiles every row of the query block sees in full are folded
                           without any mask; only the tiles crossing the diagonal or the end
                           of the keys pay for the mask; tiles above the diagonal are skipped
    rung 3 "tma"           rung 2, with Q, K, V and O moved through tensor descriptors: on
                           Hopper (sm_90) the copy engine (TMA) moves whole tiles and pads
                           out-of-bounds rows and columns with zeros, so loads need no masks
    rung 4 "lean"          rung 3 with less work per score and a better launch order: the row
                           max is taken of the raw scores and scaled once per row, so the scale
                           rides in the exponent's fused multiply-add (one multiply fewer per
                           score; needs scale > 0); causal launches start with the longest query
                           blocks, so the short ones fill the last wave instead of a long one
    rung 5 "lazy-rescale"  rung 4, and on unmasked tiles the output is rescaled only when some
                           row's max has grown by more than a factor 2^8 (a branch for the whole
                           block): most tiles of a long row skip one multiply per output element

Rungs 2 to 5 take HEAD_DIM as a compile-time constant: one compiled kernel per head dim,
so the head-dim mask disappears whenever the head dim is already a power of two.
"""
from __future__ import annotations

import torch

from .._checks import check_attention_inputs
from ..kernels._mode import interpreting, require_triton
from ..kernels.config import LOG2E, FlashConfig, head_dim_pad, seq_bucket

triton = require_triton()
import triton.language as tl  # noqa: E402

from ..kernels.function import capability, check_kernel_inputs, empty_result, flat, resolve_config  # noqa: E402
from ..kernels.forward import _LOG2E, _attn_fwd, _key_range_end, _visible  # noqa: E402

FN = "flashlib.ladder.attention"


def autotunes(dtype: torch.dtype, config) -> bool:
    """Whether a tuned path times its candidate tiles here: on a GPU (the interpreter cannot
    time kernels), for 16-bit inputs (the candidates are sized for them; float32 doubles
    every tile and would overflow shared memory), unless the caller fixed the tiles."""
    return config is None and not interpreting() and dtype in (torch.float16, torch.bfloat16)

# ----- rung 1: the teaching kernel, autotuned --------------------------------------------

# (BLOCK_Q, BLOCK_K, warps, stages) per padded head dim (16 and 32 use 64's), shared by every
# autotuned rung so that a rung's gain is its own change, not a change of tiles. Two H200
# runs (data/bench/) kept only (128, 64, 8, 3) and (64, 64, 4, 3) out of eight candidates, for
# every head dim, dtype and mask; the third candidate is a neighbour not yet measured: a deeper
# pipeline of 128 x 128 tiles at head dim 64, short 32-key tiles (three programs per SM) at 128.
# At head dim 256 a 128-row tile overflows registers and a deep pipeline shared memory, and
# 64 rows with 8 warps would hold every score twice (compile.exponentials_per_score).
FORWARD_TILES = {64: ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)),
                 128: ((128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)),
                 256: ((64, 32, 4, 1), (64, 32, 4, 2), (32, 32, 4, 2))}


def forward_tiles(head_dim_pad_: int):
    """The autotune candidates for a padded head dim."""
    return FORWARD_TILES[max(64, head_dim_pad_)]


def _autotune_bench(kernel_call, quantiles):
    """Fewer repetitions than Triton's default: the ladder benchmark has a time budget."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _config(bm, bn, w, s):
    return triton.Config({"BLOCK_Q": bm, "BLOCK_K": bn}, num_warps=w, num_stages=s)


def _head_dim_tiles(configs, named_args, **kwargs):
    """Swap in the candidates of this head dim (the listed configs are placeholders)."""
    d_pad = kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD", 64))
    return [_config(*tile) for tile in forward_tiles(d_pad)]


# One autotuner per (kernel, sequence bucket), made on first use on a GPU (decorating builds a
# Python object only; the driver is first touched when it is called). Autotuners of one kernel
# share its compiled binaries: a new bucket re-times the candidates, it never recompiles them.
_TUNERS: dict = {}


def _tuner(name: str, kernel, bucket: int):
    key = (name, bucket)
    if key not in _TUNERS:
        _TUNERS[key] = triton.autotune(
            configs=[_config(*tile) for tile in FORWARD_TILES[128]],
            key=["HEAD_DIM", "HEAD_DIM_PAD", "CAUSAL", "INPUT_PRECISION"],  # Triton adds the dtypes
            prune_configs_by={"early_config_prune": _head_dim_tiles},
            do_bench=_autotune_bench)(kernel)
    return _TUNERS[key]


def _launch_teaching(q, k, v, out, lse, causal, scale, cfg):
    """forward._attn_fwd with the tiles of cfg, or autotuned (GPU only) when cfg is None."""
    bh, seq_q, d = q.shape
    args = (q, k, v, out, lse, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), seq_q, k.shape[1], d)
    if cfg is None:  # on a GPU: let the autotuner pick the tiles
        grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_Q"]), bh)  # noqa: E731
        _tuner("autotuned", _attn_fwd, seq_bucket(seq_q, k.shape[1]))[grid](
            *args, HEAD_DIM_PAD=head_dim_pad(d), CAUSAL=causal, INPUT_PRECISION="tf32")
        return
    _attn_fwd[(triton.cdiv(seq_q, cfg.block_q), bh)](
        *args, HEAD_DIM_PAD=head_dim_pad(d), BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, CAUSAL=causal,
        INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def autotuned_choice(q, causal: bool, rung: str = "autotuned", seq: int | None = None):
    """The tiles the autotuner kept for inputs like q of a rung (None before the first GPU
    call); seq: the sequence length whose bucket to look in (default q's)."""
    bucket = seq_bucket(seq or q.shape[-2], seq or q.shape[-2])
    # "<rung>-split": rungs 4 and 5 without descriptors
    names = (rung, rung + "-split") if rung in ("lean", "lazy-rescale") else (rung,)
    for name in names:
        kernel = _TUNERS.get((name, bucket))
        for key, config in (kernel.cache.items() if kernel else ()):
            if key[0] == q.shape[-1] and key[2] == causal and str(q.dtype) in key:
                return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return None


# ----- rung 2: the causal split -----------------------------------------------------------

@triton.jit
def _key_ranges(start_m, SEQ_Q, SEQ_K, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_end, hi): key tiles [0, full_end) are seen in full by every row of the query
    block and lie inside the keys, so they need no mask; [full_end, hi) need one; the rest
    is never seen (block skipping)."""
    hi = _key_range_end(start_m * BLOCK_Q, SEQ_Q, SEQ_K, BLOCK_Q, CAUSAL)
    if CAUSAL:
        # the block's first row sees keys j <= start_m * BLOCK_Q + SEQ_K - SEQ_Q
        seen_by_all = tl.minimum(tl.maximum(start_m * BLOCK_Q + (SEQ_K - SEQ_Q) + 1, 0), SEQ_K)
    else:
        seen_by_all = SEQ_K
    full_end = (seen_by_all // BLOCK_K) * BLOCK_K
    return full_end, hi


@triton.jit
def _fold_tile(acc, l_i, m_i, q, k, v, offs_m, offs_n, qk_scale, SEQ_Q, SEQ_K,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, LEAN: tl.constexpr,
               LAZY: tl.constexpr = False):
    """One online-softmax step on a loaded tile: k, v (BLOCK_K, HEAD_DIM_PAD).
    LEAN (needs qk_scale > 0): s holds raw scores; the max is scaled once per row and the
    scale is applied inside exp2's argument, where it fuses with the subtraction.
    LAZY (unmasked tiles, with LEAN): see _lazy_fold."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_K)
    if not LEAN:
        s = s * qk_scale  # base 2
    if MASKED:
        s = tl.where(_visible(offs_m, offs_n, SEQ_Q, SEQ_K, CAUSAL), s, float("-inf"))
    if LEAN:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # max(c s) = c max(s) for c > 0
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        acc, l_i, m_new = _lazy_fold(acc, l_i, m_i, m_new, s, v, qk_scale, INPUT_PRECISION)
    else:
        if MASKED:
            # a row that has seen no visible key keeps m = -inf: shift by 0 so 2^-inf = 0, not NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # every score of an unmasked tile is finite, so the new max is too
            shift = m_new
        alpha = tl.math.exp2(m_i - shift)
        if LEAN:
            p = tl.math.exp2(s * qk_scale - shift[:, None])  # one fused multiply-add per score
        else:
            p = tl.math.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _lazy_fold(acc, l_i, m_i, m_new, s, v, qk_scale, INPUT_PRECISION: tl.constexpr):
    """Rung 5's step on an unmasked tile of raw scores s. acc and l_i may be kept relative to
    any reference m_i, not only the running max: the final out = acc / l_i and lse = m_i +
    log2(l_i) do not change. So the rescale, a multiply of every acc element, is skipped
    unless some row's max has grown by more than 8 (base 2) since its reference: terms
    2^(c s - m_i) then stay below 2^8 = 256, far from overflow. The test is one number for
    the whole block (a branch cannot differ between rows); when it passes, every row moves
    its reference to its own max, exactly as rung 4 does."""
    if tl.max(m_new - m_i, 0) > 8.0:  # the first tile always passes: m_i = -inf there
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.math.exp2(s * qk_scale - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = acc + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _load_rows(Ptr, stride, offs_rows, offs_d, n_rows, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """(rows, HEAD_DIM_PAD) tile; masks only what can be out of bounds."""
    ptrs = Ptr + offs_rows[:, None] * stride + offs_d[None, :]
    if MASK_ROWS:
        mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
        return tl.load(ptrs, mask=mask, other=0.0)
    if HEAD_DIM == HEAD_DIM_PAD:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _query_block(CAUSAL: tl.constexpr, LEAN: tl.constexpr):
    """This program's query block. Causal blocks further down see more keys; LEAN launches
    them first (longest job first), so the last wave of programs holds the short ones."""
    if LEAN and CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _finish(acc, l_i, m_i):
    """Deferred normalisation; a row that saw no key gets out = 0 and lse = -inf."""
    seen = l_i != 0  # only a row with no visible key has l_i == 0; NaN stays NaN
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) / _LOG2E, float("-inf"))
    return out, lse


@triton.jit
def _attn_fwd_split(Q, K, V, Out, Lse, qk_scale,
                    stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om,
                    SEQ_Q, SEQ_K,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    LEAN: tl.constexpr, LAZY: tl.constexpr = False):
    """As forward._attn_fwd, with the key loop split into an unmasked and a masked part
    (LEAN: rung 4's fold and launch order, see _fold_tile and _query_block; LAZY: rung 5's
    fold of the unmasked tiles, see _lazy_fold)."""
    start_m = _query_block(CAUSAL, LEAN)
    off_z = tl.program_id(1).to(tl.int64)
    Q += off_z * stride_qz
    K += off_z * stride_kz
    V += off_z * stride_vz
    Out += off_z * stride_oz
    Lse += off_z * SEQ_Q
    offs_m = start_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_rows(Q, stride_qm, offs_m, offs_d, SEQ_Q, HEAD_DIM, HEAD_DIM_PAD, True)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    full_end, hi = _key_ranges(start_m, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    for start_n in range(0, full_end, BLOCK_K):  # off-diagonal, in bounds: no masks
        offs_n = start_n + tl.arange(0, BLOCK_K)
        k = _load_rows(K, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, False)
        v = _load_rows(V, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, False)
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, k, v, offs_m, offs_n, qk_scale, SEQ_Q, SEQ_K,
                                   False, CAUSAL, INPUT_PRECISION, LEAN, LAZY)
    for start_n in range(full_end, hi, BLOCK_K):  # the diagonal and the last, ragged tile
        offs_n = start_n + tl.arange(0, BLOCK_K)
        k = _load_rows(K, stride_kn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, True)
        v = _load_rows(V, stride_vn, offs_n, offs_d, SEQ_K, HEAD_DIM, HEAD_DIM_PAD, True)
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, k, v, offs_m, offs_n, qk_scale, SEQ_Q, SEQ_K,
                                   True, CAUSAL, INPUT_PRECISION, LEAN)

    out, lse = _finish(acc, l_i, m_i)
    o_mask = (offs_m[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(Out + offs_m[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(Lse + offs_m, lse, mask=offs_m < SEQ_Q)


# ----- rung 3: tensor descriptors ---------------------------------------------------------

@triton.jit
def _attn_fwd_tma(Q, K, V, Out, Lse, qk_scale,
                  stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vn, stride_oz, stride_om,
                  SEQ_Q, SEQ_K,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  LEAN: tl.constexpr, LAZY: tl.constexpr = False):
    """Rung 2 with every tile moved by a descriptor of one (batch, head)'s (seq, HEAD_DIM)
    matrix: rows past seq and columns past HEAD_DIM arrive as zeros, stores are clipped."""
    start_m = _query_block(CAUSAL, LEAN)
    off_z = tl.program_id(1).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + off_z * stride_qz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    k_desc = tl.make_tensor_descriptor(K + off_z * stride_kz, shape=[SEQ_K, HEAD_DIM], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_K, HEAD_DIM_PAD])
    v_desc = tl.make_tensor_descriptor(V + off_z * stride_vz, shape=[SEQ_K, HEAD_DIM], strides=[stride_vn, 1],
                                       block_shape=[BLOCK_K, HEAD_DIM_PAD])
    o_desc = tl.make_tensor_descriptor(Out + off_z * stride_oz, shape=[SEQ_Q, HEAD_DIM], strides=[stride_om, 1],
                                       block_shape=[BLOCK_Q, HEAD_DIM_PAD])
    offs_m = start_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q = q_desc.load([start_m * BLOCK_Q, 0])

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], dtype=tl.float32)
    full_end, hi = _key_ranges(start_m, SEQ_Q, SEQ_K, BLOCK_Q, BLOCK_K, CAUSAL)
    for start_n in range(0, full_end, BLOCK_K):
        offs_n = start_n + tl.arange(0, BLOCK_K)
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, k_desc.load([start_n, 0]), v_desc.load([start_n, 0]),
                                   offs_m, offs_n, qk_scale, SEQ_Q, SEQ_K, False, CAUSAL, INPUT_PRECISION, LEAN,
                                   LAZY)
    for start_n in range(full_end, hi, BLOCK_K):
        offs_n = start_n + tl.arange(0, BLOCK_K)
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, k_desc.load([start_n, 0]), v_desc.load([start_n, 0]),
                                   offs_m, offs_n, qk_scale, SEQ_Q, SEQ_K, True, CAUSAL, INPUT_PRECISION, LEAN)

    out, lse = _finish(acc, l_i, m_i)
    o_desc.store([start_m * BLOCK_Q, 0], out.to(Out.dtype.element_ty))
    Lse += off_z * SEQ_Q
    tl.store(Lse + offs_m, lse, mask=offs_m < SEQ_Q)


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """A descriptor's base address and row strides must be multiples of 16 bytes, its last
    dim contiguous; checked on the (B*H, seq, d) views the kernels receive. Rows must not
    overlap either: an expanded tensor (a gradient of out.sum(), say) repeats one row with
    stride 0, which the pointer kernels read correctly and a descriptor need not."""
    def ok(t):
        size = t.element_size()
        return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(-2) >= t.shape[-1]
                and all(stride * size % 16 == 0 for stride in t.stride()[:-1]))
    return all(ok(t) for t in tensors)


def _tma_hardware(device: torch.device) -> bool:
    """The copy engine exists on sm_90 and newer; the interpreter emulates descriptors anywhere."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (9, 0)


_ALLOCATOR_SET = False


def _ensure_allocator():
    """Descriptors made inside a kernel live in a small global scratch buffer that Triton
    asks the caller to allocate; set once, on first use on a GPU (never at import)."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True


def _launch_split(kernel, q, k, v, out, lse, causal, scale, cfg, lean: bool = False, lazy: bool = False):
    """kernel with the tiles of cfg, or autotuned (GPU only) when cfg is None."""
    bh, seq_q, d = q.shape
    args = (q, k, v, out, lse, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), seq_q, k.shape[1])
    common = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), CAUSAL=causal, LEAN=lean, LAZY=lazy)
    if cfg is None:
        name = "lazy-rescale" if lazy else "lean" if lean else "tma"
        name = name if kernel is _attn_fwd_tma else ("causal-split" if name == "tma" else name + "-split")
        tuned = _tuner(name, kernel, seq_bucket(seq_q, k.shape[1]))
        tuned[lambda meta: (triton.cdiv(seq_q, meta["BLOCK_Q"]), bh)](*args, **common, INPUT_PRECISION="tf32")
        return
    kernel[(triton.cdiv(seq_q, cfg.block_q), bh)](
        *args, **common, BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k,
        INPUT_PRECISION=cfg.input_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


RUNGS = ("teaching", "autotuned", "causal-split", "tma", "lean", "lazy-rescale")


def forward(q, k, v, *, causal: bool = False, scale: float | None = None, rung: str = "tma",
            config: FlashConfig | None = None):
    """The forward of one rung: returns (out, lse), out like q, lse (..., seq_q) float32.

    Same contract as :func:`flashlib.kernels.flash_forward` (bottom-right causal diagonal,
    zeros and lse = -inf for rows that see no key). ``config`` fixes the tiles; by default
    rung "teaching" uses :func:`default_config` and the other rungs autotune on a GPU for
    16-bit inputs, keeping one choice per sequence bucket (:func:`seq_bucket`); float32
    inputs, and the interpreter, which cannot time kernels, use :func:`default_config` too.
    Rungs "tma" and "lean" run without descriptors where descriptors cannot be used: rows or
    addresses that are not multiples of 16 bytes (e.g. head_dim 59), or a GPU older than
    sm_90. Rungs "lean" and "lazy-rescale" run rung 3's fold when scale <= 0 (their max needs
    a positive scale).
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
    out = torch.empty_like(qf)
    lse = torch.empty(qf.shape[0], seq_q, dtype=torch.float32, device=q.device)
    tuned = None if autotunes(q.dtype, config) else fixed  # None: autotune
    if rung == "teaching":
        _launch_teaching(qf, kf, vf, out, lse, causal, scale, fixed)
    elif rung == "autotuned":
        _launch_teaching(qf, kf, vf, out, lse, causal, scale, tuned)
    elif rung == "causal-split":
        _launch_split(_attn_fwd_split, qf, kf, vf, out, lse, causal, scale, tuned)
    else:
        lean = rung in ("lean", "lazy-rescale") and scale > 0
        lazy = rung == "lazy-rescale" and scale > 0
        kernel = _attn_fwd_tma if tma_eligible(qf, kf, vf) and _tma_hardware(q.device) else _attn_fwd_split
        if kernel is _attn_fwd_tma and q.device.type == "cuda":
            _ensure_allocator()
        _launch_split(kernel, qf, kf, vf, out, lse, causal, scale, tuned, lean, lazy)
    return out.reshape(q.shape), lse.reshape(*lead, seq_q)
