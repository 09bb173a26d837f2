"""Measuring one grid point of the ladder benchmark: every method's time, spread and peak memory.

The timers (``triton.testing.do_bench`` medians with their 20th and 80th percentiles) and
the peak-memory probe are the GPU's; a test passes stand-ins and runs the same steps on a
CPU through Triton's interpreter. After any error the point asks whether the device still
works: a kernel fault (an illegal address, say) leaves the process unable to run anything on
the GPU, and the point then raises :class:`DeviceLost` so that the run can stop there.
"""
from __future__ import annotations

import torch

from ..roofline import attention_flops, tflops
from ..kernels._mode import half_dtype
from .methods import is_ours, sdpa

# do_bench's warm-up and repetition windows, in milliseconds: short enough that the grid fits
# the GPU check's budget, long enough for hundreds of repetitions of a short kernel (a long
# one repeats only a few times, but each of its runs is long)
WARMUP_MS, REP_MS = 5, 25
# the backends tried, in order, for the reference each forward rung's output is checked against
REFERENCE_BACKENDS = ("flash", "efficient", "cudnn")


def shape(n: int, d: int, tokens: int = 16384, hidden: int = 2048) -> tuple[int, int]:
    """(batch, heads) of a point's tensors: batch * N = tokens and heads * d = hidden (at least
    1 each), as FlashAttention's own benchmarks hold them, so every point moves the same number
    of tokens."""
    return max(1, tokens // n), max(1, hidden // d)


def bench_ms(fn, warmup: int = WARMUP_MS, rep: int = REP_MS) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_spread(fn, warmup: int = WARMUP_MS, rep: int = REP_MS) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) of the times in ms: the spread says how far apart two
    medians must be before their order means anything."""
    import triton

    median, low, high = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return float(median), float(low), float(high)


def peak_bytes(fn) -> int:
    """Bytes allocated at the peak of one call, beyond what was allocated before it: everything
    the call allocates and holds at that moment, its gradients included. A call that frees
    what an earlier call left (``fn.clear``: the gradients of the previous step) would free it
    inside the window and lower the peak by that much, so it is cleared before the window."""
    clear = getattr(fn, "clear", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def measure_ceilings(device="cuda", dtype=None) -> dict:
    """The device's 16-bit matmul rate (8192³) and copy bandwidth (1 GiB), measured now. dtype:
    the matmul's, by default bfloat16 (float16 on a GPU without bfloat16 tensor cores, such as
    a T4); the rate is stored as ``bf16_matmul_tflops`` or ``fp16_matmul_tflops``."""
    if dtype is None:
        dtype = half_dtype(device) if torch.device(device).type == "cuda" else torch.bfloat16
    n = 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_ms = bench_ms(lambda: a @ b, warmup=25, rep=100)
    del a, b
    x = torch.empty(2**28, device=device, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = bench_ms(lambda: y.copy_(x), warmup=25, rep=100)
    nbytes = 2 * x.numel() * x.element_size()  # read once, write once
    del x, y
    return {MATMUL_KEYS[dtype]: tflops(2.0 * n ** 3, matmul_ms), "matmul_shape": [n, n, n],
            "copy_gbps": nbytes / (copy_ms * 1e-3) / 1e9, "copy_bytes": nbytes}


MATMUL_KEYS = {torch.bfloat16: "bf16_matmul_tflops", torch.float16: "fp16_matmul_tflops"}


def matmul_ceiling(ceilings: dict) -> tuple[float, str]:
    """(TFLOP/s, "bf16" or "fp16"): the matmul rate a run's ceilings hold, bfloat16's where both."""
    for key in ("bf16_matmul_tflops", "fp16_matmul_tflops"):
        if key in ceilings:
            return ceilings[key], key[:4]
    raise KeyError(f"ceilings hold no matmul rate (one of {sorted(MATMUL_KEYS.values())}): {sorted(ceilings)}")


class DeviceLost(RuntimeError):
    """A method left the GPU unusable for this process (a sticky CUDA error, such as an illegal
    address): nothing more can run here. ``row`` is the method's error row at ``point``."""

    def __init__(self, method: str, point: dict, row: dict):
        super().__init__(f"{method} left the device unusable at {point}: {row.get('error')}")
        self.method, self.point, self.row = method, point, row


def device_usable(device="cuda") -> bool:
    """After an error: can this process still run anything on the device? An out-of-memory
    error leaves it usable; a kernel fault does not (every later CUDA call fails too)."""
    if torch.device(device).type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


