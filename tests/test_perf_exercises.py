"""The exercise checkers of notebook 08 (flashlib.course.perf_exercises): right answers pass,
known mistakes fail with their hint, missing answers say so."""
from __future__ import annotations

from flashlib.course import perf_exercises


def test_attention_flops_checker(capsys):
    assert perf_exercises.check_attention_flops(2 * 2 * 16 * 4096 ** 2 * 128)
    assert not perf_exercises.check_attention_flops(4 * 2 * 16 * 4096 ** 2 * 128)
    assert "half" in capsys.readouterr().out
    assert not perf_exercises.check_attention_flops(None)


def test_intensity_checker():
    n, d = 8192, 64  # 8192 / 64 = 128 query blocks, each reading K and V again
    assert perf_exercises.check_intensity(4 * n * n * d / ((n * d + 128 * 2 * n * d + n * d + n) * 2))
    assert not perf_exercises.check_intensity(1.0)


def test_saved_multiplies_checker(capsys):
    # by hand: 128 x 64 scores per tile over 256 threads is 32 each; 4096 / 64 = 64 tiles
    assert perf_exercises.check_saved_multiplies(32 * 64)
    assert not perf_exercises.check_saved_multiplies(32)
    assert "N / BLOCK_K" in capsys.readouterr().out
    assert not perf_exercises.check_saved_multiplies(128 * 4096 // 8)
    assert "divide by threads" in capsys.readouterr().out
    assert not perf_exercises.check_saved_multiplies(None)


def test_mma_sync_checker(capsys):
    # one of the five products of 16 query rows (dQ) runs on mma.sync: 1 / 5 of them
    assert perf_exercises.check_mma_sync_fraction(0.2) and perf_exercises.check_mma_sync_fraction(1 / 5)
    assert not perf_exercises.check_mma_sync_fraction(0.25)
    assert "five products" in capsys.readouterr().out
    assert not perf_exercises.check_mma_sync_fraction(1 / 7)
    assert "seven" in capsys.readouterr().out
    assert not perf_exercises.check_mma_sync_fraction(None)


def test_ridge_checker(capsys):
    run = {"ladder": {"ceilings": {"bf16_matmul_tflops": 700.0, "copy_gbps": 4000.0}}}
    assert perf_exercises.check_ridge(700e12 / 4000e9, run)
    assert not perf_exercises.check_ridge(700 / 4000, run)
    assert "factor 1000" in capsys.readouterr().out
    assert not perf_exercises.check_ridge(4000e9 / 700e12, run)
    assert not perf_exercises.check_ridge(175.0, None)
    assert "nothing to check" in capsys.readouterr().out


def test_minimum_intensity(capsys):
    n, d = 8192, 64
    assert perf_exercises.check_minimum_intensity(4 * n * n * d / ((4 * n * d + n) * 2))
    assert not perf_exercises.check_minimum_intensity(4 * n * n * d / (4 * n * d * 2))
    assert "log-sum-exp" in capsys.readouterr().out
