"""Run by tests/test_ahead.py in a fresh Python with TRITON_INTERPRET=0 and no GPU.

A stand-in driver answers Triton's three questions (which device, which stream, which
target: sm_90), so the JIT binds arguments and compiles as on an H200, and nothing can be
launched. CPU tensors stand in for the GPU's (the device checks are bypassed: nothing reads
their memory). Prints one JSON object: what was recorded, what compiled, and whether the
real launch path, with real tensors, then finds every binary in the kernels' caches.

    python tests/ahead_probe.py direct FORWARD BACKWARD HEAD_DIM DTYPE
    python tests/ahead_probe.py ladder HEAD_DIM DTYPE
"""
import json
import os
import sys
from contextlib import contextmanager

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


class StandInDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(StandInDriver())

from flashlib.bench import gpu as perf_bench  # noqa: E402
from flashlib.bench import ahead  # noqa: E402
from flashlib.bench.methods import is_ours, methods  # noqa: E402
from flashlib.bench.point import measure_point  # noqa: E402
import flashlib.op  # noqa: E402,F401
from flashlib.kernels import function as teaching  # noqa: E402
from flashlib.ladder import autotune, function  # noqa: E402
from flashlib.ladder import backward as backward_fast  # noqa: E402
from flashlib.ladder import forward as forward_fast  # noqa: E402


def _checks(fn, q, v=None):
    """The kernels' input checks without the device check (CPU tensors stand in for the GPU's)."""


forward_fast.check_kernel_inputs = _checks
# the teaching kernels' entry (the benchmark's flashlib:gqa and flashlib:window); the public op keeps its own
# reference to the device check (imported first), so that it still stays out of the probe as before
teaching.check_kernel_inputs = _checks


def cache_sizes(kernels):
    return {k.fn.__name__: len(k.device_caches[0][0]) for k in kernels}


@contextmanager
def bind_only(calls):
    """The real launch path, every autotune candidate bound and looked up, nothing launched:
    a key missing from a kernel's cache would compile there and grow it."""
    jit_run, tuner_run = ahead.JITFunction.run, ahead.Autotuner.run

    def look_up(self, *args, grid, warmup, **kwargs):
        calls.append(self.fn.__name__)
        return jit_run(self, *args, grid=grid, warmup=True, **kwargs)

    ahead.JITFunction.run, ahead.Autotuner.run = look_up, ahead.every_candidate
    try:
        yield
    finally:
        ahead.JITFunction.run, ahead.Autotuner.run = jit_run, tuner_run


def tuners_kept():
    return sum(len(t.cache) for t in autotune.all_tuners())


def direct(forward, backward, d, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 2, 256, d, generator=gen).to(dtype) for _ in range(4))  # (B, H, N, D)

    def run_all():  # the ladder's ladder:<backward> row, minus autograd
        out, lse2 = forward_fast.forward_base2(q, k, v, causal=True, rung=forward)
        function.backward_pass_base2(q, k, v, out, lse2, dout, causal=True, scale=d ** -0.5, backward=backward)

    with ahead.recording() as notes:
        run_all()
    kept = tuners_kept()
    first = ahead.compile_notes(notes, threads=2)
    kernels = list({id(n.kernel): n.kernel for n in notes}.values())
    sizes = cache_sizes(kernels)
    again = ahead.compile_notes(notes, threads=2)
    calls = []
    with bind_only(calls):
        run_all()
    return dict(notes=[n.name for n in notes],
                configs=[[n.kwargs.get(x) for x in ("BLOCK_Q", "BLOCK_K", "num_warps", "num_stages")]
                         + ([n.kwargs["DQ_T"]] if "DQ_T" in n.kwargs else []) for n in notes],
                tuners_kept=kept, first=first, again=again, sizes=sizes, after_real=cache_sizes(kernels),
                real_calls=len(calls))


def ladder(d, dtype):
    grid = perf_bench.plan(ds=(d,), ns=(256, 512), dtypes=(dtype,), causals=(True,))
    result = perf_bench.precompile(grid, threads=2, device="cpu", tokens=512, hidden=2 * d, log=lambda *_: None)
    kernels = [k for k in ahead_kernels() if k.device_caches[0][0]]
    sizes = cache_sizes(kernels)
    calls = []
    with bind_only(calls):
        for mode in ("fwd", "fwd_bwd"):
            p = dict(d=d, n=512, dtype=dtype, causal=True, mode=mode)
            ours = {n: f for n, f in methods(mode).items() if is_ours(n)}
            measure_point(p, ours, log=lambda *_: None, device="cpu", tokens=512, hidden=2 * d,
                          bench=lambda fn: 1.0, peak=lambda fn: 0)
    return dict(precompile=result, tuners_kept=tuners_kept(), sizes=sizes, after_real=cache_sizes(kernels),
                real_calls=len(calls))


def ahead_kernels():
    """Every JIT kernel of the forward and backward modules."""
    from flashlib.kernels import backward, forward
    found = {}
    for module in (forward, forward_fast, backward, backward_fast):
        for value in vars(module).values():
            if isinstance(value, ahead.JITFunction):
                found[id(value)] = value
    return list(found.values())


def main():
    kind = sys.argv[1]
    if kind == "direct":
        out = direct(sys.argv[2], sys.argv[3], int(sys.argv[4]), getattr(torch, sys.argv[5]))
    else:
        out = ladder(int(sys.argv[2]), sys.argv[3])
    print(json.dumps(dict(out, triton=triton.__version__)))


if __name__ == "__main__":
    main()
