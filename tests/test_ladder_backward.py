"""The ladder's backwards (``flashlib.ladder.attention(..., backward="tuned" | "lean" | "bulk")``):
exact in the interpreter, every autotune candidate of the rung table compiled for Hopper with
both Triton releases. The interpreter has no bulk reductions: there "bulk" adds dQ with
per-element atomics, and its bulk reduction is checked compiled (here) and on a GPU
(tests/test_gpu.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlib import dense_attention
from flashlib.kernels import triton_installed
from tests.triton_versions import each_once, triton36_dir

if not triton_installed():  # importing triton here first would keep its interpreter off
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.kernels import FlashConfig, default_config  # noqa: E402
from flashlib.kernels.compile import SHARED_LIMIT, exponentials_per_score  # noqa: E402
from flashlib.ladder import attention as flash_attention  # noqa: E402
from flashlib.ladder import rungs  # noqa: E402
from flashlib.ladder.compile import compile_rungs, spec  # noqa: E402


def _tiles(bm, bn, dq_t=False):
    return FlashConfig(block_q=16, block_k=16, bwd_block_q=bm, bwd_block_k=bn, bwd_dq_transposed=dq_t)


# every backward of the table but the teaching one (tests/test_kernels.py); "bulk:T": "bulk" with
# dQ built transposed (FlashConfig.bwd_dq_transposed)
BACKWARDS = [b.name for b in rungs.BACKWARDS if b.tiles] + ["bulk:T"]


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def _check(seq_q, seq_k, d, causal, cfg, seed=0, heads=2, backward="tuned", dtype=torch.float32):
    if backward.endswith(":T"):
        backward, cfg = backward[:-2], replace(cfg, bwd_dq_transposed=True)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq_q, d, generator=gen).to(dtype)  # (B, H, N, D)
    k, v = (torch.randn(1, heads, seq_k, d, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(1, heads, seq_q, d, generator=gen).to(dtype)
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=causal, config=cfg, backward=backward), q, k, v, dout)
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=causal), *(t.double() for t in (q, k, v, dout)))
    # float32: rounding of float32 arithmetic; float16: the gradients are rounded to float16 (and
    # so is P before its products in a 16-bit kernel): a few units of the last of 11 bits
    atol, rtol = (1e-5, 1e-4) if dtype == torch.float32 else (4e-3, 4e-3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name} {(seq_q, seq_k, d, causal, cfg.bwd_block_q, cfg.bwd_block_k)}: {m}")


# (seq_q, seq_k, head_dim, causal): every split of the loops is exercised with 16/32 tiles:
# diagonal, interior and ragged blocks, queries that see no key, keys no query sees
CASES = [(37, 50, 24, True), (50, 37, 24, True), (33, 33, 16, True), (21, 45, 59, False),
         (64, 64, 32, True), (64, 64, 32, False), (48, 80, 16, True), (1, 40, 16, True), (40, 1, 16, True)]


TILES = [(16, 16), (16, 32), (32, 16)]
# every case with every backward, and each with every pair of tiles: (case i, backward j) takes tiles i + j,
# so each case meets all three tile pairs and each backward all three (a covering of the pairs, not the
# 9 x 4 x 3 product; the property test below draws the rest)
PAIRWISE = [(*case, *TILES[(i + j) % len(TILES)], backward) for i, case in enumerate(CASES)
            for j, backward in enumerate(BACKWARDS)]


def test_the_cases_meet_every_tile_pair_and_backward():
    assert {(c[:4], c[4:6]) for c in PAIRWISE} == {(case, t) for case in CASES for t in TILES}
    assert {(c[4:6], c[6]) for c in PAIRWISE} == {(t, b) for t in TILES for b in BACKWARDS}
    assert {(c[:4], c[6]) for c in PAIRWISE} == {(case, b) for case in CASES for b in BACKWARDS}


@pytest.mark.parametrize("seq_q,seq_k,d,causal,bm,bn,backward", PAIRWISE)
def test_tuned_backward_matches_float64_autograd(seq_q, seq_k, d, causal, bm, bn, backward):
    _check(seq_q, seq_k, d, causal, _tiles(bm, bn), backward=backward)


@settings(deadline=None)
@given(seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), d=st.sampled_from([8, 16, 20]),
       causal=st.booleans(), bm=st.sampled_from([16, 32]), bn=st.sampled_from([16, 32]),
       seed=st.integers(0, 2**16), backward=st.sampled_from(BACKWARDS),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_tuned_backward_any_shape_tiles_and_dtype(seq_q, seq_k, d, causal, bm, bn, seed, backward, dtype):
    _check(seq_q, seq_k, d, causal, _tiles(bm, bn), seed=seed, heads=1, backward=backward, dtype=dtype)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_tuned_backward_rows_without_keys_get_zero_gradients(backward):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 40, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, 24, 16, generator=gen, requires_grad=True) for _ in range(2))
    cfg = _tiles(16, 16, dq_t=backward.endswith(":T"))
    flash_attention(q, k, v, causal=True, config=cfg, backward=backward.split(":")[0]).sum().backward()
    assert q.grad.dtype == torch.float32
    assert (q.grad[..., :16, :] == 0).all()  # queries 0..15 see no key (bottom-right diagonal)
    assert q.grad[..., 16:, :].abs().sum() > 0


@pytest.mark.parametrize("backward", ["tuned", "lean"])
def test_gradient_of_a_sum_arrives_expanded(backward):
    """out.sum().backward() hands the kernels a dout whose rows all alias one (stride 0)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=gen) for _ in range(3))
    got = _grads(lambda a, b, c: flash_attention(a, b, c, causal=True, config=_tiles(16, 16),
                                                 backward=backward).sum(), q, k, v, torch.tensor(1.0))
    want = _grads(lambda a, b, c: dense_attention(a, b, c, causal=True).sum(), *(t.double() for t in (q, k, v)),
                  torch.tensor(1.0, dtype=torch.float64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-4)


def test_half_precision_tuned_backwards_match_teaching_backward():
    """float16 inputs (float32 math in the interpreter): every backward agrees with the
    teaching one, and the fused path hands back dq in the input dtype."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(1, 2, 45, 32, generator=gen).half() for _ in range(4))
    cfg = _tiles(16, 32)
    names = [b.name for b in rungs.BACKWARDS]
    grads = {b: _grads(lambda a, b_, c, b=b: flash_attention(a, b_, c, causal=True, config=cfg, backward=b),
                       q, k, v, dout) for b in names}
    for b in names[1:]:
        for g, t in zip(grads[b], grads["teaching"]):
            assert g.dtype == torch.float16
            torch.testing.assert_close(g, t, atol=2e-3, rtol=2e-3)


def test_bad_backward_is_named():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="'backward'.*'fast'"):
        flash_attention(x, x, x, backward="fast")
    with pytest.raises(ValueError, match="'backward'.*'atomic'"):  # removed: data/bench/LOG.md
        rungs.backward("atomic")
    with pytest.raises(ValueError, match="'name'.*bwd_dkdv_lean.*'bwd_fused_atomic'"):
        spec("bwd_fused_atomic")


def test_pruner_gives_each_head_dim_its_candidates():
    """Each autotuned kernel of each backward times the candidates its table row lists for
    the launch's padded head dim, in one autotuner per (kernel, backward, bucket)."""
    from flashlib.ladder import autotune
    from flashlib.ladder import backward as bf

    for b in rungs.BACKWARDS:
        for role, table in b.tiles.items():
            kernel, _ = bf.variant(b, role, descriptors=True)
            tuner = autotune.tuner(kernel, (role, b.name), 4096, table)
            assert tuner is autotune.tuner(kernel, (role, b.name), 4096, table)
            assert tuner is not autotune.tuner(kernel, (role, b.name), 8192, table)
            for pad, want in ((16, 64), (64, 64), (128, 128), (256, 256)):
                got = tuner.early_config_prune(tuner.configs, {}, HEAD_DIM_PAD=pad)
                assert [(c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                        + ((c.kwargs["DQ_T"],) if "DQ_T" in c.kwargs else ()) for c in got] == list(table[want])


def test_autotuned_choices_are_kept_per_backward_and_bucket():
    from flashlib.ladder import autotune
    from flashlib.ladder import backward as bf

    tuner = autotune.tuner(bf._attn_bwd_dq_split, ("dq", "lean"), 8192, rungs.DQ_TILES)
    key = (128, True, "tf32", True, *["torch.bfloat16"] * 5, "torch.float32", "torch.float32")
    config = tuner.configs[0]
    tuner.cache[key] = config
    try:
        want = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        assert bf.autotuned_choices(128, torch.bfloat16, True, "lean", seq=5000) == {"dq": want}
        assert bf.autotuned_choices(128, torch.bfloat16, True, "lean", seq=16384) == {}
        assert bf.autotuned_choices(128, torch.bfloat16, True, "tuned", seq=5000) == {}
        assert bf.autotuned_choices(128, torch.bfloat16, False, "lean", seq=5000) == {}
    finally:
        del tuner.cache[key]


def _candidate_specs():
    """Every candidate of every autotuned backward kernel, causal, for sm_90 with the machine code;
    for sm_80 each distinct tile shape (tiles, warps, dQ's layout) once, at its deepest pipeline (see
    _check_candidates). The fused kernel is sm_90's only (elsewhere "bulk" runs lean's kernels)."""
    specs, deepest = [], {}
    for b in rungs.BACKWARDS:
        for role, table in b.tiles.items():
            for d, tiles in table.items():
                for bm, bn, w, s, *dq_t in tiles:
                    cfg = FlashConfig(bwd_block_q=bm, bwd_block_k=bn, bwd_num_warps=w, bwd_num_stages=s,
                                      bwd_dq_transposed=bool(dq_t and dq_t[0]))
                    name = f"bwd_{role}_{b.name}"
                    specs.append(spec(name, (9, 0), "bfloat16", d, True, cfg, sass=True))
                    shape = (name, d, bm, bn, w, cfg.bwd_dq_transposed)
                    if role != "fused" and s > deepest.get(shape, (0, None))[0]:
                        deepest[shape] = (s, spec(name, (8, 0), "bfloat16", d, True, cfg))
    return specs + [found for _, found in deepest.values()]


def _check_candidates(reports, version):
    """sm_90, the target the candidates were chosen for: no spills, wgmma wherever a dot has
    64 rows. sm_80 (A100): they build within its shared memory and use its tensor cores; a few
    spill some bytes there, which only makes them slower, and the autotuner times them. There
    each tile shape is compiled at its deepest pipeline: the most shared memory of its candidates
    (every stage holds one more set of streamed tiles), the same kind of instructions."""
    assert reports and all(r.triton_version == version for r in reports)
    from flashlib.ladder.compile import KERNELS

    for r in reports:
        label = (r.rung, r.capability, r.head_dim, r.config["bwd_block_q"], r.config["bwd_block_k"], version)
        assert r.ok, (label, r.error)
        assert r.shared <= SHARED_LIMIT[r.capability], label
        if r.capability == (8, 0):
            assert r.mma_sync_ops > 0 and r.bulk_copy_ops == r.bulk_reduce_ops == 0, label
            continue
        assert r.spill_stores == 0 and r.spill_loads == 0, label
        # every wgmma reads shared memory through descriptors built from shared addresses
        assert r.wgmma_from_arguments == [], (label, [hex(a) for a in r.wgmma_from_arguments])
        backward, role = KERNELS[r.rung]
        # TMA copies where the table says descriptors, only on sm_90; bulk reductions in the fused kernel
        assert (r.bulk_copy_ops > 0) == rungs.backward(backward).descriptors, label
        assert (r.bulk_reduce_ops > 0) == (role == "fused"), label
        rows = r.config["bwd_block_q"] if role == "dq" else r.config["bwd_block_k"]
        assert (r.wgmma_ops > 0) == (rows >= 64), label  # Hopper's tensor cores need 64-row tiles
        if r.config["bwd_dq_transposed"]:  # every product on wgmma, dQ's too
            assert r.mma_sync_ops == 0, label
        # each score's exponential once: a tile held twice does every exponential twice (at
        # head dim 256 every spill-free dK/dV tile but one does: left as they were, unmeasured)
        assert r.head_dim == 256 or exponentials_per_score(r.mma_loop, r.config["bwd_block_q"], r.config["bwd_block_k"],
                                      r.config["bwd_num_warps"]) < 2, (label, r.mma_loop["ops"].get("MUFU"))


CANDIDATES = _candidate_specs()
# the tile withdrawn from the bulk candidates (test_the_withdrawn_bulk_tile_is_mis_assembled), with each release
WITHDRAWN_TILE = FlashConfig(bwd_block_q=16, bwd_block_k=128, bwd_num_warps=8, bwd_num_stages=1, bwd_dq_transposed=True)
WITHDRAWN = {release: [spec("bwd_fused_bulk", (9, 0), "bfloat16", 128, causal, WITHDRAWN_TILE, sass=True)
                       for causal in (False, True)] for release in ("pinned", "3.6")}
# the fused kernel beside lean's dK/dV kernel (test_fused_dq_tiles_are_added_without_a_multiply)
FUSED_AND_LEAN = [spec(k, (9, 0), "bfloat16", 128, False, FlashConfig(bwd_block_q=32, bwd_block_k=128, bwd_num_warps=8,
                                                                      bwd_num_stages=2), sass=True)
                  for k in ("bwd_fused_bulk", "bwd_dkdv_lean")]
# dQ built plain and transposed (test_transposed_dq_puts_every_product_on_wgmma)
PLAIN_AND_TRANSPOSED = [spec("bwd_fused_bulk", (9, 0), "bfloat16", 128, False,
                             FlashConfig(bwd_block_q=16, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=3,
                                         bwd_dq_transposed=t), sass=True) for t in (False, True)]
_ALL = CANDIDATES + WITHDRAWN["pinned"] + WITHDRAWN["3.6"] + FUSED_AND_LEAN + PLAIN_AND_TRANSPOSED
# what 3.6.0 compiles: the candidates for sm_90 (the GPU check's H200 runs 3.6.0) and the withdrawn tile
_FOR_36 = [s for s in CANDIDATES if s["capability"] == (9, 0)] + WITHDRAWN["3.6"]


@pytest.fixture(scope="module")
def compiled():
    """{id(spec): report or None (3.6.0 missing)} of every spec this file compiles, each once, by the release
    that runs it; one process a release, side by side."""
    found = each_once(compile_rungs, _ALL, lambda s: any(s is t for t in _FOR_36))
    return {id(s): r for s, (_, r) in zip(_ALL, found)}


def _reports(compiled, specs):
    found = [compiled[id(s)] for s in specs]
    if any(r is None for r in found):
        triton36_dir()  # skips (locally) or fails (CI) with the reason
    return found


def test_autotune_candidates_compile_for_ampere_with_pinned_triton(compiled):
    from importlib.metadata import version

    _check_candidates(_reports(compiled, [s for s in CANDIDATES if s["capability"] == (8, 0)]), version("triton"))


def test_autotune_candidates_compile_for_hopper_with_triton_36(compiled):
    reports = _reports(compiled, [s for s in CANDIDATES if s["capability"] == (9, 0)])
    assert {r.capability for r in reports} == {(9, 0)}
    _check_candidates(reports, "3.6.0")


def test_every_candidate_tile_is_compiled_for_ampere_at_least_as_deep():
    compiled = {(s["rung"], s["head_dim"], *(s["config"][k] for k in ("bwd_block_q", "bwd_block_k", "bwd_num_warps",
                                                                      "bwd_dq_transposed")), s["config"]["bwd_num_stages"])
                for s in CANDIDATES if s["capability"] == (8, 0)}
    for s in CANDIDATES:
        if s["capability"] == (9, 0) and not s["rung"].startswith("bwd_fused"):
            c = s["config"]
            shape = (s["rung"], s["head_dim"], c["bwd_block_q"], c["bwd_block_k"], c["bwd_num_warps"], c["bwd_dq_transposed"])
            assert any(got[:-1] == shape and got[-1] >= c["bwd_num_stages"] for got in compiled), shape


def test_only_16_bit_inputs_on_a_gpu_without_a_config_autotune(monkeypatch):
    from flashlib.ladder import autotune as op

    assert not op.autotunes(torch.float16, None)  # the interpreter cannot time kernels
    monkeypatch.setattr(op, "interpreting", lambda: False)  # as on a GPU
    assert op.autotunes(torch.float16, None) and op.autotunes(torch.bfloat16, None)
    assert not op.autotunes(torch.float32, None)  # candidates are sized for 16-bit tiles
    assert not op.autotunes(torch.bfloat16, FlashConfig())  # the caller fixed the tiles


def test_fused_dq_tiles_are_added_without_a_multiply(compiled):
    """The fused kernel scales dS in the loop by an FMA where dp - delta was a subtraction
    (delta arrives scaled), so the dq tile needs no multiply per element: read from the
    machine code for sm_90 (bf16, d 128, 32 x 128 tiles, 8 warps; one trip of the query loop),
    the loop spends exactly the multiplies of lean's dK/dV loop, and adds its dq tile by one
    bulk reduction."""
    with_dq, without = _reports(compiled, FUSED_AND_LEAN)
    assert with_dq.ok and without.ok, (with_dq.error, without.error)
    ops, base = with_dq.mma_loop["ops"], without.mma_loop["ops"]
    assert ops["FMUL"] == base["FMUL"] > 0, (ops["FMUL"], base["FMUL"])
    assert ops["HGMMA"] == base["HGMMA"] > 0
    assert ops.get("UTMAREDG", 0) == 1 and ops.get("REDG", 0) == 0


def test_the_withdrawn_bulk_tile_is_mis_assembled(compiled):
    """Why (16, 128, 8, 1) transposed left the bulk candidates at head dim 128: built for sm_90,
    some wgmma products of K^T dS^T take dS^T's shared-memory descriptor from kernel arguments
    (ptxas 12.8, which both releases ship: with Triton 3.6 when causal, sequence lengths; when
    not, with both, a stride), so on an H200 they read outside shared memory and fault. The
    candidate that stays, (16, 64, 4, 3), is built clean (the candidate tests above)."""
    assert (16, 128, 8, 1, True) not in rungs.BULK_TILES[128]
    reports = {"pinned": _reports(compiled, WITHDRAWN["pinned"])}
    if all(compiled[id(s)] is not None for s in WITHDRAWN["3.6"]):
        reports["3.6"] = _reports(compiled, WITHDRAWN["3.6"])
    for label, found in reports.items():
        assert all(r.ok for r in found), [r.error for r in found]
        assert found[0].wgmma_from_arguments, (label, "non-causal")  # HGMMA addresses in the machine code
    if "3.6" in reports:  # the GPU check's Triton: the causal kernel too, the one compute-sanitizer caught
        assert reports["3.6"][1].wgmma_from_arguments


@pytest.mark.parametrize("backward,transposed", [("bulk", True), ("bulk", False), ("tuned", True)])
def test_dq_is_read_back_from_the_layout_it_was_built_in(backward, transposed, monkeypatch):
    """bwd_dq_transposed takes the transposed path in the fused backward (and dq comes back
    in q's layout); the two-kernel backwards have no such tile."""
    from flashlib.ladder import backward as bf

    seen = []
    real = bf._dq_from
    monkeypatch.setattr(bf, "_dq_from", lambda buffer, q, t: seen.append((tuple(buffer.shape), t)) or real(buffer, q, t))
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 21, 24, generator=gen, requires_grad=True) for _ in range(3))
    cfg = _tiles(16, 16, dq_t=transposed)
    flash_attention(q, k, v, causal=True, config=cfg, backward=backward).sum().backward()
    # (B*H, seq rounded up to 16, d) float32, read as it is or transposed
    assert seen == ([] if backward == "tuned" else [((2, 32, 24), transposed)])
    assert q.grad.shape == q.shape and q.grad.is_contiguous()


