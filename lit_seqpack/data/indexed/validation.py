"""One validation of the samples at setup, for every source, with the collators' rules.

The collators refuse bad samples too, but only when a microbatch holding one is built, mid-epoch, naming its
position in the microbatch. :func:`scan_dataset` checks every sample once before training and names its dataset
index (the file and line or row where there is one):

- ``input_ids``: a non-empty flat list of ints ``>= 0``; no bool (``True`` is not token 1), no ``None``;
- ``labels`` (ids ``>= 0`` or -100) or ``loss_mask`` (0/1; weights in ``[0, 1]`` with ``weighted_mask``, i.e.
  ``loss_weight_field="loss_mask"``), the same length as ``input_ids``, never ``None``;
- the lengths and loss tokens a dataset offers (``dataset.lengths``) agree with its samples;
- every id (``input_ids``, ``labels`` and ``pad_token_id``) is below the model's vocabulary when it is known.

Cost (measured on a loaded 2-core machine): pre-tokenised data (:class:`~lit_seqpack.data.sources.TokenizedDataset`,
which every file reader and ``TextDataset`` build) was validated, vectorised, when it was read; here it costs one
``max`` over the token buffer and the labels (1.3 s for 1M samples of 410M tokens). The synthetic task is valid by
construction (nothing is read). Any other map-style dataset is read once, which also gives its lengths: chunks of
4096 samples whose fields are all plain lists, all 1-D tensors or all 1-D arrays are checked vectorised (about
12 us a sample of 100 tokens as Python lists or tensors, 5.5 us as arrays: 12 s per million samples); a chunk
holding anything else, or a bad sample, is read sample by sample, so that the message names the sample exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.indexed.splits import read_sample
from lit_seqpack.data.sources.base import declared_counts

__all__ = ["DataScan", "check_vocab_range", "scan_dataset"]


@dataclass(frozen=True, slots=True)
class DataScan:
    """What one validation pass learnt about a dataset.

    Args:
        lengths: token count of every sample.
        loss_tokens: loss tokens of every sample.
        max_id: the largest id of ``input_ids`` and ``labels`` (-1 for no id).
        max_where: where that id is (``"dataset[3]"`` or a file and line), for messages.
    """

    lengths: np.ndarray
    loss_tokens: np.ndarray
    max_id: int
    max_where: str


def scan_dataset(dataset: Sequence[Mapping[str, Any]], *, weighted_mask: bool = False) -> DataScan:
    """Validate every sample of ``dataset`` (vectorised where the source is columnar) and return its facts.

    Args:
        dataset: a map-style dataset.
        weighted_mask: ``loss_mask`` may hold weights in ``[0, 1]`` (``loss_weight_field="loss_mask"``); a token
            whose weight is not 0 is a loss token, as in the collators. Otherwise ``loss_mask`` must be 0/1.

    Raises:
        ValueError: the first bad sample, naming its dataset index and the rule it breaks; or ``lengths`` /
            ``loss_tokens`` attributes that disagree with the samples.
    """
    from lit_seqpack.data.sources import SyntheticInstructionDataset
    from lit_seqpack.data.sources.tokenized import TokenizedDataset

    if isinstance(dataset, TokenizedDataset):
        return _scan_columnar(dataset)
    if isinstance(dataset, SyntheticInstructionDataset):
        return DataScan(
            np.asarray(dataset.lengths, dtype=np.int64),
            np.asarray(dataset.loss_tokens, dtype=np.int64),
            dataset.config.vocab_size - 1,
            f"the synthetic task (vocab_size={dataset.config.vocab_size})",
        )
    return _scan_samples(dataset, weighted_mask)


def _scan_columnar(dataset: Any) -> DataScan:
    tokens, labels = dataset.tokens, dataset.labels
    top = int(tokens.max())
    where_flat, kind = int(np.argmax(tokens)), "input_ids"
    if labels is not None and labels.size and int(labels.max()) > top:
        top, where_flat, kind = int(labels.max()), int(np.argmax(labels)), "labels"
    row = int(np.searchsorted(dataset.offsets, where_flat, side="right") - 1)
    return DataScan(
        np.asarray(dataset.lengths, dtype=np.int64),
        np.asarray(dataset.loss_tokens, dtype=np.int64),
        top,
        f"{dataset.source}, sample {row} ({kind})",
    )


_CHUNK = 4096


def _scan_samples(dataset: Sequence[Mapping[str, Any]], weighted_mask: bool) -> DataScan:
    """Read every sample once; chunks of plain Python lists are checked vectorised, anything else per sample."""
    size = len(dataset)
    lengths = np.empty(size, dtype=np.int64)
    loss_tokens = np.empty(size, dtype=np.int64)
    top, top_at = -1, 0
    for start in range(0, size, _CHUNK):
        samples = [read_sample(dataset, i) for i in range(start, min(start + _CHUNK, size))]
        facts = None if weighted_mask and _has_mask(samples) else _fast_chunk(samples)
        if facts is None:  # not plain lists, or a bad sample: per sample, so that the message names it exactly
            facts = _slow_chunk(samples, start, weighted_mask)
        chunk_lengths, chunk_loss, high, at = facts
        lengths[start : start + len(samples)] = chunk_lengths
        loss_tokens[start : start + len(samples)] = chunk_loss
        if high > top:
            top, top_at = high, start + at
    for name, scanned in (("lengths", lengths), ("loss_tokens", loss_tokens)):
        _check_offered(dataset, name, scanned)
    return DataScan(lengths, loss_tokens, top, f"dataset[{top_at}]")


_Facts = tuple[np.ndarray, np.ndarray, int, int]


def _has_mask(samples: list[Any]) -> bool:
    """Whether a sample of the chunk gives a ``loss_mask`` (weights are read by the per-sample path)."""
    return any(isinstance(sample, Mapping) and "loss_mask" in sample for sample in samples)


def _slow_chunk(samples: list[Any], start: int, weighted_mask: bool = False) -> _Facts:
    from lit_seqpack.data.sources.tokenized import validate_record

    lengths = np.empty(len(samples), dtype=np.int64)
    loss_tokens = np.empty(len(samples), dtype=np.int64)
    top, top_at = -1, 0
    for offset, sample in enumerate(samples):
        i = start + offset
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise TypeError(f"dataset[{i}] must be a mapping with 'input_ids', got {type(sample).__name__}")
        ids, labels = validate_record(sample, f"dataset[{i}]", weighted_mask=weighted_mask)
        lengths[offset] = len(ids)
        if labels is None:
            loss_tokens[offset], high = len(ids) - 1, int(ids.max())
        else:
            loss_tokens[offset] = int((labels[1:] != IGNORE_INDEX).sum())
            high = max(int(ids.max()), int(labels.max()))
        if high > top:
            top, top_at = high, offset
    return lengths, loss_tokens, top, top_at


def _fast_chunk(samples: list[Any]) -> _Facts | None:
    """The chunk's facts when every field is a plain list of valid ints, else ``None`` (the per-sample path)."""
    ids_lists, label_lists, mask_lists = [], [], []
    for sample in samples:
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            return None
        labels, mask = sample.get("labels", _ABSENT), sample.get("loss_mask", _ABSENT)
        if (labels is not _ABSENT and mask is not _ABSENT) or labels is None or mask is None:
            return None  # the per-sample path names the problem
        ids_lists.append(sample["input_ids"])
        label_lists.append(None if labels is _ABSENT else labels)
        mask_lists.append(None if mask is _ABSENT else mask)
    ids = _flat_ints(ids_lists, allow_bool=False)
    if ids is None:
        return None
    lengths = np.fromiter(map(len, ids_lists), dtype=np.int64, count=len(ids_lists))
    if lengths.min() == 0 or ids.min() < 0 or ids.max() > _INT32_MAX:
        return None
    targets = ids.copy()
    for parts, allow_bool in ((label_lists, False), (mask_lists, True)):
        has = np.fromiter((part is not None for part in parts), dtype=bool, count=len(parts))
        if not has.any():
            continue
        given = [part for part in parts if part is not None]
        values = _flat_ints(given, allow_bool=allow_bool)
        if values is None or [len(part) for part in given] != lengths[has].tolist():
            return None
        where = np.repeat(has, lengths)
        if parts is label_lists:
            if ((values < 0) & (values != IGNORE_INDEX)).any() or values.max(initial=0) > _INT32_MAX:
                return None
            targets[where] = values
        else:
            if ((values != 0) & (values != 1)).any():
                return None
            targets[where] = np.where(values == 1, ids[where], IGNORE_INDEX)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    counted = targets != IGNORE_INDEX
    counted[offsets[:-1]] = False  # the first token of a document never has a target
    cumulative = np.concatenate(([0], np.cumsum(counted, dtype=np.int64)))
    loss_tokens = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
    highest = np.maximum(ids, targets)
    flat_at = int(np.argmax(highest))
    return lengths, loss_tokens, int(highest[flat_at]), int(np.searchsorted(offsets, flat_at, side="right") - 1)


