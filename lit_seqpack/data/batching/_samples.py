"""Reading and validating a microbatch's samples for the collators: ids, labels (or a ``loss_mask``), names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import IGNORE_INDEX

__all__ = [
    "SampleName",
    "read_samples",
    "sample_loss_tokens",
    "sample_name",
    "sample_names",
    "token_arrays",
    "window_loss_tokens",
]

_INT64 = np.dtype(np.int64)
"""An array's dtype is this object when it is native int64 (another byte order reads the slow way)."""


def _int_vector(value: Any, name: str, key: str, *, allow_bool: bool = False) -> torch.Tensor:
    """``value`` as a 1-D int64 tensor, or a ValueError naming the sample (``name``) and ``key``."""
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:  # a stream's (token_arrays)
        return torch.from_numpy(value)
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
    return tensor if tensor.dtype == torch.int64 else tensor.to(torch.int64)


def token_arrays(sample: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``sample`` with its ``input_ids`` and ``labels`` lists as int64 arrays, checked as the collators check them.

    A stream reads each sample once and then counts, cuts, hashes and collates it: converting the lists once here
    spares each later step its own conversion. Other keys and values that are not lists stay as they are.

    Raises:
        ValueError: a token list that is not 1-D integers (a bool, a float, a nested list), naming ``name``.

    Example:
        >>> token_arrays({"input_ids": [5, 6], "labels": [-100, 6], "id": "a"}, "sample 0")["labels"]
        array([-100,    6])
    """
    if not isinstance(sample, Mapping):
        return sample  # refused by name where it is read (the over-long counter, the collator)
    converted = None
    for key in ("input_ids", "labels"):
        value = sample.get(key)
        if not isinstance(value, (list, tuple)):
            continue
        if set(map(type, value)) <= {int}:  # plain ints (no bool): one pass, no dtype discovery
            try:
                array = np.fromiter(value, np.int64, len(value))
            except OverflowError:
                array = _int_vector(value, name, key).numpy()
        else:
            array = _int_vector(value, name, key).numpy()
        converted = dict(sample) if converted is None else converted
        converted[key] = array
    if converted is None:
        return sample
    relocated = getattr(sample, "relocated", None)  # keep where a stream sample comes from (streaming/_where.py)
    return converted if relocated is None else relocated(converted)


def _first_bad(parts: Sequence[np.ndarray], bad: np.ndarray) -> int:
    """Index of the part that holds the first True of ``bad`` (a mask over the concatenation of ``parts``)."""
    ends = np.cumsum([len(p) for p in parts])
    return int(np.searchsorted(ends, int(np.flatnonzero(bad)[0]), side="right"))


def _int_array(value: Any, name: str, key: str, *, allow_bool: bool = False) -> np.ndarray:
    """:func:`_int_vector` as a numpy array; a stream's int64 arrays (:func:`token_arrays`) pass as they are."""
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
        return value
    return _int_vector(value, name, key, allow_bool=allow_bool).numpy()


def sample_name(samples: Sequence[Any], index: int) -> str:
    """``sample 3`` (the position in the microbatch), with its dataset index when the loader attached them.

    Indices with a ``describe(position)`` method (a stream's: the stream sample, its file and line) say more.
    """
    indices = getattr(samples, "indices", None)
    if indices is None or index >= len(indices):
        return f"sample {index}"
    describe = getattr(indices, "describe", None)
    where = describe(index) if callable(describe) else f"dataset index {indices[index]}"
    return f"sample {index} of the microbatch ({where})"


class SampleName:
    """:func:`sample_name` of ``samples[index]``, worked out only when an error message formats it.

    A stream's names read its file to find the sample's line: naming every sample of every microbatch up front cost
    a file read per sample.
    """

    __slots__ = ("index", "samples")

    def __init__(self, samples: Sequence[Any], index: int) -> None:
        self.samples, self.index = samples, index

    def __str__(self) -> str:
        return sample_name(self.samples, self.index)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def sample_names(samples: Sequence[Any]) -> list[SampleName]:
    """The lazy names of a microbatch's samples, for error messages (see :class:`SampleName`)."""
    return [SampleName(samples, index) for index in range(len(samples))]


def read_samples(
    samples: Sequence[Mapping[str, Any]], weighted_mask: bool = False
) -> tuple[list[np.ndarray], torch.Tensor, torch.Tensor]:
    """Validate the samples; return each document's ids and the concatenated ids and labels (no shift).

    With ``weighted_mask`` a ``loss_mask`` may hold weights (checked by :mod:`~lit_seqpack.data.batching.loss_weights`);
    its zeros mask the labels. The checks run in numpy: a few small torch operations cost more than the whole
    microbatch's numpy work.
    """
    ids, labels = [], []
    for index, sample in enumerate(samples):
        ready = _ready_arrays(sample)
        if ready is not None:  # a stream's sample (token_arrays): the checks below hold already
            ids.append(ready[0])
            labels.append(ready[1])
            continue
        name = SampleName(samples, index)
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            found = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise ValueError(f"{name}: expected a mapping with 'input_ids', got {found}")
        doc = _int_array(sample["input_ids"], name, "input_ids")
        if doc.shape[0] == 0:
            raise ValueError(f"{name}: input_ids is empty (a document needs at least one token)")
        if "labels" in sample:
            if "loss_mask" in sample:
                raise ValueError(f"{name}: give either 'labels' or 'loss_mask', not both")
            target = _int_array(sample["labels"], name, "labels")
        elif "loss_mask" in sample and weighted_mask:
            mask = np.asarray(sample["loss_mask"], dtype=np.float64).reshape(-1)
            target = np.where(mask != 0, doc, IGNORE_INDEX) if len(mask) == len(doc) else mask
        elif "loss_mask" in sample:
            mask = _int_array(sample["loss_mask"], name, "loss_mask", allow_bool=True)
            if len(mask) == len(doc) and bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"{name}: loss_mask must hold only 0 and 1, got {np.unique(mask).tolist()}")
            target = np.where(mask != 0, doc, IGNORE_INDEX) if len(mask) == len(doc) else mask
        else:
            target = doc
        if target.shape[0] != doc.shape[0]:
            key = "labels" if "labels" in sample else "loss_mask"
            raise ValueError(f"{name}: {key} has {len(target)} entries but input_ids has {len(doc)}")
        ids.append(doc)
        labels.append(target)
    all_ids, all_labels = np.concatenate(ids), np.concatenate(labels)
    problems = []  # value checks run once on the concatenation; on failure, name the first bad sample
    if all_ids.min() < 0:
        problems.append((_first_bad(ids, all_ids < 0), "input_ids must be >= 0 (found a negative id)"))
    if all_labels.min() < 0:
        bad_labels = (all_labels < 0) & (all_labels != IGNORE_INDEX)
        if bad_labels.any():
            problems.append((_first_bad(labels, bad_labels), f"labels must be >= 0 or {IGNORE_INDEX}"))
    if problems:
        index, problem = min(problems)
        raise ValueError(f"{sample_name(samples, index)}: {problem}")
    return ids, torch.from_numpy(all_ids), torch.from_numpy(all_labels)


