"""Plan once, run many: flashlib.DecodePlan and flashlib.decode.CascadePlan.

A plan's run against the float64 reference step after step (new values, same layout), its refusals of
another layout, and what run calls: with every PyTorch allocation, host read and synchronisation made
to fail and the interpreter's launches recorded instead of run, it launches the two kernels (three for
a cascade) and nothing else. Cascade decoding with its prefix's keys split across programs and its
stacked rows in several query blocks against decoding over the concatenated cache.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import threading

import pytest
import torch

import flashlib
from flashlib import decode

if importlib.util.find_spec("triton") is None:  # the kernels need Triton (Linux only)
    pytest.skip("Triton ships Linux wheels only", allow_module_level=True)

from tests.test_decode import as64, case  # noqa: E402

# what a run must not call: allocations, reads of a value on the host, synchronisation
FORBIDDEN_TORCH = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                   "full_like", "tensor", "as_tensor", "arange", "cat", "stack", "where")
FORBIDDEN_TENSOR = ("item", "tolist", "numpy", "cpu", "to", "contiguous", "clone", "new_empty", "new_zeros",
                    "new_full", "__bool__", "__int__", "__float__", "__index__", "any", "all", "nonzero")


@contextlib.contextmanager
def launches_only():
    """Inside: the interpreter's launches are recorded, not run, and every call in FORBIDDEN_* raises.
    Yields the list of (kernel name, grid, tensors passed) launched."""
    from triton.runtime.interpreter import InterpretedFunction

    launched = []

    def flat(a):  # a bundle of arguments (tuples in tuples), element by element
        return [x for item in a for x in flat(item)] if isinstance(a, tuple) else [a]

    def record(self, *args, grid, warmup, **kwargs):
        given = flat((*args, *kwargs.values()))
        launched.append((self.fn.__name__, grid, [a for a in given if isinstance(a, torch.Tensor)]))

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"run called {name}")
        return fail

    patches = [(torch, name) for name in FORBIDDEN_TORCH] + [(torch.Tensor, name) for name in FORBIDDEN_TENSOR]
    patches += [(torch.cuda, "synchronize"), (InterpretedFunction, "run")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    try:
        for owner, name in patches[:-1]:
            setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
        InterpretedFunction.run = record
        yield launched
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def step(q, k, v, lengths, seed):
    """New values in place, the layout kept: new queries, new cached keys, each sequence one longer."""
    g = torch.Generator().manual_seed(seed)
    q.copy_(torch.randn(q.shape, generator=g))
    k.copy_(torch.randn(k.shape, generator=g))
    v.copy_(torch.randn(v.shape, generator=g))
    lengths.add_(1)


@pytest.mark.parametrize("paged", [False, True])
def test_a_plan_runs_step_after_step_as_the_reference(paged):
    q, k, v, lengths = case(batch=3, q_heads=6, kv_heads=2, new_tokens=2, capacity=40, lengths=[20, 2, 31])
    options = dict(softcap=5.0, window=(9, 0), sinks=torch.tensor([0.3, -1.0, 0.0, 2.0, 0.5, 1.0]))
    table = None
    if paged:  # the caches' values live in pages: step() changes them there
        k, v, table = decode.paged_cache(k, v, 8, spare_pages=3, generator=torch.Generator().manual_seed(0))
    plan = flashlib.DecodePlan(q, k, v, lengths, block_table=table, num_splits=3, **options)
    for seed in range(3):
        want, want_lse = decode.decode_reference(*as64(q, k, v), lengths, block_table=table, return_lse=True, **options)
        out, lse = plan.run(q, k, v, lengths, table, return_lse=True)
        assert out is plan.out and lse is plan.lse  # the plan's buffers, overwritten by the next run
        torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-6)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=5e-6)
        step(q, k, v, lengths, seed)
    kept = torch.empty_like(plan.out)
    assert plan.run(q, k, v, lengths, table, out=kept) is kept
    torch.testing.assert_close(kept.double(), decode.decode_reference(*as64(q, k, v), lengths, block_table=table,
                                                                      **options), rtol=0, atol=5e-6)


@pytest.mark.parametrize("paged", [False, True])
def test_run_only_launches(paged):
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40)
    table = None
    if paged:
        k, v, table = decode.paged_cache(k, v, 8, generator=torch.Generator().manual_seed(0))
    plan = flashlib.DecodePlan(q, k, v, lengths, block_table=table, softcap=10.0, num_splits=2)
    out = torch.empty_like(plan.out)
    with torch.no_grad(), launches_only() as launched:
        plan.run(q, k, v, lengths, table)
        plan.run(q, k, v, lengths, table, out=out, return_lse=True)
    assert [(name, grid) for name, grid, _ in launched] == [("_decode_split", (1, 2, 4)), ("_decode_merge", (4, 1))] * 2
    # the step's tensors reach the kernels in place, not copied
    given = {t.data_ptr() for t in (q, k, v, lengths, table, out) if t is not None}
    assert given <= {t.data_ptr() for _, _, tensors in launched for t in tensors}


def test_run_refuses_another_layout_naming_the_argument():
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40)
    plan = flashlib.DecodePlan(q, k, v, lengths)
    refusals = {
        "k_cache": (q, k[:, :, :32], v, lengths),  # another capacity
        "q": (q.half(), k, v, lengths),
        "v_cache": (q, k, v.transpose(2, 3).contiguous().transpose(2, 3), lengths),  # other strides
        "cache_seqlens": (q, k, v, lengths[:1]),
    }
    for name, args in refusals.items():
        with pytest.raises(ValueError, match=f"DecodePlan.run: argument '{name}' has .*make a DecodePlan"):
            plan.run(*args)
    with pytest.raises(ValueError, match="'out'"):
        plan.run(q, k, v, lengths, out=torch.empty(2, 4, 1, 8))
    with pytest.raises(ValueError, match="'q' .* requiring grad"):
        plan.run(q.clone().requires_grad_(), k, v, lengths)


def test_a_plan_checks_its_call_and_a_step_on_request():
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40, lengths=[5, 40])
    with pytest.raises(ValueError, match="DecodePlan: argument 'cache_seqlens' gives sequence 1 41"):
        flashlib.DecodePlan(q, k, v, lengths + 1)
    with pytest.raises(ValueError, match="DecodePlan: argument 'k_cache' has strides .* pass k_cache.contiguous"):
        flashlib.DecodePlan(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, lengths)
    plan = flashlib.DecodePlan(q, k, v, lengths)
    plan.check(lengths)
    with pytest.raises(ValueError, match="'cache_seqlens' gives sequence 1 41 positions"):
        plan.check(lengths + 1)
    k_pages, v_pages, table = decode.paged_cache(k, v, 8, generator=torch.Generator().manual_seed(0))
    paged = flashlib.DecodePlan(q, k_pages, v_pages, lengths, block_table=table)
    with pytest.raises(ValueError, match="'block_table' sends page 0 of sequence 0 to 99"):
        paged.check(lengths, table.index_fill(1, torch.tensor([0]), 99))


def test_a_score_function_read_by_position_must_cover_the_capacity():
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40, lengths=[5, 12])
    short = torch.randn(16)  # a bias per key position, shorter than the capacity
    bias = lambda score, b, h, q_idx, kv_idx: score + short[kv_idx]  # noqa: E731
    torch.testing.assert_close(flashlib.decode_attention(q, k, v, lengths, score_mod=bias).double(),
                               decode.decode_reference(*as64(q, k, v), lengths, score_mod=bias), rtol=0, atol=5e-6)
    with pytest.raises(ValueError, match="DecodePlan.*score_mod"):  # a plan serves every length up to 40
        flashlib.DecodePlan(q, k, v, lengths, score_mod=bias)
    whole = torch.randn(40)
    plan = flashlib.DecodePlan(q, k, v, lengths, score_mod=lambda score, b, h, q_idx, kv_idx: score + whole[kv_idx])
    whole.mul_(3)  # read at every run, as the kernels load it
    torch.testing.assert_close(plan.run(q, k, v, lengths).double(), decode.decode_reference(
        *as64(q, k, v), lengths, score_mod=lambda score, b, h, q_idx, kv_idx: score + whole[kv_idx]), rtol=0, atol=5e-6)


def test_empty_batches_plan_and_run():
    q, k, v, _ = case(batch=2, new_tokens=1)
    plan = flashlib.DecodePlan(q[:0], k[:0], v[:0], torch.zeros(0, dtype=torch.int32))
    assert plan.run(q[:0], k[:0], v[:0], torch.zeros(0, dtype=torch.int32)).shape == (0, 4, 1, 16)
    assert plan.launch_shape is None


def test_a_q_that_no_view_stacks_is_copied_into_the_plans_buffer():
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=3, capacity=40)
    odd = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads not stride-compatible with new tokens
    plan = flashlib.DecodePlan(odd, k, v, lengths)
    with torch.no_grad(), launches_only() as launched:
        plan.run(odd, k, v, lengths)
    assert [name for name, _, _ in launched] == ["_decode_split", "_decode_merge"]  # the copy is no allocation
    torch.testing.assert_close(plan.run(odd, k, v, lengths).double(), decode.decode_reference(*as64(q, k, v), lengths),
                               rtol=0, atol=5e-6)


# ----- cascade: the prefix's keys split across programs ---------------------------------------------

def _concatenated(prefix_k, prefix_v, k_cache, v_cache):
    batch = k_cache.shape[0]
    return [torch.cat((p[None].expand(batch, -1, -1, -1), c), dim=2) for p, c in ((prefix_k, k_cache),
                                                                                    (prefix_v, v_cache))]


@pytest.mark.parametrize("batch, heads, kv_heads, n, prefix_splits", [(3, 4, 2, 2, 1), (3, 4, 2, 2, 4),
                                                                     (9, 8, 2, 2, 3), (5, 2, 2, 1, 9)])
def test_cascade_with_the_prefix_split_equals_decoding_over_the_concatenated_cache(batch, heads, kv_heads, n,
                                                                                   prefix_splits):
    # (9, 8, 2, 2): 72 stacked rows per kv head, two query blocks of 64; 9 splits of a 70-key prefix: some empty
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, heads, n, 16, generator=g)
    pk, pv = (torch.randn(kv_heads, 70, 16, generator=g) for _ in range(2))
    kc, vc = (torch.randn(batch, kv_heads, 20, 16, generator=g) for _ in range(2))
    lengths = torch.randint(n, 21, (batch,), generator=g, dtype=torch.int32)
    sinks = torch.randn(heads, generator=g)
    full_k, full_v = _concatenated(pk, pv, kc, vc)
    want, want_lse = decode.decode_reference(*as64(q, full_k, full_v), lengths + 70, softcap=4.0, sinks=sinks,
                                             return_lse=True)
    plan = decode.CascadePlan(q, pk, pv, kc, vc, lengths, softcap=4.0, sinks=sinks, prefix_splits=prefix_splits,
                              num_splits=2)
    assert plan.launch_shapes["prefix"].num_splits == min(prefix_splits, 3)  # 70 keys: three tiles of 32
    assert plan.launch_shapes["prefix"].split_grid[0] == -(-batch * heads // kv_heads * n // 64)
    out, lse = plan.run(q, pk, pv, kc, vc, lengths, return_lse=True)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=5e-6)


def test_a_cascade_run_only_launches():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 1, 16, generator=g)
    pk, pv = (torch.randn(2, 50, 16, generator=g) for _ in range(2))
    kc, vc = (torch.randn(4, 2, 20, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([20, 3, 9, 14], dtype=torch.int32)
    k_pages, v_pages, table = decode.paged_cache(kc, vc, 4, generator=torch.Generator().manual_seed(1))
    plan = decode.CascadePlan(q, pk, pv, k_pages, v_pages, lengths, block_table=table, prefix_splits=2)
    with torch.no_grad(), launches_only() as launched:
        plan.run(q, pk, pv, k_pages, v_pages, lengths, table)
    assert [(name, grid) for name, grid, _ in launched] == [
        ("_decode_split", (1, 2, 2)),  # the prefix: 8 stacked rows in one block, two splits, per kv head
        ("_decode_split", (1, 1, 8)), ("_decode_merge", (8, 1))]
    with pytest.raises(ValueError, match="CascadePlan.run: argument 'prefix_k'"):
        plan.run(q, pk[:, :40], pv, k_pages, v_pages, lengths, table)
    full_k, full_v = _concatenated(pk, pv, kc, vc)
    torch.testing.assert_close(plan.run(q, pk, pv, k_pages, v_pages, lengths, table).double(),
                               decode.decode_reference(*as64(q, full_k, full_v), lengths + 50), rtol=0, atol=5e-6)


# ----- what a plan reads at every run: every value its docstring says it reads -------------------------

def pairwise(q, k, v, lengths, *, score_mod=None, sinks=None):
    """Decoding in float64 from the definition, one (sequence, head, new token, key) pair at a time: query i
    of a sequence of length L sits at L - n + i and sees keys 0..L - n + i; score_mod(score, b, h, q_idx,
    kv_idx) on each scaled score; a head's sink adds e^sink to the softmax's denominator."""
    batch, heads, n, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                pos = int(lengths[b]) - n + i
                s = []
                for j in range(pos + 1):
                    score = (q[b, h, i].double() @ k[b, h // group, j].double()) / math.sqrt(d)
                    if score_mod is not None:
                        score = score_mod(score, torch.tensor(b), torch.tensor(h), torch.tensor(pos),
                                          torch.tensor(j)).double()
                    s.append(score)
                s = torch.stack(s)
                m = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
                weights = torch.exp(s - m)
                denominator = weights.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - m))
                out[b, h, i] = (weights[:, None] * v[b, h // group, :pos + 1].double()).sum(0) / denominator
    return out


def test_a_plan_reads_an_int64_tensor_its_score_function_reads_at_every_run():
    """Document ids as a data loader gives them (int64): the kernel reads an int32 copy, made again at
    every run, so that ids written in place between runs are seen."""
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40, lengths=[30, 40])
    docs = torch.zeros(40, dtype=torch.int64)

    def same_document(score, b, h, q_idx, kv_idx):
        return score + 1.5 * (docs[kv_idx] == docs[q_idx]).float()

    plan = flashlib.DecodePlan(q, k, v, lengths, score_mod=same_document)
    for write in (lambda: None, lambda: docs[:10].fill_(1), lambda: docs.copy_(torch.arange(40) // 7),
                  lambda: docs.data.mul_(3)):
        write()
        plan.check(lengths)
        torch.testing.assert_close(plan.run(q, k, v, lengths).double(),
                                   pairwise(q, k, v, lengths, score_mod=same_document), rtol=0, atol=5e-6)


def test_a_plan_refuses_at_check_what_its_kernel_was_not_written_for():
    """Integer values past int32 need another kernel (int64 arithmetic): check() says so; new values the
    same kernel serves are accepted."""
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40, lengths=[30, 40])
    docs = torch.arange(40) // 10
    plan = flashlib.DecodePlan(q, k, v, lengths, score_mod=lambda s, b, h, q_idx, kv_idx: s + docs[kv_idx] * 0.5)
    docs[:5] = 100
    plan.check(lengths)
    docs[:5] = 2 ** 40
    with pytest.raises(ValueError, match="DecodePlan: argument 'score_mod' reads a torch.int64 tensor of shape "
                                         r"\(40,\) whose values now need another kernel .*make a new DecodePlan"):
        plan.check(lengths)


@pytest.mark.parametrize("kind", ["float64", "float16", "strided", "float32"])
def test_sinks_of_any_dtype_and_strides_are_read_at_every_run(kind):
    """Sinks changed in place between runs (an optimizer's step, load_state_dict) are seen by a DecodePlan and
    a CascadePlan whatever their dtype and strides."""
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=2, capacity=40, lengths=[23, 40])
    g = torch.Generator().manual_seed(5)
    base = torch.randn(8, generator=g)
    sinks = {"float64": base[:4].double(), "float16": base[:4].half(), "strided": base[::2],
             "float32": base[:4].clone()}[kind]
    prefix_k, prefix_v = (torch.randn(2, 12, 16, generator=g) for _ in range(2))
    full_k, full_v = _concatenated(prefix_k, prefix_v, k, v)
    plan = flashlib.DecodePlan(q, k, v, lengths, sinks=sinks)
    cascade = decode.CascadePlan(q, prefix_k, prefix_v, k, v, lengths, sinks=sinks)
    optimizer = torch.optim.SGD([sinks.requires_grad_()], lr=1.0)
    for step in range(3):
        torch.testing.assert_close(plan.run(q, k, v, lengths).double(), pairwise(q, k, v, lengths, sinks=sinks),
                                   rtol=0, atol=5e-6)
        torch.testing.assert_close(cascade.run(q, prefix_k, prefix_v, k, v, lengths).double(),
                                   pairwise(q, full_k, full_v, lengths + 12, sinks=sinks), rtol=0, atol=5e-6)
        if step == 0:  # a training step: the gradient of a loss through the sinks, then the optimizer's
            (sinks.double() * torch.arange(4.0, dtype=torch.float64)).sum().backward()
            optimizer.step()
        else:  # a checkpoint loaded in place
            torch.nn.Module.load_state_dict(_holding(sinks), {"sinks": torch.randn(4, generator=g)})


def _holding(sinks):
    module = torch.nn.Module()
    module.register_buffer("sinks", sinks.detach(), persistent=True)
    return module


def test_the_copies_a_run_makes_go_into_the_plans_own_buffers():
    """An int64 tensor a score function reads and float64 sinks: each run copies them into the same buffers
    of the plan's and launches the two kernels, nothing else (no allocation: a CUDA graph can capture it)."""
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=1, capacity=40)
    docs = torch.arange(40) // 8
    sinks = torch.zeros(4, dtype=torch.float64)
    plan = flashlib.DecodePlan(q, k, v, lengths, sinks=sinks,
                               score_mod=lambda s, b, h, q_idx, kv_idx: s + (docs[q_idx] == docs[kv_idx]).float())
    with torch.no_grad(), launches_only() as launched:
        plan.run(q, k, v, lengths)
        plan.run(q, k, v, lengths)
    assert [name for name, _, _ in launched] == ["_decode_split", "_decode_merge"] * 2
    first, second = ([t.data_ptr() for t in tensors] for _, _, tensors in launched[:3:2])
    assert first == second  # the same buffers at every run
    copies = [t for t in launched[0][2] if t.dtype == torch.int32 and t.shape == docs.shape]
    assert len(copies) == 1 and docs.data_ptr() not in first  # the ids as an int32 copy
    read = [t for name, _, tensors in launched if name == "_decode_merge" for t in tensors if t.shape == sinks.shape]
    assert [t.dtype for t in read] == [torch.float32] * 2 and read[0].data_ptr() == read[1].data_ptr()  # a copy


