"""tools/test_durations.py sums pytest's own junit XML per file: checked on a run of pytest it did not write."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the inner runs need no installed pytest plugin: loading them (nbval's Jupyter imports) was most of each run
BARE = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
sys.path.insert(0, str(ROOT / "tools"))
import test_durations  # noqa: E402


def test_seconds_tests_and_failures_per_file(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n\ndef test_fails():\n    assert 1 == 2\n")
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    f"--junitxml={xml}", str(tmp_path)], cwd=tmp_path, capture_output=True, env=BARE)
    files = test_durations.per_file([xml])
    slow = next(v for k, v in files.items() if k.endswith("test_slow.py"))
    quick = next(v for k, v in files.items() if k.endswith("test_quick.py"))
    assert (slow["tests"], slow["failed"], quick["tests"], quick["failed"]) == (2, 1, 1, 0)
    assert slow["seconds"] >= 0.3 > quick["seconds"]
    out = tmp_path / "durations.json"
    assert test_durations.main([str(xml), "--out", str(out), "--top", "1"]) == 0
    record = json.loads(out.read_text())
    assert list(record["files"])[0].endswith("test_slow.py")  # slowest first


def test_cpu_seconds_tell_a_waiting_test_from_a_working_one(tmp_path):
    # tests/cpu_seconds.py, loaded as the suite's conftest loads it: a sleep costs wall time and no CPU, a
    # loop and a busy child process cost CPU
    (tmp_path / "test_kinds.py").write_text(
        "import subprocess, sys, time\n\n"
        "def test_waits():\n    time.sleep(0.6)\n\n"
        "def test_works():\n    end = time.process_time() + 0.6\n    while time.process_time() < end:\n        pass\n\n"
        "def test_child_works():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nend = time.process_time() + 0.6\\n"
        "while time.process_time() < end: pass'], check=True)\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.cpu_seconds",
                    "-o", "junit_family=xunit1", f"--junitxml={xml}", str(tmp_path / "test_kinds.py")], cwd=ROOT,
                   capture_output=True, check=True, env=BARE)
    import xml.etree.ElementTree as ET

    cpu = {case.get("name"): float(next(p.get("value") for p in case.iter("property") if p.get("name") == "cpu_seconds"))
           for case in ET.parse(xml).getroot().iter("testcase")}
    assert cpu["test_waits"] < 0.3 and cpu["test_works"] >= 0.55 and cpu["test_child_works"] >= 0.55, cpu
    (row,) = test_durations.per_file([xml]).values()
    assert row["cpu_seconds"] >= 1.1 and row["seconds"] >= 1.8, row
