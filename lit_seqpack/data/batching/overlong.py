"""The over-long policy: what happens to samples longer than the token budget ``max_tokens``.

``overlong="error"`` refuses them, ``"truncate"`` cuts them to ``max_tokens`` tokens (their first ones, or with
``truncation_side="left"`` their last ones), ``"drop"`` removes them from the index space and ``"split"`` cuts them
at multiples of ``max_tokens`` into ``ceil(L / max_tokens)`` pieces, each a document of its own (every token kept)::

    sample of 10 tokens, max_tokens=4     a0 a1 a2 a3 a4 a5 a6 a7 a8 a9
    overlong="split"                      [a0 a1 a2 a3] [a4 a5 a6 a7] [a8 a9]    3 documents
    overlong="truncate"                   [a0 a1 a2 a3]                          (truncation_side="right")
    overlong="truncate"                   [a6 a7 a8 a9]                          (truncation_side="left")

Each piece, like any document, starts its positions at 0 and its first token carries no label. Nothing is silent:
:func:`apply_overlong_policy` returns an :class:`OverlongReport` with the counts (and logs a warning when anything was
cut, dropped or split), which the DataModule logs again.
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

__all__ = [
    "OVERLONG_POLICIES",
    "TRUNCATION_SIDES",
    "DroppedDataset",
    "OverlongReport",
    "SplitDataset",
    "TruncatedDataset",
    "apply_overlong_policy",
    "check_truncation_side",
    "cut_tokens",
    "split_pieces",
]

log = logging.getLogger(__name__)

OVERLONG_POLICIES: tuple[str, ...] = ("error", "truncate", "drop", "split")
TRUNCATION_SIDES: tuple[str, ...] = ("right", "left")
"""Which end ``overlong="truncate"`` cuts: ``"right"`` keeps a sample's first tokens, ``"left"`` its last ones."""
_SHOWN = 5
_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


def check_truncation_side(truncation_side: str, policy: str) -> None:
    """Refuse a side that is not one of :data:`TRUNCATION_SIDES`, or a non-default side with another policy.

    Example:
        >>> check_truncation_side("left", "truncate")
        >>> try:
        ...     check_truncation_side("left", "split")
        ... except ValueError as err:
        ...     print(str(err)[:72])
        truncation_side='left' only applies to overlong='truncate', got overlong
    """
    if truncation_side not in TRUNCATION_SIDES:
        raise ValueError(f"truncation_side={truncation_side!r} must be one of {TRUNCATION_SIDES}")
    if truncation_side != "right" and policy != "truncate":
        raise ValueError(
            f"truncation_side={truncation_side!r} only applies to overlong='truncate', got overlong={policy!r}; "
            "remove truncation_side or set overlong='truncate'"
        )


