"""The optimisation ladder: from the readable kernel to the fast one, one change per rung.

The one table of the rungs and the backwards, which the launchers, the compile specs and the
benchmark read: what each changes and why, which kernels run it (by their place under
``flashlib``, "ladder.forward._attn_fwd_tma") and which tiles its autotuner times, (BLOCK_Q,
BLOCK_K, warps, pipeline stages) per padded head dim. Importing it needs neither Triton nor a
GPU (a notebook can show the table anywhere); a rung's kernels are imported when first run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Compute capabilities the compile tests build for, and the Triton releases they build with:
# 3.6.0 (torch 2.11, the GPU check's machine) and 3.7.1 (torch 2.13, pinned here).
TARGETS = ((8, 0), (9, 0))
TRITON_VERSIONS = ("3.6.0", "3.7.1")

# ----- tiles -------------------------------------------------------------------------------

# The forward's candidates, the same for every autotuned rung, so that a rung's gain is its own
# change and not a change of tiles. At head dims 64 and 128: (128, 64, 8, 3) and (64, 64, 4, 3),
# the fastest wherever they were timed (data/bench/LOG.md), and one neighbour: a deeper pipeline
# of 128 x 128 tiles at 64, short 32-key tiles at 128 (64 KB of shared memory: three programs per
# SM). At 256 a 128-row tile overflows registers and a deep pipeline shared memory, and 64 rows
# on 8 warps would hold every score twice (kernels.compile.exponentials_per_score).
FORWARD_TILES = {64: ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3)),
                 128: ((128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)),
                 256: ((64, 32, 4, 1), (64, 32, 4, 2), (32, 32, 4, 2))}

# The backward kernels keep one block resident (BLOCK_K keys in dK/dV, BLOCK_Q queries in dQ)
# and stream the other: a tall resident block feeds Hopper's wgmma (64 rows per warpgroup), a
# short streamed one keeps the recomputed (resident, streamed) score tiles small.
# Every candidate's causal kernel builds for sm_90 without spills with both Triton releases
# (tests/test_ladder_backward.py); at head dim 128 a 64 x 128 dK/dV tile spills.
# At head dims 64 and 128 no candidate holds its scores twice: a score tile whose probabilities
# feed another product is split among warps by rows only, 16 rows per warp (64 rows on 4 warps,
# 128 on 8); with fewer rows two warps hold the same ones and each exponential and score product
# is done twice. That rules out (32, 64, 8, 2) for dK/dV. At head dim 256 every spill-free dK/dV
# tile but (32, 32, 4, 1) does so; these stay outside the benchmark's grid.
DKDV_TILES = {64: ((32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)),
              128: ((32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (16, 64, 4, 3)),
              256: ((32, 32, 8, 1), (16, 32, 4, 2))}
DQ_TILES = {64: ((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)),
            128: ((128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)),
            256: ((32, 32, 4, 1), (16, 32, 4, 2))}  # (32, 16, 4, 2) spills with descriptors (Triton 3.6)
# Descriptors free registers (no address arithmetic for the streamed tiles): dK/dV at head dim
# 128 runs 64 key rows on 4 warps with 32-row query tiles without spilling (the pointer kernel
# spills there), two programs per SM where 128 key rows allow one.
LEAN_DKDV_TILES = {64: DKDV_TILES[64],
                   128: ((32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3)),
                   256: DKDV_TILES[256]}
# The fused kernel holds one more (BLOCK_Q, HEAD_DIM_PAD) float32 tile per step, dQ's. At head dim
# 128 a 64 x 64 tile would put dQ's product on wgmma too, but on 8 warps it holds its scores twice
# and on 4 it spills; (16, 64, 4, 3) builds clean. A fifth entry True builds dQ transposed
# (FlashConfig.bwd_dq_transposed): dQ = dS K has as many rows as the query tile (16 or 32, too few
# for wgmma, so it runs on mma.sync), its transpose K^T dS^T as many as the head dim, so every
# product goes to wgmma. Transposed at head dim 128, 32-row query tiles spill (on one stage, when
# causal with Triton 3.6), and so do 16 x 128 on 2 or 3 stages; (16, 64, 4, 3) does not. 16 x 128
# on one stage builds clean but is mis-assembled: ptxas 12.8 (both Triton releases) computes the
# shared-memory descriptors of dS^T in K^T dS^T from the kernel's arguments (sequence lengths,
# a stride), so its products read outside shared memory and the kernel faults (an H200, d = 128,
# N = 4096 and 8192). The compile tests reject any candidate whose wgmma descriptors come from
# arguments (kernels.compile.wgmma_descriptors_from_arguments).
BULK_TILES = {64: ((32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3, True),
                   (32, 64, 4, 3, True)),
              128: ((16, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (16, 64, 4, 3, True)),
              256: ((32, 32, 8, 1), (16, 32, 8, 1))}


def candidates(tiles: dict, head_dim_pad: int) -> tuple:
    """The candidates of a tile table for a padded head dim (16 and 32 use 64's)."""
    return tiles[max(64, head_dim_pad)]


# ----- the forward rungs -------------------------------------------------------------------


@dataclass(frozen=True)
class Rung:
    """One step of the ladder.

    builds: (triton version, capability) pairs whose compiled kernel is the rung's own;
        ``falls_back`` says what runs anywhere else.
    fold: the function of :mod:`flashlib.ladder.forward` the kernel takes as its FOLD argument
        ("" for the teaching kernel, which has its own).
    longest_first: causal query blocks are launched longest first.
    tiles: the autotuner's candidates per padded head dim; empty: the shipped tiles always.
    """

    number: int
    name: str
    change: str
    why: str
    kernel: str
    builds: tuple[tuple[str, tuple[int, int]], ...]
    falls_back: str = ""
    fold: str = ""
    longest_first: bool = False
    tiles: dict = field(default_factory=dict, hash=False)

    def supports(self, triton_version: str, capability) -> bool:
        return (triton_version, tuple(capability)) in self.builds


_EVERYWHERE = tuple((version, cc) for version in TRITON_VERSIONS for cc in TARGETS)
_HOPPER = tuple((version, (9, 0)) for version in TRITON_VERSIONS)
TEACHING_FORWARD = "kernels.forward._attn_fwd"
SPLIT_FORWARD = "ladder.forward._attn_fwd_split"
TMA_FORWARD = "ladder.forward._attn_fwd_tma"

LADDER = (
    Rung(0, "teaching",
         "the kernel of notebook 06 with the shipped tiles (flashlib.kernels.default_config)",
         "the baseline: one fixed choice of BLOCK_Q, BLOCK_K, warps and stages per head dim",
         TEACHING_FORWARD, _EVERYWHERE),
    Rung(1, "autotuned",
         "same kernel; BLOCK_Q, BLOCK_K, warps and pipeline stages timed on the GPU, fastest kept",
         "the best tiles depend on the GPU, head dim, dtype and mask; measuring beats guessing",
         TEACHING_FORWARD, _EVERYWHERE,
         "the CPU interpreter cannot autotune (no driver): it uses the fixed tiles", tiles=FORWARD_TILES),
    Rung(2, "causal-split",
         "key tiles seen in full are folded without masks; only diagonal and ragged tiles are masked",
         "the mask is a compare-and-select on every score; most tiles do not need it",
         SPLIT_FORWARD, _EVERYWHERE, fold="_fold", tiles=FORWARD_TILES),
    Rung(3, "tma",
         "rung 2 with Q, K, V, O moved by tensor descriptors (TMA bulk copies on sm_90)",
         "the Tensor Memory Accelerator (TMA, a unit of each SM that copies whole tiles between HBM and shared memory) moves the tiles and pads their edges, freeing threads and registers",
         TMA_FORWARD, _HOPPER,
         "rung 2's kernel runs when head_dim * element size is not a multiple of 16 bytes, and on "
         "GPUs older than sm_90 (no TMA)", fold="_fold", tiles=FORWARD_TILES),
    Rung(4, "lean",
         "rung 3 with the row max taken of raw scores and the scale applied inside exp2's argument; "
         "causal launches start with the longest query blocks",
         "one multiply fewer per score on the units that also compute the exponentials; the longest "
         "programs no longer end the launch alone",
         TMA_FORWARD, _HOPPER,
         "without descriptors (as for rung 3) rung 2's kernel runs with the same two changes; with "
         "scale <= 0 rung 3's fold runs (the scaled max needs a positive scale)",
         fold="_fold_lean", longest_first=True, tiles=FORWARD_TILES),
    Rung(5, "lazy-rescale",
         "rung 4, and on unmasked tiles the output and denominator are rescaled only when some row's max "
         "has grown by more than 8 (base 2) since its last rescale",
         "the rescale multiplies every output element (BLOCK_Q x head_dim per tile); once a row's max "
         "settles, most tiles need none, at the price of one block-wide max and a branch per tile",
         TMA_FORWARD, _HOPPER,
         "as rung 4: without descriptors rung 2's kernel with the same changes; with scale <= 0 rung 3's fold",
         fold="_fold_lazy", longest_first=True, tiles=FORWARD_TILES),
)
BY_NAME = {rung.name: rung for rung in LADDER}


def rung(name: str) -> Rung:
    if name not in BY_NAME:
        raise ValueError(f"ladder: argument 'name' must be one of {tuple(BY_NAME)}, got {name!r}")
    return BY_NAME[name]


# ----- the backwards -----------------------------------------------------------------------


@dataclass(frozen=True)
class Backward:
    """One backward of the ladder, selected by ``flashlib.ladder.attention(..., backward=name)``.

    kernels: {role: kernel}; the roles with tiles ({role: candidates per padded head dim}) are
        autotuned. forward: the forward rung it is paired with in the benchmark's rows.
    descriptors: the streamed blocks are moved by tensor descriptors where they can be (sm_90,
        rows and addresses multiples of 16 bytes); where not, ``without_descriptors`` runs
        ("": this one, with pointers), as ``falls_back`` says in words.
    longest_first: causal dQ blocks are launched longest first.
    """

    name: str
    change: str
    why: str
    kernels: dict = field(hash=False)
    forward: str = "teaching"
    tiles: dict = field(default_factory=dict, hash=False)
    descriptors: bool = False
    longest_first: bool = False
    without_descriptors: str = ""
    falls_back: str = ""


_PREPROCESS = "kernels.backward._attn_bwd_preprocess"
_SPLIT_BACKWARD = {"preprocess": _PREPROCESS, "dkdv": "ladder.backward._attn_bwd_dkdv_split",
                   "dq": "ladder.backward._attn_bwd_dq_split"}

BACKWARDS = (
    Backward("teaching", "notebook 07's three kernels with the shipped tiles; every tile masked",
             "the baseline: P and dP recomputed twice (once for dK/dV, once for dQ), seven matmuls per tile pair",
             {"preprocess": _PREPROCESS, "dkdv": "kernels.backward._attn_bwd_dkdv",
              "dq": "kernels.backward._attn_bwd_dq"}),
    Backward("tuned", "interior tiles unmasked; dK/dV and dQ each autotuned, with a tall resident block and a "
             "short streamed one",
             "the two kernels want different shapes: 128 resident rows feed wgmma, a short streamed block keeps "
             "the recomputed tiles small",
             _SPLIT_BACKWARD, "tma", {"dkdv": DKDV_TILES, "dq": DQ_TILES}),
    Backward("lean", "tuned, with the streamed blocks (Q and dO for dK/dV, K and V for dQ) moved by tensor "
             "descriptors on sm_90, and causal dQ blocks launched longest first",
             "the forward's rungs 3 and 4 for the backward: the TMA frees threads and registers, and "
             "the longest programs no longer end the launch alone",
             _SPLIT_BACKWARD, "lean", {"dkdv": LEAN_DKDV_TILES, "dq": DQ_TILES}, descriptors=True,
             longest_first=True,
             falls_back="without descriptors the same kernels load through pointers, dQ still longest first"),
    Backward("bulk", "one kernel: lean's dK/dV kernel also adds each dQ tile into a float32 dQ, by one bulk "
             "reduction of the TMA (sm_90); the autotuner may build dQ transposed (K^T dS^T)",
             "five matmuls per tile pair instead of seven, as FlashAttention-3's backward, without one atomic "
             "instruction per dQ element: the TMA does the float32 additions in L2 while the warps go "
             "on; transposed, dQ's product has the head dim as its long side, not the few query rows, and runs "
             "on wgmma like the other four",
             {"preprocess": _PREPROCESS, "fused": "ladder.backward._attn_bwd_fused"}, "lean",
             {"fused": BULK_TILES}, descriptors=True, without_descriptors="lean",
             falls_back="lean's kernels run where descriptors cannot be used (rows or addresses not multiples "
             "of 16 bytes, GPUs older than sm_90); Triton's interpreter has no bulk reductions and adds dQ "
             "with one atomic per element"),
)
BACKWARD_BY_NAME = {b.name: b for b in BACKWARDS}


def backward(name: str) -> Backward:
    if name not in BACKWARD_BY_NAME:
        raise ValueError(f"ladder: argument 'backward' must be one of {tuple(BACKWARD_BY_NAME)}, got {name!r}")
    return BACKWARD_BY_NAME[name]


def kernel_function(place: str):
    """The Triton kernel (or step) at ``place`` under flashlib; imports its module (and Triton)."""
    import importlib

    module, _, name = place.rpartition(".")
    return getattr(importlib.import_module(f"flashlib.{module}"), name)


def table() -> list[dict]:
    """The ladder as rows for printing or a DataFrame."""
    return [dict(rung=r.number, name=r.name, change=r.change, why=r.why, kernel=r.kernel,
                 falls_back=r.falls_back or "-") for r in LADDER]
