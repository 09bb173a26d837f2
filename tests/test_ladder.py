"""Every rung of the optimisation ladder: exact in the interpreter, and compiled for GPUs.

Interpreter: each rung's (out, lse) against float64 loops on small odd shapes, causal with
seq_q <, = and > seq_k (16-row tiles, so the unmasked and the masked key loops both run).
Compilation: each rung for sm_80 with the pinned Triton and for sm_90 with the pinned Triton
and Triton 3.6.0 (each spec with one of them), checking the rung table's declarations: where a
rung is declared to build, it compiles without spills, within shared memory, with tensor-core
instructions (and TMA copies for the "tma" and "lean" rungs on sm_90); where it is not, the
table says what runs instead.
"""
from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_versions import each_once, triton36_dir

from flashlib.kernels import triton_installed
from tests.reference import loop_attention

if not triton_installed():  # importing triton here first would keep its interpreter off
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from flashlib.ladder import compile as ladder_compile  # noqa: E402
from flashlib.ladder import rungs as ladder  # noqa: E402
from flashlib.ladder.forward import forward as rung_forward  # noqa: E402
from flashlib.kernels.compile import SHARED_LIMIT, exponentials_per_score  # noqa: E402
from flashlib.kernels.config import FlashConfig  # noqa: E402

PINNED = version("triton")

SMALL = FlashConfig(block_q=16, block_k=16)
# (batch*heads, seq_q, seq_k, head_dim, causal)
CASES = [(2, 37, 50, 24, True),    # seq_q < seq_k: the diagonal starts at key 13
         (1, 50, 37, 24, True),    # seq_q > seq_k: the first 13 queries see no key at all
         (1, 33, 33, 16, True),    # square, one ragged tile
         (1, 21, 45, 59, False)]   # odd head dim: padded to 64 and masked; rows not 16-byte multiples


def _reference(q, k, v, causal):
    outs, lses = zip(*(loop_attention(q[0, h], k[0, h], v[0, h], causal) for h in range(q.shape[1])))
    return torch.stack(outs)[None], torch.stack(lses)[None]


@pytest.mark.parametrize("name", [r.name for r in ladder.LADDER])
def test_rung_matches_float64_loops(name):
    rung = ladder.rung(name)
    gen = torch.Generator().manual_seed(0)
    for heads, seq_q, seq_k, d, causal in CASES:
        q = torch.randn(1, heads, seq_q, d, generator=gen)  # (B, H, N, D)
        k, v = (torch.randn(1, heads, seq_k, d, generator=gen) for _ in range(2))
        out, lse = rung_forward(q, k, v, rung=name, causal=causal, config=SMALL)
        ref_out, ref_lse = _reference(q, k, v, causal)
        case = (name, heads, seq_q, seq_k, d, causal)
        assert out.shape == q.shape and out.dtype == q.dtype, case
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4, msg=str(case))
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen), case  # -inf exactly where a row sees no key
        torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=2e-5, rtol=1e-5, msg=str(case))
        assert (out[~seen] == 0).all(), case


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from([r.name for r in ladder.LADDER]), seq_q=st.integers(1, 70), seq_k=st.integers(1, 70),
       d=st.sampled_from([8, 16, 20, 32]), causal=st.booleans(), bm=st.sampled_from([16, 32]),
       bn=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.float16]),
       seed=st.integers(0, 2**16))
def test_any_rung_shape_tiles_and_dtype(name, seq_q, seq_k, d, causal, bm, bn, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, seq_q, d, generator=gen).to(dtype)  # (B, H, N, D)
    k, v = (torch.randn(1, 1, seq_k, d, generator=gen).to(dtype) for _ in range(2))
    out, lse = rung_forward(q, k, v, rung=name, causal=causal, config=FlashConfig(block_q=bm, block_k=bn))
    ref_out, ref_lse = _reference(q.double(), k.double(), v.double(), causal)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, **tol)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], **tol)


