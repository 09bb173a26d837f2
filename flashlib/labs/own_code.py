"""Whether a lab's answer is the course's own code: the function itself, a copy of its code, or a call to it.

A lab asks the learner to write a step the course already has (its "answers", :attr:`Lab.answers`).
Handing in that code passes every case and teaches nothing, so the checker refuses it, first by what can
be seen without running anything (:func:`used`):

- the function is the course's (through ``functools.partial``, ``functools.wraps``, a bound method, a
  Triton ``@jit`` wrapper or a callable object's ``__call__``);
- its code is the course's code object, or a copy of it: the same instructions, local names aside;
- it reaches the course's function: through the globals its code names (``flashlib.tiled.tiled_forward``
  is followed attribute by attribute), its closure, its defaults, and the functions among them in turn
  (the walk over what a function reads that the kernels' memo and the device check take too,
  :func:`flashlib.machinery.captures.functions_reached`).

Then by what runs (:class:`Ran`, around every call of the learner's function while a lab is checked):
a profiler records every function that ran, so a call into any of the course's implementations (its
reference modules, its public ops, its kernels, autograd through them) is seen however it was reached
(a name built at run time, an import inside the function, an attribute of an object), and so is a copy
of the course's code made at run time. In a lab whose text asks for the loop (:attr:`Lab.loop`), torch's
``scaled_dot_product_attention`` and ``flex_attention`` are refused too. :func:`copied` finds a copy of a
lab's answers in a cell's source, compiled but never run (the grader's judge, which runs no student code).
A refusal is raised as :class:`Refused`, which no checker catches.

What it cannot see: code run in another thread or process, or a function that switches the profiler off.
"""
from __future__ import annotations

import cProfile
import dis
import functools
import importlib
import sys
import types
from pathlib import Path

from ..course.remote import Refused, checked, checking  # noqa: F401  what a check refuses, and of which lab
from ..machinery.captures import functions_reached

_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}
# forms the interpreter may rewrite once code has run (specialised method loads, cache slots): compared alike
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}
_NO_OP = {"CACHE", "PRECALL", "NOP", "RESUME", "EXTENDED_ARG"}
_MAX_PARTS = 4000  # what the walk looks at (values and their parts), at most: reaching further is not refused
# instructions that name a local variable (or a cell): compared by position, so a renamed local is the same code
_LOCAL_OPS = {"LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK", "MAKE_CELL", "LOAD_CLOSURE", "LOAD_DEREF",
              "STORE_DEREF", "DELETE_DEREF", "LOAD_CLASSDEREF", "COPY_FREE_VARS"}
_PACKAGE = Path(__file__).resolve().parent.parent  # flashlib/
# the course's files that are not its implementations: course support, measurement, set-up
_SUPPORT = ("labs", "course", "bench")
_SUPPORT_FILES = ("__init__.py", "__main__.py", "edition.py", "checks.py", "_mode.py", "config.py")
HELPERS = frozenset({"_finite"})  # a one-line helper a mistake's explanation points at: not an answer alone
MIN_COPY = 40  # instructions: a course function shorter than this may be written alike by chance


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
                  _shape(ins.argval) if isinstance(ins.argval, types.CodeType) else
                  ins.arg if ins.opname in _LOCAL_OPS else repr(ins.argval))
                 for ins in dis.get_instructions(code) if ins.opname not in _NO_OP)


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    return _shape(a) == _shape(b)


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


class _Found(Exception):
    """How the learner's function is or calls the course's own code, in words: stops the walk."""


def used(fn, codes: dict) -> str | None:
    """How ``fn`` is or calls one of the course functions ``codes`` ({code: name}), in words; None if not.
    The functions it is and reaches are those of the walk over what a function reads
    (:func:`flashlib.machinery.captures.functions_reached`)."""
    def visit(function, called: bool):
        code = function.__code__
        for course, name in codes.items():
            if code is course or _same_code(code, course):
                if called:
                    raise _Found(f"your function calls the course's own {name}")
                raise _Found(f"your function is {'' if code is course else 'a copy of '}the course's own {name}")

    try:
        functions_reached(fn, visit, limit=_MAX_PARTS)
    except _Found as found:
        return str(found)
    return None


@functools.lru_cache(maxsize=None)
def implementation(filename: str) -> str | None:
    """The module ("flashlib.tiled") whose file ``filename`` is, if it is one of the course's implementations
    (reference modules, public ops, kernels, the ladder); None for course support and anything else."""
    if filename.startswith("<"):
        return None
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return None
    if path.suffix != ".py" or not path.is_relative_to(_PACKAGE):
        return None
    parts = path.relative_to(_PACKAGE).parts
    if parts[0] in _SUPPORT or parts[-1] in _SUPPORT_FILES:
        return None
    return ".".join(("flashlib", *parts[:-1], path.stem))


