"""Checkers of notebooks 06 and 07's Triton labs: the learner's loop run inside the course's kernel.

The learner's ``@triton.jit`` loop is passed to a harness kernel (:mod:`.harness`) as its INNER
loop and launched over the cases below, through Triton's interpreter on a CPU (compiled on a
GPU). Every tensor sits inside guard regions (:mod:`.memory`); in the interpreter every load and
store is checked against them, so a missing mask is named with the tensor and the side it
strayed past, and every float32 ``tl.dot`` must have asked for INPUT_PRECISION (the interpreter
ignores it; a GPU would multiply in tf32). The last case's inputs are float16, so that a product
of a float32 tile with a float16 one, which no GPU compiles, is named too. Results are then read
as in the PyTorch labs (:mod:`.attention_cases`); what the interpreter or the compiler raises is
matched against the mistakes it means (``_ERRORS``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels._mode import interpreting
from ..kernels.config import LOG2E, head_dim_pad
from .attention_cases import Case, backward_problem, expected_backward, forward_problem
from .common import Problem, Report, error_text, first_failure
from .harness import lab_attn_bwd_dkdv, lab_attn_fwd, triton
from .memory import AccessWatch, guarded

NAN = float("nan")


@dataclass(frozen=True)
class KernelCase(Case):
    def describe(self) -> str:
        b, h, d = self.batch, self.heads, self.head_dim
        text = (f"Q {(b, h, self.seq_q, d)}, K and V {(b, h, self.seq_k, d)}, BLOCK_Q={self.block_q}, "
                f"BLOCK_K={self.block_k}, HEAD_DIM={d}, CAUSAL={self.causal}")
        if self.dtype != torch.float32:
            text += f", {str(self.dtype).removeprefix('torch.')} inputs"
        return text + (", scores in the hundreds" if self.large else "")


# Head dims pad to 32 or 64, never a block size: a tl.dot missing its transpose has shapes that do not fit.
CASES = (
    KernelCase(1, 2, 37, 45, 24, 16, 16, False, seed=0),              # uneven lengths; head dim 24 padded to 32
    KernelCase(1, 2, 37, 45, 40, 16, 32, True, seed=2),               # head dim 40 padded to 64; causal
    KernelCase(1, 2, 45, 37, 24, 16, 16, True, seed=3),               # rows 0..7 see no key
    KernelCase(1, 2, 33, 41, 20, 16, 16, False, large=True, seed=4),  # scores in the hundreds
    KernelCase(1, 2, 37, 45, 24, 16, 16, True, seed=5, dtype=torch.float16),  # tl.dot's operands must match
)


def _flat(t):
    return t.reshape(-1, *t.shape[2:])  # (batch, heads, seq[, d]) -> (batch * heads, seq[, d])


def _layout(case: Case, tensors: dict, fill: float) -> dict:
    """Each tensor inside guards: a tile's worth of rows above and below, and padded columns to the right
    (one more than the head dim's padding, so that the row stride is never HEAD_DIM)."""
    device = "cpu" if interpreting() else "cuda"
    guard, pad = max(case.block_q, case.block_k), head_dim_pad(case.head_dim) - case.head_dim + 1
    return {name: guarded(name, t.to(device), guard, pad, fill if name in _INPUTS else NAN)
            for name, t in tensors.items()}


_INPUTS = ("Q", "K", "V", "DO", "Lse", "Delta")


# what the interpreter or the compiler says, and the mistake it means
_ERRORS = (("Both operands must be same dtype", "missing_cast"),
           ("are not compatible for matmul", "dot_shapes"),
           ("must have equal reduction dimensions", "dot_shapes"),
           ("name 'inf' is not defined", "bare_inf"))


def _raised(error) -> Problem:
    text = error_text(error)
    mistake = next((key for clue, key in _ERRORS if clue in text), None)
    return Problem(f"the kernel raised {text}", mistake)


def _launch(launch, tensors: dict, outputs, case: Case) -> Problem | None:
    """Run ``launch()`` watching memory; a stray access, an exception or a written guard becomes a Problem."""
    watch = AccessWatch(tensors.values()) if interpreting() else None
    try:
        # the interpreter computes with numpy, which warns where a GPU silently gives inf (masked off later)
        with np.errstate(over="ignore", invalid="ignore"):
            if watch is None:
                launch()
            else:
                with watch:
                    launch()
    except Exception as error:  # the learner's kernel: report, never raise
        if watch is not None and watch.violation is not None:
            op, name, side = watch.violation
            if op == "load":
                return Problem(f"a tl.load read {name} {side}.", "masked_loads_missing")
            return Problem(f"a tl.store wrote {name} {side}.", "store_outside")
        return _raised(error)
    for name in outputs:
        if not tensors[name].guards_intact(NAN):
            return Problem(f"something was stored outside {name}.", "store_outside")
    if watch is not None and watch.float32_dots - {_PRECISION}:
        asked = ", ".join(sorted(watch.float32_dots - {_PRECISION}))
        return Problem(f"a tl.dot of float32 tiles ran with input_precision {asked!r}, not INPUT_PRECISION "
                       f"({_PRECISION!r} here).", "no_input_precision")
    return None


_PRECISION = "ieee"  # what the labs pass as INPUT_PRECISION: exact float32 products on a GPU too


def _sizes(case: Case):
    return dict(HEAD_DIM_PAD=head_dim_pad(case.head_dim), BLOCK_Q=case.block_q, BLOCK_K=case.block_k,
                CAUSAL=case.causal, INPUT_PRECISION=_PRECISION)


def _strides(*views):
    return [s for v in views for s in v.stride()[:2]]


def _run_forward(fn, case: Case, fill: float):
    """(out, lse) of the harness with ``fn`` as its loop, or the Problem that stopped it."""
    q, k, v, _ = case.inputs()
    bh = case.batch * case.heads
    t = _layout(case, {"Q": _flat(q), "K": _flat(k), "V": _flat(v), "Out": torch.empty_like(_flat(q)),
                       "Lse": torch.empty(bh, case.seq_q)}, fill)
    views = [t[name].view for name in ("Q", "K", "V", "Out", "Lse")]

    def launch():
        lab_attn_fwd[(triton.cdiv(case.seq_q, case.block_q), bh)](
            *views, case.scale * LOG2E, *_strides(*views[:4]), views[4].stride(0), case.seq_q, case.seq_k,
            case.head_dim, **_sizes(case), INNER=fn)

    problem = _launch(launch, t, ("Out", "Lse"), case)
    if problem is not None:
        return problem
    return views[3].reshape(q.shape).double().cpu(), views[4].reshape(q.shape[:-1]).double().cpu()


def _forward_case(fn, case: Case, fill: float):
    got = _run_forward(fn, case, fill)
    if isinstance(got, Problem):
        return got, False

    def probe(other: Case):
        again = _run_forward(fn, other, NAN)
        return None if isinstance(again, Problem) else again

    q, k, v, _ = case.inputs()
    return forward_problem(case, q, k, v, got, kernel=True, probe=probe), bool(got[0].isnan().any())


def _dkdv_case(fn, case: Case, fill: float):
    q, k, v, dout = case.inputs()
    out, lse, _ = expected_backward(case, q, k, v, dout)
    bh = case.batch * case.heads
    t = _layout(case, {"Q": _flat(q), "K": _flat(k), "V": _flat(v), "DO": _flat(dout),
                       "DK": torch.empty_like(_flat(k)), "DV": torch.empty_like(_flat(v)), "Lse": _flat(lse),
                       "Delta": _flat((dout * out).sum(dim=-1))}, fill)
    views = [t[name].view for name in ("Q", "K", "V", "DO", "DK", "DV", "Lse", "Delta")]

    def launch():
        lab_attn_bwd_dkdv[(triton.cdiv(case.seq_k, case.block_k), bh)](
            *views, case.scale * LOG2E, case.scale, *_strides(*views[:6]), views[6].stride(0),
            case.seq_q, case.seq_k, case.head_dim, **_sizes(case), INNER=fn)

    problem = _launch(launch, t, ("DK", "DV"), case)
    if problem is not None:
        return problem, False
    got = {"dk": views[4].reshape(k.shape).double().cpu(), "dv": views[5].reshape(v.shape).double().cpu()}
    return backward_problem(case, (q, k, v, dout), got, kernel=True), any(g.isnan().any() for g in got.values())


def _run_case(run, fn, case: Case) -> Problem | None:
    problem, saw_nan = run(fn, case, NAN)
    if problem is not None and saw_nan and not interpreting():
        # compiled on a GPU there is no watch on addresses: NaN that goes away when the guards hold 0
        # instead was read from them
        _, saw_nan_again = run(fn, case, 0.0)
        if not saw_nan_again:
            return Problem("NaN from the guard regions around the inputs reached the result.", "masked_loads_missing")
    return problem


def _check(fn, run) -> Report:
    if not isinstance(fn, triton.runtime.jit.KernelInterface):
        return Report(len(CASES), 1, CASES[0].describe(),
                      Problem(f"expected a @triton.jit function; got {type(fn).__name__}. Put @triton.jit on the line "
                              "above def."))
    return first_failure(CASES, lambda case: _run_case(run, fn, case))


def check_attn_fwd_inner(fn) -> Report:
    return _check(fn, _forward_case)


def check_attn_bwd_dkdv_inner(fn) -> Report:
    return _check(fn, _dkdv_case)
