"""What a ladder run reports: target and memory ratios, the tiles autotuners kept, its table, its file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .grid import NS, TARGET_D, TARGET_N, point_key
from .methods import PUBLIC_OP, is_ours

FORWARD_TARGET, FORWARD_BACKWARD_TARGET = 1.0, 0.8  # best flashlib over best SDPA, d = 128, N >= 4k


def target_ratios(points, matmul_tflops: float | None = None) -> list[dict]:
    """At d = 128, N >= 4k: the best flashlib method over the best SDPA backend, per point
    (from medians); where both were timed with their spread, also ``ratio_range``: the ratio
    with ours at its 80th percentile time and theirs at its 20th, and the other way round.
    With the measured matmul rate, the fraction of it reached (stretch goal: 0.6 forward)."""
    out = []
    keys = sorted({point_key(p)[1:] for p in points if p["d"] == TARGET_D and p["n"] >= TARGET_N})
    for n, dtype, causal, mode in keys:
        same = [p for p in points if point_key(p) == (TARGET_D, n, dtype, causal, mode) and p.get("tflops")]
        ours = [p for p in same if is_ours(p["method"])]
        theirs = [p for p in same if not is_ours(p["method"])]
        if ours and theirs:
            a, b = max(ours, key=lambda p: p["tflops"]), max(theirs, key=lambda p: p["tflops"])
            spread = all(key in p for p in (a, b) for key in ("ms_p20", "ms_p80"))
            out.append(dict(n=n, dtype=dtype, causal=causal, mode=mode, ours=a["method"], sdpa=b["method"],
                            ratio=a["tflops"] / b["tflops"],
                            target=FORWARD_TARGET if mode == "fwd" else FORWARD_BACKWARD_TARGET,
                            # the same FLOPs on both sides: the ratio of rates is theirs / our time
                            ratio_range=[b["ms_p20"] / a["ms_p80"], b["ms_p80"] / a["ms_p20"]] if spread else None,
                            matmul_fraction=a["tflops"] / matmul_tflops if matmul_tflops else None))
    return out


def memory_ratios(points, ns=(4096, 16384), method: str = PUBLIC_OP) -> list[dict]:
    """Peak memory of one method (default the public op, forward and backward) against dense
    attention: the math backend where it was measured, else the bytes of one N x N matrix of scores."""
    out = []
    for p in points:
        if p["method"] != method or p["n"] not in ns or "peak_bytes" not in p:
            continue
        dense = [m for m in points if m["method"] == "sdpa:math" and "peak_bytes" in m and point_key(m) == point_key(p)]
        element_size = torch.empty(0, dtype=getattr(torch, p["dtype"])).element_size()
        scores = p["batch"] * p["heads"] * p["n"] ** 2 * element_size
        out.append(dict(method=method, d=p["d"], n=p["n"], dtype=p["dtype"], causal=p["causal"],
                        flashlib_bytes=p["peak_bytes"], dense_bytes=dense[0]["peak_bytes"] if dense else None,
                        scores_bytes=scores, ratio=p["peak_bytes"] / dense[0]["peak_bytes"] if dense else None,
                        ratio_to_scores=p["peak_bytes"] / scores))
    return out


def _choices_at(q, d, causal, n) -> dict:
    """{kernel: tiles} every autotuned forward rung and backward kept for n's bucket (the tuned
    backward's kernels as bwd_<kernel>, as the first runs recorded them; the others' as
    bwd_<backward>_<kernel>)."""
    from ..ladder.backward import autotuned_choices as backward_choices
    from ..ladder.forward import autotuned_choice
    from ..ladder.rungs import BACKWARDS, LADDER

    found = {rung.name: autotuned_choice(q, causal, rung.name, seq=n) for rung in LADDER}
    for backward in BACKWARDS:  # a step on shipped tiles (the teaching ones) answers nothing
        prefix = "bwd_" if backward.name == "tuned" else f"bwd_{backward.name}_"
        found.update({prefix + k: t for k, t in backward_choices(d, q.dtype, causal, backward.name, seq=n).items()})
    return {k: t for k, t in found.items() if t}


def autotuned_choices(ds, dtypes, causals, ns=NS) -> tuple[dict, dict]:
    """What the autotuners kept in this process, as ({"d=128 bfloat16 causal=True": {"tma":
    tiles, ..., "bwd_dkdv": tiles, "bwd_lean_dq": tiles}}, the same per sequence bucket:
    {"d=128 ...": {"16384": {...}}}). The first is the longest bucket's choice."""
    from ..kernels.config import seq_bucket

    by_n = {}
    for d in ds:
        for dtype in dtypes:
            for causal in causals:
                q = torch.empty(1, 1, 1, d, dtype=getattr(torch, dtype))
                buckets = {str(seq_bucket(n, n)): found for n in ns if (found := _choices_at(q, d, causal, n))}
                if buckets:
                    by_n[f"d={d} {dtype} causal={causal}"] = buckets
    longest = {key: buckets[max(buckets, key=int)] for key, buckets in by_n.items()}
    return longest, by_n


def format_ladder(result: dict) -> str:
    """A plain table of the target ratios, and any kernel fault, for the GPU check's printout."""
    rows = result["ladder"]["target_ratios"]
    lines = [f"{'N':>6} {'dtype':>9} {'causal':>6} {'pass':>7} {'ours':>16} {'best SDPA':>16} "
             f"{'ratio':>6} {'target':>6} {'of matmul':>9} {'range':>9}"]
    for r in rows:
        fraction = f"{r['matmul_fraction']:.2f}" if r.get("matmul_fraction") else "-"
        spread = "{:.2f}-{:.2f}".format(*r["ratio_range"]) if r.get("ratio_range") else "-"
        lines.append(f"{r['n']:>6} {r['dtype']:>9} {int(r['causal']):>6} {r['mode']:>7} {r['ours']:>16} "
                     f"{r['sdpa']:>16} {r['ratio']:>6.2f} {r['target']:>6.1f} {fraction:>9} {spread:>9}")
    lost = result["ladder"].get("devices_lost") or ([result["ladder"]["device_lost"]]
                                                    if result["ladder"].get("device_lost") else [])
    for loss in lost:
        p = loss["point"]
        lines.append(f"{loss['method']} left the device unusable at d={p['d']} N={p['n']} {p['dtype']} "
                     f"causal={int(p['causal'])} {p['mode']} ({loss['error']}); later points ran without it")
    return "\n".join(lines)


def device_slug(device) -> str:
    """A device name as it appears in a result's file name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", str(device or "unknown").lower()).strip("-")


def write_result(result: dict, out_dir: Path | str | None = None) -> Path:
    """Write a standalone run as data/bench/gpu-ladder-<device>-<date>.json; returns the path."""
    from .records import BENCH_DIR

    info = result["ladder"]["provenance"]
    out_dir = Path(out_dir) if out_dir is not None else BENCH_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu-ladder-{device_slug(info['device'])}-{info['date']}.json"
    path.write_text(json.dumps(dict(result, provenance=info), indent=1) + "\n")
    return path
