"""Two one-line checks the notebooks use: compare arrays, and check an exercise's answer.

    compare("fc1.W", a, b)            fc1.W      exact | approx  max diff 3e-08 | DIFFERS ...
    check("n_rows", answer, expected) ✓ n_rows: correct | ✗ n_rows: expected 5, got 4 — hint

Both print one line with deterministic text and return a bool; neither raises, so a wrong
answer in a notebook shows a ✗ and the notebook carries on. An exercise's placeholder (None or
..., also inside a list, tuple or dict: what a student copy's stubs return) prints NOT_SOLVED.
"""

from __future__ import annotations

import numpy as np

NAME_WIDTH = 10  # compare's names are padded to this width so that the verdicts line up
NOT_SOLVED = "not solved yet"  # what both print for a placeholder answer (tools/student.py's stubs)


def _diff_text(diff: float) -> str:
    """A difference with one significant digit ('3e-08'), so float noise rarely changes it."""
    return "nan" if np.isnan(diff) else f"{diff:.0e}"


def compare(name: str, a, b, atol: float = 1e-6) -> bool:
    """Print `name exact`, `name approx  max diff D` or `name DIFFERS max diff D`; True if
    a and b have the same shape and agree within atol (max absolute difference).

    a is the one under test: a placeholder there prints `name not solved yet`.
    """
    label = f"{name:<{NAME_WIDTH}}"
    if not_solved(a):
        print(f"{label} {NOT_SOLVED}")
        return False
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        print(f"{label} DIFFERS shape {a.shape} vs {b.shape}")
        return False
    if np.array_equal(a, b):
        print(f"{label} exact")
        return True
    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    if diff <= atol:  # False for nan
        print(f"{label} approx  max diff {_diff_text(diff)}")
        return True
    print(f"{label} DIFFERS max diff {_diff_text(diff)}")
    return False


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


def check(name: str, answer, expected, hint: str = "", atol: float | None = None) -> bool:
    """Print `✓ name: correct` or `✗ name: ...` with the hint; True when answer == expected.

    An answer still None or ... (the exercise's placeholder) prints `✗ name: not solved yet`
    without giving the expected value away. Arrays compare elementwise (within atol if given).
    """
    tail = f" — {hint}" if hint else ""
    if not_solved(answer):
        print(f"✗ {name}: {NOT_SOLVED}{tail}")
        return False
    if _equal(answer, expected, atol):
        print(f"✓ {name}: correct")
        return True
    print(f"✗ {name}: expected {_show(expected)}, got {_show(answer)}{tail}")
    return False


def verdict(name: str, per_rank: list, hint: str, atol: float = 1e-6) -> bool:
    """One line for an exercise checked on every rank: per_rank[r] lists (what, answer,
    expected) computed on rank r; the first shape or value that differs is named."""
    if any(not_solved(answer) for items in per_rank for _, answer, _ in items):
        print(f"✗ {name}: {NOT_SOLVED} — {hint}")
        return False
    for r, items in enumerate(per_rank):
        for what, answer, expected in items:
            answer, expected = np.asarray(answer), np.asarray(expected)
            if answer.shape != expected.shape:
                shapes = f"shape {answer.shape}, expected {expected.shape}"
                print(f"✗ {name}: rank {r}, {what}: {shapes}")
                return False
            diff = float(np.max(np.abs(answer - expected), initial=0.0))
            if not diff <= atol:
                print(f"✗ {name}: rank {r}, {what}: max difference {diff:.1e} — {hint}")
                return False
    print(f"✓ {name}: correct on all {len(per_rank)} ranks")
    return True


def check_bytes(name: str, cases: dict, categories=("params", "grads", "optimizer")) -> bool:
    """Compare answers with ledgers: cases maps a configuration to (answer, [ledger per rank]).

    Prints `✓ name: correct` or, for each wrong category, which configuration, rank and
    category differs and by how many bytes; a placeholder answer prints NOT_SOLVED.
    """
    if any(not_solved(answer) for answer, _ in cases.values()):
        print(f"✗ {name}: {NOT_SOLVED}")
        return False
    wrong = [
        f"  {config} rank {r} {category}: yours {answer.get(category)!r}, the ledger "
        f"{ledger[category]:,}" + _off_by(answer.get(category), ledger[category])
        for config, (answer, ledgers) in cases.items()
        for r, ledger in enumerate(ledgers)
        for category in categories
        if answer.get(category) != ledger[category]
    ]
    if wrong:
        print(f"✗ {name}: {len(wrong)} of the ledger's figures differ", *wrong[:8], sep="\n")
        return False
    print(f"✓ {name}: correct — every category of every rank's ledger")
    return True


def _off_by(yours, ledger: int) -> str:
    """' (N bytes too many/few)' when yours is a number, else nothing."""
    if not isinstance(yours, (int, float, np.integer, np.floating)):
        return ""
    diff = yours - ledger
    return f" ({abs(diff):,} bytes too {'many' if diff > 0 else 'few'})"
