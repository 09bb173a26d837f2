"""Labs: the learner writes FlashAttention piece by piece, and a checker says what is wrong.

    check(name, fn)        run fn over the lab's cases; print and return a LabResult whose bool() is
                           the verdict (.passed, .message, .mistake: the known mistake recognised)
    hint(name)             print the next of three hints, from gentle to nearly the answer
    solution(name)         print a worked solution; solution_source(name) returns its text
    reveal(name)           print the course's own code of the lab, once it has passed here
    yours(name)            print the function written in the lab's cell, from its notebook saved beside this one
    progress()             print which labs this student has passed (kept beside the notebooks)
    LABS, MISTAKES         the labs in course order, and the mistakes the checkers name
    LOG2E                  log2 e as a Triton constant, for a kernel lab's @triton.jit code (needs Triton)

The labs, each at the end of its notebook:

    online_softmax(blocks) -> (m, l)                                          02
    merge_states(m_a, l_a, m_b, l_b) -> (m, l)                                02
    tiled_forward(q, k, v, block_q, block_k, causal) -> (out, lse)            03
    tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal)         04
    attn_fwd_inner(...)        the forward kernel's loop over key tiles       06 (Triton)
    attn_bwd_dkdv_inner(...)   the dK/dV kernel's loop over query blocks      07 (Triton)
    split_kv(q, k, v, num_splits) -> out    one query's attention over splits, merged     10
    sink_grad(sinks, lse, delta) -> dsinks  the gradient of attention sinks            12

The student edition (``make student``) has no worked solutions: ``solution`` and ``reveal`` say so.
The grader, ``python -m flashlib labs grade PATH...`` (:mod:`.grade`), runs every lab and checked
exercise cell of a class's saved notebooks, each in a sandboxed process of its own (:mod:`.zygote`,
:mod:`.sandbox`), while the checkers run in the grader's own process (:mod:`.judge`), which owns the
verdicts and writes the gradebook (:mod:`.gradebook`).

Expected results come from the definitions in float64 (:mod:`.reference`), never from the
course's own implementation of the same step. The Triton labs run inside a harness kernel
(:mod:`.harness`) through Triton's interpreter, with every tensor inside guard regions and
every load checked against the tensor it belongs to (:mod:`.memory`).
"""
from ..kernels._mode import ensure_mode, triton_installed
from .catalog import LABS, MISTAKES, Lab
from .cells import yours
from .core import (LabResult, check, has_solutions, hint, reset_hints, reveal, reveal_source, solution,
                   solution_source)
from .progress_file import progress

if triton_installed():
    # a kernel lab's cell imports flashlib, then triton: without a GPU, Triton's CPU interpreter must be on
    # before triton is first imported (it reads TRITON_INTERPRET then), whatever build of PyTorch this is
    ensure_mode()

__all__ = ["LABS", "MISTAKES", "Lab", "LabResult", "check", "has_solutions", "hint", "progress", "reset_hints",
           "reveal", "reveal_source", "solution", "solution_source", "yours"]


def __getattr__(name):
    if name == "LOG2E":  # a Triton constant: asking for it imports Triton, in the mode chosen above
        from ..kernels._mode import require_triton
        from ..kernels.config import LOG2E

        return require_triton().language.constexpr(LOG2E)
    raise AttributeError(f"module 'flashlib.labs' has no attribute {name!r}")
