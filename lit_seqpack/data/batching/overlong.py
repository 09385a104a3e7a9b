"""The over-long policy: what happens to samples longer than the token budget ``max_tokens``.

``overlong="error"`` refuses them, ``"truncate"`` cuts them to ``max_tokens`` tokens and ``"drop"``
removes them from the index space. Nothing is silent: :func:`apply_overlong_policy` returns an
:class:`OverlongReport` with the counts (and logs a warning when anything was cut or dropped), which
the DataModule logs again.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_seqpack._checks import check_int
from lit_seqpack.data.batching._samples import sample_loss_tokens

__all__ = ["OVERLONG_POLICIES", "DroppedDataset", "OverlongReport", "TruncatedDataset", "apply_overlong_policy"]

log = logging.getLogger(__name__)

OVERLONG_POLICIES: tuple[str, ...] = ("error", "truncate", "drop")
_SHOWN = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlongReport:
    """What the over-long policy did.

    Args:
        policy: ``"error"``, ``"truncate"`` or ``"drop"``.
        max_tokens: the token budget samples were compared with.
        num_samples: samples before the policy.
        num_overlong: samples longer than ``max_tokens``.
        num_dropped: samples removed (``drop``).
        num_truncated: samples cut to ``max_tokens`` (``truncate``).
        tokens_dropped: tokens of the removed samples.
        tokens_truncated: tokens cut off the truncated samples.
        indices: the first few over-long sample indices (original numbering).
        lengths: their lengths.
    """

    policy: str
    max_tokens: int
    num_samples: int
    num_overlong: int = 0
    num_dropped: int = 0
    num_truncated: int = 0
    tokens_dropped: int = 0
    tokens_truncated: int = 0
    indices: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in OVERLONG_POLICIES:
            raise ValueError(f"overlong={self.policy!r} must be one of {OVERLONG_POLICIES}")
        if self.num_dropped + self.num_truncated > self.num_overlong:
            raise ValueError("num_dropped + num_truncated cannot exceed num_overlong")

    def summary(self) -> str:
        """A one-line human-readable account, e.g. for a log."""
        text = f"{self.num_overlong} of {self.num_samples} samples are longer than max_tokens={self.max_tokens}"
        if self.num_overlong == 0:
            return text
        shown = ", ".join(f"#{i}: {n}" for i, n in zip(self.indices, self.lengths, strict=True))
        text += f" (first: {shown})"
        if self.policy == "drop":
            text += f"; overlong='drop' removed {self.num_dropped} samples ({self.tokens_dropped} tokens)"
        elif self.policy == "truncate":
            text += f"; overlong='truncate' cut {self.num_truncated} samples ({self.tokens_truncated} tokens)"
        return text


def apply_overlong_policy(
    dataset: Sequence[Mapping[str, Any]],
    lengths: np.ndarray | Sequence[int],
    max_tokens: int,
    policy: str = "error",
    token_fields: Sequence[str] = (),
) -> tuple[Sequence[Mapping[str, Any]], np.ndarray, OverlongReport]:
    """Apply ``policy`` to the samples of ``dataset`` longer than ``max_tokens``.

    Args:
        dataset: a map-style dataset.
        lengths: the token count of every sample (e.g. from ``compute_lengths``).
        max_tokens: the longest sample allowed.
        policy: ``"error"`` raises, ``"truncate"`` cuts, ``"drop"`` removes (see ``OVERLONG_POLICIES``).
        token_fields: the declared per-token fields (see :mod:`lit_seqpack.data.batching.fields`), cut with the tokens
            under ``"truncate"``; per-sample fields are kept as they are.

    Returns:
        ``(dataset, lengths, report)``: the dataset itself when no sample is over-long, with a read-only view
        of ``lengths`` (no copy), else a :class:`TruncatedDataset` or :class:`DroppedDataset` view, with the
        lengths of that view.

    Raises:
        ValueError: under ``"error"`` when a sample is over-long, naming ``overlong`` and ``max_tokens``;
            for a bad ``policy`` or ``max_tokens``; when ``lengths`` does not match the dataset; when
            ``"drop"`` would leave no sample.

    Example:
        >>> data = [{"input_ids": [1] * n} for n in (3, 9, 4)]
        >>> view, lengths, report = apply_overlong_policy(data, [3, 9, 4], max_tokens=5, policy="drop")
        >>> len(view), lengths.tolist(), report.num_dropped, report.tokens_dropped
        (2, [3, 4], 1, 9)
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={policy!r} must be one of {OVERLONG_POLICIES}")
    check_int("max_tokens", max_tokens, minimum=1)
    lengths = np.asarray(lengths)
    if lengths.dtype not in (np.int32, np.int64):  # keep a signed int32 array as it is (4 bytes a sample)
        lengths = lengths.astype(np.int64)
    if lengths.shape != (len(dataset),):
        raise ValueError(f"lengths has shape {lengths.shape} but the dataset has {len(dataset)} samples")
    over = np.flatnonzero(lengths > max_tokens)
    base = {
        "policy": policy,
        "max_tokens": int(max_tokens),
        "num_samples": len(dataset),
        "num_overlong": len(over),
        "indices": tuple(int(i) for i in over[:_SHOWN]),
        "lengths": tuple(int(lengths[i]) for i in over[:_SHOWN]),
    }
    if len(over) == 0:  # nothing changes: a read-only view of the lengths, not a copy (4-8 bytes a sample)
        unchanged = lengths.view()
        unchanged.flags.writeable = False
        return dataset, unchanged, OverlongReport(**base)
    where = getattr(dataset, "sample_where", None)  # a dataset that names its samples' file and line
    named = f" ({where(int(over[0]))} is the first)" if callable(where) else ""
    if policy == "error":
        report = OverlongReport(**base)
        raise ValueError(f"{report.summary()}{named}; raise max_tokens, or set overlong='truncate' or overlong='drop'")
    if policy == "truncate":
        _refuse_cut(dataset, over, max_tokens, lengths)
        excess = int((lengths[over] - max_tokens).sum())
        report = OverlongReport(**base, num_truncated=len(over), tokens_truncated=excess)
        view: Sequence[Mapping[str, Any]] = TruncatedDataset(dataset, lengths, int(max_tokens), token_fields)
    else:
        if len(over) == len(dataset):
            raise ValueError(f"overlong='drop' would drop all {len(dataset)} samples; raise max_tokens={max_tokens}")
        report = OverlongReport(**base, num_dropped=len(over), tokens_dropped=int(lengths[over].sum()))
        view = DroppedDataset(dataset, lengths, np.flatnonzero(lengths <= max_tokens))
    log.warning("%s", report.summary())
    return view, view.lengths.copy(), report


