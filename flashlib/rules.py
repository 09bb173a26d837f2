"""The rules the course teaches, written once in PyTorch: which keys a query sees (element by
element and tile by tile), score functions (soft-capping among them) and the gradient of attention
sinks, for the references, the block masks and the decoding reference; :mod:`flashlib.kernels.rules`
is their Triton counterpart (``tests/test_rules.py`` checks one against the other).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .machinery.refusals import truth_refusal

# what a block mask says of a tile: no pair may attend (never computed), some may, all may
SKIPPED, PARTIAL, FULL = 0, 1, 2


class Visibility(NamedTuple):
    """Which (query, key) pairs may attend. With o = seq_k - seq_q (bottom-right alignment,
    flash-attn >= 2.1), query i sees key j iff all of these that apply hold::

        causal           j <= i + o
        window (l, r)    i + o - l <= j <= i + o + r      (-1: no limit on that side)
        chunk C          j // C == (i + o) // C           (0: none; Llama 4's chunked local attention)
        mask_mod         mask_mod(b, h, i, j)             (b: batch, h: query head)

    A query before the keys' start (i + o < 0) lies in no chunk: with a chunk it sees nothing.
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    mask_mod: Callable | None = None
    chunk: int = 0

    @property
    def everything(self) -> bool:
        """True when every pair may attend (nothing to mask, no tile to skip)."""
        return not self.causal and not self.banded and self.mask_mod is None

    @property
    def banded(self) -> bool:
        """A window or a chunk: each query sees one run of keys, which the tile ranges find."""
        return self.window != (-1, -1) or self.chunk > 0

    def pairs(self, q_idx, kv_idx, seq_q: int, seq_k: int, b=None, h=None):
        """Boolean visibility of index tensors broadcast together (q_idx (..., rows, 1), kv_idx
        (..., 1, cols), b and h shaped to broadcast against them); None when every pair may attend."""
        diag = q_idx + (seq_k - seq_q)  # the key on query i's diagonal
        left, right = self.window
        rules = []
        if self.causal:
            rules.append(kv_idx <= diag)
        if left >= 0:
            rules.append(kv_idx >= diag - left)
        if right >= 0:
            rules.append(kv_idx <= diag + right)
        if self.chunk > 0:  # // floors (tensors and ints): a query at diag < 0 is in chunk -1, no key's
            rules.append(kv_idx // self.chunk == diag // self.chunk)
        if self.mask_mod is not None:
            rules.append(mask_values(self.mask_mod, _call(self.mask_mod, b, h, q_idx, kv_idx, seq_q, seq_k)))
        visible = None
        for rule in rules:
            visible = rule if visible is None else visible & rule
        return visible


def _call(mask_mod, b, h, q_idx, kv_idx, seq_q: int, seq_k: int):
    """mask_mod on index tensors; a tensor it reads that is too short for the indices is named."""
    try:
        return mask_mod(b, h, q_idx, kv_idx)
    except IndexError as exc:
        raise out_of_bounds(None, "mask_mod", mask_mod, str(exc), seq_q, seq_k) from None
    except RuntimeError as exc:  # an 'if' on the indices: refused as the kernels refuse it
        _refuse_truth("mask_mod", mask_mod, exc)
        raise


def _refuse_truth(argument: str, function, exc: RuntimeError):
    """Raise the kernels' TypeError for a function that asked for a Python truth value of a tensor
    (:func:`flashlib.machinery.refusals.truth_refusal`), if that is what ``exc`` is; else return."""
    refused = truth_refusal(None, argument, function, exc)
    if refused is not None:
        raise refused from None


def out_of_bounds(fn: str | None, argument: str, function, detail: str, seq_q: int, seq_k: int) -> ValueError:
    """The error of every op for a mask or score function that indexes a tensor it captures out of its
    bounds (PyTorch raises IndexError; a kernel would read outside it), naming fn (where known)."""
    name = getattr(function, "__name__", None) or type(function).__name__
    kind = "mask" if argument == "mask_mod" else "score"
    return ValueError(f"{fn + ': ' if fn else ''}argument '{argument}': {name} indexes a tensor out of its bounds "
                      f"({detail}); a tensor a {kind} function reads must cover every index it is given (here "
                      f"{seq_q} queries and {seq_k} keys)")


def mask_values(mask_mod, values):
    """What a mask function returned, if it is a boolean tensor; a TypeError naming it otherwise."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.bool:
        name = getattr(mask_mod, "__name__", repr(mask_mod))
        raise TypeError(f"argument 'mask_mod': {name} returned {type(values).__name__}"
                        f"{'' if not isinstance(values, torch.Tensor) else ' of ' + str(values.dtype)}; a mask "
                        "function must return a boolean tensor (comparisons joined with & | ~, never and/or/not)")
    return values


# ----- tile by tile: the keys (or query rows) of whole tiles that can see anything ----------------

def key_range_end(q0, q1, seq_q, seq_k, rule: Visibility) -> int:
    """One past the last key that query rows q0:q1 can see: tiles from there on are skipped."""
    offset = seq_k - seq_q  # bottom-right alignment: query i's diagonal is key i + offset
    k_end = seq_k
    if rule.causal:  # the last row, q1 - 1, sees keys <= q1 - 1 + offset
        k_end = min(k_end, q1 + offset)
    if rule.window[1] >= 0:  # ... and <= q1 - 1 + offset + right
        k_end = min(k_end, q1 + offset + rule.window[1])
    if rule.chunk > 0:  # ... and those of its chunk (none for a row before the keys' start)
        k_end = min(k_end, (q1 - 1 + offset) // rule.chunk * rule.chunk + rule.chunk)
    return max(k_end, 0)


def key_range_start(q0, seq_q, seq_k, rule: Visibility, block_k: int) -> int:
    """The first key tile that query rows from q0 on can see: the window's left edge and the first
    row's chunk (tiles before them are skipped), rounded down to a tile boundary; 0 without either."""
    diag, left = q0 + seq_k - seq_q, rule.window[0]
    start = 0 if left < 0 else diag - left
    if rule.chunk > 0:
        start = max(start, max(diag, 0) // rule.chunk * rule.chunk)
    return max(start, 0) // block_k * block_k


def key_span(rule: Visibility, keys: int, new_tokens: int) -> int:
    """The most keys the last ``new_tokens`` queries of a sequence of ``keys`` positions see together (what
    decoding's split count is chosen for): all, or the reach of the window's left side or of their chunks."""
    span = keys
    if rule.window[0] >= 0:
        span = min(span, rule.window[0] + new_tokens)
    if rule.chunk > 0:
        span = min(span, rule.chunk + new_tokens)
    return span


def query_range(k0, k1, seq_q, seq_k, rule: Visibility, block_q: int = 1) -> tuple[int, int]:
    """[q_start, q_end): the query rows that can see some key of k0:k1, q_start rounded down to a block."""
    offset = seq_k - seq_q
    left, right = rule.window
    q_start, q_end = 0, seq_q
    if rule.causal:  # query i sees key k0 when k0 <= i + offset
        q_start = max(q_start, k0 - offset)
    if right >= 0:
        q_start = max(q_start, k0 - offset - right)
    if left >= 0:  # query i sees key k1 - 1 when i + offset - left <= k1 - 1
        q_end = min(q_end, k1 + left - offset)
    if rule.chunk > 0:  # the rows whose chunk is one of these keys' chunks
        q_start = max(q_start, k0 // rule.chunk * rule.chunk - offset)
        q_end = min(q_end, (k1 - 1) // rule.chunk * rule.chunk + rule.chunk - offset)
    return max(q_start, 0) // block_q * block_q, max(q_end, 0)


def tile_kinds(visible, rows: int, cols: int, block_q: int, block_k: int) -> torch.Tensor:
    """SKIPPED / PARTIAL / FULL of each tile of a (..., rows, cols) visibility (None: all visible)."""
    if visible is None:
        return torch.full((1, 1, -(-rows // block_q), -(-cols // block_k)), FULL, dtype=torch.uint8)
    visible = visible.reshape((1,) * (4 - visible.ndim) + tuple(visible.shape))
    visible = visible.expand(visible.shape[0], visible.shape[1], rows, cols).to(torch.uint8)
    # positions past the sequences: no pair to see, nothing to mask
    seen = _tiles(visible, block_q, block_k, 0).amax(dim=(3, 5))
    full = _tiles(visible, block_q, block_k, 1).amin(dim=(3, 5))
    return torch.where(full.bool(), FULL, torch.where(seen.bool(), PARTIAL, SKIPPED)).to(torch.uint8)


def _tiles(x: torch.Tensor, fq: int, fk: int, fill) -> torch.Tensor:
    """(batch, heads, rows, cols) padded with fill to whole (fq, fk) tiles, as (batch, heads, row tiles, fq,
    col tiles, fk)."""
    rows, cols = x.shape[-2:]
    return F.pad(x, (0, -cols % fk, 0, -rows % fq), value=fill).unflatten(3, (-1, fk)).unflatten(2, (-1, fq))


@dataclass(frozen=True)
class BlockMask:
    """A mask at tile granularity, as flex_attention's ``create_block_mask`` builds one: kinds, uint8 (batch
    or 1, heads or 1, query blocks, key tiles), SKIPPED, PARTIAL or FULL for each tile (a dim of 1 where the
    mask does not depend on the batch row or head); rule: the mask it was built from, which a kernel applies."""

    kinds: torch.Tensor
    seq_q: int
    seq_k: int
    block_q: int
    block_k: int
    rule: Visibility = Visibility()

    def coarsen(self, block_q: int, block_k: int) -> torch.Tensor:
        """The kinds of (block_q, block_k) tiles, multiples of this mask's: FULL or SKIPPED where all the
        tiles inside are, PARTIAL otherwise (exact)."""
        if (block_q, block_k) == (self.block_q, self.block_k):
            return self.kinds
        if block_q % self.block_q or block_k % self.block_k:
            raise ValueError(f"argument 'block_mask' was built with ({self.block_q}, {self.block_k}) tiles; the "
                             f"kernels' ({block_q}, {block_k}) tiles must be multiples of them: build it with "
                             "a block_size that divides both")
        fq, fk = block_q // self.block_q, block_k // self.block_k
        # padding tiles hold no pair: neutral for both questions
        full, skipped = (_tiles(self.kinds == kind, fq, fk, True).all(dim=5).all(dim=3) for kind in (FULL, SKIPPED))
        return torch.where(full, FULL, torch.where(skipped, SKIPPED, PARTIAL)).to(torch.uint8)

    def counts(self) -> dict:
        """How many tiles of each kind, over every (batch, head) the kinds hold."""
        return {name: int((self.kinds == kind).sum()) for name, kind in
                (("skipped", SKIPPED), ("partial", PARTIAL), ("full", FULL))}

    def by_key_tile(self) -> torch.Tensor:
        """kinds as (batch or 1, heads or 1, key tiles, query blocks), contiguous: what the dK/dV kernel reads."""
        return self.kinds.transpose(-1, -2).contiguous()


# ----- score functions ---------------------------------------------------------------------------

class Scoring(NamedTuple):
    """How a tile's scores are made: s = scale * q kᵀ, then the score function, as FlexAttention does."""

    scale: float
    score_mod: Callable | None = None

    def tile(self, q_blk, k_tile, q0: int = 0, k0: int = 0) -> torch.Tensor:
        """The (batch, heads, rows, cols) scores of queries q0.. and keys k0.. of (batch, heads, ., d) tiles."""
        return self.modded((q_blk @ k_tile.transpose(-2, -1)) * self.scale, q0, k0)

    def modded(self, s, q0: int = 0, k0: int = 0, b0: int = 0) -> torch.Tensor:
        """Scaled scores s (batch, heads, rows, cols) of queries q0.., keys k0.., rows b0.. through the function."""
        if self.score_mod is None:
            return s
        batch, heads, rows, cols = s.shape
        b = torch.arange(b0, b0 + batch, device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=s.device).view(1, -1, 1, 1)
        q_idx = torch.arange(q0, q0 + rows, device=s.device)[:, None]
        kv_idx = torch.arange(k0, k0 + cols, device=s.device)[None, :]
        try:
            new = self.score_mod(s, b, h, q_idx, kv_idx)
        except IndexError as exc:  # named as a mask function's is (and as the kernels name it)
            raise out_of_bounds(None, "score_mod", self.score_mod, str(exc), q0 + rows if rows else 0,
                                k0 + cols if cols else 0) from None
        except RuntimeError as exc:  # an 'if' on the scores: refused as the kernels refuse it
            _refuse_truth("score_mod", self.score_mod, exc)
            raise
        if not isinstance(new, torch.Tensor) or not new.is_floating_point():
            name = getattr(self.score_mod, "__name__", repr(self.score_mod))
            kind = type(new).__name__ if not isinstance(new, torch.Tensor) else f"a {new.dtype} tensor"
            raise TypeError(f"argument 'score_mod': {name} returned {kind}; a score function returns the new "
                            "scores (a floating tensor)")
        # in the scores' dtype, as flex_attention gives it (a float64 bias table on float32 scores)
        return (new.expand(s.shape) if new.shape != s.shape else new).to(s.dtype)

    def slope(self, ds, s, q0: int = 0, k0: int = 0, captured=()):
        """(ds through the function: the gradient of the scaled scores s, [the gradients of the captured
        tensors]) given ds, the gradient of the function's output: the chain rule, by autograd on the
        function of this tile alone. Without a function, (ds, [])."""
        if self.score_mod is None:
            return ds, []
        with torch.enable_grad():
            leaf = s.detach().requires_grad_()
            grads = torch.autograd.grad(self.modded(leaf, q0, k0), [leaf, *captured], grad_outputs=ds,
                                        allow_unused=True)
        return grads[0], list(grads[1:])


# ----- softmax's backward ------------------------------------------------------------------------

def softmax_delta(out: torch.Tensor, dout: torch.Tensor, dlse=None, dtype=torch.float32) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse, (..., rows) in ``dtype``: the term of dS = P * (dP - delta), softmax's
    Jacobian; d lse_i / d s_ij = p_ij, so a gradient of the lse enters where delta does."""
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
    return delta if dlse is None else delta - dlse.reshape(delta.shape).to(dtype)


# ----- attention sinks -----------------------------------------------------------------------------

def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The gradient of attention sinks (heads,), from the lse (with the sink in it) and delta, both
    (..., heads, rows). A sink is a score with no value: its probability is p = exp(sink - lse), and with
    v = 0 dS = P * (dP - delta) gives dsink = -p * delta, summed over its head's rows (no atomics)."""
    sink = sinks.to(delta.dtype).reshape(-1, 1)  # (heads, 1), against (..., heads, rows)
    p = torch.exp(sink - lse)
    p = torch.where(lse == float("-inf"), 0.0, p)  # a sink of -inf on a row that sees nothing: no share
    others = tuple(d for d in range(lse.ndim) if d != lse.ndim - 2)  # every dim but the heads'
    return (-(p * delta).sum(dim=others)).to(sinks.dtype)  # no rows (or batch 0): zeros


# ----- the ladder's split: tiles seen whole, folded without a mask (kernels.rules._key_tiles) ------

def key_tiles(q0, seq_q, seq_k, causal: bool, block_q: int, block_k: int) -> tuple[int, int]:
    """(k_full_end, k_end) for query rows q0 : q0 + block_q under the causal rule alone: key tiles before
    k_full_end lie inside the keys and every row sees them whole (no mask needed); [k_full_end, k_end)
    need a mask (the diagonal, the ragged end); later tiles are skipped."""
    k_end = key_range_end(q0, q0 + block_q, seq_q, seq_k, Visibility(causal=causal))
    seen_by_all = seq_k  # keys every row sees: the first row's, under the causal rule
    if causal:
        seen_by_all = min(max(q0 + seq_k - seq_q + 1, 0), seq_k)
    return seen_by_all // block_k * block_k, k_end


def query_tiles(k0, seq_q, seq_k, causal: bool, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(q_start, q_full_start, q_full_end) for the key tile k0 : k0 + block_k under the causal rule alone:
    blocks [q_full_start, q_full_end) lie inside the queries and see the whole tile (no mask); [q_start,
    q_full_start) (the diagonal) and [q_full_end, seq_q) (the ragged end) need one. On block boundaries."""
    q_start, _ = query_range(k0, k0 + block_k, seq_q, seq_k, Visibility(causal=causal), block_q)
    rows_full = seq_q // block_q * block_q  # where the whole query blocks end
    first_full = 0  # the first block whose first row sees the tile's last key
    if causal:
        first_full = -(-max(k0 + block_k - 1 - (seq_k - seq_q), 0) // block_q) * block_q
    q_full_start = min(max(first_full, q_start), rows_full)
    q_full_end = rows_full if k0 + block_k <= seq_k else q_full_start  # a ragged key tile: masked throughout
    return q_start, q_full_start, q_full_end
