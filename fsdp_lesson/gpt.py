"""A character-level causal transformer (`--model gpt`), written as the MLP is: layers with
mirrored forward and backward, no autograd (model.py's contract).

    emb      token + position embedding             (B, S) tokens   -> (B, S*E)
    h0 ...   L blocks: x + attn(ln1(x)), then x + mlp(ln2(x))       (B, S*E) -> (B, S*E)
    head     final LayerNorm, then the LM head       (B, S*E)        -> (B, S*V)

It predicts every position: position t's target is the token after it, so a dataset row
(context, next) gives S targets, context[1:] and next (`GPT.targets`). The residual stream
travels between layers flattened to (B, S*E), as the MLP's activations do, so pipeline stages,
the memory ledger and every strategy see the 2-D arrays they know; a block is one layer, so
zero3's unit is one transformer block, as FSDP2 wraps each `TransformerBlock`.

The head is not tied to the embedding: a pipeline puts them on different stages, and tying
them would need their gradients summed across the two (Megatron's embedding group); untied,
as Llama's are, every parameter lives on one stage.

Tensor parallelism (`tp`, Megatron-LM): q, k and v column-parallel by heads, the attention's
output projection row-parallel, the MLP's two Linears as the MLP's pair (tensor.py); the
LayerNorms, the biases after a row layer, the embedding and the head replicated. A block has
tensor.py's two operators twice: f in front of q/k/v and of the MLP (backward: the partial
input gradients summed over tp), g behind the projection and the MLP (forward: the partial
products summed).

Sequence parallelism (`sequence_parallel`, Korthikanti et al. 2022) splits what tp
replicates along the sequence: each tp rank keeps the residual stream, the LayerNorms and the
dropout-free adds of S/T positions only. f becomes an allgather along the sequence (every rank
needs all positions for attention and the MLP) and g a reduce-scatter (each rank keeps the sum
at its own positions): the same bytes as g's allreduce, and the replicated activations / T.

Context parallelism (`cp`, ring_attention.py) splits every activation along the sequence, the
attention's too: each of C ranks holds S/C positions of every row (zig-zag or contiguous), and
only attention looks past them, passing K/V around the cp ring. Every other layer is per
position, so it runs on the rank's positions as it would on all of them. The loss is the mean
over the rank's positions; the strategy averages over dp and cp together (mesh.state_mesh), so
the gradient is the mean over every position of every row. Sequence parallelism then cuts a cp
rank's S/C positions over tp.
"""

from __future__ import annotations

import numpy as np

from .attention import attention, attention_backward
from .comm import Comm
from .config import ModelConfig
from .model import Embedding, Layer, Model, Params, softmax
from .placement import Placement, Replicate, Shard, piece_range
from .ring_attention import layout, ring_attention, ring_attention_backward
from .rng import Rng

EPS = np.float32(1e-5)  # LayerNorm's
GELU_C = np.float32(np.sqrt(2 / np.pi))


