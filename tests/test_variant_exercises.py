"""Notebook 09's checkers: right answers pass, the known mistakes are named."""
from __future__ import annotations

import importlib.util

import pytest

from flashlib.course import variant_exercises as ve


def test_window_tiles(capsys):
    # by hand: query block qb (64 rows) reaches back to key qb*64 - 300, inside the tile 5 back
    # (300 = 4 * 64 + 44), and forward to its own diagonal tile: 6 tiles, except the first 5
    # blocks (1, 2, 3, 4, 5 tiles)
    blocks = 4096 // 64
    assert ve.check_window_tiles(1 + 2 + 3 + 4 + 5 + 6 * (blocks - 5))
    assert not ve.check_window_tiles(blocks * (blocks + 1) // 2)
    assert "without the window" in capsys.readouterr().out
    assert not ve.check_window_tiles(5 * blocks)
    assert "tile's edge" in capsys.readouterr().out
    assert not ve.check_window_tiles(6 * blocks)
    assert "cannot look back" in capsys.readouterr().out
    assert not ve.check_window_tiles(None)


def test_kv_bytes_per_token(capsys):
    assert ve.check_kv_bytes_per_token(2 * 32 * 8 * 128 * 2)
    assert not ve.check_kv_bytes_per_token(2 * 32 * 32 * 128 * 2)
    assert "kv heads only" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the kernel half needs Triton")
def test_sink_window(capsys):
    def right(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128))

    def not_causal(b, h, q_idx, kv_idx):
        return (kv_idx < 4) | (q_idx - kv_idx < 128)

    def python_logic(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) and ((kv_idx < 4) or (q_idx - kv_idx < 128))

    def no_sink(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 128)

    def one_too_many(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx <= 128))

    assert ve.check_sink_window(right)
    assert ve.check_sink_window(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128)))
    for wrong, said in ((not_causal, "future"), (python_logic, "& and |"), (no_sink, "sink"),
                        (one_too_many, "window's edge"), (lambda b, h, q, kv: q >= kv, "window's edge")):
        capsys.readouterr()
        assert not ve.check_sink_window(wrong)
        assert said in capsys.readouterr().out, wrong
