"""Collation of a microbatch of samples into the batch contract (packed rows or padded ``[B, L]`` batches).

A sample is a mapping with ``input_ids`` (a list or 1-D tensor of non-negative ints) and optionally either
``labels`` (same length, ``-100`` masks a position, e.g. prompt tokens) or ``loss_mask`` (same length, 1 = train on
the token, 0 = do not); extra per-token and per-sample fields travel when declared (``token_fields``,
``sample_fields``, see :mod:`lit_seqpack.data.fields`), and any other key is reported once. Labels are not
shifted: models shift them by one (Hugging Face convention), so the collators put ``-100`` on the first token of
every document, which has no previous token to be predicted from, and on every padding position. The counts the
loss and the metrics need travel as Python scalars (never tensors, so reading them costs no device sync); the
plan's facts come from the :class:`~lit_seqpack.data.microbatch.MicrobatchMeta` that
:class:`~lit_seqpack.data.microbatch.PlannedDataset` attaches to the list of samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lit_seqpack.data.fields import FieldValues, check_fields, empty_fields, pad_token_field, read_fields
from lit_seqpack.data.labels import IGNORE_INDEX
from lit_seqpack.data.microbatch import MicrobatchMeta

__all__ = ["IGNORE_INDEX", "PackedCollator", "PaddedCollator"]


def _check_knob(name: str, value: int | None, *, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def _int_vector(value: Any, name: str, key: str, *, allow_bool: bool = False) -> torch.Tensor:
    """``value`` as a 1-D int64 tensor, or a ValueError naming the sample (``name``) and ``key``."""
    if value is None:
        raise ValueError(f"{name}: {key} is None; omit the key to train on every token")
    if isinstance(value, (list, tuple)) and not allow_bool:
        kinds = set(map(type, value))  # numpy would silently read [5, True] as [5, 1]
        if bool in kinds or np.bool_ in kinds:
            raise ValueError(f"{name}: {key} must hold integers, found a bool (booleans are not token ids)")
    try:
        # numpy converts a list of Python ints about 5x faster than torch.as_tensor does
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise ValueError(f"{name}: {key} is not a sequence of integers (got {value!r:.60})") from None
    if tensor.dim() != 1:
        raise ValueError(f"{name}: {key} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:  # numpy types an empty list as float64
        return torch.empty(0, dtype=torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or (tensor.dtype == torch.bool and not allow_bool):
        raise ValueError(f"{name}: {key} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.int64)


def _first_bad(parts: Sequence[torch.Tensor], bad: torch.Tensor) -> int:
    """Index of the part that holds the first True of ``bad`` (a mask over the concatenation of ``parts``)."""
    ends = np.cumsum([len(p) for p in parts])
    return int(np.searchsorted(ends, int(bad.nonzero()[0, 0]), side="right"))


def _sample_name(samples: Sequence[Any], index: int) -> str:
    """``sample 3`` (the position in the microbatch), with its dataset index when the loader attached them."""
    indices = getattr(samples, "indices", None)
    if indices is None or index >= len(indices):
        return f"sample {index}"
    return f"sample {index} of the microbatch (dataset index {indices[index]})"


def _read_samples(samples: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Validate the samples; return each document's ids and the concatenated ids and labels (no shift)."""
    ids, labels = [], []
    for index, sample in enumerate(samples):
        name = _sample_name(samples, index)
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            found = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise ValueError(f"{name}: expected a mapping with 'input_ids', got {found}")
        doc = _int_vector(sample["input_ids"], name, "input_ids")
        if len(doc) == 0:
            raise ValueError(f"{name}: input_ids is empty (a document needs at least one token)")
        if "labels" in sample and "loss_mask" in sample:
            raise ValueError(f"{name}: give either 'labels' or 'loss_mask', not both")
        if "labels" in sample:
            target = _int_vector(sample["labels"], name, "labels")
        elif "loss_mask" in sample:
            mask = _int_vector(sample["loss_mask"], name, "loss_mask", allow_bool=True)
            if len(mask) == len(doc) and bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"{name}: loss_mask must hold only 0 and 1, got {mask.unique().tolist()}")
            target = torch.where(mask.bool(), doc, IGNORE_INDEX) if len(mask) == len(doc) else mask
        else:
            target = doc
        if len(target) != len(doc):
            key = "labels" if "labels" in sample else "loss_mask"
            raise ValueError(f"{name}: {key} has {len(target)} entries but input_ids has {len(doc)}")
        ids.append(doc)
        labels.append(target)
    all_ids, all_labels = torch.cat(ids), torch.cat(labels)
    problems = []  # value checks run once on the concatenation; on failure, name the first bad sample
    if bool((all_ids < 0).any()):
        problems.append((_first_bad(ids, all_ids < 0), "input_ids must be >= 0 (found a negative id)"))
    bad_labels = (all_labels < 0) & (all_labels != IGNORE_INDEX)
    if bool(bad_labels.any()):
        problems.append((_first_bad(labels, bad_labels), f"labels must be >= 0 or {IGNORE_INDEX}"))
    if problems:
        index, problem = min(problems)
        raise ValueError(f"{_sample_name(samples, index)}: {problem}")
    return ids, all_ids, all_labels


