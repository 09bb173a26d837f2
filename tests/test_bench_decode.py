"""The decoding benchmark (flashlib.bench.decode) without a GPU: its plan, bytes and targets, and a
whole run on tiny shapes through Triton's interpreter with stand-in timers."""
from __future__ import annotations

import json

import pytest
import torch

from flashlib.bench import decode as bench


def stand_in(ms=1.0):
    def timer(fn):
        fn()  # the call runs once, as it would be timed
        return ms, 0.9 * ms, 1.1 * ms
    return timer


TINY = dict(device="cpu", batches=(1, 2), lengths=(24, 40), q_heads=4, kv_heads=2, head_dim=16, page_size=8,
            dtype=torch.float32, ceilings={"copy_gbps": 100.0}, log=lambda *_: None)


def test_the_plan_measures_the_targets_first():
    points = bench.plan()
    assert len(points) == 2 * 6 * 2
    lengths = [p["length"] for p in points]
    assert lengths[:8] == [131072] * 4 + [65536] * 4 and all(n >= 16384 for n in lengths[:16])
    assert points[0] == dict(batch=1, length=131072, layout="contiguous")  # SDPA is timed at contiguous points
    assert bench.kv_bytes(1, 8, 16384, 128) == 2 * 8 * 16384 * 128 * 2  # K and V, bf16


def test_targets_compare_with_the_best_sdpa_and_the_copy_bandwidth():
    common = dict(batch=1, length=16384, ms_p20=0.9, ms_p80=1.1)
    ours = dict(common, method="flashlib", max_abs_err_vs_sdpa=0.004)
    rows = [dict(common, method="sdpa:flash", layout="contiguous", ms=2.0),
            dict(common, method="sdpa:cudnn", layout="contiguous", ms=1.5, ms_graph=1.2),
            dict(ours, layout="contiguous", ms=1.0, gbps=3000.0, ms_graph=0.8, gbps_graph=3600.0),
            dict(ours, layout="paged", ms=2.0, gbps=1500.0),
            dict(ours, layout="paged", length=8192, ms=1.0, gbps=1.0),  # below 16k: no target
            dict(ours, batch=8, layout="contiguous", ms=0.1, gbps=4000.0, max_abs_err_vs_sdpa=0.5)]
    rows.append(dict(ours, method="flashlib:call", layout="contiguous", ms=3.0))  # the one-call form
    got = bench.targets(rows, copy_gbps=4000.0)
    assert [(t["layout"], t["sdpa"], t["speedup"], t["speedup_met"], t["bandwidth_fraction"], t["bandwidth_met"])
            for t in got] == [("contiguous", "sdpa:cudnn", 1.5, True, 0.75, True),
                              ("paged", "sdpa:cudnn", 0.75, False, 0.375, False),
                              ("contiguous", None, None, False, 1.0, False)]  # fast but wrong: no target met
    assert [t["correct"] for t in got] == [True, True, False]
    assert got[0]["speedup_graph"] == pytest.approx(1.5) and got[0]["bandwidth_fraction_graph"] == 0.9
    assert got[1]["speedup_graph"] is None  # no graph time for that row
    assert got[0]["speedup_range"] == pytest.approx([0.9 / 1.1, 1.1 / 0.9])
    assert got[0]["speedup_call"] == 0.5 and got[1]["speedup_call"] is None
    text = bench.format_targets({"decode": {"targets": got}})
    assert "0.75x sdpa:cudnn (not met)" in text and "from graphs 1.50x, bandwidth 90%" in text


