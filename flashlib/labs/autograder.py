"""An otter-grader autograder for Gradescope, built from the course's own grader.

    python -m flashlib labs autograder OUT.zip [--notebooks 02,03] [--timeout S] [--memory MIB]
    (make autograder: build/autograder/autograder.zip)

The zip is otter's (``otter generate``): one test file per lab and checked exercise of the chosen course
notebooks (all by default), each worth the gradebook's points (:mod:`.gradebook`) and hidden from students;
``otter_config.json`` naming the course's plugin (:mod:`.otter_plugin`) and what it grades; the container's
requirements, pinned as the course's lock (constraints.txt) pins them, for the course's Python
(environment.yml); and, as otter's support files, the student edition's package (no worked solutions, no
answers: :func:`.sandbox.package_copy`) and the code cells of the chosen notebooks, which say what each item
is. Two of otter's files get one addition each: ``setup.sh`` installs bubblewrap, the sandbox of the
students' cells, and ``run_otter.py`` puts the package on the runner's path (Gradescope and ``otter grade``
run it; ``otter run`` runs in the process that calls it, where the course is installed).

A submission is one notebook (otter's rule), graded as the course notebook it is named after, or, in an
autograder of one notebook, as that one. Items of the autograder's other notebooks score 0, as ``labs grade
--assignment`` scores a notebook not handed in: give each Gradescope assignment an autograder of its own
notebook (``--notebooks 02``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from . import grade
from .gradebook import Item
from .sandbox import PACKAGE, package_copy

COURSE = PACKAGE.parent  # the course's checkout: its notebooks, lock and environment
PLUGIN = "flashlib.labs.otter_plugin.Plugin"
TORCH_CPU = "https://download.pytorch.org/whl/cpu"  # a CPU container: torch's CPU build, not a multi-GB CUDA one
OTTER_CONFIG = {"lang": "python", "show_hidden": True, "force_public_test_summary": False}
TEST_FILE = '''\
"""{item} ({kind}), {points} points: the course's checker on the submission's cell, judged by flashlib's grader
apart from the student's code (flashlib.labs.otter_plugin)."""
from otter.test_files import test_case

OK_FORMAT = False

name = {item!r}
points = {points}


@test_case(points={points}, hidden=True)
def {function}():
    from flashlib.labs import otter_plugin

    otter_plugin.check({item!r})
