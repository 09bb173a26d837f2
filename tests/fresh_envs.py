"""Fresh virtual environments for the tests that play a runtime (test_runtime) or the GPU machine's image
(test_bench_notebooks): one environment of torch, Triton, numpy and matplotlib, built once per test session and
shared by its workers, and layers over it, each a virtual environment of its own whose site-packages lists the
shared one's after its own (a .pth file), so that what a layer installs lands in it alone.

venv's ensurepip installs its bundled pip and byte-compiles it (8 CPU seconds, minutes on a busy disk); here this
interpreter's pip installs the same bundled wheel without compiling (Python compiles what it imports when it
imports it), as it installs everything else."""
from __future__ import annotations

import ensurepip
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ["torch", "triton", "numpy", "matplotlib"]  # what a runtime and the GPU machine's image both have


def fresh_venv(folder: Path) -> Path:
    """The python of a new virtual environment in ``folder`` holding pip and nothing else."""
    bundled = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl"))
    venv.EnvBuilder(with_pip=not bundled).create(folder)  # a Python without the bundled wheels: venv's own way
    python = folder / "bin" / "python"
    if bundled:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                        "--no-deps", "--no-compile", "--disable-pip-version-check", str(bundled[-1])],
                       check=True, capture_output=True, timeout=600)
    return python


def pip_install(python: Path, *names: str) -> None:
    """``names`` installed into ``python``'s own site-packages at the locked versions (constraints.txt)."""
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
                           "--no-compile", "-c", str(ROOT / "constraints.txt"), *names],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def layer(base_python: Path, folder: Path) -> Path:
    """An environment of its own over ``base_python``'s: its own site-packages first, then every one the base
    sees (its own and those it lists in turn); pip, too, comes from below."""
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    sites = json.loads(subprocess.run([str(base_python), "-c", "import json, sys; print(json.dumps("
                                       "[p for p in sys.path if p.endswith('site-packages')]))"],
                                      capture_output=True, text=True, check=True).stdout)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "runtime_base.pth").write_text("".join(f"{site}\n" for site in sites))
    return python


def shared_env(tmp_path_factory) -> Path:
    """The python of the environment holding SHARED (torch first: the pinned build), built by the first test of
    the session that asks, in the folder all pytest-xdist workers of the session share."""
    from filelock import FileLock

    basetemp = tmp_path_factory.getbasetemp()
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    folder = root / "shared-torch-env"
    with FileLock(str(root / "shared-torch-env.lock")):
        if not (folder / "built").exists():
            python = fresh_venv(folder)
            pip_install(python, "torch")
            pip_install(python, *SHARED)
            (folder / "built").touch()
    return folder / "bin" / "python"