class Saved(dict):
    """What a layer's forward keeps for its backward, by name, and its bytes (the ledger's)."""

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values())


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, tuple]:
    """(x - mean) / std over the last axis, scaled by g and shifted by b; (xhat, 1/std) kept."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    rstd = 1 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + EPS)  # (..., 1)
    xhat = centred * rstd
    return xhat * g + b, (xhat, rstd)


def layer_norm_backward(dy: np.ndarray, saved: tuple, g: np.ndarray, grads: tuple) -> np.ndarray:
    """dx of layer_norm; its gain's and shift's gradients written into grads (dg, db)."""
    xhat, rstd = saved
    dg, db = grads
    rows = dy.reshape(-1, dy.shape[-1])
    np.sum(rows * xhat.reshape(rows.shape), axis=0, out=dg)
    np.sum(rows, axis=0, out=db)
    dxhat = dy * g
    mean_dxhat = dxhat.mean(axis=-1, keepdims=True)
    mean_dxhat_xhat = (dxhat * xhat).mean(axis=-1, keepdims=True)
    return (dxhat - mean_dxhat - xhat * mean_dxhat_xhat) * rstd


def gelu_tanh(u: np.ndarray) -> np.ndarray:
    """tanh(c (u + 0.044715 u^3)) in one new buffer: fresh temporaries of u's size made glibc hand
    pages back and fault them in again, 20x slower (benchmarks/bench_gpt.py)."""
    t = u * u
    t *= np.float32(0.044715)
    t += 1
    t *= u
    t *= GELU_C
    return np.tanh(t, out=t)


def gelu(u: np.ndarray) -> np.ndarray:
    """GELU, tanh form (GPT-2's): 0.5 u (1 + tanh(c (u + 0.044715 u^3)))."""
    t = gelu_tanh(u)
    t += 1
    t *= u
    t *= np.float32(0.5)
    return t


def gelu_backward(u: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dy * gelu'(u) = dy * (0.5 (1 + t) + 0.5 u (1 - t^2) c (1 + 3 * 0.044715 u^2)), t as in
    gelu, in place on three buffers."""
    t = gelu_tanh(u)
    slope = t * t
    np.subtract(1, slope, out=slope)
    slope *= u
    slope *= np.float32(0.5) * GELU_C
    inner = u * u
    inner *= np.float32(3 * 0.044715)
    inner += 1
    slope *= inner  # 0.5 u (1 - t^2) c (1 + 3 * 0.044715 u^2)
    t += 1
    t *= np.float32(0.5)
    slope += t
    slope *= dy
    return slope


def rows(a: np.ndarray) -> np.ndarray:
    """(..., n) -> (all the rows, n): the batch and sequence axes as one."""
    return a.reshape(-1, a.shape[-1])


def dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (..., n) @ w (n, m) as one 2-D product: numpy runs a 3-D @ 2-D product as one small
    product per leading index, twice as slow at this model's shapes (benchmarks/bench_gpt.py)."""
    return (rows(x) @ w).reshape(*x.shape[:-1], w.shape[1])


def uniform(shape: tuple[int, ...], k: float, rng: Rng) -> np.ndarray:
    """float32 values uniform in [-k, k], drawn from the run's stream as model.py's layers do."""
    u = rng.uniform(int(np.prod(shape))).reshape(shape)
    u *= np.float32(2 * k)
    u -= np.float32(k)
    return u


def initial_transformer(key: str, shape: tuple[int, ...], rng: Rng) -> np.ndarray:
    """GPT-style initial values: LayerNorm gains 1, biases 0 (nothing drawn), each matrix
    uniform in +-1/sqrt(its rows) (PyTorch's Linear default bound)."""
    if key.endswith("_g"):
        return np.ones(shape, np.float32)
    if len(shape) == 1:
        return np.zeros(shape, np.float32)
    return uniform(shape, 1 / np.sqrt(shape[0]), rng)


class SequenceSplit:
    """How a layer's activations sit over the tensor-parallel ranks `tp`: whole on every rank,
    or, with sequence parallelism, S/T positions each (rank r: [r*S/T, (r+1)*S/T)).

        gather(x)       (B, S_here, E) -> (B, S, E): what attention and the MLP compute with
        sum_partial(x)  (B, S, E) partial products -> their sum over tp, (B, S_here, E)

    Without sequence parallelism: the identity and an allreduce (Megatron's f's backward and
    g's forward); with it: an allgather and a reduce-scatter along the sequence. Backward uses
    each as the other's mirror (gather's backward is sum_partial, and sum_partial's is gather).
    """

    def __init__(self, tp: Comm | None, sequence_parallel: bool, seq_len: int) -> None:
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.on = sequence_parallel and self.tp is not None
        self.pieces = self.tp.size if self.on else 1
        self.local = seq_len // self.pieces  # positions this rank keeps of the stream
        self.start = (self.tp.rank if self.on else 0) * self.local

    def gather(self, x: np.ndarray, tag: str) -> np.ndarray:
        if not self.on:
            return x
        piece = np.ascontiguousarray(x.transpose(1, 0, 2))  # (S/T, B, E): rank-major below
        full = np.empty((self.pieces * len(piece),) + piece.shape[1:], x.dtype)  # (S, B, E)
        self.tp.allgather(piece.reshape(-1), full.reshape(-1), tag)
        return full.transpose(1, 0, 2)  # (B, S, E)

    def sum_partial(self, x: np.ndarray, tag: str) -> np.ndarray:
        if self.tp is None:
            return x
        if not self.on:
            x = np.ascontiguousarray(x)
            self.tp.allreduce_sum(x.reshape(-1), tag)  # 1-D: the ring cuts it into T chunks
            return x
        full = np.ascontiguousarray(x.transpose(1, 0, 2))  # (S, B, E)
        piece = np.empty((self.local,) + full.shape[1:], x.dtype)  # (S/T, B, E)
        self.tp.reduce_scatter_sum(full.reshape(-1), piece.reshape(-1), tag)
        return piece.transpose(1, 0, 2)  # (B, S/T, E)

    def own(self, x: np.ndarray) -> np.ndarray:
        """This rank's positions of a (B, S, ...) array that every tp rank holds whole."""
        return x[:, self.start : self.start + self.local] if self.on else x

    def sum_replicated_grads(self, grads: Params, keys: tuple[str, ...], tag: str) -> None:
        """Sequence parallelism: the gradients of what every rank holds whole but applied to
        its own positions only are partial sums: add them up over tp, in place."""
        if self.on:
            for key in keys:
                self.tp.allreduce_sum(grads[key].reshape(-1), f"{tag} {key}")


class ContextSplit:
    """Which positions of every row this rank holds: all of them (cp None or one rank), or
    the cp layout's S/C (ring_attention.layout); and the attention that sees the others."""

    def __init__(self, cp: Comm | None, layout_name: str, seq_len: int) -> None:
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.layout = layout(layout_name, seq_len, cp.size) if self.cp else [np.arange(seq_len)]
        self.positions = self.layout[self.cp.rank if self.cp else 0]  # (S/C,), ascending
        self.local = len(self.positions)
        self.last = next(r for r, p in enumerate(self.layout) if p[-1] == seq_len - 1)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple:
        """Causal attention of this rank's queries to every key: (out, lse)."""
        if self.cp is None:
            return attention(q, k, v, self.positions, self.positions)
        return ring_attention(q, k, v, self.layout, self.cp)

    def attention_backward(self, q, k, v, out, lse, dout) -> tuple:
        """The mirror of attention: (dq, dk, dv) of this rank's positions."""
        if self.cp is None:
            return attention_backward(q, k, v, out, lse, dout, self.positions, self.positions)
        return ring_attention_backward(q, k, v, out, lse, dout, self.layout, self.cp)

    def at_last_position(self, x: np.ndarray) -> np.ndarray:
        """x (B, S/C, n)'s row at the sequence's last position, on every cp rank: the rank that
        holds that position broadcasts it."""
        last = np.ascontiguousarray(x[:, -1])  # the last position here; the sequence's on `last`
        return last if self.cp is None else self.cp.bcast(last, root=self.last)


def piece_shapes(whole: dict, placements: dict[str, Placement], tp: Comm | None) -> dict:
    """This rank's shapes: each Shard(dim) parameter's piece along dim, the rest whole."""
    if tp is None or tp.size == 1:
        return dict(whole)
    shapes = {}
    for key, shape in whole.items():
        placement = placements.get(key, Replicate())
        if isinstance(placement, Shard):
            shape = list(shape)
            shape[placement.dim] = piece_range(shape[placement.dim], tp.size, tp.rank)[2]
            shape = tuple(shape)
        shapes[key] = shape
    return shapes


class TokenPositionEmbedding(Embedding):
    """W[token] + P[position] at this rank's positions: (B, S) tokens -> (B, S_here*E).
    Sequence parallelism: S/T of the cp rank's positions per tp rank, and W's and P's
    gradients summed over tp."""

    initial = staticmethod(initial_transformer)

    def __init__(self, name: str, c: ModelConfig, seq: SequenceSplit, ctx: ContextSplit) -> None:
        super().__init__(name, c.vocab_size, c.emb)
        self.shapes = self.whole_shapes = {"W": (c.vocab_size, c.emb), "P": (c.seq_len, c.emb)}
        self.seq = seq
        self.columns = ctx.positions[seq.start : seq.start + seq.local]  # positions embedded here

    def out_width(self, width: int, seq_len: int) -> int:
        return self.seq.local * self.emb_size

    def forward(self, p: Params, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = p["W"][tokens[:, self.columns]] + p["P"][self.columns]  # (B, S_here, E)
        return out.reshape(len(tokens), -1), tokens  # it keeps its input, as every Embedding

    def backward(self, p: Params, tokens: np.ndarray, dout: np.ndarray, g: Params) -> None:
        super().backward(p, tokens[:, self.columns], dout, g)  # g["W"]: scatter-add by token
        g["P"][...] = 0
        g["P"][self.columns] = dout.reshape(len(tokens), -1, self.emb_size).sum(axis=0)
        self.seq.sum_replicated_grads(g, ("W", "P"), self.name)
        return None


class Block(Layer):
    """One transformer block, one layer: x + attn(ln1(x)), then x + mlp(ln2(x)), with
    multi-head causal self-attention and an MLP of width F (--hidden) with GELU.

    The keys have no bias: q . (k + b) = q . k + q . b adds the same number to all of a query's
    scores, which softmax ignores, so b's gradient is zero but for rounding, and Adam, which
    divides a gradient by its own size, would turn that rounding into full-size steps (a run
    on 4 ranks then differs from one rank by 5e-4 after 20 steps: measured)."""

    initial = staticmethod(initial_transformer)

    cache_is_input = False  # it keeps q, k, v, the attention, the MLP's input ...
    TP_PLACEMENTS = {  # Megatron: q/k/v and fc by columns (heads), o and proj by rows
        **{w: Shard(1) for w in ("wq", "wk", "wv", "w_fc")},
        **{b: Shard(0) for b in ("bq", "bv", "b_fc")},
        **{w: Shard(0) for w in ("wo", "w_proj")},
    }
    REPLICATED = ("ln1_g", "ln1_b", "bo", "ln2_g", "ln2_b", "b_proj")  # whole on every tp rank

    def __init__(
        self, name: str, c: ModelConfig, tp: Comm | None, seq: SequenceSplit, ctx: ContextSplit
    ) -> None:
        E, F = c.emb, c.hidden
        T = 1 if tp is None else tp.size
        self.name, self.tp, self.seq, self.ctx, self.seq_len = name, tp, seq, ctx, ctx.local
        self.head_dim, self.heads = E // c.heads, c.heads // T  # this rank's heads
        self.whole_shapes = {
            "ln1_g": (E,), "ln1_b": (E,),
            "wq": (E, E), "bq": (E,), "wk": (E, E), "wv": (E, E), "bv": (E,),
            "wo": (E, E), "bo": (E,),
            "ln2_g": (E,), "ln2_b": (E,),
            "w_fc": (E, F), "b_fc": (F,), "w_proj": (F, E), "b_proj": (E,),
        }  # fmt: skip
        self.placements = self.TP_PLACEMENTS if T > 1 else {}
        self.shapes = piece_shapes(self.whole_shapes, self.placements, tp)

    def heads_of(self, x: np.ndarray) -> np.ndarray:
        """(B, S, heads*D) -> (B, heads, S, D)."""
        B, S, _ = x.shape
        return x.reshape(B, S, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def merged(self, x: np.ndarray) -> np.ndarray:
        """(B, heads, S, D) -> (B, S, heads*D)."""
        B, _, S, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, S, self.heads * self.head_dim)

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Saved]:
        seq = self.seq
        X = x.reshape(len(x), seq.local, -1)  # (B, S_here, E): the residual stream
        h1, ln1 = layer_norm(X, p["ln1_g"], p["ln1_b"])
        h = seq.gather(h1, f"{self.name} attn in")  # (B, S, E) on every tp rank (S: this cp rank's)
        q = self.heads_of(dot(h, p["wq"]) + p["bq"])  # (B, S, E) @ (E, E/T) -> (B, H/T, S, D)
        k = self.heads_of(dot(h, p["wk"]))  # no bias: see the class's docstring
        v = self.heads_of(dot(h, p["wv"]) + p["bv"])
        att, lse = self.ctx.attention(q, k, v)  # (B, H/T, S, D), (B, H/T, S): cp's ring
        a = self.merged(att)  # (B, S, E/T)
        o = seq.sum_partial(dot(a, p["wo"]), f"{self.name} attn out")  # (B, S_here, E)
        X2 = X + o + p["bo"]
        h2, ln2 = layer_norm(X2, p["ln2_g"], p["ln2_b"])
        hh = seq.gather(h2, f"{self.name} mlp in")  # (B, S, E)
        u = dot(hh, p["w_fc"]) + p["b_fc"]  # (B, S, E) @ (E, F/T) -> (B, S, F/T)
        m = seq.sum_partial(dot(gelu(u), p["w_proj"]), f"{self.name} mlp out")  # (B, S_here, E)
        out = X2 + m + p["b_proj"]
        saved = Saved(h=h, q=q, k=k, v=v, att=att, lse=lse, hh=hh, u=u)
        saved.update(xhat1=ln1[0], rstd1=ln1[1], xhat2=ln2[0], rstd2=ln2[1])
        return out.reshape(len(x), -1), saved

    def backward(self, p: Params, s: Saved, dout: np.ndarray, g: Params) -> np.ndarray:
        seq = self.seq
        dX2 = dout.reshape(len(dout), seq.local, -1)  # (B, S_here, E)
        # out = X2 + sum(gelu(u) @ w_proj) + b_proj
        np.sum(rows(dX2), axis=0, out=g["b_proj"])
        dm = seq.gather(dX2, f"{self.name} mlp out")  # (B, S, E)
        gl = gelu(s["u"])
        np.matmul(rows(gl).T, rows(dm), out=g["w_proj"])  # (F/T, B*S) @ (B*S, E)
        du = gelu_backward(s["u"], dot(dm, p["w_proj"].T))  # (B, S, F/T)
        np.matmul(rows(s["hh"]).T, rows(du), out=g["w_fc"])
        np.sum(rows(du), axis=0, out=g["b_fc"])
        dh2 = seq.sum_partial(dot(du, p["w_fc"].T), f"{self.name} mlp in")  # (B, S_here, E)
        dX = dX2 + layer_norm_backward(
            dh2, (s["xhat2"], s["rstd2"]), p["ln2_g"], (g["ln2_g"], g["ln2_b"])
        )
        # X2 = X + sum(attention(...) @ wo) + bo
        np.sum(rows(dX), axis=0, out=g["bo"])
        do = seq.gather(dX, f"{self.name} attn out")  # (B, S, E)
        np.matmul(rows(self.merged(s["att"])).T, rows(do), out=g["wo"])
        da = self.heads_of(dot(do, p["wo"].T))  # (B, H/T, S, D)
        dq, dk, dv = self.ctx.attention_backward(s["q"], s["k"], s["v"], s["att"], s["lse"], da)
        dh = 0
        for name, d in (("q", dq), ("k", dk), ("v", dv)):
            d = self.merged(d)  # (B, S, E/T)
            np.matmul(rows(s["h"]).T, rows(d), out=g[f"w{name}"])
            if name != "k":
                np.sum(rows(d), axis=0, out=g[f"b{name}"])
            dh = dh + dot(d, p[f"w{name}"].T)  # (B, S, E/T) @ (E/T, E): this rank's heads' part
        dh1 = seq.sum_partial(dh, f"{self.name} attn in")  # (B, S_here, E)
        dX += layer_norm_backward(
            dh1, (s["xhat1"], s["rstd1"]), p["ln1_g"], (g["ln1_g"], g["ln1_b"])
        )
        seq.sum_replicated_grads(g, self.REPLICATED, self.name)
        return dX.reshape(len(dout), -1)

    def cache_bytes(self, rows: int) -> int:
        """What forward keeps for `rows` rows, in bytes (float32): the dry run's count (S: the
        positions of this cp rank)."""
        S, E = self.seq_len, self.whole_shapes["wq"][0]
        local, width = self.seq.local, self.heads * self.head_dim
        F = self.shapes["w_fc"][1]
        floats = 2 * S * E + 4 * S * width + self.heads * S + S * F  # h, hh; q k v att; lse; u
        floats += 2 * (local * E + local)  # two LayerNorms' xhat and 1/std
        return 4 * rows * floats


class Head(Layer):
    """The final LayerNorm and the LM head, at every position of this cp rank:
    (B, S_here*E) -> (B, S*V). Under sequence parallelism it first gathers the sequence, so
    every tp rank holds all the logits (the head is replicated, as the MLP's output layer is)."""

    initial = staticmethod(initial_transformer)

    cache_is_input = False

    def __init__(self, name: str, c: ModelConfig, seq: SequenceSplit, ctx: ContextSplit) -> None:
        E, V = c.emb, c.vocab_size
        self.name, self.seq, self.seq_len, self.vocab = name, seq, ctx.local, V
        self.shapes = self.whole_shapes = {"lnf_g": (E,), "lnf_b": (E,), "W": (E, V), "b": (V,)}

    def out_width(self, width: int, seq_len: int) -> int:
        return self.seq_len * self.vocab

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, Saved]:
        X = self.seq.gather(x.reshape(len(x), self.seq.local, -1), f"{self.name} in")
        h, ln = layer_norm(X, p["lnf_g"], p["lnf_b"])  # (B, S, E)
        logits = dot(h, p["W"]) + p["b"]  # (B, S, E) @ (E, V) -> (B, S, V)
        return logits.reshape(len(x), -1), Saved(h=h, xhat=ln[0], rstd=ln[1])

    def backward(self, p: Params, s: Saved, dout: np.ndarray, g: Params) -> np.ndarray:
        d = dout.reshape(len(dout), self.seq_len, self.vocab)  # (B, S, V)
        np.matmul(rows(s["h"]).T, rows(d), out=g["W"])  # (E, B*S) @ (B*S, V)
        np.sum(rows(d), axis=0, out=g["b"])
        dh = dot(d, p["W"].T)  # (B, S, V) @ (V, E) -> (B, S, E)
        dX = layer_norm_backward(dh, (s["xhat"], s["rstd"]), p["lnf_g"], (g["lnf_g"], g["lnf_b"]))
        return np.ascontiguousarray(self.seq.own(dX)).reshape(len(dout), -1)  # every rank: all

    def cache_bytes(self, rows: int) -> int:
        return 4 * rows * (2 * self.seq_len * self.whole_shapes["W"][0] + self.seq_len)


class SequenceCrossEntropy:
    """Mean cross-entropy over every position (of this cp rank) of every row: logits (B, S*V),
    targets (B, S)."""

    def __init__(self, vocab_size: int, ctx: ContextSplit) -> None:
        self.vocab, self.ctx = vocab_size, ctx

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, tuple]:
        probs = softmax(logits.reshape(-1, self.vocab))  # (B*S, V)
        flat = targets.reshape(-1)
        picked = probs[np.arange(len(flat)), flat].astype(np.float64)
        return float(-np.mean(np.log(picked))), (probs, flat, targets.shape)

    def backward(self, cache: tuple, rows: int | None = None) -> np.ndarray:
        """(probs - onehot) / (B*S), in place; rows: the step's rows B when it has more than
        these (gradient accumulation), each with S positions."""
        dlogits, flat, (B, S) = cache
        dlogits[np.arange(len(flat)), flat] -= 1
        dlogits /= (rows or B) * S
        return dlogits.reshape(B, S * self.vocab)

    def next_token_logits(self, logits: np.ndarray) -> np.ndarray:
        """The last position's logits (rows, V): the token after the whole context."""
        return self.ctx.at_last_position(logits.reshape(len(logits), -1, self.vocab))


