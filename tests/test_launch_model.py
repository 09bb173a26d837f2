"""The launch model (flashlib.kernels.launches) on the decoding benchmark's launches, compiled for sm_90.

Every launch of the benchmark's steps (flashlib.bench.decode.launch_points: decoding and paged decoding at
every point, each cascade group's prefix pass and suffixes, each absorbed MLA step), shaped as on an H200
(132 multiprocessors) and compiled for sm_90 with the pinned Triton and with 3.6.0 (the H200's): its
registers and shared memory give its residency, and the split rule's grid its waves. Held: no launch
ends in a part-filled wave; every SM gets a program wherever the cache is long enough to split; paged
decoding keeps two programs per multiprocessor; and a paged tile's loads, in the machine code, are a
contiguous tile's: as many, as wide, as many tiles in flight, one page number per tile where a tile lies
in one page, and no division by the page size.
"""
from __future__ import annotations

import importlib.util

import pytest

from flashlib.kernels.launches import H200, launch_model, residency, waves

if importlib.util.find_spec("triton") is None:  # the kernels need Triton (Linux only)
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.bench import decode as bench  # noqa: E402
from flashlib.kernels.decode import MAX_SPLITS, MIN_KEYS_PER_SPLIT  # noqa: E402
from tests.decode_compile import compile_decode, spec  # noqa: E402
from tests.triton_versions import side_by_side, triton36_dir  # noqa: E402

H100_90 = (9, 0)


# ----- the model's rules ----------------------------------------------------------------------------

def test_residency_follows_cudas_occupancy_rules():
    # 168 registers: 5,376 a warp, 12 warps of the 65,536 (in groups of 4), three programs of 4 warps
    assert residency(168, 0, 4)["programs"] == 3
    assert residency(176, 0, 4) == dict(programs=2, limit="registers", by_registers=2, by_shared=228, by_warps=16,
                                        by_slots=32)
    assert residency(255, 0, 8)["programs"] == 1  # 8 warps of 8,192 registers: the whole file
    # shared memory: 71,680 bytes and the runtime's 1 KiB, three in 228 KiB; 114,688: two
    assert residency(64, 71680, 4)["programs"] == 3 and residency(64, 114688, 4)["programs"] == 2
    assert residency(32, 0, 1)["programs"] == 32 and residency(32, 0, 1)["limit"] == "slots"
    assert waves(264, 2) == 1.0 and waves(396, 2) == 1.5
    model = launch_model(320, 168, 0, 4)  # 320 programs, 396 slots
    assert model["waves"] == pytest.approx(320 / 396) and model["fill"] == model["waves"]
    assert launch_model(300, 255, 0, 8)["fill"] == pytest.approx(300 / 396)  # 2.27 waves in 3


# ----- the benchmark's launches ---------------------------------------------------------------------

def _specs(point) -> tuple:
    """(stage 1's compile spec, stage 2's or None) of one launch point; the machine code of stage 1's loop too."""
    common = dict(head_dim_v=point["head_dim_v"], rows=point["rows"])
    split = spec("split", H100_90, "bfloat16", point["head_dim"], paged=point["paged"], page_size=point["page_size"],
                 v_from_k=point["v_from_k"], sass=True, **common)
    stacked = point["name"].startswith("cascade prefix")  # the prefix's splits are folded by the suffixes' merge
    return split, None if stacked else spec("merge", H100_90, "bfloat16", point["head_dim"], prefix=point["prefix"],
                                            **common)


POINTS = bench.launch_points()
# the evidence of the tile-in-a-page path: pages of 64, as the MLA steps have, at decoding's shape
PAGES_OF_64 = spec("split", H100_90, "bfloat16", 128, paged=True, page_size=64, rows=4, sass=True)
SPECS = []  # each distinct compile once
for _spec in [s for p in POINTS for s in _specs(p) if s is not None] + [PAGES_OF_64]:
    if _spec not in SPECS:
        SPECS.append(_spec)


@pytest.fixture(scope="module")
def compiled():
    """{version: {spec index: report}}, both Triton releases side by side."""
    found = side_by_side(lambda specs, triton_path: compile_decode(specs, triton_path=triton_path), SPECS)
    return {version: dict(enumerate(result["reports"])) for version, result in found.items()}


