"""The syllabus's numbers, counted from the notebooks: words, code, exercises, labs, minutes.

    python tools/syllabus.py                 # print the minutes table
    python tools/syllabus.py --write         # rewrite the table in docs/syllabus.md and README.md
    python tools/syllabus.py measure [NB...] # run each notebook under nbval, one at a time, and record
                                             # its run time in data/syllabus/cpu-DATE.json

A student's minutes per notebook, estimated as:

- reading: the prose's words at READ_WPM words a minute (careful reading of technical text with
  formulas, about half of a general reading speed), plus the code cells' lines at CODE_LPM lines a
  minute (reading a cell and the output it printed);
- practice: EXERCISE_MIN minutes per checked exercise (a code cell that calls a ``check_...``
  function), LAB_MIN per lab (a cell opening with ``# LAB: name``), KERNEL_LAB_MIN when the lab is a
  Triton kernel (its cell holds ``@triton.jit``): a lab is written, run, and fixed after a hint;
- waiting: the notebook's run time under nbval on a CPU, as recorded (rounded up to a minute).

Prose is every Markdown cell but the Colab/setup cells, without HTML comments and link targets;
a word is a whitespace-separated token with a letter or digit in it (so `$N^2$` is one).
tests/test_syllabus.py recounts every number of the table from the notebooks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashlib.labs.gradebook import POINTS  # noqa: E402  the gradebook's points are these minutes

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
PAGE = ROOT / "docs" / "syllabus.md"
README = ROOT / "README.md"
CPU_RECORDS = ROOT / "data" / "syllabus"
GPU_RECORDS = ROOT / "data" / "bench"
SETUP_TAG = "flashlib-setup"  # tools/notebook_setup.py's cells: not the course's prose

READ_WPM = 120
CODE_LPM = 10
EXERCISE_MIN = POINTS["exercise"]
LAB_MIN = POINTS["lab"]
KERNEL_LAB_MIN = POINTS["kernel lab"]

BEGIN, END = "<!-- syllabus-table: begin (tools/syllabus.py --write) -->", "<!-- syllabus-table: end -->"
_CHECK_CALL = re.compile(r"\b\w+\.check_\w+\(")
_LAB = re.compile(r"^# LAB: (\w+)")
_WORD = re.compile(r"\w")


@dataclass(frozen=True)
class Counts:
    notebook: str  # the file's stem, e.g. 03_tiled_attention
    words: int
    code_lines: int
    exercises: int
    labs: tuple[str, ...]
    kernel_labs: tuple[str, ...]

    @property
    def reading_min(self) -> int:
        return max(1, round(self.words / READ_WPM + self.code_lines / CODE_LPM))

    @property
    def practice_min(self) -> int:
        plain = len(self.labs) - len(self.kernel_labs)
        return self.exercises * EXERCISE_MIN + plain * LAB_MIN + len(self.kernel_labs) * KERNEL_LAB_MIN


def prose_words(markdown: str) -> int:
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's text is read, its address is not
    return sum(1 for token in text.split() if _WORD.search(token))


def count(path: Path) -> Counts:
    """The syllabus's counts of one notebook, from its cells."""
    cells = [c for c in nbformat.read(path, as_version=4).cells
             if SETUP_TAG not in c.get("metadata", {}).get("tags", [])]
    words = sum(prose_words(c.source) for c in cells if c.cell_type == "markdown")
    code = [c.source for c in cells if c.cell_type == "code"]
    labs = [(m.group(1), "@triton.jit" in s) for s in code if (m := _LAB.match(s))]
    return Counts(
        notebook=path.stem,
        words=words,
        code_lines=sum(1 for s in code for line in s.splitlines() if line.strip()),
        exercises=sum(1 for s in code if _CHECK_CALL.search(s) and not _LAB.match(s)),
        labs=tuple(name for name, _ in labs),
        kernel_labs=tuple(name for name, kernel in labs if kernel),
    )


def notebooks(folder: Path = NOTEBOOK_DIR) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


# --- recorded run times -----------------------------------------------------------------

