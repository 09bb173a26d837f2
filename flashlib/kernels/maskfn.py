"""Mask functions, as FlexAttention users write them, compiled into the kernels.

A mask function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` runs as it is on PyTorch index tensors (the
references, the block masks, ``flex_attention``). For a kernel it is traced (:mod:`flashlib.machinery.trace`:
called once on symbolic indices, so what counts is what it does, not how its source is laid out) and
written out as one ``@triton.jit`` function ``MASK_MOD(b, h, q_idx, kv_idx, data)``:

* what it reads from outside is read again at every call, from ``data``, a tuple passed at launch (in the
  mask bundle, kernels.rules.MaskBundle): the tensors it captures, then the numbers it captures (a window, a
  length: any number its code does not spell out); a new value needs no new kernel, nor do new values in a tensor unless they leave the
  bounds the source was written for;
* ``t[q_idx]``, ``t[b, h]``, ``t[h][q_idx - 5]``... index a captured tensor (any dtype, any strides,
  negative indices counted from the end, as PyTorch does);
* arithmetic is PyTorch's: its dtypes (an index is int64), ``//`` and ``%`` rounding toward -inf, and
  64-bit integers wherever a value can leave int32 for the call's lengths (``q_idx * 10_000_019`` is
  widened first, as PyTorch's int64 would compute it);
* operators, comparisons, ``& | ^ ~``, ``torch.where``/``abs``/``minimum``/``maximum``/``clamp``/
  ``remainder``/``floor_divide``/``div``, the ``logical_`` and ``bitwise_`` functions, their methods,
  ``.to``/``.long()``/``.bool()``..., and any plain function, decorator, ``functools.partial`` or
  ``and_masks``/``or_masks``/``noop_mask`` built from them.

What the kernels cannot evaluate on tiles (``and``/``or``/``not``, ``if``, ``x if c else y``, loops,
conversions to Python numbers, other libraries' calls) is refused with one TypeError that names
``mask_mod``, the construct, the line it is on and what to write instead, before anything compiles.
"""
from __future__ import annotations

import linecache
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from ._mode import interpreting, require_triton
from .rules import _FLOAT32_MAX, _LOG2E, _floordiv, _floormod, _tanh
from .tracememo import TraceMemo, bounds_guard
from ..machinery.captures import literals
from ..machinery.trace import INT32, Graph, IndexCheck, Node, TraceError, _nodes, refusal, trace

triton = require_triton()
import triton.language as tl  # noqa: E402

# the most a kernel adds to a length: its indices run over whole tiles (BLOCK_Q, BLOCK_K <= 256)
TILE_PAD = 256


class KernelMask(NamedTuple):
    """A mask (or score) function as the kernels call it: the compiled ``MASK_MOD`` (``SCORE_MOD``), its
    ``data`` (the tensors it reads, on the kernels' device, then its launch numbers; None if empty), the
    Triton source, the tensors it captured and a score function's index check (None if it indexes none)."""

    jit: object
    data: tuple | None
    source: str
    captured: tuple = ()
    indices: IndexCheck | None = None


_COMPILED: OrderedDict = OrderedDict()  # generated source -> (its @triton.jit function, its linecache name)
_MAX_COMPILED = 256
_LOCK = threading.Lock()  # threads compiling masks at once share _COMPILED and linecache
MEMO = TraceMemo(guard=bounds_guard)


def symbol_bounds(batch=None, heads=None, seq_q=None, seq_k=None) -> dict:
    """{name: (lo, hi)} of the four indices as a kernel passes them: every tile's rows and columns
    (past the lengths by up to a tile); an unknown size bounds its index by int32."""
    def upto(n, pad=0):
        return (0, INT32[1]) if n is None else (0, max(int(n) - 1, 0) + pad)

    return {"b": upto(batch), "h": upto(heads), "q_idx": upto(seq_q, TILE_PAD), "kv_idx": upto(seq_k, TILE_PAD)}


def compile_mask(fn: str, mask_mod, device, bounds: dict | None = None) -> KernelMask:
    """The kernels' MASK_MOD for ``mask_mod`` as it reads its data now; bounds: :func:`symbol_bounds`'s."""
    return KernelMask(*compile_traced(fn, "mask_mod", mask_mod, device, bounds or symbol_bounds(), trace, _mask_source))


