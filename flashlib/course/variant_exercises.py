"""Exercise checkers of notebook 09: tiles a window computes, the KV cache a model keeps, a mask function
(whose hints step from the idea to code; ``solution("sink_window")`` prints an answer at once)."""
from __future__ import annotations

import torch

from .exercises import Digest, HintSteps, print_solution, _check_number, _failed, _passed, _unanswered
from .remote import beside_answer

WINDOW_TILES = dict(n=4096, left=300, block=64)


def check_window_tiles(answer) -> bool:
    """Tiles computed (not skipped) by causal attention with window=(300, 0), N = 4096, 64 x 64 tiles."""
    n, left, block = WINDOW_TILES.values()
    return _check_number(
        answer, Digest("window_tiles:e28624ecf593f017"), kind="a whole number of tiles", exact=True,
        hint=f"query block qb holds rows qb·{block} .. qb·{block} + {block - 1}; its first row sees keys from "
             f"qb·{block} - {left}, its last row up to itself: count the key tiles between, for every block (the "
             "first blocks are cut at key 0)",
        known_mistakes=[(Digest("window_tiles:88bc00d6ae384ca6"),
                         f"that is causal attention without the window: the window skips the tiles "
                         f"more than {left} keys back"),
                        (Digest("window_tiles:0956e3392ad5a15e"),
                         f"the window does not start on a tile's edge: {left} keys "
                         f"back reach into one more tile than {left} // {block} + 1"),
                        (Digest("window_tiles:1d463ba995b373f4"),
                         "close: the first few query blocks cannot look back the whole window")])


KV_CACHE = dict(layers=32, q_heads=32, kv_heads=8, head_dim=128, element_size=2)


def check_kv_bytes_per_token(answer) -> bool:
    """Bytes of K and V one token adds to the cache of a 32-layer model, 8 kv heads of 128, bf16."""
    return _check_number(
        answer, Digest("kv_bytes_per_token:b2f7a1282ea3c036"), kind="a whole number of bytes",
        exact=True,
        hint="every layer keeps one key and one value vector per kv head for every token: 2 x layers x kv heads x "
             "head dim x bytes per element",
        known_mistakes=[(Digest("kv_bytes_per_token:1bd36ae15eddbf8c"), "the cache holds the kv heads only: "
                         "grouped-query attention shares each among 4 query heads"),
                        (Digest("kv_bytes_per_token:5f4c5b25fda4e352"), "both K and V are cached"),
                        (Digest("kv_bytes_per_token:2639ebfa3f35f852"), "every layer has a cache of its own")])


SINK_WINDOW = dict(sink=4, window=128, n=300)
SINK_HINTS = HintSteps(
    "say the rule in words first: a key is visible when it is not after the query, and it is either one of the "
    "first keys or one of the latest; each part is one comparison of q_idx and kv_idx",
    "three comparisons: kv_idx against q_idx (causal), kv_idx against 4 (the sink), and the distance q_idx - kv_idx "
    "against 128 (the query itself is at distance 0, so its 128 latest keys are at distances 0 to 127); combine "
    "them as causal & (sink | window), with parentheses around every comparison",
    answer="sink_window")
SOLUTIONS = {"sink_window": SINK_HINTS}


def solution(name: str) -> None:
    """Print an answer to exercise ``name`` at once (the checker gives it only after repeated tries)."""
    print_solution(SOLUTIONS, name)


def _expected_sink_window(n, sink, window):
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    return (kv <= q) & ((kv < sink) | (q - kv < window))


def check_sink_window(mask_mod) -> bool:
    """``mask_mod(b, h, q_idx, kv_idx)``: causal, each query sees the first 4 keys and the 128 latest
    (itself included); checked on index tensors, then compiled into the kernel. A wrong try gets
    a diagnosis (the first (query, key) pair that differs) and the next of :data:`SINK_HINTS`."""
    sink, window, n = SINK_WINDOW.values()
    unanswered = _unanswered(mask_mod, "a function mask_mod(b, h, q_idx, kv_idx)")
    if unanswered is not None:
        return unanswered
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    try:
        got = mask_mod(zero, zero, torch.arange(n)[:, None], torch.arange(n)[None, :])
        got = torch.as_tensor(got).expand(n, n).bool()
    except RuntimeError as error:
        if "ambiguous" in str(error):
            return _failed("`and`, `or` and `if` ask a whole tensor for one truth value: write & and | (with "
                           "parentheses around each comparison).", SINK_HINTS)
        return _failed(f"mask_mod raised {type(error).__name__}: {error}", SINK_HINTS)
    except Exception as error:  # the learner's code: report, never raise
        return _failed(f"mask_mod raised {type(error).__name__}: {error}", SINK_HINTS)
    want = _expected_sink_window(n, sink, window)
    if not torch.equal(got, want):
        return _failed(_sink_window_mistake(got, want, n, sink, window), SINK_HINTS)
    return _compiled(mask_mod, want, SINK_HINTS)


def _first(pairs: torch.Tensor) -> tuple[int, int]:
    q, k = pairs.nonzero()[0].tolist()
    return q, k


def _sink_window_mistake(got, want, n, sink, window) -> str:
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    if (got & future).any():
        q, k = _first(got & future)
        return f"query {q} sees key {k}, which comes after it (in its future): the mask must be causal too."
    late = window + 20  # a query whose window no longer reaches the sink
    if not got[late, :sink].all():
        k = int((~got[late, :sink]).nonzero()[0])
        return f"query {late} does not see key {k}, one of the first {sink} keys (the sink), which every query sees."
    q, k = _first(got != want)
    distance = q - k
    edge = (f" Key {k} is {distance} positions back: check the window's edge, {window} latest keys including the "
            f"query's own (distances 0 to {window - 1}).") if abs(distance - window) <= 1 else \
        " A query always sees its own key." if distance == 0 else ""
    return f"query {q} and key {k}: your mask says {bool(got[q, k])}, the rule says {bool(want[q, k])}." + edge


def _compiled(mask_mod, want, hint) -> bool:
    """The same function compiled into the kernel (or interpreted without a GPU), against the mask."""
    from ..kernels import kernel_status

    status = kernel_status()
    if not status.can_run:
        hint.reset()
        return _passed(f"the mask is right on index tensors ({status}: the kernel check needs Triton).")
    outputs = _kernel_and_dense(mask_mod, want.shape[0], "cuda" if status.mode == "gpu" else "cpu")
    if isinstance(outputs, str):
        return _failed(f"on index tensors the mask is right, but it did not compile into the kernel: {outputs}", hint)
    got, ref = outputs
    if not torch.allclose(got, ref, atol=2e-3, rtol=2e-3):
        return _failed("on index tensors the mask is right, but the kernel's output differs from dense "
                       "attention with the same mask.", hint)
    hint.reset()
    return _passed("the mask is right on index tensors, and compiled into the kernel it gives dense "
                   "attention's output.")


@beside_answer
def _kernel_and_dense(mask_mod, n: int, device: str):
    """(the kernel's output, dense attention's) with ``mask_mod`` on (1, 2, n, 16) inputs, in float64 on the CPU;
    or what the kernel raised. Run where ``mask_mod`` is (in the student's process, while a class is graded)."""
    from .. import dense_attention, flash_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(device) for _ in range(3))  # (B, H, N, D)
    try:
        got = flash_attention(q, k, v, mask_mod=mask_mod)
    except Exception as error:  # the learner's function: report, never raise
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    ref = dense_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask_mod=mask_mod)
    return got.double().cpu(), ref
