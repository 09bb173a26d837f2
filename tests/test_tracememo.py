"""The memo of traced mask and score functions: a second call with nothing changed traces nothing, and
every change to what the function reads, however it is made, gives the fresh answer: a number
rebound, a tensor written in place, through numpy's view of it or through ``.data`` (which PyTorch's
version counter does not see), a config class's attribute, a module global a staticmethod reads, a
submodule's attribute. The kernels are compared with flex_attention and float64 dense attention on the
function as it is now. Memory stays bounded over 10,000 distinct captured numbers, and the memo keeps
no tensor alive."""
from __future__ import annotations

import gc
import importlib
import json
import linecache
import math
import operator
import sys
import tracemalloc
import warnings
import weakref

import numpy as np

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import flashlib
from flashlib import masks, scores
from flashlib.kernels import attention, function, maskfn, scorefn, tracememo
from flashlib.kernels.maskfn import compile_mask, symbol_bounds
from flashlib.kernels.scorefn import compile_score, score_bounds

from .test_flex import _flex, _inputs


@pytest.fixture
def traces(monkeypatch):
    """How many times the mask and score functions were traced, from here on."""
    count = {"mask": 0, "score": 0, "block mask": 0}

    def counting(kind, real):
        def traced(*args, **kwargs):
            count[kind] += 1
            return real(*args, **kwargs)
        return traced

    monkeypatch.setattr(maskfn, "trace", counting("mask", maskfn.trace))
    monkeypatch.setattr(scorefn, "trace_score", counting("score", scorefn.trace_score))
    monkeypatch.setattr(function, "block_mask", counting("block mask", function.block_mask))
    tracememo.clear_all()
    return count


def test_the_same_function_is_traced_once(traces):
    first = compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 64))
    again = compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 64))  # a new closure, same reads
    assert traces["score"] == 1 and again.jit is first.jit and again.data == first.data
    compile_score("t", scores.softcap(31.0), "cpu", score_bounds(1, 2, 64, 64))
    compile_score("t", scores.softcap(30.0), "cpu", score_bounds(1, 2, 64, 4096))  # other bounds
    assert traces["score"] == 3
    for _ in range(2):
        compile_mask("t", masks.sliding_window(8), "cpu", symbol_bounds(1, 2, 64, 64))
    assert traces["mask"] == 1


def test_a_float_tensor_changed_in_place_is_read_by_the_kernel_without_a_new_trace(traces):
    """A float tensor's values never shape the kernel (it reads them at launch): a training step's update of
    a bias table, however it is written, traces nothing and the kernel gives the new answer."""
    q, k, v = _inputs(24, 24)
    slopes = scores.alibi_slopes(4)
    alibi = scores.alibi(slopes)
    for write in (lambda: None, lambda: slopes.mul_(2), lambda: slopes.data.add_(0.5),
                  lambda: slopes.numpy().__imul__(-1)):
        write()
        want = flashlib.dense_attention(q.double(), k.double(), v.double(), score_mod=scores.alibi(slopes.double()))
        torch.testing.assert_close(flashlib.flash_attention(q, k, v, score_mod=alibi).double(), want,
                                   atol=2e-6, rtol=2e-5)
    assert traces["score"] == 2  # once for the kernel, once for the tensors autograd differentiates


def test_an_integer_tensor_is_traced_again_when_its_bounds_change(traces):
    """The kernel depends on an integer tensor's values through their bounds alone (int32 or int64
    arithmetic, which indices need guards): new values within them trace nothing, new bounds trace again."""
    table, index = torch.randn(40), torch.arange(40)

    def by_index(score, b, h, q_idx, kv_idx):
        return score + table[index[kv_idx]]

    bounds = score_bounds(1, 2, 40, 40)
    compile_score("t", by_index, "cpu", bounds)
    index.numpy()[:] = np.random.default_rng(0).permutation(40)  # other values, the same bounds 0..39
    assert "_index_offset" not in compile_score("t", by_index, "cpu", bounds).source and traces["score"] == 1
    index.numpy()[:] -= 40  # negative: the kernel must count from the end, as PyTorch does
    assert "_index_offset" in compile_score("t", by_index, "cpu", bounds).source and traces["score"] == 2


