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

    def strict(b, h, q_idx, kv_idx):
        return (kv_idx < q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128))

    assert ve.check_sink_window(right)
    assert ve.check_sink_window(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 128)))
    for wrong, said in ((not_causal, "query 0 sees key 1"), (python_logic, "& and |"), (no_sink, "sink"),
                        (one_too_many, "window's edge"), (lambda b, h, q, kv: q >= kv, "window's edge"),
                        (strict, "its own key")):
        ve.SINK_HINTS.reset()
        capsys.readouterr()
        assert not ve.check_sink_window(wrong)
        out = capsys.readouterr().out
        assert said in out and "hint 1 of 3" in out and "return" not in out, (wrong, out)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the kernel half needs Triton")
def test_sink_window_hints_step_from_the_idea_to_code(capsys, tmp_path):
    """The first wrong try gets a diagnosis and the idea; the code comes at the third, or on request."""
    def no_sink(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 128)

    ve.SINK_HINTS.reset()
    outs = []
    for _ in range(4):
        assert not ve.check_sink_window(no_sink)
        outs.append(capsys.readouterr().out)
    assert all("sink" in out.splitlines()[0] for out in outs)  # the diagnosis every time
    assert "hint 1 of 3" in outs[0] and "kv_idx < 4" not in outs[0]
    assert "hint 2 of 3" in outs[1] and "return" not in outs[1]
    assert "hint 3 of 3" in outs[2] and "(kv_idx < 4)" in outs[2] and outs[3] == outs[2]
    ve.solution("sink_window")
    (tmp_path / "answer.py").write_text(capsys.readouterr().out)  # the kernels compile it from its source
    spec = importlib.util.spec_from_file_location("answer", tmp_path / "answer.py")
    answer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(answer)
    assert ve.check_sink_window(answer.sink_window) and ve.SINK_HINTS.given == 0
    with pytest.raises(ValueError, match="sink_window"):
        ve.solution("window_tiles")
