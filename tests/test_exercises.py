"""The exercise checkers (fsdp_lesson/exercises/): a right answer passes, each usual mistake
gets its own line saying where and how, a stub says "not solved yet", and no line gives the
expected value. The cluster-side parts run in the notebooks (nbval) and in their student copies
(test_student.py)."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fsdp_lesson import checks, plan
from fsdp_lesson.attention import attention, merge
from fsdp_lesson.commbench import tcp_payload_rate
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler
from fsdp_lesson.exercises import (
    checkpoints,
    communication,
    context,
    data_parallel,
    dataset,
    fsdp_practice,
    many_hosts,
    memory,
    pipeline,
    single_rank,
    tensor_parallel,
    transformer,
    zero3,
)
from fsdp_lesson.model import MLP, loss_and_grads
from fsdp_lesson.pipeline import Stage
from fsdp_lesson.rng import make_rng

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def student(monkeypatch):
    """A student copy's mode: a failure prints ✗ and returns False."""
    monkeypatch.setattr(checks, "STRICT", False)


def lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_hsdp_groups_name_the_group_and_the_kind():
    actual = {"shard": [[0, 1], [2, 3]], "replicate": [[0, 2], [1, 3]]}
    assert fsdp_practice.groups_mistake(([[0, 1], [2, 3]], [[0, 2], [1, 3]]), actual) is None
    strided = fsdp_practice.groups_mistake(([[0, 2], [1, 3]], [[0, 1], [2, 3]]), actual)
    assert strided.startswith("shard group 0 is [0, 2]: not the ranks") and "consecutive" in strided
    consecutive = fsdp_practice.groups_mistake(([[0, 1], [2, 3]], [[0, 1], [2, 3]]), actual)
    assert consecutive.startswith("replicate group 0 is [0, 1]")
    assert "2 are expected" not in fsdp_practice.groups_mistake(([[0, 1, 2, 3]], []), actual)
    assert "a pair" in fsdp_practice.groups_mistake([[0, 1]], actual)


def test_smallest_n_checkers_pass_the_key_and_name_each_mistake(capsys, student):
    assert memory.check_smallest_n_70b(math.ceil(16 * 70e9 / (40 * 2**30)))
    assert not memory.check_smallest_n_70b(math.ceil(16 * 70e9 / 40e9))
    assert not memory.check_smallest_n_70b(math.ceil(16 * 70e9 / (40 * 2**30)) - 1)
    assert not memory.check_smallest_n_70b(None)
    _, gib, too_few, stub = lines(capsys)
    assert "40 GiB, 40 × 2³⁰ bytes" in gib and "one too few" in too_few
    assert "not solved yet" in stub

    def key(stage, psi, gpu):
        unsharded = {"dp": 16, "zero1": 4, "zero2": 2, "zero3": 0}[stage] * psi
        if unsharded > gpu or (unsharded == gpu and 16 * psi - unsharded):
            return math.inf
        return (
            1
            if unsharded == 16 * psi
            else max(1, math.ceil((16 * psi - unsharded) / (gpu - unsharded)))
        )

    assert memory.check_smallest_n(key)
    assert not memory.check_smallest_n(lambda s, p, g: 1 if s == "dp" else key(s, p, g))
    assert not memory.check_smallest_n(lambda s, p, g: None)
    _, dp_finite, stub = lines(capsys)
    assert dp_finite.startswith("✗ smallest_n: dp, Ψ = 7 B, 40 GiB: a finite N")
    assert "16" not in dp_finite.split("—")[1]  # the hint asks, it gives no formula
    assert "not solved yet" in stub


def test_bytes_per_rank_names_each_mistake_once(capsys, student):
    """Exercise 07-4: a usual mistake is one line, named, over every rank and configuration
    it shows in (the ledgers here: the planner's, equal to the live ones in 07)."""
    model, n = ModelConfig(), 4
    configs = {p: TrainConfig(precision=p) for p in ("fp32", "bf16")}
    peaks = {
        p: [plan.ledger_bytes("zero3", model, n, "adam", 32, precision=p)] * n for p in configs
    }

    def check(**mistake):
        return memory.check_bytes_per_rank(
            lambda s, z, k, p: memory._lever_figures(s, z, k, p, **mistake),
            model, configs, peaks, n,
        )  # fmt: skip

    assert check()
    assert lines(capsys) == ["✓ bytes_per_rank: correct — every category of every rank's ledger"]
    named = {
        "the unpadded size": dict(pad="none"),
        "padded: dp pads nothing": dict(pad="all"),
        "without its fp32 master copy": dict(master=False),
        "4 bytes an element in bf16": dict(item16=4),
    }
    for words, mistake in named.items():
        assert not check(**mistake)
        head, line, tail = lines(capsys)
        assert head.startswith("✗ bytes_per_rank:") and words in line, (head, line)
        assert "every rank" in line or words.startswith("padded"), line
    assert not memory.check_bytes_per_rank(lambda *a: None, model, configs, peaks, n)
    assert lines(capsys) == ["✗ bytes_per_rank: not solved yet"]


FAST_STEP, CABLE_BYTES = 0.012, 2.6e6  # notebook 13's fast step (s) and one cable's bytes


def key_prediction(fast_step, cable_bytes, bits_per_second):
    return fast_step + cable_bytes / tcp_payload_rate(bits_per_second)


def test_the_prediction_checker_names_bits_headers_and_the_missing_compute(capsys, student):
    def check(predict):
        return many_hosts.check_prediction(predict, FAST_STEP, CABLE_BYTES)

    assert check(key_prediction)
    assert lines(capsys) == [
        "✓ a link that costs nothing: correct",
        "✓ predicted step at 300 Mbit/s: correct",
    ]
    wrong = {
        "too small by a factor of 8: bytes divided by bits per second": lambda f, c, b: (
            f + c / tcp_payload_rate(b) / 8
        ),
        "too small by about 4 %: the frames' headers are left out": lambda f, c, b: f + 8 * c / b,
        "too small by a factor of about 8.4: bytes divided by bits per second, and no headers": (
            lambda f, c, b: f + c / b
        ),
        "too large by a factor of 8: the bytes made bits twice": lambda f, c, b: (
            f + 8 * c / tcp_payload_rate(b)
        ),
        "the bytes multiplied by the rate": lambda f, c, b: (
            f  # nothing on a free link
            + c * tcp_payload_rate(b) * (b < 1e12)
        ),
        "too large by a factor of 2: both directions counted": lambda f, c, b: (
            f + 2 * c / tcp_payload_rate(b)
        ),
        "too large — bits or bytes?": lambda f, c, b: f + 1.5 * c / tcp_payload_rate(b),
    }
    for how, predict in wrong.items():
        assert not check(predict)
        out = lines(capsys)
        assert out[-1].startswith(f"✗ predicted step at 300 Mbit/s: the link's time is {how}"), out
    assert not check(lambda f, c, b: c / tcp_payload_rate(b))  # the compute left out
    assert not check(lambda f, c, b: 2 * f + c / tcp_payload_rate(b))
    assert not check(lambda f, c, b: None)
    assert not check(lambda f, c, b: "soon")
    assert not check(lambda f, c, b: 1e3 * key_prediction(f, c, b))  # milliseconds
    compute, twice, stub, text, milliseconds = lines(capsys)
    assert milliseconds == (
        "✗ a link that costs nothing: too large by a factor of 1000: milliseconds, where seconds"
        " are asked for"
    )
    assert compute.startswith("✗ a link that costs nothing: about 0 s, the fast link's step left")
    assert twice.startswith("✗ a link that costs nothing: too large, where the fast link's step")
    assert stub == "✗ predicted step at 300 Mbit/s: not solved yet"
    assert "a str, where seconds" in text
    right = key_prediction(FAST_STEP, CABLE_BYTES, many_hosts.ASKED) - FAST_STEP
    for shown in (f"{right:.3f}", f"{1e3 * right:.1f}", f"{1e3 * right:.0f}"):
        assert shown not in " ".join(lines(capsys)), "a line gives the expected link time"


