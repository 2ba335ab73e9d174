"""Notebook 14's checkers: causal attention for one head (exercise 1) and the bytes of one
transformer block's parameter shard under zero3 (exercise 2).

Each computes the expected answer with the package (attention.attention; the block's own
shapes in a FlatParam) and names the usual mistake an answer makes (no mask, a mask off by one,
the softmax over the wrong axis, no 1/sqrt(d), masked scores of 0; a key bias, wo or a
LayerNorm's shift forgotten, no padding, elements for bytes)
without printing the expected value.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..attention import attention
from ..checks import NOT_SOLVED, fail, how_wrong, not_solved
from ..config import ModelConfig
from ..flat import FlatParam
from ..gpt import GPT

ATOL = 1e-6
# (T, D) of the inputs the attention is tried on: T != D, so a transposed product shows
ATTENTION_CASES = ((6, 4), (5, 9))


def _softmax(s: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(s - np.max(s, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _scores(
    q: np.ndarray, k: np.ndarray, scale: float, sees: int, masked: float = -np.inf
) -> np.ndarray:
    """q k^T * scale, `masked` (-inf) where key j comes more than `sees` places before ...
    after query i: a key j is seen when j <= i + sees (sees 0: causal)."""
    s = q @ k.T * scale
    T = len(q)
    s[np.arange(T)[None, :] > np.arange(T)[:, None] + sees] = masked
    return s


def attention_mistakes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """The outputs of the usual wrong attentions of one head, by what is wrong with them."""
    d = q.shape[-1]
    right = 1 / np.sqrt(d)
    with np.errstate(invalid="ignore"):  # a query that sees no key: nan, as a learner's would
        diagonal_masked = _softmax(_scores(q, k, right, -1), axis=-1) @ v
    reversed_scores = q @ k.T * right
    reversed_scores[np.tril_indices(len(q), -1)] = -np.inf  # the keys before each query hidden
    return {
        "no causal mask: every query sees the keys after it too": _softmax(q @ k.T * right, -1) @ v,
        "the mask is reversed: it hides the keys before each query and shows those after it": (
            _softmax(reversed_scores, -1) @ v
        ),
        "the mask is off by one: each query also sees the key just after it": (
            _softmax(_scores(q, k, right, 1), -1) @ v
        ),
        "the mask is off by one: a query does not see its own key": diagonal_masked,
        "the softmax is taken over the queries (axis 0): each query's weights must sum to 1"
        " over the keys": _softmax(_scores(q, k, right, 0), 0) @ v,
        "the scores are not scaled: divide q k^T by sqrt(d)": _softmax(_scores(q, k, 1.0, 0), -1)
        @ v,
        "the scores are divided by d: divide by sqrt(d)": _softmax(_scores(q, k, 1 / d, 0), -1) @ v,
        "the masked scores are 0, not -inf: exp(0) = 1 still gives every later key a weight;"
        " set them to -inf before the softmax": _softmax(_scores(q, k, right, 0, 0.0), -1) @ v,
        "the mask zeroes the weights after the softmax: mask the scores (with -inf) before it,"
        " so each row still sums to 1": (
            (_softmax(q @ k.T * right, -1) * np.tril(np.ones((len(q), len(k))))) @ v
        ),
    }


def attention_mistake(causal_attention: Callable, T: int, D: int, seed: int) -> str | None:
    """What is wrong with causal_attention on random (T, D) inputs, or None if it is right."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((T, D)) for _ in range(3))
    positions = np.arange(T)
    expected = attention(q[None, None], k[None, None], v[None, None], positions, positions)[0][0, 0]
    try:
        answer = causal_attention(q.copy(), k.copy(), v.copy())
    except Exception as err:
        return f"it raised {type(err).__name__}: {err}"
    if not_solved(answer):
        return NOT_SOLVED
    if isinstance(answer, tuple):
        return "it returned a tuple: return the output alone, an array of the queries' shape"
    answer = np.asarray(answer, dtype=np.float64)
    if answer.shape != expected.shape:
        return f"shape {answer.shape}: the output has one row per query, q's shape"
    if np.allclose(answer, expected, rtol=0, atol=ATOL):
        return None
    for what, wrong in attention_mistakes(q, k, v).items():
        if np.allclose(answer, wrong, rtol=0, atol=ATOL, equal_nan=True):
            return what
    if np.isnan(answer).any():
        row = int(np.argwhere(np.isnan(answer))[0][0])
        return f"query {row}'s output is nan: does every query see at least one key?"
    row = int(np.argwhere(~np.isclose(answer, expected, rtol=0, atol=ATOL))[0][0])
    return (
        f"query {row}'s output differs (and maybe others): scores, causal mask, softmax over"
        " the keys, weighted sum of the values"
    )


