"""The notebooks' checks: compare arrays, check an exercise's answer, check a claim of the prose.

    compare("fc1.W", a, b)            fc1.W      equal within 1e-06 | bit-identical | DIFFERS ...
    check("n_rows", answer, expected) ✓ n_rows: correct | ✗ n_rows: item 2 too small — hint
    claim("zero3 < zero2", z3 < z2)   ✓ zero3 < zero2 | ✗ claim does not hold: zero3 < zero2
    model_vector(params)              {layer: {key: array}} -> one vector, to compare models

Each prints one line whose text is the same on every machine: a verdict against the tolerance,
never the rounding residue itself (its last digits depend on the CPU's BLAS kernels; `residue`
gives it to a cell whose output nbval ignores). A wrong answer is described (where, and how:
"too large by a factor of 4", "one too few", "the sign") without the expected value, so the
checkers can grade. In the teacher's notebooks (STRICT, the default) a failure raises
CheckFailed after its line, so `make run` and nbval fail the moment package and prose part
ways; a student copy sets STRICT = False (tools/student.py), and a wrong or missing answer
prints ✗ and the notebook goes on. An exercise's placeholder (None or ..., also inside a list,
tuple or dict: what a student copy's stubs return) prints NOT_SOLVED.
"""

from __future__ import annotations

import numpy as np

NAME_WIDTH = 10  # compare's names are padded to this width so that the verdicts line up
NOT_SOLVED = "not solved yet"  # what the checkers print for a placeholder answer
STRICT = True  # a failed check raises (teacher's notebooks); student copies set False


class CheckFailed(AssertionError):
    """A check in a teacher's notebook failed: the solution or the prose no longer holds."""


def fail(line: str) -> bool:
    """Print the failure's line; raise in STRICT mode, else return False (the notebook goes on)."""
    print(line)
    if STRICT:
        raise CheckFailed(line.lstrip("✗ "))
    return False


def residue(a, b) -> float:
    """The largest absolute difference between a and b, for cells whose output nbval ignores."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b), initial=0.0))


def compare(name: str, a, b, atol: float = 1e-6, exact: bool = False, expect: bool = True) -> bool:
    """Print `name equal within ATOL` (or, with exact, `name bit-identical`; integer arrays:
    `name identical`) when a and b have the same shape and agree, else `name DIFFERS ...`;
    return whether they agree.

    a is the one under test: a placeholder there prints `name not solved yet`. A difference
    fails (raises when STRICT) unless expect=False: a cell that shows a wrong result on purpose.
    """
    label = f"{name:<{NAME_WIDTH}}"
    if not_solved(a):
        return fail(f"{label} {NOT_SOLVED}")
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        line = f"{label} DIFFERS: shape {a.shape} vs {b.shape}"
    elif exact or (a.dtype.kind in "biu" and b.dtype.kind in "biu"):  # integers: all or nothing
        word = "bit-identical" if a.dtype.kind == "f" or b.dtype.kind == "f" else "identical"
        if np.array_equal(a, b):
            print(f"{label} {word}")
            return True
        line = f"{label} DIFFERS: not {word}"
    else:
        if residue(a, b) <= atol:  # False for nan
            print(f"{label} equal within {atol:.0e}")
            return True
        line = f"{label} DIFFERS by more than {atol:.0e}"
    if expect:
        return fail(line)
    print(line)
    return False


def model_vector(params: dict) -> np.ndarray:
    """All of a model's parameters (or gradients), {layer: {key: array}}, as one vector in a
    fixed order: by layer name, then key (not dict order: dicts pulled from the engines come
    back with their keys sorted), so that two models compare with one `compare`."""
    return np.concatenate(
        [np.ravel(params[layer][key]) for layer in sorted(params) for key in sorted(params[layer])]
    )


def claim(text: str, condition) -> None:
    """A sentence of the prose, checked beside it: prints `✓ text`, or fails (raises when
    STRICT). Returns nothing, so a cell that ends with a claim shows only its line."""
    if bool(condition):
        print(f"✓ {text}")
    else:
        fail(f"✗ claim does not hold: {text}")


def not_solved(answer) -> bool:
    """True for an exercise's placeholder: None or ..., or a list, tuple or dict holding one."""
    if answer is None or answer is Ellipsis:
        return True
    if isinstance(answer, dict):
        answer = list(answer.values())
    if isinstance(answer, (list, tuple)):
        return any(not_solved(item) for item in answer)
    return False


def _equal(answer, expected, atol: float | None) -> bool:
    try:
        a, e = np.asarray(answer), np.asarray(expected)
        if a.shape != e.shape:
            return False
        if atol is None:
            return bool(np.array_equal(a, e))
        return bool(np.allclose(a, e, rtol=0, atol=atol))
    except (TypeError, ValueError):  # answers numpy cannot compare: compare them as objects
        try:
            return bool(answer == expected)
        except Exception:
            return False