def _round_up(value: int, multiple: int | None) -> int:
    return value if multiple is None else -(-value // multiple) * multiple


def _scalars(
    meta: MicrobatchMeta | None, *, documents: int, real: int, total: int, loss: int, is_empty: bool
) -> dict[str, Any]:
    """The batch contract's Python scalars; the plan's facts come from ``meta`` when there is one."""
    if meta is not None and not is_empty and meta.loss_tokens is not None and meta.loss_tokens != loss:
        raise ValueError(
            f"the plan counted {meta.loss_tokens} loss tokens for this microbatch but its labels hold {loss}: the "
            "step_loss_tokens normaliser would be wrong. Give the batch sampler the samples' real loss tokens "
            "(loss_tokens=lit_seqpack.data.lengths.compute_loss_tokens(dataset)); the default assumes every token "
            "but the first of each sample is trained on"
        )
    if meta is not None and not is_empty and meta.step_loss_tokens < loss:
        raise ValueError(
            f"the plan says step_loss_tokens={meta.step_loss_tokens} for this optimizer step, but this microbatch "
            f"alone has {loss} loss tokens: the loss tokens given to the planner do not match the samples' labels"
        )
    return {
        "num_documents": documents,
        "num_real_tokens": real,
        "num_padding_tokens": total - real,
        "num_loss_tokens": loss,
        "step_loss_tokens": loss if meta is None else meta.step_loss_tokens,
        "world_size": 1 if meta is None else meta.world_size,
        "accumulate_grad_batches": 1 if meta is None else meta.accumulate_grad_batches,
        "max_tokens": None if meta is None else meta.max_tokens,
        "is_empty": is_empty,
    }


def _is_empty(samples: Sequence[Any], meta: MicrobatchMeta | None) -> bool:
    if meta is not None and meta.is_empty and len(samples) > 0:
        raise ValueError(f"meta.is_empty is True but the microbatch holds {len(samples)} samples")
    return len(samples) == 0


def _declare(collator: Any) -> None:
    """Validate and normalise a collator's ``token_fields`` / ``sample_fields`` (frozen, so via ``object``)."""
    tokens, samples = check_fields(collator.token_fields, collator.sample_fields)
    object.__setattr__(collator, "token_fields", tokens)
    object.__setattr__(collator, "sample_fields", samples)


def _read_fields(collator: Any, samples: Sequence[Mapping[str, Any]], docs: list[torch.Tensor]) -> FieldValues:
    names = [_sample_name(samples, i) for i in range(len(samples))]
    return read_fields(samples, docs, names, collator.token_fields, collator.sample_fields, collator._reported)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedCollator:
    """Concatenates a microbatch's documents into one packed row (``B == 1``) for varlen attention.

    Docs of 3, 5 and 2 tokens with ``pad_to_multiple_of=4`` (``-`` is ``-100``, ``p`` the pad token)::

        docs          a a a b b b b b c c p p      the padding tail is a segment of its own
        input_ids     a a a b b b b b c c p p
        labels        - a a - b b b b - c - -      -100 at each document's first token and on padding
        position_ids  0 1 2 0 1 2 3 4 0 1 0 1      restart per document and for the tail
        cu_seqlens    0     3         8   10  12   int32, cu_seqlens[-1] == T;  max_seqlen = 5

    With ``pad_document_to_multiple_of=4`` (context parallelism splits every document into equal chunks) each
    document is padded at its end; positions keep counting through that padding and ``cu_seqlens`` holds the
    padded boundaries, while ``cu_seqlens_unpadded`` holds the boundaries of the real tokens as if they were
    packed without padding (Transformer Engine's ``cu_seqlens`` / ``cu_seqlens_padded`` pair)::

        input_ids            a a a p b b b b b p p p c c p p
        labels               - a a - - b b b b - - - - c - -
        position_ids         0 1 2 3 0 1 2 3 4 5 6 7 0 1 2 3
        cu_seqlens           0       4               12      16
        cu_seqlens_unpadded  0 3 8 10                          (real lengths 3, 5, 2)

    Both tensors always have the same number of entries: a padding tail added by ``pad_to_multiple_of`` on top
    appears in ``cu_seqlens_unpadded`` as a segment of length 0.

    A declared token field (``token_fields={"weights": 0.0}``) is placed like ``input_ids``, with its pad value
    on every padding position; a sample field (``sample_fields=["reward"]``) holds one value a document::

        weights       1 1 1 .5 .5 .5 .5 .5 0 0 0 0     [1, T], unshifted (value t belongs to token t)
        reward        [r_a, r_b, r_c]                   [num_documents], in cu_seqlens order

    The output dict holds ``input_ids``, ``labels``, ``position_ids`` (int64 ``[1, T]``), ``cu_seqlens`` (int32
    ``[segments + 1]``), ``max_seqlen`` (int), ``cu_seqlens_unpadded`` when documents are padded, and the
    scalars ``num_documents``, ``num_real_tokens``, ``num_padding_tokens``, ``num_loss_tokens``,
    ``step_loss_tokens``, ``world_size``, ``accumulate_grad_batches``, ``max_tokens``, ``is_empty``. An empty
    microbatch (a lock-step filler) becomes a dummy row of padding with every label ``-100``.

    Args:
        pad_token_id: token id written on padding positions.
        pad_to_multiple_of: round the row length ``T`` up to a multiple of this (e.g. 8 or 64 for kernels).
        pad_document_to_multiple_of: round every document's length up to a multiple of this.
        token_fields: extra per-token fields to carry, each name mapped to its pad value; each arrives as a
            ``[1, T]`` tensor aligned with ``input_ids`` (see :mod:`lit_seqpack.data.fields`).
        sample_fields: extra per-sample fields to carry; each arrives as a ``[num_documents]`` tensor.

    Example:
        >>> batch = PackedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> batch["position_ids"].tolist(), batch["cu_seqlens"].tolist(), batch["labels"].tolist()
        ([[0, 1, 2, 0, 1]], [0, 3, 5], [[-100, 6, 7, -100, 9]])
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    pad_document_to_multiple_of: int | None = None
    token_fields: Mapping[str, float | int] | None = None
    sample_fields: Sequence[str] | None = None
    _reported: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_knob("pad_token_id", self.pad_token_id, minimum=0, optional=False)
        _check_knob("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        _check_knob("pad_document_to_multiple_of", self.pad_document_to_multiple_of, minimum=1)
        _declare(self)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        meta = getattr(samples, "meta", None)
        if _is_empty(samples, meta):
            length = math.lcm(self.pad_to_multiple_of or 1, self.pad_document_to_multiple_of or 1)
            empty = torch.empty(0, dtype=torch.int64)
            return self._layout([], empty, empty, empty_fields(self.token_fields, self.sample_fields), meta, length)
        docs, ids, labels = _read_samples(samples)
        return self._layout(docs, ids, labels, _read_fields(self, samples, docs), meta, None)

    def _layout(
        self,
        docs: list[torch.Tensor],
        ids: torch.Tensor,
        labels: torch.Tensor,
        fields: FieldValues,
        meta: Any,
        dummy: int | None,
    ) -> dict[str, Any]:
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        padded = -(-lengths // (self.pad_document_to_multiple_of or 1)) * (self.pad_document_to_multiple_of or 1)
        body = int(padded.sum())
        total = dummy if dummy is not None else _round_up(body, self.pad_to_multiple_of)
        segments = np.append(padded, total - body) if total > body else padded
        cu_seqlens = np.concatenate([[0], np.cumsum(segments)])
        starts = torch.from_numpy(cu_seqlens[: len(docs)])
        dest: slice | torch.Tensor = slice(0, body)
        if self.pad_document_to_multiple_of is not None:  # scatter each document to its padded start
            real_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(docs) else lengths
            dest = torch.from_numpy(np.arange(len(ids)) + np.repeat(cu_seqlens[: len(docs)] - real_starts, lengths))
        input_ids = torch.full((total,), self.pad_token_id, dtype=torch.int64)
        out_labels = torch.full((total,), IGNORE_INDEX, dtype=torch.int64)
        input_ids[dest], out_labels[dest] = ids, labels
        out_labels[starts] = IGNORE_INDEX
        # numpy, not torch.repeat_interleave: its CPU kernel wakes every torch thread on each call
        position_ids = torch.from_numpy(np.arange(total) - np.repeat(cu_seqlens[:-1], segments))
        batch = {
            "input_ids": input_ids[None],
            "labels": out_labels[None],
            "position_ids": position_ids[None],
            "cu_seqlens": torch.from_numpy(cu_seqlens).to(torch.int32),
            "max_seqlen": int(segments.max()),
        }
        if self.pad_document_to_multiple_of is not None:
            real = np.append(lengths, 0) if len(segments) > len(lengths) else lengths
            batch["cu_seqlens_unpadded"] = torch.from_numpy(np.concatenate([[0], np.cumsum(real)])).to(torch.int32)
        for key, parts in fields.tokens.items():
            batch[key] = pad_token_field(parts, self.token_fields[key], (total,), dest)[None]
        batch |= fields.samples
        loss = int((out_labels != IGNORE_INDEX).sum())
        stats = _scalars(meta, documents=len(docs), real=len(ids), total=total, loss=loss, is_empty=dummy is not None)
        return batch | stats


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedCollator:
    """Right-pads a microbatch into ``[B, L]`` rows (dynamic batching or the padded baseline).

    Rows of 3, 5 and 2 tokens with ``pad_to_multiple_of=3`` (``-`` is ``-100``, ``p`` the pad token)::

        input_ids       a a a p p p    labels   - a a - - -    attention_mask  1 1 1 0 0 0
                        b b b b b p             - b b b b -                    1 1 1 1 1 0
                        c c p p p p             - c - - - -                    1 1 0 0 0 0
        position_ids    0 1 2 3 4 5 in every row (padding positions keep counting)

    The output dict holds ``input_ids``, ``labels``, ``attention_mask`` and ``position_ids`` (int64 ``[B, L]``,
    no ``cu_seqlens``) and the same scalars as :class:`PackedCollator` (``num_padding_tokens = B * L -
    num_real_tokens``). An empty microbatch becomes one dummy row of padding with every label ``-100``; its
    ``attention_mask`` is all ones so that no attention row is fully masked (which makes SDPA return NaN).

    Args:
        pad_token_id: token id written on padding positions.
        pad_to_multiple_of: round ``L`` up to a multiple of this (the plan's ``sequence_length_round``).
        token_fields: extra per-token fields to carry, each name mapped to its pad value; each arrives as a
            ``[B, L]`` tensor aligned with ``input_ids`` (see :mod:`lit_seqpack.data.fields`).
        sample_fields: extra per-sample fields to carry; each arrives as a ``[B]`` tensor (one value a row).

    Example:
        >>> batch = PaddedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
        ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]])
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    token_fields: Mapping[str, float | int] | None = None
    sample_fields: Sequence[str] | None = None
    _reported: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_knob("pad_token_id", self.pad_token_id, minimum=0, optional=False)
        _check_knob("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        _declare(self)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        meta = getattr(samples, "meta", None)
        if _is_empty(samples, meta):
            width = self.pad_to_multiple_of or 1
            input_ids = torch.full((1, width), self.pad_token_id, dtype=torch.int64)
            batch = {
                "input_ids": input_ids,
                "labels": torch.full_like(input_ids, IGNORE_INDEX),
                "attention_mask": torch.ones_like(input_ids),
                "position_ids": torch.arange(width)[None],
            }
            batch |= self._fields(empty_fields(self.token_fields, self.sample_fields), (1, width), slice(0, 0))
            return batch | _scalars(meta, documents=0, real=0, total=width, loss=0, is_empty=True)
        docs, ids, labels = _read_samples(samples)
        fields = _read_fields(self, samples, docs)
        lengths = torch.tensor([len(d) for d in docs])
        rows, width = len(docs), _round_up(int(lengths.max()), self.pad_to_multiple_of)
        real = torch.arange(width) < lengths[:, None]
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.int64)
        out_labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.int64)
        input_ids[real], out_labels[real] = ids, labels  # row-major order matches the concatenation
        out_labels[:, 0] = IGNORE_INDEX
        batch = {
            "input_ids": input_ids,
            "labels": out_labels,
            "attention_mask": real.long(),
            "position_ids": torch.arange(width).expand(rows, width).contiguous(),
        }
        batch |= self._fields(fields, (rows, width), real.view(-1))
        loss = int((out_labels != IGNORE_INDEX).sum())
        return batch | _scalars(meta, documents=rows, real=len(ids), total=rows * width, loss=loss, is_empty=False)

    def _fields(self, fields: FieldValues, shape: tuple[int, int], where: slice | torch.Tensor) -> dict[str, Any]:
        tokens = {
            key: pad_token_field(parts, self.token_fields[key], shape, where) for key, parts in fields.tokens.items()
        }
        return tokens | fields.samples
