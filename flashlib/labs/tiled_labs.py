"""Checkers of notebooks 03 and 04's labs: ``tiled_forward`` and ``tiled_backward`` in PyTorch.

Every case runs the learner's function inside a :class:`~.watch.TensorWatch`: a floating tensor
of shape (..., seq_q, seq_k) created during the call means the full score (or probability)
matrix was held. The shapes are chosen so that no other tensor can have those two sizes:
seq_q and seq_k differ from each other, from the tile sizes, the head dim, batch and heads.
"""
from __future__ import annotations

from .attention_cases import Case, backward_problem, expected_backward, forward_problem
from .common import Problem, Report, call, first_failure, unpack

CASES = (
    Case(1, 2, 37, 45, 8, 16, 8, False, seed=0),              # uneven last tiles on both sides
    Case(1, 2, 45, 37, 8, 8, 16, False, seed=1),              # seq_q > seq_k
    Case(2, 1, 37, 45, 8, 16, 8, True, seed=2),               # causal, seq_q < seq_k: bottom-right matters
    Case(1, 2, 45, 37, 8, 16, 8, True, seed=3),               # rows 0..7 see no key, in a block with rows that do
    Case(1, 2, 33, 41, 8, 16, 16, False, large=True, seed=4),  # scores in the hundreds
    Case(1, 1, 41, 33, 8, 8, 16, True, large=True, seed=5),
)


def _held(run, case: Case) -> Problem | None:
    held = run.watch.full_matrix(case.seq_q, case.seq_k)
    if held is not None:
        return Problem(f"a tensor of shape {held} was created during the call: (seq_q, seq_k) = "
                       f"({case.seq_q}, {case.seq_k}), the whole score matrix.", "full_matrix")
    if run.watch.fused_attention():
        return Problem("PyTorch's scaled_dot_product_attention was called: this lab asks for the tiles written out.")
    return None


def _forward_case(fn, case: Case) -> Problem | None:
    q, k, v, _ = case.inputs()
    run = call(fn, "tiled_forward", q.clone(), k.clone(), v.clone(), case.block_q, case.block_k, case.causal)
    if run.error:
        return Problem(run.error)
    problem = _held(run, case)
    if problem is not None:
        return problem
    got = unpack(run.result, "tiled_forward", ("out", "lse"), (tuple(q.shape), tuple(q.shape[:-1])))
    return got if isinstance(got, Problem) else forward_problem(case, q, k, v, got, probe=lambda c: _probe(fn, c))


def _probe(fn, case: Case):
    """(out, lse) of the learner's function on a probe case, or None if it fails there."""
    q, k, v, _ = case.inputs()
    run = call(fn, "tiled_forward", q, k, v, case.block_q, case.block_k, case.causal, watch=False)
    if run.error:
        return None
    got = unpack(run.result, "tiled_forward", ("out", "lse"), (tuple(q.shape), tuple(q.shape[:-1])))
    return None if isinstance(got, Problem) else got


def check_tiled_forward(fn) -> Report:
    return first_failure(CASES, lambda case: _forward_case(fn, case))


def _backward_case(fn, case: Case) -> Problem | None:
    q, k, v, dout = case.inputs()
    out, lse, _ = expected_backward(case, q, k, v, dout)
    run = call(fn, "tiled_backward", *(t.clone() for t in (q, k, v, out, lse, dout)),
               case.block_q, case.block_k, case.causal)
    if run.error:
        return Problem(run.error)
    problem = _held(run, case)
    if problem is not None:
        return problem
    got = unpack(run.result, "tiled_backward", ("dq", "dk", "dv"), (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if isinstance(got, Problem):
        return got
    return backward_problem(case, (q, k, v, dout), dict(zip(("dq", "dk", "dv"), got)),
                            probe=lambda c: _probe_backward(fn, c))


def _probe_backward(fn, case: Case):
    """{"dq", "dk", "dv"} of the learner's function on a probe case, or None if it fails there."""
    q, k, v, dout = case.inputs()
    out, lse, _ = expected_backward(case, q, k, v, dout)
    run = call(fn, "tiled_backward", q, k, v, out, lse, dout, case.block_q, case.block_k, case.causal, watch=False)
    if run.error:
        return None
    got = unpack(run.result, "tiled_backward", ("dq", "dk", "dv"), (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    return None if isinstance(got, Problem) else dict(zip(("dq", "dk", "dv"), got))


def check_tiled_backward(fn) -> Report:
    return first_failure(CASES, lambda case: _backward_case(fn, case))
