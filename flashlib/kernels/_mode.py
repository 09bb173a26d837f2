"""How the kernels will run here: compiled on a CUDA GPU, or in Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so the
choice must be made before any kernel module is imported. :func:`ensure_mode` makes it
once: a value the user set is kept; otherwise the interpreter is switched on when this
PyTorch has no usable CUDA device. Nothing here imports Triton or talks to a GPU driver
beyond PyTorch's own device count.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import threading
from dataclasses import dataclass

_HOW_TO_RUN = ("Triton publishes wheels for Linux only: run the kernel notebooks on Linux, under WSL2 on "
               "Windows, or on a GPU runtime such as Google Colab (the PyTorch half of flashlib works everywhere)")


@dataclass(frozen=True)
class KernelStatus:
    """Whether the Triton kernels can run here, how, and if not, why not."""

    can_run: bool
    mode: str | None       # "gpu", "interpreter" or None
    triton_version: str | None
    reason: str

    def __str__(self) -> str:
        return self.reason


def _cpu_build() -> bool:
    """A CPU build of PyTorch: no device to ask about (reads torch.version only, never a GPU driver)."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def triton_installed() -> bool:
    import sys

    if "triton" in sys.modules:
        return sys.modules["triton"] is not None  # None: import blocked on purpose
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def preselect_without_cuda_build() -> None:
    """At import: a CPU build of PyTorch can only interpret; say so before anyone imports Triton."""
    if "TRITON_INTERPRET" not in os.environ and _cpu_build():
        os.environ["TRITON_INTERPRET"] = "1"


