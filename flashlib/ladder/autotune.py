"""The ladder's one autotuner, shared by the forward rungs and the backward kernels.

A kernel's candidates come from the rung table (:mod:`flashlib.ladder.rungs`), chosen per
padded head dim when it is launched. Each (variant, sequence bucket) has an autotuner of its
own (:func:`flashlib.kernels.config.seq_bucket`): the best tiles change with the length, but
re-timing for every distinct length would stall a caller whose lengths vary. The autotuners
of one kernel share its compiled binaries: a new bucket re-times the candidates, it never
recompiles them. They are made on first use on a GPU (decorating builds a Python object
only; the driver is first touched when one is called).
"""
from __future__ import annotations

import torch

from ..kernels._mode import interpreting, require_triton
from .rungs import candidates

triton = require_triton()

# What a choice is kept for, besides the argument dtypes (which Triton adds): the compile-time
# arguments that change between launches of one variant. Names a kernel lacks are skipped.
KEY = ["HEAD_DIM", "CAUSAL", "INPUT_PRECISION", "TMA", "BULK_DQ"]

_TUNERS: dict = {}


def autotunes(dtype: torch.dtype, config) -> bool:
    """Whether a tuned path times its candidate tiles here: on a GPU (the interpreter cannot
    time kernels), for 16-bit inputs (the candidates are sized for them; float32 doubles
    every tile and would overflow shared memory), unless the caller fixed the tiles."""
    return config is None and not interpreting() and dtype in (torch.float16, torch.bfloat16)


def _config(bm, bn, w, s, dq_t=None):
    """A candidate (BLOCK_Q, BLOCK_K, warps, stages[, DQ_T]) as Triton's Config."""
    extra = {} if dq_t is None else {"DQ_T": dq_t}
    return triton.Config({"BLOCK_Q": bm, "BLOCK_K": bn, **extra}, num_warps=w, num_stages=s)


def _bench(kernel_call, quantiles):
    """Fewer repetitions than Triton's default: the ladder benchmark has a time budget."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def tuner(kernel, variant: tuple, bucket: int, tiles: dict, reset_to_zero=None):
    """The autotuner of one variant (any tuple naming what runs: kernel, step, backward) for
    one sequence bucket, timing ``kernel`` over ``tiles``' candidates for the launch's head
    dim. reset_to_zero: arguments zeroed before every timed run (a buffer added into)."""
    key = (*variant, bucket)

    def prune(configs, named_args, **kwargs):
        """Swap in the candidates of this head dim (the listed configs are placeholders)."""
        d_pad = kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD", 64))
        return [_config(*tile) for tile in candidates(tiles, d_pad)]

    if key not in _TUNERS:
        _TUNERS[key] = triton.autotune(configs=[_config(*tile) for tile in tiles[128]], key=KEY, do_bench=_bench,
                                       reset_to_zero=reset_to_zero,
                                       prune_configs_by={"early_config_prune": prune})(kernel)
    return _TUNERS[key]


def kept(variant: tuple, bucket: int, head_dim: int, causal: bool, dtype: torch.dtype) -> dict | None:
    """The tiles the autotuner of (variant, bucket) kept for this head dim, mask and dtype, as
    {"BLOCK_Q", "BLOCK_K", ["DQ_T",] "num_warps", "num_stages"}; None before its first GPU call."""
    found = _TUNERS.get((*variant, bucket))
    for key, config in (found.cache.items() if found else ()):
        if key[0] == head_dim and key[1] == causal and str(dtype) in key:
            return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return None


def all_tuners():
    """Every autotuner made so far in this process."""
    return list(_TUNERS.values())
