"""The grader (python -m flashlib labs grade) and the progress a student's passes leave beside the notebooks.

A folder of saved notebooks, some labs right, some wrong, one cell that raises, is graded from the files
alone: each graded cell in a fresh kernel, after only the imports of the cells before it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashlib import labs
from flashlib.labs import cells, grade
from flashlib.labs import progress_file as progress

ROOT = Path(__file__).resolve().parent.parent


def _notebook(path: Path, *sources: str) -> Path:
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


def _wrong(name: str, old: str, new: str) -> str:
    source = cells.code_cell(name, solved=True)
    assert old in source
    return source.replace(old, new)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("class")
    _notebook(folder / "02_online_softmax.ipynb",
              "x = 1 / 0  # never run by the grader: not a graded cell",
              cells.code_cell("online_softmax", solved=True),                     # right
              _wrong("merge_states", "l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b"))
    _notebook(folder / "10_inference.ipynb",
              "from flashlib.course import inference\n\nstate = 'from an earlier cell'",
              "answer = 10  # GiB\ninference.check_cache_gib(answer)",                # right, needs the import above
              "answer = None\ninference.check_step_time(answer)",                  # no answer yet
              "inference.check_gather(gather)",                                   # raises: gather never defined
              "print(state)\ninference.check_cache_gib(80)",                     # the earlier cell's state is not kept
              cells.code_cell("split_kv", solved=True))
    return folder


@pytest.fixture(scope="module")
def graded(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("grades") / "grades.json"
    env = {k: v for k, v in os.environ.items() if k != "FLASHLIB_PROGRESS"}
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", str(folder / "02_online_softmax.ipynb"),
                           str(folder / "10_inference.ipynb"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_every_graded_cell_gets_its_verdict_from_the_saved_files(graded):
    _, rows = graded
    assert all(set(row) == {"notebook", "lab", "passed", "message", "seconds"} for row in rows)
    assert all(isinstance(row["passed"], bool) and row["seconds"] > 0 for row in rows)
    seen = [(row["notebook"], row["lab"], row["passed"]) for row in rows]
    assert seen == [("02_online_softmax.ipynb", "online_softmax", True),
                    ("02_online_softmax.ipynb", "merge_states", False),
                    ("10_inference.ipynb", "cache_gib", True),
                    ("10_inference.ipynb", "step_time", False),
                    ("10_inference.ipynb", "gather", False),
                    ("10_inference.ipynb", "cache_gib", False),
                    ("10_inference.ipynb", "split_kv", True)]
    messages = [row["message"] for row in rows]
    assert messages[0].startswith("PASS: online_softmax is right in all")
    assert messages[1].startswith("NOT YET: merge_states, case ")  # the checker's first line
    assert messages[3] == "NOT YET: no answer yet; expected a number of microseconds."
    assert messages[4] == "the cell raised NameError: name 'gather' is not defined"
    assert messages[5] == "the cell raised NameError: name 'state' is not defined"


def test_the_table_has_a_row_per_cell_and_a_count(graded, folder):
    printed, rows = graded
    lines = printed.strip().splitlines()
    assert lines[0].split() == ["notebook", "lab", "passed", "seconds", "message"]
    assert len(lines) == len(rows) + 2 and lines[-1] == "3 of 7 graded cells passed."
    assert lines[2].split()[:3] == ["02_online_softmax.ipynb", "merge_states", "no"]
    assert not list(folder.glob(".flashlib-progress.json"))  # grading writes nothing beside the notebooks


def test_a_bad_argument_is_named():
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", "missing.ipynb"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "argument NOTEBOOK 'missing.ipynb' is not a notebook file" in done.stderr


def test_the_graded_cells_of_a_course_notebook_are_its_lab_and_exercises():
    nb = nbformat.read(ROOT / "notebooks" / "10_inference.ipynb", as_version=4)
    found = grade.graded_cells(nb)
    assert [name for name, _, _ in found] == ["step_time", "cache_gib", "gather", "split_kv"]
    imports = found[0][1]
    assert "from flashlib.course import inference" in imports and "%matplotlib" not in imports
    assert "subprocess" not in imports  # the setup cell, which installs flashlib on a bare runtime, is left out


def test_a_verdict_is_the_first_pass_or_not_yet_line():
    stream = nbformat.v4.new_output("stream", name="stdout", text="loading\nPASS: fine\nNOT YET: later\n")
    assert grade.verdict([stream]) == (True, "PASS: fine")
    shown = nbformat.v4.new_output("execute_result", data={"text/plain": "NOT YET: 3 is too small."})
    assert grade.verdict([shown]) == (False, "NOT YET: 3 is too small.")
    assert grade.verdict([]) == (False, "the cell printed no verdict (PASS or NOT YET)")


def test_a_pass_is_kept_beside_the_notebooks_and_survives_a_restart(tmp_path, monkeypatch, capsys):
    kept = tmp_path / ".flashlib-progress.json"
    monkeypatch.setenv("FLASHLIB_PROGRESS", str(kept))
    labs.check("merge_states", lambda m_a, l_a, m_b, l_b: (m_a, l_a))  # wrong: nothing kept
    assert not kept.exists()
    namespace = {}
    exec(labs.solution_source("merge_states"), namespace)
    assert labs.check("merge_states", namespace["merge_states"])
    first = json.loads(kept.read_text())["passed"]["merge_states"]
    labs.check("merge_states", namespace["merge_states"])
    assert json.loads(kept.read_text())["passed"] == {"merge_states": first}  # the first pass's time is kept
    capsys.readouterr()
    script = "from flashlib import labs\nshown = labs.progress()\nprint(sorted(n for n, ok in shown.items() if ok))"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLASHLIB_PROGRESS": str(kept)})
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "['merge_states']"  # a new process: a restarted kernel
    row = next(line for line in lines if " merge_states " in f" {line} ")
    assert row.split()[:3] == ["02_online_softmax", "merge_states", "yes"]
    assert f"1 of {len(labs.LABS)} labs passed" in done.stdout


def test_progress_is_kept_only_where_a_kernel_runs_or_a_file_is_named(monkeypatch):
    import types

    monkeypatch.delenv("FLASHLIB_PROGRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))  # as nbval imports it in pytest
    assert progress.path() is None  # a script or a test leaves no file behind

    class ZMQInteractiveShell:  # what IPython's get_ipython() returns inside a Jupyter kernel
        pass

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    assert progress.path() == Path(".flashlib-progress.json")  # the kernel's folder: the notebook's
    monkeypatch.setenv("FLASHLIB_PROGRESS", "off")
    assert progress.path() is None


def test_a_pass_in_a_jupyter_kernel_is_kept_in_its_folder(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cells.code_cell("merge_states", solved=True))])
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHLIB_PROGRESS", "TRITON_INTERPRET")}
    NotebookClient(nb, timeout=300, kernel_name="python3", kernel_manager_class=grade._kernel_manager()).execute(
        env=env, cwd=str(tmp_path))
    assert nb.cells[0].outputs[0].text.startswith("PASS: merge_states")
    assert list(json.loads((tmp_path / ".flashlib-progress.json").read_text())["passed"]) == ["merge_states"]
