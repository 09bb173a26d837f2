"""What a mask or score function reads besides its arguments: one walk, three uses.

A function's result depends on its code and defaults, its closure, the globals its code names (and,
in turn, what the functions among them read), and the attributes its code may read of the modules
and classes among those (a submodule's, a staticmethod's globals, followed the same way).
:func:`reads` turns all of that into one hashable key for the memo of traced functions
(:mod:`flashlib.kernels.tracememo`); :func:`captured` lists the tensors among it with the names they
are read by, for the check that they sit on q's device (:func:`flashlib._checks.check_captured_devices`);
:func:`literals` names the numbers written in the code it runs (the rest are given to a kernel at
launch). Pure PyTorch: the checks of every op import it.

Numbers, strings and dtypes enter the key by value; a tensor by identity, dtype, shape, strides,
storage offset, device and whether it requires grad: not by its values, which can change without
PyTorch knowing (through numpy's view of it, or ``.data``), so the memo guards what depends on them
itself. What cannot be keyed (an object's attributes, a numpy array, a class with a metaclass of its
own) gives no key; :func:`captured` passes over it and lists the rest.
"""
from __future__ import annotations

import dis
import functools
import types

import torch

_MAX_PARTS = 512  # past this many values a function gets no key (and the device check looks no further)
_STABLE = ("torch", "math", "operator", "functools", "builtins", "numbers", "typing", "flashlib.trace")
_BY_VALUE = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}
_MISSING = object()


class _NoKey(Exception):
    """The function reads something that cannot be keyed."""


def _stable(module_name) -> bool:
    name = module_name or ""
    return any(name == m or name.startswith(m + ".") for m in _STABLE)


def _nested(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> frozenset:
    """The names a code object (and the functions defined inside it) may look up as attributes: its
    names, and the strings it spells out that could be one (getattr(cfg, "window"))."""
    return frozenset(name for c in _nested(code) for name in (*c.co_names, *c.co_consts)
                     if isinstance(name, str) and name.isidentifier())


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple:
    """The names a code object (and the functions defined inside it) loads as globals, sorted: not its
    attribute names (``torch.where`` reads no global ``where``)."""
    return tuple(sorted({ins.argval for c in _nested(code) for ins in dis.get_instructions(c)
                         if ins.opname in _GLOBAL_LOADS}))


class _Walk:
    """One walk over what a function reads. strict: anything unkeyable stops it (raises _NoKey);
    otherwise it is passed over. ``where`` holds, for each tensor found, the path it was read by:
    ("fn", name), then ("closure" | "global" | "default", name), then ("item", index) or ("attr", name)."""

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.parts: list = []
        self.tensors: list[torch.Tensor] = []
        self.where: list[tuple] = []
        self.path: list[tuple] = []
        self.seen: set[int] = set()
        self.codes: list[types.CodeType] = []

    def add(self, part):
        self.parts.append(part)
        if len(self.parts) > _MAX_PARTS:
            raise _NoKey

    def at(self, step: tuple, obj, names=frozenset()):
        self.path.append(step)
        self.value(obj, names)
        self.path.pop()

    def value(self, obj, names=frozenset()):
        if type(obj) in (float, complex):
            return self.add((type(obj), repr(obj)))  # exact, and -0.0 apart from 0.0 (equal as numbers)
        if type(obj) in _BY_VALUE:
            return self.add((type(obj), obj))
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (tuple, list)):
            self.add((type(obj), len(obj)))
            for i, item in enumerate(obj):
                self.at(("item", i), item, names)
            return None
        if isinstance(obj, dict):
            self.add((dict, len(obj)))
            for k, v in obj.items():
                self.value(k, names)
                self.at(("item", k), v, names)
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
        if isinstance(obj, type):
            return self.add(("id", obj)) if _stable(obj.__module__) else self.klass(obj, names)
        if isinstance(obj, types.MethodType):
            self.value(obj.__func__)
            return self.value(obj.__self__, names)
        if type(obj).__name__ == "partial" and _stable(type(obj).__module__):  # functools.partial
            self.at(("attr", "func"), obj.func)
            self.at(("attr", "args"), obj.args)
            return self.at(("attr", "keywords"), obj.keywords)
        if callable(obj) and _stable(getattr(type(obj), "__module__", None)):
            return self.add(("id", obj))  # a torch or operator callable object (torch.ops, itemgetter...)
        if self.strict:
            raise _NoKey
        return self.add(("opaque", id(obj)))

    def tensor(self, t: torch.Tensor):
        self.add(("tensor", id(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device,
                  t.requires_grad))
        self.tensors.append(t)
        self.where.append(tuple(self.path))

    def function(self, fn: types.FunctionType):
        code = fn.__code__
        if id(fn) in self.seen:  # recursion: the function is keyed already
            return self.add(("again", code))
        self.seen.add(id(fn))
        self.add(("fn", code))
        self.codes.append(code)
        self.path.append(("fn", fn.__name__))
        attributes = _code_names(code)  # what the code may read of a module or class it is given
        defaults = fn.__defaults__ or ()
        self.add(("defaults", len(defaults)))
        for name, value in zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults):
            self.at(("default", name), value, attributes)
        keyword_defaults = fn.__kwdefaults__ or {}
        self.add(("keyword defaults", tuple(keyword_defaults)))
        for name, value in keyword_defaults.items():
            self.at(("default", name), value, attributes)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self.add("empty cell")
                continue
            self.at(("closure", name), contents, attributes)
        if not _stable(fn.__module__):  # a library's function: its globals are the library's
            for name in _global_names(code):
                value = fn.__globals__.get(name, _MISSING)
                if value is not _MISSING:  # names not found are builtins
                    self.add(("global", name))
                    self.at(("global", name), value, attributes)
        self.path.pop()
        return None

    def module(self, module: types.ModuleType, names):
        self.add(("module", module.__name__))
        if _stable(module.__name__):
            return None
        if id(module) in self.seen:  # modules that import each other
            return self.add("again")
        self.seen.add(id(module))
        for name in sorted(names):  # a user's module: the attributes the code may read from it (pkg.settings.W)
            value = getattr(module, name, _MISSING)
            if value is not _MISSING:
                self.add(("attr", name))
                self.at(("attr", name), value, names)
        return None

    def klass(self, cls: type, names):
        """A user's class (a config class used as a namespace): the attributes the code may read from it,
        looked up as ``cls.name`` finds them (a staticmethod's function, whose globals are followed)."""
        if type(cls) is not type:  # a metaclass of its own may compute what cls.name gives
            if self.strict:
                raise _NoKey
            return self.add(("opaque", id(cls)))
        self.add(("class", cls.__module__, cls.__qualname__))
        if id(cls) in self.seen:  # a classmethod's class, or a class attribute holding its class
            return self.add("again")
        self.seen.add(id(cls))
        for name in sorted(n for n in names if not n.startswith("__")):
            owner = next((c for c in cls.__mro__ if name in vars(c)), None)
            if owner is None:
                continue
            value = vars(owner)[name]
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            self.add(("attr", name))
            if isinstance(value, (property, types.MemberDescriptorType, types.GetSetDescriptorType)):
                self.add(("descriptor", type(value).__name__))  # cls.name gives the descriptor itself
                continue
            self.at(("attr", name), value, names)
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