def math_fits(batch, heads, n, mode, device="cuda") -> bool:
    """The math backend keeps N x N scores and probabilities (float32 inside): does it fit?"""
    if torch.device(device).type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    # float32 N x N buffers alive at once: about 2.3 in a forward on an H200 (torch 2.11); 3 and 5
    # leave a margin, and an out-of-memory error would only cost the point's time
    need = batch * heads * n * n * 4 * (3 if mode == "fwd" else 5)
    return need < 0.8 * free


def error_text(exc: BaseException) -> str:
    """'Type: first line of the message' (at most 200 characters of it), for a result row."""
    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {message}"


def _reference(q, k, v, causal):
    """The first SDPA backend's forward output that runs here, in float32; None if none does."""
    for backend in REFERENCE_BACKENDS:
        try:
            return sdpa(backend)(q, k, v, causal).float()
        except RuntimeError:
            continue
    return None


def _call(fn, q, k, v, p):
    """The call to time: the forward, or forward and backward with fresh gradients each time."""
    if p["mode"] == "fwd":
        return lambda: fn(q, k, v, p["causal"])
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def clear():
        qg.grad = kg.grad = vg.grad = None

    def forward_backward():
        clear()  # each call allocates its own gradients, as a training step does
        fn(qg, kg, vg, p["causal"]).backward(dout)
    forward_backward.clear = clear  # for the peak probe: gradients left from a call are freed before it
    forward_backward.leaves = (qg, kg, vg)
    return forward_backward


def _time(row, call, reference, bench, peak):
    """Fill row with the method's error against the reference, peak bytes and times."""
    out = call()
    if reference is not None and out is not None:
        row["max_abs_err_vs_sdpa"] = float((out.float() - reference).abs().max())
    del out
    row["peak_bytes"] = peak(call)
    timed = bench(call)  # a median, or (median, 20th, 80th percentile)
    if isinstance(timed, (tuple, list)):
        row["ms"], row["ms_p20"], row["ms_p80"] = (float(t) for t in timed)
    else:
        row["ms"] = float(timed)
    row["tflops"] = tflops(row["flops"], row["ms"])


def measure_point(p, methods, log, *, device="cuda", tokens=16384, hidden=2048, bench=None, peak=None,
                  usable=None) -> list[dict]:
    """Every method at one grid point, one row each; bench and peak default to the GPU timers.
    Raises DeviceLost when a method's error leaves the device unusable (``usable(device)`` false)."""
    bench, peak, usable = bench or bench_spread, peak or peak_bytes, usable or device_usable
    if device == "cuda":
        torch.cuda.empty_cache()  # the previous point's cached blocks would hide free memory from math_fits
    batch, heads = shape(p["n"], p["d"], tokens, hidden)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, p["n"], p["d"], device=device, dtype=getattr(torch, p["dtype"]),
                           generator=gen) for _ in range(3))  # (B, H, N, D)
    flops = attention_flops(batch, heads, p["n"], p["n"], p["d"], causal=p["causal"], mode=p["mode"])
    reference = _reference(q, k, v, p["causal"]) if p["mode"] == "fwd" else None
    rows = []
    for name, fn in methods.items():
        row = dict(p, method=name, batch=batch, heads=heads, flops=flops)
        if name == "sdpa:math" and not math_fits(batch, heads, p["n"], p["mode"], device):
            rows.append(dict(row, error="skipped: the N x N matrices would not fit in memory"))
            continue
        try:
            with torch.no_grad() if p["mode"] == "fwd" else torch.enable_grad():
                _time(row, _call(fn, q, k, v, p), reference if is_ours(name) else None, bench, peak)
        except Exception as exc:  # an unsupported backend or an OOM is a result, not a crash
            row["error"] = error_text(exc)
            if not usable(device):
                log(f"  {name} left the device unusable at {p}: {row['error']}")
                raise DeviceLost(name, p, row) from exc
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    done = [r for r in rows if "tflops" in r]
    best = max(done, key=lambda r: r["tflops"]) if done else None
    log(f"  d={p['d']:3d} N={p['n']:5d} {p['dtype']:8s} causal={int(p['causal'])} {p['mode']:7s} "
        + (f"best {best['method']} {best['tflops']:.0f} TFLOP/s" if best else "no result"))
    return rows
