"""The notebooks on any machine (flashlib.bench.notebooks, nbval_results): each notebook under
nbval in its own process, its entry in the results file written cell by cell, checked against
nbval run as CI runs it on a notebook with planted passes and failures."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashlib.bench import notebooks
from flashlib.bench.nbval_results import DEVICE_TAG, first_line, text_of, write_entry

from .fresh_envs import layer, pip_install, shared_env

ROOT = Path(__file__).resolve().parent.parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def _result(text, kind="execute_result", **more):
    return {"output_type": kind, "data": {"text/plain": text, **more}, "metadata": {}}


# (source, stored outputs, what nbval says: passed, failed or skipped)
PLANTED = [
    ("%matplotlib inline\nimport sys", [], "passed"),
    ('print("tile 2 of 3")', [_stream("tile 2 of 3\n")], "passed"),
    ('print("took 12.5 ms")', [_stream("took 3 ms\n")], "passed"),                      # sanitized: TIME
    ("1 + 1", [_result("2")], "passed"),
    ("import ipywidgets\nipywidgets.IntSlider(value=3)",
     [_result("IntSlider(value=3)", **{WIDGET_VIEW: {"model_id": "a", "version_major": 2, "version_minor": 0}})],
     "passed"),                                                                        # the view is not compared
    ("import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(3, 2))\nax.plot([1, 2]);",
     [_result("[<matplotlib.lines.Line2D at 0x7f00deadbeef>]"),  # nbval sends no history: ';' hides nothing
      _result("<Figure size 300x200 with 1 Axes>", kind="display_data", **{"image/png": "iVBORw0KGgo="})],
     "passed"),                                                                        # the image is not compared
    ("# NBVAL_IGNORE_OUTPUT\nimport random\nprint(random.random())", [_stream("0.5\n")], "passed"),
    ('# NBVAL_RAISES_EXCEPTION\nraise ValueError("planted")',
     [{"output_type": "error", "ename": "ValueError", "evalue": "planted", "traceback": ["stored"]}], "passed"),
    ('# NBVAL_SKIP\nraise RuntimeError("never run")', [], "skipped"),
    ('print("answer:", 6 * 7)', [_stream("answer: 41\n")], "failed"),                  # a planted difference
    ('{}["missing"]', [], "failed"),                                                   # an exception
    ('print("to stderr", file=sys.stderr)', [_stream("to stderr\n", "stderr")], "passed"),
    ('print("a")\nprint("b")', [_stream("a\n"), _stream("b\n")], "passed"),             # streams joined
    ('print("on this machine")', [_stream("on another machine\n")], "failed"),          # tagged device-dependent
    ("x = 1", [], "passed"),                                                           # never run when stored
]
TAGGED = 13  # the cell tagged device-dependent-output


def planted_notebook(path: Path) -> Path:
    cells = [{"cell_type": "markdown", "id": "title", "metadata": {}, "source": ["# planted\n"]}]
    for i, (source, outputs, _) in enumerate(PLANTED):
        cells.append({"cell_type": "code", "execution_count": None if source == "x = 1" else i + 1,
                      "id": f"cell-{i}", "metadata": {"tags": [DEVICE_TAG]} if i == TAGGED else {},
                      "outputs": outputs, "source": source.splitlines(True)})
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}}
    path.write_text(json.dumps(nb, indent=1))
    return path


def _nbval_says(path: Path) -> dict[int, str]:
    """{cell: passed/failed/skipped} from nbval itself, as CI runs it."""
    done = subprocess.run([sys.executable, "-m", "pytest", str(path), "--nbval", "--nbval-sanitize-with",
                           str(notebooks.SANITIZE_CFG), "-p", "no:cacheprovider", "-v", "--color=no"],
                          capture_output=True, text=True, timeout=300, cwd=path.parent)
    said = {int(cell): verdict.lower() for cell, verdict in
            re.findall(r"::Cell (\d+) (PASSED|FAILED|SKIPPED)", done.stdout)}
    assert said, done.stdout[-3000:] + done.stderr[-3000:]
    return said


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_notebook(tmp_path_factory.mktemp("planted") / "planted.ipynb")


def test_the_runner_says_what_nbval_says_on_a_planted_notebook(planted, tmp_path):
    expected = {i: verdict for i, (_, _, verdict) in enumerate(PLANTED)}
    assert _nbval_says(planted) == expected
    # through the course runner, in the environment the stored outputs were written in
    (entry,) = notebooks.run_course([planted], tmp_path / "results.json", budget_s=300, log=lambda *a: None)["notebooks"]
    ours = {c["cell"]: {"differed": "failed"}.get(c["status"], c["status"]) for c in entry["cells"]}
    assert ours == expected and entry["status"] == "failed"
    by_cell = {c["cell"]: c for c in entry["cells"]}
    assert by_cell[9]["status"] == "differed" and "answer: 42" in by_cell[9]["difference"]
    assert by_cell[9]["outputs"] == "answer: 42\n"
    assert by_cell[10]["error"] == "KeyError: 'missing'" and "KeyError" in by_cell[10]["traceback"]
    assert by_cell[6]["outputs"] and by_cell[6]["note"].startswith("output not compared")
    assert by_cell[TAGGED]["status"] == "differed"  # compared, as CI compares it
    assert [c["index"] for c in entry["cells"]] == list(range(1, len(PLANTED) + 1))
    assert by_cell[4]["line"] == "import ipywidgets" and all(c["seconds"] >= 0 for c in entry["cells"])


def test_a_device_dependent_cell_is_run_and_reported_but_not_compared(planted, tmp_path):
    (entry,) = notebooks.run_course([planted], tmp_path / "results.json", budget_s=300, device_dependent="report",
                                    log=lambda *a: None)["notebooks"]
    cell = {c["cell"]: c for c in entry["cells"]}[TAGGED]
    assert cell["status"] == "not compared" and cell["outputs"] == "on this machine\n"
    assert "on another machine" in cell["would_differ"]
    assert {c["cell"]: c["status"] for c in entry["cells"] if c["status"] != "passed"} == {
        8: "skipped", 9: "differed", 10: "failed", TAGGED: "not compared"}


def test_cells_are_named_and_shown_by_their_text():
    assert first_line("# a comment\n\nx = f(1)\ny") == "x = f(1)"
    assert first_line("# NBVAL_SKIP") == "# NBVAL_SKIP"
    assert text_of([_stream("a\n"), _result("2"), {"output_type": "error", "ename": "E", "evalue": "v"},
                    _result("<Figure>", kind="display_data", **{"image/png": "A"})]) == "a\n2\nE: v\n<Figure>\n"


def test_the_environment_is_the_one_the_stored_outputs_were_written_in(tmp_path):
    fixed = notebooks.fixed_env()
    assert fixed["PYTHONHASHSEED"] == "0" and fixed["OMP_NUM_THREADS"] == "1"
    assert fixed["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"
    (tmp_path / "writer.py").write_text("ENV = {}\n")
    with pytest.raises(ValueError, match="'writer'"):
        notebooks.fixed_env(tmp_path / "writer.py")


def test_the_course_runs_in_order_within_its_budget(tmp_path):
    now, calls = [0.0], []
    paths = [Path(f"/nowhere/{i:02d}_x.ipynb") for i in (1, 2, 3, 4)]

    def run(path, order, result_path, timeout_s, device_dependent):
        calls.append((path.name, order, timeout_s, device_dependent))
        now[0] += {0: 100.0, 1: 300.0}.get(order, 1.0)
        write_entry(result_path, dict(notebook=path.name, order=order, status="passed", cells=[]))

    results = notebooks.run_course(paths, tmp_path / "r.json", budget_s=420.0, device_dependent="report",
                                   clock=lambda: now[0], run=run, log=lambda *a: None)
    # the first notebook may take at most NOTEBOOK_TIMEOUT_S; after 400 s, 20 s are left: one more
    # starts (within what is left), and the last is listed as not run
    assert calls == [("01_x.ipynb", 0, notebooks.NOTEBOOK_TIMEOUT_S, "report"),
                     ("02_x.ipynb", 1, notebooks.NOTEBOOK_TIMEOUT_S, "report"), ("03_x.ipynb", 2, 20.0, "report")]
    assert [(e["notebook"], e["status"]) for e in results["notebooks"]] == [
        ("01_x.ipynb", "passed"), ("02_x.ipynb", "passed"), ("03_x.ipynb", "passed"), ("04_x.ipynb", "not run")]
    assert json.loads((tmp_path / "r.json").read_text()) == results
    assert [p.name[:2] for p in notebooks.course()] == sorted(p.name[:2] for p in notebooks.course())


def test_a_notebook_stopped_while_a_cell_runs_says_which(tmp_path):
    path = tmp_path / "r.json"
    write_entry(path, dict(notebook="07_x.ipynb", order=6, status="running", cells=[
        dict(cell=0, index=1, line="import torch", status="passed"),
        dict(cell=1, index=3, line="train()", status="running")]))
    notebooks._close_entry(path, "07_x.ipynb", 6, "stopped at the time limit of 180 s", 180.2)
    (entry,) = json.loads(path.read_text())["notebooks"]
    assert entry["status"] == "failed" and entry["cells"][1]["status"] == "failed"
    assert entry["cells"][1]["error"] == "stopped at the time limit of 180 s"
    text = notebooks.format_results({"notebooks": [entry]})
    assert text.splitlines() == ["07_x.ipynb: failed (2 cells, 180.2 s): stopped at the time limit of 180 s",
                                 "  Cell 1 (cell 3, 'train()'): failed: stopped at the time limit of 180 s"]
    notebooks._close_entry(path, "08_x.ipynb", 7, "the notebook's process ended with exit status 1", 2.0)
    assert json.loads(path.read_text())["notebooks"][1]["status"] == "failed"  # never wrote an entry itself


# what the GPU machine's image has (and the carried wheels leave out); torch first, the pinned build
GPU_IMAGE = ["torch", "triton", "numpy", "matplotlib", "pytest", "psutil", "packaging", "python-dateutil", "attrs",
             "pygments", "typing-extensions", "coverage"]


@pytest.mark.skipif(sys.platform != "linux", reason="the carried wheels are for x86-64 Linux")
def test_the_carried_wheels_run_the_notebooks_under_nbval_in_a_fresh_interpreter(planted, tmp_path,
                                                                                  tmp_path_factory):
    """The GPU machine's mechanism on the CPU: a fresh environment holding only what that machine's
    image has, the wheels tools/notebook_wheels.sh fetches (for this CPython) installed with
    --no-index into a folder on PYTHONPATH, and the course runner (nbval) on the planted notebook
    and on notebook 01, which must run as stored."""
    env_dir, wheels, site = tmp_path / "env", tmp_path / "wheels", tmp_path / "site"
    python = layer(shared_env(tmp_path_factory), env_dir)  # torch, Triton, numpy, matplotlib (test_runtime's too)
    pip_install(python, *GPU_IMAGE)  # and the rest of the image, into this environment's own site-packages
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run(["sh", str(ROOT / "tools" / "notebook_wheels.sh")], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHON=sys.executable, PYVER=version, DEST=str(wheels)))
    assert done.returncode == 0, done.stderr[-3000:]
    # as tools/gpu_check.sh installs them there
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "JUPYTER"))}
    env["PYTHONPATH"] = str(site)
    probe = "import IPython, ipykernel, nbval, zmq, ipywidgets; print(nbval.__file__, zmq.__file__, IPython.__file__)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and all(p.startswith(str(site)) for p in done.stdout.split()), done.stderr
    course = tmp_path / "course"
    course.mkdir()
    shutil.copy(planted, course / "planted.ipynb")
    shutil.copy(ROOT / "notebooks" / "01_dense_attention.ipynb", course)
    done = subprocess.run([str(python), "-m", "flashlib.bench.notebooks", "01_dense_attention.ipynb", "planted.ipynb",
                           "--result", str(tmp_path / "r.json"), "--device-dependent", "report"], cwd=course,
                          env=dict(env, PYTHONPATH=f"{site}{os.pathsep}{ROOT}"), capture_output=True, text=True,
                          timeout=900)
    first, planted_entry = json.loads((tmp_path / "r.json").read_text())["notebooks"]
    assert first["notebook"] == "01_dense_attention.ipynb" and first["status"] == "passed", done.stdout[-3000:]
    assert {c["cell"]: c["status"] for c in planted_entry["cells"] if c["status"] != "passed"} == {
        8: "skipped", 9: "differed", 10: "failed", TAGGED: "not compared"}


def test_notebooks_run_side_by_side_and_none_is_lost(tmp_path):
    """jobs=3: three notebooks at a time, each started once, in course order; every entry kept."""
    import threading

    paths = [Path(f"/nowhere/{i:02d}_x.ipynb") for i in range(1, 8)]
    running, most, started, lock = [0], [0], [], threading.Lock()

    def run(path, order, result_path, timeout_s, device_dependent):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            started.append(path.name)
        time.sleep(0.3)
        write_entry(result_path, dict(notebook=path.name, order=order, status="passed", cells=[]))
        with lock:
            running[0] -= 1

    results = notebooks.run_course(paths, tmp_path / "r.json", budget_s=300, jobs=3, run=run, log=lambda *a: None)
    assert most[0] == 3 and started[:3] == sorted(started[:3]) and sorted(started) == [p.name for p in paths]
    assert [e["notebook"] for e in results["notebooks"]] == [p.name for p in paths] and results["jobs"] == 3


def test_entries_written_by_processes_at_once_are_all_kept(tmp_path):
    """The results file is rewritten by each notebook's own process: 6 processes, 40 entries each. Each loads
    the plugin's file alone (flashlib's __init__ would import torch, which writing an entry does not need), so
    that the six start together and write at once."""
    import flashlib.bench.nbval_results as plugin

    path = tmp_path / "r.json"
    script = ("import importlib.util, sys\n"
              "spec = importlib.util.spec_from_file_location('nbval_results', sys.argv[3])\n"
              "plugin = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(plugin)\n"
              "for i in range(40):\n"
              "    plugin.write_entry(sys.argv[1], dict(notebook=f'{sys.argv[2]}-{i}', order=i, status='passed', "
              "cells=[]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), f"nb{j}", plugin.__file__]) for j in range(6)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    names = {e["notebook"] for e in json.loads(path.read_text())["notebooks"]}
    assert names == {f"nb{j}-{i}" for j in range(6) for i in range(40)}
