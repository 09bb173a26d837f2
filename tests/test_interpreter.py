"""flashlib's changes to Triton's CPU interpreter, seen from a kernel of one's own.

Triton patches ``triton.language`` for the interpreter at the start of a launch and again at every
call of a ``@triton.jit`` helper; flashlib skips the repeats inside a launch. A helper must still run
interpreted (the answers below), a helper reached only through ``tl.core`` (``tl.sum``'s module)
still gets its patch, and the language is Triton's own again after the launch.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from flashlib.kernels import _mode  # noqa: E402

_mode.require_triton()  # the interpreter prepared as flashlib prepares it


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _row_sum_kernel(X, Out, N: tl.constexpr, CALLS: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(X + row * N + tl.arange(0, N))
    total = tl.zeros([N], dtype=tl.float32)
    for _ in tl.static_range(CALLS):
        total += _scaled(x, 0.5)  # a helper called CALLS times in every program
    tl.store(Out + row, tl.sum(total, axis=0))  # tl.sum: a helper whose module sees only tl.core


def test_helpers_run_interpreted_and_the_language_is_patched_once_a_launch(monkeypatch):
    scans = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: scans.append(a[0]) or patch_builtin(*a))
    x = torch.arange(6 * 16, dtype=torch.float32).reshape(6, 16) / 7
    out = torch.empty(6)
    _row_sum_kernel[(6,)](x, out, N=16, CALLS=5)

    np.testing.assert_allclose(out.double(), (x.double() * 0.5 * 5).sum(1), rtol=1e-6)
    # Triton alone scans the language 4 times at the launch and 3-4 more at each of the 6 x 6
    # helper calls (193 scans); once patched, a launch scans at the launch and at the first
    # helper that sees another module of the language (tl.sum's tl.core).
    assert 0 < len(scans) <= 12, len(scans)


def test_the_language_is_tritons_own_after_a_launch():
    before = {name: getattr(tl, name) for name in ("dot", "load", "store", "arange", "program_id")}
    _row_sum_kernel[(2,)](torch.ones(2, 16), torch.empty(2), N=16, CALLS=2)
    assert {name: getattr(tl, name) for name in before} == before


def test_a_launch_that_fails_leaves_the_next_one_working():
    with pytest.raises(Exception):
        _row_sum_kernel[(2,)](torch.ones(2, 12), torch.empty(2), N=12, CALLS=1)  # tl.arange needs a power of 2
    out = torch.empty(3)
    _row_sum_kernel[(3,)](torch.ones(3, 16), out, N=16, CALLS=3)
    assert out.tolist() == [24.0, 24.0, 24.0]
    assert _mode._LAUNCH.patched is None
