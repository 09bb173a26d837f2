"""Compiled mask and score functions, kept while nothing the function reads has changed.

Tracing a mask or score function (:mod:`flashlib.trace`) and writing its kernel's source costs
60-200 µs of Python, at every call that takes one: on a GPU, more than a decoding step's kernel.
Yet what a trace finds depends only on what the function reads: its code and defaults, its
closure, the globals its code names (and, in turn, what the functions among them read), the
call's bounds and device. :func:`reads` turns all of that into one hashable key; a tensor enters
it by identity, version (PyTorch bumps it at every in-place change, through any view), dtype,
shape, strides and device, since a trace reads integer tensors' values (their bounds).

The memo holds no tensor: an entry keeps what the trace left (a kernel, its source) and where, in
the function's reads, each tensor the trace loaded sits; a hit takes those tensors from the
function as it is now. Weak references tell a tensor that died from a new one at the same address.

A function that reads what cannot be keyed (an object's attributes, a numpy array, an inference
tensor, which has no version) gets no key and is traced at every call, as without the memo: what
the docs promise, that a function's captures are read afresh at every call, holds either way.
"""
from __future__ import annotations

import threading
import types
import weakref
from collections import OrderedDict
from typing import Callable

import torch

_MAX_PARTS = 512  # past this many keyed values a function is traced at every call
_STABLE = ("torch", "math", "operator", "functools", "builtins", "numbers", "typing", "flashlib.trace")
_BY_VALUE = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_MISSING = object()


class _NoKey(Exception):
    """The function reads something that cannot be keyed."""


def _stable(module_name) -> bool:
    name = module_name or ""
    return any(name == m or name.startswith(m + ".") for m in _STABLE)


def _code_names(code: types.CodeType) -> set:
    """The names a code object (and the functions defined inside it) may look up as globals or
    attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


class _Walk:
    def __init__(self):
        self.parts: list = []
        self.tensors: list[torch.Tensor] = []
        self.seen: set[int] = set()

    def add(self, part):
        self.parts.append(part)
        if len(self.parts) > _MAX_PARTS:
            raise _NoKey

    def value(self, obj, names=frozenset()):
        if type(obj) in (float, complex):
            return self.add((type(obj), repr(obj)))  # exact, and -0.0 apart from 0.0 (equal as numbers)
        if type(obj) in _BY_VALUE:
            return self.add((type(obj), obj))
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (tuple, list)):
            self.add((type(obj), len(obj)))
            for item in obj:
                self.value(item, names)
            return None
        if isinstance(obj, dict):
            self.add((dict, len(obj)))
            for k, v in obj.items():
                self.value(k, names)
                self.value(v, names)
            return None
        if isinstance(obj, types.FunctionType):
            return self.function(obj)
        if isinstance(obj, types.ModuleType):
            return self.module(obj, names)
        if isinstance(obj, types.BuiltinFunctionType):
            owner = obj.__self__
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                return self.add(("id", obj))  # torch.tanh, math.floor: nothing in them changes
            self.add(("builtin method", obj.__name__))  # t.clamp: the method of its tensor
            return self.value(owner, names)
        if isinstance(obj, type) and _stable(obj.__module__):
            return self.add(("id", obj))
        if isinstance(obj, types.MethodType):
            self.value(obj.__func__)
            return self.value(obj.__self__, names)
        if type(obj).__name__ == "partial" and _stable(type(obj).__module__):  # functools.partial
            self.value(obj.func)
            self.value(obj.args)
            return self.value(obj.keywords)
        if callable(obj) and _stable(getattr(type(obj), "__module__", None)):
            return self.add(("id", obj))  # a torch or operator callable object (torch.ops, itemgetter...)
        raise _NoKey

    def tensor(self, t: torch.Tensor):
        try:
            version = t._version
        except RuntimeError:  # an inference tensor keeps no version
            raise _NoKey from None
        self.add(("tensor", id(t), version, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device,
                  t.requires_grad))
        self.tensors.append(t)

    def function(self, fn: types.FunctionType):
        if id(fn) in self.seen:  # recursion: the function is keyed already
            return self.add(("again", fn.__code__))
        self.seen.add(id(fn))
        self.add(("fn", fn.__code__))
        self.value(fn.__defaults__)
        self.value(fn.__kwdefaults__)
        for cell in fn.__closure__ or ():
            try:
                self.value(cell.cell_contents)
            except ValueError:  # an empty cell
                self.add("empty cell")
        if _stable(fn.__module__):  # a library's function: its globals are the library's
            return None
        names = _code_names(fn.__code__)
        for name in sorted(names):
            value = fn.__globals__.get(name, _MISSING)
            if value is not _MISSING:  # names not found are attributes or builtins
                self.add(("global", name))
                self.value(value, names)
        return None

    def module(self, module: types.ModuleType, names):
        self.add(("module", module.__name__))
        if _stable(module.__name__):
            return None
        for name in sorted(names):  # a user's module: the attributes the code may read from it
            value = getattr(module, name, _MISSING)
            if value is not _MISSING and not isinstance(value, types.ModuleType):
                self.add(("attr", name))
                self.value(value, names)
        return None


def reads(fn) -> tuple[tuple, list] | None:
    """(key, tensors): a hashable key of everything a trace of ``fn`` can read, and the tensors among
    it in the order keyed; None when fn reads what cannot be keyed."""
    walk = _Walk()
    try:
        walk.value(fn)
    except _NoKey:
        return None
    return tuple(walk.parts), walk.tensors


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
