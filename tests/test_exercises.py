"""The exercise checkers of notebooks 06-09, 12 and 15 (fsdp_lesson/exercises/): a right answer
passes, each usual mistake gets its own line saying where and how, a stub says "not solved yet",
and no line gives the expected value. The cluster-side parts run in the notebooks (nbval) and in
their student copies (test_student.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsdp_lesson import checks
from fsdp_lesson.attention import attention, merge
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler
from fsdp_lesson.exercises import (
    checkpoints,
    communication,
    context,
    fsdp_practice,
    memory,
    pipeline,
)
from fsdp_lesson.model import MLP, loss_and_grads
from fsdp_lesson.pipeline import Stage
from fsdp_lesson.rng import make_rng


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


def test_hiding_batch_checker_names_the_stage_and_hides_the_formula(capsys, student):
    def key(stage, n, flops, bandwidth):
        return (3 if stage == "zero3" else 2) * (n - 1) / n * 2 * flops / (6 * bandwidth)

    assert communication.check_hiding_batch(key)
    assert not communication.check_hiding_batch(
        lambda stage, n, flops, bandwidth: key("dp", n, flops, bandwidth)
    )
    out = lines(capsys)
    assert out[-1].startswith("✗ hiding_batch (zero3): item 0: too small")
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
    ):
        rehearse(seed_pass, 1, dtype=np.float64)
    _, missing = rehearse(seed_pass, 0, send_on=False)
    assert missing == (
        "stage 0 never sends its output to stage 1 (pp.send(..., 1)): stage 1"
        " would wait for it forever"
    )


def test_no_checker_line_prints_an_expected_figure(capsys, student):
    memory.check_smallest_n_70b(26)
    text = capsys.readouterr().out
    assert "27" not in text  # the expected N


# --- notebook 15: the log-sum-exp merge and one ring step ------------------------------------


def key_merge(out1, lse1, out2, lse2):
    lse = np.logaddexp(lse1, lse2)
    w1, w2 = np.exp(lse1 - lse)[..., None], np.exp(lse2 - lse)[..., None]
    return w1 * out1 + w2 * out2, lse


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
        "the weights do not add up to one": unnormalised,
        "lse is the larger of the two": lambda *p: (key_merge(*p)[0], np.maximum(p[1], p[3])),
        "lse is lse1 + lse2": lambda *p: (key_merge(*p)[0], p[1] + p[3]),
        "the weights are swapped": lambda o1, l1, o2, l2: (key_merge(o2, l1, o1, l2)[0], l1),
        "out differs by more than 1e-05 at batch 0": lambda o1, l1, o2, l2: (o1, l1),
        "return a pair": lambda *p: key_merge(*p)[0],
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