def _reports(compiled, version):
    if version not in compiled:
        triton36_dir()  # skips (locally) or fails (CI) with the reason
    reports = compiled[version]
    for i, r in reports.items():
        assert r["ok"], (SPECS[i], r["error"])
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0), (SPECS[i], r["registers"])
    return lambda s: reports[SPECS.index(s)]


def model_rows(report) -> list[dict]:
    """One row per benchmark launch: its name, stage, grid and the model of it on an H200."""
    rows = []
    for point in POINTS:
        shape = point["shape"]
        for stage, s, grid in zip(("split", "merge"), _specs(point), (shape.split_grid, shape.merge_grid)):
            if s is None:
                continue
            r = report(s)
            programs = 1
            for n in grid:
                programs *= n
            rows.append(dict(name=point["name"], stage=stage, grid=grid, num_splits=shape.num_splits,
                             **launch_model(programs, r["registers"], r["shared"], r["num_warps"])))
    return rows


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_every_stage_one_launch_ends_in_whole_waves(compiled, version):
    rows = [r for r in model_rows(_reports(compiled, version)) if r["stage"] == "split"]
    assert len(rows) == len(POINTS)
    for r in rows:
        # a part-filled second wave takes as long as a full one: one wave, or waves nearly all full
        assert r["waves"] <= 1 or r["fill"] >= 0.9, r
        keys = next(p for p in POINTS if p["name"] == r["name"])["keys"]
        # every multiprocessor has a program, unless the cache is too short to split further
        bounded = r["num_splits"] >= min(MAX_SPLITS, -(-keys // MIN_KEYS_PER_SPLIT))
        assert r["programs"] >= H200.sms or bounded, r


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_the_launches_as_an_h200_holds_them(compiled, version):
    rows = {(r["name"], r["stage"]): r for r in model_rows(_reports(compiled, version))}
    # decoding at 16k and past: one wave, two programs a multiprocessor at least (the split rule's), every SM busy
    for layout in ("contiguous", "paged"):
        for batch in (1, 8):
            r = rows[(f"{layout} B={batch} L=16384", "split")]
            assert r["resident"] >= 2 and r["waves"] <= 1 and r["programs"] >= H200.sms, r
    # the cascade's prefix pass: its keys split across programs, a wave of them
    for batch in (8, 32):
        r = rows[(f"cascade prefix B={batch} P=16384", "split")]
        assert r["num_splits"] >= 16 and r["programs"] >= H200.sms and r["waves"] <= 1, r
    # absorbed MLA: one program of 64 heads a multiprocessor (registers), in whole waves
    for batch in (64, 132):
        r = rows[(f"mla B={batch} L=4096", "split")]
        assert (r["resident"], r["limit"]) == (1, "registers") and r["fill"] >= 0.95, r


@pytest.mark.parametrize("version", ["pinned", "3.6"])
def test_a_paged_tile_loads_as_a_contiguous_one(compiled, version):
    report = _reports(compiled, version)
    contiguous = report(_specs(next(p for p in POINTS if p["name"] == "contiguous B=8 L=16384"))[0])
    paged = report(_specs(next(p for p in POINTS if p["name"] == "paged B=8 L=16384"))[0])
    in_a_page = report(PAGES_OF_64)
    tile = 16  # (64 keys x 128 columns of bfloat16) x (K, V) / (128 threads x 16 bytes)
    for r in (contiguous, paged, in_a_page):
        loads = r["key_loop"]["loads"]
        assert loads.get("LDGSTS.E.BYPASS.128") == tile, loads  # K and V: 16-byte copies to shared memory, as many
        assert not {op for op in loads if op.startswith("LDG.")}, loads  # none through registers
        assert not {"IABS", "I2F", "F2I"} & set(r["key_loop"]["ops"]), r["key_loop"]["ops"]  # no division by the page
        assert r["shared"] >= 2 * 64 * 2 * 128 * 2  # two tiles of K and V in flight
    assert "LDGSTS.E" not in contiguous["key_loop"]["loads"]
    assert in_a_page["key_loop"]["loads"]["LDGSTS.E"] == 1  # a tile in one page: one page number
    assert paged["key_loop"]["loads"]["LDGSTS.E"] <= 8  # pages of 16: a page number per key, 4 bytes each
    assert in_a_page["registers"] <= contiguous["registers"] + 24  # one base address for the tile's rows
