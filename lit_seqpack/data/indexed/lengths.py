"""Per-sample lengths and loss-token counts for the planner, with a fast path and an on-disk cache.

The planner needs, for every sample, its token count and its number of loss tokens (positions after
the first whose label is not -100; ``length - 1`` without labels). A dataset may offer both as
``lengths`` / ``loss_tokens`` array attributes (every dataset of this package does); otherwise the
dataset is read once, and validated on the way (:func:`~lit_seqpack.data.scan_dataset`).

:func:`cached_lengths` stores the arrays of a dataset without both attributes in ``cache_dir`` under a digest
of its ``fingerprint`` (or an explicit ``key``) and the number of samples. A cache can never override arrays a
dataset offers; on load it is checked against the data (size, value ranges, identity, and the lengths and loss
tokens of a deterministic sample of 16 records), and recomputed with a warning when unreadable or inconsistent.
It is written atomically: a unique ``mkstemp`` file (``O_EXCL``, no symlink followed) in the cache folder,
fsynced, then ``os.replace``; the temporary file is removed on failure, and one a killed writer left is removed
by the next writer after an hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack.data.batching._samples import sample_loss_tokens
from lit_seqpack.data.indexed.splits import read_sample
from lit_seqpack.data.indexed.validation import DataScan, scan_dataset
from lit_seqpack.data.sources.base import declared_counts, declared_fingerprint

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

_CACHE_VERSION = 2


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
    return declared_fingerprint(dataset)


def cache_path(dataset: Sequence[Any], cache_dir: str | os.PathLike[str], key: str | None = None) -> Path:
    """Where :func:`cached_lengths` keeps the arrays of ``dataset``: a digest of ``key`` (or the fingerprint) and size.

    Raises:
        ValueError: when ``key`` is ``None`` and the dataset has no ``fingerprint``.
    """
    digest = hashlib.sha256(_identity(dataset, key).encode()).hexdigest()[:32]
    return Path(cache_dir) / f"lengths-{digest}.npz"


def _identity(dataset: Sequence[Any], key: str | None) -> str:
    identity = key if key is not None else dataset_fingerprint(dataset)
    if identity is None:
        raise ValueError(
            f"key=None but the dataset ({type(dataset).__name__}) has no 'fingerprint'; "
            "pass key=... naming its content (e.g. its path and version) to cache its lengths"
        )
    return f"v{_CACHE_VERSION}|{identity}|n={len(dataset)}"


def cached_lengths_and_loss_tokens(
    dataset: Sequence[Mapping[str, Any]], cache_dir: str | os.PathLike[str], key: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and loss tokens of ``dataset``, read from ``cache_dir`` or computed once and stored there.

    A dataset that offers both arrays (``lengths`` and ``loss_tokens`` attributes: every dataset of this
    package) is never overridden by a cache: its arrays are returned as they are. Otherwise the cache is checked
    against the data on load (the number of samples, the values' ranges, and the lengths and loss tokens of a
    deterministic sample of records); a cache that is unreadable or disagrees is recomputed, with a warning.
    It is written atomically (a unique temporary file in the cache folder, fsync, ``os.replace``).

    Args:
        dataset: a map-style dataset.
        cache_dir: the cache folder (created when missing).
        key: the identity of the dataset's content; defaults to ``dataset.fingerprint``. Change it
            whenever the content changes (the number of samples is part of the key anyway).
    """
    lengths, loss_tokens = _fast_path(dataset, "lengths"), _fast_path(dataset, "loss_tokens")
    if lengths is not None and loss_tokens is not None:
        return lengths, loss_tokens  # exact and free: a cache could only disagree with them
    scan = cached_scan(dataset, cache_dir, key)
    return scan.lengths, scan.loss_tokens


