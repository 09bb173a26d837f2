"""The student edition (make student): no worked solution anywhere in it, and its labs still check and hint.

It is built into a temporary folder; every text file in it (each notebook's sources and outputs too) is
searched for every solution's code, and its own package, run from that folder, checks answers written
from the full edition's solutions.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest

from flashlib import labs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import student_edition  # noqa: E402

SOLUTIONS = ROOT / "flashlib" / "labs" / "solutions"


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    return student_edition.build(tmp_path_factory.mktemp("edition") / "student")


def _texts(folder: Path, skip: Path | None = None):
    """(path, text) of every text file under ``folder``; a notebook as its sources and outputs."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or (skip is not None and skip in path.parents):
            continue
        if path.suffix == ".ipynb":
            nb = nbformat.read(path, as_version=4)
            parts = [c.source for c in nb.cells]
            parts += ["".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                              for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]
            yield path, "\n".join(parts)
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def _code_lines(source: str) -> list[str]:
    """The solution's lines without comments or indentation, blank lines dropped."""
    lines = []
    for line in source.splitlines():
        code = line.split("  #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if code:
            lines.append(code)
    return lines


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _function(source: str) -> str:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    return "\n".join(_code_lines("\n".join(source.splitlines()[fn.lineno - 1:fn.end_lineno])))


def test_the_edition_has_no_solutions_package_and_installs_what_it_lists(edition):
    assert not (edition / "flashlib" / "labs" / "solutions").exists()
    assert not (edition / "flashlib" / "course" / "answers.py").exists()
    assert (edition / "flashlib" / "labs" / "core.py").exists() and (edition / "notebooks").is_dir()
    packages = tomllib.loads((edition / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "flashlib.labs.solutions" not in packages
    for package in packages:  # what setuptools will look for when make lab installs the edition
        folder = edition / "data" / "bench" if package == "flashlib.recorded" else edition / package.replace(".", "/")
        assert folder.is_dir(), package
    assert (edition / "Makefile").read_text() == (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("name", list(labs.LABS))
def test_no_solution_code_is_anywhere_in_the_edition(edition, name):
    source = (SOLUTIONS / f"{name}.py").read_text()
    function = _squash(_function(source))
    # lines of the solution that nothing else of the full edition holds (a hint's near-code shares some)
    others = [_squash(t) for _, t in _texts(ROOT / "flashlib", skip=SOLUTIONS)]
    others += [_squash(t) for _, t in _texts(ROOT / "notebooks")]
    own = [line for line in _code_lines(source)[1:] if len(line) > 24 and not any(_squash(line) in t for t in others)]
    assert own, f"{name}: every line of its solution is somewhere else in the course"
    for path, text in _texts(edition):  # the stub keeps the solution's signature and docstring, nothing more
        flat = _squash(text)
        assert function not in flat, f"{path}: holds the solution of {name}"
        for line in own:
            assert _squash(line) not in flat, f"{path}: holds {line!r} of {name}'s solution"


def test_the_notebooks_keep_each_labs_stub_and_lose_what_shows_its_answer(edition):
    from flashlib.labs import cells

    for spec in labs.LABS.values():
        nb = nbformat.read(edition / "notebooks" / f"{spec.notebook}.ipynb", as_version=4)
        task = [c.source for c in nb.cells if c.cell_type == "markdown" and cells.marked(c.source) == spec.name]
        stub = [c.source for c in nb.cells if c.cell_type == "code" and cells.marked(c.source) == spec.name]
        assert task == [cells.markdown_cell(spec.name, solutions=False, hints=2)] and "labs.solution" not in task[0]
        assert "(two, one at a time)" in task[0]
        assert stub == [cells.code_cell(spec.name)]
        assert not any("labs.reveal(" in c.source or "labs.solution(" in c.source for c in nb.cells)
    for path in sorted((edition / "notebooks").glob("*.ipynb")):  # no sentence promises what was removed
        prose = " ".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        assert "after the lab" not in prose.lower() and "labs.solution" not in prose, path.name


def test_the_editions_readme_describes_the_edition(edition):
    readme = (edition / "README.md").read_text()
    assert readme.startswith("# FlashAttention, tile by tile: the student edition")
    assert "no worked\nsolutions" in readme and "(2 per lab in this edition)" in readme and "make lab" in readme
    for absent in ("labs.solution", "docs/syllabus.md", "tests/", "tools/", "make test"):
        assert absent not in readme, absent  # what this edition lacks is not named
    assert not (edition / "docs").exists() and not (edition / "tests").exists()


STUDENT_RUN = r"""
import importlib.util, json, sys
from pathlib import Path
import flashlib
from flashlib import labs

answers = Path(sys.argv[1])
report = {"package": flashlib.__file__, "has_solutions": labs.has_solutions(), "checks": {}}

def load(name, file):
    spec = importlib.util.spec_from_file_location(f"answer_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)

for file in sorted(answers.glob("*.py")):
    name = file.stem.split("__")[0]
    result = labs.check(name, load(name, file))
    report["checks"][file.stem] = [result.passed, result.mistake, result.message]
try:
    labs.solution_source("tiled_forward")
except RuntimeError as error:
    report["solution_source"] = str(error)
print(json.dumps(report))
"""


REVEAL_RUN = r"""
from flashlib import labs
labs.solution('split_kv')
labs.reveal('attn_fwd_inner')
labs.hint('sink_grad')
for _ in range(3):
    labs.hint('merge_states')
"""
PART = "----- the next part: "


@pytest.fixture(scope="module")
def in_edition(edition, tmp_path_factory) -> dict[str, str]:
    """What each part printed, run one after another in one process of the edition's own package, as in one
    learner's session: every lab checked (STUDENT_RUN), then a solution, a reveal and hints asked for
    (REVEAL_RUN), then the exercises' solutions and wrong tries (EXERCISES_RUN)."""
    answers = tmp_path_factory.mktemp("answers")
    for name in _lab_names():  # a right answer, written from the full edition's solution, for every lab
        (answers / f"{name}.py").write_text(labs.solution_source(name))
    wrong = labs.solution_source("tiled_forward").replace("l_i = alpha * l_i + ", "l_i = l_i + ")
    (answers / "tiled_forward__no_rescale.py").write_text(wrong)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(edition), FLASHLIB_PROGRESS="off")
    script = "\n".join([STUDENT_RUN, f"print({PART + 'reveal'!r})", REVEAL_RUN,
                        f"print({PART + 'exercises'!r})", EXERCISES_RUN])
    done = subprocess.run([sys.executable, "-c", script, str(answers)], cwd=edition, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    labs_part, rest = done.stdout.split(PART + "reveal\n")
    reveal_part, exercises_part = rest.split(PART + "exercises\n")
    return {"labs": labs_part, "reveal": reveal_part, "exercises": exercises_part}


def _lab_names() -> list[str]:
    return [n for n, spec in labs.LABS.items() if not spec.triton or importlib.util.find_spec("triton")]


def test_the_editions_labs_check_answers_and_say_there_is_no_solution(edition, in_edition):
    printed = in_edition["labs"]
    report = json.loads(printed.strip().splitlines()[-1])
    assert Path(report["package"]).resolve().is_relative_to(edition.resolve())
    assert report["has_solutions"] is False
    for name in _lab_names():
        passed, mistake, message = report["checks"][name]
        assert passed and message.startswith(f"PASS: {name}"), message
    passed, mistake, message = report["checks"]["tiled_forward__no_rescale"]
    assert not passed and mistake == "no_rescale" and "labs.solution" not in message
    assert 'labs.hint("tiled_forward") gives a hint.' in message
    assert "student edition" in report["solution_source"]
    assert "PASS: online_softmax" in printed


def test_solution_reveal_and_hints_in_the_edition(in_edition):
    lines = in_edition["reveal"].splitlines()  # after every lab passed: still no reveal
    assert lines[0].startswith("This is the student edition of the course: it has no worked solutions")
    assert lines[1].startswith("This is the student edition of the course") and "reveal" in lines[1]
    assert lines[2] == f"hint 1 of 2 for sink_grad: {labs.LABS['sink_grad'].hints[0]}"  # the first two of three
    assert lines[4] == f"hint 2 of 2 for merge_states: {labs.LABS['merge_states'].hints[1]}"
    assert lines[5] == "No more hints for merge_states in this edition: labs.check says what is wrong."


EXERCISES_RUN = r"""
from flashlib.course import score_exercises, serving, variant_exercises

for module, name, check in ((score_exercises, "alibi_grad", score_exercises.check_alibi_grad),
                            (serving, "cascade_merge", serving.check_cascade_merge),
                            (variant_exercises, "sink_window", variant_exercises.check_sink_window)):
    module.solution(name)
    for _ in range(5):  # wrong tries: each gives the next hint, never the answer
        check(lambda *a: 0)
"""


def test_the_editions_exercises_never_give_their_answers(edition, in_edition):
    from flashlib.course.answers import ANSWERS

    printed = in_edition["exercises"]
    assert printed.count("it has no worked solutions") == 3
    assert "hint 2 of 2" in printed and "hint 3" not in printed
    others = [_squash(t) for path, t in _texts(ROOT / "flashlib", skip=SOLUTIONS) if path.name != "answers.py"]
    texts = [(path, _squash(text)) for path, text in _texts(edition)]
    for name, answer in ANSWERS.items():
        assert _squash(answer) not in _squash(printed), name
        # the answer's lines that nothing else of the full edition holds: printed nowhere, written nowhere
        own = [line for line in _code_lines(answer)[1:] if not any(_squash(line) in t for t in others)]
        assert own, f"{name}: every line of its answer is somewhere else in the course"
        for line in own:
            assert _squash(line) not in _squash(printed), (name, line)
            for path, text in texts:
                assert _squash(line) not in text, (path, name, line)


def test_a_teacher_chooses_how_many_hints(tmp_path):
    build = student_edition.build(tmp_path / "none", hints=0)
    nb = nbformat.read(build / "notebooks" / "02_online_softmax.ipynb", as_version=4)
    assert any("This edition gives no hints" in c.source for c in nb.cells if c.cell_type == "markdown")
    assert "HINTS: int | None = 0" in (build / "flashlib" / "edition.py").read_text()
    # an exercise with one plain hint, and a later notebook's verdict, give none there either
    wrong = ("from flashlib.course import exercises, ring, inference\n"
             "exercises.check_tile_count(13); print(repr(ring.check_idle_steps(3))); print(repr(inference.check_cache_gib(3)))")
    done = subprocess.run([sys.executable, "-c", wrong], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(build)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("hint: this edition gives none") == 3, done.stdout
    assert "ceil(" not in done.stdout and "mod 6" not in done.stdout and "2^30" not in done.stdout, done.stdout
    with pytest.raises(SystemExit, match="--hints"):
        student_edition.build(tmp_path / "bad", hints=5)


def test_the_edition_is_not_written_over_the_course():
    with pytest.raises(SystemExit, match="argument OUT"):
        student_edition.build(ROOT)


def test_the_editions_badges_and_setup_cells_install_the_edition(edition, tmp_path):
    """Its notebooks point at the edition's own address, never the full course's (unpublished by default:
    they say how to bring the edition's wheel in)."""
    import tomllib as toml

    course = toml.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    own = toml.loads((edition / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert own == student_edition.UNPUBLISHED != course
    for path in sorted((edition / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        setup = [c.source for c in nb.cells[:2]]
        assert all(course not in text for text in setup), path.name
        assert "make wheel" in setup[0], path.name  # unpublished: built from the edition's own tree
    published = student_edition.build(tmp_path / "published", address="https://github.com/example.invalid/edition")
    nb = nbformat.read(published / "notebooks" / "03_tiled_attention.ipynb", as_version=4)
    assert "colab.research.google.com/github/example.invalid/edition/blob/main/notebooks/03_tiled_attention.ipynb" \
        in nb.cells[0].source
    assert "https://github.com/example.invalid/edition" in nb.cells[1].source
    with pytest.raises(SystemExit, match="Repository"):
        student_edition.build(tmp_path / "bad", address="https://example.org/not-github")


def _hints_in(path: Path) -> dict[str, list[str]]:
    """The hints written in a file of the package: each Lab(...)'s tuple, each HintSteps(...)'s steps."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
        if name == "Lab":
            found[ast.literal_eval(node.args[0])] = list(ast.literal_eval(node.args[7]))
        elif name == "HintSteps":
            found[f"{path.stem}:{node.lineno}"] = [ast.literal_eval(a) for a in node.args]
    return found


def test_the_editions_files_hold_no_more_hints_than_it_gives(edition, tmp_path):
    """A lab's third hint, close to code, is in no file of the edition that gives two; with one, the second of
    every lab's and every exercise's steps is gone too."""
    catalog = _hints_in(edition / "flashlib" / "labs" / "catalog.py")
    assert catalog == {name: [*spec.hints[:2], ""] for name, spec in labs.LABS.items()}
    one = student_edition.build(tmp_path / "one", hints=1)
    catalog = _hints_in(one / "flashlib" / "labs" / "catalog.py")
    assert catalog == {name: [spec.hints[0], "", ""] for name, spec in labs.LABS.items()}
    for module in ("serving", "score_exercises", "variant_exercises"):
        (steps,) = _hints_in(one / "flashlib" / "course" / f"{module}.py").values()
        (full,) = _hints_in(ROOT / "flashlib" / "course" / f"{module}.py").values()
        assert steps == [full[0], *[""] * (len(full) - 1)], module
    flat = [_squash(text) for _, text in _texts(one)]
    assert not any(_squash(labs.LABS["tiled_forward"].hints[2][:40]) in text for text in flat)


def test_notebook_06_shows_the_students_own_loop_from_03(edition, tmp_path, capsys, monkeypatch):
    nb = nbformat.read(edition / "notebooks" / "06_fused_forward.ipynb", as_version=4)
    shown = [c for c in nb.cells if c.cell_type == "code" and 'labs.yours("tiled_forward")' in c.source]
    assert len(shown) == 1 and shown[0].outputs == []
    assert not any("def _online_update" in "".join(o.get("text", "") for o in c.get("outputs", []))
                   for c in nb.cells if c.cell_type == "code")  # the course's loop of 03 is not printed
    monkeypatch.chdir(tmp_path)
    labs.yours("tiled_forward")
    assert "03_tiled_attention.ipynb is not in this folder" in capsys.readouterr().out
    from flashlib.labs import cells

    for solved, said in ((False, "has no answer yet"), (True, "def tiled_forward(q, k, v, block_q, block_k, causal):")):
        cell = nbformat.v4.new_code_cell(cells.code_cell("tiled_forward", solved=solved))
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "03_tiled_attention.ipynb")
        labs.yours("tiled_forward")
        assert said in capsys.readouterr().out
