"""Compile the ladder's kernels for GPU targets without a GPU (JSON specs in, JSON reports out).

A spec names a forward rung of :data:`flashlib.ladder.rungs.LADDER` ("tma", "lean", ...) or an
autotuned kernel of a backward, ``bwd_<kernel>_<backward>`` (:data:`KERNELS`: "bwd_dkdv_lean",
"bwd_fused_bulk", ...), and is compiled as the launchers run it on that target: with
descriptors (and bulk reductions) from sm_90 on, without them before.
``python -m flashlib.ladder.compile`` is the subprocess :func:`compile_rungs` starts with
``TRITON_INTERPRET=0``, using the inspection helpers of :mod:`flashlib.kernels.compile`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from ..kernels.compile import TargetReport
from .rungs import BACKWARDS, BY_NAME

# the backwards' autotuned kernels by the names specs give them: kernel name -> (backward, role)
KERNELS = {f"bwd_{role}_{b.name}": (b.name, role) for b in BACKWARDS for role in b.tiles}
_DTYPES = ("float16", "bfloat16", "float32")


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
    dtype = str(dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise ValueError(f"ladder.spec: argument 'dtype' must be one of {_DTYPES}, got {dtype!r}")
    if config is not None and not isinstance(config, dict):
        config = asdict(config)
    return dict(rung=name, capability=tuple(capability), dtype=dtype, head_dim=int(head_dim),
                causal=bool(causal), config=config, sass=bool(sass))


def compile_rungs(specs, *, triton_path: str | None = None, timeout: float = 900) -> list[RungReport]:
    """Compile every spec in a fresh Python with TRITON_INTERPRET=0; triton_path goes first
    on its PYTHONPATH (another Triton release installed with ``pip install --target``)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "flashlib.ladder.compile"], input=json.dumps(list(specs)),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compile_rungs: the compiler process failed:\n{done.stderr[-4000:]}")
    return [RungReport(**{**r, "capability": tuple(r["capability"])}) for r in json.loads(done.stdout)]


def _forward_kernel(name, hopper, head_dim, cfg):
    from ..kernels.config import head_dim_pad
    from . import forward

    rung = BY_NAME[name]
    descriptors = rung.kernel == forward.TMA_FORWARD and hopper  # below sm_90 no TMA
    kernel, options, _ = forward.variant(rung, descriptors)
    if kernel is not forward._attn_fwd:
        options["HEAD_DIM"] = head_dim
    else:  # v's head dim is q's on the ladder
        options.update(HEAD_DIM_V=None, HEAD_DIM_V_PAD=head_dim_pad(head_dim))
    tiles = dict(BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k)
    return kernel, {**options, **tiles}, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), ()


def _backward_kernel(name, hopper, head_dim, cfg):
    from . import backward
    from .rungs import backward as backward_named

    chosen, role = KERNELS[name]
    chosen = backward_named(chosen)
    if role == "fused" and not hopper:
        raise ValueError(f"{name}: the fused kernel builds for sm_90 only ({chosen.falls_back})")
    kernel, options = backward.variant(chosen, role, chosen.descriptors and hopper, bulk=True)
    if role == "fused":
        options["DQ_T"] = cfg.bwd_dq_transposed
    tiles = dict(BLOCK_Q=cfg.bwd_block_q, BLOCK_K=cfg.bwd_block_k, HEAD_DIM=head_dim)
    return (kernel, {**options, **tiles}, dict(num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages),
            ("DQ",) if role == "fused" else ())


def _kernel_and_constants(s):
    import torch

    from ..kernels.config import FlashConfig, default_config, head_dim_pad

    cfg = (FlashConfig(**s["config"]) if s["config"]
           else default_config(s["head_dim"], getattr(torch, s["dtype"]), tuple(s["capability"])))
    hopper = tuple(s["capability"]) >= (9, 0)
    build = _forward_kernel if s["rung"] in BY_NAME else _backward_kernel
    fn, constants, options, float32 = build(s["rung"], hopper, s["head_dim"], cfg)
    constants.update(HEAD_DIM_PAD=head_dim_pad(s["head_dim"]), CAUSAL=s["causal"],
                     INPUT_PRECISION=cfg.input_precision)
    return fn, constants, options, cfg, float32


def _compile_one(s) -> dict:
    import triton

    from ..kernels.compile import compile_and_inspect

    report = RungReport(rung=s["rung"], capability=tuple(s["capability"]), dtype=s["dtype"],
                        head_dim=s["head_dim"], causal=s["causal"], config=s["config"] or {},
                        triton_version=triton.__version__)
    try:
        fn, constants, options, cfg, float32 = _kernel_and_constants(s)
        report.config = asdict(cfg)
        compile_and_inspect(report, fn, s["dtype"], constants, options, s["capability"], sass=s.get("sass", False),
                            float32=float32)
        report.ok = True
    except Exception as exc:  # reported per spec, so one failure does not hide the others
        report.error = f"{type(exc).__name__}: {exc}"[:2000]
    out = asdict(report)
    out["capability"] = list(out["capability"])
    return out


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        raise SystemExit("flashlib.ladder.compile: run with TRITON_INTERPRET=0; interpreted kernels "
                         "cannot be compiled")
    specs = json.loads(sys.stdin.read())
    json.dump([_compile_one(s) for s in specs], sys.stdout)


if __name__ == "__main__":
    main()
