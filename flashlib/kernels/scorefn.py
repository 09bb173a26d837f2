"""Score functions, as FlexAttention users write them, compiled into the kernels with their derivative.

A score function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes each scaled score before
the mask (:mod:`flashlib.scores` has ready ones). It is traced and written out as mask functions are
(:mod:`flashlib.kernels.maskfn`; the score a float32 symbol), as one ``@triton.jit`` function::

    SCORE_MOD(x, scale, qk_scale, b, h, q_idx, kv_idx, data, GRAD)
        x: the raw dot q.k; the function is applied to the natural score x * scale and the result
        returned in the kernels' base-2 units (times log2 e)
        GRAD False: the new score; GRAD True: (the new score, d new / d score), sharing what they share

The derivative is the chain rule applied to the traced expression (:func:`derivative`), so the
backward's dS is multiplied by exactly the slope of what the forward computed; at a kink, PyTorch's
subgradient (abs: 0 at 0; maximum, minimum: half to each side on a tie; a clamp: its argument's slope
at its bounds). The captured tensors' own gradients are :func:`flashlib.scores.captured_grads`'s. The
indices it reads them at are checked on the host for each call's positions (:func:`check_indices`), so
that an index past a tensor's end is refused as PyTorch refuses it, not read as 0.
"""
from __future__ import annotations

import torch

from .config import LOG2E
from .maskfn import KernelMask, _Writer, compile_traced, memo_get, symbol_bounds
from ..rules import out_of_bounds
from ..machinery.trace import FLOAT_FUNCTIONS, Graph, IndexCheck, Node, TraceError, _nodes, trace


KernelScore = KernelMask  # a score function as the kernels call it: its SCORE_MOD, data, source, captured, indices


def score_bounds(batch=None, heads=None, seq_q=None, seq_k=None) -> dict:
    """The symbols of a score function: the score (a float) and the four indices' bounds."""
    return {"score": (None, None), **symbol_bounds(batch, heads, seq_q, seq_k)}


def trace_score(score_mod, bounds: dict | None = None, device=None, literals=None) -> Graph:
    """The traced graph of a score function (a TraceError for what cannot compile); literals: as trace()'s."""
    graph = trace(score_mod, bounds or score_bounds(), device=device, floats=("score",), literals=literals)
    if not graph.result.dtype.is_floating_point:
        kind = str(graph.result.dtype).replace("torch.", "")
        raise TraceError(f"a score function that returns {kind} values", "return a float: the new score", where="")
    return graph


def compile_score(fn: str, score_mod, device, bounds: dict | None = None) -> KernelScore:
    """The kernels' SCORE_MOD for ``score_mod`` as it reads its data now; bounds: :func:`score_bounds`'s."""
    return KernelScore(*compile_traced(fn, "score_mod", score_mod, device, bounds or score_bounds(), trace_score,
                                       _score_source))


def score_tensors(fn: str, score_mod, bounds: dict | None = None) -> tuple:
    """The tensors a score function reads (captured, in the order it reads them)."""
    bounds = bounds or score_bounds()

    def build():
        graph = trace_score(score_mod, bounds)
        return None, graph.tensors, graph.read

    return memo_get(fn, "score_mod", score_mod, "score tensors", bounds, None, build)[1]


def check_indices(fn: str, score_mod, score: KernelScore, ranges: dict, regions=None) -> None:
    """A ValueError naming fn, the function and the index if it reads a captured tensor out of its bounds for
    the index ranges ({"b": (lo, hi), "h", "q_idx", "kv_idx"}); regions(): where ranges is wider than the
    call's positions (decoding's capacity, packed sequences' longest), those, one ranges per sequence (asked
    only when ranges fail)."""
    if score.indices is None or any(hi < lo for lo, hi in ranges.values()):
        return
    found = score.indices.outside(ranges, score.captured)
    if found is not None and regions is not None:  # the call's own positions: their union, else each
        found, boxes = None, [r for r in regions() if all(lo <= hi for lo, hi in r.values())]
        union = boxes and {name: (min(r[name][0] for r in boxes), max(r[name][1] for r in boxes)) for name in ranges}
        if union and score.indices.outside(union, score.captured) is not None:
            for box in map(dict, dict.fromkeys(tuple(sorted(r.items())) for r in boxes)):
                found, ranges = score.indices.outside(box, score.captured), box
                if found is not None:
                    break
    if found is None:
        return
    size = found.shape[found.dim]
    if found.at:
        detail = (f"index {found.value} is out of bounds for dimension {found.dim} with size {size} of a tensor of "
                  f"shape {found.shape}, at " + ", ".join(f"{k}={v}" for k, v in found.at.items()))
    else:
        detail = (f"an index computed from the score may reach {found.lo}..{found.hi} along dimension {found.dim} "
                  f"of a tensor of shape {found.shape}, which only the kernel could check: clamp it into 0..{size - 1}")
    raise out_of_bounds(fn, "score_mod", score_mod, detail, ranges["q_idx"][1] + 1, ranges["kv_idx"][1] + 1)