def cached_scan(
    dataset: Sequence[Mapping[str, Any]],
    cache_dir: str | os.PathLike[str],
    key: str | None = None,
    *,
    weighted_mask: bool = False,
) -> DataScan:
    """The validation scan of ``dataset`` (:func:`~lit_seqpack.data.scan_dataset`), cached.

    Args:
        dataset: a map-style dataset.
        cache_dir: the cache folder (created when missing).
        key: the identity of the dataset's content; defaults to ``dataset.fingerprint``.
        weighted_mask: ``loss_mask`` holds weights in ``[0, 1]`` (see
            :func:`~lit_seqpack.data.scan_dataset`); a scan that accepted weights is cached under another
            key than one that refused them.
    """
    identity = _identity(dataset, key) + ("|loss_mask:weights" if weighted_mask else "")
    path = Path(cache_dir) / f"lengths-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.npz"
    cached = _load(path, dataset, identity)
    if cached is not None:
        log.debug("lengths cache hit: %s", path)
        return cached
    scan = scan_dataset(dataset, weighted_mask=weighted_mask)
    _save(path, scan, identity)
    log.info("lengths of %d samples computed and cached in %s", len(scan.lengths), path)
    return scan


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
    array = declared_counts(dataset, name)
    return None if array is None else array.astype(np.int64)  # a copy: the caller's array is never aliased


def _scan(dataset: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    scan = scan_dataset(dataset)  # fail before training, naming the sample, not mid-epoch
    return scan.lengths, scan.loss_tokens


def _load(path: Path, dataset: Sequence[Mapping[str, Any]], identity: str) -> DataScan | None:
    """The cached scan at ``path`` if it is readable and agrees with ``dataset``, else ``None`` (with a warning)."""
    if path.is_symlink():
        log.warning("ignoring the lengths cache %s: it is a symbolic link; recomputing", path)
        return None
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            lengths, loss_tokens = stored["lengths"], stored["loss_tokens"]
            max_id, stored_identity = int(stored["max_id"]), str(stored["identity"])
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        log.warning("ignoring the unreadable lengths cache %s (%s: %s); recomputing", path, type(err).__name__, err)
        return None
    problem = _disagreement(dataset, lengths, loss_tokens, stored_identity, identity)
    if problem is not None:
        log.warning("ignoring the lengths cache %s: %s; recomputing", path, problem)
        return None
    return DataScan(lengths.astype(np.int64), loss_tokens.astype(np.int64), max_id, f"{path} (cached)")


_SAMPLED = 16


def _disagreement(
    dataset: Sequence[Mapping[str, Any]], lengths: np.ndarray, loss: np.ndarray, stored: str, identity: str
) -> str | None:
    """Why the cached arrays cannot be this dataset's, or ``None`` when they pass every check."""
    size = len(dataset)
    if stored != identity:
        return "it was written for other data"
    if lengths.shape != (size,) or loss.shape != (size,):
        return f"it holds {lengths.shape} entries, not {size}"
    if lengths.dtype.kind not in "iu" or loss.dtype.kind not in "iu":
        return f"its arrays are {lengths.dtype}/{loss.dtype}, not integers"
    if size and (lengths.min() < 1 or loss.min() < 0 or (loss > lengths - 1).any()):
        return "it holds impossible values (a length < 1, or more loss tokens than length - 1)"
    for i in np.unique(np.linspace(0, size - 1, num=min(size, _SAMPLED)).astype(np.int64)).tolist():
        sample = read_sample(dataset, i)
        actual = (len(sample["input_ids"]), sample_loss_tokens(sample))
        if actual != (int(lengths[i]), int(loss[i])):
            cached = f"{int(lengths[i])} and {int(loss[i])}"
            return f"dataset[{i}] has length {actual[0]} and {actual[1]} loss tokens, the cache says {cached}"
    return None


_STALE_SECONDS = 3600.0


def _save(path: Path, scan: DataScan, identity: str) -> None:
    """Write atomically: a unique temporary file (``O_EXCL``) in the cache folder, fsync, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path)
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            np.savez(
                handle,
                lengths=scan.lengths,
                loss_tokens=scan.loss_tokens,
                max_id=np.int64(scan.max_id),
                identity=np.array(identity),
            )
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)  # replaces a link itself, never its target; readers see old or new, whole
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _remove_stale_partials(path: Path) -> None:
    """Delete temporary files that a killed writer of this cache left more than an hour ago."""
    now = time.time()
    for partial in path.parent.glob(f".{path.name}.*.partial"):
        with contextlib.suppress(OSError):
            if not partial.is_symlink() and now - partial.stat().st_mtime > _STALE_SECONDS:
                partial.unlink()
