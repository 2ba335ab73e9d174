"""The plot helpers render with Agg on small data and draw exactly the data they are given."""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from fsdp_lesson import plan, plots  # noqa: E402
from fsdp_lesson.data import build_rows  # noqa: E402
from fsdp_lesson.flat import FlatParam  # noqa: E402
from fsdp_lesson.memory import CATEGORIES  # noqa: E402
from fsdp_lesson.plots import (  # noqa: E402
    COMPUTE,
    PLANNED,
    batch_by_rank,
    bytes_per_parameter,
    cluster_picture,
    collective_picture,
    gathered_spans,
    gathered_units,
    loss_curves,
    memory_bars,
    name_statistics,
    running_mean,
    shard_layout,
    step_collectives,
    step_events,
    timeline,
    token_rows,
    traffic_bars,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def notebook_names() -> set[str]:
    """Every name the notebooks take from plots: `plots.X` and `from fsdp_lesson.plots import`."""
    names = set()
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        for source in ("".join(c["source"]) for c in cells if c["cell_type"] == "code"):
            names |= set(re.findall(r"\bplots\.([A-Za-z_]\w*)", source))
            for imported in re.findall(r"from fsdp_lesson\.plots import (\([^)]*\)|.*)", source):
                names |= {n.strip() for n in imported.strip("()").split(",") if n.strip()}
    return names


def test_the_package_offers_every_name_the_notebooks_use():
    names = notebook_names()
    assert {"memory_bars", "timeline", "gathered_units"} <= names  # the scan finds them
    assert sorted(names - set(plots.__all__)) == []
    assert all(hasattr(plots, name) for name in plots.__all__)


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


def test_name_statistics_one_bar_per_letter():
    fig = name_statistics(np.array([2, 4, 4, 15]), np.arange(26))
    assert len(fig.axes) == 2 and len(fig.axes[1].patches) == 26
    fig.canvas.draw()


def test_token_rows_writes_every_token_and_marks_the_target():
    X, Y = build_rows(["emma"], seq_len=16)
    fig = token_rows(X, Y, "emma")
    ax = fig.axes[0]
    assert len(ax.texts) == 5 * 17
    assert [t.get_text() for t in ax.texts[:17]] == list("............emma.")
    assert ax.get_images()[0].get_array()[0].tolist() == [0] * 12 + [1] * 4 + [2]
    fig.canvas.draw()


def test_batch_by_rank_row_b_is_kept_by_rank_b_mod_n():
    fig = batch_by_rank(np.arange(1, 13), 4)
    kept = fig.axes[1].get_images()[0].get_array()
    assert kept.shape == (4, 12)
    assert all(kept[b % 4, b] == b % 4 + 1 and kept[:, b].sum() == b % 4 + 1 for b in range(12))
    fig.canvas.draw()


def test_cluster_picture_names_each_rank_with_its_engine_id():
    fig = cluster_picture([2, 0, 3, 1])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if "MPI rank" in t] == [
        "engine id 2 = MPI rank 0", "engine id 0 = MPI rank 1",
        "engine id 3 = MPI rank 2", "engine id 1 = MPI rank 3",
    ]  # fmt: skip
    fig.canvas.draw()


def collectives(stage: str, phase: str, **options) -> list[tuple[str, str]]:
    return [
        (kind, label)
        for p, kind, label in step_events(stage, **options)
        if p == phase and kind != COMPUTE
    ]


