"""Reading recorded benchmarks: the JSON files in ``data/bench/``.

``cpu-<date>.json`` comes from ``python -m flashlib bench cpu``, ``gpu-<device>-<date>.json``
from ``make gpu-check`` (its ladder benchmark under the key ``"ladder"``). Nothing here
needs a GPU; every figure a notebook shows from a run comes through these functions, with
the run's device and date (:func:`label`), and under today's method names whatever the run
called them (:data:`RENAMED`).
"""
from __future__ import annotations

import json
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # the flashlib folder


def bench_dir() -> Path:
    """Where the recorded runs are: the repository's ``data/bench/`` when flashlib runs from a clone
    (or an editable install), else the copy installed with the package (``flashlib/recorded``, the
    same files: pyproject.toml ships them). Never a path relative to where Jupyter started."""
    repository = _PACKAGE.parent / "data" / "bench"
    return repository if repository.is_dir() else _PACKAGE / "recorded"


BENCH_DIR = bench_dir()


# The method names of the ladder benchmark changed once: runs written before (no "vocabulary"
# in their ladder) are read under today's names (flashlib.bench.methods), so that notebooks and
# the report speak of one method by one name. Then, "flashlib" was the teaching forward with
# the teaching backward; today it is the public op as shipped ("tma" forward, "tuned" backward).
VOCABULARY = 2
RENAMED = {
    "flashlib": "ladder:teaching",                  # teaching forward + teaching backward
    "flashlib:4-warp-backward": "ladder:teaching-4-warp",
    "flashlib:tma": "ladder:tma+teaching",          # rung 3's forward + the teaching backward
    "flashlib:tuned": "ladder:tuned",               # rung 3's forward + the tuned backward
    "flashlib:atomic": "ladder:atomic",
    "flashlib:lean": "ladder:lean",
    "flashlib:bulk": "ladder:bulk",
}
# what the autotuners kept: the atomic backward's one kernel, and the block sizes by their
# kernels' names (BLOCK_Q query rows, BLOCK_K key rows; BLOCK_M and BLOCK_N before)
RENAMED_KERNELS = {"bwd_fused": "bwd_atomic_fused"}
RENAMED_TILE_KEYS = {"BLOCK_M": "BLOCK_Q", "BLOCK_N": "BLOCK_K"}


def _renamed_tiles(choices: dict) -> dict:
    """{kernel: tiles} with today's kernel names and tile keys. The first runs kept one choice
    per key, of the one autotuned kernel then, rung 1's: {key: tiles}, read as {key: {"autotuned": tiles}}."""
    if "num_warps" in choices:
        choices = {"autotuned": choices}
    return {RENAMED_KERNELS.get(kernel, kernel): {RENAMED_TILE_KEYS.get(k, k): v for k, v in tiles.items()}
            for kernel, tiles in choices.items()}


def in_current_names(run: dict) -> dict:
    """The run with every method, kernel and tile key under today's names (in place; returned).
    A run that already uses them is left as it is."""
    ladder = run.get("ladder")
    if not ladder or ladder.get("vocabulary", 1) >= VOCABULARY:
        return run
    for row in [*ladder.get("points", []), *run.get("ladder_partial", []),
                *([ladder["device_lost"]] if ladder.get("device_lost") else []), *ladder.get("devices_lost", [])]:
        row["method"] = RENAMED.get(row.get("method"), row.get("method"))
    for row in ladder.get("target_ratios") or []:
        row["ours"] = RENAMED.get(row["ours"], row["ours"])
    for row in ladder.get("memory_ratios") or []:
        row.setdefault("method", RENAMED["flashlib"])  # then measured on the method named "flashlib"
    config = ladder.get("config") or {}
    config["excluded"] = [RENAMED.get(m, m) for m in config.get("excluded", [])]
    if isinstance(ladder.get("autotuned"), dict) and "error" not in ladder["autotuned"]:
        ladder["autotuned"] = {key: _renamed_tiles(c) for key, c in ladder["autotuned"].items()}
    ladder["autotuned_by_n"] = {key: {bucket: _renamed_tiles(c) for bucket, c in buckets.items()}
                                for key, buckets in (ladder.get("autotuned_by_n") or {}).items()}
    ladder["vocabulary"], ladder["renamed_from_vocabulary"] = VOCABULARY, ladder.get("vocabulary", 1)
    return run


