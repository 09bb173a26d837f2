"""Labs: the learner writes FlashAttention piece by piece, and a checker says what is wrong.

    check(name, fn)        run fn over the lab's cases; print and return a LabResult whose bool() is
                           the verdict (.passed, .message, .mistake: the known mistake recognised)
    hint(name)             print the next of three hints, from gentle to nearly the answer
    solution(name)         print a worked solution; solution_source(name) returns its text
    LABS, MISTAKES         the labs in course order, and the mistakes the checkers name

The labs, each at the end of its notebook:

    online_softmax(blocks) -> (m, l)                                          02
    merge_states(m_a, l_a, m_b, l_b) -> (m, l)                                02
    tiled_forward(q, k, v, block_q, block_k, causal) -> (out, lse)            03
    tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal)         04
    attn_fwd_inner(...)        the forward kernel's loop over key tiles       06 (Triton)
    attn_bwd_dkdv_inner(...)   the dK/dV kernel's loop over query blocks      07 (Triton)

Expected results come from the definitions in float64 (:mod:`.reference`), never from the
course's own implementation of the same step. The Triton labs run inside a harness kernel
(:mod:`.harness`) through Triton's interpreter, with every tensor inside guard regions and
every load checked against the tensor it belongs to (:mod:`.memory`).
"""
from .catalog import LABS, MISTAKES, Lab
from .core import LabResult, check, hint, reset_hints, solution, solution_source

__all__ = ["LABS", "MISTAKES", "Lab", "LabResult", "check", "hint", "reset_hints", "solution", "solution_source"]
