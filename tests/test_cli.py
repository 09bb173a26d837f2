import json
import re
import subprocess
import sys

import pytest
import torch

from flashlib import dense_attention
from flashlib.bench.cpu import peak_allocated_bytes


def test_demo_prints_shape_table_and_passing_checks():
    done = subprocess.run([sys.executable, "-m", "flashlib", "demo"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stacked dense and tiled outputs: [2, 1, 6, 4]" in out
    assert out.count("[pass]") == 3 and "FAIL" not in out
    rows = re.findall(r"^\s+(\d)\s+(\d)-(\d)\s+(\d)-(\d)\s+(\d+)\s+(\d+)\s+(\S+)$", out, re.M)
    assert len(rows) == 9
    # recompute each step's distance independently: partial output = attention over keys seen so far
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4) for _ in range(3))
    final = dense_attention(q, k, v)
    for _, r0, r1, _, c1, tile, full, dist in rows:
        r0, r1, c1 = int(r0), int(r1) + 1, int(c1) + 1
        partial = dense_attention(q[:, r0:r1], k[:, :c1], v[:, :c1])
        assert (int(tile), int(full)) == (4, 36)
        assert abs(float(dist) - (partial - final[:, r0:r1]).abs().max().item()) < 1e-3


def test_peak_allocated_bytes_counts_exactly():
    assert peak_allocated_bytes(torch.empty, 1000, dtype=torch.float32) == 4000
    a = torch.randn(256, 64)
    # S and P are both (256, 256) float32; the peak holds at least those two
    assert peak_allocated_bytes(dense_attention, a, a, a) >= 2 * 256 * 256 * 4


# torch 2.10 and 2.11 give this warning whenever a profile starts (from torch.profiler.profiler)
_MEASURE_QUIETLY = """
import io, json, sys, warnings
import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler.profiler import _KinetoProfile
from flashlib.bench.cpu import _native_stderr_silenced, peak_allocated_bytes

if sys.argv[1] == "as-torch-2.11":
    original = _KinetoProfile.prepare_trace

    def prepare_trace(self):
        original(self)
        warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the current "
                      "cycle will be reported.To keep events across cycles, set acc_events=True.",
                      UserWarning, stacklevel=2)  # attributed to the profiler's own frame, as torch does

    _KinetoProfile.prepare_trace = prepare_trace
shown = sys.stderr = io.StringIO()  # as in a Jupyter kernel, whose sys.stderr is not file descriptor 2
peaks = [peak_allocated_bytes(torch.empty, 1000, dtype=torch.float32)]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    peaks.append(peak_allocated_bytes(torch.empty, 1000, dtype=torch.float32))
sys.stderr = sys.__stderr__
with warnings.catch_warnings(record=True) as bare, _native_stderr_silenced():  # last: torch 2.11 warns once
    with profile(activities=[ProfilerActivity.CPU]):
        pass
print(json.dumps({"bare": [str(w.message) for w in bare], "peaks": peaks, "shown": shown.getvalue(),
                  "recorded": [str(w.message) for w in seen]}))
"""


@pytest.mark.parametrize("torch_behaviour", ["as-installed", "as-torch-2.11"])
def test_peak_allocated_bytes_prints_nothing_on_stderr(torch_behaviour):
    """A stored notebook output must not depend on the profiler's version: neither a Python
    warning (Jupyter shows those on sys.stderr) nor native output reaches stderr, and the
    figure is the same."""
    done = subprocess.run([sys.executable, "-W", "always", "-c", _MEASURE_QUIETLY, torch_behaviour],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if torch_behaviour == "as-torch-2.11":
        assert any("Profiler clears events" in m for m in result["bare"])  # a bare profile does warn
    assert result["peaks"] == [4000, 4000]
    assert result["shown"] == "" and result["recorded"] == []


def test_bench_cpu_command_writes_json_with_provenance(tmp_path, capsys):
    """``python -m flashlib bench cpu``: one process per point, a JSON with provenance, a table."""
    from flashlib.__main__ import main

    assert main(["bench", "cpu", "--sizes", "256", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cpu-*.json")
    printed = capsys.readouterr().out
    assert f"wrote {path}" in printed and "tiled/dense" in printed
    data = json.loads(path.read_text())
    prov = data["provenance"]
    assert prov["torch"] == torch.__version__ and prov["date"] and prov["cpu"]
    assert {(p["method"], p["n"]) for p in data["points"]} == {("dense", 256), ("tiled", 256)}
    dense256 = next(p for p in data["points"] if p["method"] == "dense" and p["n"] == 256)
    assert dense256["peak_alloc_bytes"] >= 2 * 256 * 256 * 4
    assert all(p["seconds"] > 0 for p in data["points"]) and len(data["ratios"]) == 1


def test_gpu_check_command_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the command would run the whole check")
    from flashlib.__main__ import main

    assert main(["gpu-check", "--skip-bench"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_a_training_step_peak_counts_its_gradients_even_after_an_earlier_step():
    """A step that frees the gradients of an earlier step (as training loops do) must not
    report a peak below the gradients it allocates itself: frees of memory allocated before
    the measured call are not the call's savings."""
    from flashlib import tiled_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 512, 64, generator=g, requires_grad=True) for _ in range(3))  # (B, H, N, D)
    dout = torch.randn(1, 1, 512, 64, generator=g)

    def step(attention):
        q.grad = k.grad = v.grad = None  # the previous step's gradients, freed inside the window
        attention(q, k, v).backward(dout)

    grad_bytes = 3 * q.numel() * q.element_size()
    for attention in (dense_attention, lambda a, b, c: tiled_attention(a, b, c, block_q=128, block_k=128)):
        first, second = peak_allocated_bytes(step, attention), peak_allocated_bytes(step, attention)
        assert first == second >= grad_bytes + q.numel() * 4  # the gradients and the output at least
        assert sum(t.grad.numel() * 4 for t in (q, k, v)) == grad_bytes
