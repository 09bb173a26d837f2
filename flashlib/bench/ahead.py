"""Compile kernels before their first launch, many at once, without launching any.

An autotuned kernel compiles every candidate the first time it meets a new head dim, dtype
or mask: a benchmark over many such keys spends much of its first points compiling, one
kernel after another, on one core. Compiling is CPU work that Triton can spread over
threads (``AsyncCompileMode`` runs its compiles on an executor; ptxas and most compiler
passes run outside Python's global lock), so the GPU check compiles what its benchmark will
launch while the GPU tests run, on the machine's other cores. Two steps:

1. :func:`recording`: run code with every Triton launch replaced by a note of what it would
   launch (kernel, arguments, and for an autotuned kernel one note per candidate). Nothing
   runs on the device: outputs keep whatever their memory held, autotuners time nothing and
   keep no choice.
2. :func:`compile_notes`: Triton's warm-up entry point for every note, under
   ``AsyncCompileMode`` on a thread pool. Each binary lands in its kernel's cache under the
   key that the real launch computes, since both go through the same argument binder; a later
   launch finds it there and only loads it.

Only for compiled kernels: the interpreter has nothing to compile.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from ..kernels._mode import interpreting, require_triton

triton = require_triton()
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, MockTensor  # noqa: E402


@dataclass
class Note:
    """One launch that would have happened: kernel[grid](*args, **kwargs)."""

    kernel: JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _stand_in(arg):
    """A tensor's stand-in for compiling: Triton specialises a pointer on its dtype and on
    whether its address is a multiple of 16, and a MockTensor's is (address 0). Keeping the
    tensors themselves would hold every recorded buffer in device memory. A tuple (a bundle of
    the kernels' arguments) is stood in for element by element."""
    if isinstance(arg, tuple):
        items = [_stand_in(a) for a in arg]
        return type(arg)(*items) if hasattr(arg, "_fields") else tuple(items)
    if hasattr(arg, "data_ptr") and hasattr(arg, "dtype") and not isinstance(arg, MockTensor):
        return MockTensor(arg.dtype) if arg.data_ptr() % 16 == 0 else arg
    return arg


_LOCK = threading.Lock()  # autograd runs CUDA backward functions on a thread of its own


def every_candidate(tuner, *args, **kwargs):
    """In place of Autotuner.run: call the kernel's run() once with each candidate the
    autotuner would time for these arguments (pruned as its run() prunes them), as a
    warm-up; times nothing, keeps no choice."""
    kwargs.pop("grid", None)
    kwargs.pop("warmup", None)
    tuner.nargs = dict(zip(tuner.arg_names, args))  # what the pruning hook reads, as in run()
    try:
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
    finally:
        tuner.nargs = None
    for config in configs:
        tuner.fn.run(*args, grid=None, warmup=True, **kwargs, **config.all_kwargs())


@contextmanager
def recording():
    """Within the block, launches are noted in the yielded list instead of run (process-wide:
    nothing else may launch kernels meanwhile)."""
    if interpreting():
        raise RuntimeError("recording: the interpreter compiles nothing; run with a CUDA device "
                           "(or TRITON_INTERPRET=0)")
    notes: list[Note] = []
    jit_run, tuner_run = JITFunction.run, Autotuner.run

    def note_launch(self, *args, grid, warmup, **kwargs):
        note = Note(self, tuple(_stand_in(a) for a in args), {k: _stand_in(v) for k, v in kwargs.items()})
        with _LOCK:
            notes.append(note)

    JITFunction.run, Autotuner.run = note_launch, every_candidate  # its fn.run is note_launch now
    try:
        yield notes
    finally:
        JITFunction.run, Autotuner.run = jit_run, tuner_run


def compile_notes(notes, threads: int | None = None) -> dict:
    """Compile every noted kernel not yet compiled in this process, on ``threads`` threads
    (default: all cores but two). Returns {"kernels": compiled now, "failed": how many did
    not compile, "errors": the first few messages, "seconds", "threads"}. A kernel that fails
    here fails again, with its message, when it is launched."""
    from triton.runtime._async_compile import AsyncCompileMode

    threads = threads or max(1, (os.cpu_count() or 2) - 2)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        with AsyncCompileMode(pool, ignore_errors=True) as mode:
            for note in notes:
                note.kernel.warmup(*note.args, grid=(1,), **note.kwargs)
        futures = list(mode.raw_futures)
    errors = [f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
              for e in (f.exception() for f in futures) if e is not None]
    return dict(kernels=len(futures), failed=len(errors), errors=errors[:5],
                seconds=round(time.perf_counter() - start, 2), threads=threads)
