"""The optimisation ladder: from the readable kernel to the fast one, one change per rung.

Each :class:`Rung` says what it changes, why that should help, which callable runs it and
where it builds. Importing this module needs neither Triton nor a GPU (a notebook can show
the table anywhere); a rung's kernels are imported when it is first run or compiled.

``python -m flashlib.kernels.ladder`` compiles rungs for GPU targets in a subprocess, with
the helpers of :mod:`flashlib.kernels.compile` (JSON specs in, JSON reports out).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from .compile import TargetReport

# Compute capabilities the compile tests build for, and the Triton releases they build with:
# 3.6.0 (torch 2.11, the GPU check's machine) and 3.7.1 (torch 2.13, pinned here).
TARGETS = ((8, 0), (9, 0))
TRITON_VERSIONS = ("3.6.0", "3.7.1")


@dataclass(frozen=True)
class Rung:
    """One step of the ladder.

    kernel: the Triton kernel it launches (a name in forward.py / forward_fast.py).
    builds: (triton version, capability) pairs whose compiled kernel is the rung's own;
        anything else is listed in ``falls_back`` with what runs instead.
    """

    number: int
    name: str
    change: str
    why: str
    kernel: str
    builds: tuple[tuple[str, tuple[int, int]], ...]
    falls_back: str = ""

    def forward(self, q, k, v, causal: bool = False, scale: float | None = None, config=None):
        """(out, lse) of this rung; q, k, v (batch, heads, seq, head_dim)."""
        from . import forward_fast

        return forward_fast.forward(q, k, v, causal=causal, scale=scale, rung=self.name, config=config)

    def supports(self, triton_version: str, capability) -> bool:
        return (triton_version, tuple(capability)) in self.builds


_EVERYWHERE = tuple((version, cc) for version in TRITON_VERSIONS for cc in TARGETS)

LADDER = (
    Rung(0, "teaching",
         "the kernel of notebook 06 with the shipped tiles (flashlib.kernels.default_config)",
         "the baseline: one fixed choice of BLOCK_M, BLOCK_N, warps and stages per head dim",
         "forward._attn_fwd", _EVERYWHERE),
    Rung(1, "autotuned",
         "same kernel; BLOCK_M, BLOCK_N, warps and pipeline stages timed on the GPU, fastest kept",
         "the best tiles depend on the GPU, head dim, dtype and mask; measuring beats guessing",
         "forward._attn_fwd", _EVERYWHERE,
         "the CPU interpreter cannot autotune (no driver): it uses the fixed tiles"),
    Rung(2, "causal-split",
         "key tiles seen in full are folded without masks; only diagonal and ragged tiles are masked",
         "the mask is a compare-and-select on every score; most tiles do not need it",
         "forward_fast._attn_fwd_split", _EVERYWHERE),
    Rung(3, "tma",
         "rung 2 with Q, K, V, O moved by tensor descriptors (TMA bulk copies on sm_90)",
         "the copy engine moves whole tiles and pads the edges, freeing threads and registers",
         "forward_fast._attn_fwd_tma", tuple((version, (9, 0)) for version in TRITON_VERSIONS),
         "rung 2's kernel runs when head_dim * element size is not a multiple of 16 bytes, and on "
         "GPUs older than sm_90 (no copy engine)"),
    Rung(4, "lean",
         "rung 3 with the row max taken of raw scores and the scale applied inside exp2's argument; "
         "causal launches start with the longest query blocks",
         "one multiply fewer per score on the units that also compute the exponentials; the longest "
         "programs no longer end the launch alone",
         "forward_fast._attn_fwd_tma (LEAN=True)", tuple((version, (9, 0)) for version in TRITON_VERSIONS),
         "without descriptors (as for rung 3) rung 2's kernel runs with the same two changes; with "
         "scale <= 0 rung 3's fold runs (the scaled max needs a positive scale)"),
    Rung(5, "lazy-rescale",
         "rung 4, and on unmasked tiles the output and denominator are rescaled only when some row's max "
         "has grown by more than 8 (base 2) since its last rescale",
         "the rescale multiplies every output element (BLOCK_M x head_dim per tile); once a row's max "
         "settles, most tiles need none, at the price of one block-wide max and a branch per tile",
         "forward_fast._attn_fwd_tma (LEAN=True, LAZY=True)", tuple((version, (9, 0)) for version in TRITON_VERSIONS),
         "as rung 4: without descriptors rung 2's kernel with the same changes; with scale <= 0 rung 3's fold"),
)
BY_NAME = {rung.name: rung for rung in LADDER}


def rung(name: str) -> Rung:
    if name not in BY_NAME:
        raise ValueError(f"ladder: argument 'name' must be one of {tuple(BY_NAME)}, got {name!r}")
    return BY_NAME[name]


# The backward's steps, selected by flash_attention(..., backward=name); the forward of the
# measured "flashlib:<name>" rows is rung 3's, rung 4's for "lean" and "bulk" (perf_bench.BACKWARD_PAIRS).
BACKWARD_STEPS = (
    dict(name="teaching", change="notebook 07's three kernels with the shipped tiles; every tile masked",
         why="the baseline: P and dP recomputed twice (once for dK/dV, once for dQ), seven matmuls per tile pair"),
    dict(name="tuned", change="interior tiles unmasked; dK/dV and dQ each autotuned, with a tall resident block "
         "and a short streamed one", why="the two kernels want different shapes: 128 resident rows feed wgmma, "
         "a short streamed block keeps the recomputed tiles small"),
    dict(name="atomic", change="dQ added with float32 atomics from the dK/dV kernel: one kernel, five matmuls",
         why="saves recomputing P and dP for dQ; costs atomic traffic, a float32 dQ buffer and bitwise "
         "repeatability"),
    dict(name="lean", change="tuned, with the streamed blocks (Q and dO for dK/dV, K and V for dQ) moved by tensor "
         "descriptors on sm_90, and causal dQ blocks launched longest first",
         why="the forward's rungs 3 and 4 for the backward: the copy engine frees threads and registers, and "
         "the longest programs no longer end the launch alone"),
    dict(name="bulk", change="atomic, with lean's descriptors for Q and dO, and each dQ tile added by one bulk "
         "reduction of the copy engine (sm_90) instead of one atomic instruction per element; the autotuner may "
         "build dQ transposed (K^T dS^T)",
         why="five matmuls per tile pair instead of seven, as FlashAttention-3's backward; the copy engine "
         "does the float32 additions in L2 while the warps go on; transposed, dQ's product has the head dim "
         "as its long side, not the few query rows, and runs on wgmma like the other four"),
)


def table() -> list[dict]:
    """The ladder as rows for printing or a DataFrame."""
    return [dict(rung=r.number, name=r.name, change=r.change, why=r.why, kernel=r.kernel,
                 falls_back=r.falls_back or "-") for r in LADDER]


# ----- compiling rungs for GPU targets ---------------------------------------------------

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
    done = subprocess.run([sys.executable, "-m", "flashlib.kernels.ladder"], input=json.dumps(list(specs)),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compile_rungs: the compiler process failed:\n{done.stderr[-4000:]}")
    return [RungReport(**{**r, "capability": tuple(r["capability"])}) for r in json.loads(done.stdout)]


def _kernel_and_constants(s):
    import torch

    from . import forward, forward_fast
    from .config import FlashConfig, default_config, head_dim_pad

    cfg = (FlashConfig(**s["config"]) if s["config"]
           else default_config(s["head_dim"], getattr(torch, s["dtype"]), tuple(s["capability"])))
    constants = dict(HEAD_DIM_PAD=head_dim_pad(s["head_dim"]), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
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

    from .compile import compile_and_inspect

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
        raise SystemExit("flashlib.kernels.ladder: run with TRITON_INTERPRET=0; interpreted kernels "
                         "cannot be compiled")
    specs = json.loads(sys.stdin.read())
    json.dump([_compile_one(s) for s in specs], sys.stdout)


if __name__ == "__main__":
    main()