@pytest.mark.parametrize("name", [r.name for r in ladder.LADDER])
def test_rung_default_tiles_half_precision(name):
    """Without a config: the shipped tiles (autotuning would need a GPU driver); float16 with
    a TMA-eligible head dim, within float16's rounding of the float64 answer."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 45, 32, generator=gen).half() for _ in range(3))
    out, lse = rung_forward(q, k, v, rung=name, causal=True)
    ref_out, ref_lse = _reference(q.double(), k.double(), v.double(), True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)


def test_tma_eligibility_follows_16_byte_rows():
    from flashlib.ladder.forward import tma_eligible

    def ok(d, dtype):
        return tma_eligible(torch.empty(2, 4, d, dtype=dtype))

    assert ok(24, torch.float32) and ok(24, torch.float16) and ok(128, torch.bfloat16)
    assert not ok(59, torch.float32) and not ok(20, torch.float16) and not ok(12, torch.bfloat16)
    wide = torch.empty(2, 4, 36, dtype=torch.float16)
    assert not tma_eligible(wide[..., :24])          # rows 72 bytes apart
    assert tma_eligible(wide[..., :24].float())      # the copy is contiguous: 96-byte rows
    shifted = torch.empty(2 * 4 * 24 + 1, dtype=torch.float16)[1:].view(2, 4, 24)
    assert not tma_eligible(shifted)                 # base 2 bytes off a 16-byte boundary
    repeated = torch.ones(1, 1, 16, dtype=torch.float16).expand(2, 4, 16)
    assert not tma_eligible(repeated)                # stride-0 rows: one row seen four times
    assert tma_eligible(torch.ones(1, 4, 16, dtype=torch.float16).expand(3, 4, 16))  # shared (B*H): fine


def test_autotune_candidates_follow_the_head_dim():
    """Each autotuned rung times the candidates of its table row for the launch's padded head dim."""
    from flashlib.ladder import autotune
    from flashlib.ladder import forward as ff

    for r in ladder.LADDER:
        if not r.tiles:
            continue
        kernel, _, variant = ff.variant(r, descriptors=True)
        tuner = autotune.tuner(kernel, variant, 4096, r.tiles)
        for pad, table in ((16, 64), (64, 64), (128, 128), (256, 256)):
            got = tuner.early_config_prune(tuner.configs, {}, HEAD_DIM_PAD=pad)
            assert [(c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in got] == \
                list(r.tiles[table]), (r.name, pad)


def test_sequence_buckets():
    from flashlib.kernels.config import seq_bucket

    assert [seq_bucket(n, n) for n in (1, 512, 1024, 1025, 3000, 4096, 16384, 100000)] == \
        [1024, 1024, 1024, 2048, 4096, 4096, 16384, 16384]
    assert seq_bucket(100, 5000) == seq_bucket(5000, 100) == 8192  # the longer side decides


def test_autotuners_keep_one_choice_per_bucket_and_report_it():
    """Each (variant, bucket) has its own autotuner over one kernel; autotuned_choice finds what
    the one for q's length kept (filed by hand here, as the autotuner does on a GPU)."""
    from flashlib.ladder import autotune
    from flashlib.ladder import forward as ff

    def tuner_of(name, bucket):
        kernel, _, variant = ff.variant(ladder.rung(name), descriptors=True)
        return autotune.tuner(kernel, variant, bucket, ladder.rung(name).tiles)

    assert tuner_of("tma", 4096) is tuner_of("tma", 4096) and tuner_of("tma", 4096) is not tuner_of("tma", 8192)
    assert tuner_of("tma", 4096) is not tuner_of("lean", 4096)  # one kernel, another fold
    q = torch.empty(1, 1, 3000, 128, dtype=torch.bfloat16)
    tuner = tuner_of("lean", 4096)
    assert ff.autotuned_choice(q, True, "lean") is None
    key = (128, True, "tf32", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16",
           "torch.float32")
    config = tuner.configs[1]
    tuner.cache[key] = config
    try:
        assert ff.autotuned_choice(q, True, "lean") == dict(config.kwargs, num_warps=config.num_warps,
                                                            num_stages=config.num_stages)
        assert ff.autotuned_choice(q, True, "lean", seq=8192) is None  # another bucket
        assert ff.autotuned_choice(q, False, "lean") is None and ff.autotuned_choice(q.half(), True, "lean") is None
        assert ff.autotuned_choice(q, True, "tma") is None  # another rung
    finally:
        del tuner.cache[key]


@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
@pytest.mark.parametrize("name", ["causal-split", "tma", "lean", "lazy-rescale"])
def test_any_finite_scale(name, scale):
    """Rungs 4 and 5 scale the max of the raw scores, which is only right for scale > 0;
    other scales must take rung 3's fold, not give a wrong answer."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    out, lse = rung_forward(q, k, v, rung=name, causal=True, scale=scale, config=SMALL)
    ref_out, ref_lse = zip(*(loop_attention(q[0, h], k[0, h], v[0, h], True, scale=scale) for h in range(2)))
    torch.testing.assert_close(out[0].double(), torch.stack(ref_out), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse[0].double(), torch.stack(ref_lse), atol=2e-5, rtol=1e-5)


def test_bad_rung_and_empty_inputs():
    from flashlib.ladder.forward import forward

    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="'rung'.*'fast'"):
        forward(q, q, q, rung="fast")
    with pytest.raises(ValueError, match="'name'"):
        ladder.rung("fastest")
    out, lse = forward(q, q[..., :0, :], q[..., :0, :], rung="tma")
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (1, 1, 4)


def test_table_lists_every_rung_in_order():
    rows = ladder.table()
    assert [r["rung"] for r in rows] == list(range(len(ladder.LADDER)))
    assert [r["name"] for r in rows] == ["teaching", "autotuned", "causal-split", "tma", "lean", "lazy-rescale"]
    assert all(r["change"] and r["why"] for r in rows)


# ----- compilation -------------------------------------------------------------------------


# Every kernel this file compiles, each once, by one release, in one module fixture (one process a release,
# side by side): the rungs (the table's declarations), rung 1's candidates, rungs 2 to 5's candidates and the
# machine code of rungs 3 to 5. Triton 3.6.0 comes with torch 2.11, on the GPU check's H200 (sm_90); the pinned
# Triton runs on any GPU. So sm_80 is the pinned Triton's, and sm_90's kernels are spread over both releases.


def _rung_specs():
    """[(spec, release)]: each rung but "autotuned" (the teaching kernel with other tiles: its tiles are
    compiled below) on each target where the table declares it builds: bf16 at head dim 128 causal, fp16 at
    64 without the mask; on sm_90 also bf16 at 256 (the widest head, smallest tiles). On sm_90 the pinned
    Triton compiles the first, 3.6.0 the other two; on sm_80 the pinned Triton both."""
    rows = []
    for r in ladder.LADDER:
        if r.name == "autotuned":
            continue
        for cc in ladder.TARGETS:
            if cc == (8, 0) and not r.supports(PINNED, cc):
                continue  # rungs 3 to 5 run rung 2's kernel there: compiled with their changes below (sm_80)
            rows += [(ladder_compile.spec(r.name, cc, "bfloat16", 128, True), "pinned"),
                     (ladder_compile.spec(r.name, cc, "float16", 64, False), "pinned" if cc == (8, 0) else "3.6")]
        rows.append((ladder_compile.spec(r.name, (9, 0), "bfloat16", 256, True), "3.6"))
    return rows


def _candidate_configs(d):
    return [FlashConfig(block_q=bm, block_k=bn, num_warps=w, num_stages=s)
            for bm, bn, w, s in ladder.candidates(ladder.FORWARD_TILES, d)]


# rung 1's candidates for sm_90 at head dims 64, 128 and 256 (test_autotune_candidates_compile_for_hopper)
AUTOTUNED = [ladder_compile.spec("autotuned", (9, 0), "float16", d, False, cfg, sass=True) for d in (64, 128, 256)
             for cfg in _candidate_configs(d)]
# rungs 2 to 5's candidates, each once per target with the Triton that runs it: sm_90's with 3.6.0 (the H200's),
# sm_80's (A100: no TMA) with the pinned Triton
FAST = [ladder_compile.spec(name, (9, 0), "bfloat16", d, True, cfg, sass=True)
        for name in ("causal-split", "tma", "lean", "lazy-rescale") for d in (64, 128) for cfg in _candidate_configs(d)]
FAST += [ladder_compile.spec(name, (8, 0), "bfloat16", 128, True, cfg)
         for name in ("causal-split", "lean", "lazy-rescale") for cfg in _candidate_configs(128)]
# the machine code of rungs 3 to 5 on 64 x 64 tiles, 4 warps (128 threads, 32 scores each), with 3.6.0: the
# causal kernels are FAST's
MACHINE_CODE_TILES = FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)


def _machine_code_spec(name, causal):
    return ladder_compile.spec(name, (9, 0), "bfloat16", 128, causal, MACHINE_CODE_TILES, sass=True)


def _all_specs():
    """[(spec, release)], each distinct one once."""
    rows = _rung_specs() + [(s, "pinned") for s in AUTOTUNED]
    rows += [(s, "3.6" if s["capability"] == (9, 0) else "pinned") for s in FAST]
    rows += [(_machine_code_spec(name, False), "3.6") for name in ("tma", "lean", "lazy-rescale")]
    unique = []
    for row in rows:
        if row not in unique:
            unique.append(row)
    return unique


ALL = _all_specs()


@pytest.fixture(scope="module")
def compiled():
    """[(spec, release, report or None where 3.6.0 is missing)] of ALL."""
    specs = [s for s, _ in ALL]
    for_36 = [s for s, release in ALL if release == "3.6"]
    found = each_once(ladder_compile.compile_rungs, specs, lambda s: any(s is t for t in for_36), label36="3.6")
    return [(s, release, r) for (s, release), (_, r) in zip(ALL, found)]


def _reports(compiled, specs=None, release=None):
    """The reports of these specs (or of every spec of a release), in order; skips or fails without 3.6.0."""
    if specs is None:
        found = [r for _, got, r in compiled if got == release]
    else:
        found = [next(r for s, _, r in compiled if s == wanted) for wanted in specs]
    if any(r is None for r in found):
        triton36_dir()  # skips (locally) or fails (CI) with the reason
    return found


def _check_declarations(reports, version):
    assert reports and all(rep.triton_version == version for rep in reports)
    for rep in reports:
        label = (rep.rung, rep.capability, rep.dtype, rep.head_dim, version)
        assert ladder.rung(rep.rung).supports(version, rep.capability), label
        assert rep.ok, (label, rep.error)
        assert rep.spill_stores == 0 and rep.spill_loads == 0, label
        assert rep.shared <= SHARED_LIMIT[rep.capability], label
        if rep.capability >= (9, 0):
            assert rep.wgmma_ops > 0, label
        else:
            assert rep.mma_sync_ops > 0, label
        assert (rep.bulk_copy_ops > 0) == _descriptors(rep), label


def _descriptors(rep) -> bool:
    """Whether the rung's kernel moves its tiles by descriptors on the report's target."""
    return ladder.rung(rep.rung).kernel == ladder.TMA_FORWARD and rep.capability >= (9, 0)


def _rung_reports(compiled, release):
    rung_specs = [s for s, got in _rung_specs() if got == release]
    return _reports(compiled, rung_specs)


def test_rungs_compile_with_pinned_triton(compiled):
    reports = _rung_reports(compiled, "pinned")
    _check_declarations(reports, PINNED)
    built = {(rep.rung, rep.capability) for rep in reports}
    for r in ladder.LADDER:
        for cc in ladder.TARGETS:
            if r.name != "autotuned" and (r.name, cc) not in built:
                # a rung that does not run its own kernel here must say what runs instead
                assert not r.supports(PINNED, cc) and r.falls_back, (r.name, cc)


def test_rungs_compile_with_triton_36(compiled):
    reports = _rung_reports(compiled, "3.6")
    _check_declarations(reports, "3.6.0")
    assert {(rep.rung, rep.capability) for rep in reports} == {(r.name, (9, 0)) for r in ladder.LADDER
                                                               if r.name != "autotuned"}


def test_each_release_compiles_every_rung_for_hopper_causal_and_not():
    got = {(s["rung"], s["causal"], release) for s, release in _rung_specs() if s["capability"] == (9, 0)}
    assert got == {(r.name, causal, release) for r in ladder.LADDER if r.name != "autotuned"
                   for causal, release in ((True, "pinned"), (False, "3.6"), (True, "3.6"))}


def test_autotune_candidates_compile_for_hopper(compiled):
    """Every tile rung 1 may pick builds for sm_90 at head dims 64, 128 and 256 within shared
    memory (a candidate that spills is merely slow: the autotuner times it and moves on)."""
    reports = _reports(compiled, AUTOTUNED)
    for rep in reports:
        assert rep.ok, (rep.config, rep.error)
        assert rep.shared <= SHARED_LIMIT[(9, 0)], rep.config
        assert rep.wgmma_ops + rep.mma_sync_ops > 0, rep.config
        assert rep.wgmma_from_arguments == [], rep.config  # descriptors from shared addresses only
        cfg = rep.config  # each score's exponential once (a tile held twice does each twice)
        assert exponentials_per_score(rep.mma_loop, cfg["block_q"], cfg["block_k"], cfg["num_warps"]) < 2, \
            (cfg, rep.mma_loop["ops"].get("MUFU"))


@pytest.mark.parametrize("which", ["pinned", "3.6.0"])
def test_fast_rung_autotune_candidates_compile(which, compiled):
    """Rungs 2 to 5 autotune over the same candidates: each builds for sm_90 at head dims 64
    and 128 without spills, within shared memory, with wgmma (and bulk copies from rung 3 on);
    rungs 2, 4 and 5 also for sm_80 within its shared memory (rungs 4 and 5 there: rung 2's
    kernel with their changes, as forward() runs them without a copy engine)."""
    hopper = which == "3.6.0"
    reports = _reports(compiled, [s for s in FAST if (s["capability"] == (9, 0)) == hopper])
    assert reports and {rep.triton_version for rep in reports} == {which if hopper else PINNED}
    for rep in reports:
        label = (rep.rung, rep.capability, rep.head_dim, rep.config["block_q"], rep.config["block_k"],
                 rep.triton_version)
        assert rep.ok, (label, rep.error)
        assert rep.shared <= SHARED_LIMIT[rep.capability], label
        if rep.capability == (8, 0):  # a spill there only makes a candidate slower: the autotuner times it
            assert rep.mma_sync_ops > 0 and rep.bulk_copy_ops == 0, label
            continue
        assert rep.spill_stores == 0, label
        assert rep.wgmma_ops > 0 and (rep.bulk_copy_ops > 0) == _descriptors(rep), label
        assert rep.wgmma_from_arguments == [], label  # descriptors from shared addresses only
        assert exponentials_per_score(rep.mma_loop, rep.config["block_q"], rep.config["block_k"],
                                      rep.config["num_warps"]) < 2, (label, rep.mma_loop["ops"].get("MUFU"))


@pytest.mark.parametrize("name,kernel", [("teaching", "_attn_fwd"), ("autotuned", "_attn_fwd"),
                                         ("causal-split", "_attn_fwd_split"), ("tma", "_attn_fwd_tma"),
                                         ("lean", "_attn_fwd_tma"), ("lazy-rescale", "_attn_fwd_tma")])
def test_each_rung_launches_exactly_one_forward_kernel(name, kernel, monkeypatch):
    """A rung that launched a second kernel after its own would still return the right
    answer, and the benchmark would time both: count every kernel launch."""
    from flashlib.ladder import forward as ff

    launched = []
    launcher = type(ff._attn_fwd_tma)
    real = launcher.run
    monkeypatch.setattr(launcher, "run", lambda self, *a, **kw: (launched.append(self.fn.__name__),
                                                                 real(self, *a, **kw))[1])
    q = torch.randn(1, 1, 20, 16)  # rows of 64 bytes: descriptors can move them
    ff.forward(q, q, q, causal=True, rung=name, config=SMALL)
    assert launched == [kernel]


def _machine_code(compiled, *names, causal=False):
    reports = _reports(compiled, [_machine_code_spec(name, causal) for name in names])
    assert all(rep.ok for rep in reports), [rep.error for rep in reports]
    return [rep.mma_loop for rep in reports]


@pytest.mark.parametrize("causal", [False, True])
def test_lean_rung_spends_fewer_instructions_per_score(causal, compiled):
    """Rung 4's claim, read from the machine code for sm_90: in the unmasked key loop, the
    same exponentials and matrix instructions as rung 3, and at least one instruction fewer
    per score of a tile (64 x 64 scores over 128 threads: 32 each)."""
    tma, lean = _machine_code(compiled, "tma", "lean", causal=causal)
    for op in ("MUFU", "HGMMA"):
        assert lean["ops"][op] == tma["ops"][op] > 0, op
    assert lean["body"] <= tma["body"] - 32, (tma["body"], lean["body"])
    # 32 multiplies fewer, one more per row for the scaled max (each thread holds parts of 2 rows)
    assert lean["ops"]["FMUL"] <= tma["ops"]["FMUL"] - 32 + 2, (tma["ops"]["FMUL"], lean["ops"]["FMUL"])
    assert tma["skippable"] == lean["skippable"] == {}  # straight-line loops


def test_lazy_rung_can_skip_the_rescale(compiled):
    """Rung 5's claim: its unmasked loop can jump over the rescale (64 x 128 accumulator
    elements over 128 threads: 64 multiplies each), so a trip that skips it executes at
    least 32 instructions fewer than rung 4's, the block-wide test included."""
    lean, lazy = _machine_code(compiled, "lean", "lazy-rescale")
    assert lazy["skippable"].get("FMUL", 0) >= 64, lazy["skippable"]
    assert lazy["short"] <= lean["body"] - 32, (lean["body"], lazy["short"])
    assert lazy["ops"]["HGMMA"] == lean["ops"]["HGMMA"]


def test_lazy_rescale_exact_when_row_maxima_keep_growing():
    """Rung 5 skips the rescale while no row's max has grown by more than 2^8 since its last
    one. Keys whose norms grow along the sequence make the maxima jump mid-row (rescales
    taken), creep (references left stale, then caught up) or stay (rescales skipped); the
    answer must be float64's in every case, in both loop orders' tiles."""
    gen = torch.Generator().manual_seed(7)
    for growth in (0.0, 0.05, 0.6):
        q = torch.randn(1, 2, 40, 16, generator=gen)
        k = torch.randn(1, 2, 150, 16, generator=gen) * (1 + growth * torch.arange(150.0))[:, None]
        v = torch.randn(1, 2, 150, 16, generator=gen)
        for causal in (False, True):
            out, lse = rung_forward(q, k, v, rung="lazy-rescale", causal=causal, config=SMALL)
            ref_out, ref_lse = _reference(q, k, v, causal)
            torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4, msg=str((growth, causal)))
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5, msg=str((growth, causal)))
