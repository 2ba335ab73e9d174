"""Notebook 02's exercises (one rank): each checker computes the expected answer with the
package (`MLP(...).num_params`, `ReLU.backward`), so the learner's cell shows only the call, and
says where and how an answer is wrong, never what is right."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..checks import check, fail, not_solved
from ..config import ModelConfig
from ..model import MLP, ReLU

SIZES = [(16, 64), (8, 32), (32, 128)]  # (E, H) tried by check_count_params


def check_count_params(count_params: Callable) -> bool:
    """Exercise 1: count_params(V, S, E, H) against `MLP(...).num_params` of the seed's
    vocabulary and context with three embedding and hidden sizes."""
    config = ModelConfig()
    V, S = config.vocab_size, config.seq_len  # noqa: N806  (the exercise's names)
    answers = [count_params(V, S, e, h) for e, h in SIZES]
    expected = [MLP(ModelConfig(emb=e, hidden=h)).num_params for e, h in SIZES]
    mistakes = {  # the usual wrong counts, by what the checker says of them
        "the biases are missing: fc1 and fc2 each have one": lambda e, h: V * e + S * e * h + h * V,
        "the embedding's table is missing: emb.W, one row of E per token": lambda e, h: (
            S * e * h + h + h * V + V
        ),
        "fc1.W too small: fc1 reads the whole context, S embeddings of E numbers side by side": (
            lambda e, h: V * e + e * h + h + h * V + V
        ),
    }
    for says, count in mistakes.items():
        if not not_solved(answers) and answers == [count(e, h) for e, h in SIZES]:
            return fail(f"✗ count_params: {says}")
    return check(
        "count_params",
        answers,
        expected,
        hint="items are (E, H) = (16, 64), (8, 32), (32, 128); add up the sizes of emb.W,"
        " fc1.W, fc1.b, fc2.W and fc2.b",
    )


def check_leaky_relu_backward(leaky_relu_backward: Callable, slope: float = 0.1) -> bool:
    """Exercise 2: leaky_relu_backward(x, dout, slope) on a random float32 (4, 5) input and
    upstream gradient, at `slope` (the usual mistakes named), then at slope 0, where it must
    be the package's ReLU.backward."""
    random = np.random.default_rng(0)
    x = random.standard_normal((4, 5)).astype(np.float32)
    dout = random.standard_normal((4, 5)).astype(np.float32)
    expected = np.where(x > 0, dout, slope * dout)  # out = x where x > 0, else slope * x
    answer = leaky_relu_backward(x.copy(), dout.copy(), slope)
    mistakes = {  # the usual wrong backwards, by what the checker says of them
        "that is the ReLU's backward: where x <= 0 a leaky ReLU still passes slope times dout": (
            dout * (x > 0)
        ),
        "the gate is read from dout: which entries pass whole is decided by x, the cache": (
            np.where(dout > 0, dout, slope * dout)
        ),
        "the derivative alone: the chain rule multiplies it with dout": np.where(x > 0, 1, slope),
        "the slope is on the wrong side: where x > 0 the output is x itself": (
            np.where(x > 0, slope * dout, dout)
        ),
        "that is the forward: backward returns dL/dx": np.where(x > 0, x, slope * x),
        "dout everywhere: where x <= 0 the output changes only slope times as fast as x": dout,
    }
    if not not_solved(answer) and np.shape(answer) == expected.shape:
        for says, wrong in mistakes.items():
            if np.allclose(np.asarray(answer, np.float64), wrong, rtol=0, atol=1e-6):
                return fail(f"✗ leaky_relu_backward: {says}")
    name = "leaky_relu_backward"
    if not check(name, answer, expected, hint="differentiate each piece of out (section 4)"):
        return False
    relu = ReLU("relu").backward({}, x, dout, {})
    at_zero = leaky_relu_backward(x.copy(), dout.copy(), 0.0)
    if np.shape(at_zero) == relu.shape and np.allclose(at_zero, expected, rtol=0, atol=1e-6):
        return fail(f"✗ {name} at slope 0: the slope argument is not used (it is {slope} here)")
    return check(f"{name} at slope 0", at_zero, relu)
