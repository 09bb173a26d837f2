"""The optimisation ladder: from the readable kernel to the fast one, one change per rung.

Each :class:`Rung` says what it changes, why that should help, which callable runs it and
where it builds. Importing this module needs neither Triton nor a GPU (a notebook can show
the table anywhere); a rung's kernels are imported when it is first run or compiled.

:mod:`flashlib.ladder.compile` compiles rungs for GPU targets (``python -m flashlib.ladder.compile``).
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def supports(self, triton_version: str, capability) -> bool:
        return (triton_version, tuple(capability)) in self.builds


_EVERYWHERE = tuple((version, cc) for version in TRITON_VERSIONS for cc in TARGETS)

LADDER = (
    Rung(0, "teaching",
         "the kernel of notebook 06 with the shipped tiles (flashlib.kernels.default_config)",
         "the baseline: one fixed choice of BLOCK_Q, BLOCK_K, warps and stages per head dim",
         "forward._attn_fwd", _EVERYWHERE),
    Rung(1, "autotuned",
         "same kernel; BLOCK_Q, BLOCK_K, warps and pipeline stages timed on the GPU, fastest kept",
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
         "the rescale multiplies every output element (BLOCK_Q x head_dim per tile); once a row's max "
         "settles, most tiles need none, at the price of one block-wide max and a branch per tile",
         "forward_fast._attn_fwd_tma (LEAN=True, LAZY=True)", tuple((version, (9, 0)) for version in TRITON_VERSIONS),
         "as rung 4: without descriptors rung 2's kernel with the same changes; with scale <= 0 rung 3's fold"),
)
BY_NAME = {rung.name: rung for rung in LADDER}


def rung(name: str) -> Rung:
    if name not in BY_NAME:
        raise ValueError(f"ladder: argument 'name' must be one of {tuple(BY_NAME)}, got {name!r}")
    return BY_NAME[name]


@dataclass(frozen=True)
class Backward:
    """One backward of the ladder, selected by ``flashlib.ladder.attention(..., backward=name)``.

    forward: the forward rung it is paired with in the benchmark's ``ladder:<name>`` rows.
    """

    name: str
    change: str
    why: str
    kernels: str
    forward: str


BACKWARDS = (
    Backward("teaching", "notebook 07's three kernels with the shipped tiles; every tile masked",
             "the baseline: P and dP recomputed twice (once for dK/dV, once for dQ), seven matmuls per tile pair",
             "kernels.backward: _attn_bwd_preprocess, _attn_bwd_dkdv, _attn_bwd_dq", "teaching"),
    Backward("tuned", "interior tiles unmasked; dK/dV and dQ each autotuned, with a tall resident block and a "
             "short streamed one",
             "the two kernels want different shapes: 128 resident rows feed wgmma, a short streamed block keeps "
             "the recomputed tiles small",
             "ladder.backward: _attn_bwd_dkdv_split, _attn_bwd_dq_split", "tma"),
    Backward("atomic", "dQ added with float32 atomics from the dK/dV kernel: one kernel, five matmuls",
             "saves recomputing P and dP for dQ; costs atomic traffic, a float32 dQ buffer and bitwise "
             "repeatability",
             "ladder.backward: _attn_bwd_dkdv_split (ATOMIC_DQ)", "tma"),
    Backward("lean", "tuned, with the streamed blocks (Q and dO for dK/dV, K and V for dQ) moved by tensor "
             "descriptors on sm_90, and causal dQ blocks launched longest first",
             "the forward's rungs 3 and 4 for the backward: the copy engine frees threads and registers, and "
             "the longest programs no longer end the launch alone",
             "ladder.backward: _attn_bwd_dkdv_split (TMA), _attn_bwd_dq_split (TMA, LEAN)", "lean"),
    Backward("bulk", "atomic, with lean's descriptors for Q and dO, and each dQ tile added by one bulk reduction "
             "of the copy engine (sm_90) instead of one atomic instruction per element; the autotuner may build "
             "dQ transposed (K^T dS^T)",
             "five matmuls per tile pair instead of seven, as FlashAttention-3's backward; the copy engine does "
             "the float32 additions in L2 while the warps go on; transposed, dQ's product has the head dim as "
             "its long side, not the few query rows, and runs on wgmma like the other four",
             "ladder.backward: _attn_bwd_dkdv_split (ATOMIC_DQ, TMA, BULK_DQ, DQ_T)", "lean"),
)
BACKWARD_BY_NAME = {b.name: b for b in BACKWARDS}


def table() -> list[dict]:
    """The ladder as rows for printing or a DataFrame."""
    return [dict(rung=r.number, name=r.name, change=r.change, why=r.why, kernel=r.kernel,
                 falls_back=r.falls_back or "-") for r in LADDER]
