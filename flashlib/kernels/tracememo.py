"""What was built from a mask or score function, kept for exactly what it was built from.

Tracing a function (:mod:`flashlib.machinery.trace`) and writing its kernel's source costs 60-200 µs of Python at
every call that takes one, and a mask function's block mask an evaluation of every (query, key) pair.
Each memo below keeps what was built under a key and a guard, and returns it only while both are what
they were when it was built:

* the **key**, :func:`flashlib.machinery.captures.reads`: everything the function can read but tensors' values (its
  code and defaults, its closure, the globals its code names and, of the modules and classes among them,
  every attribute that any code the walk reaches may read, followed into the functions among those;
  numbers and strings by value; tensors by identity, dtype, shape, strides, offset, device and
  requires_grad), with the call's part (the indices' bounds, i.e. the lengths, and the device) and the
  default dtype.
* the **guard**: what the kept thing depends on of the values of the tensors the function reads,
  recomputed at every hit, since values can change without PyTorch knowing (a numpy view's writes,
  ``.data``) and PyTorch's version counter misses those.

What each kept thing depends on, and so its guard:

* a compiled kernel (``MEMO``: ``MASK_MOD``/``SCORE_MOD``, its source, which loads are narrowed to int32,
  the numbers it is given at launch, the index check of its loads): the trace's graph, which reads tensors'
  values only through the bounds of the integer tensors it loads (an index's range decides int32 or int64
  arithmetic and which guards a load needs); the kernel itself reads floats and booleans at launch. Guard:
  (least, greatest) of each integer tensor loaded (one pass over it, a transfer from a GPU). A trace that
  read a captured tensor in Python (``t[0]``, ``t.max().item()``) may hold any of its values: never kept.
* the tensors a score function reads (``MEMO``, for autograd): which tensors the trace loaded. No guard.
* a block mask (``KINDS`` in :mod:`flashlib.kernels.function`): every value of every tensor the function
  reads. Guard: a sha256 digest of each (about 20 µs per 32 KB here; on a GPU one transfer).

Numbers a function computes with that its code does not spell out (captured, or computed from captured
ones) are given to the kernel at launch, not written into its source (:func:`flashlib.machinery.captures.literals`):
a new temperature or window traces again (its value is in the key) but writes the same source, so compiles
no new kernel (:func:`flashlib.kernels.maskfn.compiled`; on a GPU Triton keeps each source's compiled
kernels for the process). What cannot be keyed (an object's attributes, a numpy array, an attribute read by
a name the code computes: ``getattr(cfg, name)``) gets no key: such a call traces afresh.

Memory is bounded, whatever the calls: ``MEMO`` holds at most 256 entries (the key, the source, a few
numbers and, for a function that indexes tensors, the graph of its loads: 2 KB for a temperature, 5 KB for
a bias table, 7 KB for T5's here), the compiled sources at most 256 (:data:`flashlib.kernels.maskfn._COMPILED`,
with their linecache entries, interpreter rewrites and file names), about 2 MB for both when full (measured:
6.7 KB per mask function), and ``KINDS`` at most 64 block masks and 16 MiB; 10,000 distinct temperatures
write one source (tests/test_tracememo.py). No memo holds a tensor: an entry keeps where in the function's
reads each tensor the trace loaded sits, and a hit takes them from the function as it is now; weak
references tell a tensor that died from a new one at the same address.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from ..machinery.captures import reads  # the walk over what a function reads, shared with the device check
from ..machinery.trace import value_bounds


def bounds_guard(read, loaded) -> tuple:
    """What a trace read of its tensors' values: the bounds of each tensor it loaded (None where fixed by
    the dtype: a float or a boolean)."""
    return tuple(value_bounds(t) if not (t.is_floating_point() or t.dtype is torch.bool) else None
                 for t in loaded)


def digest(t: torch.Tensor) -> bytes:
    """sha256 of a tensor's values (its bytes, in order): equal values, equal digests. Read from a copy: a
    numpy view of the tensor itself would make its storage unresizable for good (``t.resize_`` fails)."""
    flat = t.detach().reshape(-1).to("cpu", copy=True)  # contiguous, its own storage
    return hashlib.sha256(flat.view(torch.uint8).numpy()).digest() if flat.numel() else b""


def contents_guard(read, loaded) -> tuple:
    """Every value of every tensor a function reads (for what was computed by calling it: a block mask)."""
    return tuple(digest(t) for t in read)


class TraceMemo:
    """What was built from a function, under the key of what the function reads (:func:`reads`) and the
    guard of what it depends on of their values.

    ``get(fn, extra, build)``: build() -> (kept, tensors it loaded[, ids of tensors the function read in
    Python]); returns (kept, those tensors as the function reads them now). ``extra``: the rest of the
    key (bounds, device). ``guard(read, loaded)``: a hashable of the tensors' values, recomputed at every
    hit (read: every tensor the function reads; loaded: those the build loaded). At most ``size`` entries,
    the least recently used dropped first; with ``weigh`` (kept -> bytes), at most ``budget`` bytes in
    all (what weighs more alone is not kept)."""

    def __init__(self, size: int = 256, weigh: Callable | None = None, budget: int | None = None,
                 guard: Callable | None = None):
        self.size, self.guard = size, guard
        self.weigh, self.budget = weigh or (lambda kept: 0), float("inf") if budget is None else budget
        self._entries: OrderedDict = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()
        _MEMOS.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, fn, extra, build: Callable[[], tuple]):
        found = reads(fn)
        if found is None:
            return tuple(build()[:2])
        parts, tensors = found
        key = (extra, torch.get_default_dtype(), parts)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None:
            kept, refs, slots, fact = entry
            if all(ref() is t for ref, t in zip(refs, tensors)):  # no tensor died and left its address
                loaded = tuple(tensors[i] for i in slots)
                if self.guard is None or self.guard(tensors, loaded) == fact:
                    return kept, loaded
        kept, loaded, *read = build()
        slots = [next((i for i, t in enumerate(tensors) if t is want), None) for want in loaded]
        # a tensor made inside the function is new at every call; one read in Python may matter whole
        if None not in slots and not (read and any(id(t) in read[0] for t in tensors)):
            fact = None if self.guard is None else self.guard(tensors, tuple(loaded))
            self._keep(key, (kept, [weakref.ref(t) for t in tensors], slots, fact))
        return kept, tuple(loaded)

    def _keep(self, key, entry):
        weight = self.weigh(entry[0])
        if weight > self.budget:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._weight += weight - (self.weigh(old[0]) if old else 0)
            self._entries[key] = entry
            while len(self._entries) > self.size or self._weight > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self._weight -= self.weigh(dropped[0])

    def clear(self):
        with self._lock:
            self._entries.clear()
            self._weight = 0


_MEMOS: weakref.WeakSet = weakref.WeakSet()


def clear_all():
    """Forget every kept trace and block mask (the next calls trace again)."""
    for memo in list(_MEMOS):
        memo.clear()
