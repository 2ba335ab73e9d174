"""One forward and one backward pass through a model's layers, asking the strategy for each
layer's parameters and gradients: what train.train_step runs for every micro-batch, and a
pipeline stage for each of its micro-batches (pipeline.py).

    forward(model, strategy, x, acts, recompute)     -> the last layer's output
    backward(model, strategy, acts, recompute)       from the gradient acts holds, to the input

Mirror images, as every layer's forward and backward are (model.py); `model` is an MLP or a
pipeline stage (anything with layers, blocks and block_inputs).
"""

from __future__ import annotations

import numpy as np

from .memory import Activations
from .strategies import Strategy
from .watchdog import WHERE


def forward(
    model,
    strategy: Strategy,
    x: np.ndarray,
    acts: Activations | None = None,
    recompute: bool = False,
):
    """Run every layer on x; return the logits. With acts, keep what backward will need:
    every layer's cache, or with recompute only each block's input (the first layer's cache)."""
    strategy.begin_phase("forward")
    for layer in model.layers:
        WHERE.layer = layer.name  # for a timed-out collective's line (watchdog.py)
        p = strategy.materialize(layer)
        x, cache = layer.forward(p, x)
        if acts is not None:
            acts.push(layer.name, cache)
            if recompute and layer.name not in model.block_inputs:
                acts.drop()  # backward computes it again from the block's input
        strategy.release(layer)
    WHERE.layer = None
    return x


def recompute_block(strategy: Strategy, block: list, acts: Activations) -> None:
    """Run a block's forward again from its kept input, pushing the caches forward dropped.

    Every layer's cache is its input (model.py), so the kept cache is where to start and each
    output is the next layer's cache; the last layer's output is not needed. The parameters
    stay materialized for the backward that follows (zero3: no gather beyond backward's own).
    """
    x = acts.top()
    for layer, following in zip(block[:-1], block[1:], strict=True):
        x, _ = layer.forward(strategy.materialize(layer), x)
        acts.push(following.name, x)


def backward(model, strategy: Strategy, acts: Activations, recompute: bool = False):
    """Every layer's backward, last to first, from the gradient acts holds (the last layer's
    output's): each layer's gradients written, reduced as the strategy says, the layer released.
    After it, acts.grad is the first layer's input gradient (None for the embedding's tokens).
    With recompute, each block's forward runs again first from its kept input."""
    strategy.begin_phase("backward")
    dx = acts.grad
    for block in reversed(model.blocks):
        if recompute:
            recompute_block(strategy, block, acts)
        for layer in reversed(block):
            WHERE.layer = layer.name
            p = strategy.materialize(layer)
            dx = layer.backward(p, acts.pop(), dx, strategy.grad_buffer(layer))
            acts.gradient(f"d_in {layer.name}", dx)
            strategy.precision.store_grad(layer)  # 16-bit: into the strategy's own buffer
            strategy.reduce_grads(layer)
            strategy.release(layer)
    WHERE.layer = None