def compile_traced(fn: str, argument: str, function, device, bounds: dict, tracer, write) -> tuple:
    """(@triton.jit function, data or None, source, the tensors it reads, what else write() keeps) of a mask
    or score function, written by write(graph, tensors) -> (source, numbers given at launch, what else to
    keep); kept while nothing the function reads changes (:mod:`flashlib.kernels.tracememo`)."""
    def build():
        graph = tracer(function, bounds, device=device, literals=literals(function))
        narrow = _narrow(graph)
        source, numbers, extra = write(graph, list(_data(graph.tensors, narrow, device)))
        compiled(source)
        return (source, narrow, numbers, extra), graph.tensors, graph.read

    (source, narrow, numbers, extra), tensors = memo_get(fn, argument, function, argument, bounds, device, build)
    return compiled(source), (*_data(tensors, narrow, device), *numbers) or None, source, tensors, extra


def memo_get(fn: str, argument: str, function, kind: str, bounds: dict, device, build):
    """MEMO's (kept, tensors) for ``function``; a TraceError of build() refused as one of ``fn``'s argument."""
    def refused():
        try:
            return build()
        except TraceError as exc:
            raise refusal(fn, argument, function, exc) from None

    device = None if device is None else torch.device(device)
    return MEMO.get(function, (kind, tuple(sorted(bounds.items())), device), refused)


def compiled(source: str):
    """The @triton.jit function of a generated source, made once per source; at most _MAX_COMPILED are kept,
    the least recently used dropped first with their linecache entry and the interpreter's rewrite of them."""
    with _LOCK:
        if source not in _COMPILED:
            name = source[4:source.index("(")]  # "def _mask_mod(..."
            number = _NUMBERS.pop() if _NUMBERS else len(_COMPILED)
            filename = f"<flashlib {name.strip('_')} {number}>"
            # registered with linecache, where Triton's JIT (and a traceback) read the source
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            scope = {"__name__": "flashlib.kernels.maskfn.generated", "tl": tl, **_GENERATED_USE}
            exec(compile(source, filename, "exec"), scope)  # noqa: S102  (source written below, from a trace)
            jit = triton.jit(scope[name])
            if interpreting():  # the interpreter reads the source on first use: now, while filename holds it
                jit.rewrite()
            _COMPILED[source] = jit, filename, number
            while len(_COMPILED) > _MAX_COMPILED:
                old, filename, number = _COMPILED.popitem(last=False)[1]
                linecache.cache.pop(filename, None)
                _NUMBERS.append(number)
                if interpreting():
                    from triton.runtime.interpreter import InterpretedFunction

                    InterpretedFunction.rewritten_fn.pop(old.fn, None)
        _COMPILED.move_to_end(source)
        return _COMPILED[source][0]


# the numbers of dropped sources' file names, for the next ones: CPython keeps every file name compile()
# was ever given (about 80 bytes each), so the names are reused, not made anew per source
_NUMBERS: list[int] = []


@triton.jit
def _index_offset(i, size, stride):
    """The element offset of index i along a dim of ``size`` (negative: from the end, as PyTorch)."""
    return tl.where(i < 0, i + size, i) * stride


@triton.jit
def _index_offset64(i, size, stride):
    """_index_offset in int64, for offsets that can pass 2^31."""
    return tl.where(i < 0, i + size, i).to(tl.int64) * stride


@triton.jit
def _index_ok(i, size):
    return (i >= -size) & (i < size)


@triton.jit
def _integral(x, lo, hi):
    """x made ready for a cast to an integer type of range [lo, hi): itself where it fits, else lo, as x86
    gives PyTorch for NaN, infinities and values out of range (T5's log(0) buckets), not an undefined cast."""
    return tl.where((x >= lo) & (x < hi), x, lo)


@triton.jit
def _gather(Ptr, offset, ok):
    """Ptr[offset] where ok; indices of padding rows and columns (past the sequences) read 0."""
    return tl.load(Ptr + offset, mask=ok, other=0)


# what generated sources call, besides tl; the constants as the kernels hold them (exact, float64 at compile time)
_GENERATED_USE = {"_floordiv": _floordiv, "_floormod": _floormod, "_gather": _gather, "_index_offset": _index_offset,
                  "_index_offset64": _index_offset64, "_index_ok": _index_ok, "_tanh": _tanh, "_LOG2E": _LOG2E,
                  "_FLOAT32_MAX": _FLOAT32_MAX, "_integral": _integral}


def _narrow(graph: Graph) -> tuple:
    """Which loaded tensors are passed as int32 copies: int64 ones whose values fit (a tile of int64
    comparisons holds twice the registers: it spilled the document mask's forward)."""
    loads = {node.value: node for node in _nodes(graph.result) if node.op == "load"}  # a slot's: the same bounds
    return tuple(t.dtype == torch.int64 and _ctype(loads[slot]) == "tl.int32" for slot, t in enumerate(graph.tensors))


def _data(tensors, narrow, device) -> tuple:
    """The tensors a trace loads, as the kernels read them: on their device, int32 where narrowed."""
    moved = (t.detach().to(device) for t in tensors)
    return tuple(t.to(torch.int32) if n else t for t, n in zip(moved, narrow))


