"""compare and check: one deterministic line each, a bool back, never an exception."""

import numpy as np

from fsdp_lesson.checks import check, compare, not_solved


def test_compare_exact(capsys):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert compare("fc1.W", a, a.copy()) is True
    assert capsys.readouterr().out == "fc1.W      exact\n"


def test_compare_approx_prints_one_significant_digit(capsys):
    a = np.zeros(4)
    assert compare("fc1.b", a, a + 3.1e-8) is True
    assert capsys.readouterr().out == "fc1.b      approx  max diff 3e-08\n"


def test_compare_differs_beyond_atol(capsys):
    a = np.ones((3, 3), dtype=np.float32)
    b = a.copy()
    b[1, 2] += 0.2
    assert compare("emb.W", a, b, atol=1e-3) is False
    assert capsys.readouterr().out == "emb.W      DIFFERS max diff 2e-01\n"


def test_compare_mixed_dtypes_and_lists(capsys):
    assert compare("loss", [1.0, 2.0], np.array([1.0, 2.0], dtype=np.float32)) is True
    assert capsys.readouterr().out == "loss       exact\n"


def test_compare_shape_mismatch(capsys):
    assert compare("Y", np.zeros(3), np.zeros(4)) is False
    assert capsys.readouterr().out == "Y          DIFFERS shape (3,) vs (4,)\n"


def test_compare_nan_differs(capsys):
    assert compare("x", np.array([np.nan]), np.array([0.0])) is False
    assert capsys.readouterr().out == "x          DIFFERS max diff nan\n"


def test_compare_long_name_keeps_a_space(capsys):
    compare("a_rather_long_name", 1, 1)
    assert capsys.readouterr().out == "a_rather_long_name exact\n"


def test_compare_placeholder_is_not_solved(capsys):
    assert compare("fc1.W", None, np.zeros(3)) is False
    assert compare("grads", [np.zeros(3), None], [np.zeros(3), np.zeros(3)]) is False
    assert capsys.readouterr().out.splitlines() == [
        "fc1.W      not solved yet",
        "grads      not solved yet",
    ]


def test_not_solved_is_what_the_stubs_leave():
    assert not_solved(None) and not_solved(...) and not_solved((None, None))
    assert not_solved([np.zeros(2), None]) and not_solved({"a": 1, "b": None})
    assert not not_solved(0) and not not_solved([]) and not not_solved(np.zeros(2))


def test_compare_output_is_the_same_twice(capsys):
    a, b = np.linspace(0, 1, 50), np.linspace(0, 1, 50) + 1.23456e-9
    compare("w", a, b)
    compare("w", a, b)
    first, second = capsys.readouterr().out.splitlines()
    assert first == second == "w          approx  max diff 1e-09"


def test_check_correct(capsys):
    assert check("n_rows", [2, 5, 16], np.array([2, 5, 16])) is True
    assert capsys.readouterr().out == "✓ n_rows: correct\n"


def test_check_wrong_answer_prints_cross_and_returns_false(capsys):
    assert check("n_rows", [1, 4, 15], [2, 5, 16], hint="count the boundary token") is False
    out = capsys.readouterr().out
    assert out == "✗ n_rows: expected [2, 5, 16], got [1, 4, 15] — count the boundary token\n"


def test_check_wrong_scalar_without_hint(capsys):
    assert check("params", np.int64(18634), 18635) is False
    assert capsys.readouterr().out == "✗ params: expected 18635, got 18634\n"


def test_check_placeholder_is_not_solved_and_hides_the_answer(capsys):
    assert check("rows", None, [2, 10, 18, 26], hint="b % N == rank") is False
    assert check("rows", [None, None], [2, 5]) is False
    assert check("rows", ..., 3) is False
    assert check("shards", {"fc1": (3, None)}, {"fc1": (3, 1)}) is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "✗ rows: not solved yet — b % N == rank",
        "✗ rows: not solved yet",
        "✗ rows: not solved yet",
        "✗ shards: not solved yet",
    ]
    assert "26" not in "".join(out)


def test_check_wrong_shape_and_big_arrays(capsys):
    assert check("relu", np.zeros((4, 5)), np.zeros((5, 4))) is False
    assert check("relu", np.ones((4, 5)), np.zeros((4, 5))) is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "✗ relu: expected an array of shape (5, 4), got an array of shape (4, 5)",
        "✗ relu: expected an array of shape (4, 5), got an array of shape (4, 5)",
    ]


def test_check_with_tolerance(capsys):
    assert check("loss", 3.29584, np.log(27), atol=1e-4) is True
    assert check("loss", 3.2, np.log(27), atol=1e-4) is False
    out = capsys.readouterr().out.splitlines()
    assert out == ["✓ loss: correct", "✗ loss: expected 3.29584, got 3.2"]


def test_check_never_raises_on_odd_answers(capsys):
    assert check("rows", "two", [2, 10]) is False
    assert check("rows", {"a": 1}, [2, 10]) is False
    assert check("rows", [[1, 2], [3]], [2, 10]) is False  # ragged: numpy refuses, still False
    assert capsys.readouterr().out.count("✗") == 3


def test_verdict_names_the_rank_and_what_differs(capsys):
    from fsdp_lesson.checks import verdict

    right = [[("shard", np.ones(3), np.ones(3))] for _ in range(2)]
    assert verdict("x", right, "hint")
    assert "✓ x: correct on all 2 ranks" in capsys.readouterr().out
    wrong = right[:1] + [[("shard", np.zeros(3), np.ones(3))]]
    assert not verdict("x", wrong, "look again")
    assert "rank 1, shard: max difference 1.0e+00 — look again" in capsys.readouterr().out
    assert not verdict("x", [[("shard", np.ones(2), np.ones(3))]], "h")
    assert "shape (2,), expected (3,)" in capsys.readouterr().out
    assert not verdict("x", [[("shard", None, np.ones(3))]], "h")
    assert "not solved yet" in capsys.readouterr().out


def test_check_bytes_names_the_configuration_rank_category_and_difference(capsys):
    from fsdp_lesson.checks import NOT_SOLVED, check_bytes

    ledger = dict(params=100, grads=100, optimizer=600)
    assert check_bytes("bytes", {"bf16": (dict(ledger), [ledger] * 2)})
    assert capsys.readouterr().out == "✓ bytes: correct — every category of every rank's ledger\n"
    assert not check_bytes("bytes", {"bf16": (dict(ledger, optimizer=400), [ledger] * 2)})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✗ bytes: 2 of the ledger's figures differ"
    assert out[1] == "  bf16 rank 0 optimizer: yours 400, the ledger 600 (200 bytes too few)"
    assert not check_bytes("bytes", {"bf16": (None, [ledger])})
    assert capsys.readouterr().out == f"✗ bytes: {NOT_SOLVED}\n"