def _numbers(consts):
    for const in consts:
        if isinstance(const, (int, float, complex)):
            yield const
        elif isinstance(const, (tuple, frozenset)):
            yield from _numbers(const)


def literals(fn) -> frozenset:
    """The ids of the numbers written in the code ``fn`` runs (its own, and that of the functions it
    calls, as the walk finds them): a trace writes these into a kernel's source, and gives the kernel
    every other number at launch (captured, or computed from captured ones)."""
    walk = _Walk(strict=False)
    try:
        walk.value(fn)
    except _NoKey:  # too many values: the code found so far
        pass
    return frozenset(id(n) for code in walk.codes for c in _nested(code) for n in _numbers(c.co_consts))


def captured(fn) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for each tensor ``fn`` reads besides its arguments, as :class:`_Walk` finds them,
    passing over what it cannot look into (an object's attributes); the first _MAX_PARTS values only."""
    walk = _Walk(strict=False)
    try:
        walk.value(fn)
    except _NoKey:  # too many values: what was found so far
        pass
    return list(zip(walk.where, walk.tensors))


def describe(path: tuple) -> tuple[str, str]:
    """(name, where) of a tensor from its :func:`captured` path: ("windows[1]", "in its closure"), or,
    read by a function it calls, ("ids", "a global of doc_of, which it calls")."""
    holders = [i for i, step in enumerate(path) if step[0] == "fn"]
    steps = path[holders[-1] + 1 if holders else 0:] or (("closure", "?"),)
    kind, name = steps[0]
    for step, key in steps[1:]:
        name += f"[{key!r}]" if step == "item" else f".{key}"
    if kind not in ("closure", "global", "default"):  # a functools.partial's arguments
        return name, "an argument it was bound with"
    if len(holders) <= 1:
        return name, {"closure": "in its closure", "global": "a global", "default": "a default argument"}[kind]
    holder = path[holders[-1]][1]
    return name, {"closure": f"in the closure of {holder}", "global": f"a global of {holder}",
                  "default": f"a default argument of {holder}"}[kind] + ", which it calls"
