"""What a checker watches while the learner's function runs: the tensors it creates, the blocks it reads.

``TensorWatch`` is a ``TorchDispatchMode``: every PyTorch operation inside it passes through
``__torch_dispatch__``, so the shape of every tensor created (views included) is seen, whatever
function created it. That is how a checker knows a full (seq_q, seq_k) score matrix was held. It also
keeps the shape of every floating tensor an operation computed with, read or written, leaving out views
and copies: how a checker knows a product spanned more keys than one split holds.
``Stream`` hands out the blocks of a row one at a time and wipes each block once the next is
asked for, as a buffer that is reused would: a solution that keeps blocks around sees NaN.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# operations that only copy a tensor: what they touch is not computed with
_COPIES = frozenset({"clone", "_to_copy", "copy_", "detach", "lift_fresh", "lift_fresh_copy"})


class TensorWatch(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an operation returns, and the names of the operations."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.ops: set[str] = set()
        self.operands: list[tuple[str, tuple[int, ...]]] = []  # (operation, shape): see computed_with

    def __enter__(self):
        # Nothing compiles while watched: compiled code would hide its operations from the watch, and dynamo
        # tracing under a dispatch mode leaves its cache broken for the rest of the process (a learner's call
        # of flex_attention, which compiles itself, then made every later flex_attention fail).
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._eager.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__)
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self.created.append((tuple(t.shape), t.dtype))
        name = func.__name__.split(".")[0]
        if name not in _COPIES and not any(r.alias_info is not None for r in func._schema.returns):
            for t in tree_leaves((args, kwargs, result)):  # not a view, not in place: an operation's own work
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                    self.operands.append((name, tuple(t.shape)))
        return result

    def full_matrix(self, rows: int, cols: int):
        """The first floating tensor created whose last two dims are (rows, cols) or (cols, rows)."""
        for shape, dtype in self.created:
            if len(shape) >= 2 and dtype.is_floating_point and set(shape[-2:]) == {rows, cols} \
                    and (rows != cols or shape[-2:] == (rows, cols)):
                return shape
        return None

    def full_width(self, width: int):
        """The first floating tensor created whose last dim is ``width`` (a whole row of blocks)."""
        for shape, dtype in self.created:
            if shape and dtype.is_floating_point and shape[-1] == width:
                return shape
        return None

    def computed_with(self, sizes):
        """(operation, shape) of the first floating tensor with a dim in ``sizes`` that an operation read or
        wrote, views (slices, transposes) and copies left out; None if there is none."""
        for name, shape in self.operands:
            if any(n in sizes for n in shape):
                return name, shape
        return None

    def fused_attention(self) -> bool:
        """Whether PyTorch's own fused attention (scaled_dot_product_attention) was called."""
        return any("scaled_dot_product" in op for op in self.ops)


class Stream:
    """An iterator over blocks that can be read once, left to right.

    Once block j + 1 is asked for, block j is filled with NaN (``wipe=True``): its memory is
    reused. ``reads_after_end`` counts the times the learner asked for more after the last block.
    """

    def __init__(self, blocks, *, wipe: bool = True):
        self._blocks = [b.clone() for b in blocks]
        self._next = 0
        self._wipe = wipe
        self.reads_after_end = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._wipe and self._next > 0:
            self._blocks[self._next - 1].fill_(float("nan"))
        if self._next == len(self._blocks):
            self.reads_after_end += 1
            raise StopIteration
        self._next += 1
        return self._blocks[self._next - 1]
