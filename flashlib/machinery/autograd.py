"""What the autograd Functions save: tensors only.

An option that is absent (no attention sinks) saves nothing rather than a None, so that
``out.grad_fn.saved_tensors`` holds tensors alone: tools and courses' tests look through it (for
the one (batch, heads, seq_q) tensor that is the log-sum-exp, say) and a None breaks them.
"""
from __future__ import annotations


def save(ctx, *tensors) -> None:
    """ctx.save_for_backward of the tensors that are not None; :func:`saved` puts the Nones back."""
    ctx.flashlib_present = tuple(t is not None for t in tensors)
    ctx.save_for_backward(*(t for t in tensors if t is not None))


def saved(ctx) -> tuple:
    """The tensors given to :func:`save`, in order, None where None was given."""
    stored = iter(ctx.saved_tensors)
    return tuple(next(stored) if present else None for present in ctx.flashlib_present)
