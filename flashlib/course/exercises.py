"""Checkers for the notebooks' exercises (01-04; kernel_exercises and perf_exercises use these helpers).

Every checker takes the student's answer (a number, a tensor or a function), never
raises, prints a clear pass or feedback saying what was expected, and returns True or
False. A hint comes with feedback on a wrong answer, not before a first try: the stored
notebooks show only "no answer yet". Where a hint would give the answer away, the checker
steps (:class:`HintSteps`): each wrong try gets a diagnosis and the next hint, from the idea
to the structure to code. Expected values are computed here from first principles (loops and
definitions), not by calling the flashlib function the exercise is about.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import threading
import weakref

import torch

from .. import edition
from . import verdicts

PASS = "PASS"
RETRY = "NOT YET"


def _passed(message: str) -> bool:
    print(f"{PASS}: {message}")
    verdicts.report(True, f"{PASS}: {message}")
    return True


class HintSteps:
    """An exercise's hints in order, from the idea to the structure to code: each wrong try
    shows the next one (the last repeats), so the answer comes only after repeated tries.
    ``answer`` names the exercise's worked answer, the last step (:mod:`flashlib.course.answers`, which
    the student edition leaves out); the student edition gives at most :data:`flashlib.edition.HINTS` steps.
    How many were given is kept per thread: a grader checks several students' answers at once."""

    _ALL: "weakref.WeakSet[HintSteps]" = weakref.WeakSet()

    def __init__(self, *hints: str, answer: str | None = None):
        self.written, self.key, self._given = hints, answer, threading.local()
        HintSteps._ALL.add(self)

    @property
    def given(self) -> int:
        return getattr(self._given, "count", 0)

    @given.setter
    def given(self, count: int) -> None:
        self._given.count = count

    @classmethod
    def reset_all(cls) -> None:
        """Every exercise's hints from the first again, in this thread."""
        for steps in list(cls._ALL):
            steps.reset()

    @property
    def hints(self) -> tuple[str, ...]:
        """The steps this edition gives: the hints, then the worked answer where this edition has it."""
        steps = self.written + ((self.answer,) if self.key is not None and edition.answers_shipped() else ())
        return edition.given(steps)

    def next(self) -> tuple[str, str]:
        """(label, text) of the next hint, e.g. ("hint 1 of 3", "...")."""
        hints = self.hints
        if not hints:
            return "hint", edition.NO_HINTS
        self.given = min(self.given + 1, len(hints))
        return f"hint {self.given} of {len(hints)}", hints[self.given - 1]

    def reset(self) -> None:
        self.given = 0

    @property
    def answer(self) -> str:
        """The worked answer (the full edition's; the student edition says it has none)."""
        if self.key is None:
            return self.written[-1]
        if not edition.answers_shipped():
            raise RuntimeError(f"{edition.NO_SOLUTIONS}: the hints of this exercise go as far as this edition's "
                               "teacher chose.")
        from .answers import ANSWERS

        return ANSWERS[self.key]


def print_solution(solutions: dict, name: str) -> None:
    """Print the answer of exercise ``name`` from a notebook's {name: HintSteps} at once (in the student
    edition, that it has none)."""
    if name not in solutions:
        raise ValueError(f"solution: argument 'name' is {name!r}; the exercises with one are {', '.join(solutions)}")
    if solutions[name].key is not None and not edition.answers_shipped():
        print(f"{edition.NO_SOLUTIONS}: the checker says what is wrong, and each wrong try gives the next hint.")
        return
    print(solutions[name].answer)


def _failed(message: str, hint) -> bool:
    """Print a NOT YET with ``hint``: a string, or the next of a :class:`HintSteps`."""
    label, text = hint.next() if isinstance(hint, HintSteps) else ("hint", edition.one_hint(hint))
    print(f"{RETRY}: {message}\n  {label}: {text}")
    verdicts.report(False, f"{RETRY}: {message}")
    return False


def _unanswered(answer, kind: str, hint: str = "") -> bool | None:
    """False (after saying what is expected) when there is no answer yet; the hint waits for a try."""
    if answer is None or answer is Ellipsis:
        print(f"{RETRY}: no answer yet; expected {kind}.")
        verdicts.report(False, f"{RETRY}: no answer yet; expected {kind}.")
        return False
    return None


