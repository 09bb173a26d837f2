"""flashlib.viz: figures show what the algorithm does, checked against independent references."""
import io
import math

import numpy as np
import PIL.Image
import pytest
import torch

from flashlib import trace_tiled_attention
from flashlib.course import viz
from flashlib.softmax import online_softmax_steps


def example(seq=6, dim=4, seed=0):
    torch.manual_seed(seed)
    return torch.randn(1, seq, dim), torch.randn(1, seq, dim), torch.randn(1, seq, dim)


def schedule(seq, block_q, block_k, loop, causal):
    """The tile order each loop visits, written out independently of flashlib.tiled."""
    rows = [(r, min(r + block_q, seq)) for r in range(0, seq, block_q)]
    cols = [(c, min(c + block_k, seq)) for c in range(0, seq, block_k)]
    pairs = [(r, c) for r in rows for c in cols] if loop == "query" else [(r, c) for c in cols for r in rows]
    visible = [(r, c) for r, c in pairs if not causal or c[0] <= r[1] - 1]
    return visible, [(r, c) for r, c in pairs if (r, c) not in visible]


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGBA"))


@pytest.mark.parametrize("value, text", [(1234.5678, "1235"), (0.000123456, "0.0001235"), (-2.0, "-2"),
                                         (3.14159265, "3.142"), (float("-inf"), "-inf")])
def test_fmt4_keeps_four_significant_digits(value, text):
    assert viz.fmt4(value) == text
    assert viz.fmt4(torch.tensor(value)) == text


@pytest.mark.parametrize("loop", ["query", "key"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q, block_k", [(2, 2), (4, 3)])
def test_tile_states_follow_the_schedule(loop, causal, block_q, block_k):
    q, k, v = example()
    trace = trace_tiled_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal, loop=loop)
    order, skipped = schedule(6, block_q, block_k, loop, causal)
    assert [(s.rows, s.cols) for s in trace.steps] == order
    for step in range(len(order)):
        grid = viz.tile_states(trace, step)
        for index, ((r0, r1), (c0, c1)) in enumerate(order):
            tile = grid[r0:r1, c0:c1]
            rows, cols = np.meshgrid(np.arange(r0, r1), np.arange(c0, c1), indexing="ij")
            future = (cols > rows) if causal else np.zeros_like(tile, dtype=bool)
            if index > step:
                assert (tile == viz.TODO_STATE).all()
            else:
                state = viz.CURRENT_STATE if index == step else viz.DONE_STATE
                assert (tile[~future] == state).all()
                assert (tile[future] == viz.MASKED_STATE).all()
        for (r0, r1), (c0, c1) in skipped:
            assert (grid[r0:r1, c0:c1] == viz.SKIPPED_STATE).all()


def test_step_figure_shows_the_current_tile_and_independent_statistics():
    q, k, v = example()
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2)
    view = viz.TileStepView()
    view.draw(trace, 1)  # rows 0:2 after keys 0:4
    assert view.current_box.get_bbox().bounds == (2, 0, 2, 2)
    assert view.titles[0].get_text().startswith("step 1 of steps 0-8")
    assert viz.DISCARD_NOTE == view.fig._suptitle.get_text()
    # Reference: softmax over the first four keys only, in float64.
    s = (q[0, :2].double() @ k[0, :4].double().T) / 2.0
    m = s.max(dim=-1).values
    l = torch.exp(s - m[:, None]).sum(dim=-1)
    partial = torch.softmax(s, dim=-1) @ v[0, :4].double()
    final = torch.softmax(q[0].double() @ k[0].double().T / 2.0, dim=-1) @ v[0].double()
    heights = {name: [p.vertices[1:3, 1].max() if p.vertices[1, 1] >= 0 else p.vertices[1:3, 1].min()
                      for p in view.bars[name].get_paths()] for name in ("m", "l", "partial")}
    np.testing.assert_allclose(heights["m"], m.numpy(), rtol=1e-5)
    np.testing.assert_allclose(heights["l"], l.numpy(), rtol=1e-5)
    np.testing.assert_allclose(heights["partial"], partial.numpy().ravel(), rtol=1e-4, atol=1e-6)
    distance = (partial - final[:2]).abs().max().item()
    assert f"distance {viz.fmt4(distance)}" in view.titles[2].get_text()
    assert "scores held: 4 of 36" in view.titles[2].get_text()


def test_step_text_shows_the_current_score_tile():
    q, k, v = example()
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2)
    view = viz.TileStepView()
    view.draw(trace, 4)  # rows 2:4, keys 2:4
    s = (q[0, 2:4] @ k[0, 2:4].T) / 2.0
    shown = [t.get_text() for t in view._texts if t.axes is view.ax_grid]
    assert shown == [viz.fmt4(x) for x in s.ravel()]


