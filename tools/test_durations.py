"""Seconds per test file, summed from the junit XML files that ``make test`` writes.

    python tools/test_durations.py test-output/junit-*.xml [--out FILE] [--top N]

Prints the slowest files (a test's time counts its set-up and tear-down, so a module's compile fixtures land
on the test that first needs them) and, with ``--out``, writes every file's seconds and test count as JSON:
``make test`` keeps it in ``test-output/durations.json``, and a run worth keeping is copied into
``data/tests/`` with its date, so that a file that grows shows up against the last one.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone


def per_file(paths) -> dict[str, dict]:
    """{file: {"seconds": total, "cpu_seconds": total, "tests": count, "failed": count}} over every testcase of
    ``paths``; CPU seconds where the run recorded them (tests/cpu_seconds.py), else 0."""
    files: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "cpu_seconds": 0.0, "tests": 0, "failed": 0})
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            # xunit1 names the file; xunit2 only the dotted class, from which the module's path is rebuilt
            name = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
            row = files[name]
            row["seconds"] += float(case.get("time") or 0)
            row["cpu_seconds"] += sum(float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_seconds")
            row["tests"] += 1
            row["failed"] += any(child.tag in ("failure", "error") for child in case)
    return {k: {**v, "seconds": round(v["seconds"], 1), "cpu_seconds": round(v["cpu_seconds"], 1)}
            for k, v in files.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", help="junit XML files (pytest --junitxml)")
    parser.add_argument("--out", help="write every file's seconds and test count here as JSON")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest files to print")
    args = parser.parse_args(argv)
    files = per_file(args.xml)
    ranked = sorted(files.items(), key=lambda kv: -kv[1]["seconds"])
    total, cpu = (sum(v[key] for v in files.values()) for key in ("seconds", "cpu_seconds"))
    print(f"test time by file ({sum(v['tests'] for v in files.values())} tests, {total:.0f} s summed over "
          f"workers, {cpu:.0f} s of CPU); the slowest {min(args.top, len(ranked))}:")
    for name, row in ranked[:args.top]:
        print(f"  {row['seconds']:8.1f} s  {row['cpu_seconds']:8.1f} s CPU  {row['tests']:5d} tests  {name}")
    if args.out:
        record = dict(written=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      python=platform.python_version(), machine=platform.machine(), summed_seconds=round(total, 1),
                      cpu_seconds=round(cpu, 1),
                      files=dict(ranked))
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
