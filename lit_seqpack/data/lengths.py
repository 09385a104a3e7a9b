"""Per-sample lengths and loss-token counts for the planner, with a fast path and an on-disk cache.

The planner needs, for every sample, its token count and its number of loss tokens (positions after
the first whose label is not -100; ``length - 1`` without labels). A dataset may offer both as
``lengths`` / ``loss_tokens`` array attributes (every dataset of this package does); otherwise the
dataset is read once. :func:`cached_lengths` stores the arrays in ``cache_dir`` under a digest of the
dataset's ``fingerprint`` (or an explicit ``key``), so the DataModule computes them once in
``prepare_data`` and every rank reads them back in ``setup``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack.data.labels import IGNORE_INDEX

__all__ = [
    "cache_path",
    "cached_lengths",
    "cached_lengths_and_loss_tokens",
    "cached_loss_tokens",
    "compute_lengths",
    "compute_lengths_and_loss_tokens",
    "compute_loss_tokens",
    "dataset_fingerprint",
    "sample_loss_tokens",
]

log = logging.getLogger(__name__)

_CACHE_VERSION = 1


def sample_loss_tokens(sample: Mapping[str, Any]) -> int:
    """Loss tokens of one sample: ``labels[1:] != -100`` (or ``loss_mask[1:] == 1``) counted, else ``length - 1``.

    Example:
        >>> sample_loss_tokens({"input_ids": [5, 6, 7, 8], "labels": [5, -100, 7, 8]})
        2
        >>> sample_loss_tokens({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]})
        2
        >>> sample_loss_tokens({"input_ids": [5, 6]})
        1
    """
    labels = sample.get("labels")
    if labels is not None:
        return int((np.asarray(labels)[1:] != IGNORE_INDEX).sum())
    mask = sample.get("loss_mask")  # the collators' alternative to labels: 1 = train on the token
    if mask is not None:
        return int((np.asarray(mask)[1:] != 0).sum())
    return max(len(sample["input_ids"]) - 1, 0)


def compute_lengths(dataset: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Token count of every sample (``int64``), from ``dataset.lengths`` when offered, else by reading it once."""
    fast = _fast_path(dataset, "lengths")
    return fast if fast is not None else _scan(dataset)[0]


def compute_loss_tokens(dataset: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Loss tokens of every sample, from ``dataset.loss_tokens`` when offered, else by reading it once."""
    fast = _fast_path(dataset, "loss_tokens")
    return fast if fast is not None else _scan(dataset)[1]


def compute_lengths_and_loss_tokens(dataset: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays, reading the dataset at most once (only for what has no fast path)."""
    lengths = _fast_path(dataset, "lengths")
    loss_tokens = _fast_path(dataset, "loss_tokens")
    if lengths is None or loss_tokens is None:
        scanned_lengths, scanned_loss = _scan(dataset)
        lengths = scanned_lengths if lengths is None else lengths
        loss_tokens = scanned_loss if loss_tokens is None else loss_tokens
    return lengths, loss_tokens


def dataset_fingerprint(dataset: object) -> str | None:
    """The dataset's ``fingerprint`` attribute (a stable identity of its content), or ``None``."""
    value = getattr(dataset, "fingerprint", None)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"dataset.fingerprint must be a str or None, got {type(value).__name__}")
    return value


def cache_path(dataset: Sequence[Any], cache_dir: str | os.PathLike[str], key: str | None = None) -> Path:
    """Where :func:`cached_lengths` keeps the arrays of ``dataset``: a digest of ``key`` (or the fingerprint) and size.

    Raises:
        ValueError: when ``key`` is ``None`` and the dataset has no ``fingerprint``.
    """
    identity = key if key is not None else dataset_fingerprint(dataset)
    if identity is None:
        raise ValueError(
            f"key=None but the dataset ({type(dataset).__name__}) has no 'fingerprint'; "
            "pass key=... naming its content (e.g. its path and version) to cache its lengths"
        )
    digest = hashlib.sha256(f"v{_CACHE_VERSION}|{identity}|n={len(dataset)}".encode()).hexdigest()[:32]
    return Path(cache_dir) / f"lengths-{digest}.npz"


def cached_lengths_and_loss_tokens(
    dataset: Sequence[Mapping[str, Any]], cache_dir: str | os.PathLike[str], key: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and loss tokens of ``dataset``, read from ``cache_dir`` or computed once and stored there.

    Args:
        dataset: a map-style dataset.
        cache_dir: the cache folder (created when missing).
        key: the identity of the dataset's content; defaults to ``dataset.fingerprint``. Change it
            whenever the content changes (the number of samples is part of the key anyway).
    """
    path = cache_path(dataset, cache_dir, key)
    cached = _load(path, len(dataset))
    if cached is not None:
        log.debug("lengths cache hit: %s", path)
        return cached
    lengths, loss_tokens = compute_lengths_and_loss_tokens(dataset)
    _save(path, lengths, loss_tokens)
    log.info("lengths of %d samples computed and cached in %s", len(lengths), path)
    return lengths, loss_tokens


def cached_lengths(
    dataset: Sequence[Mapping[str, Any]], cache_dir: str | os.PathLike[str], key: str | None = None
) -> np.ndarray:
    """The lengths part of :func:`cached_lengths_and_loss_tokens`."""
    return cached_lengths_and_loss_tokens(dataset, cache_dir, key)[0]


def cached_loss_tokens(
    dataset: Sequence[Mapping[str, Any]], cache_dir: str | os.PathLike[str], key: str | None = None
) -> np.ndarray:
    """The loss-token part of :func:`cached_lengths_and_loss_tokens`."""
    return cached_lengths_and_loss_tokens(dataset, cache_dir, key)[1]


def _fast_path(dataset: Sequence[Any], name: str) -> np.ndarray | None:
    value = getattr(dataset, name, None)
    if value is None or callable(value):
        return None
    array = np.array(value, dtype=np.int64)
    if array.shape != (len(dataset),):
        raise ValueError(f"dataset.{name} has shape {array.shape} but the dataset has {len(dataset)} samples")
    return array


def _scan(dataset: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    from lit_seqpack.data.sources import validate_record

    size = len(dataset)
    lengths = np.empty(size, dtype=np.int64)
    loss_tokens = np.empty(size, dtype=np.int64)
    for i in range(size):
        sample = dataset[i]
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise TypeError(f"dataset[{i}] must be a mapping with 'input_ids', got {type(sample).__name__}")
        validate_record(sample, f"dataset[{i}]")  # fail before training, naming the sample, not mid-epoch
        lengths[i] = len(sample["input_ids"])
        loss_tokens[i] = sample_loss_tokens(sample)
    return lengths, loss_tokens


def _load(path: Path, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            lengths, loss_tokens = stored["lengths"], stored["loss_tokens"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        log.warning("ignoring the unreadable lengths cache %s (%s); recomputing", path, err)
        return None
    if lengths.shape != (size,) or loss_tokens.shape != (size,):
        log.warning("ignoring the lengths cache %s: it holds %s entries, not %d", path, lengths.shape, size)
        return None
    return lengths.astype(np.int64), loss_tokens.astype(np.int64)


def _save(path: Path, lengths: np.ndarray, loss_tokens: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as handle:
        np.savez(handle, lengths=lengths, loss_tokens=loss_tokens)
    os.replace(partial, path)  # atomic: a concurrent reader sees the old file or the whole new one