@functools.lru_cache(maxsize=None)
def _library(filename: str) -> bool:
    """Whether code of ``filename`` is an installed library's or the course's (not the learner's)."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(_PACKAGE)}
    return any(filename.startswith(root.rstrip("/") + "/") for root in roots)


def _size(code) -> int:
    return sum(1 for c in _nested(code) for _ in dis.get_instructions(c))


@functools.lru_cache(maxsize=None)
def course_shapes() -> dict:
    """{shape: (module.qualname, instructions)} of every function of the course's implementations, compiled
    from their files (nothing imported)."""
    index = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        module = implementation(str(path))
        if module is None:
            continue
        try:
            code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
        except (SyntaxError, OSError, UnicodeDecodeError):
            continue
        for c in _nested(code):
            if c is not code and not c.co_name.startswith("<"):
                index.setdefault(_shape(c), (f"{module}.{c.co_qualname}", _size(c)))
    return index


def _dotted(answers) -> set[str]:
    return {entry.replace(":", ".") for entry in answers}


def copied(source: str, answers) -> str | None:
    """How a cell's ``source`` holds a copy of one of the course functions ``answers`` ("module:function"),
    local names aside, in words; None if it holds none. Compiled only, never run."""
    try:
        code = compile(source, "<cell>", "exec")
    except (SyntaxError, ValueError):
        return None
    wanted = _dotted(answers)
    index = course_shapes()
    for c in _nested(code):
        name, _ = index.get(_shape(c), (None, 0))
        if c is not code and name in wanted:
            return f"your {c.co_name} is a copy of the course's own {name}"
    return None


@functools.lru_cache(maxsize=None)
def _resolved(filename: str) -> str:
    return str(Path(filename).resolve())


@functools.lru_cache(maxsize=None)
def _beside_kernel() -> frozenset:
    """(file, name) of the course's @jit helpers the kernel labs' harness runs around the learner's loop."""
    from . import harness

    found, todo, seen = set(), [harness.lab_attn_fwd, harness.lab_attn_bwd_dkdv], set()
    while todo:
        fn = getattr(todo.pop(), "fn", None)
        if not isinstance(fn, types.FunctionType) or fn in seen:
            continue
        seen.add(fn)
        found.add((_resolved(fn.__code__.co_filename), fn.__name__))
        loads, _ = _names(fn.__code__)
        todo += [fn.__globals__[n] for n in loads if n in fn.__globals__]
    return frozenset(found)


class Ran:
    """What ran while the learner's function ran, for the lab being checked (:func:`checking`); nothing is
    watched outside a check. :meth:`refuse` raises :class:`Refused` when it is not the learner's own."""

    def __init__(self):
        from .catalog import LABS

        self.spec = LABS.get(checked() or "")
        self.profiler = None
        self.switched_off = False

    def __enter__(self):
        if self.spec is not None:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        return self

    def __exit__(self, *exc):
        if self.profiler is not None:
            self.switched_off = sys.getprofile() is not self.profiler
            self.profiler.disable()
        return False

    def refuse(self) -> None:
        found = self.refusal()
        if found is not None:
            raise Refused(*found)

    def refusal(self) -> tuple[str, str] | None:
        """(what was refused, the mistake's key), or None."""
        if self.profiler is None:
            return None
        if self.switched_off:
            return "the profiler that watches what your function runs was switched off during it", "course_code"
        entries = self.profiler.getstats()
        course = sorted((e.totaltime, name) for e in entries if (name := self._course(e.code)) is not None)
        if course:
            return f"your function ran the course's own {course[-1][1]}", "course_code"
        copies = [name for e in entries if (name := self._copy(e.code)) is not None]
        if copies:
            return f"your function ran a copy of the course's own {copies[0]}", "course_code"
        library = next((name for e in entries if (name := self._library_attention(e.code)) is not None), None)
        if library is not None:
            return f"your function called {library}", "library_attention"
        return None

    def _course(self, code) -> str | None:
        if isinstance(code, str) or code.co_name.startswith("<") or code.co_name in HELPERS:
            return None
        module = implementation(code.co_filename)
        if module is None:
            return None
        if self.spec.triton and (_resolved(code.co_filename), code.co_name) in _beside_kernel():
            return None
        return f"{module}.{code.co_qualname}"

    def _copy(self, code) -> str | None:
        if isinstance(code, str) or _library(code.co_filename):
            return None
        name, size = course_shapes().get(_shape(code), (None, 0))
        if name is not None and (size >= MIN_COPY or name in _dotted(self.spec.answers)):
            return name
        return None

    def _library_attention(self, code) -> str | None:
        if not self.spec.loop:
            return None
        if isinstance(code, str):
            return "torch's scaled_dot_product_attention" if "scaled_dot_product" in code else None
        if code.co_name == "flex_attention" and code.co_filename.endswith("flex_attention.py"):
            return "torch's flex_attention"
        return None