def _ready_arrays(sample: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A sample's ids and targets when both are non-empty 1-D int64 arrays of one length and there is no
    ``loss_mask`` (what :func:`token_arrays` makes of a stream's sample), else ``None``: the checks then run one by one.
    """
    if not isinstance(sample, dict):
        return None
    ids = sample.get("input_ids")
    if type(ids) is not np.ndarray or ids.dtype is not _INT64 or ids.ndim != 1 or not ids.shape[0]:
        return None
    target = sample.get("labels", ids)
    if type(target) is not np.ndarray or target.dtype is not _INT64 or target.shape != ids.shape:
        return None
    return (ids, target) if "loss_mask" not in sample else None


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
        return int(np.count_nonzero(np.asarray(labels)[1:] != IGNORE_INDEX))
    mask = sample.get("loss_mask")  # the collators' alternative to labels: 1 = train on the token
    if mask is not None:
        return int(np.count_nonzero(np.asarray(mask)[1:]))
    return max(len(sample["input_ids"]) - 1, 0)


def window_loss_tokens(samples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """:func:`sample_loss_tokens` of each sample, counted in one pass when every ``labels`` is an int64 array.

    A stream window's samples come out of :func:`token_arrays`, so their labels are arrays: one comparison over their
    concatenation replaces a few small numpy calls per sample. Samples without ``labels`` or ``loss_mask`` count
    ``length - 1``; any other mix is counted sample by sample.

    Example:
        >>> labels = [np.array([5, -100, 7]), np.array([9]), np.array([-100, 4])]
        >>> window_loss_tokens([{"input_ids": x, "labels": x} for x in labels]).tolist()
        [1, 0, 1]
        >>> window_loss_tokens([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]).tolist()
        [2, 0]
    """
    labels = [sample.get("labels") for sample in samples]
    if all(x is None and sample.get("loss_mask") is None for x, sample in zip(labels, samples, strict=True)):
        sizes = np.array([len(sample["input_ids"]) for sample in samples], dtype=np.int64)
        return np.maximum(sizes - 1, 0)
    if not all(type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1 and x.shape[0] for x in labels):
        return np.array([sample_loss_tokens(sample) for sample in samples], dtype=np.int64)
    sizes = np.array([x.shape[0] for x in labels], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    trained = np.concatenate(labels) != IGNORE_INDEX
    # summed per sample in one call (a cumsum of booleans costs 10x more); a first token predicts nothing
    return np.add.reduceat(trained, starts, dtype=np.int64) - trained[starts]
