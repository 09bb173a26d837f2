"""Each lab's cell run as a learner runs it after restarting the kernel: alone, in a fresh Jupyter kernel.

The kernels start from an environment without TRITON_INTERPRET: this test process imported flashlib,
which sets it, and a kernel started from here would otherwise inherit what a learner's fresh kernel
never has. The lab's cell is the one stored in its notebook (the stub); then its worked solution
runs in the same kernel, as when the learner has written the body.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from flashlib import labs
from flashlib.labs import cells

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import execute_notebooks  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton ships Linux wheels only")


def fresh_kernel(*sources: str) -> list[str]:
    """What each cell printed (stdout, stderr and any traceback), run in order in one fresh kernel."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    env = {k: v for k, v in execute_notebooks._kernel_env().items() if k != "TRITON_INTERPRET"}
    env["FLASHLIB_PROGRESS"] = "off"  # a passing lab would leave its record in notebooks/
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                            kernel_manager_class=execute_notebooks._ThisPythonKernelManager)
    client.execute(env=env, cwd=str(ROOT / "notebooks"))
    printed = []
    for cell in nb.cells:
        text = []
        for output in cell.outputs:
            if output.output_type == "stream":
                text.append(output.text)
            elif output.output_type == "error":
                text.append(f"{output.ename}: {output.evalue}")
        printed.append("".join(text))
    return printed


def stored_cell(name: str) -> str:
    nb = nbformat.read(ROOT / "notebooks" / f"{labs.LABS[name].notebook}.ipynb", as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code" and cells.marked(c.source) == name]
    assert len(found) == 1, f"{name}: expected one lab cell in its notebook, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_triton if spec.triton else ())
                                  for name, spec in labs.LABS.items()])
def test_a_labs_cell_runs_first_in_a_fresh_kernel(name):
    stub, solved = fresh_kernel(stored_cell(name), cells.code_cell(name, solved=True))
    assert stub.startswith("NOT YET: no answer yet; expected a function"), stub
    assert solved.startswith(f"PASS: {name}"), solved


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Triton compiles whatever the import order")
def test_triton_imported_first_gets_a_message_not_a_traceback():
    first, lab = fresh_kernel("import triton", cells.code_cell("attn_fwd_inner", solved=True))
    assert first == ""
    assert lab.startswith("NOT YET: Triton was imported before flashlib could switch on its CPU interpreter"), lab
    assert "Restart the kernel" in lab