def copied(kernel: KernelMask) -> list:
    """(copy, tensor) for each tensor the kernels read from a copy (an int64 one narrowed to int32), which
    holds the values the tensor had when ``kernel`` was compiled: a caller that launches it again (a plan)
    copies them again (``copy.copy_(tensor)``)."""
    return [(data, t) for data, t in zip(kernel.data or (), kernel.captured)
            if data.dtype != t.dtype or data.data_ptr() != t.data_ptr()]


def _mask_source(graph: Graph, tensors: list) -> tuple:
    """(the MASK_MOD source of a mask function's trace, the numbers it is given at launch, None)."""
    if graph.result.dtype is not torch.bool:
        raise TraceError(f"a mask function that returns {str(graph.result.dtype).replace('torch.', '')} values",
                         "return a boolean: a comparison, or (x != 0)", where="")
    writer = _Writer([graph.result], tensors)
    value = writer.expr(graph.result)
    body = "".join(f"    {line}\n" for line in [*writer.lines, f"return {value}"])
    return "def _mask_mod(b, h, q_idx, kv_idx, data):\n" + body, tuple(n.value for n in writer.numbers), None


# ----- from the trace to Triton source -------------------------------------------------------------

_TL = {torch.bool: "tl.int1", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.int16: "tl.int16",
       torch.int32: "tl.int32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float32: "tl.float32", torch.float64: "tl.float64"}
_RANK = {"tl.int1": 0, "tl.int8": 1, "tl.uint8": 1, "tl.int16": 2, "tl.int32": 3, "tl.int64": 4}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "and": "&", "or": "|", "xor": "^", "lshift": "<<",
          "rshift": ">>", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_CALLS = {"abs": "tl.abs", "minimum": "tl.minimum", "maximum": "tl.maximum", "where": "tl.where",
          "tanh": "_tanh", "exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn"}  # _tanh: the accurate one
_UNARY = {"neg": "(-{})", "sigmoid": "(1.0 / (1.0 + tl.exp(-{})))", "invert": "(~{})"}


def _fits32(lo, hi) -> bool:
    return lo is not None and INT32[0] <= lo and hi <= INT32[1]


def _ctype(node: Node) -> str:
    """The Triton type a node is computed and held in: PyTorch's dtype, but an int64 whose values fit
    int32 held in int32 (exact, and half the registers)."""
    if node.dtype is torch.int64:
        return "tl.int32" if _fits32(node.lo, node.hi) else "tl.int64"
    return _TL[node.dtype]


def _work_type(operands, also) -> str:
    """The type an operation on ``operands`` is computed in: the widest of theirs (a float first; numbers
    aside, which PyTorch lets take the tensor's type) and ``also``; int64 where a number needs it."""
    types = [_ctype(a) for a in operands if a.op != "const"] + also or [_ctype(operands[0])]
    floats = [t for t in types if t not in _RANK]
    work = floats[0] if floats else max(types, key=_RANK.__getitem__)
    big = any(a.op == "const" and a.lo is not None and not _fits32(a.lo, a.hi) for a in operands)
    return "tl.int64" if big and work in ("tl.int1", "tl.int32") else work


class _Writer:
    """The Triton source of the nodes ``results`` of a trace: nested expressions, a local for a value used twice."""

    def __init__(self, results: list[Node], tensors: list[torch.Tensor], numbers: list | None = None,
                 first: int | None = None):
        """numbers: the constants given at launch, in data order from ``first`` (default: after the
        tensors); writers of one graph share it, so that a number has one slot."""
        self.tensors, self.numbers = tensors, [] if numbers is None else numbers
        self.first = len(tensors) if first is None else first
        self.uses: dict[int, int] = {}
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        for result in results:
            self._count(result)

    def _count(self, node: Node):
        self.uses[id(node)] = self.uses.get(id(node), 0) + 1
        if self.uses[id(node)] == 1:
            for a in node.args:
                self._count(a)

    # ----- one node -----------------------------------------------------------------------------

    def expr(self, node: Node) -> str:
        """node's value as an expression in _ctype(node)."""
        if id(node) in self.names:
            return self.names[id(node)]
        text = self._expr(node)
        if self.uses[id(node)] > 1 and node.op not in ("sym", "const"):
            name = f"t{len(self.names)}"
            self.lines.append(f"{name} = {text}")
            self.names[id(node)] = text = name
        return text

    def as_type(self, node: Node, ctype: str) -> str:
        """node's value in ctype (a cast where its own type differs; a number as a literal, or as the
        launch argument that holds it)."""
        if node.op == "const":
            return self._number(node, ctype) if node.launch else self._literal(node.value, ctype)
        text = self.expr(node)
        return text if _ctype(node) == ctype else f"{text}.to({ctype})"

    def _number(self, node: Node, ctype: str) -> str:
        """A number given at launch: data[slot], which Triton types int32 (int64 if it needs it) or float32
        (an int equal to 1 becomes a compile-time 1: tl.cast takes both). A float64 use is written as a
        literal: a float32 argument would round it."""
        if ctype == "tl.float64" or ctype == "tl.int1":
            return self._literal(node.value, ctype)
        if not any(n is node for n in self.numbers):
            self.numbers.append(node)
        text = f"data[{self.first + next(i for i, n in enumerate(self.numbers) if n is node)}]"
        return text if ctype == "tl.float32" or (ctype == "tl.int32" and _fits32(node.value, node.value)) \
            else f"tl.cast({text}, {ctype})"

    @staticmethod
    def _literal(value, ctype: str) -> str:
        if ctype == "tl.int1":
            return repr(bool(value))
        if ctype in _RANK:
            value = int(value)
            # a small number takes the other operand's type in Triton, as in PyTorch; a large one is int64
            return repr(value) if _fits32(value, value) else f"tl.full((), {value}, tl.int64)"
        value = float(value)
        text = repr(value) if value == value and abs(value) != float("inf") else f'float("{value}")'
        return text if ctype == "tl.float32" else f"tl.full((), {text}, {ctype})"

    def _expr(self, node: Node) -> str:
        op, args = node.op, node.args
        if op == "sym":
            return node.value
        if op == "const":
            return self.as_type(node, _ctype(node))
        if op == "load":
            return self._load(node)
        if op == "cast":
            if args[0].dtype.is_floating_point and node.is_int:
                bits = 63 if _ctype(node) == "tl.int64" else 31
                return f"_integral({self.expr(args[0])}, {-2.0 ** bits!r}, {2.0 ** bits!r}).to({_ctype(node)})"
            return self.as_type(args[0], _ctype(node))
        if op in _COMPARE:
            operand = _work_type(args, [])
            left, right = (self.as_type(a, operand) for a in args)
            return f"({left} {_INFIX[op]} {right})"
        # arithmetic: computed in the widest of its operands' and its own types, then held in its own
        work = _ctype(node) if node.dtype.is_floating_point else _work_type(args[1:] if op == "where" else args,
                                                                            [_ctype(node)])
        text = self._arith(node, work)
        return text if work == _ctype(node) else f"{text}.to({_ctype(node)})"

    def _arith(self, node: Node, work: str) -> str:
        op, args = node.op, node.args
        if op == "where":
            return f"tl.where({self.as_type(args[0], 'tl.int1')}, {self.as_type(args[1], work)}, " \
                   f"{self.as_type(args[2], work)})"
        operands = [self.as_type(a, work) for a in args]
        if op in _CALLS:
            return f"{_CALLS[op]}({', '.join(operands)})"
        if op in _UNARY:
            return _UNARY[op].format(operands[0])
        if op in ("floordiv", "mod"):
            a, b = args
            if work in _RANK and a.lo >= 0 and b.lo > 0:  # both non-negative: Triton's rounding is PyTorch's
                return f"({operands[0]} {'//' if op == 'floordiv' else '%'} {operands[1]})"
            if op == "floordiv" and work not in _RANK:
                return f"tl.math.floor({operands[0]} / {operands[1]})"
            return f"{'_floordiv' if op == 'floordiv' else '_floormod'}({operands[0]}, {operands[1]})"
        return f"({operands[0]} {_INFIX[op]} {operands[1]})"

    def _load(self, node: Node) -> str:
        """data[slot][index...], with PyTorch's negative indices; out of range (padding rows) reads 0."""
        t = self.tensors[node.value]
        # a lane that loads has every index in range, so its offset is within the tensor's extent (a
        # masked lane's offset may wrap: it reads nothing)
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        wide = extent > INT32[1] or any(_ctype(i) == "tl.int64" for i in node.args)
        offsets, oks = [], []
        for i, size, stride in zip(node.args, t.shape, t.stride()):
            index = self.as_type(i, "tl.int64" if wide else _ctype(i))
            if i.lo >= 0:  # never negative: a plain offset
                if stride:
                    offsets.append(index if stride == 1 else f"{index} * {stride}")
                if i.hi >= size:
                    oks.append(f"({index} < {size})")
            else:
                if stride:
                    offsets.append(f"{'_index_offset64' if wide else '_index_offset'}({index}, {size}, {stride})")
                if i.lo < -size or i.hi >= size:
                    oks.append(f"_index_ok({index}, {size})")
        return f"_gather(data[{node.value}], {' + '.join(offsets) or '0'}, {' & '.join(oks) or 'True'})"