def _as_number(answer):
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        return answer.item()
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        return answer
    return None


class Digest(str):
    """What a checker keeps of an answer instead of the answer (:func:`digest`): reading the checker gives
    the answer away no more than a hash does."""


def _digits(rel: float) -> int:
    return max(1, round(-math.log10(rel))) if rel > 0 else 17


def digest(name: str, value, rel: float = 0.0) -> Digest:
    """The digest of exercise ``name``'s answer ``value``: "name:" and the SHA-256 of the name and a canonical
    text of the value (a whole number, a float to the significant digits the tolerance ``rel`` asks for, a
    string, a set of strings, a tensor's dtype, shape and values)."""
    if isinstance(value, (set, frozenset)):
        text = "set:" + ",".join(sorted(map(str, value)))
    elif isinstance(value, str):
        text = "str:" + value
    elif isinstance(value, torch.Tensor):
        text = f"tensor:{value.dtype}:{list(value.shape)}:{value.flatten().tolist()}"
    elif isinstance(value, numbers.Integral) and rel == 0:
        text = f"int:{int(value)}"
    else:
        text = f"float:{float(value) + 0.0:.{_digits(rel) - 1}e}"  # + 0.0: -0.0 is 0.0
    return Digest(f"{name}:{hashlib.sha256(f'{name}|{text}'.encode()).hexdigest()[:16]}")


def matches(value, wanted: Digest, rel: float = 0.0) -> bool:
    """Whether ``value`` is, within ``rel``, the answer whose digest is ``wanted``: its own digest or a
    neighbour's (v·(1 ± rel) round to the digits either side of a rounding edge)."""
    name = wanted.split(":", 1)[0]
    if rel == 0 or not isinstance(value, numbers.Real):
        return digest(name, value, rel) == wanted
    return any(digest(name, v, rel) == wanted for v in (value * (1 - rel), value, value * (1 + rel)))


def _check_number(answer, expected, *, kind, hint, rel=1e-4, known_mistakes=(), exact=False):
    """Compare a numeric answer with ``expected`` (a :class:`Digest` of it, or the number); ``known_mistakes``
    maps values (or their digests) to advice."""
    unanswered = _unanswered(answer, kind, hint)
    if unanswered is not None:
        return unanswered
    value = _as_number(answer)
    if value is None or not math.isfinite(value) or exact and value != int(value):
        return _failed(f"expected {kind}, got {type(answer).__name__} {answer!r}.", hint)
    if isinstance(expected, Digest):
        return _check_digest(int(value) if exact else float(value), expected, 0.0 if exact else rel,
                             known_mistakes, hint)
    if exact and value == expected or not exact and math.isclose(value, expected, rel_tol=rel):
        return _passed(f"{_fmt(value)} is right.")
    for wrong, advice in known_mistakes:
        if math.isclose(value, wrong, rel_tol=rel):
            return _failed(f"{_fmt(value)} is not it: {advice}", hint)
    direction = "too large" if value > expected else "too small"
    return _failed(f"{_fmt(value)} is {direction} (off by a factor of {_fmt(value / expected)})"
                   if expected else f"{_fmt(value)} is not right.", hint)


def _check_digest(value, expected: Digest, rel: float, known_mistakes, hint) -> bool:
    if matches(value, expected, rel):
        return _passed(f"{_fmt(value)} is right.")
    for wrong, advice in known_mistakes:
        if matches(value, wrong, rel):
            return _failed(f"{_fmt(value)} is not it: {advice}", hint)
    return _failed(f"{_fmt(value)} is not it.", hint)


