"""Reading a notebook and comparing a cell's new outputs with its stored ones, as nbval does.

The rules are nbval's (0.11, as CI runs it with ``notebooks/sanitize.cfg``), so that a
notebook that passes CI passes here on the same machine, and a difference is reported as
nbval would report it:

- markers, from a comment line of the cell (``# NBVAL_IGNORE_OUTPUT``, ``# NBVAL_CHECK_OUTPUT``,
  ``# NBVAL_RAISES_EXCEPTION``, ``# NBVAL_SKIP``) or a cell tag (``nbval-ignore-output``, ...,
  ``raises-exception``); comments win over tags;
- streams of one name are joined into the first (text before a carriage return dropped);
- outputs are compared key by key: a stream by its name, a display or result by each of its
  MIME types, an error by ``ename`` and ``evalue``; metadata, tracebacks, execution counts,
  PNG and JPEG images and widget views are not compared; each text is sanitized with the
  config's regexes first;
- a cell never run in the stored notebook (no execution count) is not compared.

One marker of this project's own: the cell tag ``device-dependent-output`` (or a first line
``# DEVICE_DEPENDENT_OUTPUT``) says that the cell's output depends on the device (a GPU, or the
Triton release that compiles for it). nbval does not know it, so CI compares such a cell as usual,
and its CPU output must be the same on every CPU; on a GPU the runner may report its output
without comparing it. A tag keeps the marker out of the code the student reads.
"""
from __future__ import annotations

import json
import re
import warnings
from collections import defaultdict
from pathlib import Path

COMMENT_MARKERS = {
    "PYTEST_VALIDATE_IGNORE_OUTPUT": ("check", False),
    "NBVAL_IGNORE_OUTPUT": ("check", False),
    "NBVAL_CHECK_OUTPUT": ("check", True),
    "NBVAL_RAISES_EXCEPTION": ("check_exception", True),
    "NBVAL_SKIP": ("skip", True),
    "DEVICE_DEPENDENT_OUTPUT": ("device_dependent", True),
}
TAG_MARKERS = {name.lower().replace("_", "-"): marker for name, marker in COMMENT_MARKERS.items()}
TAG_MARKERS["raises-exception"] = ("check_exception", True)
SKIP_COMPARE = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")
SANITIZE_CFG = Path(__file__).resolve().parent.parent.parent / "notebooks" / "sanitize.cfg"
_CARRIAGE_RETURN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)


def _json_mime(mime: str) -> bool:
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _joined(value):
    return "".join(value) if isinstance(value, list) and all(isinstance(x, str) for x in value) else value


def read_notebook(path) -> dict:
    """The notebook's JSON with multi-line texts joined (as nbformat reads them)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        cell["source"] = _joined(cell.get("source", ""))
        for output in cell.get("outputs", []):
            if output.get("output_type") in ("execute_result", "display_data"):
                output["data"] = {mime: value if _json_mime(mime) else _joined(value)
                                  for mime, value in output.get("data", {}).items()}
            elif "text" in output:
                output["text"] = _joined(output["text"])
    return nb


def code_cells(nb: dict) -> list[tuple[int, dict]]:
    """(index in the notebook, cell) of every code cell, in order; nbval's "Cell k" is the k-th."""
    return [(i, cell) for i, cell in enumerate(nb.get("cells", [])) if cell.get("cell_type") == "code"]


def cell_options(cell: dict) -> dict:
    """{"check", "check_exception", "skip", "device_dependent"} for one code cell."""
    options = {"check": True, "check_exception": False, "skip": False, "device_dependent": False}
    tags = cell.get("metadata", {}).get("tags") or []
    if not isinstance(tags, list):
        warnings.warn("Cell tags is not a list, ignoring.")
        tags = []
    for tag in tags:
        if tag in TAG_MARKERS:
            key, value = TAG_MARKERS[tag]
            options[key] = value
    for line in cell.get("source", "").splitlines():
        line = line.strip()
        if line.startswith("#") and line.lstrip("#").strip() in COMMENT_MARKERS:
            key, value = COMMENT_MARKERS[line.lstrip("#").strip()]
            options[key] = value
    return options


def sanitize_patterns(path=SANITIZE_CFG) -> list[tuple[str, str]]:
    """(regex, replacement) pairs of an nbval sanitize config."""
    text = Path(path).read_text() if path is not None else ""
    return re.findall(r"^regex: (.*)$\n^replace: (.*)$", text, flags=re.MULTILINE)


def coalesce_streams(outputs: list[dict]) -> list[dict]:
    """Every stream joined into the first of its name; a line overwritten after a carriage return
    keeps only what overwrote it."""
    joined, streams = [], {}
    for output in outputs:
        if output.get("output_type") == "stream":
            if output["name"] in streams:
                streams[output["name"]]["text"] += output["text"]
                continue
            output = dict(output)
            streams[output["name"]] = output
        joined.append(output)
    for output in streams.values():  # nbval 0.11's loop over backspaces never runs: nor does one here
        output["text"] = _CARRIAGE_RETURN.sub("", output["text"])
    return joined


def _sanitize(value, patterns):
    if not isinstance(value, str):
        return value
    for regex, replace in patterns:
        value = re.sub(regex, replace, value)
    return value


def _by_key(outputs, patterns) -> dict[str, list]:
    """{key: [values in order]}: a stream by its name, data by MIME type, the rest by field."""
    found = defaultdict(list)
    for output in outputs:
        if output.get("output_type") == "stream":
            output = {"output_type": "stream", output["name"]: output["text"]}
        for key, value in output.items():
            if key in SKIP_COMPARE:
                continue
            if key == "data":
                for mime, data in value.items():
                    if mime not in SKIP_COMPARE:
                        found[mime].append(_sanitize(data, patterns))
            else:
                found[key].append(_sanitize(value, patterns))
    return found


def compare_outputs(new: list[dict], stored: list[dict], patterns=()) -> str | None:
    """None if the outputs agree as nbval compares them, else what differs (nbval's first finding)."""
    test, reference = _by_key(coalesce_streams(new), patterns), _by_key(coalesce_streams(stored), patterns)
    if set(reference) - set(test):
        return f"Missing output fields from running code: {sorted(set(reference) - set(test))}"
    if set(test) - set(reference):
        return f"Unexpected output fields from running code: {sorted(set(test) - set(reference))}"
    for key, ref_values in reference.items():
        test_values = test[key]
        if len(test_values) != len(ref_values):
            return (f"dissimilar number of outputs for key {key!r}: {len(ref_values)} stored, "
                    f"{len(test_values)} now: stored {ref_values!r}, now {test_values!r}")
        for ref_out, test_out in zip(ref_values, test_values):
            if ref_out != test_out:
                return f"mismatch {key!r}: stored {ref_out!r}, now {test_out!r}"
    return None
