"""The character-level MLP as layers with mirrored forward and backward.

Every layer has the same two methods:
    forward(p, x)                 -> (out, cache)
    backward(p, cache, dout, g)   -> dx        (writes the layer's gradients into g)
p and g are dicts of arrays with the shapes in `layer.shapes`. A layer owns no parameters:
whoever calls it decides where p and g live, which is exactly what the strategies change.

Under tensor parallelism (tensor.py, `MLP(config, megatron(tp))`) a layer may compute with a
piece of a whole layer: its `shapes` are the piece's, `whole_shapes` the whole's, `piece` cuts
its piece from the whole and `whole` gathers the pieces again. Every other layer is its own
whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .config import ModelConfig
from .flat import Params
from .placement import Placement, Replicate, Shard, cut_piece, join_pieces
from .rng import Rng


class Layer:
    """What every layer answers besides forward and backward: its parameters' shapes, and, for
    tensor parallelism, each parameter's placement over the tensor-parallel ranks `tp`
    (placement.py: Shard(dim) or Replicate(); a layer of its own is Replicate() throughout)."""

    name: str
    shapes: dict[str, tuple[int, ...]]  # this rank's parameters
    whole_shapes: dict[str, tuple[int, ...]]  # the layer's, as single-rank training has it
    placements: dict[str, Placement] = {}  # along tp, by parameter; missing: Replicate()
    tp = None  # the tensor-parallel ranks' Comm of a split layer (tensor.py)
    init_scale: float  # initial values uniform in [-init_scale, init_scale] (initial)
    cache_is_input = True  # forward's cache is its input x (--recompute keeps no more)

    def initial(self, key: str, shape: tuple[int, ...], rng: Rng) -> np.ndarray:
        """The whole parameter's initial float32 values: uniform in [-k, k], as the C
        program's he_init(k) = 2k*u - k, with k = init_scale."""
        k = np.float32(self.init_scale)
        u = rng.uniform(int(np.prod(shape))).reshape(shape)  # float32 in [0, 1]
        u *= np.float32(2) * k  # in place: the layer's values are its only copy
        u -= k
        return u

    def out_width(self, width: int, seq_len: int) -> int:
        """The features of this layer's output rows, given its input's (`width`; tokens: 0):
        a layer with W (in, out) gives out (a tensor-parallel piece's own), others keep it."""
        return self.shapes["W"][1] if "W" in self.shapes else width

    def placement(self, key: str) -> Placement:
        return self.placements.get(key, Replicate())

    @property
    def pieces(self) -> tuple[str, ...]:
        """The parameters this rank holds a piece of (Shard along tp)."""
        return tuple(k for k in self.shapes if isinstance(self.placement(k), Shard))

    @property
    def split(self) -> bool:
        """Whether this rank holds a piece of the layer; its other parameters are whole."""
        return bool(self.pieces)

    def piece(self, whole: Params) -> Params:
        """This rank's parameters, cut from the whole layer's (a split layer's: new arrays)."""
        if not self.split:
            return whole
        size, rank = self.tp.size, self.tp.rank
        return {k: cut_piece(v, self.placement(k), size, rank) for k, v in whole.items()}

    def whole(self, p: Params) -> Params:
        """The whole layer's parameters from this rank's (a split layer's: an allgather over
        tp of each Shard, in order)."""
        if not self.split:
            return p
        return {
            k: join_pieces(v, self.placement(k), self.tp, self.whole_shapes[k])
            for k, v in p.items()
        }


class Embedding(Layer):
    """Token ids -> vectors, flattened: (B, S) -> (B, S*E)."""

    def __init__(self, name: str, vocab_size: int, emb_size: int) -> None:
        self.name, self.emb_size = name, emb_size
        self.shapes = self.whole_shapes = {"W": (vocab_size, emb_size)}
        self.init_scale = 1.0 / emb_size  # the C program's he_init(k) with k = 1/emb_size

    def out_width(self, width: int, seq_len: int) -> int:
        return seq_len * self.emb_size  # tokens (B, S) in, (B, S*E) out

    def forward(self, p: Params, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = p["W"][tokens]  # (B, S) -> (B, S, E)
        return out.reshape(len(tokens), -1), tokens  # (B, S*E)

    def backward(self, p: Params, tokens: np.ndarray, dout: np.ndarray, g: Params) -> None:
        # dW[v] = the sum of dout's rows at the positions holding token v: a scatter-add,
        # done as one bincount per column (5x faster than np.add.at, and no big temporaries)
        flat_tokens, rows = tokens.ravel(), dout.reshape(-1, self.emb_size)  # (B*S,), (B*S, E)
        for e in range(self.emb_size):
            g["W"][:, e] = np.bincount(flat_tokens, weights=rows[:, e], minlength=len(g["W"]))
        return None  # tokens have no gradient


class Linear(Layer):
    """y = x @ W + b with W stored (in, out), row-major, as in the C program."""

    def __init__(self, name: str, in_features: int, out_features: int) -> None:
        self.name = name
        self.shapes = self.whole_shapes = {"W": (in_features, out_features), "b": (out_features,)}
        self.init_scale = 1.0 / in_features  # the C program: k = 1/in (not its square root)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = x @ p["W"]  # (B, in) @ (in, out) -> (B, out)
        out += p["b"]
        return out, x

    def backward(self, p: Params, x: np.ndarray, dout: np.ndarray, g: Params) -> np.ndarray:
        np.matmul(x.T, dout, out=g["W"])  # (in, B) @ (B, out) -> (in, out)
        np.sum(dout, axis=0, out=g["b"])
        return dout @ p["W"].T  # (B, out) @ (out, in) -> (B, in)


class ReLU(Layer):
    """max(x, 0); no parameters. It keeps its input for backward (its output is the next cache)."""

    def __init__(self, name: str) -> None:
        self.name, self.init_scale = name, 0.0
        self.shapes = self.whole_shapes = {}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.maximum(x, 0), x

    def backward(self, p: Params, x: np.ndarray, dout: np.ndarray, g: Params) -> np.ndarray:
        return dout * (x > 0)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, max subtracted; exp in float64 on float32 input, as the C program does."""
    exp = (logits - logits.max(axis=1, keepdims=True)).astype(np.float64)
    np.exp(exp, out=exp)
    exp /= exp.sum(axis=1, keepdims=True)
    return exp.astype(logits.dtype)


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits) over this rank's rows; log in float64."""

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, tuple]:
        probs = softmax(logits)  # (B, V)
        picked = probs[np.arange(len(targets)), targets].astype(np.float64)
        return float(-np.mean(np.log(picked))), (probs, targets)

    def backward(self, cache: tuple, rows: int | None = None) -> np.ndarray:
        """(probs - onehot(targets)) / B, computed in place in the cache's probs.

        rows: B, when the mean is over more rows than these (gradient accumulation: the rows of
        all micro-batches of the step); by default these rows.
        """
        dlogits, targets = cache
        dlogits[np.arange(len(targets)), targets] -= 1
        dlogits /= rows or len(targets)  # the mean over this rank's rows
        return dlogits  # (B, V)

    def next_token_logits(self, logits: np.ndarray) -> np.ndarray:
        """The logits (rows, V) of the token after each row's context: sampling's."""
        return logits


