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
from . import own_code
from .attention_cases import Case, backward_problem, expected_backward, forward_problem
from .common import Problem, Report, error_text, first_failure
from .harness import lab_attn_bwd_dkdv, lab_attn_fwd, triton
from .memory import AccessWatch, guarded
from ..course.remote import beside_answer

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
    (more than the head dim's padding, so that the row stride is never HEAD_DIM), a different number for
    each tensor, so that no two share a row stride and a tile read with another's stride is seen."""
    device = "cpu" if interpreting() else "cuda"
    guard, pad = max(case.block_q, case.block_k), head_dim_pad(case.head_dim) - case.head_dim + 1
    return {name: guarded(name, t.to(device), guard, pad + _EXTRA.get(name, 0), fill if name in _INPUTS else NAN)
            for name, t in tensors.items()}


_INPUTS = ("Q", "K", "V", "DO", "Lse", "Delta")
_EXTRA = {"Q": 1, "K": 0, "V": 3, "DO": 5, "Out": 2, "DK": 4, "DV": 6}  # extra columns: every row stride differs
# the loop's argument for each tensor's row stride
_STRIDES = {"K": "stride_kn", "V": "stride_vn", "Q": "stride_qm", "DO": "stride_dom"}


# what the interpreter or the compiler says, and the mistake it means
_ERRORS = (("Both operands must be same dtype", "missing_cast"),
           ("are not compatible for matmul", "dot_shapes"),
           ("must have equal reduction dimensions", "dot_shapes"),
           ("name 'inf' is not defined", "bare_inf"))


def _raised(error) -> Problem:
    text = error_text(error)
    mistake = next((key for clue, key in _ERRORS if clue in text), None)
    return Problem(f"the kernel raised {text}", mistake)


def _launch(launch, tensors: dict, outputs, case: Case, strides: dict) -> tuple[Problem | None, dict]:
    """Run ``launch()`` watching memory and what runs; a stray access, an exception or a written guard becomes
    a Problem. Also how many loads touched each tensor (in the interpreter; empty compiled)."""
    watch = AccessWatch(tensors.values(), strides) if interpreting() else None
    with own_code.Ran() as ran:
        problem = _watched(launch, watch)
    ran.refuse()
    if problem is not None:
        return problem, {}
    for name in outputs:
        if not tensors[name].guards_intact(NAN):
            return Problem(f"something was stored outside {name}.", "store_outside"), {}
    if watch is not None and watch.float32_dots - {_PRECISION}:
        asked = ", ".join(sorted(watch.float32_dots - {_PRECISION}))
        return Problem(f"a tl.dot of float32 tiles ran with input_precision {asked!r}, not INPUT_PRECISION "
                       f"({_PRECISION!r} here).", "no_input_precision"), {}
    return None, dict(watch.loads) if watch is not None else {}


def _watched(launch, watch) -> Problem | None:
    try:
        # the interpreter computes with numpy, which warns where a GPU silently gives inf (masked off later)
        with np.errstate(over="ignore", invalid="ignore"):
            if watch is None:
                launch()
            else:
                with watch:
                    launch()
    except Exception as error:  # the learner's kernel: report, never raise
        if watch is not None and watch.wrong_stride is not None:
            return Problem(watch.wrong_stride, "wrong_stride")
        if watch is not None and watch.violation is not None:
            op, name, side = watch.violation
            if op == "load":
                return Problem(f"a tl.load read {name} {side}.", "masked_loads_missing")
            return Problem(f"a tl.store wrote {name} {side}.", "store_outside")
        return _raised(error)
    return None


_PRECISION = "ieee"  # what the labs pass as INPUT_PRECISION: exact float32 products on a GPU too


def _sizes(case: Case):
    return dict(HEAD_DIM_PAD=head_dim_pad(case.head_dim), BLOCK_Q=case.block_q, BLOCK_K=case.block_k,
                CAUSAL=case.causal, INPUT_PRECISION=_PRECISION)


def _strides(*views):
    return [s for v in views for s in v.stride()[:2]]


@beside_answer
def _run_forward(fn, case: Case, fill: float):
    """((out, lse) of the harness with ``fn`` as its loop, or the Problem that stopped it; the loads per
    tensor). Run where ``fn`` is: in the student's process while a class is graded."""
    q, k, v, _ = case.inputs()
    bh = case.batch * case.heads
    t = _layout(case, {"Q": _flat(q), "K": _flat(k), "V": _flat(v), "Out": torch.empty_like(_flat(q)),
                       "Lse": torch.empty(bh, case.seq_q)}, fill)
    views = [t[name].view for name in ("Q", "K", "V", "Out", "Lse")]

    def launch():
        lab_attn_fwd[(triton.cdiv(case.seq_q, case.block_q), bh)](
            *views, case.scale * LOG2E, *_strides(*views[:4]), views[4].stride(0), case.seq_q, case.seq_k,
            case.head_dim, **_sizes(case), INNER=fn)

    problem, counts = _launch(launch, t, ("Out", "Lse"), case, {n: _STRIDES[n] for n in ("K", "V")})
    if problem is not None:
        return problem, counts
    return (views[3].reshape(q.shape).double().cpu(), views[4].reshape(q.shape[:-1]).double().cpu()), counts


def _forward_case(fn, case: Case, fill: float):
    got, counts = _run_forward(fn, case, fill)
    if isinstance(got, Problem):
        return got, False

    def probe(other: Case):
        again, _ = _run_forward(fn, other, NAN)
        return None if isinstance(again, Problem) else again

    q, k, v, _ = case.inputs()
    problem = forward_problem(case, q, k, v, got, kernel=True, probe=probe)
    if problem is None and counts:
        problem = _tiles_problem(case, counts.get("K", 0), forward=True)
    return problem, bool(got[0].isnan().any())


def _tiles_needed(case: Case, forward: bool) -> tuple[int, int]:
    """(tiles the loop must load, tiles there are) over every program of the case: the forward's key tiles
    before k_end (_key_range_end), or the dK/dV kernel's query blocks from q_start on (_query_range_start)."""
    lead = case.batch * case.heads
    if forward:
        ends = [case.seq_k if not case.causal else min(max(q0 + case.block_q + case.seq_k - case.seq_q, 0), case.seq_k)
                for q0 in range(0, case.seq_q, case.block_q)]
        return lead * sum(-(-e // case.block_k) for e in ends), lead * len(ends) * -(-case.seq_k // case.block_k)
    starts = [0 if not case.causal else max(k0 - (case.seq_k - case.seq_q), 0) // case.block_q * case.block_q
              for k0 in range(0, case.seq_k, case.block_k)]
    needed = sum(-(-(case.seq_q - s) // case.block_q) for s in starts)
    return lead * needed, lead * len(starts) * -(-case.seq_q // case.block_q)


def _tiles_problem(case: Case, loaded: int, forward: bool) -> Problem | None:
    """A right result from more tiles than the loop needs: causal tiles that should have been skipped."""
    needed, every = _tiles_needed(case, forward)
    if loaded <= needed:
        return None
    tensor, tiles, bound = ("K", "key tiles", "k_end") if forward else ("Q", "query blocks", "q_start")
    what = (f"the result is right, but the loop loaded {loaded} tiles of {tensor} where {needed} are needed "
            f"({tiles} over every program).")
    if case.causal and loaded > needed and loaded % every == 0:
        return Problem(what, "causal_tiles_not_skipped",
                       f"the loop ran over every one of the {tiles}, not only those the kernel's {bound} leaves it: "
                       f"the tiles past the diagonal hold no pair that may attend, so the mask gives the right "
                       f"output from work whose every result is thrown away. Loop over the range the kernel hands "
                       f"you ({bound}).")
    return Problem(what + f" Load each of the {tiles} once, and only those the kernel's {bound} leaves the loop.")


@beside_answer
def _run_dkdv(fn, case: Case, fill: float):
    """({"dk", "dv"} of the harness with ``fn`` as its loop (dk scaled, as the kernel stores it), or the Problem
    that stopped it; the loads per tensor). Run where ``fn`` is."""
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

    problem, counts = _launch(launch, t, ("DK", "DV"), case, {n: _STRIDES[n] for n in ("Q", "DO")})
    if problem is not None:
        return problem, counts
    return {"dk": views[4].reshape(k.shape).double().cpu(), "dv": views[5].reshape(v.shape).double().cpu()}, counts


def _dkdv_case(fn, case: Case, fill: float):
    got, counts = _run_dkdv(fn, case, fill)
    if isinstance(got, Problem):
        return got, False

    def probe(other: Case):
        again, _ = _run_dkdv(fn, other, NAN)
        return None if isinstance(again, Problem) else again

    problem = backward_problem(case, case.inputs(), got, kernel=True, probe=probe)
    if problem is None and counts:
        problem = _tiles_problem(case, counts.get("Q", 0), forward=False)
    return problem, any(g.isnan().any() for g in got.values())


def _run_case(run, fn, case: Case) -> Problem | None:
    problem, saw_nan = run(fn, case, NAN)
    if problem is not None and saw_nan and not interpreting():
        # compiled on a GPU there is no watch on addresses: NaN that goes away when the guards hold 0
        # instead was read from them
        _, saw_nan_again = run(fn, case, 0.0)
        if not saw_nan_again:
            return Problem("NaN from the guard regions around the inputs reached the result.", "masked_loads_missing")
    return problem


@beside_answer
def _kind(fn) -> tuple[bool, str]:
    """(whether ``fn`` is a @triton.jit function, its type's name), where ``fn`` is."""
    return isinstance(fn, triton.runtime.jit.KernelInterface), type(fn).__name__


def _check(fn, run) -> Report:
    jit, kind = _kind(fn)
    if not jit:
        return Report(len(CASES), 1, CASES[0].describe(),
                      Problem(f"expected a @triton.jit function; got {kind}. Put @triton.jit on the line "
                              "above def."))
    return first_failure(CASES, lambda case: _run_case(run, fn, case))


def check_attn_fwd_inner(fn) -> Report:
    return _check(fn, _forward_case)


def check_attn_bwd_dkdv_inner(fn) -> Report:
    return _check(fn, _dkdv_case)