def _newest(records: list[Path], has) -> dict | None:
    for path in sorted(records, reverse=True):  # names carry the date: newest first
        data = json.loads(path.read_text())
        if has(data):
            data["file"] = str(path.relative_to(ROOT))
            return data
    return None


def _entries(record: dict) -> list[dict]:
    # measure's record lists the notebooks; the GPU check's report holds the notebooks' results
    # file (flashlib.bench.check: {"notebooks": [...], "job": ...})
    found = record.get("notebooks") or []
    return found.get("notebooks", []) if isinstance(found, dict) else found


def cpu_record() -> dict | None:
    """The newest recorded CPU run of the notebooks (`measure`)."""
    return _newest(list(CPU_RECORDS.glob("cpu-*.json")), lambda d: bool(_entries(d)))


def gpu_record() -> dict | None:
    """The newest GPU check (data/bench/gpu-*.json) that ran the notebooks, if any."""
    return _newest(list(GPU_RECORDS.glob("gpu-*.json")), lambda d: bool(seconds_by_notebook(d)))


def seconds_by_notebook(record: dict | None) -> dict[str, float]:
    """Each notebook's run time; a cell whose output differed still ran (nbval runs every cell),
    a notebook stopped early (an "error" of its own) or never run has no time."""
    if not record:
        return {}
    return {Path(e["notebook"]).stem: e["seconds"] for e in _entries(record)
            if e.get("seconds") is not None and "error" not in e and e.get("status") in ("passed", "failed")}


# --- the table --------------------------------------------------------------------------

def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} s"


def rows(counts: list[Counts], cpu: dict[str, float], gpu: dict[str, float]) -> list[list[str]]:
    """One row per notebook, then the course's total."""
    out, total = [], dict(words=0, exercises=0, labs=0, reading=0, practice=0, cpu=0.0, minutes=0)
    for c in counts:
        run_min = math.ceil(cpu[c.notebook] / 60) if c.notebook in cpu else 0
        minutes = c.reading_min + c.practice_min + run_min
        out.append([c.notebook[:2].rstrip("_"), str(c.words), str(c.code_lines), str(c.exercises),
                    str(len(c.labs)), str(c.reading_min), str(c.practice_min),
                    _seconds(cpu.get(c.notebook)), _seconds(gpu.get(c.notebook)), str(minutes)])
        for key, value in (("words", c.words), ("exercises", c.exercises), ("labs", len(c.labs)),
                           ("reading", c.reading_min), ("practice", c.practice_min),
                           ("cpu", cpu.get(c.notebook, 0.0)), ("minutes", minutes)):
            total[key] += value
    hours = f"{total['minutes']} ({total['minutes'] / 60:.1f} h)"
    out.append(["all", str(total["words"]), str(sum(c.code_lines for c in counts)), str(total["exercises"]),
                str(total["labs"]), str(total["reading"]), str(total["practice"]),
                _seconds(total["cpu"]), _seconds(sum(gpu.values())) if gpu else "—", hours])
    return out


HEADER = ["notebook", "prose words", "code lines", "exercises", "labs", "reading min",
          "exercises + labs min", "CPU run", "GPU run", "student min"]


def table(folder: Path = NOTEBOOK_DIR) -> str:
    """The minutes table as Markdown, between its markers."""
    counts = [count(p) for p in notebooks(folder)]
    cpu_run, gpu_run = cpu_record(), gpu_record()
    lines = [BEGIN, "", "| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |"
              for row in rows(counts, seconds_by_notebook(cpu_run), seconds_by_notebook(gpu_run))]
    lines += ["", _provenance(cpu_run, gpu_run), "", END]
    return "\n".join(lines)