def check_causal_attention(causal_attention: Callable) -> bool:
    """Exercise 1: the learner's one-head causal attention against fsdp_lesson.attention's on
    random inputs of two shapes; names the mistake (or the first query that differs)."""
    for seed, (T, D) in enumerate(ATTENTION_CASES):
        mistake = attention_mistake(causal_attention, T, D, seed)
        if mistake == NOT_SOLVED:
            return fail(f"✗ causal_attention: {NOT_SOLVED}")
        if mistake is not None:
            return fail(f"✗ causal_attention (T={T}, d={D}): {mistake}")
    print(
        f"✓ causal_attention: correct — equal to fsdp_lesson.attention.attention within"
        f" {ATOL:.0e} on {len(ATTENTION_CASES)} random inputs"
    )
    return True


# (emb, hidden, N): the notebook's block at N = 4 and 3, and two where the padding shows
SHARD_CASES = ((16, 64, 4), (16, 64, 3), (24, 96, 7), (8, 12, 6))


def block_numel(emb: int, hidden: int) -> int:
    """The parameters of one transformer block (gpt.Block), from its own shapes."""
    block = GPT(ModelConfig(model="gpt", emb=emb, hidden=hidden, heads=1)).layers[1]
    return FlatParam(block.shapes).numel


def block_shard_bytes_of(emb: int, hidden: int, n: int) -> int:
    """What zero3 keeps of one block's parameters on a rank of N: its FlatParam's shard."""
    block = GPT(ModelConfig(model="gpt", emb=emb, hidden=hidden, heads=1)).layers[1]
    return 4 * FlatParam(block.shapes, n).shard_size


def shard_mistake(answer, emb: int, hidden: int, n: int) -> str | None:
    """How an answer for one (emb, hidden, N) is wrong, in words; None if it is right."""
    expected = block_shard_bytes_of(emb, hidden, n)
    numel = block_numel(emb, hidden)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return "return a number of bytes"
    if value == expected:
        return None
    per_rank = -(-numel // n)  # the padded shard, in elements
    known = {
        4 * numel / n: "no padding: the flat vector is padded to a multiple of N, so each rank"
        " holds a whole number of elements",
        4 * (numel // n): "rounded down: the padding makes the vector longer, so round up",
        per_rank: "elements, not bytes: a float32 is 4 bytes",
        2 * per_rank: "2 bytes an element: the block's parameters are float32, 4 bytes each",
        4 * per_rank * n: "the whole padded block: zero3 keeps 1/N of it on a rank",
        4 * numel: "the whole block: zero3 keeps 1/N of it on a rank",
        4 * -(-(numel + emb) // n): "one bias of emb too many: the keys have none",
        4 * -(-(numel - 4 * emb) // n): "the LayerNorms are missing: two of them, a gain and"
        " a shift of emb each",
        4 * -(-(numel - 2 * emb - hidden) // n): "the biases of the MLP and of the projection"
        " are missing",
        4 * -(-(numel - emb * emb) // n): "one of the attention's four emb × emb matrices is"
        " missing: q, k, v and the output projection wo",
        4 * -(-(numel - 2 * emb) // n): "each LayerNorm has a shift as well as a gain, emb each",
    }
    if value in known:
        return known[value]
    return how_wrong(value, expected)


def check_block_shard_bytes(block_shard_bytes: Callable) -> bool:
    """Exercise 2: the bytes of one block's parameter shard on a rank under zero3, for the
    notebook's block and three others, against the block's FlatParam."""
    answers = {case: block_shard_bytes(*case) for case in SHARD_CASES}
    if any(not_solved(answer) for answer in answers.values()):
        return fail(f"✗ block_shard_bytes: {NOT_SOLVED}")
    for (emb, hidden, n), answer in answers.items():
        mistake = shard_mistake(answer, emb, hidden, n)
        if mistake is not None:
            return fail(f"✗ block_shard_bytes(emb={emb}, hidden={hidden}, n={n}): {mistake}")
    print(f"✓ block_shard_bytes: correct — every one of the {len(SHARD_CASES)} blocks and N")
    return True
