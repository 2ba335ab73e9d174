"""names.txt: validation with line numbers, the seed's rows and split, batches and rank slices."""

import os

import numpy as np
import pytest

from fsdp_lesson.data import (
    DEFAULT_PATH,
    NAMES_SHA256,
    DataError,
    Dataset,
    GlobalBatchSampler,
    build_names_file,
    build_rows,
    decode,
    encode,
    load_names,
    rank_slice,
    sha256_of,
)
from fsdp_lesson.rng import make_rng


def write(tmp_path, text: str, name="names.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_committed_names_file_is_the_lessons():
    names = load_names()
    assert sha256_of(DEFAULT_PATH) == NAMES_SHA256
    assert len(names) == 29_910
    assert max(map(len, names)) == 15
    assert names[:3] == ["emma", "liam", "olivia"]


def test_build_names_file_reproduces_the_hash(tmp_path):
    assert build_names_file(tmp_path / "names.txt") == NAMES_SHA256


def test_encode_decode_round_trip():
    assert encode("emma") == [5, 13, 13, 1]
    assert decode([5, 13, 13, 1, 0]) == "emma."


def test_rows_of_one_name_are_left_padded_longest_prefix_first():
    X, Y = build_rows(["ab"], seq_len=4)
    # "ab" -> tokens a b . -> 3 rows of 5 tokens: [0 0 a b | .], [0 0 0 a | b], [0 0 0 0 | a]
    assert X.tolist() == [[0, 0, 1, 2], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert Y.tolist() == [0, 2, 1]


def test_rows_follow_names_in_file_order():
    X, Y = build_rows(["b", "cd"], seq_len=3)
    assert X.tolist() == [[0, 0, 2], [0, 0, 0], [0, 3, 4], [0, 0, 3], [0, 0, 0]]
    assert Y.tolist() == [0, 2, 0, 4, 3]


def test_dataset_sizes_and_split():
    data = Dataset.load()
    assert len(data.X_train) + len(data.X_test) == 214_764
    assert len(data.X_train) == 193_287  # int(214764 * 0.9f)
    assert data.X_train.shape[1] == 16 and data.X_train.dtype == np.uint8
    assert decode(data.X_train[0]) == "............emma" and data.Y_train[0] == 0


def test_windows_line_endings_are_accepted(tmp_path):
    assert load_names(write(tmp_path, "emma\r\nnoah\r\n")) == ["emma", "noah"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("emma\nno ah\n", "line 2: 'no ah' contains ' '; only lowercase letters a-z"),
        ("emma\nNoah\n", "line 2: 'Noah' contains 'N'"),
        ("emma\n\nnoah\n", "line 2: blank line"),
        (
            "emma\n" + "a" * 16 + "\n",
            "line 2: 'aaaaaaaaaaaaaaaa' has 16 letters; the model reads at most 15",
        ),
        ("", "is empty"),
    ],
)
def test_bad_names_files_name_the_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(DataError) as err:
        load_names(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DataError, match="no such file.*data build"):
        load_names(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="is a directory"):
        load_names(tmp_path)


def test_global_batch_is_the_same_on_every_rank_and_slices_partition_it():
    data = Dataset.load()
    batches = [
        GlobalBatchSampler(data.X_train, data.Y_train, 32, make_rng(42)).next() for _ in range(4)
    ]
    X, Y = batches[0]
    assert all(np.array_equal(X, b[0]) and np.array_equal(Y, b[1]) for b in batches)
    slices = [rank_slice(np.arange(32), r, 4) for r in range(4)]
    assert slices[1].tolist() == [1, 5, 9, 13, 17, 21, 25, 29]
    assert sorted(np.concatenate(slices).tolist()) == list(range(32))


def test_c_compat_batch_uses_rand_mod_rows():
    data = Dataset.load()
    X, _ = GlobalBatchSampler(data.X_train, data.Y_train, 32, make_rng(42, c_compat=True)).next()
    rng = make_rng(42, c_compat=True)
    assert np.array_equal(X, data.X_train[rng.rand.ints(32) % len(data.X_train)])


def test_data_build_cli_writes_and_checks(tmp_path):
    from fsdp_lesson.__main__ import main

    path = tmp_path / "names.txt"
    assert main(["data", "build", "--path", os.fspath(path)]) == 0
    assert main(["data", "check", "--path", os.fspath(path)]) == 0
    path.write_text("emma\n")
    assert main(["data", "check", "--path", os.fspath(path)]) == 1