def test_hiding_batch_checker_names_the_stage_and_hides_the_formula(capsys, student):
    def key(stage, n, flops, bandwidth):
        return (3 if stage == "zero3" else 2) * (n - 1) / n * 2 * flops / (6 * bandwidth)

    assert communication.check_hiding_batch(key)
    assert not communication.check_hiding_batch(
        lambda stage, n, flops, bandwidth: key("dp", n, flops, bandwidth)
    )
    out = lines(capsys)
    assert out[-1] == (
        "✗ hiding_batch (zero3): dp's batch — zero3 moves more bytes per step than dp: it"
        " gathers every layer in forward and again in backward"
    )
    assert not communication.check_hiding_batch(
        lambda stage, n, flops, bandwidth: 1.2 * key(stage, n, flops, bandwidth)
    )
    assert lines(capsys)[-1].startswith("✗ hiding_batch (dp): item 0: too large (and 5 more)")
    assert communication.batch_that_hides("zero3", 512, 989e12, 50e9) == pytest.approx(
        key("zero3", 512, 989e12, 50e9)
    )


def test_owned_shards_name_a_converted_dtype_once():
    expected = {f"fc{i}.{w}": np.arange(4, dtype=np.float32) for i in (1, 2) for w in ("m", "v")}
    converted = {key: value.astype(np.float16) for key, value in expected.items()}
    (line,) = checkpoints.shard_problems(converted, expected)
    assert line == (
        "fc1.m: float16 values, where the state is float32 (and 3 more arrays): keep"
        " the array's own dtype (cut it, do not convert it)"
    )
    wrong = dict(expected, **{"fc2.v": expected["fc2.v"] + 1})
    assert checkpoints.shard_problems(wrong, expected) == [
        "fc2.v: item 0: one too many (and 3 more)"
    ]


@pytest.fixture(scope="module")
def seed_pass():
    model = MLP(ModelConfig())
    rng = make_rng(42)
    params = model.init_params(rng)
    data = Dataset.load()
    X, Y = GlobalBatchSampler(data.X_train, data.Y_train, 32, rng).next()
    return model, params, X, Y


def stage_pass(stage, params, pp, x, y, dtype=np.float32, send_on=True):
    """Notebook 12's exercise 1, with two usual mistakes switchable."""
    if not stage.is_first:
        x = pp.recv(np.empty((len(y), stage.in_width), dtype), pp.rank - 1)
    caches = []
    for layer in stage.layers:
        x, cache = layer.forward(params[layer.name], x)
        caches.append(cache)
    if stage.is_last:
        _, loss_cache = stage.loss.forward(x, y)
        dx = stage.loss.backward(loss_cache)
    else:
        if send_on:
            pp.send(x, pp.rank + 1).wait()
        dx = pp.recv(np.empty((len(y), stage.out_width), np.float32), pp.rank + 1)
    grads = {}
    for layer, cache in zip(reversed(stage.layers), reversed(caches), strict=True):
        p = params[layer.name]
        grads[layer.name] = {k: np.empty_like(v) for k, v in p.items()}
        dx = layer.backward(p, cache, dx, grads[layer.name])
    if not stage.is_first:
        pp.send(dx, pp.rank - 1).wait()
    return grads


def rehearse(seed_pass, rank, **mistake):
    model, params, X, Y = seed_pass
    stage = Stage(model, 2, rank)
    rehearsal = pipeline.Rehearsal(
        stage, rank, len(Y), *pipeline.boundary_values(model, params, stage, X, Y)
    )
    grads = stage_pass(stage, params, rehearsal, X, Y, **mistake)
    return grads, pipeline.missing_messages(stage, rehearsal)


def test_the_rehearsal_answers_with_the_true_neighbour_values(seed_pass):
    model, params, X, Y = seed_pass
    _, whole = loss_and_grads(model, params, X, Y)
    for rank in (0, 1):
        grads, missing = rehearse(seed_pass, rank)
        assert missing is None
        for name, by_key in grads.items():
            for k, grad in by_key.items():
                np.testing.assert_allclose(grad, whole[name][k], atol=1e-6)


def test_the_rehearsal_refuses_a_float64_buffer_and_names_a_missing_send(seed_pass):
    with pytest.raises(
        pipeline.StagePassError,
        match="^stage 1: receives from rank 0 with a float64 buffer; the stages exchange",
    ) as float64:
        rehearse(seed_pass, 1, dtype=np.float64)
    _, missing = rehearse(seed_pass, 0, send_on=False)
    assert missing == (
        "stage 0 never sends its output to stage 1 (pp.send(..., 1)): stage 1"
        " would wait for it forever"
    )
    guide = " ".join((ROOT / "docs" / "teaching.md").read_text().split())
    for line in (str(float64.value), missing):  # as check_stage_pass prints them
        assert f"✗ my_stage_pass: {line}" in guide, f"teaching.md 12 should quote {line!r}"


def test_a_stage_gradient_that_differs_is_described_not_just_measured():
    g = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    assert pipeline.gradient_mistake(g, g) is None
    assert (
        pipeline.gradient_mistake(32 * g, g) == "too large by a factor of 32 (the same direction)"
    )
    assert pipeline.gradient_mistake(g / 4, g) == "too small by a factor of 4 (the same direction)"
    assert pipeline.gradient_mistake(-g, g) == "the sign is wrong"
    assert pipeline.gradient_mistake(0 * g, g) == (
        "all zeros: this layer's backward never wrote its gradient"
    )
    assert pipeline.gradient_mistake(g.T, g) == "shape (3, 4), expected (4, 3)"
    assert (
        pipeline.gradient_mistake(g + 1, g)
        == "differs by more than 1e-06 (not by a constant factor)"
    )


