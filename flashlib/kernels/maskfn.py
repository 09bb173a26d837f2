"""Mask functions, as FlexAttention users write them, compiled into the kernels.

A mask function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` runs as it is on PyTorch index tensors
(the references, the block masks, ``flex_attention``). For a kernel it is translated, from its
source, into a ``@triton.jit`` function ``MASK_MOD(b, h, q_idx, kv_idx, data)``:

* what it reads from outside (closure cells, module globals, default arguments) is read again on
  every call: numbers become literals of the generated source (a new value, a new kernel), and
  tensors become loads from ``data``, a tuple of tensors passed at launch (their values are read
  by the kernel itself, so a changed tensor needs no new kernel);
* ``t[q_idx]``, ``t[b, h]``... index a captured tensor (any dtype, any strides, negative indices
  counted from the end, as PyTorch does);
* ``//`` and ``%`` round as PyTorch does (toward -inf), not as Triton does (toward zero);
* ``torch.abs``, ``torch.where``, ``torch.minimum``, ``torch.maximum``, the builtin ``abs``,
  ``& | ~ ^``, ``+ - * /``, comparisons, other plain functions it calls (compiled the same way),
  and ``torch.nn.attention.flex_attention``'s ``and_masks``, ``or_masks`` and ``noop_mask``.

Anything else (``and``/``or``/``not``, ``if``, loops, ``x if c else y``, ``**``, attributes of the
indices, calls to other libraries) is refused with one short TypeError naming the construct, its
line and what to write instead, before anything compiles.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import inspect
import linecache
import numbers
import textwrap
import types
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch.nn.attention import flex_attention as _flex

from ._mode import require_triton
from .rules import _floordiv, _floormod

triton = require_triton()
import triton.language as tl  # noqa: E402

_TORCH_CALLS = {"abs": "tl.abs", "where": "tl.where", "minimum": "tl.minimum", "maximum": "tl.maximum"}
_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift, ast.RShift)
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# what a construct the kernels cannot compile should be written as
_FIXES = {
    ast.BoolOp: "'and'/'or' need Python booleans: write (a) & (b) or (a) | (b), with parentheses",
    ast.IfExp: "'x if c else y' needs a Python boolean: write torch.where(c, x, y)",
    ast.If: "'if' needs a Python boolean: compute both sides and pick with torch.where(c, x, y)",
    ast.For: "a loop cannot run on index tensors: write the terms out, or combine masks with and_masks/or_masks",
    ast.While: "a loop cannot run on index tensors: write the terms out",
    ast.Lambda: "a lambda inside a mask function: write a def beside it and call that",
    ast.Pow: "'**' on indices: write x * x",
    ast.Tuple: "a tuple: a mask function returns one boolean tensor",
}


class KernelMask(NamedTuple):
    """A mask function as the kernels call it: the compiled ``MASK_MOD``, its ``data`` (a tuple of
    the tensors it reads, on the kernels' device; None when it reads none) and the generated
    Triton source (``MASK_MOD`` is its first function, the ones it calls follow)."""

    jit: object
    data: tuple | None
    source: str


_COMPILED: OrderedDict = OrderedDict()  # generated source -> its @triton.jit functions
_MAX_COMPILED = 256


def compile_mask(fn: str, mask_mod, device) -> KernelMask:
    """The kernels' MASK_MOD for ``mask_mod`` as it reads its data now (see the module docstring)."""
    unit = _Unit(fn, device)
    top = unit.function(mask_mod)
    source = "\n\n".join(unit.sources)
    if source not in _COMPILED:
        _COMPILED[source] = _exec(source)
        if len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(source)
    return KernelMask(_COMPILED[source][top], tuple(unit.tensors) or None, source)


def _exec(source: str) -> dict:
    """The generated functions, each a @triton.jit function; their source is registered with
    linecache, where Triton's JIT (and a traceback) read it."""
    filename = f"<flashlib mask {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"__name__": "flashlib.kernels.maskfn.generated", "tl": tl, "_floordiv": _floordiv,
             "_floormod": _floormod, "_gather": _gather, "_index_offset": _index_offset,
             "_index_offset64": _index_offset64, "_index_ok": _index_ok}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102  (source generated above, from a parsed function)
    names = [name for name in scope if name.startswith("_mask_")]
    for name in names:
        scope[name] = triton.jit(scope[name])
    return {name: scope[name] for name in names}


