"""The grader (python -m flashlib labs grade) and the progress a student's passes leave beside the notebooks.

A class's folder of saved notebooks, some cells right, some wrong, one deleted, one pasted twice, one that
raises, with a roster naming a student who handed in nothing, is graded from the files alone by the grader of
a copy of the course run from that copy: the gradebook's points, totals, wide and long files, feedback files,
timestamps and digests are read back as an instructor would.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashlib import labs
from flashlib.labs import cells, grade
from flashlib.labs import progress_file as progress

ROOT = Path(__file__).resolve().parent.parent
ONLINE_STATE = (7.0, sum(math.exp(x - 7.0) for x in (2.0, 5.0, 1.0, 7.0)))


def _notebook(path: Path, *sources: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


def _wrong(name: str, old: str, new: str) -> str:
    source = cells.code_cell(name, solved=True)
    assert old in source
    return source.replace(old, new)


NO_RESCALE = ("l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("class")
    _notebook(folder / "ada" / "02_online_softmax.ipynb",
              "x = 1 / 0  # never run by the grader: not a graded cell",
              f"from flashlib.course import exercises\n\nanswer = {ONLINE_STATE!r}\n"
              "passed = exercises.check_online_state(answer)",                       # right; new_denominator deleted
              cells.code_cell("online_softmax", solved=True),                        # right
              _wrong("merge_states", *NO_RESCALE),                                   # wrong: the first counts
              cells.code_cell("merge_states", solved=True))                          # pasted again, right: ignored
    _notebook(folder / "ada" / "10_inference.ipynb",
              "from flashlib.course import inference\n\nstate = 'from an earlier cell'",
              "answer = 10  # GiB\ninference.check_cache_gib(answer)",                # right, needs the import above
              "answer = None\ninference.check_step_time(answer)",                    # no answer yet
              "print(state)\ninference.check_gather(gather)",                       # raises: state is not kept
              cells.code_cell("split_kv", solved=True))
    cheat = folder / "bo" / "week 1"
    _notebook(cheat / "02_online_softmax.ipynb",
              _wrong("merge_states", *NO_RESCALE).replace("\n", '\nprint("PASS: merge_states is right")\n', 1),
              "# LAB: online_softmax\nimport pathlib\n\n"                         # a flashlib planted in its folder
              "pathlib.Path('flashlib').mkdir()\n"
              "pathlib.Path('flashlib/__init__.py').write_text('PLANTED = True')\n"
              "import flashlib\nassert not hasattr(flashlib, 'PLANTED')\n"
              + cells.code_cell("online_softmax", solved=True).split("\n", 1)[1])
    (cheat / "flashlib").mkdir()  # a package of the same name shipped beside the submission: never imported
    (cheat / "flashlib" / "__init__.py").write_text("raise SystemExit('the submission\'s flashlib ran')\n")
    (folder / "roster.txt").write_text("# ids\nada\nbo/week 1\ncy\n")
    return folder


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """A copy of the course: the grader is run from it, whatever flashlib the interpreter would import."""
    copy = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "flashlib", copy / "flashlib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "notebooks", copy / "notebooks", ignore=shutil.ignore_patterns("*.png", "*.svg"))
    return copy


@pytest.fixture(scope="module")
def graded(folder, course, tmp_path_factory):
    out = tmp_path_factory.mktemp("grades")
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHLIB_PROGRESS", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "flashlib", "labs", "grade", str(folder), "--out", str(out),
                           "--roster", str(folder / "roster.txt"), "--jobs", "2"],
                          cwd=course, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((out / "grades.json").read_text()), out


def _rows(data, student):
    return [r for r in data["rows"] if r["student"] == student]


def test_every_item_of_the_assignment_gets_its_row(graded):
    _, data, _ = graded
    ada = [(r["item"], r["status"], r["points"], r["possible"]) for r in _rows(data, "ada")]
    assert ada == [("02_online_softmax:online_state", "graded", 5, 5),
                   ("02_online_softmax:new_denominator", "missing", 0, 5),       # deleted: 0
                   ("02_online_softmax:online_softmax", "graded", 30, 30),
                   ("02_online_softmax:merge_states", "graded", 0, 30),          # the first cell, wrong
                   ("02_online_softmax:merge_states", "duplicate", 0, 0),         # pasted again: not graded
                   ("10_inference:step_time", "graded", 0, 5),
                   ("10_inference:cache_gib", "graded", 5, 5),
                   ("10_inference:gather", "graded", 0, 5),
                   ("10_inference:split_kv", "graded", 30, 30)]
    by_item = {r["item"]: r for r in _rows(data, "ada") if r["status"] != "duplicate"}
    merge = by_item["02_online_softmax:merge_states"]
    assert merge["mistake"] == "no_rescale" and merge["message"].startswith("NOT YET: merge_states, case ")
    assert "\n  mistake: no rescale when the max grew" in merge["message"]  # the checker's whole message
    assert by_item["10_inference:step_time"]["message"] == "NOT YET: no answer yet; expected a number of microseconds."
    assert by_item["10_inference:gather"]["message"] == "the cell raised NameError: name 'state' is not defined"
    assert by_item["02_online_softmax:new_denominator"]["message"].startswith("no cell of new_denominator")


def test_the_courses_items_and_their_points(graded):
    _, data, _ = graded
    points = {i["id"]: i["points"] for i in data["items"]}
    assert points == {"02_online_softmax:online_state": 5, "02_online_softmax:new_denominator": 5,
                      "02_online_softmax:online_softmax": 30, "02_online_softmax:merge_states": 30,
                      "10_inference:step_time": 5, "10_inference:cache_gib": 5, "10_inference:gather": 5,
                      "10_inference:split_kv": 30}
    assert data["points"] == {"exercise": 5, "lab": 30, "kernel lab": 45}


def test_a_printed_pass_or_a_planted_package_earns_nothing(graded, folder):
    _, data, _ = graded
    bo = {r["item"]: r for r in _rows(data, "bo/week 1")}
    assert bo["02_online_softmax:merge_states"]["passed"] is False
    assert bo["02_online_softmax:merge_states"]["message"].startswith("NOT YET: merge_states, case ")
    assert bo["02_online_softmax:online_softmax"]["passed"] is True  # its own flashlib, not the planted one
    assert not (folder / "bo" / "week 1" / "flashlib" / "__pycache__").exists()  # the shipped package never ran
    assert not list(folder.rglob(".flashlib-progress.json"))  # grading writes nothing beside the notebooks


def test_a_student_on_the_roster_with_no_folder_gets_zero(graded):
    _, data, _ = graded
    cy = _rows(data, "cy")
    assert len(cy) == 8 and all(r["status"] == "no submission" and r["points"] == 0 for r in cy)
    totals = {s["student"]: (s["points"], s["possible"], s["percent"]) for s in data["students"]}
    assert totals == {"ada": (70, 115, 60.9), "bo/week 1": (30, 115, 26.1), "cy": (0, 115, 0.0)}


def test_the_wide_sheet_has_a_row_per_student(graded):
    _, data, out = graded
    table = list(csv.reader(io.StringIO((out / "grades.csv").read_text())))
    assert table[0] == ["id", *(i["id"] for i in data["items"]), "total", "possible", "percent"]
    rows = {r[0]: r[1:] for r in table[1:]}
    assert list(rows) == ["ada", "bo/week 1", "cy"]
    assert rows["ada"] == ["5", "0", "30", "0", "0", "5", "0", "30", "70", "115", "60.9"]
    assert rows["cy"][-3:] == ["0", "115", "0.0"]


def test_the_long_files_keep_when_and_what_was_graded(graded, folder):
    done, data, out = graded
    long_csv = list(csv.DictReader(io.StringIO((out / "rows.csv").read_text())))
    assert [r["message"] for r in long_csv] == [r["message"] for r in data["rows"]]
    nb = nbformat.read(folder / "ada" / "02_online_softmax.ipynb", as_version=4)
    merge = next(r for r in data["rows"] if r["student"] == "ada" and r["name"] == "merge_states")
    assert merge["source_sha256"] == hashlib.sha256(nb.cells[3].source.encode()).hexdigest()
    graded_rows = [r for r in data["rows"] if r["status"] == "graded" and r["seconds"] is not None]
    assert graded_rows and all(r["graded_at"] >= data["graded_at"][:10] for r in graded_rows)
    assert all(r["sandboxed"] == data["sandboxed"] for r in data["rows"])
    first = done.stdout.splitlines()[0]
    assert first.startswith("labs grade: sandboxed with bubblewrap" if data["sandboxed"] else
                            "labs grade: NOT SANDBOXED: ")


def test_each_student_gets_a_feedback_file(graded):
    _, _, out = graded
    files = sorted(p.name for p in (out / "feedback").iterdir())
    assert files == ["ada.md", "bo_week_1.md", "cy.md"]
    ada = (out / "feedback" / "ada.md").read_text()
    assert ada.startswith("# ada: 70 of 115 points (60.9%)")
    assert "## 02_online_softmax:merge_states (lab): 0 of 30" in ada and "mistake: no rescale" in ada


def test_progress_is_shown_as_cells_finish_and_the_table_ends_each_student(graded):
    done, data, _ = graded
    count = sum(r["status"] == "graded" for r in data["rows"])
    steps = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(steps) == count and steps[-1].startswith(f"[{count}/{count}] ")
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["student", "notebook", "item", "points", "passed", "seconds", "message"]
    assert "ada total: 70 of 115 points (60.9%)" in [" ".join(line.split()) for line in lines]
    assert lines[-1] == "3 students, 8 items: 100 of 345 points in all; 0 cells could not be graded."


def test_a_cell_past_its_time_or_memory_is_stopped(tmp_path):
    sleepy = _notebook(tmp_path / "a" / "sleepy.ipynb", "import time\nfrom flashlib.course import inference\n\n"
                                                         "time.sleep(60)\ninference.check_cache_gib(10)")
    greedy = _notebook(tmp_path / "b" / "sleepy.ipynb", "import torch\nfrom flashlib.course import inference\n\n"
                                                         "big = torch.ones(2**28)  # 1 GiB\n"
                                                         "inference.check_cache_gib(10)")
    fine = _notebook(tmp_path / "c" / "sleepy.ipynb", "from flashlib.course import inference\n\n"
                                                       "inference.check_cache_gib(10)")
    book = grade.grade([sleepy.parent.parent], timeout=4, memory_mib=700)  # the fine cell takes well under 1 s
    rows = {r.student: r for r in book.rows}
    assert rows["a"].message == "the cell ran past 4 s" and rows["a"].seconds < 30 and not rows["a"].passed
    assert rows["b"].message.startswith("the cell used more than 700 MiB of memory") and not rows["b"].passed
    assert rows["c"].passed and fine.exists()


def test_without_bubblewrap_the_run_says_it_is_not_sandboxed(tmp_path, monkeypatch, capsys):
    from flashlib.labs import sandbox

    _notebook(tmp_path / "class" / "ada" / "x.ipynb", "from flashlib.course import inference\n\n"
                                                       "inference.check_cache_gib(10)")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    assert grade.main([str(tmp_path / "class")], tmp_path / "g.json", csv_path=tmp_path / "g.csv") == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("labs grade: NOT SANDBOXED: bubblewrap (bwrap) is not installed here")
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["sandboxed"] is False and data["sandbox"].startswith("NOT SANDBOXED")
    (row,) = csv.DictReader(io.StringIO((tmp_path / "g.csv").read_text()))
    assert row["sandboxed"] == "False" and row["passed"] == "True"  # the judge still owns the verdict


def test_a_cell_that_could_not_be_graded_makes_the_exit_status_one(tmp_path, monkeypatch, capsys):
    from flashlib.labs import judge

    _notebook(tmp_path / "ada" / "x.ipynb", "from flashlib.course import inference\n\ninference.check_cache_gib(10)")
    monkeypatch.setattr(judge.Worker, "grade", lambda self, cell, timeout, memory: judge.Outcome(
        False, "not graded: the grader's worker failed (a test)", status="error"))
    assert grade.main([str(tmp_path)]) == 1
    assert "1 cells could not be graded" in capsys.readouterr().out


def test_a_bad_argument_is_named(monkeypatch, capsys):
    from flashlib.__main__ import main as flashlib_main  # the command line's own parser (the module fixtures
    # run it as python -m flashlib)

    monkeypatch.chdir(ROOT)
    assert flashlib_main(["labs", "grade", "missing.ipynb"]) == 2
    assert "argument PATH 'missing.ipynb' is neither a notebook file" in capsys.readouterr().err
    assert flashlib_main(["labs", "grade", ".", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_the_graded_cells_of_a_course_notebook_are_its_lab_and_exercises():
    nb = nbformat.read(ROOT / "notebooks" / "10_inference.ipynb", as_version=4)
    found = grade.graded_cells(nb)
    assert [(c.name, c.kind) for c in found] == [("step_time", "exercise"), ("cache_gib", "exercise"),
                                                 ("gather", "exercise"), ("split_kv", "lab")]
    assert found[0].module == "flashlib.course.inference" and found[0].arity == (1, ())
    assert "from flashlib.course import inference" in found[0].imports and "%matplotlib" not in found[0].imports
    assert "subprocess" not in found[0].imports  # the setup cell, which installs flashlib on a bare runtime, is left out


def test_a_roster_is_read_from_lines_or_a_csv(tmp_path):
    from flashlib.labs.gradebook import read_roster

    (tmp_path / "r.txt").write_text("ada\n\n# a comment\nbo\nada\n")
    (tmp_path / "r.csv").write_text("name,id\nAda Lovelace,ada\nBo,bo\n")
    assert read_roster(tmp_path / "r.txt") == ["ada", "bo"] and read_roster(tmp_path / "r.csv") == ["ada", "bo"]


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
