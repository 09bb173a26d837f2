"""Compiled mask and score functions, kept while nothing the function reads has changed.

Tracing a mask or score function (:mod:`flashlib.trace`) and writing its kernel's source costs
60-200 µs of Python, at every call that takes one: on a GPU, more than a decoding step's kernel.
Yet what a trace finds depends only on what the function reads: its code and defaults, its
closure, the globals its code names (and, in turn, what the functions among them read), the
call's bounds and device. :func:`flashlib.captures.reads` turns all of that into one hashable key;
a tensor enters it by identity, version (PyTorch bumps it at every in-place change, through any
view), dtype, shape, strides and device, since a trace reads integer tensors' values (their bounds).

The memo holds no tensor: an entry keeps what the trace left (a kernel, its source) and where, in
the function's reads, each tensor the trace loaded sits; a hit takes those tensors from the
function as it is now. Weak references tell a tensor that died from a new one at the same address.

A function that reads what cannot be keyed (an object's attributes, a numpy array, an inference
tensor, which has no version) gets no key and is traced at every call, as without the memo: what
the docs promise, that a function's captures are read afresh at every call, holds either way.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from ..captures import reads  # the walk over what a function reads, shared with the device check


class TraceMemo:
    """What was built from a function's trace, under the key of what the function reads (:func:`reads`).

    ``get(fn, extra, build)``: build() -> (kept, tensors the trace loaded); returns (kept, those
    tensors as the function reads them now). ``extra``: the rest of the key (bounds, device).
    At most ``size`` entries, the least recently used dropped first; with ``weigh`` (kept -> bytes),
    at most ``budget`` bytes in all (what weighs more alone is not kept)."""

    def __init__(self, size: int = 256, weigh: Callable | None = None, budget: int | None = None):
        self.size, self.weigh, self.budget = size, weigh, budget
        self._entries: OrderedDict = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()
        _MEMOS.add(self)

    def get(self, fn, extra, build: Callable[[], tuple]):
        found = reads(fn)
        if found is None:
            return build()
        parts, tensors = found
        key = (extra, torch.get_default_dtype(), parts)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None:
            kept, refs, slots = entry
            if all(ref() is t for ref, t in zip(refs, tensors)):  # no tensor died and left its address
                return kept, tuple(tensors[i] for i in slots)
        kept, loaded = build()
        slots = [next((i for i, t in enumerate(tensors) if t is want), None) for want in loaded]
        if None not in slots:  # a tensor made inside the function is new at every call: nothing to keep
            self._keep(key, (kept, [weakref.ref(t) for t in tensors], slots))
        return kept, tuple(loaded)

    def _keep(self, key, entry):
        weight = self.weigh(entry[0]) if self.weigh else 0
        if self.budget is not None and weight > self.budget:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._weight += weight - (self.weigh(old[0]) if self.weigh and old else 0)
            self._entries[key] = entry
            while len(self._entries) > self.size or (self.budget is not None and self._weight > self.budget):
                _, dropped = self._entries.popitem(last=False)
                self._weight -= self.weigh(dropped[0]) if self.weigh else 0

    def clear(self):
        with self._lock:
            self._entries.clear()
            self._weight = 0


_MEMOS: weakref.WeakSet = weakref.WeakSet()


def clear_all():
    """Forget every kept trace and block mask (the next calls trace again)."""
    for memo in list(_MEMOS):
        memo.clear()
