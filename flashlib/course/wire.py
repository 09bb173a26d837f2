"""What crosses between the judge and the student's process: length-prefixed messages of plain values.

A message is a tree of None, bools, numbers, strings, lists, string-keyed dicts and tensors, saved with
``torch.save`` and read with ``torch.load(weights_only=True)``, so that reading what the student's process
sent never runs code of its making (no arbitrary unpickling). Everything else is packed into that tree by
:func:`pack` under a tag and rebuilt by :func:`unpack`: tuples, sets, dtypes, Ellipsis, the dataclasses the
checkers exchange (cases, calls, problems: :data:`KEPT`), what a :class:`~.watch.TensorWatch` saw, and
functions, which stay where they are and travel as a handle (``hold`` and ``remote`` say what a handle is on
each side). Any other object is described (its type's name and repr) and rebuilt as an :class:`Opaque`.
A message longer than ``limit`` bytes is refused before it is read.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import numbers
import struct

import torch

LIMIT = 256 * 2**20  # bytes in one message at most
_HEADER = struct.Struct("!Q")
_DEPTH = 32
_TEXT = 2000  # characters of a repr kept
# dataclasses the checkers send across, by name: "module:class"
KEPT = {name: f"flashlib.labs.{where}" for name, where in (
    ("Call", "common:Call"), ("Problem", "common:Problem"), ("Case", "attention_cases:Case"),
    ("KernelCase", "kernel_labs:KernelCase"), ("RowCase", "softmax_labs:RowCase"))}
WATCH = "flashlib.labs.watch:TensorWatch"  # what a lab's dispatch mode saw travels as its record


class WireError(Exception):
    """A message that could not be read: too long, cut short, or not of the kinds above."""


class Opaque:
    """An object of the student's that is none of the kinds that travel: its type's name and repr."""

    def __init__(self, text: str):
        self._text = text

    def __repr__(self) -> str:
        return self._text


def _opaque(type_name: str, text: str) -> Opaque:
    name = type_name if type_name.isidentifier() else "object"
    return type(name, (Opaque,), {})(text)


def _text(value) -> str:
    try:
        return repr(value)[:_TEXT]
    except Exception:  # a repr of the student's that raises: its type says enough
        return f"<{type(value).__name__}>"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise WireError(f"{name!r} is not a torch dtype")
    return value


def pack(value, hold=None, depth: int = 0):
    """``value`` as a tree that ``torch.load(weights_only=True)`` reads; ``hold(fn) -> dict`` turns a
    function into its handle (the student's process), or None where functions stay opaque."""
    if depth > _DEPTH:
        raise WireError("a value nested too deeply to send")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(torch.Tensor).cpu().clone()
    if type(value).__module__ == "numpy":  # numpy's scalars and arrays: as Python numbers and tensors
        return pack(value.item() if getattr(value, "ndim", 1) == 0 else torch.as_tensor(value.copy()), hold, depth)
    nested = _nested(value, hold, depth + 1)
    if nested is not None:
        return nested
    handle = getattr(value, "_wire_handle", None)  # a function of the student's, sent back as it came
    if isinstance(handle, int):
        return {"__fn__": handle}
    if callable(value) and not isinstance(value, type) and hold is not None:
        return hold(value)
    return {"__object__": type(value).__name__, "text": _text(value)}


def _nested(value, hold, depth):
    """Containers, dtypes, dataclasses and watches as tagged dicts; None for what is none of these."""
    TensorWatch = _kept_class(WATCH)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [pack(v, hold, depth) for v in value]
        if isinstance(value, list):
            return items
        return {"__tuple__" if isinstance(value, tuple) else "__set__": items}
    if isinstance(value, dict):
        return {"__dict__": [[pack(k, hold, depth), pack(v, hold, depth)] for k, v in value.items()]}
    if value is Ellipsis:
        return {"__ellipsis__": True}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, TensorWatch):
        return {"__watch__": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in value.created],
                "ops": sorted(value.ops), "operands": [[op, list(shape)] for op, shape in value.operands]}
    if type(value).__name__ in KEPT and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dc__": type(value).__name__,
                "fields": {f.name: pack(getattr(value, f.name), hold, depth) for f in dataclasses.fields(value)}}
    return None


def _kept_class(where: str):
    module, _, cls = where.partition(":")
    return getattr(importlib.import_module(module), cls)


def _kept(name: str):
    return _kept_class(KEPT[name])


def unpack(tree, remote=None, depth: int = 0):
    """The value ``tree`` stands for; ``remote(dict) -> object`` turns a function's handle into what calls it
    (the judge's proxy, or the student's function itself)."""
    if depth > _DEPTH:
        raise WireError("a value nested too deeply")
    if tree is None or isinstance(tree, (bool, int, float, str, torch.Tensor)):
        return tree
    if isinstance(tree, list):
        return [unpack(v, remote, depth + 1) for v in tree]
    if not isinstance(tree, dict) or len(tree) == 0:
        raise WireError(f"unexpected {type(tree).__name__} in a message")
    return _tagged(tree, remote, depth + 1)


def _tagged(tree: dict, remote, depth: int):
    if "__tuple__" in tree:
        return tuple(unpack(v, remote, depth) for v in tree["__tuple__"])
    if "__set__" in tree:
        return set(unpack(v, remote, depth) for v in tree["__set__"])
    if "__dict__" in tree:
        return {unpack(k, remote, depth): unpack(v, remote, depth) for k, v in tree["__dict__"]}
    if "__ellipsis__" in tree:
        return Ellipsis
    if "__dtype__" in tree:
        return _dtype(tree["__dtype__"])
    if "__watch__" in tree:
        watch = _kept_class(WATCH)()
        watch.created = [(tuple(int(n) for n in shape), _dtype(dtype)) for shape, dtype in tree["__watch__"]]
        watch.ops = {str(op) for op in tree["ops"]}
        watch.operands = [(str(op), tuple(int(n) for n in shape)) for op, shape in tree.get("operands", [])]
        return watch
    if "__dc__" in tree:
        if tree["__dc__"] not in KEPT:
            raise WireError(f"{tree['__dc__']!r} is not a kind of value that travels")
        fields = {str(k): unpack(v, remote, depth) for k, v in tree["fields"].items()}
        return _kept(tree["__dc__"])(**fields)
    if "__fn__" in tree:
        if remote is None:
            raise WireError("a function where none was expected")
        return remote(tree)
    if "__object__" in tree:
        return _opaque(str(tree["__object__"]), str(tree.get("text", "")))
    raise WireError(f"unexpected keys {sorted(tree)[:5]} in a message")


def send(sock, message, hold=None) -> None:
    """Write one message (a dict) to the socket."""
    buffer = io.BytesIO()
    torch.save(pack(message, hold), buffer)
    data = buffer.getvalue()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _read(sock, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(sock, remote=None, limit: int = LIMIT):
    """Read one message; EOFError when the other side is gone, WireError when it is not a message."""
    (size,) = _HEADER.unpack(_read(sock, _HEADER.size))
    if size > limit:
        raise WireError(f"a message of {size} bytes, past the limit of {limit}")
    try:
        tree = torch.load(io.BytesIO(_read(sock, size)), weights_only=True)
    except EOFError:
        raise
    except Exception as error:  # whatever torch.load refuses: not a message of ours
        raise WireError(f"not a message: {type(error).__name__}: {str(error)[:200]}") from None
    message = unpack(tree, remote)
    if not isinstance(message, dict):
        raise WireError("a message must be a dict")
    return message
