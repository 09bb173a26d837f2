"""What a mask function does, found by calling it on symbolic indices.

:func:`trace` calls the function once with stand-ins (:class:`Traced`) for its arguments. Every
operator, every ``torch`` function and every index into a captured tensor that meets a stand-in
records a :class:`Node` instead of computing, so the result is the expression graph of what the
function computes, read from its behaviour and not from its source text: a lambda written over
several lines, a function wrapped by a decorator, a helper called with shifted indices, a
``functools.partial``, flex_attention's ``and_masks``/``or_masks``, locals of any name, all trace
alike. Python numbers it reads become constants; tensors it indexes (or 0-d tensors it uses)
become loads, whose values the kernel reads at launch.

Each node carries two facts that let a kernel compute exactly what PyTorch computes:

* its dtype, PyTorch's own: found by applying the same operation to one-element stand-in tensors,
  so type promotion is PyTorch's (an index is int64, ``q_idx / 2`` float32, int8 data stays int8);
* for integers and booleans, an interval holding every value it can take for the given bounds of
  the indices. A kernel's indices are int32; where an interval leaves int32, the kernel computes
  that node in int64, as PyTorch's int64 indices do (and wraps where they wrap).

What cannot be evaluated on whole tiles of indices at once (a Python truth value of a traced value:
``if``, ``and``, ``or``, ``not``, ``x if c else y``, ``a < b < c``, ``min``/``max``; a loop over one;
a conversion to a Python number; a captured tensor used whole; a call not in the table below)
raises :class:`TraceError` with the construct, where it is and what to write instead.

No Triton here: the graph is turned into a kernel's source by :mod:`flashlib.kernels.maskfn`.
"""
from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from .refusals import TraceError, _truth_construct, refusal  # noqa: F401 (refusal: re-exported)

INT_RANGES = {dtype: (int(torch.iinfo(dtype).min), int(torch.iinfo(dtype).max))
              for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)}
INT32 = INT_RANGES[torch.int32]


@dataclass(eq=False)
class Node:
    """One value of the traced function. op: "sym" (an argument), "const", "load" (of data slot
    ``value``; args are the indices), or an operation of :data:`OPS`; lo..hi bounds an integer or
    boolean (None for floats)."""

    op: str
    args: tuple
    dtype: torch.dtype
    lo: int | None
    hi: int | None
    value: object = None  # the constant, the argument's name, the slot, the target dtype of a cast
    example: object = field(default=None, repr=False)  # what PyTorch would hold: for dtype promotion
    launch: bool = False  # a constant whose value the kernel is given at launch (not written into its source)

    @property
    def is_int(self) -> bool:
        return self.lo is not None and self.dtype is not torch.bool


@dataclass
class Graph:
    """A traced function: its arguments' nodes, the result, and the tensors it reads (slots)."""

    symbols: dict
    result: Node
    tensors: list
    tracer: object = None  # where more nodes of the same graph are made (a derivative's)
    read: frozenset = frozenset()  # ids of the tensors the function read in Python while traced (t[0], t.max())


# ----- intervals ----------------------------------------------------------------------------------

def _full(dtype):
    return (0, 1) if dtype is torch.bool else INT_RANGES.get(dtype, (None, None))


def _clamped(lo, hi, dtype):
    """lo..hi if it fits dtype; else dtype's whole range (PyTorch wraps there, and so will the kernel)."""
    if lo is None or dtype.is_floating_point:
        return None, None
    full = _full(dtype)
    return (lo, hi) if full[0] <= lo and hi <= full[1] else full


def _corners(f, a, b):
    values = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return min(values), max(values)


def _bits(n: int) -> int:
    return (1 << max(n, 0).bit_length()) - 1