def ensure_mode() -> str:
    """Choose once between "gpu" and "interpreter"; set TRITON_INTERPRET accordingly."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        os.environ["TRITON_INTERPRET"] = "1" if _cpu_build() or not torch.cuda.is_available() else "0"
    return "interpreter" if os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "yes", "on") else "gpu"


def interpreting() -> bool:
    return ensure_mode() == "interpreter"


def require_triton():
    """Import and return triton, or raise an ImportError that says how to get it."""
    if not triton_installed():
        raise ImportError(f"flashlib.kernels needs Triton, which is not installed on this {platform.system()} "
                          f"machine. {_HOW_TO_RUN}.")
    mode = ensure_mode()
    import triton
    import triton.language.standard as standard

    # tl.sum, tl.max, ... are themselves @triton.jit functions, decorated when Triton is first
    # imported: if that happened before TRITON_INTERPRET=1, the interpreter cannot call them.
    if mode == "interpreter" and type(standard.sum).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton was imported before its CPU interpreter was switched on, so its kernels cannot "
                           "run here. Import flashlib.kernels before triton (or set TRITON_INTERPRET=1 before "
                           "starting Python), then restart the kernel or interpreter.")
    if mode == "interpreter":
        _prepare_interpreter()
    return triton


# Triton's interpreter swaps triton.language's functions for interpreted ones at the start of each
# launch and restores them at its end, process-wide, and keeps the grid index in one global: two
# launches at once break each other (errors, or silently wrong numbers). One lock for them all.
INTERPRETER_LOCK = threading.RLock()


def _prepare_interpreter() -> None:
    """Make every interpreted launch in this process (flashlib's, the labs', a user's) take
    INTERPRETER_LOCK, and the interpreter's float tl.dot, exp, exp2, log, log2, sqrt and tl.sum (of
    float16/float32) computed in float64 and rounded once; idempotent. GPU launches are untouched.
    The interpreter computes them with numpy's float32 matmul and math, whose rounding depends on the
    BLAS and SIMD kernels the CPU selects (AVX-512 or AVX2; sums added in 16 or 8 lanes) and on the tile's
    shape: kernel results, and the accuracy tests on them, would differ from one CPU to the next (by 4-20
    float32 ulps at seq_q = 1). Rounded once, they are the same on every CPU (but for a double rounding
    about once in 2^29), and an accuracy test measures the kernel's own arithmetic (exp2, the online
    softmax, the lse), not the host's. A GPU rounds more (tf32, or float32 sums per k-step); its tests
    allow for it."""
    import numpy as np
    from triton.runtime import interpreter

    run, builder = interpreter.InterpretedFunction.run, interpreter.InterpreterBuilder
    if getattr(run, "flashlib_locked", False):
        return

    def locked_run(self, *args, **kwargs):
        with INTERPRETER_LOCK:
            before, _LAUNCH.patched = _LAUNCH.patched, set()
            try:
                return run(self, *args, **kwargs)
            finally:
                _LAUNCH.patched = before

    dot = builder.create_dot

    def exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = all(t.data.dtype in (np.float16, np.float32, np.float64) for t in (a, b, d))
        if not floats:  # bfloat16 and float8 (held as integers by the interpreter), integer dots
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        total = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data.astype(np.float64)
        return interpreter.TensorHandle(total.astype(d.data.dtype), d.dtype.scalar)

    def exact(op):
        def unary(self, arg):
            data = arg.data
            if data.dtype in (np.float16, np.float32):
                return interpreter.TensorHandle(op(data.astype(np.float64)).astype(data.dtype), arg.dtype.scalar)
            return interpreter.TensorHandle(op(data), arg.dtype.scalar)

        return unary

    for name, op in (("create_exp", np.exp), ("create_exp2", np.exp2), ("create_log", np.log),
                     ("create_log2", np.log2), ("create_sqrt", np.sqrt), ("create_precise_sqrt", np.sqrt)):
        setattr(builder, name, exact(op))

    def exact_sum(self, input):  # tl.sum: numpy's float32 sum adds in SIMD lanes, 8 or 16 wide by CPU
        data = input.handle.data
        if data.dtype in (np.float16, np.float32):
            data = data.astype(np.float64)
        return self.to_tensor(np.sum(data, axis=self.axis, keepdims=self.keep_dims), input.dtype)

    interpreter.ReduceOps.sum = exact_sum
    builder.create_dot = exact_dot
    if callable(getattr(interpreter, "_patch_lang", None)):
        interpreter._patch_lang = _patch_once_a_launch(interpreter._patch_lang)
    locked_run.flashlib_locked = True
    interpreter.InterpretedFunction.run = locked_run


class _Launch:
    """The interpreted launch under way (INTERPRETER_LOCK held): the language modules it has patched."""

    patched: set | None = None


_LAUNCH = _Launch()


class _NothingToRestore:
    def restore(self):
        pass


def _patch_once_a_launch(patch_lang):
    """Triton's interpreter patches triton.language again at every call of a @triton.jit helper
    (each program, each call: four scans of the language's members), though the launch has patched it
    already, and the helper's patch is never restored. Patch what a launch has not yet patched, and skip
    the repeats: the same functions run, with 40% less time in the interpreter (data/bench/LOG.md)."""
    import triton.language as tl

    def patch(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if _LAUNCH.patched is not None and langs <= _LAUNCH.patched:
            return _NothingToRestore()
        scope = patch_lang(fn)
        if _LAUNCH.patched is not None:
            _LAUNCH.patched |= langs
        return scope

    return patch


def half_dtype(device=None):
    """The 16-bit dtype the course times its kernels in on this CUDA GPU: bfloat16 from compute
    capability 8.0 (Ampere), float16 before it (a T4 is 7.5: Triton has no bfloat16 there)."""
    import torch

    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def gpu_plan(device=None) -> str:
    """What the course's kernels can do on this CUDA GPU: its name and compute capability, its
    half-precision dtypes, the one the notebooks time in, and the ladder's rungs it cannot run."""
    import torch

    name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    dtypes = "float16 and bfloat16" if (major, minor) >= (8, 0) else "float16 (bfloat16 needs compute capability 8.0)"
    timed = str(half_dtype(device)).removeprefix("torch.")
    rungs = "" if (major, minor) >= (9, 0) else "; the ladder's TMA rungs need 9.0 and run rung 2's kernel here"
    return (f"Triton kernels compile for this machine's {name} (compute capability {major}.{minor}): "
            f"{dtypes}, and float32; the notebooks time them in {timed}{rungs}.")


def kernel_status() -> KernelStatus:
    """A cheap answer for notebooks: can the fused kernels run here, and how?"""
    if not triton_installed():
        return KernelStatus(False, None, None, f"Triton is not installed. {_HOW_TO_RUN}.")
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = version("triton")
    except PackageNotFoundError:
        triton_version = None
    mode = ensure_mode()
    if mode == "gpu":
        import torch

        plan = gpu_plan() if torch.cuda.is_available() else "Triton kernels compile for this machine's CUDA GPU."
        return KernelStatus(True, mode, triton_version, plan)
    return KernelStatus(True, mode, triton_version,
                        "No CUDA GPU: Triton kernels run in the CPU interpreter "
                        "(exact but slow; inputs are CPU tensors).")
