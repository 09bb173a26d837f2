"""What runs inside otter-grader when the course's autograder (:mod:`.autograder`) grades a submission.

otter's runner executes the submission notebook in one Jupyter kernel, cells in order, then runs the test
files in that same kernel and reads their results back from a file the kernel writes. A verdict computed
there can be forged by any cell of the notebook (DESIGN.md, "Facts for grading a class"), so
:class:`Plugin`, otter's plugin, keeps the student's code out of that kernel:

- ``before_grading`` sets aside every file handed in beside the notebook (a module of the kernel's own
  name, an otter log that otter would unpickle), so that nothing of the student's is importable or read;
- ``before_execution`` gives otter, in place of the notebook, one cell of the course's own: it puts the
  autograder's copy of the package first on the kernel's path and starts a grading :class:`Session` on the
  notebook's file; none of the student's cells runs in the kernel;
- ``after_grading`` writes the grader's line on its sandbox into otter's results.

Each test then calls :func:`check` on its item: the course's grader (:mod:`.grade`, :mod:`.judge`) runs the
student's cell in a sandboxed worker of its own (:mod:`.zygote`, :mod:`.sandbox`), after the imports of the
notebook's earlier cells and nothing else, and the checker runs here, in the kernel, which runs no student
code. The test passes when the checker's verdict is a pass; otherwise it fails with the verdict, the mistake
named and the checker's whole message. Points are the gradebook's (:mod:`.gradebook`), written in the tests.
"""
from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

from . import grade
from .gradebook import Row
from .judge import Worker
from .sandbox import PACKAGE, find, package_copy

TAG = "flashlib-autograder"  # the one cell otter runs in place of the notebook
SET_ASIDE = "flashlib-set-aside"  # beside the submission's folder: what was handed in besides the notebook
SETUP = """\
# flashlib's autograder: none of the submission's cells runs in this kernel (flashlib.labs.otter_plugin)
import sys
sys.path.insert(0, {files!r})
from flashlib.labs import otter_plugin
otter_plugin.start({submission!r}, {notebooks!r}, timeout={timeout!r}, memory_mib={memory_mib!r})
"""


class Verdict(AssertionError):
    """A test's failure: the checker's verdict on the item, the mistake named and its whole message."""


def graded_as(path: Path, notebooks: list[str]) -> str | None:
    """The course notebook a submission's file is graded as: the one it is named after (a longest name its
    own begins with, so that a browser's "02_online_softmax (1).ipynb" counts), or, where the autograder
    grades one notebook, that one; None where none fits."""
    named = [stem for stem in notebooks if path.stem.startswith(stem)]
    if named:
        return max(named, key=len)
    return notebooks[0] if len(notebooks) == 1 else None


def feedback(row: Row) -> str:
    """The test's text for one graded item: points, the mistake named, then the checker's whole message."""
    head = f"{row.item}: {row.points:g} of {row.possible} points"
    if row.mistake:
        head += f"; mistake: {row.mistake}"
    if row.status == "error":
        head += " (NOT GRADED: the grader failed, not the submission)"
    return f"{head}\n{row.message.strip()}"


class Session:
    """One submission's grading in the kernel: the course's tasks for its items, one warm worker."""

    def __init__(self, submission: Path, notebooks: list[str], timeout: float, memory_mib: float):
        self.timeout, self.memory_mib = timeout, memory_mib  # a cell's limits
        self.scratch = tempfile.TemporaryDirectory(prefix="flashlib-otter-")
        root = Path(self.scratch.name)
        folder = root / "submission"
        folder.mkdir()
        stem = graded_as(submission, notebooks) or submission.stem
        shutil.copyfile(submission, folder / f"{stem}.ipynb")
        self.package_dir = root / "course"
        package_copy(self.package_dir)  # the package the cells import: no solutions, no answers
        self.sandbox = find(self.package_dir, [submission.parent, PACKAGE.parent])
        students = grade.submissions([folder])
        items, course_cells = grade.assignment(students, notebooks)
        self.tasks: dict[str, grade.Task] = {}
        for task in grade.tasks(students, None, items, course_cells, self.sandbox.sandboxed):
            self.tasks.setdefault(task.row.item, task)  # an item's first cell; a pasted copy earns nothing
        self.preload, self.worker, self.rows = grade.preload(course_cells), None, {}
        atexit.register(self.close)

    def grade(self, item: str) -> Row:
        """The row of ``item``, its cell run and checked now (once)."""
        if item in self.rows:
            return self.rows[item]
        task = self.tasks.get(item)
        if task is None:
            raise Verdict(f"{item}: not graded: this autograder has no such item ({', '.join(self.tasks)})")
        if task.cell is not None and self.worker is None:
            self.worker = Worker(self.sandbox, self.package_dir, self.preload)
        self.rows[item] = grade.judged(task, self.worker, self.timeout, self.memory_mib)
        if len(self.rows) == len(self.tasks):
            self.close()
        return self.rows[item]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