def _fmt(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{float(x):.4g}"


def _call(fn, name, *args):
    """Run the student's function; return (result, None) or (None, error message)."""
    if not callable(fn):
        return None, f"expected a function {name}, got {type(fn).__name__}"
    try:
        return fn(*args), None
    except Exception as error:  # a student's bug must become feedback, not a traceback
        return None, f"{name} raised {type(error).__name__}: {error}"


def _check_tensor(result, expected, name, hint, atol=1e-5, rtol=1e-4) -> str | None:
    """None if ``result`` matches ``expected``; else what is wrong, in shape/value terms."""
    if not isinstance(result, torch.Tensor):
        return f"{name} should return a torch.Tensor of shape {tuple(expected.shape)}, " \
               f"got {type(result).__name__}"
    if tuple(result.shape) != tuple(expected.shape):
        return f"{name} returned shape {tuple(result.shape)}; expected {tuple(expected.shape)}"
    if not torch.isfinite(result.double()).all() and torch.isfinite(expected).all():
        return f"{name} returned inf or NaN entries where the right answer is finite"
    error = (result.double() - expected.double()).abs().max().item()
    if not torch.allclose(result.double(), expected.double(), atol=atol, rtol=rtol):
        return f"{name} has the right shape but is off by up to {error:.4g}"
    return None


# ----- notebook 01: dense attention ------------------------------------------------------

MEMORY_LIMIT = dict(heads=32, element_size=4, gib=80)


def check_longest_sequence(answer) -> bool:
    """The longest N whose float32 S and P (batch 1, 32 heads) fit together in 80 GiB."""
    heads, size, gib = MEMORY_LIMIT.values()
    return _check_number(
        answer, Digest("longest_sequence:4a16b2e9b8b9a239"), kind="an int (tokens)", exact=True,
        hint=f"S and P are both alive while softmax runs: 2 x {heads} heads x N x N x {size} bytes must stay "
             f"at or below {gib} x 2^30 bytes; solve for N and round down.",
        known_mistakes=[(Digest("longest_sequence:d2eae2c7deee2f35"), "S and P are alive at the same time: two N x N "
                         "matrices per head, not one."),
                        (Digest("longest_sequence:738d1ff3a0da0dbb"), "a GiB is 2^30 bytes, not 10^9."),
                        (Digest("longest_sequence:5e35180ca240cd55"), "every head has its own S and P.")])


CAUSAL_SHAPE = (3, 5)


def check_causal_mask(answer) -> bool:
    """Boolean (3, 5) mask, True where query i may see key j, aligned bottom-right."""
    seq_q, seq_k = CAUSAL_SHAPE
    hint = (f"row i may see key j when j <= i + (seq_k - seq_q); with seq_q={seq_q}, seq_k={seq_k} "
            f"the last query sees every key.")
    unanswered = _unanswered(answer, f"a boolean tensor of shape {CAUSAL_SHAPE}", hint)
    if unanswered is not None:
        return unanswered
    if not isinstance(answer, torch.Tensor):
        return _failed(f"expected a torch.Tensor of shape {CAUSAL_SHAPE}, got {type(answer).__name__}.", hint)
    if tuple(answer.shape) != CAUSAL_SHAPE:
        return _failed(f"your mask has shape {tuple(answer.shape)}; expected (seq_q, seq_k) = {CAUSAL_SHAPE}.", hint)
    mask = answer.bool().cpu()
    if matches(mask, Digest("causal_mask:267bb5d8bf9a427d")):
        return _passed(f"the mask is bottom-right aligned: {int(mask.sum())} visible (query, key) pairs.")
    if matches(mask, Digest("causal_mask:bf0558ddf9ff0790")):
        return _failed("this is aligned to the top-left diagonal (PyTorch SDPA's convention); "
                       "flashlib aligns to the bottom-right.", hint)
    return _failed(f"some of its {mask.numel()} entries are not those of the bottom-right rule.", hint)


STANDARD_IO = dict(n=2048, d=128)


def check_standard_io(answer) -> bool:
    """Elements standard attention reads plus writes in HBM for N = 2048, d = 128."""
    return _check_number(
        answer, Digest("standard_io:26bdf41deba36fd7"), kind="an int (elements)", exact=True,
        hint="count every matrix once per trip: Q, K, V read and O written (N x d each); "
             "S and P (N x N each) are each written once and read once.",
        known_mistakes=[(Digest("standard_io:9c1f515f9f8752b0"),
                         "S and P each make a round trip: written, then read back."),
                        (Digest("standard_io:c2408238e082593a"), "Q, K, V and O travel too (N x d each).")])


# ----- notebook 02: online softmax -------------------------------------------------------

ONLINE_ROW = (2.0, 5.0, 1.0, 7.0)


def _float_pair(answer):
    m, l = answer
    return float(_as_number(m)), float(_as_number(l))


def check_online_state(answer) -> bool:
    """The final (m, l) of online softmax over the row ONLINE_ROW."""
    hint = "m is the largest element; l = sum over the row of exp(x - m)."
    unanswered = _unanswered(answer, "a pair (m, l) of numbers", hint)
    if unanswered is not None:
        return unanswered
    try:
        m, l = _float_pair(answer)
    except Exception:
        return _failed(f"expected a pair (m, l) of numbers, got {answer!r}.", hint)
    m_ref = max(ONLINE_ROW)  # the row is printed: its max gives nothing away
    if m != m_ref:
        return _failed(f"m = {_fmt(m)}, but the running max of {list(ONLINE_ROW)} ends at {_fmt(m_ref)}.", hint)
    if matches(l, Digest("online_state:08f54f89256ca58c"), 1e-4):
        return _passed(f"m = {_fmt(m)}, l = {_fmt(l)}.")
    if matches(l, Digest("online_state:5e882a31f446bd05"), 1e-4):
        return _failed("l is sum exp(x) without subtracting m: that is the naive denominator.", hint)
    return _failed(f"m is right, l = {_fmt(l)} is not (expected a number between 1 and {len(ONLINE_ROW)}).", hint)


NEW_MAXIMUM = dict(m=5.0, l=2.5, x=7.0)


def check_new_denominator(answer) -> bool:
    """l after the element x = 7 arrives at the state (m, l) = (5, 2.5)."""
    return _check_number(
        answer, Digest("new_denominator:5d1f377b74ef2db5"), kind="a number",
        hint="two things happen: the old terms, measured against m = 5, are re-expressed against the new "
             "max 7 (multiply l by e^(5 - 7)); then x's own term, e^(x - 7), is added.",
        known_mistakes=[(Digest("new_denominator:0909a0c69240543e"),
                         "the old terms are rescaled, but x's own term e^(7 - 7) = 1 "
                         "is missing."),
                        (Digest("new_denominator:e119a5b56549e6d1"),
                         "x's term is added, but the old terms still count against the old max 5: "
                         "rescale them by e^(5 - 7)."),
                        (Digest("new_denominator:6640d5980d8a58e9"),
                         "the rescale goes the other way: the max grew, so the "
                         "old terms shrink by e^(m_old - m_new).")])


# ----- notebook 03: tiled attention ------------------------------------------------------

TILE_COUNT = dict(seq=10, block_q=4, block_k=3)


def check_tile_count(answer) -> bool:
    """Tiles computed for seq_q = seq_k = 10, block_q = 4, block_k = 3, not causal."""
    return _check_number(
        answer, Digest("tile_count:c9ad2cc6af88d8f2"), kind="an int (tiles)", exact=True,
        hint="the last block or tile may be short but still counts: ceil(10 / 4) query blocks "
             "times ceil(10 / 3) key tiles.",
        known_mistakes=[(Digest("tile_count:6110a10d866b5ffc"),
                         "the uneven last block and last tile are computed too.")])


CAUSAL_TILES = dict(seq=8, block_q=2, block_k=2)


def check_causal_tiles(answer) -> bool:
    """Tiles computed (not skipped) for causal attention, seq 8, 2x2 tiles."""
    return _check_number(
        answer, Digest("causal_tiles:4a2a0a12ce894a65"), kind="an int (tiles)", exact=True,
        hint="a tile is skipped only when every (query, key) pair in it is masked: draw the 4 x 4 "
             "grid of tiles and count those on or below the diagonal.",
        known_mistakes=[(Digest("causal_tiles:56028312648710a5"),
                         "that counts every tile; tiles entirely above the diagonal are "
                         "skipped."),
                        (Digest("causal_tiles:1ca0d7271530454b"), "that is the number of skipped tiles.")])


KEY_MAJOR = dict(n=4096, block_k=128)


def check_key_major_traffic(answer) -> bool:
    """How many times more elements of O the key-major loop moves through HBM than the query-major one."""
    return _check_number(
        answer, Digest("key_major_traffic:e44970221a844e21"), kind="a number (a ratio)",
        hint="key-major: for each key tile, every query block reads its O (and m, l) from HBM and writes it "
             "back. Query-major: O stays in fast memory and is written once. Count the trips of one row of O.",
        known_mistakes=[(Digest("key_major_traffic:689b9e62f7d17dba"),
                         "each visit both reads O and writes it back: two trips per key tile."),
                        (Digest("key_major_traffic:9e2a6da55db0b249"),
                         "the key-major loop cannot keep O in fast memory: it moves on to another query "
                         "block after each tile.")])


# ----- notebook 04: backward -------------------------------------------------------------

def check_delta(delta) -> bool:
    """``delta(dout, out)`` -> rowsum(dO ∘ O), shape (batch, heads, seq)."""
    hint = "multiply dO and O elementwise, then sum over head_dim (the last dim): one number per query row."
    unanswered = _unanswered(delta, "a function delta(dout, out)", hint)
    if unanswered is not None:
        return unanswered
    generator = torch.Generator().manual_seed(2)
    dout, out = (torch.randn(2, 3, 5, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = torch.tensor([[[sum(dout[b, h, i, c].item() * out[b, h, i, c].item() for c in range(4))
                               for i in range(5)] for h in range(3)] for b in range(2)], dtype=torch.float64)
    result, error = _call(delta, "delta", dout, out)
    if error:
        return _failed(error + ".", hint)
    problem = _check_tensor(result, expected, "delta", hint)
    if problem and isinstance(result, torch.Tensor) and tuple(result.shape) == (2, 3, 5, 4):
        problem += " (the elementwise product is there; it still needs the sum over head_dim)"
    if problem:
        return _failed(problem + ".", hint)
    return _passed("delta has shape (batch, heads, seq) and matches rowsum(dO * O).")


def check_probs_from_lse(probs) -> bool:
    """``probs(s, lse)`` -> P, recomputed from the scores and the saved log-sum-exp."""
    hint = "P_ij = exp(S_ij - lse_i): subtract first, then exponentiate, so nothing overflows."
    unanswered = _unanswered(probs, "a function probs(s, lse)", hint)
    if unanswered is not None:
        return unanswered
    generator = torch.Generator().manual_seed(3)
    s = torch.randn(2, 4, 6, generator=generator, dtype=torch.float64) * 3
    s[0, 0] += 1000.0  # large logits: exp(s) alone would overflow
    m = s.amax(dim=-1, keepdim=True)
    lse = (m + torch.log(torch.exp(s - m).sum(dim=-1, keepdim=True))).squeeze(-1)
    expected = torch.exp(s - m) / torch.exp(s - m).sum(dim=-1, keepdim=True)
    result, error = _call(probs, "probs", s, lse)
    if error:
        return _failed(error + ".", hint)
    problem = _check_tensor(result, expected, "probs", hint)
    if problem:
        return _failed(problem + " (one row has logits near 1000).", hint)
    return _passed("P recomputed from lse matches softmax(S), large logits included.")


ATOMIC_GRADIENTS = ("dq", "dk", "dv")


def check_atomics(answer) -> bool:
    """Which of dq, dk, dv need atomic additions when every query block is its own GPU program
    (the tiled backward's loops swapped: query blocks outside, key tiles inside)."""
    hint = ("a program may write rows no other program writes without atomics. With one program per query "
            "block, which gradients have rows indexed by queries, and which by keys?")
    unanswered = _unanswered(answer, "a set of names such as {'dq'}", hint)
    if unanswered is not None:
        return unanswered
    try:
        names = {str(a).strip().lower().replace(" ", "") for a in ([answer] if isinstance(answer, str) else answer)}
    except TypeError:
        return _failed(f"expected a set of names from {ATOMIC_GRADIENTS}, got {answer!r}.", hint)
    if not names <= set(ATOMIC_GRADIENTS):
        return _failed(f"expected names from {ATOMIC_GRADIENTS}, got {sorted(names)}.", hint)
    if matches(names, Digest("atomics:45d6ead3773454a6")):
        return _passed(f"{' and '.join(sorted(names))}: their rows belong to keys, which every query block's "
                       "program visits; the other's rows belong to the program's own queries.")
    if matches(names, Digest("atomics:9013025f37ba51a3")):
        return _failed("that is the answer for the loop order the course uses (key tiles outside, as in "
                       "FlashAttention-2's dK/dV kernel); here the loops are swapped.", hint)
    if matches(names, Digest("atomics:93a638df5b550da6")):
        return _failed("dq's rows are the program's own queries: no other program writes them.", hint)
    return _failed(f"{sorted(names)} is not it.", hint)
