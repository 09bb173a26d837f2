"""Whether a lab's answer is the course's own code: the function itself, a copy of its code, or a call to it.

A lab asks the learner to write a step the course already has (its "answers", :attr:`Lab.answers`).
Handing in that code passes every case and teaches nothing, so the checker refuses it first, by what
can be seen without running anything:

- the function is the course's (through ``functools.partial``, ``functools.wraps``, a bound method, a
  Triton ``@jit`` wrapper or a callable object's ``__call__``);
- its code is the course's code object, or a copy of it (the same bytecode, constants and names);
- it reaches the course's function: through the globals its code names (``flashlib.tiled.tiled_forward``
  is followed attribute by attribute), its closure, its defaults, and the functions among them in turn.

What it cannot see: a name built at run time (``getattr(module, "tiled_" + "forward")``).
"""
from __future__ import annotations

import dis
import functools
import importlib
import types

_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}
# forms the interpreter may rewrite once code has run (specialised method loads, cache slots): compared alike
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}
_NO_OP = {"CACHE", "PRECALL", "NOP", "RESUME", "EXTENDED_ARG"}
_MAX_VALUES = 2000  # values looked at, at most: a function that reaches further is not refused for it


def course_functions(answers) -> dict:
    """{code object: "module.function"} of the course functions named "module:function" (a Triton
    ``@jit`` function by the Python function it wraps)."""
    found = {}
    for entry in answers:
        module, _, name = entry.partition(":")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, RuntimeError):  # Triton missing here: that code cannot be used either
            continue
        code = _code(_unwrap(obj))
        if code is not None:
            found[code] = f"{module}.{name}"
    return found


def _unwrap(obj):
    """The Python function behind a partial, a wraps()-decorated wrapper, a bound method, a Triton @jit
    function or a callable object, as far as these go."""
    for _ in range(16):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif hasattr(obj, "__wrapped__") and not isinstance(obj, type):
            obj = obj.__wrapped__
        elif not isinstance(obj, types.FunctionType) and callable(getattr(obj, "fn", None)):
            obj = obj.fn  # triton's JITFunction / InterpretedFunction
        else:
            return obj
    return obj


def _code(obj):
    return obj.__code__ if isinstance(obj, types.FunctionType) else None


@functools.lru_cache(maxsize=4096)
def _shape(code: types.CodeType) -> tuple:
    """A code object as its instructions and their arguments (nested code by its own shape): two
    compilations of the same source give the same shape, whatever their file, line numbers or caches."""
    return tuple((_SAME_OP.get(ins.opname, ins.opname),
                  _shape(ins.argval) if isinstance(ins.argval, types.CodeType) else repr(ins.argval))
                 for ins in dis.get_instructions(code) if ins.opname not in _NO_OP)


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    return a.co_varnames == b.co_varnames and _shape(a) == _shape(b)


def _nested(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


@functools.lru_cache(maxsize=1024)
def _names(code) -> tuple[frozenset, frozenset]:
    """(globals loaded, attribute names) of a code object and the code defined inside it."""
    loads, attrs = set(), set()
    for c in _nested(code):
        attrs.update(c.co_names)
        loads.update(ins.argval for ins in dis.get_instructions(c) if ins.opname in _GLOBAL_LOADS)
    return frozenset(loads), frozenset(attrs)


def used(fn, codes: dict) -> str | None:
    """How ``fn`` is or calls one of the course functions ``codes`` ({code: name}), in words; None if not."""
    seen, todo, looked = set(), [(fn, False)], 0
    while todo and looked < _MAX_VALUES:
        obj, calls = todo.pop()
        looked += 1
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        target = _unwrap(obj)
        if isinstance(obj, functools.partial):  # what a partial binds is read too
            todo += [(v, True) for v in (*obj.args, *obj.keywords.values())]
        if not isinstance(target, types.FunctionType):
            call = getattr(type(target), "__call__", None)
            if isinstance(call, types.FunctionType):  # a callable object: its __call__ and its attributes
                todo.append((call, calls))
                todo += [(v, True) for v in vars(target).values()] if hasattr(target, "__dict__") else []
            continue
        code = target.__code__
        for course, name in codes.items():
            if code is course or _same_code(code, course):
                if calls:
                    return f"your function calls the course's own {name}"
                return f"your function is {'' if code is course else 'a copy of '}the course's own {name}"
        loads, attrs = _names(code)
        for var in loads:
            if var in target.__globals__:
                todo += [(v, True) for v in _reached(target.__globals__[var], attrs)]
        for cell in target.__closure__ or ():
            try:
                todo += [(v, True) for v in _reached(cell.cell_contents, attrs)]
            except ValueError:  # an empty cell
                pass
        defaults = (*(target.__defaults__ or ()), *(target.__kwdefaults__ or {}).values())
        todo += [(v, True) for d in defaults for v in _reached(d, attrs)]
    return None


def _reached(value, attrs, depth: int = 4) -> list:
    """The value, and for a module the attributes the code names of it (and of its submodules in turn)."""
    out = [value]
    if isinstance(value, types.ModuleType) and depth > 0:
        for attr in attrs:
            member = getattr(value, attr, None)
            if member is not None and member is not value:
                out += _reached(member, attrs, depth - 1)
    return out