SESSION: Session | None = None


def start(submission: str, notebooks: list[str], *, timeout: float = grade.TIMEOUT_S,
          memory_mib: float = grade.MEMORY_MIB) -> Session:
    """Start grading ``submission`` (a notebook's file) as the course's ``notebooks``; print the sandbox's line."""
    global SESSION
    SESSION = Session(Path(submission), list(notebooks), timeout, memory_mib)
    print(f"flashlib autograder: {SESSION.sandbox.why}")
    return SESSION


def check(item: str) -> Row:
    """A test's body: grade ``item`` ("notebook:name"); raise :class:`Verdict` unless its checker passed it."""
    if SESSION is None:
        raise Verdict(f"{item}: not graded: the autograder's plugin did not start grading (otter_config.json "
                      "must name flashlib.labs.otter_plugin.Plugin)")
    row = SESSION.grade(item)
    if not row.passed:
        raise Verdict(feedback(row))
    print(feedback(row))
    return row


def set_aside(submission: Path) -> list[str]:
    """Move what the submission's folder holds besides the notebook and otter's tests out of it, into a
    folder beside it: the kernel's working folder is on its path, and otter reads a log found there."""
    folder, aside = submission.parent, submission.parent.parent / SET_ASIDE
    moved = []
    for entry in sorted(folder.iterdir()):
        if entry.name in (submission.name, "tests"):
            continue
        aside.mkdir(exist_ok=True)
        shutil.move(str(entry), str(aside / entry.name))
        moved.append(entry.name)
    return moved


def grading_notebook(submission: Path, files: Path, config: dict):
    """What otter executes in place of the submission: the course's one cell."""
    import nbformat

    source = SETUP.format(files=str(files), submission=str(submission), notebooks=list(config["notebooks"]),
                          timeout=float(config.get("timeout", grade.TIMEOUT_S)),
                          memory_mib=float(config.get("memory_mib", grade.MEMORY_MIB)))
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [TAG]})
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nbformat.v4.new_notebook(cells=[cell], metadata={"kernelspec": kernel})


def said(notebook) -> str:
    """What the course's cell printed (the sandbox's line), or the error it raised, in an executed notebook."""
    for cell in getattr(notebook, "cells", None) or ():
        if TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        parts = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output.get("text", ""))
            elif output.get("output_type") == "error":
                parts.append(f"flashlib autograder: grading did not start: {output.get('ename')}: "
                             f"{output.get('evalue')}")
        return re.sub(r"\n+", "\n", "".join(parts)).strip()
    return ""


class Plugin:
    """otter's plugin (otter_config.json's "plugins"; otter calls these by name, so no base class is needed).

    Its configuration: ``notebooks``, the course notebooks graded; ``timeout`` and ``memory_mib``, a cell's
    limits. The autograder's copy of the package is the zip's ``files/flashlib``, which otter unpacks into
    ``<autograder>/source/files`` (the submission is ``<autograder>/submission/<notebook>``)."""

    def __init__(self, submission_path, submission_metadata=None, plugin_config=None):
        # otter generate makes one with no submission (its during_generate event), to see that it loads
        self.submission = Path(submission_path).resolve() if submission_path is not None else None
        self.files = self.submission.parent.parent / "source" / "files" if self.submission is not None else None
        self.config = dict(plugin_config or {})
        self.metadata = submission_metadata or {}

    def before_grading(self, config) -> None:
        set_aside(self.submission)

    def before_execution(self, submission):
        return grading_notebook(self.submission, self.files, self.config)

    def after_grading(self, results) -> None:
        line = said(getattr(results, "notebook", None))
        if line:
            results.set_output(line)