def _interval(op, args, dtype):
    """Bounds of op(*args) from its operands' bounds (before clamping to dtype)."""
    if dtype is torch.bool:
        return 0, 1
    if op == "cast" and args[0].lo is None and not dtype.is_floating_point:
        return _full(dtype)  # a float made an integer (T5's log-bucket): any value of the dtype
    if dtype.is_floating_point or any(a.lo is None for a in args):
        return None, None
    a, b = (args + (None,))[:2]
    if op in ("add", "sub", "mul"):
        f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}[op]
        return _corners(f, a, b)
    if op == "floordiv":
        if b.lo > 0 or b.hi < 0:
            return _corners(operator.floordiv, a, b)
        bound = max(abs(a.lo), abs(a.hi))
        return -bound, bound
    if op == "mod":
        if b.lo > 0:
            return 0, b.hi - 1
        if b.hi < 0:
            return b.lo + 1, 0
        bound = max(abs(b.lo), abs(b.hi))
        return -bound, bound
    if op in ("and", "or", "xor"):
        if a.lo >= 0 and b.lo >= 0:
            return (0, min(a.hi, b.hi)) if op == "and" else (0, _bits(max(a.hi, b.hi)))
        return _full(torch.int64)
    if op == "lshift" and a.lo >= 0 and 0 <= b.lo and b.hi < 64:
        return a.lo << b.lo, a.hi << b.hi
    if op == "rshift" and b.lo >= 0:
        return min(a.lo, 0) if a.lo < 0 else a.lo >> b.hi, a.hi >> b.lo if a.hi >= 0 else 0
    if op == "neg":
        return -a.hi, -a.lo
    if op == "invert":
        return -a.hi - 1, -a.lo - 1
    if op == "abs":
        return (a.lo, a.hi) if a.lo >= 0 else (0 if a.hi >= 0 else -a.hi, max(-a.lo, a.hi))
    if op == "where":
        return min(args[1].lo, args[2].lo), max(args[1].hi, args[2].hi)
    if op in ("minimum", "maximum"):
        f = min if op == "minimum" else max
        return f(a.lo, b.lo), f(a.hi, b.hi)
    if op == "cast":
        return a.lo, a.hi
    return _full(torch.int64)


# ----- the operations a stand-in records ---------------------------------------------------------

# name -> how PyTorch computes it on the stand-in examples (for the result's dtype)
OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne, "neg": operator.neg, "invert": operator.invert, "abs": torch.abs,
    "where": torch.where, "minimum": torch.minimum, "maximum": torch.maximum,
    # float functions, for score functions (their derivatives: flashlib.kernels.scorefn)
    "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "sigmoid": torch.sigmoid,
}
FLOAT_FUNCTIONS = ("tanh", "exp", "log", "sqrt", "sigmoid")
_PYTHON_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
               "floordiv": operator.floordiv, "mod": operator.mod, "and": operator.and_, "or": operator.or_,
               "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift, "lt": operator.lt,
               "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
               "neg": operator.neg, "invert": operator.invert, "abs": abs}


