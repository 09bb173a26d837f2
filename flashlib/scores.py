"""Score functions: one idea behind soft-capping, ALiBi, relative-position biases and temperatures.

A score function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` is FlexAttention's: it gets
each scaled score ``scale * q.k`` of query ``q_idx`` and key ``kv_idx`` in head ``h`` of batch
row ``b`` and returns the score the softmax uses, before the mask. Every op of flashlib takes one
as ``score_mod=``; the references call it on index tensors, the kernels compile it from what it
does (:mod:`flashlib.kernels.scorefn`) with its derivative, so the backward's dS is the chain rule
through it. ``q_idx`` and ``kv_idx`` are positions within their own sequence, in every op.

The ready ones below are closures over numbers and tensors; a tensor that requires grad (ALiBi's
slopes, a bias table, a temperature) gets its gradient through autograd, computed
deterministically (:func:`captured_grads`)::

    softcap(c)           c * tanh(score / c)                          Gemma 2's soft-capping
    alibi(slopes)        score + slopes[h] * (kv_idx - q_idx)         ALiBi, (heads,)
    relative_bias(table) score + table[q_idx - kv_idx + (len - 1) // 2]  a bias per distance, (2n - 1,)
    t5_relative_bias(table, ...)  score + table[bucket(kv_idx - q_idx), h]  T5's log buckets, (buckets, heads)
    temperature(t)       score * t[h]                                 a per-head temperature, (heads,)

As a mask function's, the tensors a score function reads live on q's device: every op refuses one on
another device by name, before anything runs.
"""
from __future__ import annotations

import math
import numbers

import torch

FN = "flashlib.scores"


