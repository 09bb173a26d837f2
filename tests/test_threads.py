"""Several threads calling the kernels at once.

Triton's CPU interpreter swaps ``triton.language``'s functions for interpreted ones at the start of
every launch and puts them back at its end, process-wide: without one lock around interpreted
launches, a launch that ends puts the originals back under a launch still running in another
thread ("Did you forget to add @triton.jit?"). Each thread here checks its own answers against
float64 attention, so a race that corrupted numbers instead of raising would fail too.
"""
import math
import sys
import threading

import pytest
import torch

import flashlib
from flashlib.kernels import _mode

THREADS, CALLS = 4, 18


def _reference(q, k, v, visible):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.double()


def _masks(n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    window = 5 + 0  # a closure's number, compiled as a literal
    return [
        (dict(causal=True), j <= i),
        (dict(), torch.ones(n, n, dtype=torch.bool)),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: abs(q_idx - kv_idx) < window), (i - j).abs() < window),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx % 3) != 1), (j % 3) != 1),
    ]


def _worker(seed, failures):
    n = 40
    g = torch.Generator().manual_seed(seed)
    try:
        for call in range(CALLS):
            options, visible = _masks(n)[(seed + call) % 4]
            q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
            out = flashlib.flash_attention(q, k, v, **options)
            err = (out.double() - _reference(q, k, v, visible)).abs().max().item()
            if err > 1e-5:
                failures.append(f"thread {seed}, call {call}: error {err:.3g}")
    except Exception as exc:  # noqa: BLE001 (reported by the test, with the thread's name)
        failures.append(f"thread {seed}: {type(exc).__name__}: {str(exc)[:200]}")


@pytest.mark.parametrize("round_", range(3))
def test_threads_calling_flash_attention(round_):
    failures: list[str] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a loaded machine would
    threads = [threading.Thread(target=_worker, args=(round_ * THREADS + t, failures)) for t in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures


@pytest.mark.skipif(not _mode.interpreting(), reason="the lock is for the interpreter; GPU launches need none")
def test_interpreted_launches_share_one_lock():
    from triton.runtime.interpreter import InterpretedFunction

    assert getattr(InterpretedFunction.run, "flashlib_locked", False)
