"""The course on a GPU runtime, played on the CPU.

A runtime (Colab, Kaggle, a cluster's JupyterHub) has its own torch, Triton, numpy, matplotlib,
ipywidgets and ipykernel, and no flashlib; a student opens one notebook from a link, alone. Here:
a fresh virtual environment holding exactly those packages (the locked versions), notebooks 01, 03,
06 and 08 copied alone into an empty folder, executed there by nbclient on that environment's
kernel with ``FLASHLIB_SOURCE`` pointing at a clean copy of the repository (its tracked files,
as a clone has them). The first notebook's setup cell installs flashlib; every notebook then runs
to its end, each cell's outputs as stored (nbval's rules, flashlib.bench.nbcompare), and torch's,
Triton's and numpy's versions and files are unchanged afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from traitlets import default

from flashlib.bench import nbcompare

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
    _pip(python, "install", "--quiet", "-c", constraints, "torch")  # first: the pinned build, not a CUDA one
    _pip(python, "install", "--quiet", "-c", constraints, *RUNTIME_PACKAGES)
    return python, _clean_copy(base / "flashlib")


class _Runtime(KernelSpecManager):
    python: str = ""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(argv=[self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="runtime", language="python", resource_dir="")


def _kernel_manager(python: Path):
    class Manager(KernelManager):
        @default("kernel_spec_manager")
        def _runtime(self):
            spec = _Runtime()
            spec.python = str(python)
            return spec

    return Manager


def _runtime_env(source: Path) -> dict:
    """This process's environment without what points at the test environment or its flashlib. The
    runtime's matplotlib keeps its font cache beside it: in the user's cache it would list fonts inside
    this temporary environment, and every later notebook would warn that they are gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON", "VIRTUAL_ENV"))}
    env.update(FLASHLIB_SOURCE=str(source), OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
               MPLBACKEND="module://matplotlib_inline.backend_inline", MPLCONFIGDIR=str(source.parent / "mpl"))
    return env


def _execute(path: Path, python: Path, source: Path):
    nb = nbformat.read(path, as_version=4)
    env = _runtime_env(source)
    client = NotebookClient(nb, timeout=600, kernel_name="runtime", kernel_manager_class=_kernel_manager(python),
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env, cwd=str(path.parent))
    return nbformat.from_dict(nb)


def test_notebooks_opened_alone_on_a_runtime_install_flashlib_and_run_as_stored(runtime, tmp_path):
    python, source = runtime
    before = _fingerprint(python)
    folder = tmp_path / "opened"
    folder.mkdir()
    missing = subprocess.run([str(python), "-c", "import flashlib"], cwd=folder, env=_runtime_env(source),
                             capture_output=True)
    assert missing.returncode != 0  # the runtime starts without the course
    patterns = nbcompare.sanitize_patterns()
    said = []
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, folder / name)  # alone: no package, no data beside it
        ran = _execute(folder / name, python, source)
        stored = nbcompare.read_notebook(ROOT / "notebooks" / name)
        for (i, cell), new in zip(nbcompare.code_cells(stored), [c for c in ran.cells if c.cell_type == "code"]):
            outputs = [dict(o) for o in new.get("outputs", [])]
            assert not any(o.get("output_type") == "error" for o in outputs), (name, i, outputs)
            if "flashlib-setup" in cell.get("metadata", {}).get("tags", []):
                said.append("".join(o.get("text", "") for o in outputs))
                continue
            options = nbcompare.cell_options(cell)
            if options["skip"] or not options["check"] or cell.get("execution_count") is None:
                continue
            difference = nbcompare.compare_outputs(outputs, cell["outputs"], patterns)
            assert difference is None, f"{name}, cell {i}: {difference}"
    # the first notebook installed flashlib and said so in one line; the others found it
    assert said == ["installed flashlib from FLASHLIB_SOURCE\n", "", "", ""], said
    assert _fingerprint(python) == before  # torch, Triton, numpy: the runtime's own, untouched
