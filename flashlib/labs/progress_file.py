"""Which labs this student has passed, kept in a small file beside the notebooks so it survives a restart.

``labs.check`` writes a lab's name here when it passes; ``labs.progress()`` prints every lab, in
course order, with the time it was first passed. The file is ``.flashlib-progress.json`` in the
kernel's working directory (Jupyter starts a notebook's kernel in the notebook's folder). The
environment variable ``FLASHLIB_PROGRESS`` names another file, or ``off`` writes none (the grader
sets it); outside a Jupyter kernel (a script, a test) nothing is kept unless it names a file.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

FILE = ".flashlib-progress.json"
ENV = "FLASHLIB_PROGRESS"


def path() -> Path | None:
    """Where progress is kept, or None where it is switched off."""
    where = os.environ.get(ENV)
    if where is None:
        return Path(FILE) if _in_kernel() else None
    return None if where.strip().lower() in ("", "off", "0", "no") else Path(where)


def _in_kernel() -> bool:
    """Whether this is a Jupyter kernel's process (importing ipykernel, as pytest's nbval does, is not one)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def read() -> dict[str, str]:
    """{lab: when it was first passed, ISO 8601 UTC}; empty when there is no file or it cannot be read."""
    where = path()
    try:
        data = json.loads(where.read_text(encoding="utf-8")) if where is not None else {}
    except (OSError, ValueError):
        return {}
    passed = data.get("passed", {}) if isinstance(data, dict) else {}
    return {k: v for k, v in passed.items() if isinstance(k, str) and isinstance(v, str)}


def record(name: str) -> None:
    """Note that lab ``name`` passed, keeping the first time; a file that cannot be written is left alone."""
    where = path()
    passed = read()
    if where is None or name in passed:
        return
    passed[name] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        where.write_text(json.dumps({"passed": passed}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except OSError:
        pass  # a read-only folder: the verdict was printed, which is what matters


def table() -> str:
    """Every lab in course order: its notebook, passed or not yet, and when."""
    from .catalog import LABS

    passed = read()
    lines = [f"{'notebook':<20} {'lab':<20} {'passed':<8} first passed"]
    for spec in LABS.values():
        when = passed.get(spec.name)
        lines.append(f"{spec.notebook:<20} {spec.name:<20} {'yes' if when else 'not yet':<8} {when or ''}".rstrip())
    where = path()
    kept = f"kept in {where}" if where is not None else f"not kept here: set {ENV} to a file name"
    lines.append(f"{sum(n in passed for n in LABS)} of {len(LABS)} labs passed ({kept}).")
    return "\n".join(lines)


def progress() -> dict[str, bool]:
    """Print which labs this student has passed; return {lab: passed}."""
    from .catalog import LABS

    print(table())
    passed = read()
    return {name: name in passed for name in LABS}
