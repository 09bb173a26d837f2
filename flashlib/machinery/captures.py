"""What a mask or score function reads besides its arguments: one walk, four uses.

A function's result depends on its code and defaults, its closure, the globals its code names (and,
in turn, what the functions among them read), and the attributes of the modules and classes among
those that any code the walk reaches may read (a submodule's, a staticmethod's globals, followed the
same way): a module handed to a helper (``near(settings, q_idx, kv_idx)``) is read by the helper's code,
not by the code that holds it. :func:`reads` turns all of that into one hashable key for the memo of
traced functions (:mod:`flashlib.kernels.tracememo`); :func:`captured` lists the tensors among it with
the names they are read by, for the check that they sit on q's device
(:func:`flashlib.machinery.checks.check_captured_devices`); :func:`literals` names the numbers written in the
code it runs (the rest are given to a kernel at launch); :func:`functions_reached` tells the labs each
function a learner's answer is or can call (:mod:`flashlib.labs.own_code`, which refuses the course's own).
Pure PyTorch: the checks of every op import it.

Numbers, strings and dtypes enter the key by value; a tensor by identity, dtype, shape, strides,
storage offset, device and whether it requires grad: not by its values, which can change without
PyTorch knowing (through numpy's view of it, or ``.data``), so the memo guards what depends on them
itself. What cannot be keyed gives no key (the function is traced at every call): an object's
attributes, a numpy array, a class with a metaclass of its own, and an attribute whose name the code
computes (``getattr(cfg, name)``, ``vars(cfg)[name]``, ``cfg.__dict__[name]`` with a name that is not
a constant written in the code; ``operator.attrgetter``). :func:`captured` passes over those and lists
the rest.
"""
from __future__ import annotations

import dis
import functools
import operator
import types

import torch

from .trace import TraceError, refusal, trace

_MAX_PARTS = 512  # past this many values a function gets no key (and the device check looks no further)
_STABLE = ("torch", "math", "operator", "functools", "builtins", "numbers", "typing", "flashlib.machinery.trace")
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


# ----- attributes read by a computed name ---------------------------------------------------------

_BY_NAME = frozenset({"getattr", "hasattr"})  # f(obj, name, ...): the name is their second argument
_READERS = _BY_NAME | {"vars"}  # vars(obj)[name]
_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_ATTR", "LOAD_METHOD"})
# readers whose names the walk cannot see at all
_OPAQUE = frozenset({"__getattribute__", "__getattr__", "attrgetter", "methodcaller", "getattr_static"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))
_BUILTIN_READERS = (getattr, hasattr, vars)


@functools.lru_cache(maxsize=4096)
def _computes_names(code: types.CodeType) -> bool:
    """Whether a code object (or one defined inside it) may read an attribute whose name it computes:
    ``getattr``/``hasattr`` with a second argument that is not a string constant, ``vars(x)`` or
    ``x.__dict__`` not indexed at once by one, ``__getattribute__``, ``attrgetter``... (read from the
    bytecode: a constant is a constant however the source spells it)."""
    return any(_computes_in(c) for c in _nested(code))


def _computes_in(code: types.CodeType) -> bool:
    names = set(code.co_names)
    if names & _OPAQUE:
        return True
    if not names & (_READERS | {"__dict__"}):
        return False
    ins = list(dis.get_instructions(code))
    depth = [0]  # the stack's depth before each instruction (jumps not taken: read within one expression)
    for i in ins:
        depth.append(depth[-1] + dis.stack_effect(i.opcode, i.arg, jump=False))
    for a, i in enumerate(ins):
        reader = i.opname in _NAME_LOADS and i.argval in _READERS or i.argval == "__dict__" and "ATTR" in i.opname
        if reader and not _constant_name(ins, depth, a):
            return True
    return False