def test_the_kernels_follow_every_change_of_what_a_function_reads(traces):
    q, k, v = _inputs(40, 40)
    width = 3

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    document_id = torch.arange(40) // 7
    doc = masks.document(document_id)
    for step in range(3):
        for mask_mod in (near, doc):
            torch.testing.assert_close(attention(q, k, v, mask_mod=mask_mod), _flex(q, k, v, mask_mod)[0],
                                       atol=2e-6, rtol=2e-5, msg=lambda m: f"step {step}: {m}")
        width += 4  # a closure's number rebound
        document_id.copy_(torch.arange(40) // (5 + 6 * step) + 2**40 * step)  # values past int32: new bounds
    assert traces["mask"] == 6 and traces["block mask"] == 6


def test_a_mask_functions_block_mask_is_evaluated_once(traces):
    q, k, v = _inputs(64, 64)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    for _ in range(3):
        attention(q, k, v, mask_mod=masks.sliding_window(9)).sum().backward()
    assert traces["block mask"] == 1 and traces["mask"] == 1  # the backward tiles as the forward does here


class Window:
    """A mask function read through an object's attribute: such a read cannot be keyed."""

    def __init__(self, size):
        self.size = size

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.size)


def test_what_cannot_be_keyed_is_traced_at_every_call(traces):
    q, k, v = _inputs(40, 40)
    window = Window(2)
    attribute = lambda b, h, q_idx, kv_idx: window(b, h, q_idx, kv_idx)  # noqa: E731
    assert tracememo.reads(window) is None and tracememo.reads(attribute) is None
    for size in (2, 9):
        window.size = size
        torch.testing.assert_close(attention(q, k, v, mask_mod=attribute), _flex(q, k, v, attribute)[0],
                                   atol=2e-6, rtol=2e-5)
    assert traces["mask"] >= 2


def test_an_inference_tensor_is_keyed_and_its_values_guarded(traces):
    """An inference tensor keeps no version; its values are guarded as any tensor's are."""
    q, k, v = _inputs(40, 40)
    with torch.inference_mode():
        ids = torch.arange(40) // 9
    doc = masks.document(ids)
    assert tracememo.reads(doc) is not None
    for step in range(2):
        torch.testing.assert_close(attention(q, k, v, mask_mod=doc), _flex(q, k, v, doc)[0], atol=2e-6, rtol=2e-5)
        with torch.inference_mode():
            ids.copy_(torch.arange(40) // 4)
    assert traces["block mask"] == 2


# ----- values written where PyTorch does not see them, and reads the key follows --------------------

def _dense(q, k, v, **options):
    return flashlib.dense_attention(q.double(), k.double(), v.double(), **options).float()


def _fresh(run, q, k, v, **options):
    """run(q, k, v, **options) equals float64 dense attention on the functions as they are now."""
    torch.testing.assert_close(run(q, k, v, **options), _dense(q, k, v, **options), atol=3e-6, rtol=3e-5)


def test_a_numpy_fed_batch_of_document_ids_gives_the_fresh_mask(traces):
    """A data loader's batch: one numpy buffer behind torch.from_numpy, refilled in numpy for each batch.
    Each step's block mask and kernel follow the new ids (flex_attention and dense attention agree)."""
    q, k, v = _inputs(48, 48)
    rng = np.random.default_rng(0)
    buffer = np.zeros(48, dtype=np.int64)
    ids = torch.from_numpy(buffer)
    doc = masks.document(ids)
    for _ in range(4):
        buffer[:] = np.sort(rng.integers(0, 5, size=48))  # the next batch's documents, written in numpy
        out = flashlib.flash_attention(q, k, v, mask_mod=doc)
        torch.testing.assert_close(out, _flex(q, k, v, doc)[0], atol=3e-6, rtol=3e-5)
        torch.testing.assert_close(out, _dense(q, k, v, mask_mod=doc), atol=3e-6, rtol=3e-5)
    assert traces["block mask"] == 4


def test_writes_through_data_give_the_fresh_answer():
    """``.data`` shares the storage but not the version counter: a mask's ids and a score function's index
    tensor rewritten that way (made negative: PyTorch counts from the end) give the fresh answer."""
    q, k, v = _inputs(40, 40)
    ids = torch.arange(40) // 8
    doc = masks.document(ids)
    table, index = torch.randn(40), torch.arange(40)

    def by_index(score, b, h, q_idx, kv_idx):
        return score + table[index[kv_idx]]

    for step in range(3):
        _fresh(flashlib.flash_attention, q, k, v, mask_mod=doc)
        _fresh(flashlib.flash_attention, q, k, v, score_mod=by_index)
        ids.data[:] = torch.arange(40) // (3 + step)
        index.data[:] = -torch.arange(1, 41) if step == 0 else torch.arange(40).flip(0)


class Settings:
    """A config class used as a namespace."""

    window = 2


WINDOW = 3


class Rules:
    @staticmethod
    def window():
        return WINDOW  # a module global, read by a staticmethod


def by_class(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= Settings.window)


def by_staticmethod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= Rules.window())