@triton.jit
def _index_offset(i, size, stride):
    """The element offset of index i along a dim of ``size`` (negative: from the end, as PyTorch)."""
    return tl.where(i < 0, i + size, i) * stride


@triton.jit
def _index_offset64(i, size, stride):
    """_index_offset in int64, for a tensor whose elements lie 2^31 or more apart."""
    return tl.where(i < 0, i + size, i).to(tl.int64) * stride


@triton.jit
def _index_ok(i, size):
    return (i >= -size) & (i < size)


@triton.jit
def _gather(Ptr, offset, ok):
    """Ptr[offset] where ok; indices of padding rows and columns (past the sequences) read 0."""
    return tl.load(Ptr + offset, mask=ok, other=0)


# ----- from a Python function to generated source --------------------------------------------------

def _and_or_codes():
    """The code objects of flex_attention's combinators, so that their closures are recognised."""
    noop = _flex.noop_mask
    return _flex.and_masks(noop).__code__, _flex.or_masks(noop).__code__


_AND_CODE, _OR_CODE = _and_or_codes()


class _Unit:
    """One compilation: the generated functions' sources, and the tensors they read (data slots)."""

    def __init__(self, fn: str, device):
        self.fn, self.device = fn, device
        self.sources: list[str] = []
        self.tensors: list[torch.Tensor] = []  # as the kernels read them
        self.captured: list[torch.Tensor] = []  # as the mask function holds them
        self.names: dict[int, str] = {}  # id(function) -> generated name, while this unit lives
        self.keep: list = []  # the functions named, alive so that their ids stay theirs

    def fail(self, what: str, fix: str, where: str = "") -> TypeError:
        return TypeError(f"{self.fn}: argument 'mask_mod': {what}{where} cannot be compiled into the kernels; {fix}")

    def function(self, f) -> str:
        """The generated name of Python function f (compiled on first use in this unit)."""
        if id(f) in self.names:
            return self.names[id(f)]
        if not isinstance(f, types.FunctionType):
            raise self.fail(f"{type(f).__name__} {f!r}", "a mask function must be a def or a closure (not a "
                            "functools.partial, a class instance or a builtin)")
        name = self.names[id(f)] = f"_mask_{len(self.names)}"
        self.keep.append(f)
        if f.__code__ in (_AND_CODE, _OR_CODE):
            self.sources.append(self._combinator(f, name))
        elif f is _flex.noop_mask:
            self.sources.append(f"def {name}(b, h, q_idx, kv_idx, data):\n    return True\n")
        else:
            self.sources.append(_Translator(self, f).source(name))
        return name

    def _combinator(self, f, name: str) -> str:
        """and_masks(m1, m2, ...) / or_masks(...): the masks' calls joined by & or |."""
        mods = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__)))["mask_mods"]
        join, empty = (" & ", "True") if f.__code__ is _AND_CODE else (" | ", "False")
        calls = [f"{self.function(m)}(b, h, q_idx, kv_idx, data)" for m in mods]
        return f"def {name}(b, h, q_idx, kv_idx, data):\n    return {join.join(f'({c})' for c in calls) or empty}\n"

    def tensor(self, t: torch.Tensor) -> int:
        """The data slot of a captured tensor (on the kernels' device)."""
        for slot, seen in enumerate(self.captured):
            if seen is t:
                return slot
        self.captured.append(t)
        self.tensors.append(_narrow(t.to(self.device)))
        return len(self.tensors) - 1


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """int64 data whose values fit in int32, as an int32 copy (read at this call, like the rest): a
    tile of int64 comparisons holds twice the registers, and spilled the document mask's forward."""
    if t.dtype == torch.int64 and t.numel() and bool((t.min() >= -2**31) & (t.max() < 2**31)):
        return t.to(torch.int32)
    return t


def _function_node(unit: _Unit, f):
    """The ast node (FunctionDef or Lambda) of f's source."""
    label = getattr(f, "__qualname__", f.__name__)
    try:
        source = textwrap.dedent(inspect.getsource(f))
    except (OSError, TypeError) as exc:
        raise unit.fail(f"{label}, whose source cannot be read ({exc}),",
                        "the kernels compile a mask function from its source: define it with def in a file or "
                        "a notebook cell") from None
    if f.__name__ == "<lambda>":
        lambdas = [n for n in ast.walk(ast.parse(_whole_statement(source))) if isinstance(n, ast.Lambda)]
        if len(lambdas) != 1:
            raise unit.fail(f"a lambda on a line of {len(lambdas)} lambdas",
                            "write the mask function as a def")
        return lambdas[0], f.__code__.co_firstlineno
    return ast.parse(source).body[0], f.__code__.co_firstlineno