_ABSENT = object()
_INT32_MAX = int(np.iinfo(np.int32).max)


def _flat_ints(parts: list[Any], *, allow_bool: bool) -> np.ndarray | None:
    """The concatenation of ``parts`` as int64 when they are all plain lists of ints, or all 1-D integer tensors or
    arrays (``allow_bool``: booleans too); else ``None`` (the per-sample path then names the problem)."""
    kind = type(parts[0])
    if kind is list:
        allowed = {int, bool} if allow_bool else {int}
        if any(type(part) is not list for part in parts):
            return None
        if not set(map(type, itertools.chain.from_iterable(parts))) <= allowed:
            return None
        total = sum(map(len, parts))
        try:
            return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=total)
        except OverflowError:
            return None
    import torch

    if kind is torch.Tensor:
        if any(type(p) is not torch.Tensor or p.dim() != 1 or p.is_floating_point() or p.is_complex() for p in parts):
            return None
        if not allow_bool and any(p.dtype == torch.bool for p in parts):
            return None
        return torch.cat([p.to(torch.int64) for p in parts]).cpu().numpy()
    if kind is np.ndarray:
        ok = "biu" if allow_bool else "iu"
        if any(type(p) is not np.ndarray or p.ndim != 1 or p.dtype.kind not in ok for p in parts):
            return None
        return np.concatenate(parts).astype(np.int64)
    return None