def with_errata_applied(run: dict) -> dict:
    """The run with the figures its errata withdraw set aside (in place; returned).

    An erratum may name a field it withdraws (``"withdraws": {"field": "peak_bytes", "where":
    {"mode": "fwd_bwd"}, "memory_ratios": true}``): each matching point keeps the figure as
    ``<field>_withdrawn`` and gets None, so no table or plot shows it as a measurement.
    Whole rows an erratum invalidates carry "invalid" in the file itself (:func:`ladder_points`)."""
    ladder = run.get("ladder") or {}
    for erratum in run.get("errata", []):
        withdraws = erratum.get("withdraws")
        if not withdraws:
            continue
        field, where = withdraws["field"], withdraws.get("where", {})
        for point in ladder.get("points", []):
            if point.get(field) is not None and all(point.get(k) == v for k, v in where.items()):
                point[f"{field}_withdrawn"], point[field] = point[field], None
        if withdraws.get("memory_ratios"):
            ladder["memory_ratios_withdrawn"], ladder["memory_ratios"] = ladder.get("memory_ratios"), []
    return run


def load_run(path: Path | str) -> dict:
    """One recorded run, under today's names (:func:`in_current_names`) and with its errata
    applied (:func:`with_errata_applied`), with a "file" key."""
    path = Path(path)
    run = with_errata_applied(in_current_names(json.loads(path.read_text())))
    run["file"] = path.name
    return run


KINDS = ("cpu", "gpu", "cascade-cpu", "calls-cpu")