def _score_source(graph: Graph, tensors: list) -> tuple:
    """(a score function's SCORE_MOD source, the numbers it is given at launch, its index check or None)."""
    value, slope, first, folded = _base2(graph, len(tensors))
    tiles = [graph.symbols[name] for name in ("score", "q_idx", "kv_idx", "x")]
    numbers, start = [], len(tensors) + len(folded)  # launch numbers after the tensors and a, b
    one = _Writer([value], tensors, numbers, start)
    value_text = _tile(one.as_type(value, "tl.float32"), value, tiles)
    both = _Writer([value, slope], tensors, numbers, start)  # what they share (tanh(score / c)) is computed once
    pair = [_tile(both.as_type(n, "tl.float32"), n, tiles) for n in (value, slope)]
    lines = ["def _score_mod(x, scale, qk_scale, b, h, q_idx, kv_idx, data, GRAD: tl.constexpr):",
             "    if GRAD:  # the backward: the new score (base 2) and its slope d new / d score",
             *(f"        {line}" for line in first + both.lines), f"        return {pair[0]}, {pair[1]}",
             "    else:", *(f"        {line}" for line in first + one.lines), f"        return {value_text}"]
    check = IndexCheck(graph)
    return "\n".join(lines) + "\n", (*folded, *(n.value for n in numbers)), check if check.loads else None


# ----- from the natural scaled score to the kernels' base-2 units --------------------------------------

def _folded(graph: Graph):
    """(a, f, b) where the function is a * f(score / b) with numbers a, b (1 where a factor is absent)
    and f one of tanh, exp, log, sqrt, sigmoid (soft-capping: c * tanh(score / c)); else None."""
    node, a = graph.result, 1.0
    if node.op == "mul":
        numbers = [i for i, arg in enumerate(node.args) if _number(arg)]
        if not numbers:
            return None
        a, node = node.args[numbers[0]].value, node.args[1 - numbers[0]]
    if node.op not in FLOAT_FUNCTIONS:
        return None
    inner, score = node.args[0], graph.symbols["score"]
    if inner is score:
        return float(a), node.op, 1.0
    if inner.op != "truediv" or inner.args[0] is not score or not _number(inner.args[1]):
        return None
    return float(a), node.op, float(inner.args[1].value)


def _number(node: Node) -> bool:
    return node.op == "const" and node.dtype is not torch.bool


def _base2(graph: Graph, slots: int) -> tuple:
    """The function in the kernels' units: (the new score in base 2 and its slope d new / d score (nodes),
    the lines that define the symbols they use, the numbers passed at launch after the tensors).

    In general the function of x * scale, times log2 e. For a * f(score / b), the numbers are folded into
    f's argument and result instead, (a log2 e) * f(x * (qk_scale / (b log2 e))): two roundings fewer per
    score, the hand-written soft-capping kernel's arithmetic (its bits: tests/test_scores.py), and a and b
    are passed at launch (``data[slots]``), so that a new cap compiles no new kernel."""
    tracer = graph.tracer
    apply, const = tracer.apply, tracer.const
    for name in ("x", "qk_scale", "_FLOAT32_MAX"):
        graph.symbols[name] = tracer.symbol(name, None, None, torch.float32)
    folded = _folded(graph)
    if folded is None:
        return apply("mul", graph.result, const(LOG2E)), derivative(graph), ["score = x * scale"], ()
    a, f, b = folded
    # c log2 e written where it is used, as the hand-written kernel did: a local would hold it as a float32
    # tile in Triton's interpreter, where the number times the constexpr _LOG2E is computed in float64
    cap_a = tracer.symbol(f"(data[{slots}] * _LOG2E)", None, None, torch.float32)
    cap_b = cap_a if a == b else tracer.symbol(f"(data[{slots + 1}] * _LOG2E)", None, None, torch.float32)
    # the ratio capped at float32's largest so that a score of 0 stays 0 (a cap of 1e-38)
    ratio = apply("minimum", apply("truediv", graph.symbols["qk_scale"], cap_b), graph.symbols["_FLOAT32_MAX"])
    arg = apply("mul", graph.symbols["x"], ratio)
    inner = apply(f, arg)
    value = apply("mul", inner, cap_a)  # the tile first: a constexpr times a tile would wrap the tile
    if f == "tanh":  # 1 - tanh², tanh read back from the output (alive for P anyway; tanh's tile need not be)
        t = apply("truediv", value, cap_a)
        slope = apply("sub", const(1.0), apply("mul", t, t))
    else:
        slope = _Chain(tracer, arg)._slope(f, inner, arg)
    if a != b:  # d/dscore a f(score / b) = (a / b) f'(score / b)
        slope = apply("mul", slope, apply("truediv", cap_a, cap_b))
    return value, slope, [], (a,) if a == b else (a, b)


def _tile(text: str, result: Node, tiles: list) -> str:
    """An expression whose value is a tile, as the score's, even for a number or a head's (a slope of 1)."""
    return text if any(n is t for n in _nodes(result) for t in tiles) else f"tl.zeros_like(x) + {text}"