class GPT(Model):
    """emb -> L transformer blocks -> head; tp: the tensor-parallel ranks' Comm (None: one);
    sequence_parallel: split along the sequence what tp replicates; cp: the context-parallel
    ranks' Comm (None: one), each holding the positions `cp_layout` gives it."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Comm | None = None,
        sequence_parallel: bool = False,
        cp: Comm | None = None,
        cp_layout: str = "zigzag",
    ) -> None:
        config.validate()
        c = self.config = config
        self.context = ctx = ContextSplit(cp, cp_layout, c.seq_len)
        seq = SequenceSplit(tp, sequence_parallel, ctx.local)
        self.layers: list[Layer] = [TokenPositionEmbedding("emb", c, seq, ctx)]
        self.layers += [Block(f"h{i}", c, tp, seq, ctx) for i in range(c.layers)]
        self.layers.append(Head("head", c, seq, ctx))
        self.blocks = [[layer] for layer in self.layers]  # each layer is its own block
        self.loss = SequenceCrossEntropy(c.vocab_size, ctx)

    def targets(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """Every position's next token (the context shifted by one, then the row's next), at
        this rank's positions: (B, S/C)."""
        following = np.concatenate([X[:, 1:], Y.reshape(-1, 1)], axis=1)  # (B, S)
        return following[:, self.context.positions].astype(np.int64)
