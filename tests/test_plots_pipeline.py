"""plots.pipeline: the stages' lanes draw every op where the record puts it, the bubble curves
draw the planner's formula, and bad input is refused saying what is wrong."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from fsdp_lesson import plan  # noqa: E402
from fsdp_lesson.pipeline import unit_time_records  # noqa: E402
from fsdp_lesson.plots import OP_COLORS, bubble_curves, pipeline_lanes  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def boxes(ax) -> list[tuple[float, float, float]]:
    """(x, width, y) of every op's box: the lanes' broken_barh collections but the grey ones."""
    found = []
    for collection in ax.collections:
        if tuple(collection.get_facecolor()[0][:3]) == tuple(matplotlib.colors.to_rgb("#eeeeee")):
            continue
        for path in collection.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            found.append((round(x0, 6), round(x1 - x0, 6), round(y0, 6)))
    return found


def test_lanes_draw_every_op_of_every_stage_where_the_record_puts_it():
    records = unit_time_records("1f1b", 3, 4)
    fig = pipeline_lanes(records)
    ax = fig.axes[0]
    drawn = boxes(ax)
    assert len(drawn) == 3 * 8  # 4 forwards and 4 backwards on each of the 3 stages
    want = sorted((start, end - start, s - 0.35) for s, r in enumerate(records)
                  for _, _, start, end in r)  # fmt: skip
    assert sorted(drawn) == [(x, w, round(y, 6)) for x, w, y in want]
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("F0") == 3 and labels.count("B3") == 3
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_xlim() == (0, 12)  # the last op ends at 12 units: M + P - 1 forward and back
    fig.canvas.draw()


def test_measured_records_in_seconds_draw_in_ms():
    records = [[(0, "F", 0.0, 0.002), (0, "B", 0.004, 0.006)], [(0, "F", 0.002, 0.003)]]
    fig = pipeline_lanes(records, unit="ms")
    assert fig.axes[0].get_xlim() == pytest.approx((0, 6))
    assert fig.axes[0].get_xlabel() == "ms"
    assert len(boxes(fig.axes[0])) == 3
    assert set(OP_COLORS) == {"F", "B"}
    fig.canvas.draw()


@pytest.mark.parametrize(
    "records, words",
    [
        ([], "one list of ops per stage"),
        ([[]], "no stage has an op"),
        ([[(0, "X", 0, 1)]], "kind 'X', not 'F' or 'B'"),
        ([[(0, "F", 2, 1)]], "need 0 <= start <= end"),
        ([[(0, "F", 1)]], r"each op is \(micro, 'F' or 'B', start, end\)"),
        ([(0, "F", 0, 1)], r"this is one stage's record: give \[record\]"),
        ([5], r"records\[0\]: a list of"),
    ],
)
def test_lanes_refuse_what_is_not_a_record(records, words):
    with pytest.raises(ValueError, match=words):
        pipeline_lanes(records)


def test_bubble_curves_draw_the_formula_and_the_measured_points():
    fig = bubble_curves((2, 4), [1, 2, 4, 8], measured={"P = 2, measured": {1: 0.5, 8: 0.2}})
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "P = 2, predicted",
        "P = 4, predicted",
        "P = 2, measured",
    ]
    assert list(lines[1].get_ydata()) == [plan.bubble_fraction(4, m) for m in (1, 2, 4, 8)]
    assert list(lines[2].get_xdata()) == [1, 8]
    fig.canvas.draw()
    with pytest.raises(ValueError, match="positive integers"):
        bubble_curves((0,))
    with pytest.raises(ValueError, match="no points"):
        bubble_curves(measured={"empty": {}})
