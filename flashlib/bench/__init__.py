"""Measurements: the CPU benchmark, the GPU ladder benchmark, the GPU check, recorded runs.

    cpu       dense against tiled attention on this CPU (``python -m flashlib bench cpu``);
              ``peak_allocated_bytes``, the notebooks' memory measurement
    gpu       every rung of the ladder and every SDPA backend, side by side (``make gpu-check``)
    check     the GPU check: GPU tests, then the ladder benchmark (``python -m flashlib gpu-check``)
    ahead     compiling the benchmark's kernels on many cores before their first launch
    records   reading the JSON files in data/bench/; plots: their figures
    report    what a recorded run says against the expectations in data/bench/LOG.md
              (``python -m flashlib.bench.report``)

Nothing in the reference modules, the kernels or the ladder imports this package.
"""
from .cpu import peak_allocated_bytes

__all__ = ["peak_allocated_bytes"]