def test_a_run_on_tiny_shapes_through_the_interpreter():
    replays = []

    def graph(call):  # stands in for a CUDA graph: replaying is calling
        replays.append(call)
        return call
    result = bench.run_decode_bench(60, bench=stand_in(), sweeps=False, graph=graph, **TINY)["decode"]
    points = result["points"]
    ours = [p for p in points if p["method"] == "flashlib"]
    assert [(p["batch"], p["length"], p["layout"]) for p in ours] == [
        (1, 40, "contiguous"), (1, 40, "paged"), (2, 40, "contiguous"), (2, 40, "paged"),
        (1, 24, "contiguous"), (1, 24, "paged"), (2, 24, "contiguous"), (2, 24, "paged")]
    assert all(p["max_abs_err_vs_sdpa"] < 1e-5 and p["num_splits"] == 1 for p in ours)  # the interpreter's rule
    assert ours[2]["bytes"] == 2 * 2 * 2 * 40 * 16 * 4 and ours[2]["gbps"] == pytest.approx(ours[2]["bytes"] / 1e6)
    sdpa = [p for p in points if p["method"].startswith("sdpa:")]
    assert len(sdpa) == 4 * 4 and {p["layout"] for p in sdpa} == {"contiguous"}  # once per batch and length
    assert any(p.get("gqa") == "enable_gqa" and "ms" in p for p in sdpa)
    # flashlib at every point and the fastest SDPA backend once per batch and length, from graphs too
    assert len(replays) == 8 + 4 and all("ms_graph" in p for p in ours)
    assert sum("ms_graph" in p for p in sdpa) == 4
    # decode_attention as a user calls it, beside the plan's run at every point: as called only
    called = [p for p in points if p["method"] == "flashlib:call"]
    assert [(p["batch"], p["length"], p["layout"]) for p in called] == [(p["batch"], p["length"], p["layout"])
                                                                        for p in ours]
    assert all("ms" in p and "ms_graph" not in p for p in called)
    assert result["ceilings"] == {"copy_gbps": 100.0} and result["skipped"] == [] and result["device_lost"] is None
    json.dumps(result)  # the check writes it as JSON


def test_the_sweeps_fill_what_the_budget_leaves():
    every = bench.sweep_items(1, 40)
    assert [i["sweep"] for i in every] == ["splits"] * 6 + ["pages"] * 3 + ["tiles"] * 10  # tiles last: they compile
    # a few of each (the interpreter runs 128 splits' programs one by one)
    items = [i for i in every if i.get("num_splits", 1) <= 8 and i.get("page_size", 16) == 16
             and i.get("block_k", 32) == 32]
    inputs = lambda p, page_size: bench.Inputs(p, page_size=page_size, q_heads=4, kv_heads=2, head_dim=16,  # noqa: E731
                                               dtype=torch.float32, device="cpu")
    rows, skipped = bench.run_sweeps(items, inputs, stand_in(), 60, log=lambda *_: None)
    assert skipped == [] and all("ms" in r for r in rows) and rows[0]["num_splits"] == 1
    clock = iter(range(0, 1000, 5))  # every reading 5 s later: the second item starts at 15 s, the third at 25
    rows, skipped = bench.run_sweeps(items, inputs, stand_in(), 22, log=lambda *_: None, clock=lambda: next(clock))
    assert len(rows) == 2 and len(skipped) == len(items) - 2


def test_a_fault_that_loses_the_device_ends_the_run(monkeypatch):
    def broken(x, **_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench, "ours_call", broken)
    monkeypatch.setattr(bench, "device_usable", lambda device: False)
    result = bench.run_decode_bench(60, bench=stand_in(), **TINY)["decode"]
    assert result["device_lost"]["method"] == "flashlib" and "illegal memory" in result["device_lost"]["error"]
    assert len([p for p in result["points"] if p["method"] == "flashlib"]) == 1 and result["sweeps"] == []


def test_main_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_decode_bench", lambda budget, sweeps, progress: (
        progress([{"method": "flashlib"}]) or {"decode": {"targets": [], "budget": budget, "sweeps": sweeps}}))
    bench.main(["--budget", "30", "--result", str(tmp_path / "d.json"), "--no-sweeps"])
    assert json.loads((tmp_path / "d.json").read_text()) == {"decode": {"targets": [], "budget": 30.0, "sweeps": False}}
    assert "wrote" in capsys.readouterr().out


def test_the_shared_prefix_groups_time_plain_and_cascade_decoding():
    items = bench.cascade_items(groups=(2, 4), prefixes=(40,), suffix=8)
    replays = []
    rows, skipped = bench.run_cascade(items, stand_in(), 600, lambda *_: None, q_heads=4, kv_heads=2, head_dim=16,
                                      dtype=torch.float32, device="cpu", graph=lambda call: replays.append(1) or call,
                                      copy_gbps=100.0)
    assert skipped == [] and [r["method"] for r in rows] == ["flashlib:plain", "flashlib:cascade"] * 2
    assert len(replays) == 4 and all("ms_graph" in r and r["num_splits"] == 1 for r in rows)  # plans, from graphs
    for plain, cascade in zip(rows[::2], rows[1::2]):
        assert plain["max_abs_difference"] < 1e-5  # the same attention, through the interpreter
        assert plain["bytes"] == plain["batch"] * 48 * 2 * 2 * 16 * 4  # every request's prefix and suffix
        assert cascade["bytes"] == (40 + plain["batch"] * 8) * 2 * 2 * 16 * 4  # 2 x 2 rows: one block
        assert cascade["copy_fraction"] == pytest.approx(cascade["gbps"] / 100.0)
    assert [i["sweep"] for i in bench.cascade_items()] == ["cascade"] * 4


