"""Re-execute notebooks in place, deterministically, so their stored outputs can be compared.

    python tools/execute_notebooks.py notebooks/01_dense_attention.ipynb [...]

Each notebook runs top to bottom in a fresh kernel of this Python environment (the
``python3`` kernel of ``sys.executable``, not whatever a user has registered), with
the working directory ``notebooks/`` and fixed hashing and thread settings. Volatile
metadata (timings, widget state, random widget ids, the Python patch version) is
stripped, so executing twice writes byte-identical files.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets import default

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
FIXED_ENV = {
    "PYTHONHASHSEED": "0",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    "OMP_NUM_THREADS": "1",  # same float summation order on every machine
    "TQDM_DISABLE": "1",
}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class _ThisPythonKernels(KernelSpecManager):
    """Resolve 'python3' to an ipykernel running under this interpreter."""

    def get_kernel_spec(self, kernel_name):
        if kernel_name != "python3":
            return super().get_kernel_spec(kernel_name)
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="Python 3 (ipykernel)", language="python", resource_dir="")


class _ThisPythonKernelManager(AsyncKernelManager):
    @default("kernel_spec_manager")
    def _this_python_kernels(self):
        return _ThisPythonKernels(data_dir=self.data_dir)


def _kernel_env() -> dict:
    env = dict(os.environ)
    env.update(FIXED_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _coalesce_streams(outputs):
    """Join consecutive stdout (or stderr) chunks: where a kernel splits them depends on timing."""
    joined = []
    for output in outputs:
        previous = joined[-1] if joined else None
        if (output.output_type == "stream" and previous is not None
                and previous.output_type == "stream" and previous.name == output.name):
            previous.text += output.text
        else:
            joined.append(output)
    return joined


def _strip(nb) -> None:
    """Drop what changes from run to run but carries no meaning."""
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                                 "name": "python3"}
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    widget_count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if "outputs" in cell:
            cell.outputs = _coalesce_streams(cell.outputs)
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is not None:
                # A fresh random id each run, pointing at state that is not stored anyway.
                widget_count += 1
                view["model_id"] = f"flashlib-widget-{widget_count}"


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            store_widget_state=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
                            kernel_manager_class=_ThisPythonKernelManager)
    start = time.perf_counter()
    client.execute(env=_kernel_env(), cwd=str(NOTEBOOK_DIR))
    elapsed = time.perf_counter() - start
    _strip(nb)
    nbformat.validate(nb)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        nbformat.write(nb, f)
    return elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {execute(path, args.timeout):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