def _provenance(cpu: dict | None, gpu: dict | None) -> str:
    if cpu:
        text = (f"CPU run: each notebook alone under nbval (`{cpu['command']}`), on {cpu['date']}, "
                f"{cpu['cpu']} with {cpu['cores']} cores shared with other work ({_loads(cpu)}), "
                f"Python {cpu['python']}, torch {cpu['torch']}, "
                f"Triton {cpu['triton']} (its interpreter): `{cpu['file']}`.")
        differed = [f"{Path(e['notebook']).stem[:2].rstrip('_')} ({', '.join(e.get('failed', []))})"
                    for e in _entries(cpu) if e.get("status") != "passed"]
        if differed:
            text += (f" In that run these cells printed other than their stored outputs (nbval runs every cell, "
                     f"so the times stand): {'; '.join(differed)}.")
    else:
        text = "CPU run: not recorded yet (`python tools/syllabus.py measure`)."
    if gpu:
        jobs = (gpu.get("notebooks") or {}).get("jobs", 1) if isinstance(gpu.get("notebooks"), dict) else 1
        beside = " beside the GPU tests" if gpu.get("tests") else ""
        at_once = f", {jobs} at a time{beside} on one GPU (so each took longer than alone)" if jobs > 1 else ""
        text += (f" GPU run: the GPU check's nbval run of the notebooks on {gpu.get('device')}, "
                 f"{gpu.get('date')}{at_once}: `{gpu['file']}`.")
    else:
        text += (" GPU run: no recorded GPU run in `data/bench/` has run the notebooks yet "
                 "(`make gpu-check` records one).")
    return text


def _loads(cpu: dict) -> str:
    loads = [e["load_1min"] for e in _entries(cpu) if e.get("load_1min") is not None]
    if not loads:
        return "load not recorded"
    return f"load average {min(loads):.1f}–{max(loads):.1f} as the notebooks started"


def replace_table(text: str, new: str, where: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"syllabus: {where} has no table markers ({BEGIN} ... {END})")
    return text[:start] + new + text[end + len(END):]


# --- measuring --------------------------------------------------------------------------

def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure(paths: list[Path]) -> Path:
    """Run each notebook alone under nbval, as CI does, and record its time; the record's path."""
    command = ("python -m pytest --nbval NOTEBOOK --nbval-sanitize-with notebooks/sanitize.cfg "
               "-p no:cacheprovider --durations=0")
    entries = []
    for path in paths:
        load = float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else None
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "--nbval", str(path.relative_to(ROOT)),
                               "--nbval-sanitize-with", "notebooks/sanitize.cfg", "-p", "no:cacheprovider",
                               "--durations=0", "-q"], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        lines = done.stdout.strip().splitlines()
        failed = [line.split("::")[-1].split(" - ")[0] for line in lines if line.startswith("FAILED")]
        entries.append(dict(notebook=path.name, seconds=round(seconds, 1), load_1min=load,
                            status="passed" if done.returncode == 0 else "failed",
                            pytest=lines[-1] if lines else "", **({"failed": failed} if failed else {})))
        print(f"{path.name}: {entries[-1]['status']} in {seconds:.0f} s ({entries[-1]['pytest']})", flush=True)
    record = dict(date=datetime.date.today().isoformat(), command=command, cpu=_cpu_name(),
                  cores=os.cpu_count(), python=platform.python_version(),
                  torch=_version("torch"), triton=_version("triton"), nbval=_version("nbval"),
                  notebooks=entries)
    CPU_RECORDS.mkdir(parents=True, exist_ok=True)
    out = CPU_RECORDS / f"cpu-{record['date']}.json"
    if out.exists():  # a partial rerun keeps the other notebooks' times of that day
        kept = {e["notebook"]: e for e in json.loads(out.read_text())["notebooks"]}
        kept.update({e["notebook"]: e for e in entries})
        record["notebooks"] = sorted(kept.values(), key=lambda e: e["notebook"])
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=("table", "measure"), default="table")
    parser.add_argument("notebooks", nargs="*", type=Path, help="for measure (default: every notebook)")
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/syllabus.md and README.md")
    args = parser.parse_args(argv)
    if args.action == "measure":
        paths = [p.resolve() for p in args.notebooks] or notebooks()
        print(f"measure: wrote {measure(paths).relative_to(ROOT)}")
        return 0
    new = table()
    if not args.write:
        print(new)
        return 0
    for path in (PAGE, README):
        path.write_text(replace_table(path.read_text(encoding="utf-8"), new, str(path.relative_to(ROOT))),
                        encoding="utf-8")
        print(f"syllabus: table written in {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
