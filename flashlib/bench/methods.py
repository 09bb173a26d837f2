"""What the ladder benchmark times: one callable per method, named from the ladder's table.

    rung:<name>              a forward rung of :data:`flashlib.ladder.rungs.LADDER` (forward only)
    flashlib                 ``flashlib.flash_attention`` as shipped (forward and backward)
    ladder:<backward>        a backward of :data:`flashlib.ladder.rungs.BACKWARDS` with the forward
                             rung the table pairs it with (``Backward.forward``)
    ladder:teaching-4-warp   ``ladder:teaching`` with the backward on 64 x 64 tiles and 4 warps
    sdpa:<backend>           torch's scaled_dot_product_attention forced to one backend

``ladder:<forward>+<backward>`` names a pairing the table does not make (only recorded runs
hold one: :data:`flashlib.bench.records.RENAMED`). Each callable is f(q, k, v, causal) -> out.
"""
from __future__ import annotations

import torch

PUBLIC_OP = "flashlib"
FOUR_WARP = "ladder:teaching-4-warp"
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


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
    found.update({f"sdpa:{backend}": sdpa(backend) for backend in SDPA_BACKENDS})
    return found


def is_ours(name: str) -> bool:
    """A flashlib method (not an SDPA backend)."""
    return not name.startswith("sdpa:")