def test_the_mla_steps_time_one_latent_read_against_a_value_cache_of_its_own():
    assert bench.mla_items() == [dict(sweep="mla", batch=b, length=n, layout="paged", page_size=64)
                                 for n in (4096, 16384) for b in (64, 132)]
    items = bench.mla_items(batches=(1, 2), lengths=(40,), page_size=16)
    tiny = dict(q_heads=4, width=24, head_dim_v=16, scale=0.25, dtype=torch.float32, device="cpu")
    rows, skipped = bench.run_mla(items, stand_in(), 600, lambda *_: None, graph=lambda call: call, copy_gbps=50.0,
                                  **tiny)
    assert skipped == [] and [r["method"] for r in rows] == ["flashlib:mla", "flashlib:mla-separate"] * 2
    assert all(r["copy_fraction_graph"] == pytest.approx(r["gbps_graph"] / 50.0) for r in rows)
    for shared, separate in zip(rows[::2], rows[1::2]):
        assert shared["max_abs_difference"] < 1e-5  # the same attention, through the interpreter
        queries = shared["batch"] * 4 * (24 + 16) * 4  # q read, the output written
        assert shared["bytes"] == shared["batch"] * 40 * 24 * 4 + queries  # the latent cache once
        assert separate["bytes"] == shared["batch"] * 40 * (24 + 16) * 4 + queries  # and the values apart
        assert shared["gbps"] == pytest.approx(shared["bytes"] / 1e6) and shared["row_blocks"] == 1
    # the GPU run's step: DeepSeek-V3's 128 heads over 576 columns, 512 of them values
    assert (bench.MLA_Q_HEADS, bench.MLA_WIDTH, bench.MLA_HEAD_DIM_V) == (128, 576, 512)


def test_serving_targets_compare_paged_with_contiguous_cascade_with_plain_and_mla_with_copy():
    ours = dict(method="flashlib", batch=8, length=16384)
    points = [dict(ours, layout="contiguous", ms=1.0, ms_graph=0.8), dict(ours, layout="paged", ms=1.25, ms_graph=0.8),
              dict(ours, layout="paged", length=4096, ms=9.0)]  # below 16k: no target
    group = dict(batch=8, prefix=16384, suffix=512)
    cascade = [dict(group, method="flashlib:plain", ms=0.6, ms_graph=0.5),
               dict(group, method="flashlib:cascade", ms=0.2, ms_graph=0.3)]
    mla = [dict(method="flashlib:mla", batch=64, length=4096, copy_fraction=0.4, copy_fraction_graph=0.55),
           dict(method="flashlib:mla-separate", batch=64, length=4096, copy_fraction=0.9)]
    got = {t["target"]: t for t in bench.serving_targets(points, cascade, mla)}
    assert (got["paged/contiguous"]["ratio"], got["paged/contiguous"]["met"], got["paged/contiguous"]["met_graph"]) == (
        0.8, False, True)
    assert got["cascade/plain"]["ratio"] == pytest.approx(3.0) and got["cascade/plain"]["met"]
    assert not got["cascade/plain"]["met_graph"]  # 0.5 / 0.3 < 2
    assert (got["mla/copy"]["met"], got["mla/copy"]["met_graph"]) == (False, True) and len(got) == 3
    text = bench.format_targets({"decode": {"targets": [], "serving_targets": list(got.values())}})
    assert "cascade/plain batch=8 prefix=16384: 3.00 as called (met, goal 2.0), from graphs 1.67 (not met)" in text


def test_the_launch_points_cover_every_step_of_the_benchmark():
    points = bench.launch_points()
    names = [p["name"] for p in points]
    assert len(points) == len(bench.plan()) + 2 * len(bench.cascade_items()) + len(bench.mla_items())
    assert "paged B=8 L=16384" in names and "cascade prefix B=32 P=65536" in names and "mla B=132 L=16384" in names
    prefix = next(p for p in points if p["name"] == "cascade prefix B=8 P=16384")
    assert prefix["rows"] == 32 and prefix["shape"].split_grid == (1, 33, 8)  # 8 programs a split: 33 splits
    mla = next(p for p in points if p["name"] == "mla B=64 L=4096")
    assert mla["shape"].block_q == 64 and mla["shape"].split_grid == (2, 2, 64)  # two blocks of 64 heads, side by side
