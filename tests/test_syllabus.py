"""The syllabus (docs/syllabus.md, README's Syllabus section) names every notebook, and its
numbers are the notebooks' own: words, code lines, exercises and labs recounted here from the
notebooks as they are now (tools/syllabus.py), so an edit to a notebook that changes them fails
until `python tools/syllabus.py --write` writes the table again."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import syllabus  # noqa: E402

NOTEBOOKS = syllabus.notebooks()
PAGE = (REPO / "docs" / "syllabus.md").read_text(encoding="utf-8")
README = (REPO / "README.md").read_text(encoding="utf-8")
PATHS = ("A 90-minute lecture demo", "A 3-hour class", "A two-day workshop", "Self-study")


def _short(stem: str) -> str:
    return stem[:2].rstrip("_")  # 03_tiled_attention -> 03, A_machine_code -> A


def _between_markers(text: str) -> str:
    start, end = text.find(syllabus.BEGIN), text.find(syllabus.END)
    assert 0 <= start < end, "no syllabus table markers"
    return text[start:end + len(syllabus.END)]


def _minutes_rows(text: str) -> dict[str, dict[str, str]]:
    """The minutes table's rows by notebook, each as {column: cell}."""
    lines = [line for line in _between_markers(text).splitlines()
             if line.startswith("| ") and not line.startswith("| ---")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}


def test_the_syllabus_names_every_notebook_in_order():
    assert "{doc}" not in PAGE, "a {doc} role shows as raw text on GitHub: link the file instead"
    # links as GitHub resolves them from docs/ (the site's build maps ../notebooks/ to its notebooks/)
    named = re.findall(r"^\| \[\w+\]\(\.\./notebooks/(\w+)\.ipynb\) \|", PAGE, flags=re.M)
    assert named == [p.stem for p in NOTEBOOKS], (
        "the syllabus's table of needs and teaches must have one row per notebook, in course order: "
        f"missing {sorted({p.stem for p in NOTEBOOKS} - set(named))}, extra {sorted(set(named) - {p.stem for p in NOTEBOOKS})}")


@pytest.mark.parametrize("where", ["docs/syllabus.md", "README.md"])
def test_counts_are_the_notebooks(where):
    rows = _minutes_rows(PAGE if where == "docs/syllabus.md" else README)
    wrong = []
    for path in NOTEBOOKS:
        counted = syllabus.count(path)
        row = rows.get(_short(path.stem))
        if row is None:
            wrong.append(f"{path.stem}: no row")
            continue
        for column, value in (("prose words", counted.words), ("code lines", counted.code_lines),
                              ("exercises", counted.exercises), ("labs", len(counted.labs)),
                              ("reading min", counted.reading_min), ("exercises + labs min", counted.practice_min)):
            if row[column] != str(value):
                wrong.append(f"{path.stem}: {column} {row[column]} in {where}, {value} in the notebook")
    assert not wrong, "\n".join(wrong) + "\nrun `python tools/syllabus.py --write`"
    assert set(rows) == {_short(p.stem) for p in NOTEBOOKS} | {"all"}, sorted(rows)


@pytest.mark.parametrize("where", ["docs/syllabus.md", "README.md"])
def test_the_whole_table_is_as_written(where):
    """Totals, run times and provenance too: the table is exactly what the tool writes today."""
    text = PAGE if where == "docs/syllabus.md" else README
    assert _between_markers(text) == syllabus.table(), f"{where}: run `python tools/syllabus.py --write`"


def test_every_notebook_has_a_measured_cpu_run():
    record = syllabus.cpu_record()
    assert record, "no data/syllabus/cpu-*.json: run `python tools/syllabus.py measure`"
    seconds = syllabus.seconds_by_notebook(record)
    missing = [p.stem for p in NOTEBOOKS if not seconds.get(p.stem, 0) > 0]
    assert not missing, f"{record['file']} has no run time for {missing}: `python tools/syllabus.py measure NOTEBOOK`"
    assert record["cores"] >= 1 and record["command"].startswith("python -m pytest --nbval")