def test_fast_png_equals_a_full_render_and_changes_with_the_step():
    q, k, v = example(seq=10, dim=4, seed=3)
    trace = trace_tiled_attention(q, k, v, block_q=4, block_k=3, causal=True)
    stepping = viz.TileStepView()
    images = []
    for step in range(len(trace.steps)):
        stepping.draw(trace, step)
        fresh = viz.TileStepView()
        fresh.draw(trace, step)
        cached = pixels(stepping.png())
        np.testing.assert_array_equal(cached, pixels(viz.figure_png(fresh.fig)))
        images.append(cached)
    assert all(not np.array_equal(a, b) for a, b in zip(images, images[1:]))


def test_trace_limits_hold_every_value_of_each_panel():
    q, k, v = example()
    trace = trace_tiled_attention(q, k, v, block_q=3, block_k=2, causal=True)
    limits = viz.trace_limits(trace)
    for s in trace.steps:
        for name, t in (("l", s.l), ("out", s.partial), ("m", s.m[torch.isfinite(s.m)])):
            lo, hi = limits[name]
            assert lo <= t.min().item() and t.max().item() <= hi, name


def test_the_distance_restarts_with_every_query_block():
    """One line per query block: the partial outputs of a new block start far from the final
    output again, so joining the last step of one block to the first of the next would draw a
    convergence that does not happen."""
    q, k, v = example()
    for loop in ("query", "key"):
        trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2, loop=loop)
        view = viz.TileStepView()
        view.draw(trace, 0)
        lines = [np.asarray(segment) for segment in view.distance_lines.get_segments()]
        assert len(lines) == 3  # three query blocks
        for line in lines:
            rows = {trace.steps[int(x)].rows for x in line[:, 0]}
            assert len(rows) == 1 and line[-1, 1] == 0.0  # one block each, exact at its last tile


def test_many_output_entries_are_drawn_as_images_of_partial_and_final_output():
    q, k, v = example(seq=64, dim=16, seed=1)
    trace = trace_tiled_attention(q, k, v, block_q=16, block_k=16, causal=True)
    view = viz.TileStepView()
    view.draw(trace, 5)
    now = trace.steps[5]
    image = np.asarray(view.out_image.get_array())
    assert view.out_image.get_visible() and not view.bars["partial"].get_visible()
    np.testing.assert_allclose(image[:, :16], now.partial.numpy(), rtol=1e-6)
    np.testing.assert_allclose(image[:, 17:], trace.out[now.rows[0]:now.rows[1]].numpy(), rtol=1e-6)


def test_bad_step_is_rejected_with_its_range():
    q, k, v = example()
    trace = trace_tiled_attention(q, k, v, block_q=2, block_k=2)
    with pytest.raises(ValueError, match=r"'step'.*0\.\.8.*got 9"):
        viz.tile_step_figure(trace, 9)
    with pytest.raises(ValueError, match="'matrix'"):
        viz.matrix_heatmap(torch.zeros(2, 3, 4))


def test_heatmap_marks_masked_entries():
    s = torch.tensor([[1.0, float("-inf")], [0.5, 2.0]])
    fig = viz.matrix_heatmap(s, "S")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1", "-inf", "0.5", "2"]


def test_online_softmax_figure_colours_seen_current_and_future():
    x = torch.tensor([0.5, 2.0, -1.0, 3.5, 1.0])
    steps = online_softmax_steps(x, block=2)
    fig = viz.online_softmax_figure(x, steps, 2)  # elements 2:4 current
    colors = [tuple(np.round(p.get_facecolor()[:3], 3)) for p in fig.axes[0].patches]
    from matplotlib.colors import to_rgb
    expected = [viz.DONE, viz.DONE, viz.CURRENT, viz.CURRENT, viz.TODO]
    assert colors == [tuple(np.round(to_rgb(c), 3)) for c in expected]
    m = max(x[:4].tolist())
    l = sum(math.exp(t - m) for t in x[:4].tolist())
    assert f"m = {viz.fmt4(m)}, l = {viz.fmt4(l)}" in fig.axes[1].get_title()


def test_error_and_memory_plots_carry_the_data():
    fig = viz.error_curve(["a", "b"], [1e-7, 0.0], tolerance=1e-5)
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [1e-7, 1e-17])
    fig = viz.memory_plot([2, 4], {"dense": [16, 64], "tiled": [8, 16]})
    assert [line.get_label() for line in fig.axes[0].lines] == ["dense", "tiled"]
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [16, 64])


def test_a_drawn_tensor_is_copied_not_viewed():
    # a figure drawn from a float64 tensor must not change when the tensor does, nor pin its storage
    scores = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    fig = viz.matrix_heatmap(scores, annotate=False)
    drawn = fig.axes[0].images[0].get_array().copy()
    scores.mul_(-1).resize_(4, 4)
    assert np.array_equal(fig.axes[0].images[0].get_array(), drawn)
