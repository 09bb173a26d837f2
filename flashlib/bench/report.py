"""What a recorded GPU run says about the expectations in data/bench/LOG.md.

    python -m flashlib.bench.report                      # the newest run against the one before it
    python -m flashlib.bench.report RUN.json [--against OLDER.json]

Prints, from the JSON alone: what was measured (points, budget, compiling ahead, any kernel
fault), the target ratios, each ladder step against the step before it in the same run, each
method against itself in the earlier run, and the backward tiles the autotuners kept. Every
figure is a ratio of medians (above 1: faster), with the 20th/80th-percentile range where the
run kept one; a range that spans 1 says nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from . import records
from .methods import FOUR_WARP, PUBLIC_OP, pair_name, rung_name


def steps() -> list[tuple[str, str]]:
    """(method, the step it is measured against), from the ladder's table: each forward rung
    over the rung before it, each backward (with its paired forward) over the backward before
    it, the 4-warp teaching backward and the public op over the teaching path."""
    from ..ladder.rungs import BACKWARDS, LADDER

    forwards = [(rung_name(b.name), rung_name(a.name)) for a, b in zip(LADDER, LADDER[1:])]
    backwards = [(pair_name(b.name), pair_name(a.name)) for a, b in zip(BACKWARDS, BACKWARDS[1:])]
    return forwards + [(FOUR_WARP, pair_name("teaching")), *backwards, (PUBLIC_OP, pair_name("teaching"))]


def _cell(r) -> str:
    text = f"{r['speedup']:.2f}"
    if r.get("range"):
        text += " ({:.2f}-{:.2f})".format(*r["range"])
    return text


def comparison_lines(rows) -> list[str]:
    """One line per (dtype, mask, pass): the speedup at each N."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["d"], r["dtype"], r["causal"], r["mode"]), []).append(r)
    lines = []
    for (d, dtype, causal, mode), group in sorted(groups.items()):
        cells = "  ".join(f"N={r['n']}: {_cell(r)}" for r in sorted(group, key=lambda r: r["n"]))
        lines.append(f"    d={d} {dtype} causal={int(causal)} {mode}: {cells}")
    return lines


def report(run: dict, previous: dict | None = None) -> str:
    ladder = run.get("ladder") or {}
    out = [records.label(run), f"GPU tests: {(run.get('tests') or {}).get('summary', 'not run')}"]
    notebooks = (run.get("notebooks") or {}).get("notebooks") or []
    if notebooks:
        out.append("notebooks: " + ", ".join(f"{e['notebook'].split('_')[0]} {e['status']}" for e in notebooks))
    keys = {(p["d"], p["n"], p["dtype"], p["causal"], p["mode"]) for p in ladder.get("points", [])}
    out.append(f"grid points measured: {len(keys)}, skipped by the budget: {len(ladder.get('skipped', []))}")
    timeline = ladder.get("timeline") or []
    for first in (True, False):
        seconds = [t["seconds"] for t in timeline if t.get("first_of_kind") == first]
        if seconds:
            out.append(f"  {'first' if first else 'later'} points of a kind: {len(seconds)}, seconds median "
                       f"{statistics.median(seconds):.1f}, longest {max(seconds):.1f}")
    pre = ladder.get("precompile") or run.get("precompile")
    if pre:
        out.append("compiled ahead: " + (pre["error"] if "error" in pre else
                   f"{pre.get('kernels')} kernels ({pre.get('failed')} failed) in {pre.get('seconds')} s "
                   f"on {pre.get('threads')} threads"))
    for loss in ladder.get("devices_lost") or ([ladder["device_lost"]] if ladder.get("device_lost") else []):
        out.append(f"kernel fault: {loss['method']} at {loss['point']}: {loss['error']}")
    if ladder.get("target_ratios"):
        from .results import format_ladder

        out += ["", "targets (d = 128, N >= 4k): best flashlib over best SDPA", format_ladder(run)]
    out += ["", "each step against the one before it, in this run (d = 128, bf16):"]
    for method, baseline in steps():
        rows = records.speedups(run, method, baseline, d=128, dtype="bfloat16")
        out.append(f"  {method} over {baseline}:" + ("" if rows else " not measured in this run"))
        out += comparison_lines(rows)
    if previous is not None:
        out += ["", f"against the earlier run ({records.label(previous)}), same method (d = 128, bf16):"]
        methods = sorted({p["method"] for p in records.ladder_points(run, d=128, dtype="bfloat16")})
        for method in methods:
            rows = records.speedups(run, method, method, against=previous, d=128, dtype="bfloat16")
            if rows:
                out.append(f"  {method}:")
                out += comparison_lines(rows)
    return "\n".join(out + kept_tiles_lines(run))


def _tile_line(label: str, kernel: str, tile: dict) -> str:
    extra = " dQ transposed" if tile.get("DQ_T") else ""
    return (f"  {label} {kernel:16s} BLOCK_Q={tile['BLOCK_Q']:3d} BLOCK_K={tile['BLOCK_K']:3d} "
            f"warps={tile['num_warps']} stages={tile['num_stages']}{extra}")


def kept_tiles_lines(run: dict) -> list[str]:
    """The backward tiles the autotuners kept (d = 128, bf16, non-causal): per sequence bucket,
    or the run's one choice where it kept one for every N."""
    out = ["", "backward tiles the autotuners kept (d = 128, bf16, non-causal), by sequence bucket:"]
    by_n = ((run.get("ladder") or {}).get("autotuned_by_n") or {}).get("d=128 bfloat16 causal=False") or {}
    for bucket in sorted(by_n, key=int):
        out += [_tile_line(f"N<={bucket:>5}", kernel, tile) for kernel, tile in sorted(by_n[bucket].items())
                if kernel.startswith("bwd_")]
    if not by_n:
        kept = {k: t for k, t in records.autotuned_tiles(run).items() if k.startswith("bwd_")}
        out.append("  one choice for every N in this run" if kept else "  none recorded in this run")
        out += [_tile_line("every N ", kernel, tile) for kernel, tile in sorted(kept.items())]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a GPU run's JSON (default: the newest in data/bench/)")
    parser.add_argument("--against", help="an earlier run's JSON (default: the one before the run)")
    args = parser.parse_args(argv)
    runs = [r for r in records.load_runs("gpu") if r.get("ladder")]
    run = records.load_run(args.run) if args.run else (runs[-1] if runs else None)
    if run is None:
        print("No GPU run with a ladder benchmark is recorded in data/bench/.")
        return 1
    if args.against:
        previous = records.load_run(args.against)
    else:
        earlier = [r for r in runs if records.provenance(r).get("date", "") < records.provenance(run).get("date", "")]
        previous = earlier[-1] if earlier else None
    print(report(run, previous))
    return 0


if __name__ == "__main__":
    sys.exit(main())
