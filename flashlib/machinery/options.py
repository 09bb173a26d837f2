"""The options of one attention call, checked once into one object.

Every op checks its keyword arguments once (:func:`check_options`) into an :class:`Options`, which is
what travels. A new option is one field here (and its check; a tensor option a row of :data:`TENSOR_OPTIONS`
too); layers ask the rules through :attr:`Options.visibility` and :attr:`Options.scoring`.

    visibility  which pairs may attend, :class:`flashlib.rules.Visibility`, made of the op's options
        causal           bool: the causal rule (bottom-right aligned)
        window           (left, right), -1 for no limit on a side
        mask_mod         mask_mod(b, h, q_idx, kv_idx) -> bool, or None
        attention_chunk  int, 0 for none (the rule's field ``chunk``): query at p = i + seq_k - seq_q sees
                         key j only if j // C == p // C
    scale       float: the softmax scale, resolved (1/sqrt(head_dim) unless given)
    softcap     float, 0.0 for none: the score function flashlib.scores.softcap(c)
    block_mask  the block mask built once from the mask (flashlib.masks.create_block_mask), or None
    score_mod   score_mod(score, b, h, q_idx, kv_idx) -> score, or None
    sinks       attention sinks (heads,), a tensor, or None
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .checks import (batch_and_heads, check_attention_inputs, check_chunk, check_mask_mod, check_score_mod,
                      check_sinks, check_softcap, check_window)
from ..rules import BlockMask, Scoring, Visibility
from ..scores import softcap as softcap_score


class TensorOption(NamedTuple):
    """An option that is a tensor: its field, its shape (in words, for errors and docs), whether it has a gradient."""

    name: str
    shape: str
    gradient: bool


# every tensor option, in the one order an op's inputs, a Function's saved tensors and the backward's
# gradients list them
TENSOR_OPTIONS = (TensorOption("sinks", "(heads,)", True),)


# the options an op takes by name, in the order :meth:`Options.given` lists them; those of the rule live in
# Options.visibility, under the rule's own name (flashlib.rules.Visibility: the chunk is its field 'chunk')
OPTION_NAMES = ("causal", "scale", "window", "softcap", "mask_mod", "block_mask", "score_mod", "sinks",
                "attention_chunk")
RULE_FIELDS = {"causal": "causal", "window": "window", "mask_mod": "mask_mod", "attention_chunk": "chunk"}


class Options(NamedTuple):
    """The checked options of a call (see the module's table); made by :func:`check_options`. Which pairs
    may attend (causal, window, mask_mod, attention_chunk) is one field, the rule itself."""

    visibility: Visibility = Visibility()
    scale: float = 1.0
    softcap: float = 0.0
    block_mask: BlockMask | None = None
    score_mod: Callable | None = None
    sinks: torch.Tensor | None = None

    # ----- the rules, asked ------------------------------------------------------------------

    def option(self, name: str):
        """The option an op takes as ``name`` (one of :data:`OPTION_NAMES`), wherever it is held."""
        return getattr(self.visibility, RULE_FIELDS[name]) if name in RULE_FIELDS else getattr(self, name)

    @classmethod
    def of(cls, **keywords) -> "Options":
        """Options from an op's keywords (:data:`OPTION_NAMES`) as they are, unchecked: :func:`check_options`
        checks them."""
        rule = {RULE_FIELDS[name]: keywords.pop(name) for name in list(keywords) if name in RULE_FIELDS}
        return cls(Visibility(**rule), **keywords)

    def with_rule(self, **fields) -> "Options":
        """These options with the rule's fields changed (causal=False, window=..., chunk=...)."""
        return self._replace(visibility=self.visibility._replace(**fields))

    @property
    def score_function(self) -> Callable | None:
        """score_mod, or soft-capping as a score function, or None."""
        return self.score_mod or (softcap_score(self.softcap) if self.softcap else None)

    @property
    def scoring(self) -> Scoring:
        """How a tile's scores are made."""
        return Scoring(self.scale, self.score_function)

    @property
    def masked(self) -> bool:
        """A window, a chunk or a mask function: the kernels take their mask path (a mask bundle)."""
        return self.visibility.banded or self.visibility.mask_mod is not None

    @property
    def functions(self) -> bool:
        """A mask or score function: Python code, which no custom op's schema can carry."""
        return self.visibility.mask_mod is not None or self.score_mod is not None

    def given(self) -> list[str]:
        """The names of the options set to anything but their default (causal and scale always)."""
        default = Options()
        return ["causal", "scale"] + [name for name in OPTION_NAMES[2:]
                                      if (self.option(name) is not None if default.option(name) is None
                                          else self.option(name) != default.option(name))]  # a tensor is never compared

    @property
    def beyond_causal(self) -> bool:
        """Anything but the causal rule and the scale: what the ladder's fast rungs do not have."""
        return len(self.given()) > 2

    def refuse_beyond(self, fn: str, path: str, implemented=("causal", "scale")) -> "Options":
        """These options if ``path`` implements each one set, else a ValueError naming the rest (none is dropped)."""
        missing = [name for name in self.given() if name not in implemented]
        if missing:
            raise ValueError(f"{fn}: {path} does not implement {', '.join(map(repr, missing))}; it takes "
                             f"{', '.join(implemented)}")
        return self

    def window_within(self, keys: int) -> "Options":
        """These options with each window side and the chunk at most ``keys``, which limits nothing more
        (-1 and 0 stay), so that the kernels' integers (a side plus a position) stay small."""
        rule = self.visibility
        return self.with_rule(window=tuple(min(side, keys) for side in rule.window), chunk=min(rule.chunk, keys))

    @property
    def rule_numbers(self) -> tuple:
        """(window left, window right[, chunk]): the rule's tuple the kernels are given (flashlib.kernels.rules);
        two integers without chunks, so that the chunk's code is compiled out."""
        rule = self.visibility
        return (*rule.window, rule.chunk) if rule.chunk else tuple(rule.window)

    # ----- what crosses a custom op's schema: numbers and tensors, each in one list --------------

    @property
    def held(self) -> list[TensorOption]:
        """The rows of :data:`TENSOR_OPTIONS` whose tensor is set, in the table's order."""
        return [row for row in TENSOR_OPTIONS if getattr(self, row.name) is not None]

    @property
    def tensors(self) -> list:
        """The tensors the options hold: an op's or autograd Function's inputs for them, in its gradients' order."""
        return [getattr(self, row.name) for row in self.held]

    def with_tensors(self, tensors) -> "Options":
        """These options holding ``tensors`` (as :attr:`tensors` lists them): an op's or a Function's own
        inputs, so that autograd sees the tensors it differentiates."""
        return self._replace(**{row.name: t for row, t in zip(self.held, list(tensors))})

    def tensor_grads(self, grads: dict) -> list:
        """The gradients of :attr:`tensors` from {name: gradient} (None for one that takes none)."""
        return [grads.get(row.name) if row.gradient else None for row in self.held]

    def op_numbers(self) -> list:
        """The numbers of the options as one list of floats (exact: flags and ints far below 2^53) for a
        custom op's schema; :meth:`from_op` reads them back."""
        if self.functions:
            raise ValueError("a mask or score function is Python code, not an argument of a custom op")
        rule = self.visibility
        return [float(rule.causal), float(self.scale), *map(float, rule.window), float(self.softcap),
                float(rule.chunk), *(float(getattr(self, row.name) is not None) for row in TENSOR_OPTIONS)]

    @classmethod
    def from_op(cls, numbers, tensors) -> "Options":
        """The options an op was given as (:meth:`op_numbers`, :attr:`tensors`)."""
        causal, scale, left, right, softcap, chunk, *held = numbers
        placeholders = {row.name: torch.empty(0) for row, flag in zip(TENSOR_OPTIONS, held) if flag}
        rule = Visibility(bool(causal), (int(left), int(right)), chunk=int(chunk))
        return cls(rule, scale, softcap, **placeholders).with_tensors(tensors)

    def keywords(self) -> dict:
        """The keyword arguments that give these options again: :meth:`given`'s, so no op is handed one unset."""
        return {name: self.option(name) for name in self.given()}


def check_options(fn: str, q, k, v, *, causal: bool = False, scale=None, window=None, softcap=None, mask_mod=None,
                  block_mask=None, sinks=None, score_mod=None, attention_chunk=None, value_dim: bool = False) -> Options:
    """The options of a call on (..., heads, seq, head_dim) q, k, v, checked with the inputs (errors name
    ``fn`` and the argument); a block mask's rule fills causal, window, mask_mod and the chunk (the call may
    repeat them, not change them). value_dim: v may have a head dim of its own."""
    scale = check_attention_inputs(fn, q, k, v, causal=causal, scale=scale, groups=True, value_dim=value_dim)
    heads = q.shape[-3] if q.ndim >= 3 else 1
    options = checked_options(fn, heads, q.device, causal=causal, scale=scale, window=window, softcap=softcap,
                              mask_mod=mask_mod, sinks=sinks, score_mod=score_mod, attention_chunk=attention_chunk)
    return options if block_mask is None else _with_block_mask(fn, options, block_mask, q, k, window, mask_mod,
                                                               attention_chunk)


def checked_options(fn: str, heads: int, device, *, causal=False, scale: float, window=None, softcap=None,
                    mask_mod=None, sinks=None, score_mod=None, attention_chunk=None) -> Options:
    """:func:`check_options` for a call whose inputs and scale are checked otherwise (packed
    sequences, decoding): the options alone, for ``heads`` query heads on ``device``."""
    window, softcap_value = check_window(fn, window), check_softcap(fn, softcap)
    mask_mod = check_mask_mod(fn, mask_mod, device)
    score_mod, sinks = check_score_mod(fn, score_mod, softcap, device), check_sinks(fn, sinks, heads, device)
    rule = Visibility(bool(causal), window, mask_mod, check_chunk(fn, attention_chunk))
    return Options(rule, float(scale), softcap_value, None, score_mod, sinks)


def _with_block_mask(fn, options: Options, block_mask, q, k, window, mask_mod, attention_chunk) -> Options:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{fn}: argument 'block_mask' must be a flashlib BlockMask (flashlib.masks.create_block_mask),"
                        f" got {type(block_mask).__name__}")
    rule, given = block_mask.rule, options.visibility
    if mask_mod is None:  # the block mask's own mask function: the kernels read its tensors too
        check_mask_mod(fn, rule.mask_mod, q.device)
    for name, ruled, differs in (("causal", rule.causal, given.causal and not rule.causal),
                                 ("window", rule.window, window is not None and given.window != rule.window),
                                 ("mask_mod", rule.mask_mod, mask_mod is not None and mask_mod is not rule.mask_mod),
                                 ("attention_chunk", rule.chunk,
                                  attention_chunk is not None and given.chunk != rule.chunk)):
        if differs:
            raise ValueError(f"{fn}: argument '{name}' differs from the block mask's ({ruled!r}); the "
                             f"block mask carries the mask: pass {name} to create_block_mask, not to this call")
    batch, heads = batch_and_heads(q.shape)
    seen = (block_mask.seq_q, block_mask.seq_k, *block_mask.kinds.shape[:2])
    if seen[:2] != (q.shape[-2], k.shape[-2]) or seen[2] not in (1, batch) or seen[3] not in (1, heads):
        raise ValueError(f"{fn}: argument 'block_mask' was built for (batch {seen[2]}, heads {seen[3]}, seq_q "
                         f"{seen[0]}, seq_k {seen[1]}) but the call has ({batch}, {heads}, {q.shape[-2]}, "
                         f"{k.shape[-2]}); build it for these shapes (batch and heads may be 1)")
    return options._replace(visibility=rule, block_mask=block_mask)
