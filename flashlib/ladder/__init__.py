"""The optimisation ladder: faster forwards and backwards, one change per rung (notebook 08).

    rungs      the table: every forward rung and backward, what each changes and why, its
               kernels and its candidate tiles (imports neither Triton nor a GPU)
    forward    the forward kernels and their folds; backward, the backward kernels
    autotune   the one autotuner both use: the table's candidates, one choice per length bucket
    function   any forward with any backward behind one autograd Function
    compile    every kernel of the table compiled for GPU targets without a GPU

:func:`attention` runs any forward rung with any backward, for the benchmark and for readers
who want to compare them; ``flashlib.flash_attention`` runs the fastest measured combination
without asking. The kernels are imported on first use.
"""
from __future__ import annotations

__all__ = ["attention"]


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, forward: str = "tma",
              backward: str = "tuned", config=None, return_lse: bool = False):
    """softmax(q kᵀ · scale) v with one forward rung and one backward of the ladder; differentiable.

    Same conventions as :func:`flashlib.kernels.attention` (q (batch, heads, seq_q, head_dim),
    k, v (batch, heads, seq_k, head_dim), bottom-right causal diagonal, zeros and lse = -inf
    for rows that see no key). ``forward`` names a rung of :data:`flashlib.ladder.rungs.LADDER`,
    ``backward`` one of :data:`flashlib.ladder.rungs.BACKWARDS`; ``config`` (a
    :class:`flashlib.kernels.FlashConfig`) fixes the tiles, otherwise they are autotuned on a
    GPU for 16-bit inputs and the shipped ones are used elsewhere.
    """
    from .function import attention as run

    return run(q, k, v, causal=causal, scale=scale, forward=forward, backward=backward, config=config,
               return_lse=return_lse)
