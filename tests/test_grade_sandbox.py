"""Every way a cell was found to earn a grade that is not its own, written as a student would write it.

One class, graded once, one cell at a time in one sandboxed worker (so that what one cell leaves behind
meets the next): a cell that writes a pass into its open files and exits, replaces json.dump, calls the
verdicts' listener, looks for the class through the grader's /proc, runs or rewrites a classmate's notebook,
leaves a process behind for the next cell, allocates memory in a child, hands in the course's own code by
every route (the public op, autograd through it, a renamed copy, an import in the body, a name built at run
time, an attribute of an object), hands in SDPA or plain attention as split_kv, imports the worked solutions, loops over a
checker, or reads an answer out of a checker. None earns a point; an honest classmate's do.

The sandbox is bubblewrap's: CI installs it (make test); elsewhere without it these tests are skipped.
"""
from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from flashlib.labs import cells, grade

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("CI") != "true",
                                reason="bubblewrap (bwrap) is not installed: make test installs it")
MARKER = "flashlib-leftover-marker"


def _notebook(path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)


def _solved(name: str) -> str:
    """The worked solution's function, without its cell's marker and check."""
    body = cells.code_cell(name, solved=True).split("\n", 1)[1]
    return body.rsplit("\n\npassed = ", 1)[0]


def _lab(name: str, body: str, answer: str | None = None) -> str:
    return f"# LAB: {name}\nimport torch\nfrom flashlib import labs\n\n{body}\n\npassed = labs.check({name!r}, " \
           f"{answer or name})"


def _renamed_sink_grad() -> str:
    from flashlib import rules

    source = inspect.getsource(rules.sink_grad)
    for old, new in (("sink = ", "s_ = "), ("sink -", "s_ -"), ("others", "dims"), (" p = ", " prob = "),
                     ("p * delta", "prob * delta"), (", p)", ", prob)")):
        source = source.replace(old, new)
    assert source != inspect.getsource(rules.sink_grad)
    return source


def _kernel_loop_copy() -> str:
    """The course's loop of notebook 06's kernel, pasted into the lab's cell under the lab's name."""
    from flashlib.kernels import forward

    source = inspect.getsource(forward._attn_fwd_inner.fn).replace("def _attn_fwd_inner(", "def attn_fwd_inner(")
    return ("# LAB: attn_fwd_inner\nfrom flashlib import labs\nimport triton\nimport triton.language as tl\n"
            "from flashlib.kernels.forward import *\n\n" + source + "\n\npassed = labs.check('attn_fwd_inner', "
            "attn_fwd_inner)")


