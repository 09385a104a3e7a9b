"""Counter-based random numbers (uniform floats, a pure function of ``(seed, index, stream)``) and a content digest.

Seeding a generator per index costs tens of microseconds, so a million lengths would take seconds;
hashing the index with splitmix64 gives the same per-index determinism, vectorised over numpy arrays,
and independent of the order (or process) in which indices are read.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["content_digest", "hashed_uniform", "sampled_indices"]

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


def sampled_indices(num_samples: int, count: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct sample indices spread over ``range(num_samples)``, a pure function of its arguments.

    The first and the last sample, and the rest drawn with :func:`hashed_uniform` (stream 7).

    Example:
        >>> sampled_indices(1000, 4).tolist() == sampled_indices(1000, 4).tolist()
        True
        >>> sampled_indices(3, 8).tolist()
        [0, 1, 2]
    """
    if num_samples <= count:
        return np.arange(num_samples)
    drawn = np.floor(hashed_uniform(seed, np.arange(4 * count, dtype=np.uint64), 7) * num_samples).astype(np.int64)
    candidates = np.concatenate(([0, num_samples - 1], drawn))
    _, first = np.unique(candidates, return_index=True)
    return np.sort(candidates[np.sort(first)][:count])


def content_digest(
    dataset: object, count: int, seed: int = 0, *, read: Callable[[Any, int], Mapping[str, Any]] | None = None
) -> str:
    """A short SHA-256 of the tokens (``input_ids``, and ``labels``/``loss_mask`` when present) of ``count`` samples.

    Ranks that read different data with the same lengths (another file version, tokenizer or preprocessing)
    get different digests; reading ``count`` samples is all it costs.

    Args:
        dataset: a map-style dataset of mappings with ``input_ids``.
        count: samples to read (:func:`sampled_indices`).
        seed: picks the samples.
        read: ``(dataset, index) -> sample`` (default ``dataset[index]``; the data layer passes one whose errors name
            the index).

    Example:
        >>> data = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
        >>> content_digest(data, 2) == content_digest([dict(s) for s in data], 2)
        True
        >>> content_digest(data, 2) == content_digest([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 6]}], 2)
        False
    """
    digest = hashlib.sha256(f"content|{count}|{seed}".encode())
    for i in sampled_indices(len(dataset), count, seed).tolist():
        sample = dataset[i] if read is None else read(dataset, i)  # type: ignore[index]
        digest.update(f"|{i}".encode())
        for key in ("input_ids", "labels", "loss_mask"):
            if sample.get(key) is not None:
                digest.update(key.encode() + np.asarray(sample[key]).astype(np.int64).tobytes())
    return digest.hexdigest()[:16]
