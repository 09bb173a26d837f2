"""The notebooks on any machine (flashlib.bench.nbcompare, nbexec, notebooks): nbval's rules
without Jupyter, checked against nbval itself on a notebook with planted passes and failures."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flashlib.bench import nbcompare, nbexec, notebooks, processes

ROOT = Path(__file__).resolve().parent.parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def _result(text, kind="execute_result", **more):
    return {"output_type": kind, "data": {"text/plain": text, **more}, "metadata": {}}


# (source, stored outputs, what nbval says: passed, failed or skipped)
PLANTED = [
    ("%matplotlib inline\nimport sys", [], "passed"),
    ('print("tile 2 of 3")', [_stream("tile 2 of 3\n")], "passed"),
    ('print("took 12.5 ms")', [_stream("took 3 ms\n")], "passed"),                      # sanitized: TIME
    ("1 + 1", [_result("2")], "passed"),
    ("import ipywidgets\nipywidgets.IntSlider(value=3)",
     [_result("IntSlider(value=3)", **{WIDGET_VIEW: {"model_id": "a", "version_major": 2, "version_minor": 0}})],
     "passed"),                                                                        # the view is not compared
    ("import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(3, 2))\nax.plot([1, 2]);",
     [_result("[<matplotlib.lines.Line2D at 0x7f00deadbeef>]"),  # nbval sends no history: ';' hides nothing
      _result("<Figure size 300x200 with 1 Axes>", kind="display_data", **{"image/png": "iVBORw0KGgo="})],
     "passed"),                                                                        # the image is not compared
    ("# NBVAL_IGNORE_OUTPUT\nimport random\nprint(random.random())", [_stream("0.5\n")], "passed"),
    ('# NBVAL_RAISES_EXCEPTION\nraise ValueError("planted")',
     [{"output_type": "error", "ename": "ValueError", "evalue": "planted", "traceback": ["stored"]}], "passed"),
    ('# NBVAL_SKIP\nraise RuntimeError("never run")', [], "skipped"),
    ('print("answer:", 6 * 7)', [_stream("answer: 41\n")], "failed"),                  # a planted difference
    ('{}["missing"]', [], "failed"),                                                   # an exception
    ('print("to stderr", file=sys.stderr)', [_stream("to stderr\n", "stderr")], "passed"),
    ('print("a")\nprint("b")', [_stream("a\n"), _stream("b\n")], "passed"),             # streams joined
    ('# DEVICE_DEPENDENT_OUTPUT\nprint("on this machine")', [_stream("on another machine\n")], "failed"),
    ("x = 1", [], "passed"),                                                           # never run when stored
]


def planted_notebook(path: Path) -> Path:
    cells = [{"cell_type": "markdown", "id": "title", "metadata": {}, "source": ["# planted\n"]}]
    for i, (source, outputs, _) in enumerate(PLANTED):
        cells.append({"cell_type": "code", "execution_count": None if source == "x = 1" else i + 1,
                      "id": f"cell-{i}", "metadata": {}, "outputs": outputs, "source": source.splitlines(True)})
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}}
    path.write_text(json.dumps(nb, indent=1))
    return path


def _nbval_says(path: Path) -> dict[int, str]:
    """{cell: passed/failed/skipped} from nbval itself, as CI runs it."""
    done = subprocess.run([sys.executable, "-m", "pytest", str(path), "--nbval", "--nbval-sanitize-with",
                           str(nbcompare.SANITIZE_CFG), "-p", "no:cacheprovider", "-v", "--color=no"],
                          capture_output=True, text=True, timeout=300, cwd=path.parent)
    said = {int(cell): verdict.lower() for cell, verdict in
            re.findall(r"::Cell (\d+) (PASSED|FAILED|SKIPPED)", done.stdout)}
    assert said, done.stdout[-3000:] + done.stderr[-3000:]
    return said


def _runner_says(path: Path, result: Path, device_dependent="compare", site=None) -> dict:
    env = dict(os.environ, **notebooks.fixed_env())
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-m", "flashlib.bench.nbexec", str(path), "--result", str(result),
                    "--device-dependent", device_dependent], env=processes.with_root_on_path(env), timeout=300,
                   check=False, cwd=path.parent)
    (entry,) = json.loads(result.read_text())["notebooks"]
    return entry


def test_the_runner_agrees_with_nbval_on_a_planted_notebook(tmp_path):
    pytest.importorskip("nbval")
    path = planted_notebook(tmp_path / "planted.ipynb")
    expected = {i: verdict for i, (_, _, verdict) in enumerate(PLANTED)}
    assert _nbval_says(path) == expected
    # through the course runner, in the environment the stored outputs were written in
    (entry,) = notebooks.run_course([path], tmp_path / "results.json", budget_s=300, log=lambda *a: None)["notebooks"]
    ours = {c["cell"]: {"differed": "failed"}.get(c["status"], c["status"]) for c in entry["cells"]}
    assert ours == expected and entry["status"] == "failed"
    by_cell = {c["cell"]: c for c in entry["cells"]}
    assert by_cell[9]["difference"] == "mismatch 'stdout': stored 'answer: 41\\n', now 'answer: 42\\n'"
    assert by_cell[10]["error"] == "KeyError: 'missing'" and "KeyError" in by_cell[10]["traceback"]
    assert by_cell[6]["outputs"] and by_cell[6]["note"].startswith("output not compared")


def test_markers_are_read_as_nbval_reads_them():
    plugin = pytest.importorskip("nbval.plugin")
    sources = ["# NBVAL_IGNORE_OUTPUT\nx", "x  # NBVAL_SKIP", "  ## NBVAL_SKIP  \nx", "# NBVAL_RAISES_EXCEPTION",
               "# NBVAL_CHECK_OUTPUT\n# NBVAL_IGNORE_OUTPUT", "# nbval_skip", "# DEVICE_DEPENDENT_OUTPUT"]
    for source in sources:
        with warnings.catch_warnings():  # nbval warns of the conflicting pair, and keeps the last
            warnings.simplefilter("ignore")
            theirs = dict(plugin.find_comment_markers(source))
        ours = nbcompare.cell_options({"source": source})
        for key in ("check", "check_exception", "skip"):
            assert ours[key] == theirs.get(key, key == "check"), (source, key)
    for tags in (["nbval-ignore-output"], ["raises-exception"], ["nbval-skip", "other"]):
        theirs = dict(plugin.find_metadata_tags({"tags": tags}))
        ours = nbcompare.cell_options({"source": "x", "metadata": {"tags": tags}})
        assert {k: ours[k] for k in theirs} == theirs
    assert nbcompare.cell_options({"source": "# DEVICE_DEPENDENT_OUTPUT\nx"})["device_dependent"]
    assert nbcompare.sanitize_patterns() == plugin.get_sanitize_patterns(nbcompare.SANITIZE_CFG.read_text())


def test_outputs_are_compared_as_nbval_compares_them():
    patterns = nbcompare.sanitize_patterns()
    same = nbcompare.compare_outputs
    assert same([_stream("a\nb\n")], [_stream("a\n"), _stream("b\n")]) is None
    assert same([_stream("step 1\rstep 2\n")], [_stream("step 2\n")]) is None
    assert same([_stream("0x7f3a2b1c4d5e\n")], [_stream("0xdeadbeef\n")], patterns) is None
    assert same([_stream("cuda:0\n")], [_stream("cuda:1\n")], patterns) is None
    assert same([_result("2", **{"image/png": "A"})], [_result("2", **{"image/png": "B"})]) is None
    assert same([_result("<Figure>", kind="display_data")], [_result("<Figure>")]) is None  # the kind is not compared
    assert "Missing output fields" in same([], [_stream("a\n")])
    assert "Unexpected output fields" in same([_stream("a\n", "stderr")], [])
    assert "dissimilar number of outputs for key 'text/plain'" in same([_result("1"), _result("2")], [_result("1")])
    assert same([_result("1")], [_result("2")]) == "mismatch 'text/plain': stored '2', now '1'"
    error = {"output_type": "error", "ename": "ValueError", "evalue": "x", "traceback": ["now"]}
    assert same([error], [dict(error, traceback=["stored"])]) is None
    assert same([error], [dict(error, evalue="y")]) == "mismatch 'evalue': stored 'y', now 'x'"


def test_a_notebook_is_read_as_nbformat_reads_it(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    path = planted_notebook(tmp_path / "planted.ipynb")
    ours = nbcompare.read_notebook(path)
    theirs = nbformat.read(str(path), as_version=4)
    assert [c["source"] for c in ours["cells"]] == [c.source for c in theirs.cells]
    assert [c.get("outputs") for c in ours["cells"]] == [c.get("outputs") for c in theirs.cells]
    assert [i for i, _ in nbcompare.code_cells(ours)] == list(range(1, len(PLANTED) + 1))


def test_the_environment_is_the_one_the_stored_outputs_were_written_in(tmp_path):
    fixed = notebooks.fixed_env()
    assert fixed["PYTHONHASHSEED"] == "0" and fixed["OMP_NUM_THREADS"] == "1"
    assert fixed["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"
    (tmp_path / "writer.py").write_text("ENV = {}\n")
    with pytest.raises(ValueError, match="'writer'"):
        notebooks.fixed_env(tmp_path / "writer.py")


def test_the_course_runs_in_order_within_its_budget(tmp_path):
    now, calls = [0.0], []
    paths = [Path(f"/nowhere/{i:02d}_x.ipynb") for i in (1, 2, 3, 4)]

    def run(path, order, result_path, timeout_s, device_dependent):
        calls.append((path.name, order, timeout_s, device_dependent))
        now[0] += {0: 100.0, 1: 300.0}.get(order, 1.0)
        nbexec.write_entry(result_path, dict(notebook=path.name, order=order, status="passed", cells=[]))

    results = notebooks.run_course(paths, tmp_path / "r.json", budget_s=420.0, device_dependent="report",
                                   clock=lambda: now[0], run=run, log=lambda *a: None)
    # the first notebook may take at most NOTEBOOK_TIMEOUT_S; after 400 s, 20 s are left: one more
    # starts (within what is left), and the last is listed as not run
    assert calls == [("01_x.ipynb", 0, notebooks.NOTEBOOK_TIMEOUT_S, "report"),
                     ("02_x.ipynb", 1, notebooks.NOTEBOOK_TIMEOUT_S, "report"), ("03_x.ipynb", 2, 20.0, "report")]
    assert [(e["notebook"], e["status"]) for e in results["notebooks"]] == [
        ("01_x.ipynb", "passed"), ("02_x.ipynb", "passed"), ("03_x.ipynb", "passed"), ("04_x.ipynb", "not run")]
    assert json.loads((tmp_path / "r.json").read_text()) == results
    assert [p.name[:2] for p in notebooks.course()] == sorted(p.name[:2] for p in notebooks.course())


def test_a_notebook_stopped_while_a_cell_runs_says_which(tmp_path):
    path = tmp_path / "r.json"
    nbexec.write_entry(path, dict(notebook="07_x.ipynb", order=6, status="running", cells=[
        dict(cell=0, index=1, line="import torch", status="passed"),
        dict(cell=1, index=3, line="train()", status="running")]))
    notebooks._close_entry(path, "07_x.ipynb", 6, "stopped at the time limit of 180 s", 180.2)
    (entry,) = json.loads(path.read_text())["notebooks"]
    assert entry["status"] == "failed" and entry["cells"][1]["status"] == "failed"
    assert entry["cells"][1]["error"] == "stopped at the time limit of 180 s"
    text = notebooks.format_results({"notebooks": [entry]})
    assert text.splitlines() == ["07_x.ipynb: failed (2 cells, 180.2 s): stopped at the time limit of 180 s",
                                 "  Cell 1 (cell 3, 'train()'): failed: stopped at the time limit of 180 s"]
    notebooks._close_entry(path, "08_x.ipynb", 7, "the notebook's process ended with exit status 1", 2.0)
    assert json.loads(path.read_text())["notebooks"][1]["status"] == "failed"  # never wrote an entry itself


def test_a_device_dependent_cell_is_reported_where_it_is_not_compared():
    source, stored, _ = PLANTED[13]
    cell = {"source": source, "execution_count": 14, "outputs": stored}
    options = nbcompare.cell_options(cell)
    now = [_stream("on this machine\n")]
    assert nbexec.verdict(cell, options, now, ())["status"] == "differed"  # as nbval, in CI
    marked = nbexec.verdict(cell, options, now, (), device_dependent="report")
    assert marked["status"] == "not compared" and marked["outputs"] == "on this machine\n"
    assert marked["would_differ"].startswith("mismatch 'stdout'")
    assert nbexec.notebook_status([dict(marked), dict(status="passed"), dict(status="skipped")]) == "passed"


def test_verdicts_say_what_nbval_would():
    cell = {"execution_count": 1, "outputs": [_stream("a\n")]}
    options = nbcompare.cell_options({"source": "x"})
    assert nbexec.verdict(cell, options, [_stream("a\n")], ())["status"] == "passed"
    assert nbexec.verdict(dict(cell, execution_count=None), options, [], ())["status"] == "failed"
    assert nbexec.verdict(dict(cell, execution_count=None, outputs=[]), options, [_stream("b\n")], ())["status"] \
        == "passed"
    with pytest.raises(ValueError, match="'device_dependent'"):
        nbexec.run_notebook(ROOT / "notebooks" / "01_dense_attention.ipynb", "unused.json", device_dependent="skip")


def test_wheels_carried_for_the_gpu_machine_install_and_serve_the_runner(tmp_path):
    """Where .whl/ holds the notebooks' wheels (tools/notebook_wheels.sh fetches them): they
    install without an index, and IPython and ipywidgets then come from there."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip("no wheels in .whl/ (tools/notebook_wheels.sh fetches them)")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), *map(str, wheels)], check=True, timeout=300)
    probe = ("import IPython, ipywidgets, matplotlib_inline, traitlets, comm; "
             "print(ipywidgets.__file__, IPython.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(target)))
    assert done.returncode == 0, done.stderr
    assert all(p.startswith(str(target)) for p in done.stdout.split())
    path = planted_notebook(tmp_path / "planted.ipynb")
    entry = _runner_says(path, tmp_path / "results.json", site=target)
    assert {c["cell"]: c["status"] for c in entry["cells"] if c["status"] != "passed"} == {
        8: "skipped", 9: "differed", 10: "failed", 13: "differed"}
