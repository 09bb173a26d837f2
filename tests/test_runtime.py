"""The course on a GPU runtime, played on the CPU.

A runtime (Colab, Kaggle, a cluster's JupyterHub) has its own torch, Triton, numpy, matplotlib,
ipywidgets and ipykernel, and no flashlib; a student opens one notebook from a link, alone. Here:
a fresh virtual environment holding exactly those packages (the locked versions), notebooks 01, 03,
06 and 08 copied alone into an empty folder, executed there by nbval (as CI runs it) on that
environment's kernel with ``FLASHLIB_SOURCE`` pointing at a clean copy of the repository (its
tracked files, as a clone has them). The first notebook's setup cell installs flashlib; every
notebook then runs to its end, each cell's outputs as stored, and torch's, Triton's and numpy's
versions and files are unchanged afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["01_dense_attention.ipynb", "03_tiled_attention.ipynb", "06_fused_forward.ipynb",
             "08_performance.ipynb"]
RUNTIME_PACKAGES = ["torch", "triton", "numpy", "matplotlib", "ipywidgets", "ipykernel"]
KEPT = ["torch", "triton", "numpy"]  # what the runtime's own build must keep

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runtime test installs Triton (Linux wheels)")


def _python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _pip(python: Path, *args, timeout=600):
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _fingerprint(python: Path) -> dict:
    """{package: (version, sha1 of its RECORD)}: a reinstall or an upgrade changes one or the other."""
    code = ("import importlib.metadata as m, hashlib, json, sys; print(json.dumps({n: (m.version(n), "
            "hashlib.sha1(m.distribution(n).read_text('RECORD').encode()).hexdigest()) for n in sys.argv[1:]}))")
    done = subprocess.run([str(python), "-c", code, *KEPT], capture_output=True, text=True, timeout=120)
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


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """(python of a fresh environment with the runtime's packages, a clean copy of the repository)."""
    base = tmp_path_factory.mktemp("runtime")
    venv.EnvBuilder(with_pip=True).create(base / "env")
    python = _python(base / "env")
    constraints = str(ROOT / "constraints.txt")
    # --no-compile: Python compiles what it imports when it imports it (torch's byte-compiling took 13 s)
    _pip(python, "install", "--quiet", "--no-compile", "-c", constraints, "torch")  # first: the pinned build
    _pip(python, "install", "--quiet", "--no-compile", "-c", constraints, *RUNTIME_PACKAGES)
    return python, _clean_copy(base / "flashlib")


def _kernel_spec(python: Path, folder: Path) -> Path:
    """A Jupyter data folder whose one kernel, "runtime", is the runtime environment's Python."""
    spec = folder / "kernels" / "runtime"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "runtime", "language": "python"}))
    return folder


def _runtime_env(source: Path) -> dict:
    """This process's environment without what points at the test environment or its flashlib. The
    runtime's matplotlib keeps its font cache beside it: in the user's cache it would list fonts inside
    this temporary environment, and every later notebook would warn that they are gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON", "VIRTUAL_ENV", "JUPYTER"))}
    env.update(FLASHLIB_SOURCE=str(source), OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
               MPLBACKEND="module://matplotlib_inline.backend_inline", MPLCONFIGDIR=str(source.parent / "mpl"))
    return env


def test_notebooks_opened_alone_on_a_runtime_install_flashlib_and_run_as_stored(runtime, tmp_path):
    python, source = runtime
    before = _fingerprint(python)
    folder = tmp_path / "opened"
    folder.mkdir()
    missing = subprocess.run([str(python), "-c", "import flashlib"], cwd=folder, env=_runtime_env(source),
                             capture_output=True)
    assert missing.returncode != 0  # the runtime starts without the course
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, folder / name)  # alone: no package, no data beside it
    # nbval, as CI runs it, on the runtime's kernel; the results plugin says what happened cell by cell
    env = dict(_runtime_env(source), JUPYTER_PATH=str(_kernel_spec(python, tmp_path / "jupyter")),
               IPYTHONDIR=str(tmp_path / "ipython"))
    done = subprocess.run([sys.executable, "-m", "pytest", *NOTEBOOKS, "--nbval", "--nbval-kernel-name", "runtime",
                           "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"),
                           "-p", "flashlib.bench.nbval_results", "--flashlib-result", str(tmp_path / "r.json"),
                           "-p", "no:cacheprovider", "-q", "--color=no"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    entries = json.loads((tmp_path / "r.json").read_text())["notebooks"]
    assert [e["notebook"] for e in entries] == NOTEBOOKS, done.stdout[-3000:]
    # the first notebook's setup cell installed flashlib and said so in one line (where the stored
    # notebook, which had flashlib, says nothing); every other cell of the four is as stored
    setup = entries[0]["cells"][0]
    assert setup["line"].startswith("import") and setup["status"] == "differed", setup
    assert setup["outputs"] == "installed flashlib from FLASHLIB_SOURCE\n"
    wrong = [(e["notebook"], c) for e in entries for c in e["cells"]
             if c["status"] not in ("passed", "skipped") and c is not setup]
    assert not wrong, wrong
    assert all(e["cells"][0]["status"] == "passed" for e in entries[1:])  # the others found it
    assert _fingerprint(python) == before  # torch, Triton, numpy: the runtime's own, untouched
