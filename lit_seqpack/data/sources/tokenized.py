"""Pre-tokenised data on disk: JSONL, Parquet and Hugging Face ``save_to_disk`` directories.

Every loader validates each record (``input_ids`` a non-empty list of non-negative ints, optional
``labels`` of the same length holding ids or -100) and raises a ``ValueError`` naming the file, the
line or row, and the problem. Samples are held as one flat ``int32`` token buffer plus offsets, so a
million documents cost two arrays, ``lengths`` and ``loss_tokens`` are free, and the dataset pickles
cheaply into DataLoader workers.

Declared extra fields (``token_fields`` / ``sample_fields``, see :mod:`lit_seqpack.data.sources.tokenized`) are kept
as flat columns and returned by ``__getitem__``; every other key of the data is counted and reported once.

Parquet needs ``pyarrow`` and ``save_to_disk`` directories need ``datasets``; both are optional and
imported only by the loader that needs them.

The declared token and sample fields of pre-tokenised files, read into flat columns at load time.

A file may carry more than ``input_ids`` / ``labels`` / ``loss_mask``. The fields the user declared
(``token_fields`` / ``sample_fields`` of the DataModule, see :mod:`lit_seqpack.data.batching.fields`) are kept:

- a token field as one flat buffer concatenated like the tokens (``float32`` when any value of the file is a
  float, ``int64`` otherwise), each record's values as long as its ``input_ids``;
- a sample field as one number a record (``float64`` when any value is a float, ``int64`` otherwise).

Any other key is counted and reported once per file (:func:`report_undeclared_keys`), never dropped silently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import numbers
import operator
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import IGNORE_INDEX

__all__ = [
    "file_fingerprint",
    "text_lines",
    "TOKENIZED_FORMATS",
    "TokenizedDataset",
    "load_tokenized",
    "FieldColumns",
    "check_field_columns",
    "column_dtype",
    "report_undeclared_keys",
]


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


TOKENIZED_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet", "hf_disk")
_INT32_MAX = np.iinfo(np.int32).max


class TokenizedDataset(torch.utils.data.Dataset):
    """Map-style pre-tokenised samples: ``dataset[i] -> {"input_ids": LongTensor[L], "labels"?: LongTensor[L], ...}``.

    Build it with :meth:`from_records`, :meth:`from_jsonl`, :meth:`from_parquet`, :meth:`from_hf_disk`
    or :func:`load_tokenized`. Samples without labels are returned without a ``labels`` key (every
    token is trained on); when only some records have labels, the others get a copy of their ids.

    Args:
        tokens: all token ids, concatenated (1-D integer array).
        offsets: ``num_samples + 1`` increasing offsets into ``tokens``; sample ``i`` is
            ``tokens[offsets[i]:offsets[i + 1]]``.
        labels: the labels, concatenated like ``tokens``, or ``None``.
        token_fields: declared per-token fields, each a flat buffer concatenated like ``tokens`` (float or int);
            sample ``i`` gets ``buffer[offsets[i]:offsets[i + 1]]`` as a tensor under the field's name.
        sample_fields: declared per-sample fields, one number a sample; sample ``i`` gets a Python number.
        source: where the data came from (used in messages).
        fingerprint: a stable identity of the content; ``None`` hashes the arrays (lazily, when first asked).

    Example:
        >>> ds = TokenizedDataset.from_records([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8]}])
        >>> ds.lengths.tolist(), ds.loss_tokens.tolist(), ds[1]["labels"].tolist()
        ([3, 1], [2, 0], [8])
    """

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray | None = None,
        *,
        token_fields: Mapping[str, np.ndarray] | None = None,
        sample_fields: Mapping[str, np.ndarray] | None = None,
        source: str = "<memory>",
        fingerprint: str | Callable[[], str] | None = None,
    ) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.labels = None if labels is None else np.ascontiguousarray(labels, dtype=np.int32)
        self.source = source
        self._fingerprint = fingerprint
        if self.offsets.ndim != 1 or len(self.offsets) < 2 or self.offsets[0] != 0:
            raise ValueError(f"{source}: offsets must start at 0 and describe at least one sample")
        if self.offsets[-1] != len(self.tokens) or (np.diff(self.offsets) <= 0).any():
            raise ValueError(f"{source}: offsets must increase strictly and end at len(tokens)={len(self.tokens)}")
        if self.labels is not None and self.labels.shape != self.tokens.shape:
            raise ValueError(f"{source}: labels hold {len(self.labels)} entries but tokens hold {len(self.tokens)}")
        self.token_fields, self.sample_fields = check_field_columns(
            token_fields or {}, sample_fields or {}, len(self.tokens), len(self.offsets) - 1, source
        )
        self.lengths = np.diff(self.offsets)
        self.lengths.flags.writeable = False
        self.loss_tokens = _loss_tokens(self.labels, self.offsets)
        self.loss_tokens.flags.writeable = False

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        start, stop = self.offsets[i], self.offsets[i + 1]
        sample = {"input_ids": torch.from_numpy(self.tokens[start:stop].astype(np.int64))}
        if self.labels is not None:
            sample["labels"] = torch.from_numpy(self.labels[start:stop].astype(np.int64))
        for name, buffer in self.token_fields.items():
            sample[name] = torch.from_numpy(buffer[start:stop].copy())
        for name, values in self.sample_fields.items():
            sample[name] = values[i].item()
        return sample

    @property
    def fingerprint(self) -> str:
        """Identity of the content: a hash of the file's bytes (computed once, when asked), else of the arrays."""
        if callable(self._fingerprint):
            self._fingerprint = self._fingerprint()
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=20)
            for array in (self.offsets, self.tokens, self.labels if self.labels is not None else np.empty(0)):
                digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
            self._fingerprint = f"content:{digest.hexdigest()}"
        return self._fingerprint

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        *,
        source: str = "<memory>",
        token_fields: Sequence[str] = (),
        sample_fields: Sequence[str] = (),
    ) -> TokenizedDataset:
        """Validate and pack in-memory records (mappings with ``input_ids``, optional ``labels``, declared fields)."""
        fields = FieldColumns(token_fields, sample_fields)
        return _pack(((f"{source}, record {i}", r) for i, r in enumerate(records)), source, None, "None", fields)

    @classmethod
    def from_jsonl(
        cls, path: str | os.PathLike[str], *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> TokenizedDataset:
        """Read a JSONL file: one JSON object per line; whitespace-only lines are skipped."""
        path = Path(path)
        fingerprint = functools.partial(file_fingerprint, "jsonl", path)
        return _pack(_jsonl_records(path), str(path), fingerprint, "null", FieldColumns(token_fields, sample_fields))

    @classmethod
    def from_parquet(
        cls, path: str | os.PathLike[str], *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> TokenizedDataset:
        """Read a Parquet file: an ``input_ids`` list-of-int column, optional ``labels`` or ``loss_mask`` columns,
        and the declared field columns (a list of numbers a row for a token field, a number for a sample field)."""
        from lit_seqpack.data.sources._arrow import parquet_table

        path = Path(path)
        fields = (*token_fields, *sample_fields)
        table, names = parquet_table(path, ("input_ids", "labels", "loss_mask", *fields))
        fingerprint = functools.partial(file_fingerprint, "parquet", path)
        return _from_table(cls, table, names, str(path), fingerprint, tuple(token_fields), tuple(sample_fields))

    @classmethod
    def from_hf_disk(
        cls,
        path: str | os.PathLike[str],
        *,
        split: str | None = None,
        token_fields: Sequence[str] = (),
        sample_fields: Sequence[str] = (),
    ) -> TokenizedDataset:
        """Read a directory written by ``datasets.Dataset.save_to_disk`` (``split`` picks one of a DatasetDict)."""
        from lit_seqpack.data.sources._arrow import hf_disk_table

        path = Path(path)
        where = f"{path}" if split is None else f"{path} [split {split!r}]"
        table, names = hf_disk_table(path, split, (*token_fields, *sample_fields))
        fingerprint = functools.partial(file_fingerprint, f"hf_disk:{split}", path)
        return _from_table(cls, table, names, where, fingerprint, tuple(token_fields), tuple(sample_fields))


def _from_table(
    cls: type[TokenizedDataset],
    table: Any,
    names: list[str],
    where: str,
    fingerprint: Callable[[], str],
    token_fields: tuple[str, ...],
    sample_fields: tuple[str, ...],
) -> TokenizedDataset:
    """A dataset of a validated Arrow table, its declared fields kept and its other columns reported."""
    from lit_seqpack.data.sources._arrow import table_fields, table_to_arrays

    tokens, offsets, labels = table_to_arrays(table, where)
    token_columns, sample_columns = table_fields(table, where, offsets, token_fields, sample_fields)
    known = {"input_ids", "labels", "loss_mask", *token_fields, *sample_fields}
    report_undeclared_keys({name: table.num_rows for name in names if name not in known}, table.num_rows, where)
    return cls(
        tokens,
        offsets,
        labels,
        token_fields=token_columns,
        sample_fields=sample_columns,
        source=where,
        fingerprint=fingerprint,
    )


def load_tokenized(
    path: str | os.PathLike[str],
    format: str = "auto",
    *,
    split: str | None = None,
    token_fields: Sequence[str] = (),
    sample_fields: Sequence[str] = (),
) -> TokenizedDataset:
    """Load pre-tokenised data; ``format="auto"`` picks by suffix (``.jsonl``, ``.parquet``) or directory.

    Args:
        path: a ``.jsonl``/``.json`` file, a ``.parquet`` file, or a ``save_to_disk`` directory.
        format: one of ``TOKENIZED_FORMATS``.
        split: the split of a saved ``DatasetDict`` (``hf_disk`` only).
        token_fields: names of the declared per-token fields to keep (each as long as ``input_ids``).
        sample_fields: names of the declared per-sample fields to keep (one number a sample).
    """
    path = Path(path)
    if format not in TOKENIZED_FORMATS:
        raise ValueError(f"format={format!r} must be one of {TOKENIZED_FORMATS}")
    if not path.exists():
        raise ValueError(f"path={str(path)!r} does not exist")
    if format == "auto":
        format = _detect_format(path)
    if split is not None and format != "hf_disk":
        raise ValueError(f"split={split!r} only applies to format='hf_disk', not {format!r}")
    fields = {"token_fields": tuple(token_fields), "sample_fields": tuple(sample_fields)}
    if format == "jsonl":
        return TokenizedDataset.from_jsonl(path, **fields)
    if format == "parquet":
        return TokenizedDataset.from_parquet(path, **fields)
    return TokenizedDataset.from_hf_disk(path, split=split, **fields)


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "hf_disk"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"format='auto' cannot tell the format of {str(path)!r}; pass format='jsonl' or 'parquet'")


def _jsonl_records(path: Path) -> Iterable[tuple[str, Any]]:
    for number, line in text_lines(path):
        if not line.strip():
            continue
        try:
            yield f"{path}, line {number}", json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: invalid JSON ({err.msg})") from err
        except RecursionError:
            raise ValueError(
                f"{path}, line {number}: JSON nested too deeply to parse (a sample is one flat object)"
            ) from None


def _pack(
    records: Iterable[tuple[str, Any]],
    source: str,
    fingerprint: Callable[[], str] | None,
    null: str,
    fields: FieldColumns,
) -> TokenizedDataset:
    ids_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray | None] = []
    for where, record in records:
        ids, labels = validate_record(record, where, null=null)
        fields.add(record, where, len(ids))
        ids_parts.append(ids)
        label_parts.append(labels)
    if not ids_parts:
        raise ValueError(f"{source}: no samples")
    tokens = np.concatenate(ids_parts)
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in ids_parts])))
    labels = None
    if any(part is not None for part in label_parts):
        labels = np.concatenate([ids if lab is None else lab for ids, lab in zip(ids_parts, label_parts, strict=True)])
    report_undeclared_keys(fields.undeclared, len(ids_parts), source)
    token_columns, sample_columns = fields.columns()
    return TokenizedDataset(
        tokens,
        offsets,
        labels,
        token_fields=token_columns,
        sample_fields=sample_columns,
        source=source,
        fingerprint=fingerprint,
    )


