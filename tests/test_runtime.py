"""The course on a student's runtime: the setup cell, and three runtimes played on the CPU.

A runtime (Colab, Kaggle, a cluster's JupyterHub) has its own torch, Triton, numpy and matplotlib, and
no flashlib; a student opens one notebook from a link, alone. Each runtime here is a notebook (or three)
copied alone into an empty folder and run there by nbval, as CI runs it, on the runtime's own kernel,
with the runtime's packages recorded before and after:

(a) a clean runtime: no flashlib, and no ipywidgets either, as a bare JupyterHub image may be; the course
    comes from ``FLASHLIB_SOURCE``, a clean copy of the repository (its tracked files, as a clone has
    them). Notebooks 01, 03 (through its last stepper) and 06: the first setup cell installs the course
    and ipywidgets, holding the rest; every notebook runs to its end with every other cell as stored: the
    steppers on the ipywidgets added, the kernels in Triton's interpreter, the recorded GPU runs (the
    package's data) read from the installed course.
(b) a runtime whose torch is older than the course's floor; the course from the wheel ``make wheel``
    builds, uploaded into the notebook's folder (``FLASHLIB_SOURCE`` unset). Notebook 01 runs to its
    end, the setup cell saying that torch is older than the course is tested with.
(c) a runtime with another package importable as flashlib (the package index's ``flashlib`` 0.4.0 is an
    unrelated project). Notebook 01 stops at its setup cell, which names that package and what to do;
    nothing imports it. nbval runs every cell even after one fails, so this run stops at the first
    failure (``-x``), as Run All stops in Jupyter.
In all three the runtime's torch, Triton, numpy and matplotlib (and (c)'s other flashlib) are unchanged.

How: one base environment holds the runtime's packages (the locked versions: torch, Triton, numpy,
matplotlib, ipykernel); each runtime is a virtual environment of its own whose site-packages lists the
base's after its own (a .pth file), so that what its setup cell installs lands in it alone and the base
serves all three. The base is itself such a layer: ipykernel over the environment of torch, Triton, numpy
and matplotlib that test_bench_notebooks' image shares (tests/fresh_envs.py), built once per session. What is simulated, and how:
- (b)'s torch 2.10.0 is a distribution holding metadata only (a wheel built here), installed into the
  runtime over the base's torch: pip and importlib.metadata, by which the setup cell and pip decide, see
  torch 2.10.0, while ``import torch`` still runs the base's 2.13.0 build. Other torch releases cannot
  be had here (only CPU builds of 2.13.0 and 2.14.1 lie on this machine; the CUDA builds are gigabytes),
  and what is tested is what the setup cell does with an older torch, not how torch 2.10 computes.
- (c)'s flashlib 0.4.0 is a wheel built here, named like the index's and importing as flashlib; its
  ``__init__`` only writes a file when imported, so the test sees whether anything ran it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from flashlib.course import runtime

from .fresh_envs import layer, pip_install, shared_env

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["01_dense_attention.ipynb", "03_tiled_attention.ipynb", "06_fused_forward.ipynb"]
# opened through its last stepper (the ipywidgets the setup cell added): the cells after it compute what the
# course's own nbval run compares, with nothing of the runtime's that the others do not use
THROUGH_LAST_STEPPER = {"03_tiled_attention.ipynb"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
BASE_PACKAGES = ["torch", "triton", "numpy", "matplotlib", "ipykernel"]
KEPT = ["torch", "triton", "numpy", "matplotlib"]  # what the runtime's own build must keep


# --- the line the setup cell prints --------------------------------------------------------------

T4 = dict(gpu="Tesla T4", capability=(7, 5), cuda_build="12.6")
LOCKED = {"torch": "2.13.0+cpu", "triton": "3.7.1", "numpy": "2.4.6", "matplotlib": "3.11.2", "ipywidgets": "8.1.9"}


def test_the_runtime_line_says_what_runs_on_colabs_t4_with_its_torch_2_10():
    colab = runtime.Runtime(dict(LOCKED, torch="2.10.0+cu126", triton="3.6.0"), **T4)
    assert runtime.describe(colab) == (
        "Runtime: Tesla T4 (compute capability 7.5); torch 2.10.0+cu126, Triton 3.6.0; float16 (no bfloat16), "
        "tl.dot on FMA units (no tensor cores): torch 2.10.0+cu126 is older than the course is tested with "
        "(2.11): notebooks 01-04 run; the kernels may not.")
    # in range, the T4 is told what its timings are
    assert runtime.describe(runtime.Runtime(dict(LOCKED, torch="2.11.0+cu126", triton="3.6.0"), **T4)).endswith(
        "every notebook runs; its timings are float16 on FMA units, not comparable with the recorded runs.")


@pytest.mark.parametrize("facts,expected", [
    (dict(gpu="NVIDIA H200", capability=(9, 0), cuda_build="13.0"),
     "Runtime: NVIDIA H200 (compute capability 9.0); torch 2.13.0+cpu, Triton 3.7.1; bfloat16 and float16, tl.dot on "
     "tensor cores: every notebook runs, the ladder's TMA rungs included."),
    (dict(gpu="NVIDIA A100", capability=(8, 0), cuda_build="12.8"),
     "Runtime: NVIDIA A100 (compute capability 8.0); torch 2.13.0+cpu, Triton 3.7.1; bfloat16 and float16, tl.dot on "
     "tensor cores: every notebook runs; the ladder's TMA rungs need compute capability 9.0."),
    (dict(cuda_build="13.0"),  # a CUDA 13 build of torch on a driver that cannot run it
     "Runtime: no CUDA GPU that this torch (built for CUDA 13.0) can use; torch 2.13.0+cpu, Triton 3.7.1; kernels in "
     "Triton's CPU interpreter (exact, slow; float32 and float16, no bfloat16): every notebook runs; GPU timings "
     "shown are recorded runs."),
])
def test_the_runtime_line_names_the_gpu_its_arithmetic_and_what_runs(facts, expected):
    assert runtime.describe(runtime.Runtime(LOCKED, **facts)) == expected


def test_the_runtime_line_without_triton_or_with_old_packages_says_what_runs():
    mac = runtime.Runtime(dict(LOCKED, triton=None), system="Darwin")
    assert runtime.describe(mac) == ("Runtime: no CUDA GPU; torch 2.13.0+cpu, no Triton: notebooks 01-04 and 11 run; "
                                     "05-10, 12-14 and A need Triton (Linux, WSL2 or a GPU runtime).")
    old = runtime.Runtime(dict(LOCKED, numpy="2.0.2", ipywidgets="7.7.1"), **T4)
    assert runtime.describe(old).endswith(": numpy 2.0.2 and ipywidgets 7.7.1 are older than the course is tested "
                                          "with (2.4, 8.1): figures and sliders may differ from the stored notebooks.")
    assert runtime.older_than_tested(dict(LOCKED, triton="3.5.1", torch="2.11.0a0+git")) == ["triton"]
    with pytest.raises(ValueError, match="'dev' does not start with a release number"):
        runtime.release("dev")


def test_this_environment_is_described_from_what_is_installed():
    from importlib import metadata

    here = runtime.here()
    assert here.versions["torch"] == metadata.version("torch")
    assert runtime.describe().startswith("Runtime: ")


# --- three runtimes ---------------------------------------------------------------------------------

LINUX_ONLY = pytest.mark.skipif(sys.platform != "linux", reason="the runtimes install Triton (Linux wheels)")


def _pip(python: Path, *args, timeout=600):
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _fingerprint(python: Path, names) -> dict:
    """{package: (version, sha1 of its RECORD)} as the runtime sees them (the first found on its path): a
    reinstall, an upgrade or a downgrade changes one or the other."""
    code = ("import importlib.metadata as m, hashlib, json, sys; print(json.dumps({n: (m.version(n), "
            "hashlib.sha1(m.distribution(n).read_text('RECORD').encode()).hexdigest()) for n in sys.argv[1:]}))")
    # from the interpreter's own folder: `python -c` puts its working folder first on the path, and a
    # checkout's folder may hold metadata (an *.egg-info) that is not the runtime's
    done = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, timeout=120,
                          cwd=python.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _clean_copy(target: Path) -> Path:
    """The repository's tracked and unignored files, as a fresh clone has them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def tiny_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A wheel of distribution ``name`` ``version`` holding ``files`` (path -> text) and its metadata."""
    info = f"{name}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"

    def row(path, text):
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(text.encode())}"

    contents[f"{info}/RECORD"] = "".join(row(p, t) + "\n" for p, t in contents.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in contents.items():
            wheel.writestr(member, text)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(python of the base environment with the runtime's packages, a clean copy of the repository)."""
    folder = tmp_path_factory.mktemp("runtime")
    python = layer(shared_env(tmp_path_factory), folder / "env")  # torch, Triton, numpy, matplotlib
    pip_install(python, *BASE_PACKAGES)  # and ipykernel, held to the locked versions
    return python, _clean_copy(folder / "flashlib-course")


def _kernel_spec(python: Path, folder: Path) -> Path:
    """A Jupyter data folder whose one kernel, "runtime", is the runtime environment's Python."""
    spec = folder / "kernels" / "runtime"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "runtime", "language": "python"}))
    return folder