def test_a_zero3_shard_that_is_n_times_the_mean_is_named():
    g = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    assert zero3._how_shard_differs(4 * g, g) == (
        "is 4 times zero3's: the sum over the ranks, where zero3 keeps their mean?"
    )
    assert zero3._how_shard_differs(g + 1, g) == "differs by more than 1e-6"
    assert zero3._how_shard_differs(g / 4, g) == "differs by more than 1e-6"


def test_zero3_saving_names_the_usual_mistakes(capsys, student):
    def key(psi, largest, n):
        return 4 * psi * (n - 1) / n - 4 * largest

    assert zero3.check_zero3_saving(key)
    wrong = {
        lambda psi, largest, n: key(psi, largest, n) - 4 * largest: "two full layers counted",
        lambda psi, largest, n: key(psi, largest, n) + 4 * largest: "the full layer zero3"
        " gathers is left out",
        lambda psi, largest, n: 4 * psi - 4 * largest: "all the parameters saved",
        lambda psi, largest, n: -key(psi, largest, n): "item 0: the sign is wrong (and 8 more)",
    }
    for answer in wrong:
        assert not zero3.check_zero3_saving(answer)
    out = lines(capsys)
    assert out[0] == "✓ zero3_saving: correct"
    for line, says in zip(out[1:], wrong.values(), strict=True):
        assert line.startswith(f"✗ zero3_saving: {says}"), line


def test_no_checker_line_prints_an_expected_figure(capsys, student):
    memory.check_smallest_n_70b(26)
    text = capsys.readouterr().out
    assert "27" not in text  # the expected N


def test_count_params_and_leaky_relu_backward_name_the_mistake_and_hide_the_value(capsys, student):
    def key(V, S, E, H):
        return V * E + S * E * H + H + H * V + V

    assert single_rank.check_count_params(key)
    assert not single_rank.check_count_params(lambda V, S, E, H: key(V, S, E, H) - H - V)
    assert not single_rank.check_count_params(lambda V, S, E, H: None)
    assert single_rank.check_leaky_relu_backward(lambda x, dout, k: np.where(x > 0, dout, k * dout))
    assert not single_rank.check_leaky_relu_backward(lambda x, dout, k: dout * (x > 0))
    _, biases, stub, _, _, relu = lines(capsys)
    assert biases == "✗ count_params: the biases are missing: fc1 and fc2 each have one"
    assert "not solved yet" in stub
    assert relu.startswith("✗ leaky_relu_backward: that is the ReLU's backward")
    assert not single_rank.check_count_params(lambda V, S, E, H: key(V, S, E, H) - V * E)
    assert not single_rank.check_count_params(lambda V, S, E, H: key(V, S, E, H) - (S - 1) * E * H)
    assert not single_rank.check_count_params(lambda V, S, E, H: key(V, S, E, H) + 1)
    no_emb, no_context, other = lines(capsys)
    assert no_emb.startswith("✗ count_params: the embedding's table is missing")
    assert no_context.startswith("✗ count_params: fc1.W too small: fc1 reads the whole context")
    assert other.startswith("✗ count_params: item 0: one too many (and 2 more)")
    assert str(MLP(ModelConfig()).num_params) not in other.replace(",", "")
    for wrong, says in {
        lambda x, dout, k: np.where(dout > 0, dout, k * dout): ": the gate is read from dout",
        lambda x, dout, k: np.where(x > 0, 1, k): ": the derivative alone",
        lambda x, dout, k: np.where(x > 0, k * dout, dout): ": the slope is on the wrong side",
        lambda x, dout, k: np.where(x > 0, x, k * x): ": that is the forward",
        lambda x, dout, k: dout: ": dout everywhere",
        lambda x, dout, k: np.where(x > 0, dout, 0.1 * dout): " at slope 0: the slope argument",
        lambda x, dout, k: np.where(x > 0, dout, 2 * k * dout): ": item (0, 1): too large by a",
        lambda x, dout, k: None: ": not solved yet",
    }.items():
        assert not single_rank.check_leaky_relu_backward(wrong)
        assert lines(capsys)[-1].startswith(f"✗ leaky_relu_backward{says}")  # after any ✓


def test_prefetch_order_is_zero3s_own_choice():
    order = fsdp_practice.zero3_order(ModelConfig(layers=4, hidden=256))
    count = len(order) // 2
    assert order == {
        (u, backward): (u - 1 if backward else u + 1)
        if 0 <= (u - 1 if backward else u + 1) < count
        else None
        for u in range(count)
        for backward in (False, True)
    }


def test_ring_call_seconds_names_the_kind_that_is_wrong(capsys, student):
    line = {"alpha_s": 10e-6, "beta_s_per_byte": 1e-9}
    report = {
        kind: {"calls": 3, "buffer_bytes": 4000, "messages": (2 if kind == "allreduce" else 1)
               * 3 * 3, "sent_bytes": (2 if kind == "allreduce" else 1) * 3 / 4 * 4000}
        for kind in communication.KINDS
    }  # fmt: skip
    runs = {("seed", 4, "dp"): [report]}

    def key(line, kind, n, calls, buffer_bytes):
        factor = 2 if kind == "allreduce" else 1
        return line["alpha_s"] * factor * (n - 1) * calls + line["beta_s_per_byte"] * (
            factor * (n - 1) / n * buffer_bytes
        )

    assert communication.check_ring_call_seconds(key, runs, line)
    assert not communication.check_ring_call_seconds(
        lambda line, kind, n, calls, b: key(line, "allgather", n, calls, b), runs, line
    )
    out = lines(capsys)
    assert out[-1].startswith("✗ ring_call_seconds (allreduce): item 0: too small by a factor of 2")