'''
# what the autograder adds to two of otter's files: setup.sh's last lines, run_otter.py's first
SETUP_ADDITION = """
# flashlib: bubblewrap, the sandbox of the students' cells (the grader says when the container cannot use it)
apt-get install -y bubblewrap
"""
RUNNER_ADDITION = """\
import os
import sys
# flashlib: the autograder's package (the zip's files/, beside this file), for its otter plugin
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "files"))
"""


def chosen(spec: str | None, course: Path = grade.NOTEBOOKS) -> list[str]:
    """The course notebooks ``spec`` names ("02,03", "02_online_softmax", "A"; None: every one), in course order."""
    stems = sorted(p.stem for p in course.glob("*.ipynb"))
    if spec is None:
        return stems
    found = []
    for given in (s.strip() for s in spec.split(",")):
        name = given.removesuffix(".ipynb")
        match = [s for s in stems if s == name or s.startswith(f"{name}_")]
        if len(match) != 1:
            raise ValueError(f"--notebooks names {given!r}, which is not one course notebook; expected numbers "
                             f"or names of {', '.join(stems)}")
        found.append(match[0])
    return [s for s in stems if s in found]


def items_of(stems: list[str], course: Path = grade.NOTEBOOKS) -> list[Item]:
    """Every lab and checked exercise of the notebooks ``stems``, with its points."""
    items, _ = grade.assignment({}, stems, course)
    bare = [s for s in stems if not any(i.notebook == s for i in items)]
    if bare:
        raise ValueError(f"--notebooks: {', '.join(bare)} has no lab or checked exercise to grade")
    return items


def test_file(item: Item, index: int) -> tuple[str, str]:
    """(file name, text) of ``item``'s otter test; the names sort in course order."""
    function = re.sub(r"\W", "_", f"test_{item.notebook}_{item.name}")
    return (f"{item.notebook}-{index:02d}-{item.name}.py",
            TEST_FILE.format(item=item.id, kind=item.kind, points=item.points, function=function))


def requirements(course: Path = COURSE) -> str:
    """The container's requirements: the package's own dependencies at the lock's versions, torch's CPU build."""
    declared = tomllib.loads((course / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    pins = {}
    for line in (course / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    lines = [f"--extra-index-url {TORCH_CPU}"]
    for requirement in declared:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        if name not in pins:
            raise ValueError(f"constraints.txt pins no version of {name}, a dependency of the package")
        lines.append(f"{name}=={pins[name]}+cpu" if name == "torch" else f"{name}=={pins[name]}")
    return "\n".join(lines) + "\n"


def python_version(course: Path = COURSE) -> str:
    """The course's Python, as environment.yml gives it to classrooms."""
    found = re.search(r"^\s*-\s*python=(\S+)\s*$", (course / "environment.yml").read_text(encoding="utf-8"), re.M)
    if found is None:
        raise ValueError("environment.yml names no python=X.Y: the autograder's container needs the course's Python")
    return found.group(1)


def _code_cells(path: Path, out: Path) -> None:
    """The notebook's code cells as the grader reads them (sources and tags; no outputs, no prose)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    keep = [nbformat.v4.new_code_cell(c.source, metadata={k: v for k, v in c.metadata.items() if k == "tags"})
            for c in nb.cells if c.cell_type == "code" and grade.SETUP_TAG not in c.metadata.get("tags", [])]
    nbformat.write(nbformat.v4.new_notebook(cells=keep), out)


def stage(folder: Path, stems: list[str], items: list[Item], *, timeout: float, memory_mib: float,
          course: Path = grade.NOTEBOOKS) -> None:
    """What otter generate takes, written into ``folder``: tests/, the config, the requirements, the files."""
    (folder / "tests").mkdir(parents=True)
    for index, item in enumerate(items):
        name, text = test_file(item, index)
        (folder / "tests" / name).write_text(text, encoding="utf-8")
    plugin = {PLUGIN: {"notebooks": stems, "timeout": timeout, "memory_mib": memory_mib}}
    config = {**OTTER_CONFIG, "plugins": [plugin]}
    (folder / "otter_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (folder / "requirements.txt").write_text(requirements(), encoding="utf-8")
    package_copy(folder, hints=None, compiled=False)  # the package labs grade gives the students' cells
    (folder / "notebooks").mkdir()
    for stem in stems:
        _code_cells(course / f"{stem}.ipynb", folder / "notebooks" / f"{stem}.ipynb")


@contextlib.contextmanager
def _inside(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _amend(generated: Path, out: Path) -> None:
    """Copy otter's zip to ``out``, with the course's additions to setup.sh and run_otter.py."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(generated) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == "setup.sh":
                data += SETUP_ADDITION.encode()
            elif info.filename == "run_otter.py":
                data = RUNNER_ADDITION.encode() + data
            target.writestr(info, data)


def build(out: Path, notebooks: str | None = None, *, timeout: float = grade.TIMEOUT_S,
          memory_mib: float = grade.MEMORY_MIB) -> list[Item]:
    """Write the autograder of the course notebooks ``notebooks`` names (all when None) to ``out``; its items."""
    try:
        from otter.generate import main as generate
    except ImportError as error:
        raise RuntimeError("labs autograder needs otter-grader: pip install -c constraints.txt -e '.[grading]'") \
            from error
    stems = chosen(notebooks)
    items = items_of(stems)
    with tempfile.TemporaryDirectory(prefix="flashlib-autograder-") as scratch:
        folder = Path(scratch) / "stage"
        stage(folder, stems, items, timeout=timeout, memory_mib=memory_mib)
        with _inside(folder):
            generate(tests_dir="tests", output_path=str(Path(scratch) / "otter.zip"), config="otter_config.json",
                     requirements="requirements.txt", no_environment=True, files=["flashlib", "notebooks"],
                     python_version=python_version())
        _amend(Path(scratch) / "otter.zip", Path(out))
    return items


def main(out, notebooks: str | None = None, timeout: float = grade.TIMEOUT_S,
         memory_mib: float = grade.MEMORY_MIB) -> int:
    """The command line's ``labs autograder``: 0 once the zip is written, 2 on bad input."""
    if not str(out).endswith(".zip"):
        print(f"labs autograder: argument OUT is {str(out)!r}; expected a path ending in .zip", file=sys.stderr)
        return 2
    try:
        items = build(Path(out), notebooks, timeout=timeout, memory_mib=memory_mib)
    except (ValueError, RuntimeError) as error:
        print(f"labs autograder: {error}", file=sys.stderr)
        return 2
    for item in items:
        print(f"  {item.id:<48} {item.kind:<9} {item.points:>3} points")
    notebooks_graded = sorted({i.notebook for i in items})
    print(f"labs autograder: wrote {out}: {len(items)} tests, {sum(i.points for i in items)} points, from "
          f"{', '.join(notebooks_graded)}")
    return 0
