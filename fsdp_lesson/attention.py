"""Causal attention of queries at some positions over keys at others, forward and backward.

    attention(q, k, v, q_pos, k_pos)                          -> (out, lse)
    attention_backward(q, k, v, out, lse, dout, q_pos, k_pos)  -> (dq, dk, dv)

q (B, H, Tq, D) and k, v (B, H, Tk, D) are one block of queries and one of keys; q_pos (Tq,) and
k_pos (Tk,) are their places in the sequence, and a query sees the keys at its place or before
(causal). A single rank passes every position to both; context parallelism (a rank holds a
slice of the sequence) passes its queries' positions and those of the keys it has been sent.

Besides the output, forward returns each query's log-sum-exp of its scores, `lse` (B, H, Tq):
all that two partial results over different keys need to be merged into the whole one
(`merge`, the online-softmax rule), and all that backward needs besides the inputs. Backward is
FlashAttention's: given the *final* out and lse, the gradients of one block of keys need that
block alone, so a ring of key blocks can compute them block by block.
"""

from __future__ import annotations

import numpy as np


def scores(q: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """q k^T / sqrt(D), -inf where a key comes after the query: (B, H, Tq, Tk)."""
    s = q @ k.swapaxes(-1, -2)  # (B, H, Tq, D) @ (B, H, D, Tk) -> (B, H, Tq, Tk)
    s *= np.float32(1 / np.sqrt(q.shape[-1]))
    s[..., k_pos[None, :] > q_pos[:, None]] = -np.inf
    return s


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """softmax(scores) @ v and each query's log-sum-exp; a query that sees no key here gets
    out 0 and lse -inf (it adds nothing when merged)."""
    s = scores(q, k, q_pos, k_pos)
    top = s.max(axis=-1, keepdims=True)  # (B, H, Tq, 1)
    top[np.isneginf(top)] = 0  # a row with every key masked: exp(-inf) = 0 below
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)  # (B, H, Tq, 1)
    out = p @ v  # (B, H, Tq, Tk) @ (B, H, Tk, D) -> (B, H, Tq, D)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total > 0, out / total, 0).astype(q.dtype)
        lse = (top + np.log(total))[..., 0]  # log(0) = -inf for a row that sees nothing
    return out, lse.astype(q.dtype)


def merge(
    out1: np.ndarray, lse1: np.ndarray, out2: np.ndarray, lse2: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Two attentions of the same queries over disjoint keys, merged into the one over both:
    each weighted by its share exp(lse_i - lse) of the whole softmax's denominator."""
    lse = np.logaddexp(lse1, lse2)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a query that sees no key in either
        w1 = np.nan_to_num(np.exp(lse1 - lse))[..., None]
        w2 = np.nan_to_num(np.exp(lse2 - lse))[..., None]
    return (w1 * out1 + w2 * out2).astype(out1.dtype), lse


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dout: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients of q, k and v through this block of keys, given the attention's final
    out and lse over all keys (so a block's share needs nothing from the others)."""
    s = scores(q, k, q_pos, k_pos)
    with np.errstate(invalid="ignore"):
        p = np.nan_to_num(np.exp(s - lse[..., None]))  # the final softmax's entries here
    dv = p.swapaxes(-1, -2) @ dout  # (B, H, Tk, Tq) @ (B, H, Tq, D) -> (B, H, Tk, D)
    dp = dout @ v.swapaxes(-1, -2)  # (B, H, Tq, D) @ (B, H, D, Tk) -> (B, H, Tq, Tk)
    delta = np.sum(dout * out, axis=-1, keepdims=True)  # (B, H, Tq, 1): sum_j p_j dp_j
    ds = p * (dp - delta)  # the softmax's backward
    ds *= np.float32(1 / np.sqrt(q.shape[-1]))
    dq = ds @ k  # (B, H, Tq, Tk) @ (B, H, Tk, D) -> (B, H, Tq, D)
    dk = ds.swapaxes(-1, -2) @ q  # (B, H, Tk, Tq) @ (B, H, Tq, D) -> (B, H, Tk, D)
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)
