"""Counter-based random numbers: uniform floats that are a pure function of ``(seed, index, stream)``.

Seeding a generator per index costs tens of microseconds, so a million lengths would take seconds;
hashing the index with splitmix64 gives the same per-index determinism, vectorised over numpy arrays,
and independent of the order (or process) in which indices are read.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["hashed_uniform"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hashed_uniform(seed: int, indices: np.ndarray, stream: int) -> np.ndarray:
    """Uniform floats in (0, 1), a pure function of ``(seed, index, stream)`` (splitmix64), vectorised.

    Example:
        >>> u = hashed_uniform(0, np.arange(3, dtype=np.uint64), 1)
        >>> bool(((u > 0) & (u < 1)).all()), bool((u == hashed_uniform(0, np.arange(3, dtype=np.uint64), 1)).all())
        (True, True)
    """
    key = _stream_key(seed, stream)
    bits = _splitmix64(np.asarray(indices, dtype=np.uint64) * _GOLDEN ^ key)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(2**53)


@functools.lru_cache(maxsize=64)
def _stream_key(seed: int, stream: int) -> np.ndarray:
    key = _splitmix64(np.array([seed], dtype=np.uint64) * _GOLDEN + np.uint64(stream))
    key.flags.writeable = False
    return key


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