def test_the_gpu_column_comes_from_a_recorded_run(tmp_path, monkeypatch):
    monkeypatch.setattr(syllabus, "ROOT", tmp_path)
    monkeypatch.setattr(syllabus, "GPU_RECORDS", tmp_path)
    (tmp_path / "gpu-x-2026-01-01T0000Z.json").write_text(json.dumps({"device": "X", "ladder": {}}))
    assert syllabus.gpu_record() is None  # a run that did not run the notebooks
    # as flashlib.bench.check writes it: the notebooks' results file under "notebooks"; a notebook
    # stopped at its time limit has an error of its own and no time that counts
    (tmp_path / "gpu-x-2026-01-02T0000Z.json").write_text(json.dumps({"device": "X", "date": "2026-01-02", "notebooks": {
        "notebooks": [{"notebook": "01_a.ipynb", "seconds": 12.4, "status": "passed"},
                      {"notebook": "02_b.ipynb", "seconds": 30.0, "status": "failed", "error": "stopped at the time limit"},
                      {"notebook": "03_c.ipynb", "status": "not run"}],
        "job": {"returncode": 1}}}))
    record = syllabus.gpu_record()
    assert record["file"] == "gpu-x-2026-01-02T0000Z.json"
    assert syllabus.seconds_by_notebook(record) == {"01_a": 12.4}
    counts = syllabus.Counts("01_a", words=240, code_lines=10, exercises=1, labs=(), kernel_labs=())
    row = syllabus.rows([counts], {"01_a": 61.0}, syllabus.seconds_by_notebook(record))[0]
    assert row == ["01", "240", "10", "1", "0", "3", "5", "61 s", "12 s", str(3 + 5 + 2)]


def _notebook(tmp_path: Path, cells) -> Path:
    path = tmp_path / "01_scratch.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def test_what_is_counted(tmp_path):
    v4 = nbformat.v4
    path = _notebook(tmp_path, [
        v4.new_markdown_cell("**[Open in Colab](https://example.org/x)** setup words", metadata={"tags": ["flashlib-setup"]}),
        v4.new_code_cell("import os\nprint(1)", metadata={"tags": ["flashlib-setup"]}),
        v4.new_markdown_cell("# Title\n\nSee [the paper](https://arxiv.org/abs/1) on $N^2$ memory — here.\n"
                             "<!-- LAB: hidden note -->"),
        v4.new_code_cell("x = 1\n\n\ny = 2"),
        v4.new_code_cell("answer = None\npassed = exercises.check_tile_count(answer)"),
        v4.new_code_cell("# LAB: tiled_forward\nfrom flashlib import labs\nlabs.check('tiled_forward', f)"),
        v4.new_code_cell("# LAB: attn_fwd_inner\n@triton.jit\ndef inner(x):\n    pass\nlabs.check('attn_fwd_inner', inner)"),
    ])
    counted = syllabus.count(path)
    # Title, See, [the, paper], on, $N^2$, memory, here. ("#" and the dash are no words)
    assert counted.words == 8
    assert counted.code_lines == 2 + 2 + 3 + 5
    assert counted.exercises == 1  # the labs' own check calls are labs, not exercises
    assert counted.labs == ("tiled_forward", "attn_fwd_inner")
    assert counted.kernel_labs == ("attn_fwd_inner",)
    assert counted.practice_min == syllabus.EXERCISE_MIN + syllabus.LAB_MIN + syllabus.KERNEL_LAB_MIN
    assert counted.reading_min == max(1, round(8 / syllabus.READ_WPM + 12 / syllabus.CODE_LPM))


def test_each_path_names_what_to_skip_in_real_notebooks_and_labs():
    sections = re.split(r"^### ", PAGE.split("## Four ways through the course", 1)[1], flags=re.M)[1:]
    assert [s.splitlines()[0].strip() for s in sections] == list(PATHS)
    shorts = {_short(p.stem) for p in NOTEBOOKS}
    labs = {name for p in NOTEBOOKS for name in syllabus.count(p).labs}
    for section in sections:
        title = section.splitlines()[0]
        assert "**Skip:**" in section, f"{title}: says nothing of what to skip"
        skip = section.split("**Skip:**", 1)[1].split("\n\n", 1)[0]
        numbers = set(re.findall(r"\b(\d\d|A)\b", skip))
        for low, high in re.findall(r"\b(\d\d)–(\d\d)\b", skip):
            numbers |= {f"{n:02d}" for n in range(int(low), int(high) + 1)}
        assert numbers and numbers <= shorts, f"{title}: skips notebooks {sorted(numbers - shorts)}, which do not exist"
        named_labs = set(re.findall(r"lab `(\w+)`|labs? `(\w+)`", section))
        named_labs = {a or b for a, b in named_labs}
        assert named_labs <= labs, f"{title}: no lab {sorted(named_labs - labs)}"
    for path in PATHS:
        assert f"**{path}**" in README, f"README's Syllabus section lacks {path!r}"