def test_bulk_without_descriptors_runs_lean(monkeypatch):
    """Rows that are not multiples of 16 bytes (head dim 20 in float16) cannot be moved by
    descriptors: "bulk" then runs lean's two kernels, as its table row says."""
    from flashlib.ladder import backward as bf

    launched = []
    real = bf._launch
    monkeypatch.setattr(bf, "_launch", lambda chosen, role, *a: launched.append((chosen.name, role)) or
                        real(chosen, role, *a))
    gen = torch.Generator().manual_seed(8)
    for d, want in ((20, [("lean", "dkdv"), ("lean", "dq")]), (24, [("bulk", "fused")])):
        q, k, v = (torch.randn(1, 1, 19, d, generator=gen).half().requires_grad_() for _ in range(3))
        launched.clear()
        flash_attention(q, k, v, causal=True, config=_tiles(16, 16), backward="bulk").sum().backward()
        assert launched == want, d
    assert "lean" in rungs.backward("bulk").falls_back


def test_transposed_dq_puts_every_product_on_wgmma(compiled):
    """Machine code for sm_90 (bf16, d 128, 16 x 64 query-by-key tiles, 4 warps, one trip of the
    query loop): dQ = dS K on 16 query rows runs on mma.sync, its transpose on wgmma, with the
    same multiplies (none per dQ element) and one bulk reduction per tile either way."""
    plain, transposed = _reports(compiled, PLAIN_AND_TRANSPOSED)
    assert plain.ok and transposed.ok, (plain.error, transposed.error)
    a, b = plain.mma_loop["ops"], transposed.mma_loop["ops"]
    assert a.get("HMMA", 0) > 0 and b.get("HMMA", 0) == 0 and b["HGMMA"] > a["HGMMA"], (a, b)
    assert a["FMUL"] == b["FMUL"] and a["UTMAREDG"] == b["UTMAREDG"] == 1
    assert transposed.spill_stores == 0 and transposed.mma_sync_ops == 0


