"""Seeded random numbers: numpy's Generator by default, or an exact glibc rand() in c-compat mode.

Every rank builds the same Rng from the same seed and makes the same calls, so all ranks
initialise the same model and draw the same global batches without communicating.
"""

from __future__ import annotations

import numpy as np

RAND_MAX = 2**31 - 1


class GlibcRand:
    """glibc's default rand(): the TYPE_3 additive generator r[i] = r[i-31] + r[i-3] (mod 2^32)."""

    def __init__(self, seed: int) -> None:
        seed = int(np.uint32(seed).view(np.int32))  # srand takes an unsigned int, stores an int32
        words = [seed if seed != 0 else 1]  # srand(0) behaves as srand(1)
        for _ in range(30):  # the 16807 generator, Schrage's method, C truncating division
            prev = words[-1]
            hi, lo = int(prev / 127773), prev - int(prev / 127773) * 127773
            word = 16807 * lo - 2836 * hi
            words.append(word + 2147483647 if word < 0 else word)
        words += words[:3]  # r[31..33] = r[0..2]
        self._ring = [w & 0xFFFFFFFF for w in words[-31:]]  # the last 31 words, oldest first
        self._pos = 0  # index of r[i-31] in the ring
        self.ints(310)  # glibc discards the first 310 outputs

    def ints(self, n: int) -> np.ndarray:
        """The next n values of rand(), as int64."""
        ring, pos, out = self._ring, self._pos, np.empty(n, dtype=np.int64)
        for k in range(n):
            word = (ring[pos] + ring[(pos + 28) % 31]) & 0xFFFFFFFF  # r[i-31] + r[i-3]
            ring[pos] = word
            pos = (pos + 1) % 31
            out[k] = word >> 1
        self._pos = pos
        return out


class Rng:
    """The two draws the lesson needs: uniforms in [0, 1] (float32) and row indices."""

    def uniform(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def indices(self, high: int, n: int) -> np.ndarray:
        raise NotImplementedError

    def get_state(self) -> dict:
        """A JSON-able snapshot, for checkpoints: set_state(get_state()) replays the stream."""
        raise NotImplementedError

    def set_state(self, state: dict) -> None:
        raise NotImplementedError


class NumpyRng(Rng):
    """numpy's PCG64 Generator: the default, fast and statistically sound."""

    def __init__(self, seed: int) -> None:
        self.generator = np.random.default_rng(seed)

    def uniform(self, n: int) -> np.ndarray:
        return self.generator.random(n, dtype=np.float32)

    def indices(self, high: int, n: int) -> np.ndarray:
        return self.generator.integers(0, high, size=n)

    def get_state(self) -> dict:
        return self.generator.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.generator.bit_generator.state = state


class CRng(Rng):
    """The C program's draws: uniform() = (float)rand() / RAND_MAX, index = rand() % n."""

    def __init__(self, seed: int) -> None:
        self.rand = GlibcRand(seed)

    def uniform(self, n: int) -> np.ndarray:
        # float32 division; RAND_MAX rounds to 2^31 in float32, as in C
        return self.rand.ints(n).astype(np.float32) / np.float32(RAND_MAX)

    def indices(self, high: int, n: int) -> np.ndarray:
        return self.rand.ints(n) % high

    def get_state(self) -> dict:
        return {"glibc_ring": list(self.rand._ring), "glibc_pos": self.rand._pos}

    def set_state(self, state: dict) -> None:
        self.rand._ring, self.rand._pos = list(state["glibc_ring"]), state["glibc_pos"]


def make_rng(seed: int, c_compat: bool = False) -> Rng:
    """The run's one random stream: init, batches, validation and sampling draw from it in order."""
    return CRng(seed) if c_compat else NumpyRng(seed)
