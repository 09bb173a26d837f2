"""Measurements: the CPU benchmark, the GPU ladder benchmark, the GPU check, recorded runs.

    cpu        dense against tiled attention on this CPU (``python -m flashlib bench cpu``);
               ``peak_allocated_bytes``, the notebooks' memory measurement
    gpu        the ladder benchmark: every rung, the public op, every paired backward and every
               SDPA backend, side by side (``python -m flashlib.bench.gpu``), made of
      methods    the methods it times, named from the ladder's table
      point      measuring one grid point (timers, peak memory, a lost device)
      grid       the grid, its priority order and the time budget
      fresh      the points a kernel fault left, measured in fresh processes
      results    target and memory ratios, autotuned tiles, its table and file
    ahead      compiling the benchmark's kernels on many cores before their first launch
    check      the GPU check in two parts, the notebooks and the tests with the benchmarks
               (``python -m flashlib gpu-check [notebooks|tests]``, ``make gpu-check``); processes:
               its children; gpu_tests: the GPU tests, a fresh process after a kernel fault
    notebooks  the course's notebooks executed on this machine and judged as nbval judges them
               (each under nbval in its own process; nbval_results: its entry, cell by cell)
    records    reading the JSON files in data/bench/ under today's method names; plots: their figures
    report     what a recorded run says against the expectations in data/bench/LOG.md
               (``python -m flashlib.bench.report``)
    ring       ring attention on CPU processes (``python -m flashlib.bench.ring``)
    variants   a sliding window against full causal attention in the tiled reference, on this
               CPU: time, peak memory, tiles (``python -m flashlib.bench.variants``)

Nothing in the reference modules, the kernels or the ladder imports this package.
"""
from .cpu import peak_allocated_bytes

__all__ = ["peak_allocated_bytes"]
