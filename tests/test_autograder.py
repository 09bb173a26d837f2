"""The otter-grader autograder (python -m flashlib labs autograder), run by otter itself as Gradescope runs it.

An autograder of notebooks 02 and 03 is built with the command; two students' submissions of the student
edition's notebooks are graded by ``otter run -a autograder.zip SUBMISSION -o DIR`` (otter's own code, in a
process of its own, two at once), and the same notebooks by the course's grader (``labs grade``'s
machinery, in this process). One submission holds an honest lab and exercise, a lab with a known mistake
that prints PASS, an exercise that prints PASS after a wrong answer, and is handed in as a zip with a module
named ``otter``, a package named ``flashlib`` and an otter log that would run code when unpickled; the other
an honest exercise, untouched cells, a wrong number and a lab cell that only prints PASS. Points are read
from otter's results.json, item by item, and compared with the grader's rows and with what the cells earn.

make test installs otter-grader (pyproject.toml's extra "grading", pinned in constraints.txt); elsewhere
without it these tests are skipped.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from flashlib.__main__ import main as flashlib_main
from flashlib.labs import cells, grade

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import student_edition  # noqa: E402

if os.environ.get("CI") != "true":
    pytest.importorskip("otter", reason="otter-grader is not installed: make test installs it (.[grading])")

ITEMS = {"02_online_softmax:online_state": 5, "02_online_softmax:new_denominator": 5,
         "02_online_softmax:online_softmax": 30, "02_online_softmax:merge_states": 30,
         "03_tiled_attention:tile_count": 5, "03_tiled_attention:causal_tiles": 5,
         "03_tiled_attention:key_major_traffic": 5, "03_tiled_attention:tiled_forward": 30}
# what each student's cells earn (ada hands in 02, bo 03; the other notebook's items are not handed in)
EARNED = {"ada": {"02_online_softmax:online_state": 5, "02_online_softmax:online_softmax": 30},
          "bo": {"03_tiled_attention:tile_count": 5}}
NO_RESCALE = ("l_a * torch.exp(m_a - shift) + l_b * torch.exp(m_b - shift)", "l_a + l_b")
PLANTED = ("otter.py", "flashlib/__init__.py", ".OTTER_LOG")


def _edition(name: str):
    return student_edition.student_notebook(nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4), name)


def _answer(nb, check: str, answer: str, after: str = "") -> None:
    cell = next(c for c in nb.cells if c.cell_type == "code" and f".check_{check}(" in c.source)
    assert "answer = None" in cell.source
    cell.source = cell.source.replace("answer = None", f"answer = {answer}", 1) + after


def _lab(nb, name: str, source: str) -> None:
    cell = next(c for c in nb.cells if c.cell_type == "code" and cells.marked(c.source) == name)
    cell.source = source


def _ada(folder: Path, marker: Path) -> Path:
    """Notebook 02: an honest exercise and lab, a wrong lab printing PASS, a wrong exercise printing PASS, a cell
    that is not graded; as a zip with planted files. The cell and each file leave ``marker`` behind if run."""
    nb = _edition("02_online_softmax")
    plant = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    nb.cells.insert(3, nbformat.v4.new_code_cell(plant))  # not a graded cell: nothing may run it
    _answer(nb, "online_state", repr((7.0, sum(math.exp(x - 7.0) for x in (2.0, 5.0, 1.0, 7.0)))))
    _answer(nb, "new_denominator", "1.0", '\nprint("PASS: new_denominator is right")')
    _lab(nb, "online_softmax", cells.code_cell("online_softmax", solved=True))
    wrong = cells.code_cell("merge_states", solved=True).replace(*NO_RESCALE)
    _lab(nb, "merge_states", wrong + '\nprint("PASS: merge_states is right")')
    path = folder / "ada" / "02_online_softmax.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    log = subprocess.run([sys.executable, "-c", "import dill, sys; sys.stdout.buffer.write(dill.dumps("
                          f"type('L', (), {{'__reduce__': lambda self: (exec, ({plant!r},))}})()))"],
                         capture_output=True, check=True).stdout
    submission = folder / "ada.zip"
    with zipfile.ZipFile(submission, "w") as z:
        z.write(path, path.name)
        z.writestr("otter.py", plant)
        z.writestr("flashlib/__init__.py", plant)
        z.writestr(".OTTER_LOG", log)
    return submission


def _bo(folder: Path) -> Path:
    """Notebook 03: an honest exercise, an untouched one, a wrong number, a lab cell that only prints PASS."""
    nb = _edition("03_tiled_attention")
    _answer(nb, "tile_count", "12")
    _answer(nb, "key_major_traffic", "65")
    _lab(nb, "tiled_forward", '# LAB: tiled_forward\nprint("PASS: tiled_forward is right")')
    path = folder / "bo" / "03_tiled_attention.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("autograder") / "autograder.zip"
    assert flashlib_main(["labs", "autograder", str(out), "--notebooks", "02,03"]) == 0
    return out


@pytest.fixture(scope="module")
def graded(built, tmp_path_factory):
    """({student: otter's results.json}, {student: labs grade's rows}, the planted files' marker)."""
    folder = tmp_path_factory.mktemp("class")
    marker = folder / "planted-code-ran"
    submissions = {"ada": _ada(folder, marker), "bo": _bo(folder)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    runs = {}
    for student, submission in submissions.items():
        out = folder / f"otter-{student}"
        out.mkdir()
        runs[student] = (out, subprocess.Popen(
            [sys.executable, "-m", "otter", "run", "--no-logo", "-a", str(built), str(submission), "-o", str(out)],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    book = grade.grade([folder / "ada", folder / "bo"], names=["02_online_softmax", "03_tiled_attention"])
    results = {}
    for student, (out, process) in runs.items():
        printed, _ = process.communicate(timeout=600)
        assert process.returncode == 0, printed[-3000:]
        results[student] = json.loads((out / "results.json").read_text())
    rows = {s: [r for r in book.rows if r.student == s and r.status != "duplicate"] for s in submissions}
    return results, rows, marker


def _scores(result: dict) -> dict:
    return {t["name"]: t["score"] for t in result["tests"]}


def test_the_autograder_holds_one_hidden_test_per_item_with_its_points(built, tmp_path):
    from otter.test_files import create_test_file
    from otter.nbmeta_config import NBMetadataConfig

    with zipfile.ZipFile(built) as z:
        names = z.namelist()
        z.extractall(tmp_path)
    tests = sorted((tmp_path / "tests").glob("*.py"))
    found = {}
    for path in tests:
        test = create_test_file(str(path), NBMetadataConfig())
        assert [case.hidden for case in test.test_cases] == [True]
        found[test.name] = test.possible
    assert found == ITEMS
    assert [t.name.split("-")[0] for t in tests] == sorted(t.name.split("-")[0] for t in tests)  # course order
    config = json.loads((tmp_path / "otter_config.json").read_text())
    assert config["plugins"] == [{"flashlib.labs.otter_plugin.Plugin": {
        "notebooks": ["02_online_softmax", "03_tiled_attention"], "timeout": 600, "memory_mib": 4096}}]
    assert "files/flashlib/labs/grade.py" in names and "files/notebooks/02_online_softmax.ipynb" in names
    assert not [n for n in names if "/solutions/" in n or n.endswith("course/answers.py")]  # the edition's package
    assert "apt-get install -y bubblewrap" in (tmp_path / "setup.sh").read_text()


def test_the_container_gets_the_courses_python_and_locked_versions(built, tmp_path):
    with zipfile.ZipFile(built) as z:
        environment = z.read("environment.yml").decode()
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    python = re.search(r"python=(\S+)", (ROOT / "environment.yml").read_text()).group(1)
    assert f"- python={python}" in environment
    assert f"- torch=={pins['torch']}+cpu" in environment and "--extra-index-url https://download.pytorch.org/whl/cpu" \
        in environment
    for name in ("triton", "numpy", "matplotlib", "ipywidgets"):
        assert f"- {name}=={pins[name]}" in environment
    assert f"otter-grader[grading,plugins]=={pins['otter-grader']}" in environment


def test_otter_run_gives_the_graders_points_item_by_item(graded):
    results, rows, _ = graded
    for student, result in results.items():
        assert _scores(result) == {r.item: r.points for r in rows[student]}, student
        assert _scores(result) == {item: EARNED[student].get(item, 0) for item in ITEMS}, student
        assert {t["name"]: t["max_score"] for t in result["tests"]} == ITEMS


def test_feedback_is_the_checkers_verdict_and_names_the_mistake(graded):
    results, rows, _ = graded
    ada = {t["name"]: t["output"] for t in results["ada"]["tests"]}
    merge = ada["02_online_softmax:merge_states"]
    assert "0 of 30 points; mistake: no_rescale" in merge and "NOT YET: merge_states, case " in merge
    assert "mistake: no rescale when the max grew" in merge  # the checker's whole message
    row = next(r for r in rows["ada"] if r.name == "merge_states")
    assert row.mistake == "no_rescale" and row.message.strip().splitlines()[-1] in merge
    bo = {t["name"]: t["output"] for t in results["bo"]["tests"]}
    assert "no checker of tiled_forward ran (a printed PASS is not a verdict)" in bo["03_tiled_attention:tiled_forward"]
    assert "02_online_softmax.ipynb was not handed in" in bo["02_online_softmax:merge_states"]
    assert {t["visibility"] for r in results.values() for t in r["tests"]} == {"after_published"}  # hidden until published


def test_the_students_files_never_run_and_the_sandbox_is_said(graded):
    results, _, marker = graded
    assert not marker.exists()  # neither the ungraded cell nor the planted otter, flashlib or otter log ran
    for result in results.values():
        assert result["output"].startswith("flashlib autograder: sandboxed with bubblewrap" if
                                           _has_bwrap() else "flashlib autograder: NOT SANDBOXED: ")


def _has_bwrap() -> bool:
    from flashlib.labs import sandbox

    return sandbox.find(ROOT).sandboxed


def test_by_default_every_notebook_with_a_lab_or_exercise_is_graded(tmp_path, capsys):
    assert flashlib_main(["labs", "autograder", str(tmp_path / "all.zip")]) == 0
    with zipfile.ZipFile(tmp_path / "all.zip") as z:
        tests = [n for n in z.namelist() if n.startswith("tests/")]
    graded_notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb") if re.search(
        r"# LAB: |\.check_\w+\(", " ".join(c.source for c in nbformat.read(p, as_version=4).cells)))
    assert sorted({Path(t).name.split("-")[0] for t in tests}) == graded_notebooks
    triton = [t for t in tests if "attn_fwd_inner" in t or "attn_bwd_dkdv_inner" in t]
    assert len(triton) == 2 and all("points = 45" in zipfile.ZipFile(tmp_path / "all.zip").read(t).decode()
                                    for t in triton)
    assert f"{len(tests)} tests" in capsys.readouterr().out


def test_bad_input_is_named(tmp_path, capsys):
    assert flashlib_main(["labs", "autograder", str(tmp_path / "x.zip"), "--notebooks", "02,99"]) == 2
    assert "--notebooks names '99'" in capsys.readouterr().err
    assert flashlib_main(["labs", "autograder", str(tmp_path / "x.tar")]) == 2
    assert "expected a path ending in .zip" in capsys.readouterr().err