def test_rank_1_of_3_checks_both_answers(capsys, student):
    numel = 16 * 16 * 64 + 64
    size = -(-numel // 3)
    assert checkpoints.check_rank_1_of_3((size, 2 * size), 3 * size - numel, ModelConfig())
    assert not checkpoints.check_rank_1_of_3((size - 1, 2 * size - 1), 3 * size - numel,
                                             ModelConfig())  # fmt: skip
    out = lines(capsys)
    assert out[-2].startswith("✗ fc1_rank_1_of_3: item 0: one too few")
    assert str(size) not in out[-2].replace(",", "")
    # no hint gives the formula; each usual mistake is named
    assert out[-2].endswith("— the slices are S long each, in rank order")
    down = numel // 3
    assert not checkpoints.check_rank_1_of_3((down, 2 * down), 3 * size - numel, ModelConfig())
    assert lines(capsys)[-2].endswith("— S rounded down: three slices of S must hold all of fc1")
    assert not checkpoints.check_rank_1_of_3((0, size), 3 * size - numel, ModelConfig())
    assert lines(capsys)[-2].endswith("— rank 0's slice: ranks count from 0")
    # the padding (1 here) is never "too large by a factor of" the answer itself
    for answer, says in {
        3 * size: "too large — that is the padded vector's whole length",
        numel - 3 * (numel // 3): "one too many — what S rounded down leaves out",
        5: "too large — the padding fills up the last slice to S",
    }.items():
        assert not checkpoints.check_rank_1_of_3((size, 2 * size), answer, ModelConfig())
        assert lines(capsys)[-1].startswith(f"✗ fc1_padding_at_3: {says}")


def test_my_1f1b_names_the_stage_and_the_mistake(capsys, student):
    from fsdp_lesson.pipeline import schedule_ops

    assert pipeline.check_1f1b(lambda P, s, M: schedule_ops("1f1b", P, s, M))
    assert pipeline.check_1f1b(lambda P, s, M: [list(op) for op in schedule_ops("1f1b", P, s, M)])
    assert not pipeline.check_1f1b(lambda P, s, M: schedule_ops("gpipe", P, s, M))
    assert not pipeline.check_1f1b(lambda P, s, M: None)
    assert not pipeline.check_1f1b(lambda P, s, M: [("F", 0)] if M > 1 else schedule_ops(
        "1f1b", P, s, M))  # fmt: skip
    out = lines(capsys)
    assert out[2] == (
        "✗ my_1f1b: stage 0 of 2, M = 3: op 2 is a forward, a backward was due — warm-up too long"
    )
    assert "not solved yet" in out[3]
    assert out[4] == "✗ my_1f1b: stage 0 of 2, M = 2: 1 ops where 4 are due"


def test_a_mean_that_is_not_one_is_named_in_words_that_read():
    """allreduce_mean's and average_grads' lines: "buf is ..." whatever the mistake."""
    given, total = np.ones(3), np.full(3, 4.0)
    how = data_parallel._mean_or_what(np.zeros(3), total / 4, total, given, 4)
    assert (
        how
        == "all zeros: this rank received nothing (a Reduce leaves the result on its root alone)"
    )
    how = data_parallel._mean_or_what(np.full(3, 2.0), total / 4, total, given, 4)
    assert how == "not the mean over the ranks: off by more than 1e-06"
    assert data_parallel._mean_or_what(np.ones(2), total / 4, total, given, 4).startswith(
        "of shape (2,), not the buffer's"
    )


def test_n_rows_and_rows_of_rank_name_the_item_and_hide_the_value(capsys, student):
    assert dataset.check_n_rows(lambda L: L + 1)
    assert not dataset.check_n_rows(lambda L: L)
    assert not dataset.check_n_rows(lambda L: None)
    assert dataset.check_rows_of_rank([b for b in range(32) if b % 8 == 2])
    assert not dataset.check_rows_of_rank(list(range(8, 12)))  # a block, not a stride
    assert not dataset.check_rows_of_rank(None)
    _, one_few, stub, _, block, stub_2 = lines(capsys)
    assert one_few == (
        "✗ n_rows: item 0: one too few (and 2 more) — count the tokens of a name, the boundary"
        " included"
    )
    assert block == (
        "✗ rank 2 of 8: a contiguous block of the batch — section 6's rule interleaves the"
        " ranks, it does not cut the batch into blocks"
    )
    assert "not solved yet" in stub and "not solved yet" in stub_2
    assert not dataset.check_rows_of_rank([b for b in range(32) if b % 8 == 3])  # from 1
    assert lines(capsys) == ["✗ rank 2 of 8: rank 3's rows — ranks count from 0"]
    assert not dataset.check_rows_of_rank([2, 10, 18, 27])
    assert lines(capsys)[0].startswith("✗ rank 2 of 8: item 3: one too many")


def test_tp_verdict_names_the_mistake_the_shape_and_the_extra_allreduce(capsys, student):
    y, b = np.arange(6.0).reshape(2, 3), np.ones(3)
    mistakes = {"the bias counted T times: add it once, after the sum": y + 3 * b}

    def ranks_with(answer, allreduces=(1, 24)):
        result = {"items": [("the logits", answer, y, mistakes)], "needed": (1, 24)}
        return [dict(result, allreduces=allreduces)] * 4

    g = "g is one allreduce-sum of the row layer's output"
    assert tensor_parallel.tp_verdict("tp_forward", ranks_with(y.copy()), g)
    assert not tensor_parallel.tp_verdict("tp_forward", ranks_with(y + 3 * b), g)
    assert not tensor_parallel.tp_verdict("tp_forward", ranks_with(y[:, :2]), g)
    assert not tensor_parallel.tp_verdict("tp_forward", ranks_with(y, (2, 48)), g)
    assert not tensor_parallel.tp_verdict("tp_forward", [None] * 4, g)
    _, bias, shape, extra, stub = lines(capsys)
    assert bias == (
        "✗ tp_forward: rank 0, the logits: the bias counted T times: add it once, after the sum"
    )
    assert shape == "✗ tp_forward: rank 0, the logits: shape (2, 2), where (2, 3) is expected"
    assert extra == (
        "✗ tp_forward: rank 0: the values are right, but tp counted 2 allreduce calls of 48"
        f" bytes — {g}"
    )
    assert "not solved yet" in stub


def test_no_notebook_defines_a_checker_of_its_own():
    """A checker defined in a notebook's cell is in the student copy too, with the expected
    answer computed in view (hidden cells are only collapsed): every checker lives in
    fsdp_lesson/exercises, and the cells call it."""
    import nbformat

    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        defined = {
            name
            for source in code
            for name in re.findall(r"^def ((?:check|try)_\w*)\(", source, re.M)
        }
        assert not defined, (
            f"{path.name} defines {sorted(defined)}: move them to fsdp_lesson/exercises"
        )


# --- notebook 14: causal attention for one head, and one block's shard under zero3 -----------


def right_attention(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[-1])
    s[np.triu_indices(len(q), 1)] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def wrong_attention(mask_offset=0, axis=-1, scale=None, masked=True):
    """One head's attention with one usual mistake: a key j is seen when j <= i + mask_offset;
    the softmax over `axis`; the scores times `scale` (None: 1/sqrt(d))."""

    def attention(q, k, v):
        s = q @ k.T * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
        if masked:
            s[np.arange(len(k))[None, :] > np.arange(len(q))[:, None] + mask_offset] = -np.inf
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(axis=axis, keepdims=True))
            return p / p.sum(axis=axis, keepdims=True) @ v

    return attention


def right_attention_masked_by_0(q, k, v):
    """A learner's attention that multiplies the scores by the causal mask (0 for a later key)."""
    s = q @ k.T / np.sqrt(q.shape[-1]) * np.tril(np.ones((len(q), len(k))))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def test_causal_attention_checker_accepts_the_key_and_names_each_mistake(capsys, student):
    assert transformer.check_causal_attention(right_attention)
    assert lines(capsys)[0].startswith("✓ causal_attention: correct")
    mistakes = {
        "no causal mask": wrong_attention(masked=False),
        "also sees the key just after it": wrong_attention(mask_offset=1),
        "does not see its own key": wrong_attention(mask_offset=-1),
        "taken over the queries (axis 0)": wrong_attention(axis=0),
        "not scaled: divide q k^T by sqrt(d)": wrong_attention(scale=1.0),
        "the scores are divided by d": wrong_attention(scale=0.25),  # d = 4 in the first case
        "the masked scores are 0, not -inf": lambda q, k, v: right_attention_masked_by_0(q, k, v),
        "the mask is reversed": lambda q, k, v: right_attention(q[::-1], k[::-1], v[::-1])[::-1],
    }
    for says, answer in mistakes.items():
        assert not transformer.check_causal_attention(answer)
        (line,) = lines(capsys)
        assert line.startswith("✗ causal_attention (T=6, d=4): ") and says in line, line
    assert not transformer.check_causal_attention(lambda q, k, v: right_attention(q, k, v).T)
    assert "the output has one row per query" in lines(capsys)[0]
    assert not transformer.check_causal_attention(lambda q, k, v: (right_attention(q, k, v), 0))
    assert "return the output alone" in lines(capsys)[0]
    assert not transformer.check_causal_attention(lambda q, k, v: None)
    assert lines(capsys) == ["✗ causal_attention: not solved yet"]


def numel(e, f):
    """One transformer block's parameters (E = e, F = f): the exercise's key."""
    return 4 * e * e + 2 * e * f + 8 * e + f


def test_block_shard_checker_accepts_the_key_and_names_each_mistake(capsys, student):
    assert transformer.check_block_shard_bytes(lambda e, f, n: 4 * -(-numel(e, f) // n))
    assert lines(capsys)[0].startswith("✓ block_shard_bytes: correct")
    mistakes = {
        "no padding": lambda e, f, n: 4 * numel(e, f) / n,
        "rounded down": lambda e, f, n: 4 * (numel(e, f) // n),
        "elements, not bytes": lambda e, f, n: -(-numel(e, f) // n),
        "2 bytes an element": lambda e, f, n: 2 * -(-numel(e, f) // n),
        "the whole block": lambda e, f, n: 4 * numel(e, f),
        "one bias of emb too many: the keys have none": lambda e, f, n: (
            4 * -(-(numel(e, f) + e) // n)
        ),
        "the LayerNorms are missing": lambda e, f, n: 4 * -(-(numel(e, f) - 4 * e) // n),
        "four emb × emb matrices is missing": lambda e, f, n: 4 * -(-(numel(e, f) - e * e) // n),
        "a shift as well as a gain": lambda e, f, n: 4 * -(-(numel(e, f) - 2 * e) // n),
    }
    for says, answer in mistakes.items():
        assert not transformer.check_block_shard_bytes(answer)
        (line,) = lines(capsys)
        assert line.startswith("✗ block_shard_bytes(emb=") and says in line, line
    assert not transformer.check_block_shard_bytes(lambda e, f, n: 4 * -(-numel(e, f) // n) + 4)
    assert "too large" in lines(capsys)[0]
    assert not transformer.check_block_shard_bytes(lambda e, f, n: None)
    assert lines(capsys) == ["✗ block_shard_bytes: not solved yet"]


# --- notebook 15: the log-sum-exp merge and one ring step ------------------------------------


def key_merge(out1, lse1, out2, lse2):
    lse = np.logaddexp(lse1, lse2)
    w1, w2 = np.exp(lse1 - lse)[..., None], np.exp(lse2 - lse)[..., None]
    return w1 * out1 + w2 * out2, lse


def product_merge(out1, lse1, out2, lse2):
    """The weights from lse1 + lse2: where a part's lse is -inf, exp(-inf - -inf) is NaN."""
    lse = lse1 + lse2
    with np.errstate(invalid="ignore"):
        return np.exp(lse1 - lse)[..., None] * out1 + np.exp(lse2 - lse)[..., None] * out2, lse


def test_the_merge_checker_passes_the_key_and_names_each_mistake(capsys, student):
    def unnormalised(o1, l1, o2, l2):
        top = np.maximum(l1, l2)
        return np.exp(l1 - top)[..., None] * o1 + np.exp(l2 - top)[..., None] * o2, key_merge(
            o1, l1, o2, l2
        )[1]

    assert context.check_merge(key_merge)
    assert capsys.readouterr().out.startswith("✓ my_merge: correct")
    wrong = {
        "the plain average of the two parts": lambda o1, l1, o2, l2: ((o1 + o2) / 2, l1),
        "out is the sum of the two parts": lambda o1, l1, o2, l2: (o1 + o2, l1),
        "the weights do not add up to one": unnormalised,
        "lse is the larger of the two": lambda *p: (key_merge(*p)[0], np.maximum(p[1], p[3])),
        "lse is lse1 + lse2": lambda *p: (key_merge(*p)[0], p[1] + p[3]),
        "lse is lse1 + lse2, the log": product_merge,  # its out holds NaN: the lse is named
        "the weights are swapped": lambda o1, l1, o2, l2: (key_merge(o2, l1, o1, l2)[0], l1),
        "out differs by more than 1e-05 at batch 0": lambda o1, l1, o2, l2: (o1, l1),
        "return a pair": lambda *p: key_merge(*p)[0],
        "out is float16, narrower than the parts' float32": lambda *p: (
            key_merge(*p)[0].astype(np.float16),
            key_merge(*p)[1],
        ),
    }
    for words, fn in wrong.items():
        assert context.check_merge(fn) is False
        line = capsys.readouterr().out.strip()
        assert line.startswith("✗ my_merge: ") and words in line, (words, line)
    assert context.check_merge(lambda *p: (None, None)) is False
    assert capsys.readouterr().out.strip() == "✗ my_merge: not solved yet"


def test_no_merge_line_prints_an_expected_value(capsys, student):
    context.check_merge(lambda o1, l1, o2, l2: ((o1 + o2) / 2, l1))
    context.check_merge(lambda o1, l1, o2, l2: (o1, l1))
    text = capsys.readouterr().out
    (parts, whole), *_ = context.merge_cases().values()
    assert not any(f"{x:.3f}" in text for x in np.ravel(whole[0])[:20])


def key_ring_step(q, k, v, out, lse, positions, cp, after=1, merged=True, own_positions=False):
    kv = np.stack([k, v])
    received = np.empty_like(kv)
    cp.send(kv, (cp.rank + after) % cp.size)
    before = (cp.rank - after) % cp.size
    cp.irecv(received, before).wait()
    k_pos = positions[cp.rank] if own_positions else positions[before]
    part = attention(q, received[0], received[1], positions[cp.rank], k_pos)
    return merge(out, lse, *part) if merged else part


def rehearse_ring(step, size=4):
    """Every rank's rehearsal of `step`: (its mistake or the verdict on its answer) by rank, or
    the ring's mismatch, as ring_step_items decides them without MPI."""
    lines, messages = [], []
    for rank in range(size):
        inputs = context.ring_inputs(size, rank)
        rehearsal = context.RingRehearsal(rank, size, inputs["blocks"])
        try:
            answer = step(inputs["q"], inputs["k"], inputs["v"], inputs["out"], inputs["lse"],
                          inputs["positions"], rehearsal)  # fmt: skip
        except context.RingStepError as err:
            return str(err)
        mistake = context.rehearsal_mistake(rehearsal)
        if mistake:
            return mistake
        messages.append((rehearsal.sent[0], rehearsal.received[0]))
        lines.append(context.ring_step_answer(answer, inputs, rank, size))
    return context.ring_mistake(messages) or next((line for line in lines if line), None)


def test_the_ring_step_rehearsal_passes_the_key_and_names_each_mistake():
    assert rehearse_ring(key_ring_step) is None
    cases = {
        "rank 0's queries attended to the keys of rank 1, the next rank": dict(after=-1),
        "rank 0 returned the received block's attention alone": dict(merged=False),
        "rank 0 masked the received keys with its own positions": dict(own_positions=True),
    }
    for words, mistake in cases.items():
        line = rehearse_ring(lambda *a, mistake=mistake: key_ring_step(*a, **mistake))
        assert line.startswith(words), (words, line)

    def own_block_twice(q, k, v, out, lse, positions, cp):
        key_ring_step(q, k, v, out, lse, positions, cp)  # the messages, then the wrong block
        return merge(out, lse, *attention(q, k, v, positions[cp.rank], positions[cp.rank]))

    def averaged(q, k, v, out, lse, positions, cp):
        part = key_ring_step(q, k, v, out, lse, positions, cp, merged=False)
        return (out + part[0]) / 2, np.logaddexp(lse, part[1])

    assert rehearse_ring(own_block_twice) == (
        "rank 0 merged its own block in a second time: attend to the received block's keys and"
        " values"
    )
    assert rehearse_ring(averaged) == (
        "rank 0: lse is right, out is not — merge the two outputs as exercise A does"
    )


def test_the_ring_step_rehearsal_stops_what_would_hang_or_cannot_be_a_block():
    def same_side(q, k, v, out, lse, positions, cp):
        kv = np.stack([k, v])
        cp.send(kv, (cp.rank + 1) % cp.size)
        cp.irecv(np.empty_like(kv), (cp.rank + 1) % cp.size).wait()
        return out, lse

    def no_send(q, k, v, out, lse, positions, cp):
        cp.irecv(np.empty((2, *k.shape), np.float32), (cp.rank - 1) % cp.size).wait()
        return out, lse

    def two_messages(q, k, v, out, lse, positions, cp):
        cp.send(k, (cp.rank + 1) % cp.size)
        return out, lse

    assert rehearse_ring(same_side) == (
        "rank 0 receives from rank 1, which sends its block to rank 2: rank 0 would wait forever"
    )
    assert rehearse_ring(no_send).startswith("rank 0 never sends its K/V block (cp.send)")
    assert "a block is K and V as one float32 message" in rehearse_ring(two_messages)

    def receive_first(q, k, v, out, lse, positions, cp):
        kv = np.stack([k, v])
        received = cp.irecv(np.empty_like(kv), (cp.rank - 1) % cp.size).wait()
        cp.send(kv, (cp.rank + 1) % cp.size)
        return merge(out, lse, *attention(q, received[0], received[1], positions[cp.rank],
                                          positions[(cp.rank - 1) % cp.size]))  # fmt: skip

    assert rehearse_ring(receive_first).startswith("rank 0 waits for its receive before it sends")


# --- on the cluster: each checker whose answer runs on the engines, given the usual mistakes --


def px_cells(notebook: str, keep) -> list[str]:
    """The code of a notebook's %%px cells (magic line dropped) whose source keep() accepts."""
    import nbformat

    path = next((ROOT / "notebooks").glob(f"{notebook}_*.ipynb"))
    return [
        cell.source.removeprefix("%%px\n")
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code" and cell.source.startswith("%%px") and keep(cell.source)
    ]


@pytest.fixture(scope="module")
def engines():
    """One 4-engine cluster for this module's cluster tests (its own profile)."""
    from fsdp_lesson.cluster import connect

    with connect(n=4, profile="exercises", timeout=120) as ranks:
        yield ranks


def on_engines(ranks, code: str) -> None:
    ranks.view.execute(textwrap.dedent(code), block=True)


def guide_text() -> str:
    return " ".join((ROOT / "docs" / "teaching.md").read_text().split())


def key_state_and_buffer_bytes(strategy, model_config, n, pad=True, buffers="", optimizer=8):
    """Exercise 07-1's key (the notebook's solution), or a usual mistake."""
    sizes = plan.layer_sizes(model_config)
    init = 4 * max(sizes)
    if strategy == "dp":
        return {"params": 4 * sum(sizes), "grads": 4 * sum(sizes),
                "optimizer": optimizer * sum(sizes), "buffers": init}  # fmt: skip
    padded = [-(-size // n) * n if pad else size for size in sizes]
    whole, shard, largest = 4 * sum(padded), 4 * sum(padded) // n, 4 * max(padded)
    stage = int(strategy[-1])
    return {
        "params": shard if stage >= 3 else whole,
        "grads": shard if stage >= 2 else whole,
        "optimizer": optimizer * sum(padded) // n,
        "buffers": {
            1: init,
            2: largest + init if buffers == "sum" else max(largest, init),
            3: max(largest if buffers == "once" else 2 * largest, init),
        }[stage],
    }


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_state_and_buffer_bytes_names_each_mistake_against_live_ledgers(engines, capsys, student):
    def check(**mistake):
        return memory.check_state_and_buffer_bytes(
            lambda s, c, n: key_state_and_buffer_bytes(s, c, n, **mistake), engines
        )

    assert check()
    assert lines(capsys) == [
        "✓ state_and_buffer_bytes: correct — every category of every rank's ledger"
    ]
    mistakes = {
        "the unpadded size": {"pad": False},
        "initialisation's layer added to the gradient buffer": {"buffers": "sum"},
        "one layer's gathered parameters alone": {"buffers": "once"},
        "12 bytes a parameter: the paper's fp32 master copy": {"optimizer": 12},
    }
    guide = guide_text()
    for how, mistake in mistakes.items():
        assert not check(**mistake)
        first, detail, _ = lines(capsys)
        assert first.startswith("✗ state_and_buffer_bytes: ") and first.endswith("differ")
        assert detail.startswith("  every rank, ") and f": {how}" in detail, detail
        assert detail.strip() in guide, f"teaching.md 07 should quote {detail.strip()!r}"
    assert not memory.check_state_and_buffer_bytes(lambda s, c, n: None, engines)
    assert lines(capsys) == ["✗ state_and_buffer_bytes: not solved yet"]


C_BUG_05 = """
from mpi4py import MPI
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler, rank_slice
from fsdp_lesson.model import MLP
from fsdp_lesson.rng import make_rng
comm = MPI.COMM_WORLD
rank = comm.rank
data = Dataset.load()
"""  # what notebook 05's earlier cells left on the engines for its seed_run


def c_step1() -> dict[int, float]:
    """The C FSDP program's printed step-1 loss at N = 2 and 4, as notebook 05 reads it."""

    def step_1(name):
        rows = (ROOT / "tests" / "fixtures" / name).read_text().splitlines()
        return [float(row.split()[1]) for row in rows if not row.startswith("#")][1]

    return {2: step_1("c_fsdp_losses.txt"), 4: step_1("c_fsdp_n4_losses.txt")}


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_c_reduce_grads_names_which_gradients_were_averaged(engines, capsys, student):
    on_engines(engines, C_BUG_05 + "\n".join(px_cells("05", lambda s: "def seed_run" in s)))
    reduce = "def c_reduce_grads(grads, comm):\n{}\n    return grads"
    answers = {
        "": "    if 'W' in grads:\n        comm.allreduce_mean(grads['W'])",
        "step 1 is what the package's dp prints": "    for g in grads.values():\n"
        "        comm.allreduce_mean(g)",
        "step 1 shows nothing averaged": "    pass",
        "step 1 shows the biases averaged and the weights left local": "    if 'b' in grads:\n"
        "        comm.allreduce_mean(grads['b'])",
        "step 1 shows the weights' gradients summed, not averaged": "    if 'W' in grads:\n"
        "        comm.allreduce_sum(grads['W'])",
        "at N = 4 step 1's loss is too large": "    if 'W' in grads:\n"
        "        comm.allreduce_mean(grads['W'])\n        grads['W'] *= 0.5",
    }
    guide = guide_text()
    for how, body in answers.items():
        on_engines(engines, reduce.format(body))
        assert zero3.check_c_bug(engines, c_step1()) is not bool(how)
        (line,) = lines(capsys)
        assert line.startswith(f"✗ c_reduce_grads: {how}" if how else "✓"), line
        if how.startswith("step 1"):
            quoted = line.split(" — ")[0]
            assert quoted in guide, f"teaching.md 05 should quote {quoted!r}"
    on_engines(engines, "def c_reduce_grads(grads, comm):\n    return None")
    assert not zero3.check_c_bug(engines, c_step1())
    assert lines(capsys) == ["✗ c_reduce_grads: not solved yet"]


def key_sent_bytes(unit_bytes, n, reshard, gathers=None, ring=True, shard=False):
    """Exercise 06-2's key, or a usual mistake: the gathers miscounted, no (N-1)/N, or the
    bytes of a shard where the ring counts the full buffer."""
    psi = sum(unit_bytes) / (n if shard else 1)
    share = (n - 1) / n if ring else 1
    passes = gathers if gathers is not None else (2 if reshard else 1)
    return {"allgather": passes * share * psi, "reduce_scatter": share * psi}


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_sent_bytes_names_the_configuration_the_kind_and_the_factor(engines, capsys, student):
    deep = ModelConfig(layers=4, hidden=256)
    quick = TrainConfig(strategy="zero3", steps=10, eval_batches=0, samples=0)
    assert fsdp_practice.check_sent_bytes(engines, key_sent_bytes, deep, quick)
    assert lines(capsys) == ["✓ K=2, reshard=False: correct", "✓ K=3, reshard=True: correct"]
    wrong = {  # the start of the line, and the mistake it names after ' — '
        "✗ K=2, reshard=False: allgather: too large by a factor of 2": (
            dict(gathers=2),
            "gathered once per step",
        ),
        "✗ K=3, reshard=True: allgather: too small by a factor of 2": (
            dict(gathers=1),
            "gathered again for its backward",
        ),
        "✗ K=2, reshard=False: allgather and reduce_scatter: too large by N/(N-1)": (
            dict(ring=False),
            "a ring sends (N-1)/N of each buffer",
        ),
        "✗ K=2, reshard=False: allgather: too small by a factor of 4": (
            dict(shard=True),
            "not a rank's shard",
        ),
    }
    for start, (mistake, named) in wrong.items():
        assert not fsdp_practice.check_sent_bytes(
            engines, lambda u, n, r, m=mistake: key_sent_bytes(u, n, r, **m), deep, quick
        )
        out = lines(capsys)
        assert out[-1].startswith(start), out
        assert named in out[-1], out
        assert " ".join(out[-1].split()) in " ".join(guide_text().split()), (
            f"teaching.md 06 should quote {out[-1]!r}"
        )
    assert not fsdp_practice.check_sent_bytes(engines, lambda u, n, r: None, deep, quick)
    assert lines(capsys) == ["✗ sent bytes: not solved yet"]


def key_traffic(strategy, sizes, n, pad=True, ring=True, element=4, dp_passes=2, zero3_gathers=2):
    """Exercise 08-1's key (bytes one rank sends per step, by kind), or a usual mistake."""
    share = (n - 1) / n if ring else 1
    if strategy == "dp":
        return {"allreduce": dp_passes * share * element * sum(sizes), "allgather": 0.0,
                "reduce_scatter": 0.0}  # fmt: skip
    padded = element * sum(-(-size // n) * n if pad else size for size in sizes)
    gathers = zero3_gathers if strategy == "zero3" else 1
    return {"allreduce": 0.0, "allgather": gathers * share * padded,
            "reduce_scatter": share * padded}  # fmt: skip


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_traffic_per_step_names_the_stage_the_kind_and_the_mistake(engines, capsys, student):
    assert communication.check_traffic(engines, key_traffic)
    assert lines(capsys) == [
        "✓ traffic_per_step: correct — every kind on every rank, as Comm counted"
    ]
    wrong = {
        "  zero1 allgather, every rank: the unpadded size": dict(pad=False),
        "  dp allreduce, every rank: too large by N/(N-1)": dict(ring=False),
        "  dp allreduce, every rank: too small by a factor of 2: the package's gradients are"
        " float32": dict(element=2),
        "  dp allreduce, every rank: too small by a factor of 2: an allreduce is a"
        " reduce-scatter and an allgather": dict(dp_passes=1),
        "  zero3 allgather, every rank: too small by a factor of 2: zero3 gathers every layer"
        " in forward and again in backward": dict(zero3_gathers=1),
    }
    for start, mistake in wrong.items():
        assert not communication.check_traffic(
            engines, lambda s, z, n, m=mistake: key_traffic(s, z, n, **m)
        )
        out = lines(capsys)
        assert out[0] == "✗ traffic_per_step differs from what Comm counted:"
        assert out[1].startswith(start), out
        assert all(line.startswith("  ") and ", every rank: " in line for line in out[1:-1]), out
        if "element" not in mistake and "ring" not in mistake:  # the guide quotes these whole
            assert out[1].strip() in guide_text(), f"teaching.md 08 should quote {out[1]!r}"


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_allgather_calls_names_the_pass_and_the_relu(engines, capsys, student):
    from fsdp_lesson.bench import MODELS

    medium = ModelConfig(**MODELS["medium"][0])
    every = len(plan.layer_sizes(medium))
    with_params = sum(1 for size in plan.layer_sizes(medium) if size)
    assert communication.check_allgather_calls(engines, (2 * with_params, with_params), medium)
    for answer in ((with_params, with_params), (2 * every, every), None):
        assert not communication.check_allgather_calls(engines, answer, medium)
    right, one_pass, relu, stub = lines(capsys)
    assert right == "✓ allgather calls (zero3, zero2): correct"
    assert one_pass.startswith("✗ allgather calls (zero3, zero2): item 0: too small by a factor"
                               " of 2 — one allgather per layer with parameters")  # fmt: skip
    assert relu.startswith("✗ allgather calls (zero3, zero2): the layers without parameters")
    assert stub == "✗ allgather calls (zero3, zero2): not solved yet"
    assert str(2 * with_params) not in " ".join((one_pass, relu))
    assert relu in guide_text(), f"teaching.md 08 should quote {relu!r}"


PIECES_11 = """
def column_piece(whole, r, T):
    w = whole["W"].shape[1] // T
    return {{"W": whole["W"][:, {columns}].copy(), "b": whole["b"][{columns}].copy()}}


def row_piece(whole, r, T):
    w = whole["W"].shape[0] // T
    return {{"W": whole["W"][{rows}].copy(), "b": whole["b"].copy()}}
"""
FORWARD_11 = """
def tp_forward(x, p1, p2, tp):
    h = x @ p1["W"] + p1["b"]
    logits = np.maximum(h, 0) @ p2["W"]
    {reduce}
    return logits, h
"""
BACKWARD_11 = """
def tp_backward(x, h, p1, p2, dlogits, tp):
    a = np.maximum(h, 0)
    g2 = {{"W": a.T @ dlogits, "b": dlogits.sum(axis=0)}}
    dh = (dlogits @ p2["W"].T) * (h > 0)
    g1 = {{"W": x.T @ dh, "b": dh.sum(axis=0)}}
    dx = dh @ p1["W"].T
    {reduce}
    return g1, g2, dx
"""


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_tensor_parallel_checkers_name_the_rank_the_array_and_the_mistake(engines, capsys, student):
    for setup in px_cells("11", lambda s: "SOLUTION" not in s)[:2]:  # the model, then pieces
        on_engines(engines, setup)
    block = "r * w:(r + 1) * w"
    pieces = {
        "✓ pieces: correct on all 4 ranks": dict(columns=block, rows=block),
        "✗ pieces: rank 0, fc1.W (column_piece): every 4th of the columns from 0 on: rank r's are"
        " a block of consecutive ones": dict(columns="r::T", rows=block),
        "✗ pieces: rank 0, fc1.W (column_piece): rank 1's columns, not rank 0's": dict(
            columns="(r + 1) % T * w:((r + 1) % T + 1) * w", rows=block
        ),
        "✗ pieces: rank 0, fc2.W (row_piece): shape (64, 16), where (16, 27) is expected": dict(
            columns=block, rows=f":, {block}"
        ),
    }
    for line, cuts in pieces.items():
        on_engines(engines, PIECES_11.format(**cuts))
        assert tensor_parallel.check_pieces(engines) is line.startswith("✓")
        assert lines(capsys) == [line]
        if "'s columns" in line or "th of the columns" in line:  # the guide quotes these
            assert line in guide_text(), f"teaching.md 11 should quote {line!r}"
    forward = {
        "✓ tp_forward: correct on all 4 ranks, one allreduce each": "tp.allreduce_sum(logits)"
        "\n    logits += p2['b']",
        "✗ tp_forward: rank 0, the logits: this rank's share only: g sums the shares of all"
        " ranks": "logits += p2['b']",
        "✗ tp_forward: rank 0, the logits: the mean of the shares: g is a sum": "tp.allreduce_sum("
        "logits)\n    logits /= tp.size\n    logits += p2['b']",
        "✗ tp_forward: rank 0, the logits: the bias counted T times: add it once, after the"
        " sum": "logits += p2['b']\n    tp.allreduce_sum(logits)",
        "✗ tp_forward: rank 0: the values are right, but tp counted 2 allreduce calls": "tp."
        "allreduce_sum(logits)\n    tp.allreduce_sum(np.zeros(1))\n    logits += p2['b']",
        "✗ tp_forward: rank 0, h: h after the ReLU: return fc1's output before it": "tp."
        "allreduce_sum(logits)\n    logits += p2['b']\n    h = np.maximum(h, 0)",
    }
    for line, reduce in forward.items():
        on_engines(engines, FORWARD_11.format(reduce=reduce))
        assert tensor_parallel.check_tp_forward(engines) is line.startswith("✓")
        (printed,) = lines(capsys)
        assert printed.startswith(line), printed
    backward = {
        "✓ tp_backward: correct on all 4 ranks, one allreduce each": "tp.allreduce_sum(dx)",
        "✗ tp_backward: rank 0, dx: only the part through this rank's hidden units": "pass",
        "✗ tp_backward: rank 0, dx: too small by a factor of 4: f is a sum, not a mean": "tp."
        "allreduce_sum(dx)\n    dx /= tp.size",
        "✗ tp_backward: rank 0, fc2's b gradient: too large by a factor of 4": "tp.allreduce_sum("
        "dx)\n    tp.allreduce_sum(g2['b'])",
        "✗ tp_backward: rank 0, fc1's W gradient: shape (16, 256), where (256, 16) is"
        " expected": "tp.allreduce_sum(dx)\n    g1['W'] = g1['W'].T",
        "✗ tp_backward: rank 0, fc1's W gradient: the ReLU's backward is missing between fc2"
        " and fc1": "tp.allreduce_sum(dx)\n    g1 = {'W': x.T @ (dlogits @ p2['W'].T),"
        " 'b': (dlogits @ p2['W'].T).sum(axis=0)}",
        "✗ tp_backward: rank 0, fc2's W gradient: fc2's input is the ReLU's output, not h": "tp."
        "allreduce_sum(dx)\n    g2['W'] = h.T @ dlogits",
    }
    for line, reduce in backward.items():
        on_engines(engines, BACKWARD_11.format(reduce=reduce))
        assert tensor_parallel.check_tp_backward(engines) is line.startswith("✓")
        (printed,) = lines(capsys)
        assert printed.startswith(line), printed
