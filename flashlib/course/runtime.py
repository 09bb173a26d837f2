"""What a runtime has, and what of the course runs there: the line every notebook's setup cell prints.

A runtime (Colab, Kaggle, a cluster's JupyterHub, a laptop) keeps its own torch, Triton, numpy,
matplotlib and ipywidgets: the setup cell (tools/notebook_setup.py) never replaces them. This module
says what they are against the oldest releases the course is tested with, and what follows:

    >>> print(describe(Runtime({"torch": "2.10.0+cu126", "triton": "3.6.0"}, "Tesla T4", (7, 5))))
    Runtime: Tesla T4 (compute capability 7.5); torch 2.10.0+cu126, Triton 3.6.0; float16 (no bfloat16), tl.dot on FMA units (no tensor cores): torch 2.10.0+cu126 is older than the course is tested with (2.11): notebooks 01-04 run; the kernels may not.

Versions are those of the installed distributions, as pip sees them; nothing here imports Triton.
"""
from __future__ import annotations

import platform
import re
from dataclasses import dataclass, field
from importlib import metadata

# The oldest release of each that something runs the course with (README, "Versions"): the lock
# (constraints.txt) on the CPU, Triton 3.6 compiling for GPU targets, the recorded GPU runs (torch 2.11,
# Triton 3.6). pyproject.toml declares exactly these as its lower bounds (tests/test_project.py).
TESTED = {"torch": "2.11", "triton": "3.6", "numpy": "2.4", "matplotlib": "3.11", "ipywidgets": "8.1"}
DISTRIBUTION = "flashlib-course"  # the course's name on a package index ("flashlib" there is another project)
TENSOR_CORES = (8, 0)  # Triton's tl.dot: tensor cores (and bfloat16) from Ampere; FMA on a T4 (7.5)
TMA = (9, 0)           # the ladder's TMA rungs: Hopper
PYTORCH_ONLY = "notebooks 01-04 and 11"
KERNEL_NOTEBOOKS = "05-10, 12-14 and A"


@dataclass(frozen=True)
class Runtime:
    """What describe() needs to know of a runtime."""

    versions: dict[str, str | None]             # distribution -> installed version (None: missing)
    gpu: str | None = None                      # the CUDA device torch sees, by name
    capability: tuple[int, int] | None = None   # its compute capability
    cuda_build: str | None = None               # the CUDA torch was built for (None: a CPU build)
    system: str = field(default_factory=platform.system)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed() -> dict[str, str | None]:
    """The installed version of each package the course has a floor for (None: missing)."""
    return {name: _version(name) for name in TESTED}


def here() -> Runtime:
    """This process's runtime: installed versions, and the CUDA device torch can use, if any."""
    versions = installed()
    if versions["torch"] is None:
        return Runtime(versions)
    import torch

    cuda_build = torch.version.cuda
    if cuda_build is None or not torch.cuda.is_available():  # a CPU build asks no driver
        return Runtime(versions, cuda_build=cuda_build)
    return Runtime(versions, torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()), cuda_build)


def release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string: '2.10.0+cu126' -> (2, 10); '3.6' -> (3, 6)."""
    numbers = re.match(r"(\d+)(?:\.(\d+))?", version)
    if numbers is None:
        raise ValueError(f"version {version!r} does not start with a release number such as 2.11")
    return tuple(int(n) for n in numbers.groups(default="0"))


def older_than_tested(versions: dict[str, str | None]) -> list[str]:
    """The installed distributions older than the course's tested floor, in TESTED's order."""
    return [name for name in TESTED
            if versions.get(name) is not None and release(versions[name]) < release(TESTED[name])]


def _device(rt: Runtime) -> str:
    if rt.gpu is not None:
        major, minor = rt.capability
        return f"{rt.gpu} (compute capability {major}.{minor})"
    if rt.cuda_build is not None:  # e.g. a CUDA 13 build of torch on a driver of CUDA 12
        return f"no CUDA GPU that this torch (built for CUDA {rt.cuda_build}) can use"
    return "no CUDA GPU"


def _arithmetic(rt: Runtime) -> str:
    if rt.gpu is None:
        return "kernels in Triton's CPU interpreter (exact, slow; float32 and float16, no bfloat16)"
    if rt.capability >= TENSOR_CORES:
        return "bfloat16 and float16, tl.dot on tensor cores"
    return "float16 (no bfloat16), tl.dot on FMA units (no tensor cores)"


def _what_runs(rt: Runtime) -> str:
    old = older_than_tested(rt.versions)
    if old:
        found = " and ".join(f"{name} {rt.versions[name]}" for name in old)
        floors = ", ".join(TESTED[name] for name in old)
        verb = "is" if len(old) == 1 else "are"
        if "torch" in old:
            follows = "notebooks 01-04 run; the kernels may not"
        elif "triton" in old:
            follows = f"{PYTORCH_ONLY} run; the kernels may not compile"
        else:
            follows = "figures and sliders may differ from the stored notebooks"
        return f"{found} {verb} older than the course is tested with ({floors}): {follows}."
    if rt.versions.get("triton") is None:
        where = "Linux, WSL2 or a GPU runtime" if rt.system != "Linux" else "pip install triton"
        return f"{PYTORCH_ONLY} run; {KERNEL_NOTEBOOKS} need Triton ({where})."
    if rt.gpu is None:
        return "every notebook runs; GPU timings shown are recorded runs."
    if rt.capability < TENSOR_CORES:
        return "every notebook runs; its timings are float16 on FMA units, not comparable with the recorded runs."
    if rt.capability < TMA:
        return "every notebook runs; the ladder's TMA rungs need compute capability 9.0."
    return "every notebook runs, the ladder's TMA rungs included."


def describe(rt: Runtime | None = None) -> str:
    """One line: the GPU and its capability, torch's and Triton's versions, the arithmetic the kernels
    get (bfloat16 or float16, tensor cores or FMA), and what of the course runs here."""
    rt = here() if rt is None else rt
    torch, triton = rt.versions.get("torch"), rt.versions.get("triton")
    versions = f"torch {torch}, " + (f"Triton {triton}" if triton else "no Triton")
    if triton is None:
        return f"Runtime: {_device(rt)}; {versions}: {_what_runs(rt)}"
    return f"Runtime: {_device(rt)}; {versions}; {_arithmetic(rt)}: {_what_runs(rt)}"
