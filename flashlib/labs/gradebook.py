"""The gradebook: what an assignment's items are worth, each student's rows and totals, and the files a
learning platform takes.

Points follow the syllabus's minutes of practice (tools/syllabus.py): 5 per checked exercise, 30 per lab
in PyTorch, 45 per Triton lab. An assignment is the graded cells of its notebooks as the course hands them
out; every one of them is in every student's total, so a deleted cell scores 0 and a cell pasted twice
counts once (the first). A student on the roster with no folder gets 0 on every item.

Files: the long CSV and JSON (one row per student and item, with the checker's whole message, when it was
graded and a digest of the source graded), the wide CSV (one row per student: the id, one column per item,
the total, the possible points and the percent) and one feedback file per student.
"""
from __future__ import annotations

import csv
import datetime
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

POINTS = {"exercise": 5, "lab": 30, "kernel lab": 45}  # the syllabus's minutes of practice for each


@dataclass(frozen=True)
class Item:
    """One graded cell of an assignment: a lab or a checked exercise of a notebook."""

    notebook: str  # the notebook's file name without .ipynb
    name: str
    kind: str  # "lab" or "exercise"
    points: int

    @property
    def id(self) -> str:
        return f"{self.notebook}:{self.name}"


def points(kind: str, name: str) -> int:
    """An item's points: a lab's by whether it is a Triton lab, an exercise's."""
    from .catalog import LABS

    if kind == "lab":
        return POINTS["kernel lab"] if name in LABS and LABS[name].triton else POINTS["lab"]
    return POINTS["exercise"]


@dataclass
class Row:
    """A student's result on one item (or one more cell of an item already graded, ``status`` "duplicate")."""

    student: str
    item: str  # the item's id, notebook:name
    notebook: str
    name: str
    kind: str
    points: float
    possible: int
    passed: bool
    status: str  # graded, missing (no such cell), no submission (not handed in), duplicate, error (not graded)
    message: str
    mistake: str | None = None
    seconds: float | None = None
    graded_at: str | None = None
    source_sha256: str | None = None
    folder: str = ""
    sandboxed: bool = False


@dataclass
class Gradebook:
    items: list[Item]
    rows: list[Row]
    students: list[str]
    sandbox: str
    sandboxed: bool
    graded_at: str = field(default_factory=lambda: now())

    def totals(self) -> dict[str, tuple[float, int]]:
        """Each student's (points, possible points), in the order of ``students``."""
        possible = sum(item.points for item in self.items)
        earned = {s: 0.0 for s in self.students}
        for row in self.rows:
            if row.status != "duplicate":
                earned[row.student] += row.points
        return {s: (earned[s], possible) for s in self.students}

    def ungraded(self) -> list[Row]:
        return [row for row in self.rows if row.status == "error"]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _percent(earned: float, possible: int) -> float:
    return round(100 * earned / possible, 1) if possible else 0.0


def table(book: Gradebook) -> str:
    """The rows as a text table, each student's followed by their total, then the class's."""
    rows = [r for r in book.rows]
    width = {k: max([len(str(getattr(r, k))) for r in rows] + [len(k)]) for k in ("student", "notebook", "name")}
    lines = [f"{'student':<{width['student']}}  {'notebook':<{width['notebook']}}  {'item':<{width['name']}}  "
             f"{'points':>9}  {'passed':<6}  {'seconds':>7}  message"]
    totals = book.totals()
    for i, r in enumerate(rows):
        first = r.message.strip().splitlines()[0] if r.message.strip() else ""
        seconds = f"{r.seconds:>7.1f}" if r.seconds is not None else f"{'':>7}"
        lines.append(f"{r.student:<{width['student']}}  {r.notebook:<{width['notebook']}}  {r.name:<{width['name']}}  "
                     f"{f'{r.points:g}/{r.possible}':>9}  {'yes' if r.passed else 'no':<6}  {seconds}  {first}"
                     + (f" [mistake: {r.mistake}]" if r.mistake else ""))
        if i + 1 == len(rows) or rows[i + 1].student != r.student:
            earned, possible = totals[r.student]
            lines.append(f"{r.student:<{width['student']}}  total: {earned:g} of {possible} points "
                         f"({_percent(earned, possible)}%)")
    everyone = sum(e for e, _ in totals.values())
    lines.append(f"{len(book.students)} students, {len(book.items)} items: {everyone:g} of "
                 f"{sum(p for _, p in totals.values())} points in all; "
                 f"{len(book.ungraded())} cells could not be graded.")
    return "\n".join(lines)


LONG_FIELDS = [f.name for f in Row.__dataclass_fields__.values()]


def write_long_csv(book: Gradebook, path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=LONG_FIELDS)
        writer.writeheader()
        for row in book.rows:
            writer.writerow(asdict(row))


def write_json(book: Gradebook, path) -> None:
    totals = book.totals()
    data = dict(graded_at=book.graded_at, sandboxed=book.sandboxed, sandbox=book.sandbox, points=POINTS,
                items=[dict(id=i.id, notebook=i.notebook, name=i.name, kind=i.kind, points=i.points)
                       for i in book.items],
                students=[dict(student=s, points=e, possible=p, percent=_percent(e, p)) for s, (e, p) in totals.items()],
                rows=[asdict(row) for row in book.rows])
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_wide_csv(book: Gradebook, path) -> None:
    """One row per student: the id, one column per item (its points), total, possible, percent."""
    earned = {(r.student, r.item): r.points for r in book.rows if r.status != "duplicate"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", *(i.id for i in book.items), "total", "possible", "percent"])
        for student, (total, possible) in book.totals().items():
            writer.writerow([student, *(f"{earned.get((student, i.id), 0):g}" for i in book.items), f"{total:g}",
                             possible, _percent(total, possible)])


def _file_name(student: str) -> str:
    return re.sub(r"[^\w.-]+", "_", student).strip("._") or "student"


def write_feedback(book: Gradebook, folder) -> list[Path]:
    """A Markdown file per student: their total, then each item's points and the checker's whole message."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for student, (total, possible) in book.totals().items():
        lines = [f"# {student}: {total:g} of {possible} points ({_percent(total, possible)}%)", "",
                 f"Graded {book.graded_at}; {book.sandbox}.", ""]
        for row in (r for r in book.rows if r.student == student):
            lines += [f"## {row.item} ({row.kind}): {row.points:g} of {row.possible}"
                      + (" (not graded)" if row.status == "error" else ""), "", "```", row.message.strip(), "```", ""]
        path = folder / f"{_file_name(student)}.md"
        path.write_text("\n".join(lines), encoding="utf-8")
        written.append(path)
    return written


def read_roster(path) -> list[str]:
    """Student ids, one a line (blank lines and # comments skipped); a .csv file's column "id" or "student",
    else its first column."""
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".csv":
        rows = list(csv.reader(text.splitlines()))
        if not rows:
            return []
        head = [h.strip().lower() for h in rows[0]]
        column = next((head.index(k) for k in ("id", "student") if k in head), None)
        body = rows[1:] if column is not None else rows
        ids = [r[column or 0].strip() for r in body if r and len(r) > (column or 0)]
    else:
        ids = [line.strip() for line in text.splitlines()]
    return list(dict.fromkeys(i for i in ids if i and not i.startswith("#")))