def test_step_events_follow_the_strategies():
    """The collectives of one step, as strategies/*.py call them (and Comm counts them)."""
    grads = ["grad fc2", "grad fc1", "grad emb"]  # backward runs the layers in reverse
    params = ["params emb", "params fc1", "params fc2"]
    assert collectives("dp", "backward") == [("allreduce", g) for g in grads]
    assert collectives("dp", "update") == []
    assert collectives("zero1", "backward") == []
    assert collectives("zero1", "update") == [  # every owned gradient first, then the updates
        *[("reduce_scatter", g) for g in grads[::-1]],
        *[("allgather", p) for p in params],
    ]
    assert collectives("zero2", "backward") == [("reduce_scatter", g) for g in grads]
    assert collectives("zero2", "update") == [("allgather", p) for p in params]
    assert collectives("zero3", "forward") == [("allgather", p) for p in params]
    assert collectives("zero3", "backward", prefetch=False) == [
        pair
        for p, g in zip(params[::-1], grads, strict=True)
        for pair in (("allgather", p), ("reduce_scatter", g))
    ]
    # prefetch: the next unit's allgather is issued before this one's reduce-scatter
    assert collectives("zero3", "backward") == [
        ("allgather", "params fc2"), ("allgather", "params fc1"), ("reduce_scatter", "grad fc2"),
        ("allgather", "params emb"), ("reduce_scatter", "grad fc1"), ("reduce_scatter", "grad emb"),
    ]  # fmt: skip
    for stage in PLANNED:  # and every step logs its loss
        assert collectives(stage, "log") == [("allreduce", "loss (8 B)")]
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        step_events("zero4")


def test_step_collectives_draws_one_box_per_event():
    fig = step_collectives("zero2")
    ax = fig.axes[0]
    boxes = [p for p in ax.patches if not isinstance(p, Rectangle)]
    assert len(boxes) == len(step_events("zero2"))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "allreduce", "allgather", "reduce_scatter"
    ]  # fmt: skip
    fig.canvas.draw()


def test_shard_layout_one_slice_per_rank_and_the_padding():
    layouts = {"fc2": FlatParam({"W": (64, 27), "b": (27,)}, 4)}
    fig = shard_layout(layouts, zoom_cells=10)
    slices = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert [r.get_width() for r in slices] == [439, 439, 439, 438, 1]  # rank 3's + 1 padding
    assert len(fig.axes[1].patches) == 10
    fig.canvas.draw()


def test_bytes_per_parameter_stacks_params_grads_optimizer():
    fig = bytes_per_parameter({"fp32": plan.FP32_ADAM, "mixed": plan.MIXED_ADAM})
    widths = [r.get_width() for r in bars(fig)]
    assert widths == [4, 4, 8, 2, 2, 12]
    fig.canvas.draw()


def test_formula_legend_names_the_dashed_line_and_keeps_it_in_the_frame():
    from fsdp_lesson.plots import PAPER_FORMULA, formula_legend

    peak = dict(params=400, grads=400, optimizer=0, activations=100, buffers=0)
    fig = formula_legend(memory_bars({"dp": [peak]}, formula={"dp": dict(params=2000)}))
    ax = fig.axes[0]
    (line,) = ax.collections
    assert line.get_label() == PAPER_FORMULA
    assert PAPER_FORMULA in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_ylim()[1] > 2000  # above the line, which is above the bar
    fig.canvas.draw()


def test_memory_bars_mark_the_peak_at_one_moment_and_say_what_they_stack():
    peak = dict(params=400, grads=400, optimizer=0, activations=100, buffers=300)
    fig = memory_bars({"zero2": [peak] * 2}, at_once={"zero2": [950, 960]})
    ax = fig.axes[0]
    (moment,) = ax.collections  # no formula: the only line collection is the peak at one moment
    assert [segment[0][1] for segment in moment.get_segments()] == [950, 960]
    assert "stacked" in ax.get_title() and "not one moment" in ax.get_title()
    assert "peak at one moment" in [t.get_text() for t in ax.get_legend().get_texts()]
    from fsdp_lesson.plots import PAPER_FORMULA, formula_legend

    both = {"zero2": [peak] * 2, "zero3": [peak] * 2}
    fig = memory_bars(both, formula={"zero2": peak}, at_once={"zero2": [950] * 2, "zero3": [9] * 2})
    labels = [t.get_text() for t in formula_legend(fig).axes[0].get_legend().get_texts()]
    assert labels.count("peak at one moment") == 1 and labels.count(PAPER_FORMULA) == 1, labels