def _own(method):
    """A Tracer method whose PyTorch calls (on its one-element stand-ins) are the trace's own, not the
    function's reads: run with torch functions' overrides off (and so unseen by _Reads, and faster)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return method(*args, **kwargs)
    return run


class Tracer:
    """The nodes of one trace, shared where equal (the same operation of the same operands)."""

    def __init__(self, device=None, literals=None):
        self.device = device
        self.memo: dict = {}
        self.tensors: list[torch.Tensor] = []
        # ids of the numbers written in the function's code (and the code it calls); any other number it
        # computes with (captured, or computed from captured ones) is given to the kernel at launch, so
        # that a new value writes the same source. None: every number is written into the source.
        self.literals = literals
        self.read: set[int] = set()

    def node(self, op, args, dtype, lo, hi, value=None, example=None, launch=False) -> Node:
        key = (op, tuple(id(a) for a in args), dtype, value, launch)
        if key not in self.memo:
            lo, hi = _clamped(lo, hi, dtype)
            self.memo[key] = Node(op, args, dtype, lo, hi, value, example, launch)
        return self.memo[key]

    def travels(self, value) -> bool:
        """Whether a number the function computes with is given to the kernel at launch."""
        return self.literals is not None and not isinstance(value, bool) and id(value) not in self.literals

    @_own
    def symbol(self, name: str, lo, hi, dtype=torch.int64) -> Node:
        """An argument: an int64 index in lo..hi, or (dtype floating) a value such as a score."""
        return self.node("sym", (), dtype, lo, hi, name, torch.ones(1, dtype=dtype))

    def const(self, value, launch: bool = False) -> Node:
        """A number; launch: its value is given to the kernel at launch, not written into the source."""
        if isinstance(value, bool):
            return self.node("const", (), torch.bool, int(value), int(value), value, value)
        if isinstance(value, numbers.Integral):
            value = int(value)
            if not INT_RANGES[torch.int64][0] <= value <= INT_RANGES[torch.int64][1]:
                raise TraceError(f"the number {value}", "it does not fit int64, PyTorch's index dtype: use a "
                                 "smaller one")
            return self.node("const", (), torch.int64, value, value, value, value, launch)
        if isinstance(value, numbers.Real):
            return self.node("const", (), torch.get_default_dtype(), None, None, float(value), float(value), launch)
        raise TraceError(f"the value {value!r} ({type(value).__name__})",
                         "a mask function computes with its indices, numbers and tensors indexed by them")

    def tensor_value(self, t: torch.Tensor) -> Node:
        """A 0-d captured tensor as a value: a load of its one element."""
        if t.ndim:
            raise TraceError(f"a captured tensor of shape {tuple(t.shape)} used whole",
                             "index it with the indices (e.g. t[q_idx] or t[h, q_idx]): the kernel reads one "
                             "element per (query, key) pair")
        return self.load(t, [])

    def slot(self, t: torch.Tensor) -> int:
        for i, seen in enumerate(self.tensors):
            if seen is t:
                return i
        if t.is_complex() or t.dtype not in (torch.bool, *INT_RANGES, torch.float16, torch.bfloat16,
                                             torch.float32, torch.float64):
            raise TraceError(f"a captured tensor of dtype {t.dtype}", "use a bool, integer or real tensor")
        self.tensors.append(t)
        return len(self.tensors) - 1

    @_own
    def load(self, t: torch.Tensor, index: list) -> Node:
        slot = self.slot(t)
        lo, hi = value_bounds(t)
        example = torch.ones(1 if any(i.example is not None and _dimensioned(i.example) for i in index) else (),
                             dtype=t.dtype)
        return self.node("load", tuple(index), t.dtype, lo, hi, slot, example)

    @_own
    def apply(self, op: str, *args, value=None) -> Node:
        """op on nodes (Python numbers folded where every operand is one; given at launch if one was);
        value: what tells apart nodes of one op (a clamp's "clamp", differentiated as torch.clamp)."""
        if all(a.op == "const" for a in args) and op in _PYTHON_OPS:
            try:
                return self.const(_PYTHON_OPS[op](*(a.value for a in args)), any(a.launch for a in args))
            except (ArithmeticError, TypeError):
                pass
        if op in ("and", "or") and all(a.dtype is torch.bool for a in args):
            for const, other in (args, args[::-1]):
                if const.op == "const":  # and_masks starts from True, or_masks from False
                    keeps = bool(const.value) == (op == "and")
                    return other if keeps else const
        examples = [a.example for a in args]
        if op in ("minimum", "maximum"):  # these take tensors only; a 0-d one promotes as a number does
            examples = [e if isinstance(e, torch.Tensor) else torch.tensor(e) for e in examples]
        try:
            example = OPS[op](*examples)
        except (RuntimeError, TypeError) as exc:
            kinds = ", ".join(str(a.dtype).replace("torch.", "") for a in args)
            raise TraceError(f"'{op}' of ({kinds}) values", f"PyTorch refuses it too ({str(exc).splitlines()[0]})")
        example = example if isinstance(example, torch.Tensor) else torch.tensor(example)
        if op in ("neg",) and example.dtype is torch.bool:
            raise TraceError("'-' of a boolean", "use ~ for not")
        lo, hi = _interval(op, args, example.dtype)
        return self.node(op, args, example.dtype, lo, hi, value, _shaped(example, examples))

    @_own
    def cast(self, a: Node, dtype: torch.dtype) -> Node:
        if dtype == a.dtype:
            return a
        if a.op == "const":  # a number given a dtype (new_ones((), dtype=torch.bool)): a 0-d tensor
            value = torch.tensor(a.value, dtype=dtype).item()
            lo = None if dtype.is_floating_point else int(value)
            launch = a.launch and dtype is not torch.bool
            return self.node("const", (), dtype, lo, lo, value, torch.tensor(value, dtype=dtype), launch)
        lo, hi = (0, 1) if dtype is torch.bool else _interval("cast", (a,), dtype)
        return self.node("cast", (a,), dtype, lo, hi, dtype, _shaped(torch.ones((), dtype=dtype), [a.example]))


def value_bounds(t: torch.Tensor) -> tuple:
    """(lo, hi) of the values a tensor holds, as a trace bounds its loads: (0, 1) for a boolean, (None,
    None) for a float, its least and greatest element for an integer one (one pass over it)."""
    if t.dtype is torch.bool:
        return 0, 1
    if t.dtype.is_floating_point:
        return None, None
    if t.numel() == 0:
        return 0, 0
    with torch._C.DisableTorchFunction():  # the trace's own read, not the function's
        # not through numpy: a numpy view of a tensor makes its storage unresizable for good (t.resize_ fails)
        lo, hi = torch.aminmax(t.detach().reshape(-1))
        if t.device.type == "cpu":
            return int(lo), int(hi)
        lo, hi = torch.stack((lo, hi)).tolist()  # one transfer from the device
        return int(lo), int(hi)


def _dimensioned(example) -> bool:
    return isinstance(example, torch.Tensor) and example.ndim > 0


def _shaped(example: torch.Tensor, operands) -> torch.Tensor:
    """A one-element stand-in of example's dtype: 1-d if any operand is (PyTorch promotes a
    dimensioned tensor over a 0-d one or a number), else 0-d."""
    return torch.ones(1 if any(_dimensioned(e) for e in operands) else (), dtype=example.dtype)


# ----- the stand-in ------------------------------------------------------------------------------

def _refuse(what, fix):
    def method(self, *args, **kwargs):
        raise TraceError(what, fix)
    return method


_BINARY = {"__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "truediv",
           "__floordiv__": "floordiv", "__mod__": "mod", "__and__": "and", "__or__": "or", "__xor__": "xor",
           "__lshift__": "lshift", "__rshift__": "rshift", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
           "__ge__": "ge", "__eq__": "eq", "__ne__": "ne"}
_UNARY = {"__neg__": "neg", "__invert__": "invert", "__abs__": "abs"}
_CASTS = {"int": torch.int32, "long": torch.int64, "bool": torch.bool, "float": torch.float32,
          "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class Traced:
    """A stand-in for an index tensor (or a value computed from one) during :func:`trace`."""

    __slots__ = ("tracer", "node")
    __hash__ = object.__hash__

    def __init__(self, tracer: Tracer, node: Node):
        self.tracer, self.node = tracer, node

    def __repr__(self) -> str:
        return f"Traced({self.node.op}, {self.node.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in _flat(args, kwargs or {}) if isinstance(a, Traced))
        return _torch_call(tracer, func, args, kwargs or {})

    def __pow__(self, exponent):
        if not isinstance(exponent, numbers.Integral) or isinstance(exponent, bool) or not 0 <= exponent <= 8:
            raise TraceError("'**' with this exponent", "a small whole power is x * x; anything else needs a float "
                             "function the kernels' masks do not take")
        one = self.tracer.const(1)  # x ** 0 is a one of x's dtype, as PyTorch's (an index's: int64)
        result = self.tracer.cast(one, self.node.dtype) if self.node.dtype.is_floating_point else one
        for _ in range(int(exponent)):
            result = self.tracer.apply("mul", result, self.node)
        return Traced(self.tracer, result)

    @property
    def dtype(self):
        return self.node.dtype

    @property
    def device(self):
        return torch.device("cpu") if self.tracer.device is None else torch.device(self.tracer.device)

    def __getattr__(self, name):
        if name.startswith("__"):  # protocols (numpy's, copy's...) probe for these: not ours
            raise AttributeError(name)
        method = getattr(torch.Tensor, name, None)
        if method is not None and callable(method):  # _torch_call takes or refuses it
            return lambda *args, **kwargs: _torch_call(self.tracer, method, (self, *args), kwargs)
        raise TraceError(f"the attribute '.{name}' of a traced index",
                         "a mask function sees its indices only through operators and torch.where/abs/minimum/"
                         "maximum/clamp and the methods of the same names")

    def __bool__(self):
        raise TraceError(*_truth_construct())

    __iter__ = _refuse("a loop or unpacking over a traced index", "write the terms out, or combine masks with "
                       "and_masks/or_masks")
    __len__ = _refuse("len() of a traced index", "the kernel sees one (query, key) pair at a time")
    __index__ = _refuse("a traced index where Python needs an int (a slice bound, a list's index, range())",
                        "index one element, t[q_idx]; for a list of values, torch.tensor(values)[q_idx]")
    __int__ = __float__ = __complex__ = _refuse(
        "a traced value turned into a Python number (int(), float(), math.*, numpy)",
        "use torch functions and operators, which the kernel can evaluate on tiles")
    __getitem__ = _refuse("indexing a traced index", "index a captured tensor with it instead: t[q_idx]")
    __setitem__ = _refuse("assigning into a traced index", "compute a new value instead")


def _binary(op):
    return lambda self, other: Traced(self.tracer, self.tracer.apply(op, self.node, _as_node(self.tracer, other)))


def _reflected(op):
    return lambda self, other: Traced(self.tracer, self.tracer.apply(op, _as_node(self.tracer, other), self.node))


for _dunder, _op in _BINARY.items():
    setattr(Traced, _dunder, _binary(_op))
    if _op not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Traced, "__r" + _dunder[2:], _reflected(_op))
for _dunder, _op in _UNARY.items():
    setattr(Traced, _dunder, lambda self, _op=_op: Traced(self.tracer, self.tracer.apply(_op, self.node)))
Traced.__pos__ = lambda self: self


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


def _as_node(tracer: Tracer, value) -> Node:
    if isinstance(value, Traced):
        return value.node
    if isinstance(value, torch.Tensor):
        return tracer.tensor_value(value)
    return tracer.const(value, tracer.travels(value))


def _index_list(index) -> list:
    return list(index) if isinstance(index, tuple) else [index]


def _index(tracer: Tracer, t: torch.Tensor, index: list):
    """t[index...] with traced (or constant) indices, every dim at once: a load."""
    for i in index:
        if isinstance(i, (slice, type(Ellipsis))) or i is None:
            raise TraceError(f"indexing a captured tensor with '{i!r}'", "give one index per dim, no slices: the "
                             "kernel reads one element per (query, key) pair")
        if isinstance(i, torch.Tensor) and i.ndim:
            raise TraceError("indexing a captured tensor with a tensor of indices", "index it with the traced "
                             "indices, or numbers")
    if len(index) != t.ndim:
        raise TraceError(f"{len(index)} indices into a captured tensor of {t.ndim} dims",
                         "give one index per dim in one subscript, t[h, q_idx] (on broadcast index tensors, as the "
                         "block mask evaluates it, t[h][q_idx] would index dim 0 twice)")
    nodes = [_as_node(tracer, i) for i in index]
    for n in nodes:
        if not n.is_int:
            raise TraceError(f"a captured tensor indexed by a {str(n.dtype).replace('torch.', '')} value",
                             "index with integers (.long() converts)")
    return Traced(tracer, tracer.load(t, nodes))


_TORCH_OPS = {
    torch.where: "where", torch.abs: "abs", torch.minimum: "minimum", torch.maximum: "maximum",
    torch.logical_and: "logical_and", torch.logical_or: "logical_or", torch.logical_xor: "logical_xor",
    torch.logical_not: "logical_not", torch.bitwise_and: "and", torch.bitwise_or: "or", torch.bitwise_xor: "xor",
    torch.bitwise_not: "invert", torch.remainder: "mod", torch.floor_divide: "floordiv", torch.add: "add",
    torch.sub: "sub", torch.mul: "mul", torch.true_divide: "truediv", torch.eq: "eq", torch.ne: "ne",
    torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.neg: "neg", torch.clamp: "clamp",
    torch.clip: "clamp", torch.div: "div", torch.min: "minimum", torch.max: "maximum",
    torch.tanh: "tanh", torch.exp: "exp", torch.log: "log", torch.sqrt: "sqrt", torch.sigmoid: "sigmoid",
}
_METHODS = {"abs", "where", "minimum", "maximum", "logical_and", "logical_or", "logical_xor", "logical_not",
            "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "remainder", "floor_divide", "add", "sub",
            "mul", "div", "true_divide", "eq", "ne", "lt", "le", "gt", "ge", "neg", "clamp", "clip", "to",
            "new_ones", "new_zeros", "new_full", "type_as", *_CASTS, *FLOAT_FUNCTIONS}
_TENSOR_DUNDERS = {getattr(torch.Tensor, d): (op, False) for d, op in _BINARY.items()}
_TENSOR_DUNDERS.update({getattr(torch.Tensor, "__r" + d[2:]): (op, True) for d, op in _BINARY.items()
                        if hasattr(torch.Tensor, "__r" + d[2:]) and op not in ("lt", "le", "gt", "ge", "eq", "ne")})
_TENSOR_DUNDERS.update({getattr(torch.Tensor, d): (op, False) for d, op in _UNARY.items()})


def _torch_call(tracer: Tracer, func, args, kwargs):
    """A torch function or Tensor method that met a stand-in."""
    if func is torch.Tensor.__getitem__:
        return _index(tracer, args[0], _index_list(args[1]))
    if func in _TENSOR_DUNDERS:
        op, reflected = _TENSOR_DUNDERS[func]
        nodes = [_as_node(tracer, a) for a in args]
        return Traced(tracer, tracer.apply(op, *(nodes[::-1] if reflected else nodes)))
    name = _TORCH_OPS.get(func) or getattr(func, "__name__", "")
    if name in _CASTS or name in ("to", "type_as"):
        target = _CASTS.get(name) or _cast_target(name, args, kwargs)
        return Traced(tracer, tracer.cast(_as_node(tracer, args[0]), target))
    if name in ("new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like"):
        return _filled(tracer, name, args, kwargs)
    if func in _TORCH_OPS or name in _METHODS:
        return Traced(tracer, _combine(tracer, name, args, kwargs))
    name = getattr(func, "__name__", repr(func))
    label = f"the method .{name}()" if getattr(torch.Tensor, name, None) is func else f"the call torch.{name}"
    raise TraceError(f"{label} on a traced index", "the kernels take operators and torch.where, abs, minimum, "
                     "maximum, clamp, remainder, floor_divide, div, the logical_ and bitwise_ functions and, on "
                     "scores, tanh, exp, log, sqrt and sigmoid")


def _cast_target(name, args, kwargs):
    target = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    if name == "type_as":
        target = target.dtype
    if not isinstance(target, torch.dtype):
        raise TraceError(f".{name}() with {target!r}", "give a dtype: .to(torch.int64)")
    return target


def _filled(tracer: Tracer, name, args, kwargs):
    """new_ones(()), zeros_like(q_idx)...: a constant (flex's and_masks and noop_mask start from one)."""
    size = kwargs.get("size", args[1] if len(args) > 1 and name.startswith("new_") else ())
    if tuple(size) not in ((), (1,)):
        raise TraceError(f"{name} of size {tuple(size)}", "a mask function computes one value per pair")
    value = {"ones": 1, "zeros": 0}.get(name.split("_")[1] if name.startswith("new_") else name.split("_")[0])
    if value is None:
        value = kwargs.get("fill_value", args[2] if name == "new_full" else args[1])
    dtype = kwargs.get("dtype") or _as_node(tracer, args[0]).dtype
    return Traced(tracer, tracer.cast(tracer.const(value), dtype))


def _combine(tracer: Tracer, name, args, kwargs):
    nodes = [_as_node(tracer, a) for a in args]
    if name == "where":
        cond, x, y = nodes[0], nodes[1], nodes[2] if len(nodes) > 2 else _as_node(tracer, kwargs["other"])
        return tracer.apply("where", tracer.cast(cond, torch.bool), x, y)
    if name == "clamp":
        low, high = (args[1:] + (None, None))[:2]
        low, high = kwargs.get("min", low), kwargs.get("max", high)
        result = nodes[0]
        if low is not None:
            result = tracer.apply("maximum", result, _as_node(tracer, low), value="clamp")
        if high is not None:
            result = tracer.apply("minimum", result, _as_node(tracer, high), value="clamp")
        return result
    if name.startswith("logical_"):
        bools = [tracer.cast(n, torch.bool) for n in nodes]
        if name == "logical_not":
            return tracer.apply("invert", bools[0])
        return tracer.apply({"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}[name], *bools)
    if name == "div":
        mode = kwargs.get("rounding_mode")
        if mode not in (None, "floor"):
            raise TraceError(f"torch.div with rounding_mode={mode!r}", "use // (floor) or rounding_mode='floor'")
        return tracer.apply("floordiv" if mode == "floor" else "truediv", *nodes)
    op = {"bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor", "bitwise_not": "invert",
          "remainder": "mod", "floor_divide": "floordiv", "true_divide": "truediv"}.get(name, name)
    if op not in OPS or kwargs:
        raise TraceError(f"torch.{name} with these arguments", "pass tensors and numbers by position")
    return tracer.apply(op, *nodes)


class _Reads(TorchFunctionMode):
    """Notes the tensors a traced function reads in Python (``t[0]``, ``int(t.max())``, ``t + 1``): what the
    trace then holds may depend on any of their values. Reads of shapes, dtypes and devices are not noted."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA and getattr(func, "__name__", "") != "__get__":
            values = list(_flat(args, kwargs))
            if not any(isinstance(a, Traced) for a in values):
                self.tracer.read.update(id(a) for a in values if isinstance(a, torch.Tensor))
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.__len__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.storage_offset, torch.Tensor.element_size, torch.Tensor.is_floating_point,
             torch.Tensor.is_complex, torch.Tensor.is_contiguous, torch.Tensor.nelement, torch.Tensor.ndimension,
             torch.Tensor.get_device}


def trace(fn, symbols: dict, *, device=None, floats=(), literals=None) -> Graph:
    """The graph of ``fn(*symbols)``; symbols: {name: (lo, hi)} in the order fn takes them, each an
    int64 index whose values lie in lo..hi, but those named in floats: float32 values (lo, hi None).
    literals: ids of the numbers written in the code fn runs (:func:`flashlib.machinery.captures.literals`):
    any other number becomes a constant given at launch (None: every number is written into the source)."""
    tracer = Tracer(device, literals)
    nodes = {name: tracer.symbol(name, lo, hi, torch.float32 if name in floats else torch.int64)
             for name, (lo, hi) in symbols.items()}
    with _Reads(tracer):
        result = fn(*(Traced(tracer, n) for n in nodes.values()))
    if isinstance(result, Traced):
        return Graph(nodes, result.node, tracer.tensors, tracer, frozenset(tracer.read))
    if isinstance(result, torch.Tensor) and result.ndim:
        raise TraceError(f"a returned tensor of shape {tuple(result.shape)} that does not depend on the indices",
                         "return a comparison of the indices (one boolean per pair)", where="")
    try:
        return Graph(nodes, _as_node(tracer, result), tracer.tensors, tracer, frozenset(tracer.read))
    except TraceError as exc:
        raise TraceError(f"the returned {exc.what}", exc.fix, where="") from None


# ----- the indices a graph reads its tensors at, for a call's index ranges ----------------------------

class _Span(NamedTuple):
    lo: int | None
    hi: int | None


class Outside(NamedTuple):
    """An index that reads outside its tensor: the tensor (its slot and shape), the dim, one index value
    outside and the (b, h, q_idx, kv_idx) it is read at; for an index computed from the score, which no
    host can evaluate, value None, at {} and the bounds lo..hi it may take."""

    slot: int
    shape: tuple
    dim: int
    value: int | None
    at: dict
    lo: int | None = None
    hi: int | None = None


_CELLS = 1 << 22  # the most (b, h, q_idx, kv_idx) combinations evaluated at once


class IndexCheck:
    """Whether a traced function's loads stay inside their tensors for a call's index ranges, as PyTorch
    checks an index (``-size <= i < size``, negative ones counted from the end).

    First by bounds: each index's interval, worked out from the ranges of the arguments as the trace
    works out its own (exact for sums, products and clamps). Where bounds cannot tell (``torch.where``
    joins both branches' intervals: T5's log buckets), by evaluating the index expressions in PyTorch
    on every (b, h, q_idx, kv_idx) of the ranges they use (cost: that many evaluations of the indices
    alone, in blocks of 2^22, on the tensors' device). A verdict that depends on no tensor's values
    is kept per ranges (at most 16)."""

    def __init__(self, graph: Graph):
        self.loads = [(node, tuple(graph.tensors[node.value].shape)) for node in _nodes(graph.result)
                      if node.op == "load" and node.args]
        self._verdicts: dict = {}

    def outside(self, ranges: dict, tensors=()) -> Outside | None:
        """The first index outside its tensor for ``ranges`` ({"b": (lo, hi), "h": .., "q_idx": ..,
        "kv_idx": ..}, inclusive, every one non-empty), or None; tensors: the captured tensors in slot
        order, as the function reads them now (for loads whose indices are themselves loaded)."""
        key = tuple(sorted(ranges.items()))
        if key in self._verdicts:
            return self._verdicts[key]
        spans, found, depends_on_data = {}, None, False
        for node, shape in self.loads:
            for dim, (index, size) in enumerate(zip(node.args, shape)):
                span = _span(index, ranges, spans)
                if -size <= span.lo and span.hi < size:
                    continue
                depends_on_data = depends_on_data or any(n.op == "load" for n in _nodes(index))
                found = _evaluated(node, dim, shape, ranges, tensors)
                if found is not None:
                    break
            if found is not None:
                break
        if not depends_on_data:
            if len(self._verdicts) >= 16:
                self._verdicts.pop(next(iter(self._verdicts)))
            self._verdicts[key] = found
        return found


def _nodes(result: Node) -> list:
    """Every node result is computed from, result included, each once."""
    out, stack, seen = [], [result], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            out.append(node)
            stack.extend(node.args)
    return out


def _span(node: Node, ranges: dict, spans: dict) -> _Span:
    """node's interval when the arguments range over ``ranges`` (a load: the values its tensor held when
    traced, which the memo of traces guards); (None, None) for a float."""
    if id(node) in spans:
        return spans[id(node)]
    if node.op == "sym":
        span = _Span(*ranges.get(node.value, (None, None)))
    elif node.op in ("const", "load") or node.lo is None:
        span = _Span(node.lo, node.hi)
    else:
        args = tuple(_span(a, ranges, spans) for a in node.args)
        span = _Span(*_clamped(*_interval(node.op, args, node.dtype), node.dtype))
    spans[id(node)] = span
    return span


def _uses(node: Node) -> set:
    return {n.value for n in _nodes(node) if n.op == "sym"}


def _boxes(ranges: dict, used: set):
    """Sub-ranges of ranges covering it, each of at most _CELLS combinations of the used arguments."""
    cells = 1
    for name in used:
        cells *= ranges[name][1] - ranges[name][0] + 1
    if cells <= _CELLS:
        yield ranges
        return
    name = max(used, key=lambda n: ranges[n][1] - ranges[n][0])
    lo, hi = ranges[name]
    mid = (lo + hi) // 2
    yield from _boxes({**ranges, name: (lo, mid)}, used)
    yield from _boxes({**ranges, name: (mid + 1, hi)}, used)


def _evaluated(load: Node, dim: int, shape: tuple, ranges: dict, tensors) -> Outside | None:
    """Outside for load's index ``dim`` by evaluating it on every combination of the ranges, or None."""
    index = load.args[dim]
    used = _uses(load)
    if "score" in used:  # an index computed from the score: its values are known only to the kernel
        span = _span(index, ranges, {})
        return Outside(load.value, shape, dim, None, {}, span.lo, span.hi)
    device = next((t.device for t in tensors), torch.device("cpu"))
    for box in _boxes(ranges, used):
        grids = {name: torch.arange(lo, hi + 1, device=device).view([-1 if i == axis else 1 for i in range(4)])
                 for axis, (name, (lo, hi)) in enumerate(sorted(box.items(), key=lambda kv: _AXES[kv[0]]))}
        try:
            _value(load, grids, tensors, {})
        except _OutOfRange as exc:  # this index, or one it is computed from (a load of a load)
            return exc.outside
    return None


_AXES = {"b": 0, "h": 1, "q_idx": 2, "kv_idx": 3}


class _OutOfRange(Exception):
    def __init__(self, outside: Outside):
        self.outside = outside


def _value(node: Node, grids: dict, tensors, memo: dict) -> torch.Tensor:
    """node's values as PyTorch computes them on the index grids (b, h, q_idx, kv_idx broadcast against
    each other); a load whose index leaves its tensor raises _OutOfRange."""
    if id(node) in memo:
        return memo[id(node)]
    op, args = node.op, node.args
    if op == "sym":
        value = grids[node.value]
    elif op == "const":
        value = torch.tensor(node.value, dtype=node.dtype, device=next(iter(grids.values())).device)
    elif op == "load":
        t = tensors[node.value]
        indices = [_value(a, grids, tensors, memo) for a in args]
        for dim, (i, size) in enumerate(zip(indices, t.shape)):
            bad = (i < -size) | (i >= size)
            if bool(bad.any()):  # one pair that reads outside: its coordinates (any value along unused dims)
                spot = bad.nonzero()[0].tolist() if bad.ndim == 4 else [0] * 4
                at = {name: int(g.reshape(-1)[spot[_AXES[name]] if g.numel() > 1 else 0]) for name, g in grids.items()}
                value = int(i.expand(bad.shape)[tuple(spot)] if bad.ndim == 4 else i)
                raise _OutOfRange(Outside(node.value, tuple(t.shape), dim, value, at))
        value = t[tuple(indices)] if indices else t
    elif op == "cast":
        value = _value(args[0], grids, tensors, memo).to(node.value)
    else:
        operands = [_value(a, grids, tensors, memo) for a in args]
        value = OPS[op](*operands).to(node.dtype)
    memo[id(node)] = value
    return value