def _routes(folder: Path) -> dict[str, tuple[str, str]]:
    """{student: (notebook, the cell)}."""
    honest = folder / "z-honest" / "02_online_softmax.ipynb"
    merge = _solved("merge_states")
    found_class = (f"CLASS = {str(folder)!r}\n"
                   "seen = []\n"
                   "for path in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ'):\n"
                   "    try:\n        seen.append(open(path, 'rb').read().decode(errors='replace'))\n"
                   "    except OSError:\n        pass\n"
                   "for path in glob.glob('/proc/*/cwd'):\n"
                   "    try:\n        seen.append(os.readlink(path))\n    except OSError:\n        pass\n"
                   "others = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                   "leak = any(CLASS in text for text in seen) or os.path.exists(CLASS) or len(others) > 4\n")
    return {
        "killer": ("02_online_softmax", "# LAB: merge_states\nimport os, signal\nfrom flashlib import labs\n\n"
                   "for pid in {1, os.getppid()}:\n    for sig in (signal.SIGKILL, signal.SIGSTOP):\n"
                   "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
                   "passed = labs.check('merge_states', None)"),
        "fd": ("02_online_softmax", "# LAB: merge_states\nimport json, os\n\n"
               "forged = json.dumps({'verdicts': [{'name': 'merge_states', 'passed': True, 'message': 'PASS'}]})\n"
               "for fd in os.listdir('/proc/self/fd'):\n    try:\n        os.write(int(fd), forged.encode())\n"
               "    except OSError:\n        pass\nos._exit(0)"),
        "json": ("02_online_softmax", _lab("merge_states", "import builtins, json\n\n"
                 "json.dump = lambda *a, **k: None\njson.dumps = lambda *a, **k: '{\"passed\": true}'\n"
                 "builtins.print = lambda *a, **k: None\n\n"
                 "def merge_states(m_a, l_a, m_b, l_b):\n    return torch.maximum(m_a, m_b), l_a + l_b")),
        "listener": ("02_online_softmax", "# LAB: merge_states\nfrom flashlib.course import verdicts\n\n"
                     "verdicts.listen(print)\nverdicts.report(True, 'PASS: merge_states is right', lab='merge_states')"),
        "proc": ("02_online_softmax", _lab("merge_states", f"import glob, os\n\n{found_class}\n{merge}",
                                           "merge_states if leak else None")),
        "classmate": ("02_online_softmax", _lab("merge_states", "import nbformat\n\n"
                      f"nb = nbformat.read({str(honest)!r}, as_version=4)\n"
                      "exec(nb.cells[0].source.split('passed = ')[0])")),
        "rewrite": ("02_online_softmax", "# LAB: merge_states\nimport nbformat\n\n"
                    f"nb = nbformat.v4.new_notebook()\nnbformat.write(nb, {str(honest)!r})"),
        "a-background": ("02_online_softmax", _lab("merge_states", "import subprocess, sys\n\n"
                         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); "
                         f"open(\"/tmp/leftover\", \"w\").write(\"x\"); time.sleep(60)', {MARKER!r}], "
                         "start_new_session=True)", "None")),
        "b-leftover": ("02_online_softmax", _lab("merge_states", "import glob, os, time\n\ntime.sleep(2.5)\n"
                       "texts = []\nfor path in glob.glob('/proc/*/cmdline'):\n    try:\n"
                       "        texts.append(open(path, 'rb').read().decode(errors='replace'))\n"
                       "    except OSError:\n        pass\n"
                       f"leak = os.path.exists('/tmp/leftover') or any({MARKER!r} in t for t in texts)\n{merge}",
                       "merge_states if leak else None")),
        "memory": ("02_online_softmax", _lab("merge_states", "import subprocess, sys, time\n\n"
                   "children = [subprocess.Popen([sys.executable, '-c', 'b = b\"x\" * (600 * 2**20); import time; "
                   "time.sleep(60)']) for _ in range(3)]  # each within the limit, not together\n"
                   "time.sleep(20)\n" + merge)),
        "op": ("03_tiled_attention", _lab("tiled_forward", "import flashlib\n\n"
               "def tiled_forward(q, k, v, block_q, block_k, causal):\n"
               "    return flashlib.flash_attention(q, k, v, causal=causal, return_lse=True)")),
        "autograd": ("04_backward", _lab("tiled_backward", "import flashlib\n\n"
                     "def tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal):\n"
                     "    with torch.enable_grad():\n"
                     "        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))\n"
                     "        o = flashlib.flash_attention(q, k, v, causal=causal)\n"
                     "        return torch.autograd.grad(o, (q, k, v), dout)")),
        "renamed": ("12_real_models", _lab("sink_grad", _renamed_sink_grad())),
        "kernel-copy": ("06_fused_forward", _kernel_loop_copy()),
        "body-import": ("03_tiled_attention", _lab("tiled_forward",
                        "def tiled_forward(q, k, v, block_q, block_k, causal):\n"
                        "    from flashlib.tiled import tiled_forward as mine\n"
                        "    return mine(q, k, v, block_q=block_q, block_k=block_k, causal=causal)")),
        "getattr": ("04_backward", _lab("tiled_backward", "import importlib\n\n"
                    "def tiled_backward(q, k, v, out, lse, dout, block_q, block_k, causal):\n"
                    "    module = importlib.import_module('flashlib.' + 'backward')\n"
                    "    return getattr(module, 'tiled_' + 'backward')(q, k, v, out, lse, dout, block_q=block_q, "
                    "block_k=block_k, causal=causal)")),
        "attribute": ("02_online_softmax", _lab("merge_states", "import importlib\n\n"
                      "class Holder:\n    pass\n\nholder = Holder()\n"
                      "holder.step = getattr(importlib.import_module('flashlib.softmax'), 'merge_' + 'states')\n\n"
                      "def merge_states(m_a, l_a, m_b, l_b):\n"
                      "    return tuple(holder.step((m_a, l_a), (m_b, l_b)))")),
        "sdpa": ("10_inference", _lab("split_kv", "import torch.nn.functional as F\n\n"
                 "def split_kv(q, k, v, num_splits):\n"
                 "    return F.scaled_dot_product_attention(q[None, None, None], k[None, None], v[None, None])"
                 "[0, 0, 0]")),
        "plain-split": ("10_inference", _lab("split_kv", "def split_kv(q, k, v, num_splits):\n"
                        "    return torch.softmax(k @ q / q.shape[-1] ** 0.5, dim=0) @ v")),
        "z-honest-split": ("10_inference", cells.code_cell("split_kv", solved=True)),
        "solutions": ("02_online_softmax", _lab("merge_states", "from flashlib.labs.solutions.merge_states import "
                                                                "merge_states")),
        "loop": ("03_tiled_attention", "from flashlib.course import exercises\n\nfor guess in range(100):\n"
                 "    if exercises.check_tile_count(guess):\n        break"),
        "checker-source": ("02_online_softmax", "import inspect, math, re\nfrom flashlib.course import exercises\n\n"
                           "source = inspect.getsource(exercises.check_new_denominator)\n"
                           "m, l, x = exercises.NEW_MAXIMUM.values()\n"
                           "answer = eval(re.search(r'expected = (.*?)  #', source).group(1))\n"
                           "passed = exercises.check_new_denominator(answer)"),
        "z-honest": ("02_online_softmax", cells.code_cell("merge_states", solved=True)),
        "z-honest-delta": ("04_backward", "from flashlib.course import exercises\n\n"
                           "def delta(dout, out):\n    return (dout * out).sum(dim=-1)\n\n"
                           "passed = exercises.check_delta(delta)"),
        "z-honest-mask": ("09_masks_and_variants", "from flashlib.course import variant_exercises as exercises\n\n"
                          "def sink_window(b, h, q_idx, kv_idx):\n"
                          "    return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128))\n\n"
                          "passed = exercises.check_sink_window(sink_window)"),
    }


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    for student, (notebook, source) in _routes(folder).items():
        _notebook(folder / student / f"{notebook}.ipynb", source)
    honest = (folder / "z-honest" / "02_online_softmax.ipynb").read_bytes()
    book = grade.grade([folder], timeout=60, memory_mib=1000, jobs=1)
    rows = {(r.student, r.name): r for r in book.rows if r.status not in ("missing", "duplicate")}
    return book, rows, folder, honest