def plain_linear(i: int, widths: list[int]) -> Linear:
    """The model's i-th Linear (fc{i}, from widths[i-1] to widths[i]), whole."""
    return Linear(f"fc{i}", widths[i - 1], widths[i])


class Model:
    """What every model gives the loop and the strategies: `layers` in forward order, `blocks`
    (what --recompute keeps the input of, and pipeline stages are made of), `loss`, `config`,
    and each layer's initial parameters. MLP here; the transformer in gpt.py."""

    config: ModelConfig
    layers: list[Layer]
    blocks: list[list[Layer]]
    loss: SoftmaxCrossEntropy

    @property
    def block_inputs(self) -> set[str]:
        """The first layer of each block: what --recompute keeps the input of."""
        return {block[0].name for block in self.blocks}

    @property
    def num_params(self) -> int:
        """The whole model's parameters (under tensor parallelism too)."""
        return sum(int(np.prod(s)) for layer in self.layers for s in layer.whole_shapes.values())

    def targets(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """What the loss compares the logits with, from the dataset's rows (context X, next Y):
        the next token, one per row."""
        return Y

    def init_layers(self, rng: Rng, dtype=np.float32) -> Iterator[tuple[Layer, Params]]:
        """Each whole layer's initial parameters in turn, in the C program's order: one layer at
        a time (a split layer's piece is `layer.piece` of them).

        A caller that keeps only a shard of each layer still draws every layer, so the random
        stream is the same at any N.
        """
        for layer in self.layers:
            params = {}
            for name, shape in layer.whole_shapes.items():
                params[name] = layer.initial(name, shape, rng).astype(dtype, copy=False)
            yield layer, params

    def init_params(self, rng: Rng, dtype=np.float32) -> dict[str, Params]:
        """Every whole layer's initial parameters at once (the reference; strategies use
        init_layers)."""
        return {layer.name: params for layer, params in self.init_layers(rng, dtype)}


class MLP(Model):
    """embedding -> fc1, ReLU -> (layers - 1) x (Linear, ReLU) -> output Linear.

    `linear(i, widths)` makes the i-th Linear: whole by default; tensor.py's megatron(tp) pairs
    them as Megatron's column- and row-parallel layers.
    """

    def __init__(
        self, config: ModelConfig, linear: Callable[[int, list[int]], Linear] = plain_linear
    ) -> None:
        config.validate()
        c = config
        self.config = c
        self.layers: list[Layer] = [Embedding("emb", c.vocab_size, c.emb)]
        widths = [c.seq_len * c.emb] + [c.hidden] * c.layers + [c.vocab_size]
        for i in range(1, c.layers + 2):
            self.layers.append(linear(i, widths))
            if i <= c.layers:
                self.layers.append(ReLU(f"relu{i}"))
        self.loss = SoftmaxCrossEntropy()
        # the segments --recompute checkpoints: a layer with parameters and the ReLU after it
        self.blocks: list[list] = []
        for layer in self.layers:
            if layer.shapes or not self.blocks:
                self.blocks.append([])
            self.blocks[-1].append(layer)


def loss_and_grads(
    model: Model, params: dict[str, Params], X: np.ndarray, Y: np.ndarray
) -> tuple[float, dict[str, Params]]:
    """The reference: loss and every gradient of one batch, all parameters in one place."""
    x, caches = X, []
    for layer in model.layers:
        x, cache = layer.forward(params[layer.name], x)
        caches.append(cache)
    loss, loss_cache = model.loss.forward(x, Y)
    dx = model.loss.backward(loss_cache)
    grads = {}
    for layer, cache in zip(reversed(model.layers), reversed(caches), strict=True):
        p = params[layer.name]
        grads[layer.name] = {k: np.empty_like(v) for k, v in p.items()}
        dx = layer.backward(p, cache, dx, grads[layer.name])
    return loss, grads
