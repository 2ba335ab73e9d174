"""The plot helpers render with Agg on small data and draw exactly the data they are given."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from fsdp_lesson.memory import CATEGORIES  # noqa: E402
from fsdp_lesson.plots import (  # noqa: E402
    collective_picture,
    gathered_spans,
    gathered_units,
    loss_curves,
    memory_bars,
    running_mean,
    traffic_bars,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bars(fig) -> list[Rectangle]:
    """The bars of a figure's first axes (the axes' background patch is not a bar)."""
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_running_mean():
    assert running_mean([1, 2, 3, 4], 2).tolist() == [1.5, 2.5, 3.5]
    assert running_mean([1, 2, 3], 10).tolist() == [2.0]  # fewer values than the window


def test_loss_curves_one_line_per_label_smoothed():
    curves = {"single": np.arange(100.0), "dp": np.ones(100)}
    fig = loss_curves(curves, smooth=10)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["single", "dp"]
    x, y = lines[0].get_data()
    assert len(y) == 91 and x[0] == 9 and x[-1] == 99
    assert y[0] == pytest.approx(4.5)  # the mean of 0..9
    fig.canvas.draw()


def test_loss_curves_draws_into_a_given_axes():
    fig, (ax1, ax2) = plt.subplots(1, 2)
    assert loss_curves({"a": np.ones(5)}, smooth=2, ax=ax2) is fig
    assert len(ax2.get_lines()) == 1 and len(ax1.get_lines()) == 0


def test_memory_bars_stack_every_category_for_every_rank():
    peak = dict(params=400, grads=400, optimizer=0, activations=100, buffers=0)
    reports = {"dp": [peak] * 4, "zero3": [dict(peak, params=100)] * 4}
    fig = memory_bars(reports, formula={"dp": dict(params=400, grads=400)})
    rects = bars(fig)
    assert len(rects) == len(CATEGORIES) * 8  # a segment per category, rank and strategy
    heights = [r.get_height() for r in rects]
    assert heights[:4] == [400] * 4  # dp's params on ranks 0-3
    assert heights[20:24] == [100] * 4  # zero3's params
    tops = {r.get_x(): r.get_y() + r.get_height() for r in rects}
    assert sorted(set(tops.values())) == [600, 900]  # each bar's top is its total
    (formula_line,) = fig.axes[0].collections
    assert formula_line.get_segments()[0][0][1] == 800
    fig.canvas.draw()


def test_traffic_bars_stack_kinds_and_mark_the_formula():
    traffic = {
        "dp": {"allreduce": 1000.0, "allgather": 0.0, "reduce_scatter": 0.0},
        "zero3": {"allreduce": 12.0, "allgather": 1000.0, "reduce_scatter": 500.0},
    }
    fig = traffic_bars(traffic, formula={"dp": 1000.0, "zero3": 1512.0})
    rects = bars(fig)
    assert [r.get_height() for r in rects] == [1000, 12, 0, 1000, 0, 500]
    assert rects[-1].get_y() + rects[-1].get_height() == 1512
    (formula_lines,) = fig.axes[0].collections  # a dashed line over each bar
    assert [segment[0][1] for segment in formula_lines.get_segments()] == [1000.0, 1512.0]
    fig.canvas.draw()


def test_collective_picture_shows_every_value_of_every_rank():
    before = [np.arange(8) + 10 * r for r in range(4)]
    after = [np.array([r * 2, r * 2 + 1]) for r in range(4)]
    fig = collective_picture(before, after, "Reduce_scatter_block")
    left, right = fig.axes
    assert [t.get_text() for t in left.texts][:9] == [str(v) for v in range(8)] + ["10"]
    assert len(left.texts) == 32 and len(right.texts) == 8
    assert left.get_images()[0].get_array().shape == (4, 8)
    assert [t.get_text() for t in left.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert fig._suptitle.get_text() == "Reduce_scatter_block"
    assert "→" in [t.get_text() for t in fig.texts]  # the arrow from before to after
    fig.canvas.draw()


def test_gathered_units_draws_one_bar_per_gather_in_unit_rows():
    timeline = [
        ("start", 0),
        ("hold emb gathered", 8),
        ("hold fc1 gathered", 24),
        ("free emb gathered", 16),
        ("hold act", 20),
        ("free fc1 gathered", 4),
        ("hold fc1 gathered", 20),
        ("free fc1 gathered", 4),
    ]
    assert gathered_spans(timeline) == [("emb", 1, 3), ("fc1", 2, 5), ("fc1", 6, 7)]
    fig = gathered_units({"prefetch": timeline, "none": timeline[:1]})
    bottom = fig.axes[2]  # row-major: the two top panels, then the bottoms
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["emb", "fc1"]
    assert len(bottom.collections) == 3
    assert list(fig.axes[0].lines[0].get_ydata()) == [live for _, live in timeline]
