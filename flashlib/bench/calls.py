"""The Python around a launch: microseconds per call, with compiled mask and score functions and
mask functions' block masks kept (:mod:`flashlib.kernels.tracememo`) and with them made again at
every call, side by side in one run; and a decoding plan's run (:class:`flashlib.DecodePlan`) beside
the bare launches of its kernels, their arguments made beforehand, and beside the one-call form.

A decoding step's kernel takes tens of microseconds on a GPU, so what the host does before the
launch (checks, options, tracing a score function and writing its kernel) can be most of a step.
On a CPU the interpreter's launch is replaced by a no-op while timing, so only the host's work
is counted (each case's output is first checked against dense attention with real launches); on a
GPU the launches run and are not waited for, the host's time per call as a model sees it.
``python -m flashlib bench calls`` writes ``data/bench/calls-DEVICE-DATE[THHMMZ].json``.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch

from .. import dense_attention, flash_attention, masks, scores
from ..decode import decode_attention, decode_reference
from ..kernels.tracememo import clear_all
from .cpu import provenance, write_result

SHAPE = dict(batch=1, heads=4, seq=128, head_dim=64)
DECODE = dict(batch=4, q_heads=8, kv_heads=2, capacity=256, length=100, head_dim=64)


def cases(device) -> dict:
    """{name: (call, reference)}: small shapes, so the host's work is what is timed."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SHAPE["batch"], SHAPE["heads"], SHAPE["seq"], SHAPE["head_dim"], generator=g).to(device)
               for _ in range(3))
    slopes = scores.alibi_slopes(SHAPE["heads"]).to(device)
    ids = (torch.arange(SHAPE["seq"]) // 32).to(device)  # a mask that reads a tensor: its values guarded each call
    prefill = dict(plain={}, softcap=dict(softcap=30.0), alibi=dict(score_mod=scores.alibi(slopes)),
                   window_mask=dict(mask_mod=masks.sliding_window(32)), document_mask=dict(mask_mod=masks.document(ids)))
    out = {f"flash_attention {name}": (lambda kw=kw: flash_attention(q, k, v, causal=True, **kw),
                                       lambda kw=kw: dense_attention(q, k, v, causal=True, **kw))
           for name, kw in prefill.items()}
    d = DECODE
    qd = torch.randn(d["batch"], d["q_heads"], 1, d["head_dim"], generator=g).to(device)
    kc, vc = (torch.randn(d["batch"], d["kv_heads"], d["capacity"], d["head_dim"], generator=g).to(device)
              for _ in range(2))
    lengths = torch.full((d["batch"],), d["length"], dtype=torch.int32, device=device)
    for name, kw in dict(plain={}, softcap=dict(softcap=30.0)).items():
        out[f"decode_attention {name}"] = (lambda kw=kw: decode_attention(qd, kc, vc, lengths, **kw),
                                           lambda kw=kw: decode_reference(qd, kc, vc, lengths, **kw))
    return out


@contextlib.contextmanager
def _host_only(device):
    """On a CPU, the interpreter's launches do nothing (the host's work is what is timed)."""
    if torch.device(device).type != "cpu":
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


def plan_cases(device) -> dict:
    """{name: (run, bare, one_call, reference)}: a plan's run, its kernels launched bare with the arguments
    run would give them (:meth:`flashlib.DecodePlan.bound`), the one-call form, and the reference."""
    from ..decode import CascadePlan, DecodePlan, cascade_attention, paged_cache

    g = torch.Generator().manual_seed(1)
    d = DECODE
    q = torch.randn(d["batch"], d["q_heads"], 1, d["head_dim"], generator=g).to(device)
    kc, vc = (torch.randn(d["batch"], d["kv_heads"], d["capacity"], d["head_dim"], generator=g).to(device)
              for _ in range(2))
    lengths = torch.full((d["batch"],), d["length"], dtype=torch.int32, device=device)
    k_pages, v_pages, table = paged_cache(kc, vc, 16, generator=torch.Generator().manual_seed(0))
    prefix = [torch.randn(d["kv_heads"], d["capacity"], d["head_dim"], generator=g).to(device) for _ in range(2)]
    calls = {"DecodePlan.run plain": ((q, kc, vc, lengths), {}, decode_attention),
             "DecodePlan.run paged": ((q, k_pages, v_pages, lengths, table), {}, decode_attention),
             "DecodePlan.run softcap=30": ((q, kc, vc, lengths), dict(softcap=30.0), decode_attention),
             "CascadePlan.run": ((q, *prefix, kc, vc, lengths), {}, cascade_attention)}
    out = {}
    for name, (args, kw, one_call) in calls.items():
        cascade = one_call is cascade_attention
        tensors = dict(zip(("q", "k_cache", "v_cache", "cache_seqlens", "block_table"), args)) if not cascade else {}
        plan = CascadePlan(*args, **kw) if cascade else DecodePlan(*args[:4], block_table=tensors.get("block_table"), **kw)
        launches = [(kernel[grid], a, k) for kernel, grid, a, k in plan.bound(*args)]

        def bare(launches=launches):
            for launch, a, k in launches:
                launch(*a, **k)
        call = (lambda args=args, kw=kw: cascade_attention(*args, **kw)) if cascade else (
            lambda tensors=tensors, kw=kw: decode_attention(**tensors, **kw))
        reference = (lambda args=args, kw=kw: cascade_attention(*args, reference=True, **kw)) if cascade else (
            lambda tensors=tensors, kw=kw: decode_reference(**tensors, **kw))
        out[name] = (lambda plan=plan, args=args: plan.run(*args), bare, call, reference)
    return out


def measure_runs(device="cpu", *, calls: int = 200, repeats: int = 7, clock=time.perf_counter, log=print) -> list:
    """Each plan case's median microseconds per call: run, the bare launches and the one-call form,
    interleaved; run's own work is run_us - bare_us."""
    rows = []
    for name, (run, bare, one_call, reference) in plan_cases(device).items():
        with torch.no_grad():
            err = (run().double() - reference().double()).abs().max().item()
        times = {"run": [], "bare": [], "call": []}
        with torch.no_grad(), _host_only(device):
            for _ in range(repeats):
                for key, fn in (("run", run), ("bare", bare), ("call", one_call)):
                    start = clock()
                    for _ in range(calls):
                        fn()
                    times[key].append((clock() - start) / calls * 1e6)
        row = dict(case=name, **{f"{key}_us": statistics.median(t) for key, t in times.items()}, max_error=err)
        row["run_over_bare_us"] = row["run_us"] - row["bare_us"]
        rows.append(row)
        log(format_runs(rows[-1:], header=len(rows) == 1))
    return rows


def measure(device="cpu", *, calls: int = 200, repeats: int = 7, clock=time.perf_counter, log=print) -> list:
    """Each case's median microseconds per call, kept and traced interleaved, and their ratio."""
    rows = []
    for name, (call, reference) in cases(device).items():
        with torch.no_grad():
            err = (call().double() - reference().double()).abs().max().item()
        kept, traced = [], []
        with torch.no_grad(), _host_only(device):
            call()
            for _ in range(repeats):
                for memo, times in ((True, kept), (False, traced)):
                    start = clock()
                    for _ in range(calls):
                        if not memo:
                            clear_all()  # every call traces, as before the memo
                        call()
                    times.append((clock() - start) / calls * 1e6)
        row = dict(case=name, kept_us=statistics.median(kept), traced_us=statistics.median(traced),
                   max_error=err)
        row["ratio"] = row["traced_us"] / row["kept_us"]
        rows.append(row)
        log(format_rows(rows[-1:], header=len(rows) == 1))
    return rows


def run_calls_bench(device=None, *, out_dir: Path | None = None, log=print, **kwargs) -> Path:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = measure(device, log=log, **kwargs)
    runs = measure_runs(device, log=log, **kwargs)
    where = "cpu" if torch.device(device).type == "cpu" else "gpu"
    result = dict(provenance(), kind=f"calls-{where}", device=str(device),
                  gpu=torch.cuda.get_device_name() if where == "gpu" else None,
                  shape=SHAPE, decode=DECODE, launches="not run (interpreter)" if where == "cpu" else "not awaited",
                  points=rows, runs=runs)
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())  # a run's own file: earlier runs of the day are kept
    return write_result(result, f"calls-{where}-{stamp}", out_dir)


def format_runs(rows, header: bool = True) -> str:
    lines = [f"{'case':28s} {'run µs':>7} {'bare µs':>8} {'run - bare':>11} {'one call µs':>12}"] if header else []
    lines += [f"{r['case']:28s} {r['run_us']:7.1f} {r['bare_us']:8.1f} {r['run_over_bare_us']:11.1f} {r['call_us']:12.0f}"
              for r in rows]
    return "\n".join(lines)


def format_rows(rows, header: bool = True) -> str:
    lines = [f"{'case':28s} {'kept µs':>8} {'traced µs':>10} {'ratio':>6}"] if header else []
    lines += [f"{r['case']:28s} {r['kept_us']:8.0f} {r['traced_us']:10.0f} {r['ratio']:5.2f}x" for r in rows]
    return "\n".join(lines)