def how_wrong(answer, expected, atol: float | None = None) -> str:
    """Where and how an answer differs from the expected one, without saying what it is.

    'item 2: too large by a factor of 4', 'one too few', 'the sign is wrong', 'shape (4, 5),
    not the expected 2-D shape', '3 values where 4 are expected', ...
    """
    if isinstance(answer, dict) and isinstance(expected, dict):
        if set(answer) != set(expected):
            return f"keys {sorted(map(str, answer))}, not the expected {len(expected)} keys"
        for key in expected:
            if not _equal(answer[key], expected[key], atol):
                return f"{key}: {how_wrong(answer[key], expected[key], atol)}"
    try:
        a, e = np.asarray(answer), np.asarray(expected)
        numeric = a.dtype.kind in "biuf" and e.dtype.kind in "biuf"
    except (TypeError, ValueError):
        return f"{_show(answer)} is not it"
    if a.shape != e.shape:
        if a.ndim == e.ndim == 1:
            return f"{a.size} values where {e.size} are expected"
        return f"shape {a.shape}, where a {e.ndim}-D shape of {e.size} elements is expected"
    if not numeric:
        return f"{_show(answer)} is not it" if a.ndim == 0 else _first_item(a, e, atol)
    if a.ndim > 0:
        return _first_item(a, e, atol)
    return _scalar_how(float(a), float(e))


def _first_item(a: np.ndarray, e: np.ndarray, atol: float | None) -> str:
    """The first item that differs (index, how), and how many more do."""
    pairs = list(zip(a.reshape(-1), e.reshape(-1), strict=True))
    wrong = [i for i, (x, y) in enumerate(pairs) if not _equal(x, y, atol)]
    if not wrong:
        return "differs"
    i = wrong[0]
    where = tuple(int(k) for k in np.unravel_index(i, a.shape)) if a.ndim > 1 else i
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return f"item {where}: {how_wrong(pairs[i][0].item(), pairs[i][1].item(), atol)}{more}"


def _scalar_how(a: float, e: float) -> str:
    """How a number differs from the expected one, in words that do not give it away."""
    if not np.isfinite(a):
        return f"{a:g}, which is not it"
    if not np.isfinite(e):  # an expected infinity: only the direction can be told
        return "too large" if a > e else "too small"
    if e != 0 and a == -e:
        return "the sign is wrong"
    if abs(a - e) == 1:
        return f"one too {'many' if a > e else 'few'}"
    if e != 0 and a != 0 and np.sign(a) == np.sign(e):
        ratio = a / e if abs(a) > abs(e) else e / a
        factor = round(ratio)
        if factor >= 2 and abs(ratio - factor) < 1e-9 * factor:
            return f"too {'large' if abs(a) > abs(e) else 'small'} by a factor of {factor}"
    return "too large" if a > e else "too small"


def _show(value) -> str:
    """A short, address-free text for an answer: lists for arrays, plain numbers for scalars."""
    if isinstance(value, np.ndarray) and value.size > 12:
        return f"an array of shape {value.shape}"
    if hasattr(value, "tolist"):  # numpy arrays and scalars: no 'np.int64(5)' or 'array(...)'
        value = value.tolist()
    if isinstance(value, float):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check(name: str, answer, expected, hint: str = "", atol: float | None = None) -> bool:
    """Print `✓ name: correct`, or `✗ name: ` where and how the answer is wrong, and the hint.

    An answer still None or ... (the exercise's placeholder) prints `✗ name: not solved yet`
    and nothing more: a hint is for a wrong answer, never a stub's (it might solve it).
    Arrays compare elementwise (within atol if given). The expected value is never printed.
    """
    tail = f" — {hint}" if hint else ""
    if not_solved(answer):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    if _equal(answer, expected, atol):
        print(f"✓ {name}: correct")
        return True
    return fail(f"✗ {name}: {how_wrong(answer, expected, atol)}{tail}")


def check_bytes(name: str, cases: dict, categories=("params", "grads", "optimizer")) -> bool:
    """Compare answers with ledgers: cases maps a configuration to (answer, [ledger per rank]).

    Prints `✓ name: correct` or, for each wrong category, which configuration, rank and
    category differs and how (never the ledger's figure); a placeholder prints NOT_SOLVED.
    """
    if any(not_solved(answer) for answer, _ in cases.values()):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    wrong = [
        f"  {config} rank {r} {category}: {how_wrong(answer.get(category), ledger[category])}"
        for config, (answer, ledgers) in cases.items()
        for r, ledger in enumerate(ledgers)
        for category in categories
        if answer.get(category) != ledger[category]
    ]
    if wrong:
        print(f"✗ {name}: {len(wrong)} of the ledger's figures differ", *wrong[:7], sep="\n")
        return fail(f"  ({name}: see the lines above)")
    print(f"✓ {name}: correct — every category of every rank's ledger")
    return True