def _constant_name(ins: list, depth: list, a: int) -> bool:
    """Whether the reader loaded by instruction a reads a name written as a string constant: getattr/hasattr's
    second argument, or the subscript straight after vars(x) or x.__dict__."""
    if ins[a].argval == "__dict__":
        return _subscripted_by_constant(ins, a + 1)
    first = a + 2 if a + 1 < len(ins) and ins[a + 1].opname == "PUSH_NULL" else a + 1  # 3.13: x.getattr, NULL
    loaded = depth[first]  # the stack's depth with the reader (and a NULL or self beside it) pushed
    for j in range(first, len(ins)):
        if ins[j].opcode in _JUMPS:  # a conditional expression among the arguments
            return False
        if depth[j + 1] < loaded:  # the call that consumes the reader
            break
    else:
        return False
    if ins[a].argval == "vars":
        return _subscripted_by_constant(ins, j + 1)
    name = loaded + 2  # the depth once the name, the second argument, is pushed
    made = [k for k in range(first, j) if depth[k + 1] == name]
    return bool(made) and ins[made[-1]].opname == "LOAD_CONST" and isinstance(ins[made[-1]].argval, str) \
        and depth[made[-1]] == name - 1


def _subscripted_by_constant(ins: list, k: int) -> bool:
    return (k + 1 < len(ins) and ins[k].opname == "LOAD_CONST" and isinstance(ins[k].argval, str)
            and (ins[k + 1].opname == "BINARY_SUBSCR"
                 or ins[k + 1].opname == "BINARY_OP" and ins[k + 1].argrepr == "[]"))  # 3.14's subscript


