"""Reading recorded runs (flashlib.bench.records), under one vocabulary of method names;
their figures (flashlib.bench.plots); what the report says of them (flashlib.bench.report)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashlib.bench import plots, records, report
from flashlib.bench.methods import methods
from flashlib.course import viz
from flashlib.ladder.rungs import BACKWARDS, LADDER
from tests.bench_runs import gpu_run

RECORDED = {stamp: records.BENCH_DIR / f"gpu-nvidia-h200-{stamp}.json"
            for stamp in ("2026-11-29T2353Z", "2026-11-30T0015Z")}


def test_bad_kind_names_itself():
    with pytest.raises(ValueError, match="'kind'"):
        records.load_runs("tpu")


def test_load_runs_sorts_by_date_and_labels(tmp_path):
    assert records.load_runs("gpu", tmp_path) == [] and records.latest("gpu", tmp_path) is None
    (tmp_path / "gpu-b-2026-03-01.json").write_text(json.dumps(gpu_run("2026-03-01", "Newer GPU")))
    (tmp_path / "gpu-a-2026-01-02.json").write_text(json.dumps(gpu_run()))
    (tmp_path / "cpu-2026-02-01.json").write_text(json.dumps(
        {"provenance": {"cpu": "Some CPU", "torch": "2.13.0", "date": "2026-02-01"}, "points": []}))
    runs = records.load_runs("gpu", tmp_path)
    assert [r["file"] for r in runs] == ["gpu-a-2026-01-02.json", "gpu-b-2026-03-01.json"]
    assert records.latest("gpu", tmp_path)["device"] == "Newer GPU"
    (tmp_path / "gpu-c-2026-04-01.json").write_text(json.dumps({"device": "No ladder", "date": "2026-04-01"}))
    assert records.latest("gpu", tmp_path)["device"] == "No ladder"
    assert records.latest("gpu", tmp_path, with_key="ladder")["device"] == "Newer GPU"
    assert records.label(runs[0]) == "Test GPU, torch 2.11.0, Triton 3.6.0, CUDA 12.8, 2026-01-02"
    assert records.label(records.latest("cpu", tmp_path)) == "Some CPU, torch 2.13.0, 2026-02-01"


def test_selections_from_a_run():
    run = gpu_run()
    points = records.ladder_points(run, n=4096)
    assert len(points) == 5
    assert records.best_sdpa(points, 4096) == ("sdpa:flash", 140.0)
    assert records.best_sdpa(points, 512) is None
    assert records.ladder_gains(run, n=16384) == [("teaching", 110.0), ("tma", 170.0)]
    assert records.series(points) == {"rung:teaching": {4096: 100.0}, "rung:tma": {4096: 150.0},
                                      "sdpa:flash": {4096: 140.0}, "sdpa:efficient": {4096: 70.0}}


def test_recorded_runs_are_read_under_todays_names():
    """The two H200 runs wrote 'flashlib' for the teaching forward and backward, 'flashlib:tma'
    and 'flashlib:tuned' for pairings, and BLOCK_M/BLOCK_N: read, they speak today's names; the
    files themselves are as the runs wrote them."""
    first, second = (records.load_run(path) for path in RECORDED.values())
    assert {p["method"] for p in first["ladder"]["points"]} - {p["method"] for p in second["ladder"]["points"]} \
        == {"ladder:tma+teaching"}
    assert {p["method"] for p in second["ladder"]["points"] if not p["method"].startswith(("rung:", "sdpa:"))} \
        == {"ladder:teaching", "ladder:tuned", "ladder:atomic"}
    raw = json.loads(RECORDED["2026-11-30T0015Z"].read_text())["ladder"]
    assert [p["method"] for p in raw["points"]].count("flashlib:tuned") == 28
    assert [(p["method"], p.get("ms")) for p in second["ladder"]["points"]] == \
        [(records.RENAMED.get(p["method"], p["method"]), p.get("ms")) for p in raw["points"]]
    assert {r["ours"] for r in second["ladder"]["target_ratios"] if r["mode"] == "fwd_bwd"} == {"ladder:tuned"}
    # the forward + backward peaks were measured net of the gradients: an erratum withdraws them
    assert second["ladder"]["memory_ratios"] == []
    assert {r["method"] for r in second["ladder"]["memory_ratios_withdrawn"]} == {"ladder:teaching"}
    for run in (first, second):
        for choices in run["ladder"]["autotuned"].values():
            for tiles in (choices.values() if "BLOCK_Q" not in choices else [choices]):
                assert "BLOCK_Q" in tiles and "BLOCK_K" in tiles and "BLOCK_M" not in tiles
    assert set(records.autotuned_tiles(second, n=16384)) == {"autotuned", "causal-split", "tma", "bwd_dkdv",
                                                              "bwd_dq", "bwd_atomic_fused"}


def test_a_run_in_todays_names_is_left_as_it_is():
    run = gpu_run()
    run["ladder"]["points"].append(dict(run["ladder"]["points"][0], method="flashlib", mode="fwd_bwd"))
    assert records.in_current_names(json.loads(json.dumps(run))) == run
    old = json.loads(json.dumps(run))
    del old["ladder"]["vocabulary"]
    renamed = records.in_current_names(old)
    assert renamed["ladder"]["points"][-1]["method"] == "ladder:teaching"
    assert renamed["ladder"]["renamed_from_vocabulary"] == 1
    assert records.in_current_names(json.loads(json.dumps(renamed))) == renamed  # once only


def test_autotuned_tiles_by_bucket_and_from_older_runs():
    tile = dict(BLOCK_Q=64, BLOCK_K=64, num_warps=4, num_stages=3)
    wide = dict(tile, BLOCK_Q=128, num_warps=8)
    new = {"ladder": {"autotuned": {"d=128 bfloat16 causal=False": {"tma": wide}},
                      "autotuned_by_n": {"d=128 bfloat16 causal=False": {"4096": {"tma": tile}, "16384": {"tma": wide}}}}}
    assert records.autotuned_tiles(new, n=3000) == {"tma": tile}      # 3000 -> the 4096 bucket
    assert records.autotuned_tiles(new, n=16384) == {"tma": wide}
    assert records.autotuned_tiles(new, n=1024) == {}                 # nothing kept for that bucket
    old = {"ladder": {"autotuned": {"d=128 bfloat16 causal=False": {"tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
                                                                                  num_stages=3)}}}}
    old = records.in_current_names(old)
    assert records.autotuned_tiles(old, n=1024) == {"tma": tile}      # one choice for every N, today's keys
    assert records.autotuned_tiles(old, causal=True) == {}


def test_rows_marked_invalid_are_left_out_and_errata_are_readable():
    run = gpu_run()
    run["ladder"]["points"][0]["invalid"] = "timed two kernels"
    run["errata"] = [dict(rows="rung:teaching rows", count=1, problem="timed two kernels", instead="another run")]
    first = gpu_run()["ladder"]["points"][0]
    assert records.ladder_points(run, n=first["n"], method=first["method"]) == []
    assert records.rates_at(run, ["rung:teaching", "rung:tma"], n=first["n"]) == \
        {"rung:tma": next(p["tflops"] for p in run["ladder"]["points"] if p["n"] == first["n"] and p["method"] == "rung:tma")}
    assert records.errata(run) == ["rung:teaching rows (1 rows): timed two kernels; instead: another run"]
    assert records.errata(gpu_run()) == []


def test_newest_run_with_every_method_valid(tmp_path):
    old, new = gpu_run("2026-01-02", "Old GPU"), gpu_run("2026-03-01", "New GPU")
    for p in new["ladder"]["points"]:
        if p["method"] == "rung:teaching":
            p["invalid"] = "timed two kernels"
    (tmp_path / "gpu-a-2026-01-02.json").write_text(json.dumps(old))
    (tmp_path / "gpu-b-2026-03-01.json").write_text(json.dumps(new))
    pick = lambda methods: records.newest_run_with(methods, n=4096, directory=tmp_path)  # noqa: E731
    assert pick(["rung:tma", "sdpa:flash"])["device"] == "New GPU"
    assert pick(["rung:teaching", "sdpa:flash"])["device"] == "Old GPU"
    assert pick(["rung:teaching", "sdpa:cudnn"]) is None  # cuDNN failed there: no run has both


def test_speedups_by_hand():
    point = dict(d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd")
    run = {"ladder": {"points": [dict(point, method="new", ms=2.0, ms_p20=1.8, ms_p80=2.2),
                                 dict(point, method="old", ms=3.0, ms_p20=2.9, ms_p80=3.3),
                                 dict(point, n=8192, method="new", ms=4.0),  # no baseline there
                                 dict(point, n=1024, method="old", error="boom")]}}
    (row,) = records.speedups(run, "new", "old", d=128)
    assert row["n"] == 4096 and row["speedup"] == pytest.approx(1.5)
    assert row["range"] == pytest.approx([2.9 / 2.2, 3.3 / 1.8])
    earlier = {"ladder": {"points": [dict(point, n=8192, method="new", ms=5.0)]}}
    (row,) = records.speedups(run, "new", "new", against=earlier)
    assert row["n"] == 8192 and row["speedup"] == pytest.approx(1.25) and row["range"] is None
    assert records.speedups(run, "new", "missing") == []


def test_report_steps_follow_the_ladders_table():
    steps = report.steps()
    assert steps[:len(LADDER) - 1] == [(f"rung:{b.name}", f"rung:{a.name}") for a, b in zip(LADDER, LADDER[1:])]
    assert [m for m, _ in steps if m.startswith("ladder:") and m != "ladder:teaching-4-warp"] == \
        [f"ladder:{b.name}" for b in BACKWARDS[1:]]
    timed = set(methods("fwd")) | set(methods("fwd_bwd"))
    assert {name for step in steps for name in step} <= timed


def test_run_report_reads_the_recorded_runs():
    """python -m flashlib.bench.report on the second H200 run against the first: a step's speedup as
    computed here from the file, and the earlier run named."""
    run, earlier = RECORDED["2026-11-30T0015Z"], RECORDED["2026-11-29T2353Z"]
    ms = {p["method"]: p["ms"] for p in records.ladder_points(records.load_run(run), d=128, n=4096,
                                                              dtype="bfloat16", causal=False, mode="fwd_bwd")
          if p.get("ms")}
    done = subprocess.run([sys.executable, "-m", "flashlib.bench.report", str(run), "--against", str(earlier)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ladder:tuned over ladder:teaching:" in done.stdout
    assert f"N=4096: {ms['ladder:teaching'] / ms['ladder:tuned']:.2f}" in done.stdout
    assert records.label(records.load_run(earlier)) in done.stdout
    assert "rung:lean over rung:tma: not measured in this run" in done.stdout
    assert "bwd_atomic_fused" in done.stdout and "BLOCK_M" not in done.stdout


def test_figures_render():
    run = gpu_run()
    figures = [plots.rate_plot(records.series(records.ladder_points(run)), title=records.label(run), ceiling=700.0),
               plots.bar_chart(["teaching", "tma"], [100.0, 150.0], title="ladder"),
               plots.roofline_plot([dict(label="tma", flops=4e12, bytes=2e9, ms=20.0)], 700.0, 4000.0)]
    cpu = {"provenance": {"cpu": "Some CPU", "torch": "2.13.0", "date": "2026-02-01"},
           "points": [dict(method=m, n=n, peak_alloc_bytes=n * (n if m == "dense" else 64) * 4, seconds=n * 1e-6)
                      for m in ("dense", "tiled") for n in (1024, 2048)]}
    figures += list(plots.cpu_figures(cpu))
    for fig in figures:
        assert viz.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(figures[0].axes[0].lines) == 5  # four methods and the ceiling


def test_grouped_bar_chart_draws_only_measured_bars():
    fig = plots.grouped_bar_chart({"run 1": {"teaching": 100.0, "tma": 150.0}, "run 2": {"tma": 170.0}}, title="t")
    assert viz.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes[0].patches) == 3
    fig = plots.grouped_bar_chart({"run 1": {"teaching": 100.0, "sdpa": 90.0}, "run 2": {"tma": 170.0, "sdpa": 95.0}},
                                  order=["teaching", "tma", "lean"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["teaching", "tma", "sdpa"]


def test_the_recorded_files_are_where_the_tests_look():
    assert all(Path(p).exists() for p in RECORDED.values())


def test_an_erratum_withdraws_the_figures_it_names_and_keeps_them_aside():
    for path in RECORDED.values():
        run, raw = records.load_run(path), json.loads(path.read_text())
        pairs = list(zip(run["ladder"]["points"], raw["ladder"]["points"]))
        assert all(p["peak_bytes"] is None and p["peak_bytes_withdrawn"] == r["peak_bytes"]
                   for p, r in pairs if r["mode"] == "fwd_bwd" and r.get("peak_bytes") is not None)
        assert all(p.get("peak_bytes") == r.get("peak_bytes") for p, r in pairs if r["mode"] == "fwd")
        assert any("net of the gradients" in line for line in records.errata(run))
