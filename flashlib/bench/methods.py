"""What the ladder benchmark times: one callable per method, named from the ladder's table.

    rung:<name>              a forward rung of :data:`flashlib.ladder.rungs.LADDER` (forward only)
    flashlib                 ``flashlib.flash_attention`` as shipped (forward and backward)
    ladder:<backward>        a backward of :data:`flashlib.ladder.rungs.BACKWARDS` with the forward
                             rung the table pairs it with (``Backward.forward``)
    ladder:teaching-4-warp   ``ladder:teaching`` with the backward on 64 x 64 tiles and 4 warps
    flashlib:gqa             the teaching kernels with grouped-query heads (what flash_attention runs
                             for them): k and v the point's first heads / GQA_GROUP heads (one
                             where the heads do not divide)
    flashlib:window          the teaching kernels with a sliding window of WINDOW keys before each
                             query (and after it, where the point is not causal)
    sdpa:<backend>           torch's scaled_dot_product_attention forced to one backend

The two variants (:data:`VARIANTS`, forward and backward only) run the teaching kernels, as the
public op does for these options (the fastest rungs have none), and time another problem than
the point's own: their rows
keep the point's full-attention FLOPs (a window computes fewer) and belong to a point of their
own (:func:`flashlib.bench.grid.point_key`), so that no ratio sets them against the others.

``ladder:<forward>+<backward>`` names a pairing the table does not make (only recorded runs
hold one: :data:`flashlib.bench.records.RENAMED`). Each callable is f(q, k, v, causal) -> out.
"""
from __future__ import annotations

import torch

PUBLIC_OP = "flashlib"
FOUR_WARP = "ladder:teaching-4-warp"
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
GQA_GROUP = 4  # query heads per kv head (Llama 3 8B's 32 / 8)
WINDOW = 1024  # keys a query sees before it (Mistral 7B: 4096, Gemma 2: 4096, for longer sequences)
VARIANTS = {"flashlib:gqa": "gqa", "flashlib:window": "window"}


def rung_name(rung: str) -> str:
    return f"rung:{rung}"


def pair_name(backward: str, forward: str | None = None) -> str:
    """``ladder:<backward>``, or ``ladder:<forward>+<backward>`` for a pairing not in the table."""
    from ..ladder.rungs import BACKWARD_BY_NAME

    paired = BACKWARD_BY_NAME.get(backward)
    if forward is None or (paired is not None and paired.forward == forward):
        return f"ladder:{backward}"
    return f"ladder:{forward}+{backward}"


def sdpa(backend: str):
    """f(q, k, v, causal) running torch's scaled_dot_product_attention on one backend only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel([which]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def four_warp_backward(q):
    """The shipped configuration for q with the teaching backward on 64 x 64 tiles and 4 warps
    (2 pipeline stages at head dim 64, 1 above: more spill at 128). The shipped Hopper tiles,
    64 x 64 on 8 warps, hold every score twice (compile.exponentials_per_score); these hold
    each once, at the price of half the threads and shallower pipelining."""
    from dataclasses import replace

    from ..kernels.config import default_config, head_dim_pad

    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    stages = 2 if head_dim_pad(q.shape[-1]) <= 64 else 1
    return replace(default_config(q.shape[-1], q.dtype, capability), bwd_block_q=64, bwd_block_k=64,
                   bwd_num_warps=4, bwd_num_stages=stages)


def _forward_rung(rung: str):
    from ..ladder.forward import forward

    return lambda q, k, v, causal: forward(q, k, v, causal=causal, rung=rung)[0]


def _paired(forward: str, backward: str, config_for=None):
    from ..ladder import attention

    def run(q, k, v, causal):
        config = config_for(q) if config_for is not None else None
        return attention(q, k, v, causal=causal, forward=forward, backward=backward, config=config)
    return run


def _public_op(q, k, v, causal):
    from .. import flash_attention

    return flash_attention(q, k, v, causal=causal)


def _grouped(q, k, v, causal):
    """k and v cut to heads / GQA_GROUP heads (B, H_kv, N, d), one if H does not divide."""
    from ..kernels import attention

    heads = q.shape[1]
    kv_heads = heads // GQA_GROUP if heads % GQA_GROUP == 0 else 1
    return attention(q, k[:, :kv_heads], v[:, :kv_heads], causal=causal)


def _windowed(q, k, v, causal):
    from ..kernels import attention

    return attention(q, k, v, causal=causal, window=(WINDOW, 0 if causal else WINDOW))


def variant_of(name) -> str | None:
    """"gqa" or "window" for a variant's method name (:data:`VARIANTS`), None for the others."""
    return VARIANTS.get(name)


def methods(mode: str) -> dict:
    """{name: f(q, k, v, causal) -> out} for one pass ("fwd", or "fwd_bwd": forward and backward)."""
    from ..ladder.rungs import BACKWARDS, LADDER

    if mode not in ("fwd", "fwd_bwd"):
        raise ValueError(f"methods: argument 'mode' must be 'fwd' or 'fwd_bwd', got {mode!r}")
    found = {}
    if mode == "fwd":
        found.update({rung_name(rung.name): _forward_rung(rung.name) for rung in LADDER})
    else:
        found[PUBLIC_OP] = _public_op
        for backward in BACKWARDS:
            found[pair_name(backward.name)] = _paired(backward.forward, backward.name)
            if backward.name == "teaching":
                found[FOUR_WARP] = _paired(backward.forward, backward.name, four_warp_backward)
        found.update({"flashlib:gqa": _grouped, "flashlib:window": _windowed})
    found.update({f"sdpa:{backend}": sdpa(backend) for backend in SDPA_BACKENDS})
    return found


def is_ours(name: str) -> bool:
    """A flashlib method (not an SDPA backend)."""
    return not name.startswith("sdpa:")
