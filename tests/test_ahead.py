"""Compiling ahead (flashlib.bench.ahead, perf_bench.precompile), checked without a GPU.

tests/ahead_probe.py runs in a fresh Python with a stand-in driver that targets sm_90: the
JIT binds and compiles exactly as on an H200 and nothing can be launched. Each probe records
a launch path, compiles the notes on threads, then walks the real path with the real
tensors and counts the binaries it would have had to compile: none, or the step is useless.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashlib.kernels.config import head_dim_pad
from flashlib.ladder import rungs
from tests.triton_versions import triton36_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(*args, triton_path=None):
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ahead_probe.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kernel_name(place):
    return place.rpartition(".")[2]


def _expected(forward, backward, d):
    """(kernel, tiles) the path launches on sm_90, from the rung table."""
    d_pad = head_dim_pad(d)
    rung, chosen = rungs.rung(forward), rungs.backward(backward)
    out = [(_kernel_name(rung.kernel), list(t)) for t in rungs.candidates(rung.tiles, d_pad)]
    out.append((_kernel_name(chosen.kernels["preprocess"]), [64, None, None, None]))
    for role, table in chosen.tiles.items():
        out += [(_kernel_name(chosen.kernels[role]), list(t)) for t in rungs.candidates(table, d_pad)]
    return out


def _check_direct(result, forward, backward, d):
    expected = _expected(forward, backward, d)
    assert list(zip(result["notes"], result["configs"])) == [tuple(e) for e in expected]
    assert result["tuners_kept"] == 0  # recording timed nothing, so no autotuner may have chosen
    assert result["first"]["failed"] == 0, result["first"]["errors"]
    assert result["first"]["kernels"] == len({(n, tuple(c)) for n, c in expected})
    assert result["again"]["kernels"] == 0  # already compiled: nothing submitted twice
    assert result["real_calls"] == len(expected)
    assert result["after_real"] == result["sizes"]  # the real tensors found every binary


def test_recording_needs_compiled_kernels():
    from flashlib.bench import ahead

    with pytest.raises(RuntimeError, match="interpreter"):
        with ahead.recording():
            pass


def test_compiled_ahead_binaries_are_the_ones_a_launch_looks_up_pinned_triton():
    _check_direct(_probe("direct", "lean", "lean", 64, "bfloat16"), "lean", "lean", 64)


def test_compiled_ahead_binaries_are_the_ones_a_launch_looks_up_triton_3_6():
    result = _probe("direct", "lazy-rescale", "bulk", 128, "bfloat16", triton_path=triton36_dir())
    assert result["triton"] == "3.6.0"
    _check_direct(result, "lazy-rescale", "bulk", 128)


def test_precompile_covers_every_kernel_the_ladder_launches_triton_3_6():
    result = _probe("ladder", 64, "float16", triton_path=triton36_dir())
    pre = result["precompile"]
    assert result["triton"] == "3.6.0"
    assert pre["keys"] == 2 and not pre["record_errors"] and pre["failed"] == 0, pre
    assert pre["kernels"] == sum(result["sizes"].values()) > 30
    assert result["tuners_kept"] == 0
    # every launch of both passes, every candidate of every autotuner, at another N: all found
    assert result["real_calls"] == pre["launches_noted"]
    assert result["after_real"] == result["sizes"]
