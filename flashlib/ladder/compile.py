"""Compile the ladder's kernels for GPU targets without a GPU (JSON specs in, JSON reports out).

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
from .rungs import rung

@dataclass
class RungReport(TargetReport):
    """One rung's kernel compiled for one target."""

    rung: str = field(default="", kw_only=True)


def spec(rung_name: str, capability=(9, 0), dtype="float16", head_dim=64, causal=False, config=None,
         sass: bool = False):
    """A JSON-able description of one rung compilation; config: a FlashConfig or its dict;
    sass: also count the machine instructions (RungReport.sass_ops)."""
    rung(rung_name)
    dtype = str(dtype).replace("torch.", "")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"ladder.spec: argument 'dtype' must be float16, bfloat16 or float32, got {dtype!r}")
    if config is not None and not isinstance(config, dict):
        config = asdict(config)
    return dict(rung=rung_name, capability=tuple(capability), dtype=dtype, head_dim=int(head_dim),
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


def _kernel_and_constants(s):
    import torch

    from ..kernels import forward
    from ..kernels.config import FlashConfig, default_config, head_dim_pad
    from . import forward as forward_fast

    cfg = (FlashConfig(**s["config"]) if s["config"]
           else default_config(s["head_dim"], getattr(torch, s["dtype"]), tuple(s["capability"])))
    constants = dict(HEAD_DIM_PAD=head_dim_pad(s["head_dim"]), BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k,
                     CAUSAL=s["causal"], INPUT_PRECISION=cfg.input_precision)
    if s["rung"] in ("teaching", "autotuned"):
        fn = forward._attn_fwd
    else:
        # what forward() launches: below sm_90 (no copy engine) rungs 3 and 4 run rung 2's kernel
        tma = s["rung"] != "causal-split" and tuple(s["capability"]) >= (9, 0)
        fn = forward_fast._attn_fwd_tma if tma else forward_fast._attn_fwd_split
        constants.update(HEAD_DIM=s["head_dim"], LEAN=s["rung"] in ("lean", "lazy-rescale"),
                         LAZY=s["rung"] == "lazy-rescale")
    return fn, constants, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), cfg


def _compile_one(s) -> dict:
    import triton

    from ..kernels.compile import compile_and_inspect

    report = RungReport(rung=s["rung"], capability=tuple(s["capability"]), dtype=s["dtype"],
                        head_dim=s["head_dim"], causal=s["causal"], config=s["config"] or {},
                        triton_version=triton.__version__)
    try:
        fn, constants, options, cfg = _kernel_and_constants(s)
        report.config = asdict(cfg)
        compile_and_inspect(report, fn, s["dtype"], constants, options, s["capability"], sass=s.get("sass", False))
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
