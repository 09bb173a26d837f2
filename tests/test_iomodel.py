import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashlib.iomodel import flash2_attention_io, flash_attention_io, paper_block_sizes, standard_attention_io


class HBM:
    """Counts element reads and writes as an algorithm touches (rows, cols) blocks."""

    def __init__(self):
        self.reads = self.writes = 0

    def read(self, rows, cols=1):
        self.reads += rows * cols

    def write(self, rows, cols=1):
        self.writes += rows * cols


def simulate_standard(n, d):
    hbm = HBM()
    hbm.read(n, d), hbm.read(n, d), hbm.write(n, n)   # S = Q Kᵀ
    hbm.read(n, n), hbm.write(n, n)                    # P = softmax(S)
    hbm.read(n, n), hbm.read(n, d), hbm.write(n, d)    # O = P V
    return hbm


def simulate_algorithm1(n, d, m_elements):
    """The paper's Algorithm 1, line by line, with uneven last blocks."""
    b_c = math.ceil(m_elements / (4 * d))
    b_r = min(b_c, d)
    hbm = HBM()
    hbm.write(n, d), hbm.write(n), hbm.write(n)        # line 2: O = 0, l = 0, m = -inf
    for j in range(0, n, b_c):
        cols = min(b_c, n - j)
        hbm.read(cols, d), hbm.read(cols, d)           # line 6: K_j, V_j
        for i in range(0, n, b_r):
            rows = min(b_r, n - i)
            hbm.read(rows, d), hbm.read(rows, d), hbm.read(rows), hbm.read(rows)   # line 8
            hbm.write(rows, d), hbm.write(rows), hbm.write(rows)                  # lines 12-13
    return hbm


@given(n=st.integers(1, 300), d=st.integers(1, 64))
def test_standard_counts_match_simulation(n, d):
    io, sim = standard_attention_io(n, d), simulate_standard(n, d)
    assert (io.reads, io.writes) == (sim.reads, sim.writes)


@given(n=st.integers(1, 300), d=st.integers(1, 32), extra=st.integers(0, 5000))
def test_flash_counts_match_simulation(n, d, extra):
    sram_bytes = (4 * d + extra) * 2
    io, sim = flash_attention_io(n, d, sram_bytes, element_size=2), simulate_algorithm1(n, d, sram_bytes // 2)
    assert (io.reads, io.writes) == (sim.reads, sim.writes)
    assert io.bytes == 2 * (sim.reads + sim.writes)


def test_paper_block_sizes():
    # 100 KiB of SRAM in fp16 and d = 64: M = 51200 elements, B_c = ceil(51200 / 256) = 200
    assert paper_block_sizes(64, 100 * 1024) == (64, 200)
    assert paper_block_sizes(128, 100 * 1024) == (100, 100)


def test_flash_traffic_grows_like_n2_d2_over_m():
    d, sram = 64, 192 * 1024
    small, big = flash_attention_io(4096, d, sram), flash_attention_io(16384, d, sram)
    assert 14 < big.total / small.total < 17          # N² scaling (16x)
    assert standard_attention_io(16384, d).total / big.total > 3
    more_sram = flash_attention_io(16384, d, 4 * sram)
    assert 3 < big.total / more_sram.total < 4.2      # ~1/M


def test_flash2_counts():
    io = flash2_attention_io(1000, 64, 128)
    t_r = math.ceil(1000 / 128)
    assert io.reads == 1000 * 64 + t_r * 2 * 1000 * 64 and io.writes == 1000 * 64 + 1000


@pytest.mark.parametrize("call,arg", [
    (lambda: standard_attention_io(0, 64), "'n'"),
    (lambda: standard_attention_io(16, 2.0), "'d'"),
    (lambda: flash_attention_io(16, 64, 100), "'sram_bytes'"),
    (lambda: flash2_attention_io(16, 64, 0), "'block_q'"),
])
def test_bad_arguments(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()