def _check_offered(dataset: Any, name: str, scanned: np.ndarray) -> None:
    """A ``lengths`` / ``loss_tokens`` attribute must agree with the samples (the planner trusts it)."""
    offered = declared_counts(dataset, name)
    if offered is None:
        return
    wrong = np.flatnonzero(offered != scanned)
    if wrong.size:
        i = int(wrong[0])
        raise ValueError(
            f"dataset.{name}[{i}] = {int(offered[i])} but dataset[{i}] has {int(scanned[i])} ({wrong.size} samples "
            f"disagree): the planner would pack by the wrong {name}; fix the dataset's {name} attribute"
        )


def check_vocab_range(scan: DataScan, *, vocab_size: int | None, pad_token_id: int, owner: str = "model") -> None:
    """Fail when a data id or the pad id is outside a known vocabulary (``None``: nothing to check).

    Args:
        scan: the data's facts from :func:`scan_dataset`.
        vocab_size: the number of ids the model embeds.
        pad_token_id: the id written on padding positions (it reaches the embedding too).
        owner: who has that vocabulary, for the message.

    Raises:
        ValueError: naming the id, where it is, the vocabulary size and the setting to change.
    """
    if vocab_size is None:
        return
    if pad_token_id >= vocab_size:
        raise ValueError(
            f"pad_token_id={pad_token_id} is >= the {owner}'s vocab_size={vocab_size}: padding would index past "
            f"the embedding. Set data.pad_token_id below {vocab_size} or raise the {owner}'s vocab_size"
        )
    if scan.max_id >= vocab_size:
        raise ValueError(
            f"token id {scan.max_id} ({scan.max_where}) is >= the {owner}'s vocab_size={vocab_size}: it would index "
            f"past the embedding. Raise the {owner}'s vocab_size to at least {scan.max_id + 1} (for ReferenceLM: "
            "model.init_args.vocab_size; for HFCausalLM: model.init_args.config.vocab_size) or fix the data"
        )


# model_vocab_size is the model's side of the vocabulary check: it lives in lit_seqpack.model.hf_load now