# ----- the derivative of a traced expression with respect to the score ------------------------------

def derivative(graph: Graph) -> Node:
    """d result / d score, as nodes of the same graph: the chain rule applied node by node. Integer
    and boolean nodes, loads and constants do not depend on the score (their derivative is 0)."""
    slope = _Chain(graph.tracer, graph.symbols["score"]).d(graph.result)
    return graph.tracer.const(0.0) if slope is None else slope


class _Chain:
    """The chain rule on traced nodes; None stands for a derivative of 0."""

    def __init__(self, tracer, target: Node):
        self.tracer, self.target, self.memo = tracer, target, {}

    def mul(self, a, b):
        if a is None or b is None:
            return None
        for c, x in ((a, b), (b, a)):  # numbers gathered into one (c (1/c) x -> x): fewer roundings
            if c.op == "const" and c.dtype.is_floating_point:
                if x.op == "mul" and x.args[0].op == "const" and x.args[0].dtype.is_floating_point:
                    product = c.value * x.args[0].value  # given at launch if either was
                    c, x = self.tracer.const(product, c.launch or x.args[0].launch), x.args[1]
                if c.value == 1.0 and not c.launch and x.dtype.is_floating_point:
                    return x
                return self.tracer.apply("mul", c, x)
        return self.tracer.apply("mul", a, b)

    def add(self, a, b):
        return b if a is None else a if b is None else self.tracer.apply("add", a, b)

    def neg(self, a):
        return None if a is None else self.tracer.apply("neg", a)

    def select(self, cond, a, b):
        """where(cond, a, b) of two derivatives (None: 0)."""
        if a is None and b is None:
            return None
        return self.tracer.apply("where", cond, a or self.tracer.const(0.0), b or self.tracer.const(0.0))

    def d(self, node: Node):
        if id(node) not in self.memo:
            self.memo[id(node)] = self._rule(node)
        return self.memo[id(node)]

    def _rule(self, node: Node):
        if node is self.target:
            return self.tracer.const(1.0)
        if not node.dtype.is_floating_point or node.op in ("sym", "const", "load"):
            return None
        op, args, apply = node.op, node.args, self.tracer.apply
        if op == "cast":
            return self.d(args[0])
        if op in ("add", "sub"):
            return self.add(self.d(args[0]), self.d(args[1]) if op == "add" else self.neg(self.d(args[1])))
        if op == "mul":
            return self.add(self.mul(self.d(args[0]), args[1]), self.mul(args[0], self.d(args[1])))
        if op == "truediv":  # (a / b)' = a' / b - (a / b) b' / b
            da, db = self.d(args[0]), self.d(args[1])
            first = None if da is None else apply("truediv", da, args[1])
            second = None if db is None else apply("truediv", self.mul(node, db), args[1])
            return self.add(first, self.neg(second))
        if op == "neg":
            return self.neg(self.d(args[0]))
        if op == "where":
            return self.select(args[0], self.d(args[1]), self.d(args[2]))
        if op in ("minimum", "maximum"):
            return self._extreme(node)
        if op == "abs":  # PyTorch's: the sign's slope, 0 at 0
            da = self.d(args[0])
            if da is None:
                return None
            zero = self.tracer.const(0.0)
            return self.select(apply("gt", args[0], zero), da, self.select(apply("lt", args[0], zero), self.neg(da), None))
        if op in FLOAT_FUNCTIONS:
            return self.mul(self.d(args[0]), self._slope(op, node, args[0]))
        raise TraceError(f"the score's derivative through '{op}'", "use + - * /, torch.where, abs, minimum, "
                         "maximum, clamp, tanh, exp, log, sqrt or sigmoid on the score", where="")

    def _extreme(self, node: Node):
        """minimum/maximum as PyTorch differentiates them: the slope of the side taken, half of each on a
        tie; a clamp (value "clamp") passes its argument's slope on a tie with its bound, as torch.clamp."""
        apply, (a, b) = self.tracer.apply, node.args
        da, db = self.d(a), self.d(b)
        if da is None and db is None:
            return None
        takes_a = apply("lt" if node.op == "minimum" else "gt", a, b)
        if node.value == "clamp":  # a = the clamped value, b = the bound
            tie = da
        else:
            both = self.add(da, db)
            tie = None if both is None else apply("mul", self.tracer.const(0.5), both)
        return self.select(takes_a, da, self.select(apply("eq", a, b), tie, db))

    def _slope(self, op: str, node: Node, x: Node) -> Node:
        """f'(x) of a float function, from f(x) = node where that is cheaper."""
        apply, one = self.tracer.apply, self.tracer.const(1.0)
        if op == "tanh":
            return apply("sub", one, apply("mul", node, node))  # 1 - tanh²
        if op == "exp":
            return node
        if op == "log":
            return apply("truediv", one, x)
        if op == "sqrt":
            return apply("truediv", self.tracer.const(0.5), node)
        return apply("mul", node, apply("sub", one, node))  # sigmoid: s (1 - s)

