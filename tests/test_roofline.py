"""flashlib.roofline's arithmetic against hand-computed values: FLOPs, bytes, rates, the
roofline, the launch model of causal blocks, the shapes of the backward's products."""
from __future__ import annotations

import pytest

from flashlib import roofline


def test_attention_flops_by_hand():
    # 4 * B * H * N_q * N_k * d = 4 * 2 * 3 * 5 * 7 * 11
    assert roofline.attention_flops(2, 3, 5, 7, 11) == 9240
    assert roofline.attention_flops(2, 3, 5, 7, 11, causal=True) == 4620
    assert roofline.attention_flops(2, 3, 5, 7, 11, mode="bwd") == 23100
    assert roofline.attention_flops(2, 3, 5, 7, 11, mode="fwd_bwd") == 32340
    assert roofline.attention_flops(1, 1, 4096, 4096, 128, causal=True, mode="fwd_bwd") == 3.5 * 2 * 4096 ** 2 * 128


def test_rates_and_roofline_by_hand():
    assert roofline.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert roofline.tflops(5e9, 0.5) == pytest.approx(10.0)
    assert roofline.arithmetic_intensity(1000.0, 250.0) == 4.0
    # 1e12 FLOPs at 100 TFLOP/s: 10 ms; 1e9 bytes at 1000 GB/s: 1 ms -> compute bound
    assert roofline.roofline_ms(1e12, 1e9, 100.0, 1000.0) == pytest.approx(10.0)
    # 1e9 FLOPs: 0.01 ms; 4e9 bytes: 4 ms -> memory bound
    assert roofline.roofline_ms(1e9, 4e9, 100.0, 1000.0) == pytest.approx(4.0)


def test_attention_bytes_by_hand():
    n, d = 256, 64
    # flash2, BLOCK_Q 128: Q once, K and V once per query block (2 blocks), O and lse once
    flash2 = (n * d + 2 * 2 * n * d + n * d + n) * 2
    assert roofline.attention_bytes(1, 1, n, d, block_q=128) == flash2 == 197120
    assert roofline.attention_bytes(3, 4, n, d, block_q=128) == 12 * flash2
    # standard: Q, K, V read and O written; S and P each written and read back
    assert roofline.attention_bytes(1, 1, n, d, method="standard") == (4 * n * d + 4 * n * n) * 2 == 655360


@pytest.mark.parametrize("call, name", [
    (lambda: roofline.attention_flops(0, 1, 1, 1, 1), "batch"),
    (lambda: roofline.attention_flops(1, 1, 1, 1, 2.0), "head_dim"),
    (lambda: roofline.attention_flops(1, 1, 1, 1, 1, mode="bwd+fwd"), "mode"),
    (lambda: roofline.tflops(1.0, 0.0), "milliseconds"),
    (lambda: roofline.attention_bytes(1, 1, 8, 8, method="dense"), "method"),
    (lambda: roofline.roofline_ms(1.0, 1.0, 0.0, 1.0), "peak_tflops"),
    (lambda: roofline.launch_makespan([1], 0), "slots"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        call()


def test_launch_model_by_hand():
    # two slots; durations 1, 2, 3, 4 in order: 3 starts at 1 (ends 4), 4 starts at 2 (ends 6)
    assert roofline.launch_makespan([1, 2, 3, 4], 2) == 6
    # longest first: 4 and 3 start at 0; 2 starts at 3 (ends 5), 1 at 4 (ends 5): the ideal 10 / 2
    assert roofline.launch_makespan([4, 3, 2, 1], 2) == 5
    assert roofline.launch_makespan([], 3) == 0
    # one head of 4 blocks (1 + 2 + 3 + 4 = 10 tiles) on 2 slots: 6 / 5 in order, 5 / 5 longest first
    model = roofline.causal_launch_model(256, block=64, tokens=256, hidden=128, head_dim=128, slots=2)
    assert model == {"in_order": pytest.approx(1.2), "longest_first": pytest.approx(1.0)}


def test_backward_products_by_hand():
    # 16 query rows, 64 key rows, d = 128: four products of 64 rows, dQ of 16 (or 128 transposed)
    shapes = [(rows, cols, inner) for _, rows, cols, inner in roofline.backward_products(16, 64, 128)]
    assert shapes == [(64, 16, 128), (64, 128, 16), (64, 16, 128), (64, 128, 16), (16, 128, 64)]
    assert roofline.backward_products(16, 64, 128, dq_transposed=True)[-1][1:] == (128, 16, 64)
    assert roofline.WGMMA_ROWS == 64


def test_the_least_traffic_reads_every_input_once_and_writes_every_output_once():
    n, d = 4096, 128
    assert roofline.attention_bytes(1, 1, n, d, method="minimum") == (4 * n * d + n) * 2
    assert roofline.attention_bytes(3, 2, n, d, method="minimum") == 6 * (4 * n * d + n) * 2
    flops = roofline.attention_flops(1, 1, n, n, d)
    # below the IO model of the kernels' order, which re-reads K and V for every query block
    assert roofline.attention_bytes(1, 1, n, d, method="minimum") < roofline.attention_bytes(1, 1, n, d)
    assert roofline.arithmetic_intensity(flops, roofline.attention_bytes(1, 1, n, d, method="minimum")) > 0.99 * n / 2