def _row(rows, student: str):
    (row,) = [r for (s, _), r in rows.items() if s == student]
    return row


def test_the_class_ran_sandboxed_and_the_honest_cell_passed(routes):
    book, rows, _, _ = routes
    assert book.sandboxed and book.sandbox.startswith("sandboxed with bubblewrap")
    assert _row(rows, "z-honest").passed and not book.ungraded()
    earned = {s: e for s, (e, _) in book.totals().items() if e}
    assert earned == {"z-honest": 30, "z-honest-delta": 5, "z-honest-mask": 5, "z-honest-split": 30}  # functions judged across the sandbox
    assert "compiled into the kernel it gives dense attention's output" in _row(rows, "z-honest-mask").message


def test_nothing_a_cell_writes_or_replaces_is_a_verdict(routes):
    _, rows, _, _ = routes
    assert _row(rows, "fd").message == "no checker of merge_states ran (a printed PASS is not a verdict)"
    assert _row(rows, "json").message.startswith("NOT YET: merge_states, case ")
    assert _row(rows, "listener").message == "no checker of merge_states ran (a printed PASS is not a verdict)"
    assert _row(rows, "killer").message.startswith("NOT YET: no answer yet")  # the worker lives on


def test_a_cell_sees_no_classmate_and_no_grader(routes):
    _, rows, folder, honest = routes
    assert _row(rows, "proc").message == ("NOT YET: no answer yet; expected a function merge_states(m_a, l_a, m_b, "
                                          "l_b) -> (m, l).")
    assert _row(rows, "classmate").message.startswith("the cell raised FileNotFoundError")
    assert _row(rows, "rewrite").message.startswith("the cell raised FileNotFoundError")
    assert (folder / "z-honest" / "02_online_softmax.ipynb").read_bytes() == honest


def test_what_a_cell_starts_ends_with_it(routes):
    _, rows, _, _ = routes
    assert _row(rows, "b-leftover").message.startswith("NOT YET: no answer yet")  # nothing of the cell before
    for pid in filter(str.isdigit, os.listdir("/proc")):  # nor anything on this machine
        try:
            assert MARKER not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue


def test_memory_is_counted_over_every_process_of_a_cell(routes):
    _, rows, _, _ = routes
    assert _row(rows, "memory").message == "the cell used more than 1000 MiB of memory"
    assert _row(rows, "memory").seconds < 20


@pytest.mark.parametrize("student, said", [
    ("op", "ran the course's own flashlib.op.flash_attention"),
    ("autograd", "ran the course's own flashlib.op."),
    ("renamed", "is a copy of the course's own flashlib.rules.sink_grad"),
    ("kernel-copy", "is a copy of the course's own flashlib.kernels.forward._attn_fwd_inner"),
    ("body-import", "ran the course's own flashlib.tiled.tiled_forward"),
    ("getattr", "ran the course's own flashlib.backward.tiled_backward"),
    ("attribute", "ran the course's own flashlib.softmax.merge_states"),
])
def test_the_courses_own_code_is_refused_by_every_route(routes, student, said):
    _, rows, _, _ = routes
    row = _row(rows, student)
    assert not row.passed and row.mistake == "course_code" and said in row.message, row.message


def test_sdpa_is_not_a_split_kv(routes):
    _, rows, _, _ = routes
    row = _row(rows, "sdpa")
    assert not row.passed and row.mistake == "library_attention"
    assert "called torch's scaled_dot_product_attention" in row.message


def test_keys_never_split_are_named_across_the_sandbox(routes):
    """What the lab's watch saw beside the answer reaches the judge whole: plain attention is no split."""
    _, rows, _, _ = routes
    row = _row(rows, "plain-split")
    assert not row.passed and row.mistake == "no_split", row.message


def test_no_answer_comes_from_the_course(routes):
    _, rows, _, _ = routes
    assert _row(rows, "solutions").message.startswith("the cell raised ModuleNotFoundError")
    assert _row(rows, "loop").message.startswith("NOT YET: 0 is not it")  # the first answer counts
    assert _row(rows, "checker-source").message.startswith("the cell raised AttributeError")