def test_a_config_class_and_a_staticmethods_global_are_read_afresh(monkeypatch):
    q, k, v = _inputs(40, 40)
    for size in (2, 7, 2):
        monkeypatch.setattr(Settings, "window", size)
        monkeypatch.setattr(f"{__name__}.WINDOW", size + 1)
        _fresh(flashlib.flash_attention, q, k, v, mask_mod=by_class)
        _fresh(flashlib.flash_attention, q, k, v, mask_mod=by_staticmethod)
        temperature = lambda s, b, h, q_idx, kv_idx: s * (Settings.window / 4)  # noqa: E731
        _fresh(flashlib.flash_attention, q, k, v, score_mod=temperature)


def test_a_submodules_attribute_is_read_afresh(tmp_path, monkeypatch):
    """pkg.settings.WINDOW: a module global that is a package, whose submodule holds the number."""
    package = tmp_path / "memo_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import settings\n")
    (package / "settings.py").write_text("WINDOW = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = importlib.import_module("memo_pkg")
    scope = {"pkg": pkg}
    exec("def windowed(b, h, q_idx, kv_idx):\n"  # noqa: S102  (a function whose global is the package)
         "    return (q_idx >= kv_idx) & (q_idx - kv_idx <= pkg.settings.WINDOW)\n", scope)
    q, k, v = _inputs(40, 40)
    for size in (2, 11, 5):
        monkeypatch.setattr(pkg.settings, "WINDOW", size)
        _fresh(flashlib.flash_attention, q, k, v, mask_mod=scope["windowed"])


# ----- a module or class read by the code it is handed to ----------------------------------------------

def pairwise(q, k, v, mask_mod=None, score_mod=None):
    """Attention in float64 from the definition, one (batch, head, query, key) pair at a time: the score
    q.k / sqrt(d), score_mod(score, b, h, i, j) on it, mask_mod(b, h, i, j) deciding whether it is seen."""
    batch, heads, n, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, h, i in np.ndindex(batch, heads, n):
        index = [torch.tensor(x) for x in (b, h, i)]
        scores, seen = [], []
        for j in range(k.shape[2]):
            if mask_mod is not None and not bool(mask_mod(*index[:2], index[2], torch.tensor(j))):
                continue
            score = q[b, h, i].double() @ k[b, h // group, j].double() / math.sqrt(d)
            scores.append(score if score_mod is None else score_mod(score, *index, torch.tensor(j)).double())
            seen.append(j)
        if seen:
            p = torch.softmax(torch.stack(scores), 0)
            out[b, h, i] = (p[:, None] * v[b, h // group, seen].double()).sum(0)
    return out


def _flex_score(q, k, v, score_mod):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on a CPU warns that it is unfused
        return flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)


def _right(q, k, v, *, mask_mod=None, score_mod=None):
    """flash_attention (the kernels, through the memo) equals float64 attention pair by pair and flex_attention
    on the functions as they are now."""
    got = flashlib.flash_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    torch.testing.assert_close(got.double(), pairwise(q, k, v, mask_mod, score_mod), atol=3e-6, rtol=3e-5)
    flex = _flex(q, k, v, mask_mod)[0] if mask_mod is not None else _flex_score(q, k, v, score_mod)
    torch.testing.assert_close(got, flex, atol=3e-6, rtol=3e-5)


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """A config module, as a project keeps one: settings.WINDOW and settings.TEMPERATURE."""
    (tmp_path / "memo_settings.py").write_text("WINDOW = 2\nTEMPERATURE = 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("memo_settings")
    yield module
    sys.modules.pop("memo_settings", None)


def near(cfg, q_idx, kv_idx):
    """A helper handed the config (a module or a class): it reads cfg.WINDOW, its caller does not."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= cfg.WINDOW)


def scaled(cfg, score):
    return score * cfg.TEMPERATURE


class Named:
    """A config class whose attributes a function reads by a name it holds elsewhere."""

    WINDOW = 2
    OTHER = 9


NAME = "WINDOW"


def test_a_config_module_handed_to_a_helper_is_read_afresh(settings, monkeypatch):
    q, k, v = _inputs(16, 16)

    def windowed(b, h, q_idx, kv_idx):
        return near(settings, q_idx, kv_idx)

    def tempered(score, b, h, q_idx, kv_idx):
        return scaled(settings, score)

    for window, temperature in ((2, 0.5), (9, 2.0), (2, 0.5)):
        monkeypatch.setattr(settings, "WINDOW", window)
        monkeypatch.setattr(settings, "TEMPERATURE", temperature)
        _right(q, k, v, mask_mod=windowed)
        _right(q, k, v, score_mod=tempered)


def test_a_config_class_passed_on_from_a_closure_is_read_afresh(monkeypatch):
    q, k, v = _inputs(16, 16)

    def make(cfg):
        def windowed(b, h, q_idx, kv_idx):
            return near(cfg, q_idx, kv_idx)
        return windowed

    mask = make(Named)
    for window in (2, 11, 4):
        monkeypatch.setattr(Named, "WINDOW", window)
        _right(q, k, v, mask_mod=mask)


def test_an_attribute_read_by_a_computed_name_is_read_afresh(monkeypatch):
    """getattr, vars and __dict__ with a name held in a global: a new value, or a new name, gives the fresh
    answer (the name is known only when the function runs: it is traced at every call)."""
    q, k, v = _inputs(16, 16)
    readers = {
        "getattr": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= getattr(Named, NAME)),
        "vars": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= vars(Named)[NAME]),
        "__dict__": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= Named.__dict__[NAME]),
    }
    for name, window in (("WINDOW", 2), ("WINDOW", 7), ("OTHER", 9), ("WINDOW", 2)):
        monkeypatch.setattr(f"{__name__}.NAME", name)
        monkeypatch.setattr(Named, "WINDOW", window)
        for reader in readers.values():
            _right(q, k, v, mask_mod=reader)


def test_a_name_written_in_the_code_keeps_its_trace(traces, monkeypatch):
    """getattr(Named, "WINDOW"), vars(Named)["WINDOW"]: the name is in the code, so the memo keys the
    attribute and traces once while it is unchanged, and again when it changes."""
    q, k, v = _inputs(16, 16)

    def by_getattr(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= getattr(Named, "WINDOW"))

    for window in (2, 2, 5, 5):
        monkeypatch.setattr(Named, "WINDOW", window)
        _right(q, k, v, mask_mod=by_getattr)
    assert traces["mask"] == 2


@pytest.mark.parametrize("keyed, body", [
    (True, 'getattr(Named, "WINDOW")'), (True, 'getattr(Named, "WINDOW", 3)'), (True, 'vars(Named)["WINDOW"]'),
    (True, 'Named.__dict__["WINDOW"]'), (True, 'getattr(Named, "WIN" "DOW")'),
    (False, "getattr(Named, NAME)"), (False, "getattr(Named, NAME.upper())"), (False, 'getattr(Named, f"{NAME}")'),
    (False, 'getattr(Named, "WINDOW" if NAME else "OTHER")'), (False, "vars(Named)[NAME]"),
    (False, 'vars(Named).get("WINDOW")'), (False, "Named.__dict__[NAME]"), (False, "hasattr(Named, NAME) * 2"),
    (False, 'operator.attrgetter("WINDOW")(Named)'), (False, "reader(Named, NAME)"),
])
def test_a_name_is_keyed_where_the_code_writes_it_and_traced_afresh_where_it_computes_it(keyed, body):
    scope = {"Named": Named, "NAME": NAME, "operator": operator, "reader": getattr}
    exec(f"def windowed(b, h, q_idx, kv_idx):\n    return q_idx - kv_idx <= {body}\n", scope)  # noqa: S102
    assert (tracememo.reads(scope["windowed"]) is not None) == keyed


def test_reading_a_captured_tensor_leaves_it_resizable():
    """The memo reads an integer tensor's bounds and a mask's tensors' digest without a numpy view of them
    (which would make their storage unresizable for the rest of the process)."""
    q, k, v = _inputs(24, 24)
    ids = torch.arange(24) // 5
    table, index = torch.randn(24), torch.arange(24)
    flashlib.flash_attention(q, k, v, mask_mod=masks.document(ids))
    flashlib.flash_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[index[kv_idx]])
    for t in (ids, table, index):
        t.resize_(2 * 24)
        assert t.shape == (48,)


def test_a_trace_that_reads_a_captured_tensor_in_python_is_not_kept(traces):
    """lengths[0] read in Python makes a number of the trace from the tensor's value: such a trace is made
    again at every call (nothing could guard every value it may depend on)."""
    q, k, v = _inputs(40, 40)
    lengths = torch.tensor([5, 9])

    def first_length(b, h, q_idx, kv_idx):
        return kv_idx < int(lengths[0])

    for value in (5, 30):
        lengths.numpy()[0] = value
        _fresh(flashlib.flash_attention, q, k, v, mask_mod=first_length)
    assert traces["mask"] == 2


# ----- memory: numbers are launch arguments, one source per code, everything bounded ---------------

def test_an_annealing_schedule_of_10000_temperatures_stays_within_the_memory_bound(traces):
    """A temperature that changes at every call writes one source (the number is given at launch), so
    one compiled function; what the memo keeps stays within its 256 entries, linecache does not grow,
    and 9,000 more temperatures after the first 1,000 add under 256 KiB (traced memory)."""
    bounds = score_bounds(1, 2, 64, 64)

    def annealed(t):
        return lambda score, b, h, q_idx, kv_idx: score * t

    temperatures = torch.linspace(0.05, 3.0, 10_000).tolist()
    first = compile_score("t", annealed(temperatures[0]), "cpu", bounds)
    lines, sources = len(linecache.cache), len(maskfn._COMPILED)
    tracemalloc.start()
    try:
        for i, t in enumerate(temperatures):
            kernel = compile_score("t", annealed(t), "cpu", bounds)
            assert kernel.jit is first.jit and kernel.data == (t,)
            if i == 999:
                gc.collect()
                settled = tracemalloc.get_traced_memory()[0]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - settled
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, grown
    assert len(linecache.cache) == lines and len(maskfn._COMPILED) == sources
    assert len(maskfn.MEMO) <= maskfn.MEMO.size and traces["score"] == 10_000
    q, k, v = _inputs(24, 24)
    for t in temperatures[::3333]:  # real calls: the same kernel, each temperature's answer
        _fresh(flashlib.flash_attention, q, k, v, score_mod=annealed(t))


def test_compiled_sources_past_the_limit_drop_their_linecache_entries(monkeypatch):
    """Sources that differ (here by their code) are kept up to _MAX_COMPILED; those dropped take their
    linecache entry and the interpreter's rewrite of them along."""
    from triton.runtime.interpreter import InterpretedFunction

    def generated():  # (linecache entries, interpreter rewrites) of generated functions
        return (sum(name.startswith("<flashlib ") for name in linecache.cache),
                sum(fn.__globals__.get("__name__") == "flashlib.kernels.maskfn.generated"
                    for fn in InterpretedFunction.rewritten_fn))

    monkeypatch.setattr(maskfn, "_MAX_COMPILED", 4)
    q, k, v = _inputs(16, 16)
    _fresh(attention, q, k, v, mask_mod=masks.causal)
    before = generated()
    for shift in range(12):
        scope = {}
        exec(f"def near(b, h, q_idx, kv_idx):\n    return q_idx - kv_idx <= {shift}\n", scope)  # noqa: S102
        _fresh(attention, q, k, v, mask_mod=scope["near"])
    assert len(maskfn._COMPILED) <= 4 and all(after <= 4 for after in generated()), (before, generated())


def test_the_memo_keeps_no_tensor_alive(traces):
    ids = torch.arange(4096) // 100
    table = torch.randn(2 * 64 - 1)
    compile_mask("t", masks.document(ids), "cpu")
    compile_score("t", scores.relative_bias(table), "cpu", score_bounds(1, 1, 64, 64))
    alive = [weakref.ref(ids), weakref.ref(table)]
    del ids, table
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_a_new_tensor_at_a_dead_ones_address_is_traced_again(monkeypatch):
    """The key holds a tensor's id; if it died and a new tensor took its address, the weak reference
    the entry kept tells them apart (forced here: both calls see the same key)."""
    memo = tracememo.TraceMemo()
    old, new = torch.arange(4), torch.arange(4)
    reads = iter([(("same key",), [old]), (("same key",), [new]), (("same key",), [new])])
    monkeypatch.setattr(tracememo, "reads", lambda fn: next(reads))
    built = []

    def build(t):
        return lambda: (built.append(t) or "kernel", [t])

    assert memo.get(None, (), build(old)) == ("kernel", (old,))
    del old
    gc.collect()
    assert memo.get(None, (), build(new)) == ("kernel", (new,)) and len(built) == 2
    assert memo.get(None, (), build(new))[1][0] is new and len(built) == 2  # kept now, with the new tensor


def test_softcap_calls_trace_once_through_every_op(traces):
    q, k, v = _inputs(24, 24)
    for _ in range(3):
        out = flashlib.flash_attention(q, k, v, softcap=20.0)
    torch.testing.assert_close(out, flashlib.dense_attention(q.double(), k.double(), v.double(), softcap=20.0).float(),
                               atol=2e-6, rtol=2e-5)
    assert traces["score"] <= 2  # the forward's kernel, and the captured tensors (none) asked once


def test_the_calls_benchmark_checks_each_case_and_restores_the_launches(tmp_path):
    from triton.runtime.interpreter import InterpretedFunction

    from flashlib.bench import calls

    run = InterpretedFunction.run
    path = calls.run_calls_bench("cpu", out_dir=tmp_path, log=lambda *_: None, calls=2, repeats=1)
    assert InterpretedFunction.run is run
    result = json.loads(path.read_text())
    assert [p["case"] for p in result["points"]] == list(calls.cases("cpu"))
    for point in result["points"]:
        assert point["max_error"] < 1e-5, point  # real launches, against dense attention and decode_reference
        assert point["kept_us"] > 0 and point["traced_us"] > 0


def test_a_weighed_memo_keeps_within_its_budget():
    memo = tracememo.TraceMemo(size=10, weigh=len, budget=10)
    built = []

    def get(fn, kept):
        return memo.get(fn, (), lambda: (built.append(kept) or kept, []))[0]

    first, second, big = (lambda b, h, q, k: q >= k), (lambda b, h, q, k: q > k), (lambda b, h, q, k: q < k)
    get(first, "abcdef"), get(first, "abcdef")
    assert built == ["abcdef"]  # kept
    get(second, "ghijkl")  # 12 bytes in all: the least recent goes
    get(second, "ghijkl"), get(first, "abcdef")
    assert built == ["abcdef", "ghijkl", "abcdef"]
    get(big, "x" * 11), get(big, "x" * 11)  # heavier than the whole budget: never kept
    assert built[-2:] == ["x" * 11] * 2
