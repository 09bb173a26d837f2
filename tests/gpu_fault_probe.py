"""A kernel fault on purpose, for test_gpu.py's test_a_kernel_fault_is_told_from_an_ordinary_error,
run as a script in a process of its own (the fault leaves the process's GPU unusable). Prints one
JSON line: was the device usable before, which method the benchmark blamed, and after. The kernel
lives in this file because Triton reads a kernel's source from its file (``python -c`` fails)."""
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _stray_store(X):
    tl.store(X + (1 << 40), 1.0)  # 4 TiB past the allocation: an illegal address


def fault(q, k, v, causal):
    x = torch.zeros(1, device="cuda")
    _stray_store[(1,)](x)
    torch.cuda.synchronize()
    return q


def main():
    from flashlib.bench import gpu as perf_bench

    methods = {"sdpa:flash": perf_bench._sdpa("flash"), "faulty": fault}
    point = dict(d=64, n=256, dtype="float16", causal=False, mode="fwd")
    before = perf_bench._device_usable()
    try:
        perf_bench._measure_point(point, methods, lambda *a: None, tokens=256, hidden=128)
        result = dict(before=before, lost=None)
    except perf_bench.DeviceLost as exc:
        result = dict(before=before, lost=exc.method, error=exc.row["error"], after=perf_bench._device_usable())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
