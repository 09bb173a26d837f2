"""tools/test_durations.py sums pytest's own junit XML per file: checked on a run of pytest it did not write."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import test_durations  # noqa: E402


def test_seconds_tests_and_failures_per_file(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n\ndef test_fails():\n    assert 1 == 2\n")
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    f"--junitxml={xml}", str(tmp_path)], cwd=tmp_path, capture_output=True)
    files = test_durations.per_file([xml])
    slow = next(v for k, v in files.items() if k.endswith("test_slow.py"))
    quick = next(v for k, v in files.items() if k.endswith("test_quick.py"))
    assert (slow["tests"], slow["failed"], quick["tests"], quick["failed"]) == (2, 1, 1, 0)
    assert slow["seconds"] >= 0.3 > quick["seconds"]
    out = tmp_path / "durations.json"
    assert test_durations.main([str(xml), "--out", str(out), "--top", "1"]) == 0
    record = json.loads(out.read_text())
    assert list(record["files"])[0].endswith("test_slow.py")  # slowest first