def _refuse_cut(dataset: Sequence[Mapping[str, Any]], over: np.ndarray, max_tokens: int, lengths: np.ndarray) -> None:
    """Raise for an over-long sample that cannot be cut: one with images (``has_images``) of a dataset that declares
    ``truncatable = False`` (its image tokens and patches belong together), naming it."""
    if getattr(dataset, "truncatable", True):
        return
    has_images = getattr(dataset, "has_images", lambda i: True)
    for i in over:
        if has_images(int(i)):
            where = getattr(dataset, "sample_where", lambda i: f"sample {i}")(int(i))
            raise ValueError(
                f"{where}: {int(lengths[i])} tokens (its images' tokens included) exceed max_tokens={max_tokens}, and "
                "overlong='truncate' cannot cut a conversation with images (its image tokens and pixels belong "
                "together); raise max_tokens, or set overlong='drop' (dropped conversations are counted)"
            )


class TruncatedDataset:
    """A view of ``dataset`` whose samples are cut to ``max_tokens``.

    ``input_ids``, ``labels``, ``loss_mask`` and the declared token fields are cut; every other key (e.g. a
    per-sample field) is kept as it is.

    Args:
        dataset: the map-style dataset.
        lengths: the length of every sample of ``dataset``; a sample whose real length differs raises
            (a stale lengths cache would otherwise let an over-long sample through).
        max_tokens: the longest sample kept.
        token_fields: the declared per-token fields; each must be as long as ``input_ids`` before the cut (a
            shorter one would otherwise be cut to the same length and misalign silently).
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        lengths: np.ndarray,
        max_tokens: int,
        token_fields: Sequence[str] = (),
    ) -> None:
        self.dataset = dataset
        self.max_tokens = max_tokens
        self.token_fields = tuple(token_fields)
        self._source_lengths = np.asarray(lengths, dtype=np.int64)
        self.lengths = np.minimum(self._source_lengths, max_tokens)
        self._loss_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        sample = _checked(self.dataset, i, int(self._source_lengths[i]))
        if len(sample["input_ids"]) <= self.max_tokens:
            return sample
        length, cut = len(sample["input_ids"]), dict(sample)
        for key in ("input_ids", "labels", "loss_mask", *self.token_fields):
            if key not in cut or cut[key] is None:
                continue  # the collator names a missing declared field
            if len(cut[key]) != length:
                raise ValueError(
                    f"sample {i}: {key} has {len(cut[key])} entries but input_ids has {length} tokens (before "
                    f"overlong='truncate' cuts both to max_tokens={self.max_tokens})"
                )
            cut[key] = cut[key][: self.max_tokens]
        return cut

    @property
    def loss_tokens(self) -> np.ndarray | None:
        """Loss tokens per sample after truncation, when the wrapped dataset offers ``loss_tokens``."""
        source = getattr(self.dataset, "loss_tokens", None)
        if source is None:
            return None
        if self._loss_tokens is None:
            counts = np.array(source, dtype=np.int64)
            for i in np.flatnonzero(self._source_lengths > self.max_tokens):
                counts[i] = sample_loss_tokens(self[int(i)])
            self._loss_tokens = counts
        return self._loss_tokens

    @property
    def fingerprint(self) -> str | None:
        """The wrapped dataset's fingerprint plus the policy, or ``None``."""
        inner = getattr(self.dataset, "fingerprint", None)
        return None if inner is None else f"{inner}|truncate:{self.max_tokens}"


