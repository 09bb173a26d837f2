"""Ring attention launched the way a user launches it: ``torchrun --standalone``, three gloo
ranks on this machine's CPUs, each running tests/torchrun_worker.py (two where a rank fails on
purpose: the one other rank must be stopped as several would).

``--standalone`` rendezvouses on a port the OS picks, so runs never collide. Every run has a
time limit and its process group is killed when it is over; a hang fails the test.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flashlib
from flashlib import distributed as fd
from tests import torchrun_worker as worker

ROOT = Path(__file__).resolve().parent.parent
WORLD = 3
FAILING_WORLD = 2  # the runs where rank 1 fails: each rank a process that costs seconds to start
LIMIT = 240  # seconds for one torchrun before it counts as hung


def torchrun(out_dir: Path, *args: str, world: int = WORLD) -> tuple[subprocess.CompletedProcess, float]:
    """Run the worker on ``world`` ranks; (the finished torchrun, its wall time in seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(world), str(ROOT / "tests" / "torchrun_worker.py"), str(out_dir), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # three ranks share the machine's cores
    start = time.monotonic()
    # A session of its own, so that a hung run's ranks are stopped with it.
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within {LIMIT} s; its output:\n{output}")
    done = subprocess.CompletedProcess(command, process.returncode, output)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank saved: {"<layout>-<causal>": [out, dq, dk, dv]}, its shards."""
    out_dir = tmp_path_factory.mktemp("torchrun")
    done, _ = torchrun(out_dir)
    assert done.returncode == 0, done.stdout
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("layout", worker.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_under_torchrun_matches_dense_attention(ranks, layout, causal):
    q, k, v, dout = worker.inputs(WORLD)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = flashlib.dense_attention(*leaves, causal=causal)  # one process, float64
    expected.backward(dout)
    for i, (name, reference) in enumerate(zip(("out", "dq", "dk", "dv"),
                                              (expected.detach(), *(t.grad for t in leaves)))):
        got = fd.unshard([r[f"{layout}-{causal}"][i] for r in ranks], layout=layout)
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-12, msg=name)


def _failure_entries(output: str) -> list[str]:
    """The entries of torchrun's failure summary ("Root Cause" and "Other Failures"), one per rank."""
    summary = output[output.index("Root Cause (first observed failure)"):]
    return re.split(r"\n\[\d+\]:\n", summary)[1:]


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_failing_rank_stops_torchrun_and_is_named(tmp_path, when):
    """Rank 1 raises before the first ring or inside it. Its process exits, so gloo's connections
    to it close and the others' collectives raise at once; torchrun stops the rest at the first
    failure. Neither waits for the collective timeout (COLLECTIVE_TIMEOUT), which bounds the
    remaining case: a rank that hangs without exiting."""
    done, seconds = torchrun(tmp_path, "--fail-rank", "1", "--fail-when", when, world=FAILING_WORLD)
    assert done.returncode != 0
    assert seconds < worker.COLLECTIVE_TIMEOUT.total_seconds(), done.stdout
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished
    entry = [e for e in _failure_entries(done.stdout) if re.search(r"rank\s*: 1 \(local_rank: 1\)", e)]
    assert len(entry) == 1, done.stdout
    assert re.search(r"exitcode\s*: 1 ", entry[0]), entry[0]  # it failed itself, it was not stopped
    assert f"RuntimeError: rank 1 fails on purpose {'before' if when == 'before' else 'inside'} the ring" in entry[0]