def split_pieces(lengths: np.ndarray | Sequence[int], max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces ``overlong="split"`` cuts samples into: ``(sample, piece, length)`` of every piece, in order.

    A sample of ``L`` tokens becomes ``ceil(L / max_tokens)`` pieces (one for ``L <= max_tokens``); piece ``k`` holds
    its tokens ``[k * max_tokens, min((k + 1) * max_tokens, L))``.

    Example:
        >>> sample, piece, length = split_pieces([3, 10, 4], 4)
        >>> sample.tolist(), piece.tolist(), length.tolist()
        ([0, 1, 1, 1, 2], [0, 0, 1, 2, 0], [3, 4, 4, 2, 4])
    """
    source = np.asarray(lengths, dtype=np.int64)
    counts = np.maximum((source + max_tokens - 1) // max_tokens, 1)
    sample = np.repeat(np.arange(len(source), dtype=np.int64), counts)
    piece = np.arange(len(sample), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return sample, piece, np.minimum(source[sample] - piece * max_tokens, max_tokens)


def cut_tokens(
    sample: Mapping[str, Any], start: int, stop: int, *, token_fields: Sequence[str] = (), name: object, why: str
) -> dict[str, Any]:
    """``sample`` with its tokens ``[start, stop)``: ``input_ids``, ``labels``, ``loss_mask`` and the declared token
    fields are cut, every other key (a per-sample field) is kept as it is.

    Args:
        sample: the sample.
        start: first token kept.
        stop: one past the last token kept.
        token_fields: the declared per-token fields; each must be as long as ``input_ids`` (one of another length
            would be cut out of line with the tokens, silently).
        name: what an error calls the sample (e.g. ``sample 3``).
        why: what cuts it, for the error (e.g. ``overlong='truncate' cuts both to max_tokens=8``).

    Example:
        >>> cut_tokens({"input_ids": [1, 2, 3], "id": 7}, 1, 3, name="sample 0", why="a test")
        {'input_ids': [2, 3], 'id': 7}
    """
    length, cut = len(sample["input_ids"]), dict(sample)
    for key in (*_TOKEN_KEYS, *token_fields):
        if key not in cut or cut[key] is None:
            continue  # the collator names a missing declared field
        if len(cut[key]) != length:
            raise ValueError(
                f"{name}: {key} has {len(cut[key])} entries but input_ids has {length} tokens (before {why})"
            )
        cut[key] = cut[key][start:stop]
    return cut


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlongReport:
    """What the over-long policy did.

    Args:
        policy: ``"error"``, ``"truncate"``, ``"drop"`` or ``"split"``.
        max_tokens: the token budget samples were compared with.
        num_samples: samples before the policy.
        num_overlong: samples longer than ``max_tokens``.
        num_dropped: samples removed (``drop``).
        num_truncated: samples cut to ``max_tokens`` (``truncate``).
        tokens_dropped: tokens of the removed samples.
        tokens_truncated: tokens cut off the truncated samples.
        indices: the first few over-long sample indices (original numbering).
        lengths: their lengths.
        num_split: samples cut into pieces (``split``).
        num_pieces: the pieces those samples became (``split``; every token is kept).
        truncation_side: the end ``truncate`` cut (``"right"`` keeps the first tokens, ``"left"`` the last ones).
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
    num_split: int = 0
    num_pieces: int = 0
    truncation_side: str = "right"

    def __post_init__(self) -> None:
        if self.policy not in OVERLONG_POLICIES:
            raise ValueError(f"overlong={self.policy!r} must be one of {OVERLONG_POLICIES}")
        check_truncation_side(self.truncation_side, self.policy)
        if self.num_dropped + self.num_truncated + self.num_split > self.num_overlong:
            raise ValueError("num_dropped + num_truncated + num_split cannot exceed num_overlong")
        if self.num_pieces < 2 * self.num_split:
            raise ValueError(f"num_pieces={self.num_pieces} must be at least 2 x num_split={self.num_split}")

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
            side = "" if self.truncation_side == "right" else " from the left (truncation_side='left')"
            text += f"; overlong='truncate' cut {self.num_truncated} samples ({self.tokens_truncated} tokens){side}"
        elif self.policy == "split":
            text += (
                f"; overlong='split' split {self.num_split} samples into {self.num_pieces} pieces of at most "
                f"{self.max_tokens} tokens (every token kept)"
            )
        return text


def apply_overlong_policy(
    dataset: Sequence[Mapping[str, Any]],
    lengths: np.ndarray | Sequence[int],
    max_tokens: int,
    policy: str = "error",
    token_fields: Sequence[str] = (),
    truncation_side: str = "right",
) -> tuple[Sequence[Mapping[str, Any]], np.ndarray, OverlongReport]:
    """Apply ``policy`` to the samples of ``dataset`` longer than ``max_tokens``.

    Args:
        dataset: a map-style dataset.
        lengths: the token count of every sample (e.g. from ``compute_lengths``).
        max_tokens: the longest sample allowed.
        policy: ``"error"`` raises, ``"truncate"`` cuts, ``"drop"`` removes, ``"split"`` cuts into pieces (see
            ``OVERLONG_POLICIES``).
        token_fields: the declared per-token fields (see :mod:`lit_seqpack.data.batching.fields`), cut with the tokens
            under ``"truncate"`` and ``"split"``; per-sample fields are kept as they are (repeated on every piece).
        truncation_side: ``"right"`` (keep the first ``max_tokens`` tokens) or ``"left"`` (keep the last ones);
            ``"truncate"`` only.

    Returns:
        ``(dataset, lengths, report)``: the dataset itself when no sample is over-long, with a read-only view
        of ``lengths`` (no copy), else a :class:`TruncatedDataset`, :class:`DroppedDataset` or :class:`SplitDataset`
        view, with the lengths of that view.

    Raises:
        ValueError: under ``"error"`` when a sample is over-long, naming ``overlong`` and ``max_tokens``;
            for a bad ``policy``, ``truncation_side`` or ``max_tokens``; when ``lengths`` does not match the dataset;
            when ``"drop"`` would leave no sample.

    Example:
        >>> data = [{"input_ids": [1] * n} for n in (3, 9, 4)]
        >>> view, lengths, report = apply_overlong_policy(data, [3, 9, 4], max_tokens=5, policy="drop")
        >>> len(view), lengths.tolist(), report.num_dropped, report.tokens_dropped
        (2, [3, 4], 1, 9)
        >>> view, lengths, report = apply_overlong_policy(data, [3, 9, 4], max_tokens=5, policy="split")
        >>> len(view), lengths.tolist(), view.original_indices.tolist(), report.num_pieces
        (4, [3, 5, 4, 4], [0, 1, 1, 2], 2)
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={policy!r} must be one of {OVERLONG_POLICIES}")
    check_truncation_side(truncation_side, policy)
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
        "truncation_side": truncation_side,
    }
    if len(over) == 0:  # nothing changes: a read-only view of the lengths, not a copy (4-8 bytes a sample)
        unchanged = lengths.view()
        unchanged.flags.writeable = False
        return dataset, unchanged, OverlongReport(**base)
    where = getattr(dataset, "sample_where", None)  # a dataset that names its samples' file and line
    named = f" ({where(int(over[0]))} is the first)" if callable(where) else ""
    if policy == "error":
        report = OverlongReport(**base)
        raise ValueError(
            f"{report.summary()}{named}; raise max_tokens, or set overlong='split' (every token kept, in pieces), "
            "overlong='truncate' or overlong='drop'"
        )
    view: Sequence[Mapping[str, Any]]
    if policy == "truncate":
        _refuse_cut(dataset, over, max_tokens, lengths)
        excess = int((lengths[over] - max_tokens).sum())
        report = OverlongReport(**base, num_truncated=len(over), tokens_truncated=excess)
        view = TruncatedDataset(dataset, lengths, int(max_tokens), token_fields, truncation_side=truncation_side)
    elif policy == "split":
        pieces = int(((lengths[over].astype(np.int64) + max_tokens - 1) // max_tokens).sum())
        report = OverlongReport(**base, num_split=len(over), num_pieces=pieces)
        view = SplitDataset(dataset, lengths, int(max_tokens), token_fields)
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
    """A view of ``dataset`` whose samples are cut to ``max_tokens``: their first tokens kept, or their last ones.

    ``input_ids``, ``labels``, ``loss_mask`` and the declared token fields are cut; every other key (e.g. a
    per-sample field) is kept as it is. With ``truncation_side="left"`` the first kept token is a document's first
    token, so it carries no label (the collators mask every document's first token).

    Args:
        dataset: the map-style dataset.
        lengths: the length of every sample of ``dataset``; a sample whose real length differs raises
            (a stale lengths cache would otherwise let an over-long sample through).
        max_tokens: the longest sample kept.
        token_fields: the declared per-token fields; each must be as long as ``input_ids`` before the cut (a
            shorter one would otherwise be cut to the same length and misalign silently).
        truncation_side: ``"right"`` keeps the first ``max_tokens`` tokens, ``"left"`` the last ones.
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        lengths: np.ndarray,
        max_tokens: int,
        token_fields: Sequence[str] = (),
        *,
        truncation_side: str = "right",
    ) -> None:
        check_truncation_side(truncation_side, "truncate")
        self.dataset = dataset
        self.max_tokens = max_tokens
        self.token_fields = tuple(token_fields)
        self.truncation_side = truncation_side
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
        length = len(sample["input_ids"])
        if length <= self.max_tokens:
            return sample
        start = length - self.max_tokens if self.truncation_side == "left" else 0
        why = f"overlong='truncate' cuts both to max_tokens={self.max_tokens}"
        return cut_tokens(
            sample, start, start + self.max_tokens, token_fields=self.token_fields, name=f"sample {i}", why=why
        )

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
        side = "" if self.truncation_side == "right" else ":left"
        return None if inner is None else f"{inner}|truncate:{self.max_tokens}{side}"


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


class SplitDataset:
    """A view of ``dataset`` whose index space is the pieces of its samples: over-long ones cut into pieces of at
    most ``max_tokens`` tokens at multiples of ``max_tokens`` (:func:`split_pieces`), the others one piece each.

    Each piece is a sample of its own: ``input_ids``, ``labels``, ``loss_mask`` and the declared token fields are cut,
    every other key (a per-sample field) is repeated on every piece. Packed, each piece is a document (positions
    restart, attention stays inside it, its first token carries no label): a last piece of one token is kept and
    counted, and trains nothing.

    Args:
        dataset: the map-style dataset.
        lengths: the length of every sample of ``dataset``; a sample whose real length differs raises.
        max_tokens: the longest piece.
        token_fields: the declared per-token fields; each must be as long as ``input_ids``.

    Attributes:
        original_indices: the sample of ``dataset`` each piece comes from.
        piece_indices: the piece's number in its sample (0 for its first tokens).
        lengths: the piece's length.
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
        self.original_indices, self.piece_indices, self.lengths = split_pieces(self._source_lengths, max_tokens)
        self._loss_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.original_indices)

    def piece(self, index: int) -> tuple[int, int]:
        """``(sample, piece)``: the sample of ``dataset`` item ``index`` comes from, and its piece number there."""
        return int(self.original_indices[index]), int(self.piece_indices[index])

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} pieces")
        source, piece = self.piece(i)
        sample = _checked(self.dataset, source, int(self._source_lengths[source]))
        return self._cut(sample, source, piece)

    def _cut(self, sample: Mapping[str, Any], source: int, piece: int) -> Mapping[str, Any]:
        if len(sample["input_ids"]) <= self.max_tokens:
            return sample
        start = piece * self.max_tokens
        why = f"overlong='split' cuts both into pieces of max_tokens={self.max_tokens}"
        name = f"sample {source} (piece {piece})"
        return cut_tokens(sample, start, start + self.max_tokens, token_fields=self.token_fields, name=name, why=why)

    def piece_loss_tokens(self, loss_tokens: np.ndarray) -> np.ndarray:
        """The loss tokens of every piece, from those of every sample (``loss_tokens``): a piece of a sample not
        split keeps its sample's count, the pieces of a split sample are counted (each sample read once)."""
        counts = np.asarray(loss_tokens, dtype=np.int64)[self.original_indices]
        first = np.flatnonzero(self.piece_indices == 0)
        for source in np.flatnonzero(self._source_lengths > self.max_tokens):
            sample = _checked(self.dataset, int(source), int(self._source_lengths[source]))
            start = int(first[source])
            pieces = int((self._source_lengths[source] + self.max_tokens - 1) // self.max_tokens)
            for piece in range(pieces):
                counts[start + piece] = sample_loss_tokens(self._cut(sample, int(source), piece))
        return counts

    @property
    def loss_tokens(self) -> np.ndarray | None:
        """Loss tokens per piece, when the wrapped dataset offers ``loss_tokens``."""
        source = getattr(self.dataset, "loss_tokens", None)
        if source is None:
            return None
        if self._loss_tokens is None:
            self._loss_tokens = self.piece_loss_tokens(np.asarray(source, dtype=np.int64))
        return self._loss_tokens

    @property
    def fingerprint(self) -> str | None:
        """The wrapped dataset's fingerprint plus the policy, or ``None``."""
        inner = getattr(self.dataset, "fingerprint", None)
        return None if inner is None else f"{inner}|split:{self.max_tokens}"


def _checked(dataset: Sequence[Mapping[str, Any]], index: int, expected: int) -> Mapping[str, Any]:
    sample = dataset[index]
    if len(sample["input_ids"]) != expected:
        raise ValueError(
            f"sample {index} has {len(sample['input_ids'])} tokens but the lengths array says {expected}; "
            "the lengths (or their cache) are stale for this dataset"
        )
    return sample
