"""Made-up recorded runs and grid points for the bench tests (no GPU figure in them is real)."""
from __future__ import annotations


def gpu_run(date="2026-01-02", device="Test GPU"):
    """A GPU run's JSON: forward rates of two rungs and two SDPA backends at d = 128, N = 4k
    and 16k, and an SDPA backend that failed."""
    points = []
    for n, (teach, tma, flash) in {4096: (100.0, 150.0, 140.0), 16384: (110.0, 170.0, 150.0)}.items():
        for method, rate in (("rung:teaching", teach), ("rung:tma", tma), ("sdpa:flash", flash),
                             ("sdpa:efficient", flash / 2)):
            points.append(dict(method=method, d=128, n=n, dtype="bfloat16", causal=False, mode="fwd", tflops=rate))
    points.append(dict(method="sdpa:cudnn", d=128, n=4096, dtype="bfloat16", causal=False, mode="fwd",
                       error="RuntimeError: no kernel"))
    return {"device": device, "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8", "date": date,
            "ladder": {"points": points, "vocabulary": 2,
                       "ceilings": {"bf16_matmul_tflops": 700.0, "copy_gbps": 4000.0}}}


def grid_point(n, mode="fwd", causal=False):
    return dict(d=128, n=n, dtype="bfloat16", causal=causal, mode=mode)
