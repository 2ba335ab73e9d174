"""Notebook 02's exercises (one rank): each checker computes the expected answer with the
package (`MLP(...).num_params`, `ReLU.backward`), so the learner's cell shows only the call, and
says where and how an answer is wrong, never what is right."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..checks import check
from ..config import ModelConfig
from ..model import MLP, ReLU

SIZES = [(16, 64), (8, 32), (32, 128)]  # (E, H) tried by check_count_params


def check_count_params(count_params: Callable) -> bool:
    """Exercise 1: count_params(V, S, E, H) against `MLP(...).num_params` of the seed's
    vocabulary and context with three embedding and hidden sizes."""
    config = ModelConfig()
    answers = [count_params(config.vocab_size, config.seq_len, e, h) for e, h in SIZES]
    expected = [MLP(ModelConfig(emb=e, hidden=h)).num_params for e, h in SIZES]
    return check(
        "count_params",
        answers,
        expected,
        hint="items are (E, H) = (16, 64), (8, 32), (32, 128); add up the sizes of emb.W,"
        " fc1.W, fc1.b, fc2.W and fc2.b",
    )


def check_relu_backward(relu_backward: Callable) -> bool:
    """Exercise 2: relu_backward(x, dout) against the package's ReLU.backward on a random
    float32 (4, 5) input and upstream gradient."""
    random = np.random.default_rng(0)
    x = random.standard_normal((4, 5)).astype(np.float32)
    dout = random.standard_normal((4, 5)).astype(np.float32)
    expected = ReLU("relu").backward({}, x, dout, {})
    return check(
        "relu_backward",
        relu_backward(x.copy(), dout.copy()),
        expected,
        hint="the gradient passes where x > 0 and is 0 elsewhere",
    )
