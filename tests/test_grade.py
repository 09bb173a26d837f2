"""The grader (python -m flashlib labs grade) and the progress a student's passes leave beside the notebooks.

A class's folder of saved notebooks, some labs right, some wrong, one cell that raises, some cells that try
to earn what they should not, is graded from the files alone: each graded cell in a process and an empty
folder of its own, after only the imports of the cells before it, credited only by its own checker's report.
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
    (folder / "ada").mkdir()
    _notebook(folder / "ada" / "02_online_softmax.ipynb",
              "x = 1 / 0  # never run by the grader: not a graded cell",
              cells.code_cell("online_softmax", solved=True),                     # right
              _wrong("merge_states", "l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b"))
    _notebook(folder / "ada" / "10_inference.ipynb",
              "from flashlib.course import inference\n\nstate = 'from an earlier cell'",
              "answer = 10  # GiB\ninference.check_cache_gib(answer)",                # right, needs the import above
              "answer = None\ninference.check_step_time(answer)",                  # no answer yet
              "inference.check_gather(gather)",                                   # raises: gather never defined
              "print(state)\ninference.check_cache_gib(80)",                     # the earlier cell's state is not kept
              cells.code_cell("split_kv", solved=True))
    # a second student, whose cells try to earn what they should not
    cheat = folder / "bo" / "week 1"
    cheat.mkdir(parents=True)
    wrong_merge = _wrong("merge_states", "l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b")
    _notebook(cheat / "02_online_softmax.ipynb",
              wrong_merge.replace("\n", '\nprint("PASS: merge_states is right")\n', 1),      # a printed PASS
              "# LAB: merge_states\nfrom flashlib import labs\n\n"
              "labs.check = lambda name, fn: print(f'PASS: {name} is right')\nlabs.check('merge_states', None)",
              "# LAB: merge_states\n" + cells.code_cell("online_softmax", solved=True),  # another lab's checker
              "# LAB: online_softmax\nimport pathlib\n\n"                                 # a planted flashlib
              "pathlib.Path('flashlib').mkdir()\n"
              "pathlib.Path('flashlib/__init__.py').write_text('PLANTED = True')\n"
              "from flashlib import labs\nlabs.check('online_softmax', None)",
              "# LAB: online_softmax\nimport flashlib\n\nprint(getattr(flashlib, 'PLANTED', False))\n"
              "from flashlib.course import exercises\nexercises._passed('online_softmax is right')")
    # a package of the same name shipped beside the submission: never imported
    (cheat / "flashlib").mkdir()
    (cheat / "flashlib" / "__init__.py").write_text("raise SystemExit('the submission\'s flashlib ran')\n")
    return folder


@pytest.fixture(scope="module")
def graded(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("grades")
    env = {k: v for k, v in os.environ.items() if k != "FLASHLIB_PROGRESS"}
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", str(folder), "--json",
                           str(out / "grades.json"), "--csv", str(out / "grades.csv"), "--jobs", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((out / "grades.json").read_text()), (out / "grades.csv").read_text()


def test_every_graded_cell_gets_its_verdict_from_the_saved_files(graded, folder):
    _, rows, _ = graded
    assert all(set(row) == {"student", "notebook", "lab", "passed", "message", "mistake", "seconds"} for row in rows)
    assert all(isinstance(row["passed"], bool) and row["seconds"] > 0 for row in rows)
    ada = [row for row in rows if row["student"] == str(folder / "ada")]
    seen = [(row["notebook"], row["lab"], row["passed"]) for row in ada]
    assert seen == [("02_online_softmax.ipynb", "online_softmax", True),
                    ("02_online_softmax.ipynb", "merge_states", False),
                    ("10_inference.ipynb", "cache_gib", True),
                    ("10_inference.ipynb", "step_time", False),
                    ("10_inference.ipynb", "gather", False),
                    ("10_inference.ipynb", "cache_gib", False),
                    ("10_inference.ipynb", "split_kv", True)]
    messages = [row["message"] for row in ada]
    assert messages[0].startswith("PASS: online_softmax is right in all")
    assert messages[1].startswith("NOT YET: merge_states, case ")  # the checker's first line
    assert ada[1]["mistake"] == "no_rescale"  # the mistake the checker named
    assert messages[3] == "NOT YET: no answer yet; expected a number of microseconds."
    assert messages[4] == "the cell raised NameError: name 'gather' is not defined"
    assert messages[5] == "the cell raised NameError: name 'state' is not defined"


def test_nothing_earns_what_its_own_checker_did_not_report(graded, folder):
    """A printed PASS, a replaced labs.check, another lab's checker, a flashlib planted by an earlier
    cell or shipped beside the notebooks, a verdict printed by hand: none is credited."""
    _, rows, _ = graded
    bo = [row for row in rows if row["student"] == str(folder / "bo" / "week 1")]
    assert [(row["lab"], row["passed"]) for row in bo] == [
        ("merge_states", False), ("merge_states", False), ("merge_states", False), ("online_softmax", False),
        ("online_softmax", False)]
    assert bo[0]["message"].startswith("NOT YET: merge_states, case ")  # the real checker, not the print
    assert bo[1]["message"] == "no checker of merge_states ran (a printed PASS is not a verdict)"
    assert bo[2]["message"] == ("the cell ran the checker of online_softmax, not of merge_states: no credit for "
                                "merge_states")
    assert bo[3]["message"] == "NOT YET: no answer yet; expected a function online_softmax(blocks) -> (m, l)."
    assert bo[4]["message"] == "no checker of online_softmax ran (a printed PASS is not a verdict)"


def test_the_table_and_the_csv_give_each_student_a_total(graded, folder):
    printed, rows, csv_text = graded
    lines = printed.strip().splitlines()
    assert lines[0].split() == ["student", "notebook", "lab", "passed", "seconds", "message"]
    assert len(lines) == len(rows) + 2 + 2 and lines[-1] == f"3 of {len(rows)} graded cells passed."
    totals = {line.split("  total: ")[0].rstrip(): line.split("  total: ")[1] for line in lines if "  total: " in line}
    assert totals == {str(folder / "ada"): "3 of 7 passed", str(folder / "bo" / "week 1"): "0 of 5 passed"}
    import csv
    import io

    table = list(csv.DictReader(io.StringIO(csv_text)))
    assert len(table) == len(rows) + 2
    totals = {r["student"]: r["message"] for r in table if r["lab"] == "total"}
    assert totals == {str(folder / "ada"): "3 of 7 passed", str(folder / "bo" / "week 1"): "0 of 5 passed"}
    assert not list(folder.rglob(".flashlib-progress.json"))  # grading writes nothing beside the notebooks
    assert not (folder / "bo" / "week 1" / "flashlib" / "__pycache__").exists()  # the shipped package never ran


def test_a_cell_past_its_time_or_memory_is_stopped(tmp_path):
    sleepy = _notebook(tmp_path / "sleepy.ipynb", "import time\nfrom flashlib.course import inference\n\n"
                                                  "time.sleep(60)\ninference.check_cache_gib(10)")
    greedy = _notebook(tmp_path / "greedy.ipynb", "import torch\nfrom flashlib.course import inference\n\n"
                                                  "big = torch.ones(2**28)  # 1 GiB\ninference.check_cache_gib(10)")
    (row,) = grade.grade([sleepy], timeout=8)
    assert row.passed is False and row.message == "the cell ran past 8 s" and row.seconds < 30
    (row,) = grade.grade([greedy], memory_mib=700)
    assert row.passed is False and row.message == "the cell used more than 700 MiB of memory"
    (row,) = grade.grade([greedy])  # within the default
    assert row.passed is True


def test_a_bad_argument_is_named():
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", "missing.ipynb"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "argument PATH 'missing.ipynb' is neither a notebook file" in done.stderr
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", ".", "--jobs", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--jobs must be at least 1, got 0" in done.stderr


def test_the_graded_cells_of_a_course_notebook_are_its_lab_and_exercises():
    nb = nbformat.read(ROOT / "notebooks" / "10_inference.ipynb", as_version=4)
    found = grade.graded_cells(nb)
    assert [name for name, _, _ in found] == ["step_time", "cache_gib", "gather", "split_kv"]
    imports = found[0][1]
    assert "from flashlib.course import inference" in imports and "%matplotlib" not in imports
    assert "subprocess" not in imports  # the setup cell, which installs flashlib on a bare runtime, is left out


def test_a_verdict_is_the_report_of_the_checker_graded():
    heard = [dict(name="online_softmax", passed=True, message="PASS: right", mistake=None),
             dict(name="merge_states", passed=False, message="NOT YET: wrong", mistake="no_rescale")]
    result = dict(verdicts=heard, raised=None)
    assert grade.verdict(result, "merge_states") == (False, "NOT YET: wrong", "no_rescale")
    assert grade.verdict(result, "online_softmax") == (True, "PASS: right", None)
    assert grade.verdict(result, "split_kv")[1].startswith("the cell ran the checker of merge_states, online_softmax")
    raised = dict(verdicts=heard, raised="ValueError: no")
    assert grade.verdict(raised, "online_softmax") == (False, "the cell raised ValueError: no", None)
    assert grade.verdict(dict(verdicts=[], raised=None), "x")[1] == "no checker of x ran (a printed PASS is not a verdict)"


def test_a_report_counts_only_from_the_courses_own_checkers():
    from flashlib.course import exercises, inference, verdicts
    from flashlib.course.ring import Verdict

    heard = []
    verdicts.listen(heard.append)
    try:
        inference.check_cache_gib(10)                        # a checker: heard, under its name
        verdicts.report(True, "PASS: forged")                # called from here: not flashlib's code
        exercises._passed("forged")                          # a checker's helper, with no checker running
        Verdict(True, "forged")

        def check_cache_gib(answer):                         # a checker of one's own, named as the course's
            return exercises._passed("forged")

        check_cache_gib(1)
    finally:
        verdicts.listen(None)
    assert [(h["name"], h["passed"], h["message"]) for h in heard] == [("cache_gib", True, "PASS: 10 GiB.")]


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
    NotebookClient(nb, timeout=300, kernel_name="python3", kernel_manager_class=_this_python()).execute(
        env=env, cwd=str(tmp_path))
    assert nb.cells[0].outputs[0].text.startswith("PASS: merge_states")
    assert list(json.loads((tmp_path / ".flashlib-progress.json").read_text())["passed"]) == ["merge_states"]


def _this_python():
    """A kernel manager whose 'python3' is this Python (not whatever a user registered under that name)."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="Python 3 (ipykernel)", language="python", resource_dir="")

    class Manager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _this_python(self):
            return ThisPython(data_dir=self.data_dir)

    return Manager
