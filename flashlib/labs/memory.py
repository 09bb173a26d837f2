"""Guard regions around a Triton lab's tensors, and a watch on every address its kernel touches.

Each tensor a lab's kernel gets is placed inside a larger buffer: ``guard_rows`` rows of a
sentinel above and below every (batch * head) slice, and ``pad`` columns of it to the right of
every row, so that a tile loaded without its mask reads the sentinel (NaN for inputs) instead of
a neighbour's data, and a store without its mask lands where it can be seen.

In Triton's interpreter every ``tl.load``, ``tl.store`` and ``tl.dot`` goes through a method of
its builder; :class:`AccessWatch` wraps them while a lab runs and checks each address whose mask
is on against the tensors: the first one outside them (in a guard, or in no tensor at all) stops
the kernel before it is read, and is reported by tensor and side. It also records the precision
each float32 ``tl.dot`` asked for, which the interpreter itself ignores (it multiplies in exact
float32) but a GPU does not. Compiled on a GPU there is no such hook; the guards' sentinel still
shows a load or store that strayed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Guarded:
    """``view``, the tensor the kernel gets, (z, rows[, cols]), lives inside ``buffer`` with its guards."""

    name: str
    buffer: torch.Tensor
    view: torch.Tensor
    guard_rows: int

    def _position(self, index):
        """(row, column) inside the tensor of buffer element(s) ``index``; rows < 0 are above it."""
        cols = self.buffer.shape[2] if self.buffer.dim() == 3 else 1
        return index // cols % self.buffer.shape[1] - self.guard_rows, index % cols

    def first_outside(self, index: np.ndarray) -> str | None:
        """Where the first of the buffer elements ``index`` that is not in the tensor lies, or None."""
        row, col = self._position(index)
        outside = (row < 0) | (row >= self.view.shape[1])
        if self.buffer.dim() == 3:
            outside |= col >= self.view.shape[2]
        if not outside.any():
            return None
        row, col = int(row[outside][0]), int(col[outside][0])
        if row < 0:
            return f"above its first row (row {row})"
        if row >= self.view.shape[1]:
            return f"past its last row (row {row} >= {self.view.shape[1]})"
        return f"past its last column (column {col} >= HEAD_DIM = {self.view.shape[2]})"

    def guards_intact(self, fill: float) -> bool:
        """Whether every guard element still holds ``fill`` (a store outside the tensor changes one)."""
        outside = torch.ones_like(self.buffer, dtype=torch.bool)
        rows = slice(self.guard_rows, self.guard_rows + self.view.shape[1])
        if self.buffer.dim() == 3:
            outside[:, rows, :self.view.shape[2]] = False
        else:
            outside[:, rows] = False
        kept = self.buffer[outside]
        return bool(kept.isnan().all() if fill != fill else (kept == fill).all())


def guarded(name: str, t: torch.Tensor, guard_rows: int, pad: int, fill: float = float("nan")) -> Guarded:
    """``t`` (z, rows, cols) or (z, rows) copied into a buffer with guards of ``fill`` around it."""
    if t.dim() == 3:
        z, rows, cols = t.shape
        buffer = torch.full((z, rows + 2 * guard_rows, cols + pad), fill, dtype=t.dtype, device=t.device)
        view = buffer[:, guard_rows:guard_rows + rows, :cols]
    else:
        z, rows = t.shape
        buffer = torch.full((z, rows + 2 * guard_rows), fill, dtype=t.dtype, device=t.device)
        view = buffer[:, guard_rows:guard_rows + rows]
    view.copy_(t)
    return Guarded(name, buffer, view, guard_rows)


class OutOfBounds(Exception):
    """Raised inside the interpreted kernel at the first access outside every tensor."""


class AccessWatch:
    """While active, checks every masked-on address of every tl.load and tl.store (interpreter only).

    It also counts the loads that touch each tensor (``loads``: how many tiles a loop read), and
    checks that a 2-D tile is read with its own tensor's row stride: ``strides`` maps a tensor's name
    to the argument that holds its stride (``{"K": "stride_kn", ...}``), so a tile of V read with K's
    stride is named as such rather than as a load that strayed.
    """

    def __init__(self, tensors, strides: dict[str, str] | None = None):
        self.tensors = list(tensors)
        self.strides = strides or {}
        self.violation: tuple[str, str, str] | None = None  # (load or store, tensor name, side)
        self.wrong_stride: str | None = None  # what the first tile read with another stride was
        self.float32_dots: set[str] = set()  # the input precisions float32 tl.dot calls asked for: "ieee", "tf32"
        self.loads: dict[str, int] = {}
        self._saved = None

    def __enter__(self):
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        self._saved = (builder, builder.create_masked_load, builder.create_masked_store, builder.create_dot)
        load, store, dot = self._saved[1:]
        watch = self

        def create_masked_load(self, ptrs, mask, *args):
            watch.check("load", ptrs.data, mask.data)
            return load(self, ptrs, mask, *args)

        def create_masked_store(self, ptrs, value, mask, *args):
            watch.check("store", ptrs.data, mask.data)
            return store(self, ptrs, value, mask, *args)

        def create_dot(self, a, b, d, input_precision, *args):
            if a.dtype.name == "fp32" and b.dtype.name == "fp32":
                watch.float32_dots.add(str(input_precision).rsplit(".", 1)[-1].lower())
            return dot(self, a, b, d, input_precision, *args)

        builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
        builder.create_dot = create_dot
        return self

    def __exit__(self, *exc):
        builder, builder.create_masked_load, builder.create_masked_store, builder.create_dot = self._saved
        return False

    def check(self, op: str, addresses, mask) -> None:
        tile = np.broadcast_to(np.asarray(addresses), np.shape(mask)).astype(np.int64)
        addresses = tile[np.asarray(mask, dtype=bool)].ravel()
        known = np.zeros(addresses.shape, dtype=bool)
        for t in self.tensors:
            base, size = t.buffer.data_ptr(), t.buffer.element_size()
            inside = (addresses >= base) & (addresses < base + t.buffer.numel() * size)
            if op == "load" and inside.any():
                self.loads[t.name] = self.loads.get(t.name, 0) + 1
                self._check_stride(t, tile)
            known |= inside
            side = t.first_outside((addresses[inside] - base) // size)
            if side is not None:
                self._stop(op, t.name, side)
        if not known.all():
            self._stop(op, "no tensor", "at an address outside every tensor the kernel was given")

    def _check_stride(self, t: Guarded, tile: np.ndarray) -> None:
        """Stop at a 2-D tile of ``t`` whose rows are not ``t``'s row stride apart (its columns 1 apart)."""
        if tile.ndim != 2 or min(tile.shape) < 2 or t.view.dim() != 3 or t.name not in self.strides:
            return
        size = t.buffer.element_size()
        steps = {int(tile[1, 0] - tile[0, 0]) // size, int(tile[0, 1] - tile[0, 0]) // size}
        own = t.view.stride(1)
        if 1 not in steps or steps == {1, own}:
            return  # a tile of another shape (or gathered rows) is for the values to judge
        step = max(steps - {1})
        other = next((n for n in self.tensors if n.name != t.name and n.name in self.strides
                      and n.view.stride(1) == step), None)
        whose = f": that is {other.name}'s, {self.strides[other.name]}" if other is not None else ""
        self.wrong_stride = (f"a tl.load read a tile of {t.name} with its rows {step} elements apart, but {t.name}'s "
                             f"rows are {own} apart ({self.strides[t.name]}){whose}.")
        self._stop("load", t.name, "with another tensor's row stride")

    def _stop(self, op, name, side):
        self.violation = (op, name, side)
        raise OutOfBounds(f"{op} {name} {side}")
