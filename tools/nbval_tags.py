"""nbval's comment markers as cell tags: the same behaviour, and no marker line in the cell.

    python tools/nbval_tags.py NOTEBOOK...           # rewrite the notebooks that hold a marker comment
    python tools/nbval_tags.py --check NOTEBOOK...   # exit 1 and name the cells that still do

nbval reads a comment line `# NBVAL_IGNORE_OUTPUT` (or `_SKIP`, `_RAISES_EXCEPTION`,
`_CHECK_OUTPUT`) anywhere in a cell, and the cell tags `nbval-ignore-output`, `nbval-skip`,
`raises-exception`, `nbval-check-output` just as well (nbval's find_metadata_tags). A tag keeps
the marker out of the code a learner reads, on the site and in JupyterLab. Only the marker lines
are removed (with the blank lines they leave at the cell's top); outputs are kept as stored.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

# nbval's comment markers and the tag that means the same (nbval/plugin.py: comment_markers,
# metadata_tags); PYTEST_VALIDATE_IGNORE_OUTPUT is nbval's old name for NBVAL_IGNORE_OUTPUT.
TAGS = {
    "NBVAL_IGNORE_OUTPUT": "nbval-ignore-output",
    "PYTEST_VALIDATE_IGNORE_OUTPUT": "nbval-ignore-output",
    "NBVAL_CHECK_OUTPUT": "nbval-check-output",
    "NBVAL_RAISES_EXCEPTION": "raises-exception",
    "NBVAL_SKIP": "nbval-skip",
}
# as nbval reads them: a line that, stripped, is '#'s and the marker
MARKER_LINE = re.compile(r"^\s*#+\s*(" + "|".join(TAGS) + r")\s*$")


def strip_markers(source: str) -> tuple[str, list[str]]:
    """The source without its marker lines (and the blank lines they leave on top); the markers."""
    kept, found = [], []
    for line in source.split("\n"):
        match = MARKER_LINE.match(line)
        if match:
            found.append(match.group(1))
        else:
            kept.append(line)
    while found and kept and not kept[0].strip():
        kept.pop(0)
    return "\n".join(kept), found


def convert(notebook) -> list[int]:
    """Move every code cell's marker comments into its tags, in place; the cells changed."""
    changed = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        source, found = strip_markers(cell.source)
        if not found:
            continue
        tags = cell.metadata.setdefault("tags", [])
        tags += [TAGS[m] for m in found if TAGS[m] not in tags]
        cell.source = source
        changed.append(index)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only report the cells that hold a marker comment")
    args = parser.parse_args(argv)
    left = []
    for path in args.notebooks:
        notebook = nbformat.read(path, as_version=4)
        changed = convert(notebook)
        if changed and args.check:
            left.append(f"{path}: cells {changed} mark nbval with a comment; run tools/nbval_tags.py {path}")
        elif changed:
            nbformat.write(notebook, path)
            print(f"{path}: cells {changed} now tagged")
    if left:
        print("\n".join(left), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