def test_four_warp_teaching_backward_holds_each_score_once_without_spills():
    """The benchmark's flashlib:4-warp-backward row: the teaching kernels on the tiles
    perf_bench.four_warp_backward gives, built for sm_90 (bf16, both masks, pinned Triton):
    no spills, each score's exponential once. (The shipped 64 x 64 on 8 warps holds them twice:
    tests/test_kernel_compile.py's ONCE_EXEMPT, checked with both releases.)"""
    from flashlib.bench.gpu import four_warp_backward
    from flashlib.kernels.compile import compile_kernels
    from flashlib.kernels.compile import spec as kernel_spec

    specs = []
    for d in (64, 128):
        cfg = four_warp_backward(torch.empty(1, 1, 16, d, dtype=torch.bfloat16))
        assert (cfg.bwd_block_q, cfg.bwd_block_k, cfg.bwd_num_warps) == (64, 64, 4)
        specs += [kernel_spec(k, (9, 0), "bfloat16", d, c, cfg, sass=True) for k in ("bwd_dkdv", "bwd_dq") for c in (False, True)]
        # the shipped tiles are these on 8 warps, 2 stages
        assert default_config(d, torch.bfloat16, (9, 0)) == FlashConfig(**{**cfg.__dict__, "bwd_num_warps": 8,
                                                                           "bwd_num_stages": 2})
    for r in compile_kernels(specs):
        c = r.config
        # the float64 lse's second half (lse_lo) costs dK/dV at d = 128 8 bytes of spill here (data/bench/LOG.md)
        allowed = 8 if (r.kernel, r.head_dim) == ("bwd_dkdv", 128) else 0
        assert r.ok and r.spill_stores <= allowed, (r.kernel, r.head_dim, r.causal, r.spill_stores, r.error)
        assert exponentials_per_score(r.mma_loop, c["bwd_block_q"], c["bwd_block_k"], c["bwd_num_warps"]) < 2
