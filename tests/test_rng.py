"""The glibc rand() emulation against the real libc, and the seeded streams."""

import ctypes
import ctypes.util

import numpy as np
import pytest

from fsdp_lesson.rng import RAND_MAX, CRng, GlibcRand, NumpyRng, make_rng

libc = ctypes.CDLL(ctypes.util.find_library("c"))


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1])
def test_glibc_rand_matches_libc(seed):
    libc.srand(ctypes.c_uint(seed))
    expected = np.array([libc.rand() for _ in range(100_000)], dtype=np.int64)
    assert np.array_equal(GlibcRand(seed).ints(100_000), expected)


def test_glibc_rand_continues_across_calls():
    one = GlibcRand(42).ints(1000)
    split = GlibcRand(42)
    assert np.array_equal(np.concatenate([split.ints(3), split.ints(997)]), one)


def test_c_uniform_is_float32_rand_over_rand_max():
    rand, rng = GlibcRand(7), CRng(7)
    u = rng.uniform(1000)
    assert u.dtype == np.float32
    expected = np.array([np.float32(r) / np.float32(RAND_MAX) for r in rand.ints(1000)])
    assert np.array_equal(u, expected)
    assert 0.0 <= u.min() and u.max() <= 1.0


def test_c_indices_are_rand_mod_n():
    assert np.array_equal(CRng(3).indices(193_287, 50), GlibcRand(3).ints(50) % 193_287)


@pytest.mark.parametrize("c_compat", [False, True])
def test_streams_are_deterministic(c_compat):
    a, b = make_rng(5, c_compat), make_rng(5, c_compat)
    assert np.array_equal(a.uniform(10), b.uniform(10))
    assert np.array_equal(a.indices(100, 10), b.indices(100, 10))
    assert not np.array_equal(make_rng(6, c_compat).uniform(10), make_rng(5, c_compat).uniform(10))


def test_numpy_rng_ranges():
    rng = NumpyRng(0)
    idx = rng.indices(27, 10_000)
    assert idx.min() == 0 and idx.max() == 26
    assert rng.uniform(5).dtype == np.float32