def test_threads_share_a_plan_each_with_its_own_out():
    """One plan, four threads, each decoding its own queries into its own ``out``: every answer is its own
    (runs take turns; without that, a run's merge would read another run's partial results)."""
    q, k, v, lengths = case(batch=2, q_heads=4, kv_heads=2, new_tokens=2, capacity=40, lengths=[33, 40])
    plan = flashlib.DecodePlan(q, k, v, lengths, num_splits=3)
    queries = [torch.randn(q.shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    failures = []

    def worker(mine):
        out = torch.empty_like(plan.out)
        for _ in range(4):
            got = plan.run(mine, k, v, lengths, out=out)
            error = (got.double() - pairwise(mine, k, v, lengths)).abs().max().item()
            if error > 5e-6:
                failures.append(error)

    threads = [threading.Thread(target=worker, args=(mine,)) for mine in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_the_package_exports_the_plan():
    assert flashlib.DecodePlan is decode.DecodePlan and "DecodePlan" in flashlib.__all__


# ----- the host's time: a run beside its bare launches (flashlib.bench.calls) --------------------------

def test_the_calls_benchmark_times_a_run_beside_its_bare_launches():
    from flashlib.bench import calls

    rows = calls.measure_runs("cpu", calls=3, repeats=1, log=lambda *_: None)
    assert [r["case"] for r in rows] == list(calls.plan_cases("cpu"))
    for r in rows:
        assert r["max_error"] < 1e-5, r  # real launches, against the reference
        assert r["run_over_bare_us"] == r["run_us"] - r["bare_us"] and r["call_us"] > 0


def test_the_recorded_runs_cost_at_most_ten_microseconds_over_their_launches():
    from flashlib.bench import records

    run = records.latest("calls-cpu", with_key="runs")
    assert run is not None, "python -m flashlib bench calls records the host's time per call"
    assert {r["case"] for r in run["runs"]} >= {"DecodePlan.run plain", "DecodePlan.run paged", "CascadePlan.run"}
    for r in run["runs"]:
        assert r["run_over_bare_us"] <= 10, r  # what a plan's run adds to the launches themselves, on this CPU
        assert r["run_us"] * 5 < r["call_us"], r  # the one-call form: checks, trace and plan at every call
