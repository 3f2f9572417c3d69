"""Keyed pseudo-random permutations evaluated pointwise (torch-free: the exporter uses them
too). A Feistel network with cycle-walking maps ``[0, n)`` onto itself in O(1) memory, so a
10^9-row shuffle needs no 10^9-element array."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
_ROUNDS = 4


def _mix(values: npt.NDArray[np.uint64], key: np.uint64) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser of ``values + key`` (wrapping uint64 arithmetic)."""
    z = values + key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seed_sequence(*key: int) -> np.random.SeedSequence:
    """A SeedSequence of a key of ints of any sign, without collisions: non-negative keys give
    the entropy they always gave, and the signs of negative parts go into the spawn key (so
    seeds -1 and 1 differ)."""
    signs = sum(1 << i for i, k in enumerate(key) if k < 0)
    return np.random.SeedSequence([abs(int(k)) for k in key], spawn_key=(signs,) if signs else ())


def key_rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(seed_sequence(*key))


class RandomPermutation:
    """A keyed bijection of ``[0, n)`` evaluated pointwise in O(1) memory."""

    def __init__(self, n: int, *key: int) -> None:
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        state = seed_sequence(*key).generate_state(_ROUNDS, np.uint64)
        self.keys = [np.uint64(k) for k in state]

    def _feistel(self, v: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        half = np.uint64(self.half)
        left, right = v >> half, v & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << half) | right

    def __call__(self, positions: IntArray) -> IntArray:
        values = positions.astype(np.uint64)
        todo = np.ones(len(values), dtype=bool)
        while todo.any():  # cycle-walk until inside [0, n): expected < 4 rounds
            values[todo] = self._feistel(values[todo])
            todo = values >= np.uint64(self.n)
        return values.astype(np.int64)