class _Walk:
    """One walk over what a function reads. strict: anything unkeyable stops it (raises _NoKey);
    otherwise it is passed over. ``where`` holds, for each tensor found, the path it was read by:
    ("fn", name), then ("closure" | "global" | "default", name), then ("item", index) or ("attr", name).

    A user's module or class is a *holder*: its attributes are read once the functions are walked, for
    every name any code the walk reached may read (:func:`_code_names`), and again for the names of the
    code found among them, until no new name appears."""

    def __init__(self, strict: bool = True, *, limit: int = _MAX_PARTS, visit=None):
        self.strict, self.limit, self.visit = strict, limit, visit  # visit: see functions_reached
        self.parts: list = []
        self.tensors: list[torch.Tensor] = []
        self.where: list[tuple] = []
        self.path: list[tuple] = []
        self.seen: set[int] = set()
        self.codes: list[types.CodeType] = []
        self.holders: dict[int, list] = {}  # id -> [number, module or class, path, names read]

    def walk(self, fn):
        """Walk fn, then its holders' attributes."""
        self.value(fn)
        names: frozenset = frozenset()
        counted = 0
        while True:
            for code in self.codes[counted:]:
                names |= _code_names(code)
            counted = len(self.codes)
            pending = [(h, sorted(names - h[3])) for h in list(self.holders.values()) if names - h[3]]
            if not pending:
                return
            for holder, new in pending:
                number, obj, path, done = holder
                holder[3] = done | set(new)
                self.add(("holder", number))
                self.path = list(path)
                for name in new:
                    (self._module_attr if isinstance(obj, types.ModuleType) else self._class_attr)(obj, name)
            self.path = []

    def add(self, part):
        self.parts.append(part)
        if len(self.parts) > self.limit:
            raise _NoKey

    def opaque(self, obj):
        if self.strict:
            raise _NoKey
        self.add(("opaque", id(obj)))

    def at(self, step: tuple, obj):
        self.path.append(step)
        self.value(obj)
        self.path.pop()

    def value(self, obj):
        if type(obj) in (float, complex):
            return self.add((type(obj), repr(obj)))  # exact, and -0.0 apart from 0.0 (equal as numbers)
        if type(obj) in _BY_VALUE:
            return self.add((type(obj), obj))
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (tuple, list)):
            self.add((type(obj), len(obj)))
            for i, item in enumerate(obj):
                self.at(("item", i), item)
            return None
        if isinstance(obj, dict):
            self.add((dict, len(obj)))
            for k, v in obj.items():
                self.value(k)
                self.at(("item", k), v)
            return None
        if isinstance(obj, types.FunctionType):
            return self.function(obj)
        if isinstance(obj, types.ModuleType):
            return self.holder(obj, ("module", obj.__name__)) if not _stable(obj.__name__) else \
                self.add(("module", obj.__name__))
        if isinstance(obj, types.BuiltinFunctionType):
            if any(obj is reader for reader in _BUILTIN_READERS):  # getattr under another name: names computed
                return self.opaque(obj)
            owner = obj.__self__
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                return self.add(("id", obj))  # torch.tanh, math.floor: nothing in them changes
            self.add(("builtin method", obj.__name__))  # t.clamp: the method of its tensor
            return self.value(owner)
        if isinstance(obj, type):
            return self.add(("id", obj)) if _stable(obj.__module__) else self.klass(obj)
        if isinstance(obj, types.MethodType):
            self.value(obj.__func__)
            return self.value(obj.__self__)
        if isinstance(obj, (operator.attrgetter, operator.methodcaller)):  # names held in the object
            return self.opaque(obj)
        if type(obj).__name__ == "partial" and _stable(type(obj).__module__):  # functools.partial
            self.at(("attr", "func"), obj.func)
            self.at(("attr", "args"), obj.args)
            return self.at(("attr", "keywords"), obj.keywords)
        if callable(obj) and _stable(getattr(type(obj), "__module__", None)):
            return self.add(("id", obj))  # a torch or operator callable object (torch.ops, itemgetter...)
        if self.visit is not None and callable(obj):
            return self.inside(obj)
        return self.opaque(obj)

    def inside(self, obj):
        """A callable object, looked into (for :func:`functions_reached` only: a key never reads an object's
        attributes): the function a wrapper holds (a Triton @jit function's ``fn``), or its ``__call__`` and
        its attributes."""
        wrapped = getattr(obj, "fn", None)
        if isinstance(wrapped, types.FunctionType):
            return self.at(("unwrap", "fn"), wrapped)
        call = getattr(type(obj), "__call__", None)
        if isinstance(call, types.FunctionType):
            self.at(("unwrap", "__call__"), call)
        for name, value in (vars(obj).items() if hasattr(obj, "__dict__") else ()):
            self.at(("member", name), value)
        return None

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
        if self.visit is not None:
            self.visit(fn, any(step[0] in _CALLED or step in _BOUND for step in self.path))
            if isinstance(getattr(fn, "__wrapped__", None), types.FunctionType):  # functools.wraps
                self.at(("unwrap", "__wrapped__"), fn.__wrapped__)
        if _computes_names(code):  # which attributes it reads is known only when it runs
            self.opaque(fn)
        self.add(("fn", code))
        self.codes.append(code)
        self.path.append(("fn", fn.__name__))
        defaults = fn.__defaults__ or ()
        self.add(("defaults", len(defaults)))
        for name, value in zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults):
            self.at(("default", name), value)
        keyword_defaults = fn.__kwdefaults__ or {}
        self.add(("keyword defaults", tuple(keyword_defaults)))
        for name, value in keyword_defaults.items():
            self.at(("default", name), value)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self.add("empty cell")
                continue
            self.at(("closure", name), contents)
        if not _stable(fn.__module__):  # a library's function: its globals are the library's
            for name in _global_names(code):
                value = fn.__globals__.get(name, _MISSING)
                if value is not _MISSING:  # names not found are builtins
                    self.add(("global", name))
                    self.at(("global", name), value)
        self.path.pop()
        return None

    def holder(self, obj, part: tuple):
        """A user's module or class: keyed by what it is here, its attributes once the walk knows every name
        (:meth:`walk`); met again, by its number."""
        self.add(part)
        if id(obj) not in self.holders:
            self.holders[id(obj)] = [len(self.holders), obj, tuple(self.path), frozenset()]
        self.add(("holder", self.holders[id(obj)][0]))

    def klass(self, cls: type):
        if type(cls) is not type:  # a metaclass of its own may compute what cls.name gives
            return self.opaque(cls)
        return self.holder(cls, ("class", cls.__module__, cls.__qualname__))

    def _module_attr(self, module: types.ModuleType, name: str):
        """A user's module's attribute (pkg.settings.W)."""
        value = getattr(module, name, _MISSING)
        if value is not _MISSING:
            self.add(("attr", name))
            self.at(("attr", name), value)

    def _class_attr(self, cls: type, name: str):
        """A config class's attribute (a class used as a namespace), looked up as ``cls.name`` finds it (a
        staticmethod's function, whose globals are followed)."""
        if name.startswith("__"):
            return
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is None:
            return
        value = vars(owner)[name]
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        self.add(("attr", name))
        if isinstance(value, (property, types.MemberDescriptorType, types.GetSetDescriptorType)):
            self.add(("descriptor", type(value).__name__))  # cls.name gives the descriptor itself
            return
        self.at(("attr", name), value)