def test_memory_timeline_starts_its_axis_at_zero():
    from fsdp_lesson.plots import memory_timeline

    timeline = [("hold x", 300_000), ("hold dlogits", 310_000), ("free x", 290_000)]
    ax = memory_timeline({"dp": timeline}).axes[0]
    assert ax.get_ylim()[0] == 0  # an 18 kB rise is not drawn as tall as a 150 kB one


def test_memory_timeline_shades_backward_from_dlogits():
    from fsdp_lesson.plots import memory_timeline

    timeline = [("start", 10), ("hold emb", 12), ("hold dlogits", 15), ("free emb", 11)]
    ax = memory_timeline({"zero3": timeline}).axes[0]
    (shade,) = [p for p in ax.patches if not isinstance(p, Rectangle) or p.get_width() != 1]
    assert shade.get_x() == 1.5  # between "hold emb" and "hold dlogits"
    assert list(ax.get_lines()[0].get_ydata()) == [10, 12, 15, 11]


def test_memory_timeline_dots_each_gather_and_says_so_in_the_title():
    from fsdp_lesson.plots import memory_timeline

    events = ["start", "hold fc1 gathered", "hold fc1", "free fc1 gathered", "hold dlogits"]
    fig = memory_timeline(
        {
            "zero3": list(zip(events, [1, 5, 6, 2, 3], strict=True)),
            "dp": [("start", 1), ("hold dlogits", 2)],
        }
    )
    zero3, dp = fig.axes
    dotted = [line.get_xdata()[0] for line in zero3.get_lines()[1:]]
    assert dotted == [1] and "dotted: a layer is gathered" in zero3.get_title()
    assert len(dp.get_lines()) == 1 and "dotted" not in dp.get_title()


def test_rank_shards_fills_each_ranks_slice():
    from fsdp_lesson.flat import FlatParam
    from fsdp_lesson.plots import rank_shards

    fig = rank_shards({"fc": FlatParam({"W": (5,)}, 2)}, 2)
    assert len(fig.axes) == 2
    widths = [[p.get_width() for p in ax.patches] for ax in fig.axes]
    assert widths == [[5, 3], [5, 2, 1]]  # the layer, rank 1's 2 numbers + 1 padding


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


def test_timeline_draws_each_collective_kind_on_its_own_lane_under_a_title():
    trace = [  # a prefetched allgather overlapping a reduce-scatter, as zero3 records them
        ("comm", "allgather emb", 0.000, 0.002),
        ("compute", "backward fc1", 0.001, 0.003),
        ("comm", "reduce_scatter fc1", 0.002, 0.005),
        ("comm", "allgather fc1", 0.003, 0.004),
    ]
    ax = timeline({"prefetch": [trace, trace], "none": [trace[:2]]}).axes[0]
    lanes = {}  # colour -> the y of its bars
    for collection in ax.collections:
        (x, y), *_ = collection.get_paths()[0].vertices
        lanes.setdefault(tuple(collection.get_facecolor()[0][:3]), set()).add(round(y % 1, 6))
    assert len(ax.collections) == 4 + 4 + 2
    assert len(lanes) == 3 and all(len(ys) == 1 for ys in lanes.values())  # one lane per kind
    assert len({y for ys in lanes.values() for y in ys}) == 3  # the kinds do not overlap
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "compute (per unit)",
        "allgather",
        "reduce-scatter",
    ]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["prefetch r0", "prefetch r1", "none r0"]
    assert ax.get_title()


def test_ring_moves_follow_ring_py():
    """The table in fsdp_lesson/ring.py's docstring, N = 4: what each rank sends, step by step."""
    from fsdp_lesson.plots import ring_moves

    assert [sent for _, _, sent in ring_moves(4)] == [
        [3, 0, 1, 2], [2, 3, 0, 1], [1, 2, 3, 0],  # reduce-scatter
        [0, 1, 2, 3], [3, 0, 1, 2], [2, 3, 0, 1],  # allgather
    ]  # fmt: skip


