"""Compile the ladder's kernels for GPU targets without a GPU (JSON specs in, JSON reports out).

A spec names a forward rung of :data:`flashlib.ladder.rungs.LADDER` ("tma", "lean", ...) or an
autotuned kernel of a backward, ``bwd_<kernel>_<backward>`` (:data:`KERNELS`: "bwd_dkdv_lean",
"bwd_fused_bulk", ...), and is compiled as the launchers run it on that target: with
descriptors (and bulk reductions) from sm_90 on, without them before.
``python -m flashlib.ladder.compile`` is the subprocess :func:`compile_rungs` starts with
``TRITON_INTERPRET=0``, using the inspection helpers of :mod:`flashlib.kernels.compile`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels.compile import TargetReport, compile_spec, launch_tiles, run_compiler, serve, spec_config, target_spec
from .rungs import BACKWARDS, BY_NAME

# the backwards' autotuned kernels by the names specs give them: kernel name -> (backward, role)
KERNELS = {f"bwd_{role}_{b.name}": (b.name, role) for b in BACKWARDS for role in b.tiles}


@dataclass
class RungReport(TargetReport):
    """One kernel of the ladder compiled for one target; rung: the name the spec gave (a
    forward rung, or a backward's kernel ``bwd_<kernel>_<backward>``)."""

    rung: str = field(default="", kw_only=True)


def spec(name: str, capability=(9, 0), dtype="float16", head_dim=64, causal=False, config=None,
         sass: bool = False):
    """A JSON-able description of one compilation: ``name`` a forward rung or one of
    :data:`KERNELS`; config: a FlashConfig or its dict (forward rungs read its block_q, block_k,
    num_warps and num_stages, backward kernels its bwd_* fields); sass: also count the machine
    instructions (RungReport.sass_ops, .mma_loop)."""
    if name not in BY_NAME and name not in KERNELS:
        raise ValueError(f"ladder.spec: argument 'name' must be a rung of {tuple(BY_NAME)} or a backward "
                         f"kernel of {tuple(KERNELS)}, got {name!r}")
    return dict(rung=name, **target_spec("ladder.spec", capability, dtype, head_dim, causal, config), sass=bool(sass))


def compile_rungs(specs, *, triton_path: str | None = None, timeout: float = 900) -> list[RungReport]:
    """Compile every spec in a fresh Python (:func:`flashlib.kernels.compile.run_compiler`)."""
    return run_compiler("flashlib.ladder.compile", RungReport, specs, triton_path, timeout)


def _kernel_and_constants(s):
    """(kernel, compile-time arguments, options, FlashConfig, float32 pointers) of a spec, as the launchers
    run it on its target."""
    from ..kernels.config import head_dim_pad
    from . import backward, forward
    from .rungs import backward as backward_named

    cfg, hopper, d = spec_config(s), tuple(s["capability"]) >= (9, 0), s["head_dim"]
    float32 = ()
    if s["rung"] in BY_NAME:
        rung = BY_NAME[s["rung"]]
        # below sm_90 no TMA
        kernel, constants, _ = forward.variant(rung, rung.kernel == forward.TMA_FORWARD and hopper)
        if kernel is forward._attn_fwd:  # v's head dim is q's on the ladder
            constants.update(HEAD_DIM_V=None, HEAD_DIM_V_PAD=head_dim_pad(d))
        else:
            constants["HEAD_DIM"] = d
    else:
        chosen, role = KERNELS[s["rung"]]
        chosen = backward_named(chosen)
        if role == "fused" and not hopper:
            raise ValueError(f"{s['rung']}: the fused kernel builds for sm_90 only ({chosen.falls_back})")
        kernel, constants = backward.variant(chosen, role, chosen.descriptors and hopper, bulk=True)
        constants["HEAD_DIM"] = d
        if role == "fused":
            constants["DQ_T"] = cfg.bwd_dq_transposed
            float32 = ("DQ",)
    tiles, options = launch_tiles(cfg, backward=s["rung"] not in BY_NAME)
    constants.update(tiles, HEAD_DIM_PAD=head_dim_pad(d), CAUSAL=s["causal"], INPUT_PRECISION=cfg.input_precision)
    return kernel, constants, options, cfg, float32


if __name__ == "__main__":
    serve(lambda s: compile_spec(RungReport, s, _kernel_and_constants, rung=s["rung"]))
