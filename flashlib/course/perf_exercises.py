"""Exercise checkers of notebook 08: FLOPs, intensity, the ridge point, the ladder's savings.

Each keeps a digest of its answer, not the answer (:func:`flashlib.course.exercises.digest`); the ridge
point's answer comes from the recorded GPU run the cell passes."""
from __future__ import annotations

from .exercises import Digest, _check_number

FLOPS_EXERCISE = dict(batch=2, heads=16, n=4096, head_dim=128, causal=True)


def check_attention_flops(answer) -> bool:
    """FLOPs of a causal forward for batch 2, 16 heads, N = 4096, head dim 128."""
    return _check_number(
        answer, Digest("attention_flops:658a68638a22619f"), kind="a number (FLOPs)",
        hint="Q Kᵀ and P V each cost 2·N·N·d FLOPs per head (a multiply and an add); causal keeps half.",
        known_mistakes=[(Digest("attention_flops:f294a272e5fdd38e"),
                         "causal attention computes only about half of the scores."),
                        (Digest("attention_flops:1b6d3a11eb94743f"),
                         "a multiply-add is two FLOPs, and there are two matmuls."),
                        (Digest("attention_flops:1b6d3a11eb94743f"), "every batch element has its own heads.")])


INTENSITY_EXERCISE = dict(n=8192, head_dim=64, block_q=64, element_size=2)


def check_intensity(answer) -> bool:
    """FLOPs per HBM byte of one head's non-causal forward (FlashAttention-2 IO model)."""
    return _check_number(
        answer, Digest("intensity:4496f69f3fbb4750"), kind="a number (FLOPs per byte)", rel=1e-3,
        hint="FLOPs = 4·N²·d; bytes: Q read once, K and V read once per query block "
             "(N / BLOCK_Q blocks), O and lse written once; 2 bytes an element.",
        known_mistakes=[(Digest("intensity:2f167b662b673c55"), "K and V are read once per query block, "
                         "not once in all.")])


MINIMUM_EXERCISE = dict(n=8192, head_dim=64, element_size=2)


def check_minimum_intensity(answer) -> bool:
    """FLOPs per byte of one head's non-causal forward if Q, K, V are read once and O written once."""
    return _check_number(
        answer, Digest("minimum_intensity:1cc8d13791c51544"), kind="a number (FLOPs per byte)", rel=1e-3,
        hint="FLOPs = 4·N²·d as before; bytes: Q, K and V read once, O and the log-sum-exp (one number per row) "
             "written once, 2 bytes an element.",
        known_mistakes=[(Digest("minimum_intensity:5a91a65da9aa2be9"),
                         "almost: the log-sum-exp is written too, one number "
                         "per row."),
                        (Digest("minimum_intensity:680ec3fc86da1884"), "O is written as well as Q, K, V read.")])


LEAN_EXERCISE = dict(n=4096, block_q=128, block_k=64, num_warps=8)


def check_saved_multiplies(answer) -> bool:
    """Multiplies one thread saves with rung 4 over one query block's non-causal key loop."""
    return _check_number(
        answer, Digest("saved_multiplies:e012ee73e57f0aa0"), kind="a number (multiplies per thread)",
        hint="One multiply per score; a tile's BLOCK_Q x BLOCK_K scores are shared by warps x 32 threads, "
             "and the loop visits N / BLOCK_K key tiles.",
        known_mistakes=[(Digest("saved_multiplies:c940a29e4f425a4a"),
                         "that is one key tile; the loop visits N / BLOCK_K of them."),
                        (Digest("saved_multiplies:4738a271ea2adad3"),
                         "that is the whole query block: its scores are shared by all the threads."),
                        (Digest("saved_multiplies:72880dd2c6fde52d"),
                         "a warp is 32 threads: divide by threads, not by warps.")])


SWAP_EXERCISE = dict(block_q=16, block_k=64, head_dim=128)


def check_mma_sync_fraction(answer) -> bool:
    """The fraction of one tile pair's matrix-multiply FLOPs whose product has fewer rows than
    a warpgroup product needs (so runs on mma.sync), dQ not transposed, SWAP_EXERCISE's tiles."""
    return _check_number(
        answer, Digest("mma_sync_fraction:d3e6a61ffc02d7f0"), kind="a fraction between 0 and 1", rel=1e-3,
        hint="Write down the five products with their shapes (rows x inner times inner x columns); each costs "
             "2 x rows x columns x inner FLOPs. Which of them has fewer than 64 rows?",
        known_mistakes=[(Digest("mma_sync_fraction:d7ca5f1c1649efd3"),
                         "there are five products per tile pair, not four: dQ is one of them."),
                        (Digest("mma_sync_fraction:9bbfef69451be971"),
                         "seven is the teaching backward's count; the fused one recomputes nothing."),
                        (Digest("mma_sync_fraction:63313c33af16e9d5"),
                         "one product has the query tile's 16 rows: which?")])


def check_ridge(answer, run: dict | None) -> bool:
    """The ridge point R / W, FLOPs per byte, of a recorded GPU run's measured ceilings."""
    if run is None or not (run.get("ladder") or {}).get("ceilings"):
        print("No GPU run with measured ceilings is recorded in data/bench/: nothing to check against yet.")
        return False
    ceilings = run["ladder"]["ceilings"]
    rate, bandwidth = ceilings["bf16_matmul_tflops"] * 1e12, ceilings["copy_gbps"] * 1e9
    return _check_number(
        answer, rate / bandwidth, kind="a number (FLOPs per byte)", rel=1e-3,
        hint="R is in TFLOP/s (1e12 FLOP/s), W in GB/s (1e9 bytes/s): convert both to units, then divide.",
        known_mistakes=[(ceilings["bf16_matmul_tflops"] / ceilings["copy_gbps"],
                         "TFLOP/s over GB/s leaves a factor 1000: convert to FLOP/s and bytes/s first."),
                        (bandwidth / rate, "the ridge is FLOPs per byte: rate over bandwidth.")])
