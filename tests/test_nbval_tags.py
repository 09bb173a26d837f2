"""nbval's markers are cell tags, not comment lines a reader sees (tools/nbval_tags.py).

nbval reads a marker either way (nbval.plugin: find_comment_markers on every comment line,
find_metadata_tags on the tags); moving one must leave the options nbval gives each cell as
they were.
"""
from __future__ import annotations

import copy
import sys
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import find_comment_markers, find_metadata_tags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import nbval_tags  # noqa: E402

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def nbval_options(notebook) -> list[dict]:
    """What nbval makes of each code cell's markers, as its collector combines them."""
    found = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            options = defaultdict(bool, find_metadata_tags(cell.metadata))
            options.update(dict(find_comment_markers(cell.source)))
            found.append(dict(options))
    return found


def test_each_marker_becomes_its_tag():
    sources = {"# NBVAL_IGNORE_OUTPUT\nprint(1)": ("nbval-ignore-output", {"check": False}),
               "# NBVAL_SKIP\nraise SystemExit": ("nbval-skip", {"skip": True}),
               "# NBVAL_RAISES_EXCEPTION\n1 / 0": ("raises-exception", {"check_exception": True}),
               "#NBVAL_CHECK_OUTPUT\nprint(2)": ("nbval-check-output", {"check": True}),
               "import os\n\n  # NBVAL_IGNORE_OUTPUT\nprint(os.sep)": ("nbval-ignore-output", {"check": False})}
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]
                                        + [nbformat.v4.new_code_cell("x = 1  # NBVAL_SKIP is only named here")])
    before = nbval_options(notebook)
    assert nbval_tags.convert(notebook) == [0, 1, 2, 3, 4]
    assert nbval_options(notebook) == before
    for cell, (tag, options) in zip(notebook.cells, sources.values()):
        assert cell.metadata["tags"] == [tag]
        assert "NBVAL" not in cell.source and not cell.source.startswith("\n"), cell.source
        assert nbval_options(nbformat.v4.new_notebook(cells=[cell]))[0] == options
    assert notebook.cells[4].source == "import os\n\nprint(os.sep)"  # blank lines inside the code stay
    assert notebook.cells[5].source == "x = 1  # NBVAL_SKIP is only named here"  # not a marker: code


def test_a_tag_already_there_is_not_doubled():
    cell = nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint(1)",
                                     metadata={"tags": ["device-dependent-output", "nbval-ignore-output"]})
    nbval_tags.convert(nbformat.v4.new_notebook(cells=[cell]))
    assert cell.metadata["tags"] == ["device-dependent-output", "nbval-ignore-output"]
    assert cell.source == "print(1)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_marks_nbval_with_tags(path):
    notebook = nbformat.read(path, as_version=4)
    converted = copy.deepcopy(notebook)
    changed = nbval_tags.convert(converted)
    assert nbval_options(converted) == nbval_options(notebook)  # the conversion would keep the behaviour
    assert not changed, (f"{path.name}: cells {changed} mark nbval with a comment line; "
                         f"`python tools/nbval_tags.py notebooks/{path.name}` makes them tags")


def test_check_mode_names_the_cells(tmp_path, capsys):
    path = tmp_path / "a.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                                   nbformat.v4.new_code_cell("# NBVAL_SKIP\ny = 2")]), path)
    assert nbval_tags.main(["--check", str(path)]) == 1
    assert "cells [1]" in capsys.readouterr().err
    assert "NBVAL_SKIP" in path.read_text()  # --check writes nothing
    assert nbval_tags.main([str(path)]) == 0
    assert nbval_tags.main(["--check", str(path)]) == 0


def test_the_site_leaves_marker_lines_out(tmp_path):
    """tools/build_site.py lays out each notebook without its marker lines, whatever its owner
    has converted yet, and leaves the stored notebook as it is."""
    import build_site

    source = "# NBVAL_IGNORE_OUTPUT\nimport time\nprint(time.time())  # NBVAL_SKIP named in a comment stays"
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["device-dependent-output"]})
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A notebook"), cell])
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "docs").mkdir()
    nbformat.write(notebook, tmp_path / "notebooks" / "01_a.ipynb")
    assert build_site.lay_out(tmp_path / "docs", tmp_path / "notebooks", tmp_path / "src") == []
    shown = nbformat.read(tmp_path / "src" / "notebooks" / "01_a.ipynb", as_version=4).cells[1]
    assert shown.source == "import time\nprint(time.time())  # NBVAL_SKIP named in a comment stays"
    assert shown.metadata["tags"] == ["device-dependent-output"]
    assert nbformat.read(tmp_path / "notebooks" / "01_a.ipynb", as_version=4).cells[1].source == source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_hold_no_machine_paths_and_no_warnings(path):
    """A stored output is compared on every machine: an absolute path (a venv's, a home's, a
    temporary folder's) or a warning on stderr there is this machine's, not the course's."""
    machine = ("/work/", "/home/", "/tmp/", "/root/", "site-packages", "Warning:")
    found = []
    for n, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") if output.get("output_type") == "stream" else \
                str(output.get("data", {}).get("text/plain", ""))
            found += [f"cell {n}: {word!r} in {text.strip()[:120]!r}" for word in machine if word in text]
            if output.get("name") == "stderr":
                found.append(f"cell {n}: stderr {text.strip()[:120]!r}")
    assert found == []