def load_runs(kind: str = "gpu", directory: Path | str | None = None) -> list[dict]:
    """Every recorded run of one kind, oldest first (:func:`load_run` each): "cpu" (dense against tiled),
    "gpu" (the GPU check), "cascade-cpu" (shared-prefix decoding, flashlib.bench.cascade) or "calls-cpu"
    (the host's time per call, flashlib.bench.calls)."""
    if kind not in KINDS:
        raise ValueError(f"records: argument 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    directory = Path(directory) if directory is not None else BENCH_DIR
    runs = [load_run(path) for path in sorted(directory.glob(f"{kind}-*.json"))]
    return sorted(runs, key=lambda r: (provenance(r).get("date", ""), r["file"]))


def latest(kind: str = "gpu", directory: Path | str | None = None, with_key: str | None = None) -> dict | None:
    """The newest recorded run of that kind (holding ``with_key``, if given), or None."""
    runs = [r for r in load_runs(kind, directory) if with_key is None or r.get(with_key)]
    return runs[-1] if runs else None


def provenance(run: dict) -> dict:
    """Device, versions and date of a run, wherever its writer put them."""
    info = dict(run.get("provenance", {}))
    for key in ("device", "torch", "triton", "cuda", "date"):
        if key not in info and key in run:
            info[key] = run[key]
    ladder = run.get("ladder") or {}
    for key, value in ladder.get("provenance", {}).items():
        info.setdefault(key, value)
    return info


def label(run: dict) -> str:
    """One line naming where and when a run was measured, for every figure title."""
    info = provenance(run)
    where = info.get("device") or info.get("cpu") or "unknown device"
    parts = [where, f"torch {info.get('torch', '?')}"]
    if info.get("triton"):
        parts.append(f"Triton {info['triton']}")
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    parts.append(info.get("date", "undated"))
    return ", ".join(parts)


def ladder_points(run: dict, **where) -> list[dict]:
    """Points of a GPU run's ladder benchmark matching every key=value in ``where``. Rows a
    run's errata mark ``invalid`` (not a measurement of what they name) are left out."""
    points = (run.get("ladder") or {}).get("points", [])
    return [p for p in points if not p.get("invalid") and all(p.get(k) == v for k, v in where.items())]


def autotuned_tiles(run: dict, *, head_dim: int = 128, dtype: str = "bfloat16", causal: bool = False,
                    n: int | None = None) -> dict[str, dict]:
    """{kernel: tiles} the run's autotuners kept for this head dim, dtype and mask: for the
    sequence bucket of n where the run recorded one per bucket, else (older runs, which tuned
    once at the first N measured) the run's only choice."""
    from ..kernels.config import seq_bucket

    key = f"d={head_dim} {dtype} causal={causal}"
    ladder = run.get("ladder") or {}
    by_n = (ladder.get("autotuned_by_n") or {}).get(key)
    if by_n and n is not None:
        return by_n.get(str(seq_bucket(n, n)), {})
    return (ladder.get("autotuned") or {}).get(key, {})


def errata(run: dict) -> list[str]:
    """What a run's file says, after the fact, about rows it holds that are not to be used."""
    return [f"{e['rows']} ({e.get('count', '?')} rows): {e['problem']}; instead: {e.get('instead', '-')}"
            for e in run.get("errata", [])]


def series(points, method_key: str = "method", value: str = "tflops") -> dict[str, dict[int, float]]:
    """{method: {n: value}} over the points that have the value."""
    out: dict[str, dict[int, float]] = {}
    for p in points:
        if p.get(value) is not None:
            out.setdefault(p[method_key], {})[p["n"]] = p[value]
    return out


def best_sdpa(points, n: int) -> tuple[str, float] | None:
    """(backend, TFLOP/s) of the fastest SDPA backend at sequence length n, or None."""
    rates = [(p["method"], p["tflops"]) for p in points
             if p["n"] == n and p["method"].startswith("sdpa:") and p.get("tflops")]
    return max(rates, key=lambda r: r[1]) if rates else None


def ladder_gains(run: dict, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
                 causal: bool = False) -> list[tuple[str, float]]:
    """Forward TFLOP/s of every rung at one shape, in ladder order, for the bar chart."""
    points = ladder_points(run, d=head_dim, n=n, dtype=dtype, causal=causal, mode="fwd")
    rates = {p["method"]: p["tflops"] for p in points if p.get("tflops")}
    from ..ladder.rungs import LADDER

    return [(r.name, rates[f"rung:{r.name}"]) for r in LADDER if f"rung:{r.name}" in rates]


def newest_run_with(methods, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
                    causal: bool = False, mode: str = "fwd", directory: Path | str | None = None) -> dict | None:
    """The newest recorded GPU run that measured (validly) every one of ``methods`` at this
    shape, so that a table compares figures of one run; None if no run did."""
    for run in reversed(load_runs("gpu", directory)):
        got = rates_at(run, methods, head_dim=head_dim, n=n, dtype=dtype, causal=causal, mode=mode)
        if len(got) == len(list(methods)):
            return run
    return None


def rates_at(run: dict, methods, *, head_dim: int = 128, n: int = 4096, dtype: str = "bfloat16",
             causal: bool = False, mode: str = "fwd") -> dict[str, float]:
    """{method: TFLOP/s} at one shape for the methods asked for that the run measured (validly)."""
    points = ladder_points(run, d=head_dim, n=n, dtype=dtype, causal=causal, mode=mode)
    rates = {p["method"]: p["tflops"] for p in points if p.get("tflops")}
    return {m: rates[m] for m in methods if m in rates}


def speedups(run: dict, method: str, baseline: str, *, against: dict | None = None, **where) -> list[dict]:
    """Where ``method`` and ``baseline`` were both timed (in ``run``, or ``baseline`` in the
    run ``against``, an earlier one), per grid point matching ``where``: the baseline's
    median time over the method's (above 1: the method is faster), with a ``range`` from the
    20th/80th percentiles where both have them (a range that spans 1 says nothing)."""
    def timed(points, name):
        return {(p["d"], p["n"], p["dtype"], p["causal"], p["mode"]): p for p in points
                if p["method"] == name and p.get("ms")}

    ours = timed(ladder_points(run, **where), method)
    theirs = timed(ladder_points(against if against is not None else run, **where), baseline)
    out = []
    for key in sorted(ours.keys() & theirs.keys()):
        a, b = ours[key], theirs[key]
        spread = all(k in p for p in (a, b) for k in ("ms_p20", "ms_p80"))
        out.append(dict(zip(("d", "n", "dtype", "causal", "mode"), key), speedup=b["ms"] / a["ms"],
                        range=[b["ms_p20"] / a["ms_p80"], b["ms_p80"] / a["ms_p20"]] if spread else None))
    return out