def test_ring_steps_sums_then_spreads_every_chunk():
    from fsdp_lesson.plots import ring_steps

    fig = ring_steps(4)
    panels = fig.axes[:4] + fig.axes[4:7]  # start, 3 reduce-scatter steps, 3 allgather steps
    labels = [[t.get_text() for t in ax.texts[:16]] for ax in panels]  # by rank, chunk
    assert labels[0] == [str(r) for r in range(4) for _ in range(4)]
    assert labels[1][4 * 1 + 3] == "0+1"  # step 0: rank 1 added rank 0's chunk 3
    assert [labels[3][5 * r] for r in range(4)] == ["Σ"] * 4  # rank r: the sum of chunk r
    assert labels[-1] == ["Σ"] * 16
    outlined = [[p for p in ax.patches if not p.get_fill()] for ax in panels]
    assert [len(o) for o in outlined] == [0] + [4] * 6  # every rank receives once per step
    numbers = [[np.arange(4) * (r + 1) for r in range(4)]] * 7
    with_numbers = ring_steps(4, numbers)
    assert with_numbers.axes[0].texts[5].get_text() == "2"  # rank 1's chunk 1
    assert "value" in with_numbers.axes[-1].texts[0].get_text()  # the legend says what they are
    fig.canvas.draw()


def test_lever_bars_split_the_master_out_of_the_optimizer_state():
    from fsdp_lesson.plots import LEVER_PARTS, lever_bars

    peak = dict(params=200, grads=200, optimizer=1200, activations=50, buffers=10)
    peaks, mixed = {"fp32": [peak] * 2, "bf16": [peak] * 2}, {"fp32": False, "bf16": True}
    fig = lever_bars(peaks, mixed, formula={"fp32": 1600, "bf16": 1600})
    heights = [r.get_height() for r in bars(fig)]
    assert len(heights) == len(LEVER_PARTS) * 4
    master = LEVER_PARTS.index("master") * 2  # bars go configuration, part, rank
    per_config = len(LEVER_PARTS) * 2
    assert heights[master : master + 2] == [0, 0]  # fp32 has no master copy
    assert heights[per_config + master : per_config + master + 2] == [400, 400]  # a third
    tops = {r.get_x(): r.get_y() + r.get_height() for r in bars(fig)}
    assert set(tops.values()) == {1660}  # splitting moves no byte
    (line,) = fig.axes[0].collections
    assert [s[0][1] for s in line.get_segments()] == [1600, 1600]
    fig.canvas.draw()


def test_activation_vs_batch_draws_measured_points_on_predicted_lines():
    from fsdp_lesson.plots import activation_vs_batch

    fig = activation_vs_batch([8, 16], {"plain": [10, 20]}, {"plain": [10, 20]})
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[10, 20], [10, 20]]
    fig.canvas.draw()


def test_activation_vs_sequence_draws_the_ledger_solid_and_the_counts_dashed():
    from fsdp_lesson.plots import activation_vs_sequence

    fig = activation_vs_sequence([16, 32], {"ledger": [10, 20]}, {"naive P": [4, 16]})
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.lines] == [[10, 20], [4, 16]]
    assert [line.get_linestyle() for line in ax.lines] == ["-", "--"]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    fig.canvas.draw()


def test_precision_curves_draws_the_reference_solid_and_the_differences_below():
    from fsdp_lesson.plots import precision_curves

    losses = np.linspace(3, 2, 300)
    fig = precision_curves({"fp32": losses, "bf16": losses + 0.01}, margin=0.02, smooth=10)
    top, bottom = fig.axes
    assert [line.get_linestyle() for line in top.lines] == ["-", "--"]
    (difference,) = [line for line in bottom.lines if line.get_label() == "bf16 − fp32"]
    assert np.allclose(difference.get_ydata(), 0.01)


def test_loss_scale_marks_every_skipped_step():
    from fsdp_lesson.plots import loss_scale

    scales, skipped = [2.0**20, 2.0**19, 2.0**19, 2.0**20], [True, False, False, False]
    ax = loss_scale(scales, skipped).axes[0]
    marks = ax.lines[1]
    assert list(marks.get_xdata()) == [0] and list(marks.get_ydata()) == [20]
    assert "(1)" in marks.get_label()