# the steps of a path by which a function reached is called by the one walked (not the one walked itself,
# unwrapped): its closure, globals, defaults, an object's attributes, what a functools.partial binds
_CALLED = frozenset({"closure", "global", "default", "member"})
_BOUND = frozenset({("attr", "args"), ("attr", "keywords")})


def functions_reached(fn, visit, *, limit: int = 4 * _MAX_PARTS) -> None:
    """Call ``visit(function, called)`` for each Python function ``fn`` is or reaches, in the walk's order:
    ``fn`` itself, the function behind a functools.partial, functools.wraps, a bound method, a Triton @jit
    function or a callable object (called False), and the functions its code can call (called True): in its
    closure, defaults and globals, the attributes of the modules among them, a callable object's attributes,
    a partial's arguments, and theirs in turn. The first ``limit`` values only; visit may raise to stop."""
    walk = _Walk(strict=False, limit=limit, visit=visit)
    try:
        walk.walk(fn)
    except _NoKey:  # too many values: those found so far
        pass


def reads(fn) -> tuple[tuple, list] | None:
    """(key, tensors): a hashable key of everything a trace of ``fn`` can read, and the tensors among
    it in the order keyed; None when fn reads what cannot be keyed."""
    walk = _Walk()
    try:
        walk.walk(fn)
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
        walk.walk(fn)
    except _NoKey:  # too many values: the code found so far
        pass
    return frozenset(id(n) for code in walk.codes for c in _nested(code) for n in _numbers(c.co_consts))


def captured(fn) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for each tensor ``fn`` reads besides its arguments, as :class:`_Walk` finds them,
    passing over what it cannot look into (an object's attributes); the first _MAX_PARTS values only."""
    walk = _Walk(strict=False)
    try:
        walk.walk(fn)
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


def captured_tensors(fn: str, score_mod, *, compiles: bool = True) -> list[torch.Tensor]:
    """The tensors a score function reads, found by calling it once on stand-ins (the translator the
    kernels use, :mod:`flashlib.machinery.trace`; no Triton needed): the same functions work in the
    references and the kernels, and what cannot be traced is refused by name. compiles=False (a
    reference, which calls the function as it is, as dense attention does): what cannot be traced is
    taken too, its tensors those its closure, defaults and globals hold (:func:`captured`)."""
    bounds = {"score": (None, None), **{name: (0, 2**31 - 1) for name in ("b", "h", "q_idx", "kv_idx")}}
    try:
        return list(trace(score_mod, bounds, floats=("score",)).tensors)
    except TraceError as exc:
        if not compiles:
            return [t for _, t in captured(score_mod)]
        raise refusal(fn, "score_mod", score_mod, exc) from None
