"""plots.context: ring_balance draws each rank's work relative to the least busy rank, counted
as bars and measured as dots, and refuses input it cannot draw, saying what to give."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from fsdp_lesson.plots import ring_balance  # noqa: E402
from fsdp_lesson.ring_attention import layout, ring_work  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_bars_are_the_counted_work_over_the_least_and_dots_the_measured():
    counted = {name: [w.scores for w in ring_work(layout(name, 16, 4))]
               for name in ("contiguous", "zigzag")}  # fmt: skip
    measured = {"contiguous": [1.0, 2.5, 2.0, 4.0], "zigzag": [2.0, 2.0, 2.2, 2.0]}
    ax = ring_balance(counted, measured).axes[0]
    heights = [round(bar.get_height(), 9) for bar in ax.patches]
    assert heights == [1, 2, 3, 4, 1, 1, 1, 1]  # contiguous: 16, 32, 48, 64 scores
    dots = [round(float(line.get_ydata()[0]), 9) for line in ax.lines if line.get_marker() == "o"]
    assert dots == [1, 2.5, 2, 4, 1, 1, 1.1, 1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["contiguous", "zigzag"]


@pytest.mark.parametrize(
    ("counted", "measured", "words"),
    [
        ({}, None, "counted: give"),
        ({"zigzag": [1, 0]}, None, "positive work"),
        ({"zigzag": [1, 2]}, {"contiguous": [1.0, 2.0]}, "the same layouts"),
        ({"zigzag": [1, 2]}, {"zigzag": [1.0]}, "seconds for every rank"),
    ],
)
def test_input_it_cannot_draw_is_refused(counted, measured, words):
    with pytest.raises(ValueError, match=words):
        ring_balance(counted, measured)
