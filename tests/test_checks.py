"""The notebooks' checks: one line each whose text is the same on every machine; a failure
raises in a teacher's notebook (STRICT) and prints ✗ in a student's copy; the expected value
of an exercise is never printed."""

import numpy as np
import pytest

from fsdp_lesson import checks
from fsdp_lesson.checks import CheckFailed, check, claim, compare, not_solved, residue


@pytest.fixture
def student(monkeypatch):
    """A student copy's mode: a failure prints ✗ and returns False."""
    monkeypatch.setattr(checks, "STRICT", False)


def test_compare_equal_prints_the_tolerance_not_the_residue(capsys):
    a = np.zeros(4)
    assert compare("fc1.b", a, a + 3.1e-8) is True
    assert compare("fc1.b", a, a + 7.9e-8, atol=1e-5) is True
    assert compare("fc1.b", a, a.copy()) is True
    assert capsys.readouterr().out.splitlines() == [
        "fc1.b      equal within 1e-06",
        "fc1.b      equal within 1e-05",
        "fc1.b      equal within 1e-06",  # bit-identical or not: the same line on any CPU
    ]


def test_compare_exact_asks_for_bit_identity(capsys, student):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert compare("fc1.W", a, a.copy(), exact=True) is True
    assert compare("fc1.W", a, a + np.float32(1e-6), exact=True) is False
    assert capsys.readouterr().out.splitlines() == [
        "fc1.W      bit-identical",
        "fc1.W      DIFFERS: not bit-identical",
    ]


def test_compare_integers_are_identical_or_not(capsys, student):
    tokens = np.arange(6, dtype=np.uint8)
    assert compare("X", tokens, tokens.astype(np.int64)) is True
    assert compare("X", tokens, tokens + 1) is False
    assert capsys.readouterr().out.splitlines() == [
        "X          identical",
        "X          DIFFERS: not identical",
    ]


def test_compare_differs_raises_in_a_teachers_notebook(capsys):
    a = np.ones((3, 3), dtype=np.float32)
    with pytest.raises(CheckFailed, match="emb.W +DIFFERS by more than 1e-03"):
        compare("emb.W", a, a + 0.2, atol=1e-3)
    assert capsys.readouterr().out == "emb.W      DIFFERS by more than 1e-03\n"


def test_compare_expect_false_shows_a_wrong_result_on_purpose(capsys):
    assert compare("emb.W (+=)", np.zeros(2), np.ones(2), expect=False) is False
    assert capsys.readouterr().out == "emb.W (+=) DIFFERS by more than 1e-06\n"


def test_compare_mixed_dtypes_shapes_nan_and_long_names(capsys, student):
    assert compare("loss", [1.0, 2.0], np.array([1.0, 2.0], dtype=np.float32)) is True
    assert compare("Y", np.zeros(3), np.zeros(4)) is False
    assert compare("x", np.array([np.nan]), np.array([0.0])) is False
    compare("a_rather_long_name", 1, 1)
    assert capsys.readouterr().out.splitlines() == [
        "loss       equal within 1e-06",
        "Y          DIFFERS: shape (3,) vs (4,)",
        "x          DIFFERS by more than 1e-06",
        "a_rather_long_name identical",
    ]


def test_compare_placeholder_is_not_solved(capsys, student):
    assert compare("fc1.W", None, np.zeros(3)) is False
    assert compare("grads", [np.zeros(3), None], [np.zeros(3), np.zeros(3)]) is False
    assert capsys.readouterr().out.splitlines() == [
        "fc1.W      not solved yet",
        "grads      not solved yet",
    ]


def test_residue_is_the_largest_absolute_difference():
    assert residue([1.0, 2.0], [1.0, 2.5]) == 0.5
    assert residue(np.zeros((2, 2), np.float32), np.zeros((2, 2))) == 0.0


def test_not_solved_is_what_the_stubs_leave():
    assert not_solved(None) and not_solved(...) and not_solved((None, None))
    assert not_solved([np.zeros(2), None]) and not_solved({"a": 1, "b": None})
    assert not not_solved(0) and not not_solved([]) and not not_solved(np.zeros(2))


def test_claim_prints_the_sentence_or_raises(capsys):
    assert claim("zero3 needs less than zero2", 2 < 3) is None  # a cell's last line shows no True
    assert capsys.readouterr().out == "✓ zero3 needs less than zero2\n"
    with pytest.raises(CheckFailed, match="claim does not hold: zero3 wins"):
        claim("zero3 wins", False)


def test_claim_in_a_student_copy_goes_on(capsys, student):
    claim("zero3 wins", np.bool_(False))
    assert capsys.readouterr().out == "✗ claim does not hold: zero3 wins\n"