def _runtime_env(folder: Path, **more) -> dict:
    """This process's environment without what points at the test environment or its flashlib. The
    runtime's matplotlib keeps its font cache beside it: in the user's cache it would list fonts inside
    this temporary environment, and every later notebook would warn that they are gone."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "TRITON", "VIRTUAL_ENV", "JUPYTER", "FLASHLIB"))}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", MPLBACKEND="module://matplotlib_inline.backend_inline",
               MPLCONFIGDIR=str(folder / "mpl"), **more)
    return env


def _open_alone(python: Path, folder: Path, notebooks, env: dict, *options) -> tuple[list[dict], str]:
    """Copy ``notebooks`` alone into an empty folder and run them there under nbval, as CI runs it, on the
    runtime's kernel; each notebook's entry from the results plugin, cell by cell, and pytest's output."""
    opened = folder / "opened"
    opened.mkdir(exist_ok=True)
    for name in notebooks:  # alone: no package, no data beside it
        nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        if name in THROUGH_LAST_STEPPER:
            nb.cells = nb.cells[:1 + max(i for i, c in enumerate(nb.cells)
                                         if any(WIDGET_VIEW in o.get("data", {}) for o in c.get("outputs", [])))]
        nbformat.write(nb, opened / name)
    env = dict(env, JUPYTER_PATH=str(_kernel_spec(python, folder / "jupyter")), IPYTHONDIR=str(folder / "ipython"))
    done = subprocess.run([sys.executable, "-m", "pytest", *notebooks, "--nbval", "--nbval-kernel-name", "runtime",
                           "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"),
                           "-p", "flashlib.bench.nbval_results", "--flashlib-result", str(folder / "r.json"),
                           "-p", "no:cacheprovider", "-q", "--color=no", *options],
                          cwd=opened, env=env, capture_output=True, text=True, timeout=900)
    entries = json.loads((folder / "r.json").read_text())["notebooks"]
    assert [e["notebook"] for e in entries] == list(notebooks), done.stdout[-3000:]
    return entries, done.stdout