def _whole_statement(source: str) -> str:
    """A lambda's source lines as a statement that parses (getsource may stop inside brackets)."""
    for end in range(len(source), 0, -1):
        try:
            ast.parse(source[:end])
            return source[:end]
        except SyntaxError:
            continue
    return source


class _Translator(ast.NodeTransformer):
    """One Python function's body as Triton source: names resolved, operators PyTorch's."""

    def __init__(self, unit: _Unit, f):
        self.unit, self.f = unit, f
        self.label = getattr(f, "__qualname__", f.__name__)
        self.node, self.first_line = _function_node(unit, f)
        code = f.__code__
        self.params = list(code.co_varnames[:code.co_argcount])
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in f.__closure__ or ())))
        defaults = dict(zip(self.params[len(self.params) - len(f.__defaults__ or ()):], f.__defaults__ or ()))
        self.outside = {**vars(builtins), **f.__globals__, **cells}
        self.params = self.params[:len(self.params) - len(defaults)]
        self.locals = set(self.params)
        self.assigned: set[str] = set()  # names the body assigns (a parameter reassigned may be negative)
        self.defaults = defaults

    def where(self, node) -> str:
        return f" (in {self.label}, line {self.first_line + getattr(node, 'lineno', 1) - 1})"

    def fail(self, node, what: str, fix: str) -> TypeError:
        return self.unit.fail(what, fix, self.where(node))

    def source(self, name: str) -> str:
        data = "data" if "data" not in self.params else "_data_"
        self.data = data
        lines = [f"def {name}({', '.join(self.params + [data])}):"]
        for key, value in self.defaults.items():
            lines.append(f"    {key} = {ast.unparse(self.value(self.node, key, value))}")
            self.locals.add(key)
        body = [ast.Return(self.node.body)] if isinstance(self.node, ast.Lambda) else self.node.body
        for i, stmt in enumerate(body):
            if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # the docstring
            lines.append("    " + self.statement(stmt))
        if not isinstance(body[-1], ast.Return):
            raise self.fail(body[-1], "a mask function that does not end with return", "end it with return <mask>")
        return "\n".join(lines) + "\n"

    def statement(self, stmt) -> str:
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            return "return " + ast.unparse(self.visit(stmt.value))
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = ast.unparse(self.visit(stmt.value))
            self.locals.add(stmt.targets[0].id)
            self.assigned.add(stmt.targets[0].id)
            return f"{stmt.targets[0].id} = {value}"
        raise self.fail(stmt, f"a statement '{type(stmt).__name__.lower()}'",
                        _FIXES.get(type(stmt), "a mask function is assignments of names and one return"))

    # ----- expressions ----------------------------------------------------------------------------

    def generic_visit(self, node):
        raise self.fail(node, f"'{ast.unparse(node)}' ({type(node).__name__})",
                        _FIXES.get(type(node), "write it with the indices, numbers, captured tensors indexed by "
                                               "them, & | ~, arithmetic, comparisons and torch.where/abs/minimum/"
                                               "maximum"))

    def visit_Constant(self, node):
        if isinstance(node.value, (bool, int, float)):
            return node
        return self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.locals:
            return ast.Name(self.data if node.id == "data" else node.id, ast.Load())
        if node.id not in self.outside:
            raise self.fail(node, f"the name '{node.id}'", "it is not defined where the mask function is")
        return self.value(node, node.id, self.outside[node.id])

    def value(self, node, name: str, value):
        """A value read from outside the function, as source: a literal, or a 0-d tensor's load."""
        if isinstance(value, (bool, numbers.Integral, numbers.Real)) and not isinstance(value, torch.Tensor):
            return ast.Constant(value if isinstance(value, bool) else
                                int(value) if isinstance(value, numbers.Integral) else float(value))
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            return self.load(node, value, [])
        if isinstance(value, torch.Tensor):
            raise self.fail(node, f"the tensor '{name}' {tuple(value.shape)} used without an index",
                            f"index it with the indices, e.g. {name}[q_idx]")
        raise self.fail(node, f"'{name}' ({type(value).__name__})", "a mask function reads numbers and tensors "
                        "indexed by b, h, q_idx or kv_idx")

    def visit_Attribute(self, node):
        base = node.value
        if isinstance(base, ast.Name) and base.id not in self.locals and base.id in self.outside:
            owner = self.outside[base.id]
            if not isinstance(owner, types.ModuleType) and hasattr(owner, node.attr):
                return self.value(node, ast.unparse(node), getattr(owner, node.attr))
        return self.generic_visit(node)

    def visit_Subscript(self, node):
        tensor = self.captured_tensor(node.value)
        index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(i, ast.Slice) for i in index) or len(index) != tensor.ndim:
            raise self.fail(node, f"'{ast.unparse(node)}' (a {tensor.ndim}-d tensor with {len(index)} indices)",
                            f"give one index per dim, no slices: the kernels read one element at a time")
        return self.load(node, tensor, [self.visit(i) for i in index])

    def captured_tensor(self, node) -> torch.Tensor:
        value = None
        if isinstance(node, ast.Name) and node.id not in self.locals:
            value = self.outside.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            value = getattr(self.outside.get(node.value.id), node.attr, None)
        if not isinstance(value, torch.Tensor):
            raise self.fail(node, f"indexing '{ast.unparse(node)}'", "only a tensor captured by the mask function "
                            "(a closure cell or a global) can be indexed")
        if value.is_complex():
            raise self.fail(node, f"the complex tensor '{ast.unparse(node)}'", "use an integer, bool or real tensor")
        return value

    def load(self, node, tensor: torch.Tensor, index: list):
        slot = self.unit.tensor(tensor)
        moved = self.unit.tensors[slot]
        # int64 offsets only for a tensor whose elements lie 2^31 or more apart (registers are dear)
        wide = sum((size - 1) * abs(stride) for size, stride in zip(moved.shape, moved.stride())) >= 2**31
        offsets, oks = [], []
        for i, size, stride in zip(index, moved.shape, moved.stride()):
            text = ast.unparse(i)
            if text in self.params[:4] and text not in self.assigned and not wide:
                # an index itself: never negative, past the end only on padding rows and columns
                offsets.append(f"{text} * {stride}")
                oks.append(f"({text} < {size})")
            else:
                offsets.append(f"{'_index_offset64' if wide else '_index_offset'}({text}, {size}, {stride})")
                oks.append(f"_index_ok({text}, {size})")
        text = f"_gather({self.data}[{slot}], {' + '.join(offsets) or '0'}, {' & '.join(oks) or 'True'})"
        return ast.parse(text, mode="eval").body

    def visit_BinOp(self, node):
        left, right = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            helper = "_floordiv" if isinstance(node.op, ast.FloorDiv) else "_floormod"
            return ast.Call(ast.Name(helper, ast.Load()), [left, right], [])
        if not isinstance(node.op, _OPERATORS):
            raise self.fail(node, f"the operator in '{ast.unparse(node)}'",
                            _FIXES.get(type(node.op), "use + - * / // % & | ^ << >>"))
        return ast.BinOp(left, node.op, right)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            raise self.fail(node, f"'{ast.unparse(node)}'", "'not' needs a Python boolean: write ~(x)")
        return ast.UnaryOp(node.op, self.visit(node.operand))

    def visit_Compare(self, node):
        if len(node.ops) != 1 or not isinstance(node.ops[0], _COMPARISONS):
            raise self.fail(node, f"the comparison '{ast.unparse(node)}'",
                            "compare two values at a time and join with &: (a < b) & (b < c)")
        return ast.Compare(self.visit(node.left), node.ops, [self.visit(node.comparators[0])])

    def visit_Call(self, node):
        if node.keywords:
            raise self.fail(node, f"keyword arguments in '{ast.unparse(node)}'", "pass the arguments by position")
        args = [self.visit(a) for a in node.args]
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and self.outside.get(func.value.id) is torch and func.attr in _TORCH_CALLS:
            return ast.Call(ast.parse(_TORCH_CALLS[func.attr], mode="eval").body, args, [])
        target = self.outside.get(func.id) if isinstance(func, ast.Name) and func.id not in self.locals else None
        if target is builtins.abs:
            return ast.Call(ast.parse("tl.abs", mode="eval").body, args, [])
        if isinstance(target, types.FunctionType):
            name = self.unit.function(target)
            return ast.Call(ast.Name(name, ast.Load()), args + [ast.Name(self.data, ast.Load())], [])
        raise self.fail(node, f"the call '{ast.unparse(node)}'", "call torch.where, torch.abs, torch.minimum, "
                        "torch.maximum, abs, or another def written the same way")