def softcap(cap: float):
    """c * tanh(score / c): scores squashed into (-c, c) (Gemma 2: c = 50 for attention)."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < cap < float("inf"):
        raise ValueError(f"{FN}.softcap: argument 'cap' must be a finite number > 0, got {cap!r}")
    cap = float(cap)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap_score.cap = cap  # what softcap= says, read back by the checks
    return softcap_score


def _vector(fn: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.ndim != 1 or not t.is_floating_point():
        kind = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.ndim}-d {t.dtype} tensor"
        raise TypeError(f"{FN}.{fn}: argument '{name}' must be a 1-d floating-point tensor, got {kind}")
    return t


def alibi(slopes: torch.Tensor):
    """score + slopes[h] * (kv_idx - q_idx): ALiBi's linear penalty on distance, one slope per query
    head ((heads,), learnable if it requires grad). :func:`alibi_slopes` gives the paper's."""
    slopes = _vector("alibi", "slopes", slopes)

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_score


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes for ``heads`` heads: 2^(-8 i / heads), i = 1 .. heads (a power of two of heads;
    others interleave the next power's, as the paper's code does)."""
    if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads < 1:
        raise ValueError(f"{FN}.alibi_slopes: argument 'heads' must be an int >= 1, got {heads!r}")
    n = 1 << (int(heads).bit_length() - 1)  # the largest power of two <= heads
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    if n < heads:
        extra = [2.0 ** (-4.0 * (i + 1) / n) for i in range(2 * n)][0::2]
        slopes += extra[:heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def relative_bias(table: torch.Tensor):
    """score + table[q_idx - kv_idx + center], center = (len(table) - 1) // 2: one learnable bias per
    distance, (2 n - 1,) for distances -(n - 1) .. n - 1 (T5's buckets without the buckets)."""
    table = _vector("relative_bias", "table", table)
    center = (table.shape[0] - 1) // 2

    def relative_bias_score(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + center]

    return relative_bias_score


def t5_bucket(relative_position: torch.Tensor, *, num_buckets: int = 32, max_distance: int = 128,
              bidirectional: bool = True) -> torch.Tensor:
    """T5's bucket of each relative position (key position - query position), as T5 defines it (Mesh
    TensorFlow; transformers' ``T5Attention._relative_position_bucket``, float32 logarithms included):
    exact buckets for distances below half a side's buckets, logarithmic ones up to ``max_distance``,
    the last bucket beyond; with ``bidirectional``, half the buckets for keys after the query."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.minimum(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(distance < max_exact, distance, large)


def t5_relative_bias(table: torch.Tensor, *, num_buckets: int | None = None, max_distance: int = 128,
                     bidirectional: bool = True):
    """score + table[bucket(kv_idx - q_idx), h]: T5's relative position bias, one learnable bias per
    bucket of distance and head; table (num_buckets, heads), as T5's ``relative_attention_bias.weight``
    (num_buckets: its rows unless given). The buckets (:func:`t5_bucket`, T5's own definition) are
    computed once, here, for the distances -max_distance .. max_distance, in whose last buckets every
    farther distance falls: the kernels read them from that small table, so that a bucket is the one
    T5's float32 logarithm gives, whatever logarithm a GPU computes."""
    fn = "t5_relative_bias"
    if not isinstance(table, torch.Tensor) or table.ndim != 2 or not table.is_floating_point():
        kind = type(table).__name__ if not isinstance(table, torch.Tensor) else f"a {table.ndim}-d {table.dtype} tensor"
        raise TypeError(f"{FN}.{fn}: argument 'table' must be a 2-d floating-point tensor (num_buckets, heads), as "
                        f"T5's relative_attention_bias.weight, got {kind}")
    num_buckets = table.shape[0] if num_buckets is None else num_buckets
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, numbers.Integral) or num_buckets != table.shape[0]:
        raise ValueError(f"{FN}.{fn}: argument 'num_buckets' is {num_buckets!r} but 'table' has {table.shape[0]} rows, "
                         "one per bucket; pass the table's row count (or leave num_buckets out)")
    side = num_buckets // 2 if bidirectional else num_buckets  # the buckets of one side
    if side < 2 or isinstance(max_distance, bool) or not isinstance(max_distance, numbers.Integral) \
            or max_distance <= side // 2:
        raise ValueError(f"{FN}.{fn}: num_buckets {num_buckets} and max_distance {max_distance!r}: T5's buckets need "
                         f"at least 2 per side and max_distance > {max(side // 2, 1)} (its exact buckets' reach), "
                         "as T5's 32 and 128")
    reach = int(max_distance)
    buckets = t5_bucket(torch.arange(-reach, reach + 1, device=table.device), num_buckets=num_buckets,
                        max_distance=reach, bidirectional=bidirectional)

    def t5_relative_bias_score(score, b, h, q_idx, kv_idx):
        return score + table[buckets[(kv_idx - q_idx).clamp(-reach, reach) + reach], h]

    return t5_relative_bias_score


def temperature(t: torch.Tensor):
    """score * t[h]: a per-head temperature ((heads,), learnable if it requires grad)."""
    t = _vector("temperature", "t", t)

    def temperature_score(score, b, h, q_idx, kv_idx):
        return score * t[h]

    return temperature_score


# ----- the gradients of the tensors a score function captures ---------------------------------------

def trainable(tensors) -> list[torch.Tensor]:
    """The captured tensors whose gradient autograd wants: floating point, requiring grad."""
    return [t for t in tensors if t.is_floating_point() and t.requires_grad]


def captured_grads(score_mod, tensors, q, k, v, lse, dout, delta, *, scale: float, visible_of,
                   block_q: int = 128) -> list[torch.Tensor]:
    """d loss / d t for each tensor t the score function captures, from the forward's lse (natural)
    and delta = rowsum(dout * out) - dlse, all (batch, heads, seq_q[, d]); k, v expanded to q's heads.

    For each block of query rows, in order: the scores are recomputed, the function applied with
    autograd on (so its own graph says how each captured tensor entered), P = exp(s' - lse),
    dS' = P (dO Vᵀ - delta) where the pairs are visible, and autograd's vector-Jacobian product of
    s' with dS' adds each tensor's share. visible_of(q0, q1): the (.., q1 - q0, seq_k) boolean of the
    pairs that may attend, or None. A fixed order of fixed-shape sums, and PyTorch's deterministic
    index accumulation: the same bits every run. Any index pattern PyTorch can differentiate works."""
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[-2]
    b = torch.arange(batch, device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=q.device).view(1, -1, 1, 1)
    kv_idx = torch.arange(seq_k, device=q.device).view(1, 1, 1, -1)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # index_put's accumulation: sorted, not atomic
    try:
        for q0 in range(0, seq_q, block_q):
            q1 = min(q0 + block_q, seq_q)
            q_idx = torch.arange(q0, q1, device=q.device).view(1, 1, -1, 1)
            with torch.no_grad():
                s = (q[..., q0:q1, :].float() @ k.float().transpose(-2, -1)) * scale
            with torch.enable_grad():
                s_mod = score_mod(s, b, h, q_idx, kv_idx)
                with torch.no_grad():
                    p = torch.exp(s_mod - lse[..., q0:q1, None])
                    ds = p * (dout[..., q0:q1, :].float() @ v.float().transpose(-2, -1) - delta[..., q0:q1, None])
                    visible = visible_of(q0, q1)
                    if visible is not None:  # rows that see nothing have lse = -inf: p is inf there, not used
                        ds = torch.where(visible, ds, 0.0)
                parts = torch.autograd.grad(s_mod, tensors, grad_outputs=ds, allow_unused=True)
            for total, part in zip(grads, parts):
                if part is not None:
                    total += part.float()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    return [g.to(t.dtype) for g, t in zip(grads, tensors)]