def _as_stored_but_the_setup(entries) -> list:
    """Every cell but the first notebook's setup cell that did not pass (or was skipped as stored)."""
    setup = entries[0]["cells"][0]
    return [(e["notebook"], c) for e in entries for c in e["cells"]
            if c["status"] not in ("passed", "skipped") and c is not setup]


def _setup_said(entries) -> list[str]:
    setup = entries[0]["cells"][0]
    assert setup["line"].startswith("def _flashlib_setup") and setup["status"] == "differed", setup
    return setup["outputs"].splitlines()


@LINUX_ONLY
def test_a_clean_runtime_gets_the_course_and_what_it_lacks_and_keeps_its_own(base, tmp_path):
    base_python, source = base
    python = layer(base_python, tmp_path / "env")  # a runtime of its own over the base
    before, base_before = _fingerprint(python, KEPT), _fingerprint(base_python, KEPT)
    env = _runtime_env(tmp_path, FLASHLIB_SOURCE=str(source))
    missing = subprocess.run([str(python), "-c", "import flashlib"], cwd=tmp_path, env=env, capture_output=True)
    assert missing.returncode != 0  # the runtime starts without the course
    entries, said = _open_alone(python, tmp_path, NOTEBOOKS, env)
    # the first notebook's setup cell installed the course and ipywidgets, which the runtime lacked, and
    # said so; then its line on the runtime, as stored (the same versions as the lock's)
    installed, line = _setup_said(entries)
    assert installed == ("installed flashlib-course from FLASHLIB_SOURCE; kept this runtime's torch, triton, numpy, "
                         "matplotlib; added ipywidgets"), said[-3000:]
    assert line.startswith("Runtime: no CUDA GPU; torch 2.13.0+cpu, Triton 3.7.1;") and "every notebook runs" in line
    assert not _as_stored_but_the_setup(entries), _as_stored_but_the_setup(entries)
    assert all(e["cells"][0]["status"] == "passed" for e in entries[1:])  # the others found it, and said as stored
    assert _fingerprint(python, KEPT) == before and _fingerprint(base_python, KEPT) == base_before
    assert runtime.release(_fingerprint(python, ["ipywidgets"])["ipywidgets"][0]) >= runtime.release("8.1")