class DroppedDataset:
    """A view of ``dataset`` restricted to ``kept`` indices; ``original_indices[i]`` is the source of ``i``.

    Args:
        dataset: the map-style dataset.
        lengths: the length of every sample of ``dataset``.
        kept: the indices of ``dataset`` that stay, in order.
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]], lengths: np.ndarray, kept: np.ndarray) -> None:
        self.dataset = dataset
        self.original_indices = np.asarray(kept, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)[self.original_indices]

    def __len__(self) -> int:
        return len(self.original_indices)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        return _checked(self.dataset, int(self.original_indices[i]), int(self.lengths[i]))

    @property
    def loss_tokens(self) -> np.ndarray | None:
        """The wrapped dataset's ``loss_tokens`` of the kept samples, or ``None``."""
        source = getattr(self.dataset, "loss_tokens", None)
        return None if source is None else np.asarray(source, dtype=np.int64)[self.original_indices]

    @property
    def fingerprint(self) -> str | None:
        """The wrapped dataset's fingerprint plus a digest of the kept indices, or ``None``."""
        inner = getattr(self.dataset, "fingerprint", None)
        if inner is None:
            return None
        return f"{inner}|drop:{hashlib.blake2b(self.original_indices.tobytes(), digest_size=16).hexdigest()}"


def _checked(dataset: Sequence[Mapping[str, Any]], index: int, expected: int) -> Mapping[str, Any]:
    sample = dataset[index]
    if len(sample["input_ids"]) != expected:
        raise ValueError(
            f"sample {index} has {len(sample['input_ids'])} tokens but the lengths array says {expected}; "
            "the lengths (or their cache) are stale for this dataset"
        )
    return sample
