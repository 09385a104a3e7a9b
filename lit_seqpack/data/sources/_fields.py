"""The declared token and sample fields of pre-tokenised files, read into flat columns at load time.

A file may carry more than ``input_ids`` / ``labels`` / ``loss_mask``. The fields the user declared
(``token_fields`` / ``sample_fields`` of the DataModule, see :mod:`lit_seqpack.data.batching.fields`) are kept:

- a token field as one flat buffer concatenated like the tokens (``float32`` when any value of the file is a
  float, ``int64`` otherwise), each record's values as long as its ``input_ids``;
- a sample field as one number a record (``float64`` when any value is a float, ``int64`` otherwise).

Any other key is counted and reported once per file (:func:`report_undeclared_keys`), never dropped silently.
"""

from __future__ import annotations

import logging
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["FieldColumns", "check_field_columns", "column_dtype", "report_undeclared_keys"]

log = logging.getLogger(__name__)

_READ_KEYS = frozenset({"input_ids", "labels", "loss_mask"})


def column_dtype(parts: Sequence[np.ndarray], *, token: bool) -> np.dtype:
    """The dtype of a whole field column: float when any part is floating point, else int64.

    Example:
        >>> column_dtype([np.array([1, 2]), np.array([0.5])], token=True), column_dtype([np.array([1])], token=False)
        (dtype('float32'), dtype('int64'))
    """
    if any(part.dtype.kind == "f" for part in parts):
        return np.dtype(np.float32 if token else np.float64)
    return np.dtype(np.int64)


def _token_values(value: Any, name: str, where: str, length: int) -> np.ndarray:
    """One record's values of the declared token field ``name``: 1-D numbers, as many as its tokens."""
    if value is None:
        raise ValueError(f"{where}: the declared token field {name!r} is missing")
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy()
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{where}: token field {name!r} must be a list of numbers, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as err:
        raise ValueError(f"{where}: token field {name!r} must be a flat list of numbers ({err})") from None
    if array.size == 0:
        array = np.empty(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "biuf":
        raise ValueError(f"{where}: token field {name!r} must be a flat list of numbers, got {value!r:.60}")
    if len(array) != length:
        raise ValueError(f"{where}: token field {name!r} has {len(array)} values but 'input_ids' has {length} tokens")
    return array.astype(np.int64) if array.dtype.kind == "b" else array


def _sample_value(value: Any, name: str, where: str) -> int | float:
    """One record's value of the declared sample field ``name``: a single number."""
    if value is None:
        raise ValueError(f"{where}: the declared sample field {name!r} is missing")
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: sample field {name!r} must be one number a sample, got {value!r:.60}")
    return int(value) if isinstance(value, (bool, np.bool_)) else value


class FieldColumns:
    """Collects the declared fields of records one by one, and counts the keys nobody declared.

    Args:
        token_fields: the declared per-token field names.
        sample_fields: the declared per-sample field names.

    Example:
        >>> columns = FieldColumns(["weights"], ["reward"])
        >>> columns.add({"input_ids": [1, 2], "weights": [1, 0.5], "reward": 3, "id": "a"}, "record 0", 2)
        >>> tokens, samples = columns.columns()
        >>> tokens["weights"].tolist(), samples["reward"].tolist(), dict(columns.undeclared)
        ([1.0, 0.5], [3], {'id': 1})
    """

    def __init__(self, token_fields: Sequence[str], sample_fields: Sequence[str]) -> None:
        self.token_fields = tuple(token_fields)
        self.sample_fields = tuple(sample_fields)
        self.undeclared: Counter[str] = Counter()
        self._known = _READ_KEYS | set(self.token_fields) | set(self.sample_fields)
        self._tokens: dict[str, list[np.ndarray]] = {name: [] for name in self.token_fields}
        self._samples: dict[str, list[int | float]] = {name: [] for name in self.sample_fields}

    def add(self, record: Mapping[str, Any], where: str, length: int) -> None:
        """Read the declared fields of one validated record with ``length`` tokens.

        Raises:
            ValueError: a declared field is missing, not numbers, or (token field) not ``length`` values long,
                naming ``where``, the field and both lengths.
        """
        for name in self.token_fields:
            self._tokens[name].append(_token_values(record.get(name), name, where, length))
        for name in self.sample_fields:
            self._samples[name].append(_sample_value(record.get(name), name, where))
        self.undeclared.update(str(key) for key in record if key not in self._known)

    def columns(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The flat token-field buffers and the per-sample value arrays, each in its column dtype."""
        tokens = {
            name: np.concatenate(parts).astype(column_dtype(parts, token=True)) for name, parts in self._tokens.items()
        }
        samples = {}
        for name, values in self._samples.items():
            is_float = any(isinstance(v, (float, np.floating)) for v in values)
            try:
                samples[name] = np.asarray(values, dtype=np.float64 if is_float else np.int64)
            except OverflowError:
                raise ValueError(f"sample field {name!r} holds an integer beyond int64: {max(values)}") from None
        return tokens, samples


def check_field_columns(
    tokens: Mapping[str, np.ndarray], samples: Mapping[str, np.ndarray], num_tokens: int, num_samples: int, where: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Validate field columns handed to a dataset: flat buffers of ``num_tokens`` numbers, ``num_samples`` values.

    Raises:
        ValueError: a column of the wrong shape or not numeric, naming ``where`` and the field.
    """
    out: list[dict[str, np.ndarray]] = []
    for kind, columns, size in (("token", tokens, num_tokens), ("sample", samples, num_samples)):
        checked = {}
        for name, column in columns.items():
            array = np.ascontiguousarray(column)
            if array.shape != (size,) or array.dtype.kind not in "iuf":
                raise ValueError(
                    f"{where}: {kind} field {name!r} must be {size} numbers (one a {kind}), got an array of shape "
                    f"{array.shape} and dtype {array.dtype}"
                )
            checked[name] = array
        out.append(checked)
    return out[0], out[1]


def report_undeclared_keys(counts: Mapping[str, int], num_samples: int, source: str) -> None:
    """Warn once that ``source`` holds keys that are neither read nor declared, with how many samples carry each."""
    if not counts:
        return
    found = ", ".join(f"{key!r} ({count} of {num_samples} samples)" for key, count in sorted(counts.items()))
    log.warning(
        "%s: the samples carry %s, which are not loaded: declare per-token fields with "
        "token_fields={name: pad_value} and per-sample fields with sample_fields=[name] (data.token_fields / "
        "data.sample_fields in YAML) to carry them in the batches, or remove them from the data",
        source,
        found,
    )