@LINUX_ONLY
def test_a_runtime_with_an_older_torch_keeps_it_and_is_told_what_runs(base, tmp_path):
    base_python, source = base
    python = layer(base_python, tmp_path / "env")  # a runtime of its own over the base
    # torch 2.10.0 as pip and importlib.metadata see it (metadata only; the module docstring says why)
    _pip(python, "install", "--quiet", "--no-deps", str(tiny_wheel(tmp_path, "torch", "2.10.0", {})))
    # ipywidgets as the runtime's own, so that only torch is out of the ordinary here
    _pip(python, "install", "--quiet", "--no-compile", "-c", str(ROOT / "constraints.txt"), "ipywidgets")
    names = KEPT + ["ipywidgets"]
    before = _fingerprint(python, names)
    assert before["torch"][0] == "2.10.0"
    # the wheel of `make wheel`, run as written in the Makefile in the clean copy, uploaded beside the notebook
    (source / ".venv").mkdir(exist_ok=True)
    (source / ".venv" / ".installed-stamp").touch()  # the course's own environment is not what is built here
    done = subprocess.run(["make", "-C", str(source), "wheel", f"PY={sys.executable}"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = (source / "build" / "wheel").glob("flashlib_course-*-py3-none-any.whl")
    (tmp_path / "opened").mkdir()
    shutil.copy(wheel, tmp_path / "opened" / wheel.name)
    entries, said = _open_alone(python, tmp_path, NOTEBOOKS[:1], _runtime_env(tmp_path))
    installed, line = _setup_said(entries)
    assert installed == (f"installed flashlib-course from {wheel.name}; kept this runtime's torch, triton, numpy, "
                         "matplotlib, ipywidgets"), said[-3000:]
    assert line.startswith("Runtime: no CUDA GPU; torch 2.10.0, Triton 3.7.1;"), line
    assert line.endswith("torch 2.10.0 is older than the course is tested with (2.11): notebooks 01-04 run; "
                         "the kernels may not.")
    assert not _as_stored_but_the_setup(entries), _as_stored_but_the_setup(entries)
    assert _fingerprint(python, names) == before  # torch 2.10 stays: nothing was upgraded


@LINUX_ONLY
def test_a_runtime_with_another_flashlib_stops_at_the_setup_cell_naming_it(base, tmp_path):
    base_python, source = base
    python = layer(base_python, tmp_path / "env")  # a runtime of its own over the base
    imported = tmp_path / "the other flashlib was imported"
    other = tiny_wheel(tmp_path, "flashlib", "0.4.0", {"flashlib/__init__.py": (
        '"""Stands in for the package index\'s flashlib 0.4.0, an unrelated project that imports as flashlib."""\n'
        "import os, pathlib\n"
        "if os.environ.get('OTHER_FLASHLIB_IMPORTED'):\n"
        "    pathlib.Path(os.environ['OTHER_FLASHLIB_IMPORTED']).write_text('imported')\n")})
    _pip(python, "install", "--quiet", "--no-deps", str(other))
    names = KEPT + ["flashlib"]
    before = _fingerprint(python, names)
    env = _runtime_env(tmp_path, FLASHLIB_SOURCE=str(source), OTHER_FLASHLIB_IMPORTED=str(imported))  # source unused
    entries, said = _open_alone(python, tmp_path, NOTEBOOKS[:1], env, "-x")  # Run All stops at an error
    (setup,) = entries[0]["cells"]  # nothing after it ran
    assert setup["status"] == "failed", setup
    assert setup["error"].startswith("RuntimeError: another package is importable as flashlib here, not this "
                                     "course's (flashlib-course): flashlib 0.4.0 at "), setup["error"]
    assert "uninstall it (pip uninstall -y flashlib), restart the runtime" in setup["error"]
    assert not imported.exists()  # named from its metadata, never run
    assert _fingerprint(python, names) == before  # neither removed nor installed over