def validate_record(
    record: Any, where: str, *, null: str = "None", weighted_mask: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Check one record and return its ``input_ids`` and ``labels`` (or ``None``) as int32 arrays.

    The rules are the collators': ``input_ids`` a non-empty flat list of ints ``>= 0`` (no bool, no None),
    optional ``labels`` (ids or -100) or ``loss_mask`` (0/1 or bools) of the same length, not both.

    Args:
        record: the sample mapping.
        where: how messages name it (``"data.jsonl, line 3"``, ``"dataset[150]"``).
        null: how the source spells a missing value (``"null"`` in JSON), in the message refusing a ``None``
            ``labels`` / ``loss_mask`` (read as "no labels" it would train every token, the prompt included; the
            collators and the Parquet reader refuse it too).
        weighted_mask: ``loss_mask`` holds loss weights in ``[0, 1]`` (``loss_weight_field="loss_mask"``); the
            labels then mask the tokens whose weight is 0.

    Raises:
        ValueError: naming ``where`` and the problem.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object with 'input_ids', got {type(record).__name__}")
    if "input_ids" not in record:
        raise ValueError(f"{where}: missing 'input_ids' (keys: {sorted(record)})")
    ids = _int_array(record["input_ids"], "input_ids", where)
    if len(ids) == 0:
        raise ValueError(f"{where}: 'input_ids' is empty")
    if ids.min() < 0:
        position = int(np.argmax(ids < 0))
        raise ValueError(f"{where}: 'input_ids' has negative id {int(ids[position])} at position {position}")
    for key in ("labels", "loss_mask"):
        if key in record and record[key] is None:
            raise ValueError(f"{where}: '{key}' is {null}; omit the key to train on every token")
    labels = record.get("labels")
    if record.get("loss_mask") is not None:
        if labels is not None:
            raise ValueError(f"{where}: give either 'labels' or 'loss_mask', not both")
        return ids, _mask_to_labels(ids, record["loss_mask"], where, weighted=weighted_mask)
    if labels is None:
        return ids, None
    labels = _int_array(labels, "labels", where)
    if len(labels) != len(ids):
        raise ValueError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
    bad = (labels < 0) & (labels != IGNORE_INDEX)
    if bad.any():
        position = int(np.argmax(bad))
        raise ValueError(
            f"{where}: 'labels' has {int(labels[position])} at position {position}; labels are ids >= 0 or -100"
        )
    return ids, labels


def _mask_to_labels(ids: np.ndarray, loss_mask: Any, where: str, *, weighted: bool = False) -> np.ndarray:
    """``loss_mask`` (1 = train on the token, 0 = do not) as labels: the id where 1, -100 where 0.

    ``weighted``: the mask holds weights in ``[0, 1]``; every token of a non-zero weight keeps its id.
    """
    if weighted:
        return _weights_to_labels(ids, loss_mask, where)
    if _holds_floats(loss_mask):
        raise ValueError(
            f"{where}: 'loss_mask' must hold only 0 and 1, found floats; for loss weights in [0, 1] set "
            "loss_weight_field='loss_mask'"
        )
    mask = _int_array(loss_mask, "loss_mask", where, allow_bool=True)
    if len(mask) != len(ids):
        raise ValueError(f"{where}: 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"{where}: 'loss_mask' must hold only 0 and 1, got {sorted(set(mask.tolist()))}")
    return np.where(mask == 1, ids, IGNORE_INDEX).astype(np.int32)


def _holds_floats(values: Any) -> bool:
    """Whether a list holds a Python float, or an array or tensor has a floating dtype."""
    if isinstance(values, (list, tuple)):
        return any(type(value) is float for value in values)
    if isinstance(values, torch.Tensor):
        return values.is_floating_point()
    return isinstance(values, np.ndarray) and values.dtype.kind == "f"


def _weights_to_labels(ids: np.ndarray, loss_mask: Any, where: str) -> np.ndarray:
    """A weighted ``loss_mask`` (finite numbers in ``[0, 1]``) as labels: the id where the weight is not 0."""
    if isinstance(loss_mask, torch.Tensor):
        loss_mask = loss_mask.cpu().numpy()
    if not isinstance(loss_mask, (list, tuple, np.ndarray)):
        raise ValueError(f"{where}: 'loss_mask' must be a list of weights, got {type(loss_mask).__name__}")
    try:
        weights = np.asarray(loss_mask, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: 'loss_mask' must be a flat list of weights in [0, 1] ({err})") from None
    if weights.ndim != 1 or len(weights) != len(ids):
        raise ValueError(f"{where}: 'loss_mask' has shape {weights.shape} but 'input_ids' has {len(ids)} tokens")
    bad = ~np.isfinite(weights) | (weights < 0) | (weights > 1)
    if bad.any():
        position = int(np.argmax(bad))
        raise ValueError(
            f"{where}: 'loss_mask' has {weights[position]} at position {position}; with "
            "loss_weight_field='loss_mask' its values are weights in [0, 1]"
        )
    return np.where(weights != 0, ids, IGNORE_INDEX).astype(np.int32)


def _int_array(value: Any, key: str, where: str, *, allow_bool: bool = False) -> np.ndarray:
    if not isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        raise ValueError(f"{where}: '{key}' must be a list of ints, got {type(value).__name__}")
    if isinstance(value, (list, tuple)) and not allow_bool:
        kinds = set(map(type, value))  # C speed; numpy would silently turn [5, True] into [5, 1]
        if bool in kinds or np.bool_ in kinds:
            position = next(i for i, v in enumerate(value) if isinstance(v, (bool, np.bool_)))
            raise ValueError(
                f"{where}: '{key}' must be a flat list of ints, found bool ({value[position]!r} at position "
                f"{position}); booleans are not token ids"
            )
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as err:
        raise ValueError(f"{where}: '{key}' must be a flat list of ints ({err})") from err
    if array.size == 0:
        return np.empty(0, dtype=np.int32)
    if allow_bool and array.dtype == np.bool_:
        array = array.astype(np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        kinds = sorted({type(v).__name__ for v in np.ravel(array).tolist() if type(v) is not int})
        found = ", ".join(kinds) if kinds else ("nested lists" if array.ndim != 1 else "ids beyond int64")
        raise ValueError(f"{where}: '{key}' must be a flat list of ints, found {found}")
    if array.max() > _INT32_MAX:
        raise ValueError(f"{where}: '{key}' has id {int(array.max())} above {_INT32_MAX}")
    return array.astype(np.int32)


def _loss_tokens(labels: np.ndarray | None, offsets: np.ndarray) -> np.ndarray:
    """Per sample, positions after the first whose label is not -100 (length - 1 without labels)."""
    if labels is None:
        return np.diff(offsets) - 1
    counted = labels != IGNORE_INDEX
    counted[offsets[:-1]] = False  # the first token of a document never has a target
    cumulative = np.concatenate(([0], np.cumsum(counted, dtype=np.int64)))
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def text_lines(path: Path) -> Iterable[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file (a leading BOM is dropped); other encodings fail naming the line.

    Raises:
        ValueError: naming the file, the line and the byte that is not UTF-8 (and gzip or UTF-16 when it is).
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1:
                hint = next((why for magic, why in _NOT_UTF8.items() if raw.startswith(magic)), None)
                if hint is not None:
                    raise ValueError(f"{path}: not UTF-8 text, {hint}")
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                    "JSONL and text files must be UTF-8"
                ) from err


def file_fingerprint(kind: str, path: Path) -> str:
    """``kind`` and a SHA-256 of the bytes of a file, or of every file (with its relative name) under a directory.

    The content, not the size and mtime: a same-size rewrite changes it. Streaming costs about 0.16 s per 100 MB
    (4% of reading a 100 MB JSONL file), and it is computed only when the fingerprint is asked for.
    """
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path) if path.is_dir() else ''}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda handle=handle: handle.read(1 << 20), b""):
                digest.update(chunk)
    return f"{kind}:sha256:{digest.hexdigest()}"


"""The splits a source is asked for."""


_NOT_UTF8 = {
    b"\x1f\x8b": "it is gzip-compressed: decompress it first (gunzip)",
    b"\xff\xfe": "it is UTF-16 (little-endian BOM): re-encode it as UTF-8",
    b"\xfe\xff": "it is UTF-16 (big-endian BOM): re-encode it as UTF-8",
}
