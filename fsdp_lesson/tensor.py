"""Tensor parallelism (Megatron-LM): T ranks split each pair of Linears; none holds either whole.

    ColumnParallelLinear  keeps W[:, cols], b[cols]   y_r = x @ W_r + b_r     (B, in) -> (B, H/T)
    RowParallelLinear     keeps W[rows, :], b whole   y = sum_r x_r @ W_r + b (B, H/T) -> (B, out)

A column layer, the ReLU (which works element by element, so on each rank's columns alone)
and a row layer make one block with one allreduce in forward and one in backward, the two
operators of Megatron's paper:

    f  in front of the column layer: forward the identity (every rank has all of x); backward
       an allreduce-sum, since each rank's dx = dy_r @ W_r.T covers only its columns
    g  behind the row layer: forward an allreduce-sum, since each rank's x_r @ W_r covers only
       its rows; backward the identity (every rank has all of dy)

Each layer's `shapes` are this rank's piece, so every --strategy (dp, zero1-3 over the mesh's
data-parallel ranks) allocates, shards and reduces the pieces as it would whole layers.

A width H that T does not divide is padded to T * ceil(H/T) with zero columns of the column
layer (weights and bias) and zero rows of the row layer. They stay exactly zero: a padded
column's output is x @ 0 + 0 = 0, so its gradients are x.T @ dy_pad and sum(dy_pad) where
dy_pad = (dx_row @ 0) * relu'(0) = 0; a padded row multiplies that zero column, so its gradient
is 0.T @ dy = 0. Zero gradients leave SGD's p - lr * 0 and Adam's m, v and update at zero.

--c-compat reduces as the C program does (docs/seed_semantics.md, "The TP program"): g is a
mean taken after each rank added the whole bias, and f's backward a mean.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from .comm import Comm
from .model import Linear, Params, plain_linear
from .placement import Replicate, Shard, piece_range


def megatron(tp: Comm | None, c_compat: bool = False) -> Callable[[int, list[int]], Linear]:
    """MLP's Linear factory over the T ranks of `tp`: Megatron's pairs (megatron_linear), or
    whole Linears when T = 1 (or tp is None)."""
    if tp is None or tp.size == 1:
        return plain_linear
    return partial(megatron_linear, tp=tp, c_compat=c_compat)


def megatron_linear(i: int, widths: list[int], tp: Comm, c_compat: bool = False) -> Linear:
    """The model's i-th Linear (fc{i}, from widths[i-1] to widths[i]) as Megatron pairs them:
    fc1 column, fc2 row, fc3 column, ...; an odd last one (the output layer) stays whole."""
    name, n_in, n_out = f"fc{i}", widths[i - 1], widths[i]
    if i % 2 == 0:
        return RowParallelLinear(name, n_in, n_out, tp, c_compat)
    if i == len(widths) - 1:  # nothing to pair it with: replicated, as the embedding is
        return Linear(name, n_in, n_out)
    return ColumnParallelLinear(name, n_in, n_out, tp, c_compat)


def f_backward(dx: np.ndarray, tp: Comm, c_compat: bool, tag: str) -> np.ndarray:
    """f's backward: the partial dx of every rank's columns summed (C: their mean), in place."""
    flat = dx.reshape(-1)  # a view: the ring cuts a 1-D buffer into T chunks
    if c_compat:
        tp.allreduce_mean(flat, tag)
    else:
        tp.allreduce_sum(flat, tag)
    return dx


def g_forward(partial: np.ndarray, b: np.ndarray, tp: Comm, c_compat: bool, tag: str):
    """g's forward: every rank's partial product summed, then the bias added once, in place.
    The C program adds the whole bias on every rank and takes the mean: sum / T + b."""
    flat = partial.reshape(-1)  # a view: the ring cuts a 1-D buffer into T chunks
    if c_compat:
        partial += b
        tp.allreduce_mean(flat, tag)
    else:
        tp.allreduce_sum(flat, tag)
        partial += b
    return partial


class ColumnParallelLinear(Linear):
    """This rank's columns of a Linear: W (in, H/T), b (H/T,); its output is this rank's
    columns of y, and its input's gradient the sum over ranks (f). DTensor's ColwiseParallel
    (whose weight is stored (out, in), so Shard(0) there)."""

    placements = {"W": Shard(1), "b": Shard(0)}  # columns start:stop of each, zero-padded

    def __init__(self, name: str, n_in: int, n_out: int, tp: Comm, c_compat: bool = False):
        super().__init__(name, n_in, n_out)  # the whole layer: whole_shapes and init_scale
        self.tp, self.c_compat = tp, c_compat
        self.start, self.stop, width = piece_range(n_out, tp.size, tp.rank)
        self.shapes = {"W": (n_in, width), "b": (width,)}

    def backward(self, p: Params, x: np.ndarray, dout: np.ndarray, g: Params) -> np.ndarray:
        # dW (in, B) @ (B, H/T), db, and dx (B, H/T) @ (H/T, in) -> (B, in): these columns' share
        dx = super().backward(p, x, dout, g)
        return f_backward(dx, self.tp, self.c_compat, self.name)


class RowParallelLinear(Linear):
    """This rank's rows of a Linear: W (H/T, out), and the whole bias b (out,); its input is
    this rank's columns of x, its output the sum over ranks (g) plus b, on every rank.
    DTensor's RowwiseParallel."""

    placements = {"W": Shard(0), "b": Replicate()}  # rows start:stop of W; b whole everywhere

    def __init__(self, name: str, n_in: int, n_out: int, tp: Comm, c_compat: bool = False):
        super().__init__(name, n_in, n_out)  # the whole layer: whole_shapes and init_scale
        self.tp, self.c_compat = tp, c_compat
        self.start, self.stop, width = piece_range(n_in, tp.size, tp.rank)
        self.shapes = {"W": (width, n_out), "b": (n_out,)}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        partial = x @ p["W"]  # (B, H/T) @ (H/T, out) -> (B, out): these rows' share of y
        return g_forward(partial, p["b"], self.tp, self.c_compat, self.name), x

    # backward is Linear's (g's backward is the identity): dW = x_r.T @ dy (H/T, out),
    # db = sum(dy) (the same on every rank, so b stays replicated), dx_r = dy @ W_r.T (B, H/T)
