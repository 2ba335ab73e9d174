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
    every layer's cache, or with recompute only each block's input."""
    strategy.begin_phase("forward")
    for layer in model.layers:
        WHERE.layer = layer.name  # for a timed-out collective's line (watchdog.py)
        p = strategy.materialize(layer)
        x_in = x
        x, cache = layer.forward(p, x)
        if acts is not None:
            acts.push(layer.name, cache)  # counted while it exists, with recompute too
            if recompute and layer.name not in model.block_inputs:
                acts.drop()  # backward computes it again from the block's input
            elif recompute and not layer.cache_is_input:
                acts.drop()  # a block's whole cache: only its input is kept
                acts.push(layer.name, x_in)
        strategy.release(layer)
    WHERE.layer = None
    return x


def recompute_block(strategy: Strategy, block: list, acts: Activations) -> None:
    """Run a block's forward again from its kept input, pushing the caches forward dropped.

    A layer whose cache is its input (model.py's) has it kept already, and each output is the
    next layer's cache, so the last layer's forward is not needed; a layer that keeps more (a
    transformer block, gpt.py) runs again to make its cache. The parameters stay materialized
    for the backward that follows (zero3: no gather beyond backward's own).
    """
    x = acts.top()  # the block's input
    last = len(block) - 1
    for i, layer in enumerate(block):
        if layer.cache_is_input:
            if i > 0:
                acts.push(layer.name, x)  # its cache is its input
            if i < last:
                x, _ = layer.forward(strategy.materialize(layer), x)
        else:
            if i == 0:
                acts.drop()  # only the input was kept: the whole cache is made again
            x, cache = layer.forward(strategy.materialize(layer), x)
            acts.push(layer.name, cache)


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