def test_check_correct(capsys):
    assert check("n_rows", [2, 5, 16], np.array([2, 5, 16])) is True
    assert capsys.readouterr().out == "✓ n_rows: correct\n"


def test_check_wrong_answer_says_where_and_how_never_the_expected_value(capsys, student):
    assert check("n_rows", [2, 4, 16], [2, 5, 16], hint="count the boundary token") is False
    assert check("params", np.int64(18634), 18635) is False
    assert check("bytes", 4 * 74_540, 74_540) is False
    assert check("bytes", 18_635, 4 * 18_635) is False
    assert check("mean", -0.25, 0.25) is False
    assert check("loss", 3.2, np.log(27), atol=1e-4) is False
    assert check("shard", {"fc1": 3, "fc2": 7}, {"fc1": 3, "fc2": 9}) is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "✗ n_rows: item 1: one too few — count the boundary token",
        "✗ params: one too few",
        "✗ bytes: too large by a factor of 4",
        "✗ bytes: too small by a factor of 4",
        "✗ mean: the sign is wrong",
        "✗ loss: too small",
        "✗ shard: fc2: too small",
    ]
    for expected in ("5", "18635", "74540", "298160", "0.25", "3.29", "9"):
        assert not any(expected in line.split(":", 1)[1] for line in out[1:]), expected


def test_check_describes_infinities_and_nan(capsys, student):
    assert check("n", 5, np.inf) is False and check("n", np.inf, 5) is False
    assert check("n", np.nan, 5) is False
    assert capsys.readouterr().out.splitlines() == [
        "✗ n: too small",
        "✗ n: inf, which is not it",
        "✗ n: nan, which is not it",
    ]


def test_check_raises_in_a_teachers_notebook(capsys):
    with pytest.raises(CheckFailed, match="n_rows: item 2: too large"):
        check("n_rows", [2, 5, 20], [2, 5, 16])
    assert capsys.readouterr().out.startswith("✗ n_rows: item 2: too large")


def test_check_placeholder_is_not_solved_and_hides_the_answer(capsys, student):
    assert check("rows", None, [2, 10, 18, 26], hint="b % N == rank") is False
    assert check("rows", [None, None], [2, 5]) is False
    assert check("rows", ..., 3) is False
    assert check("shards", {"fc1": (3, None)}, {"fc1": (3, 1)}) is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "✗ rows: not solved yet",  # no hint: it might solve it
        "✗ rows: not solved yet",
        "✗ rows: not solved yet",
        "✗ shards: not solved yet",
    ]
    assert "26" not in "".join(out) and "b % N" not in "".join(out)


def test_check_wrong_shape_and_big_arrays(capsys, student):
    assert check("relu", np.zeros((4, 5)), np.zeros((5, 4))) is False
    assert check("relu", np.ones((4, 5)), np.zeros((4, 5))) is False
    assert check("rows", [1, 2, 3], [1, 2, 3, 4]) is False
    assert capsys.readouterr().out.splitlines() == [
        "✗ relu: shape (4, 5), where a 2-D shape of 20 elements is expected",
        "✗ relu: item (0, 0): one too many (and 19 more)",
        "✗ rows: 3 values where 4 are expected",
    ]


def test_check_with_tolerance(capsys):
    assert check("loss", 3.29584, np.log(27), atol=1e-4) is True
    assert capsys.readouterr().out == "✓ loss: correct\n"


def test_check_never_raises_on_odd_answers_in_a_student_copy(capsys, student):
    assert check("rows", "two", [2, 10]) is False
    assert check("rows", {"a": 1}, [2, 10]) is False
    assert check("rows", [[1, 2], [3]], [2, 10]) is False  # ragged: numpy refuses, still False
    assert capsys.readouterr().out.count("✗") == 3


def test_check_bytes_names_the_configuration_rank_category_and_how(capsys, student):
    from fsdp_lesson.checks import NOT_SOLVED, check_bytes

    ledger = dict(params=100, grads=100, optimizer=600)
    assert check_bytes("bytes", {"bf16": (dict(ledger), [ledger] * 2)})
    assert capsys.readouterr().out == "✓ bytes: correct — every category of every rank's ledger\n"
    assert not check_bytes("bytes", {"bf16": (dict(ledger, optimizer=300), [ledger] * 2)})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "✗ bytes: 2 of the ledger's figures differ"
    assert out[1] == "  bf16 rank 0 optimizer: too small by a factor of 2"
    assert "600" not in "".join(out)
    assert not check_bytes("bytes", {"bf16": (None, [ledger])})
    assert capsys.readouterr().out == f"✗ bytes: {NOT_SOLVED}\n"
