"""Arrow tables (Parquet files, ``datasets.save_to_disk`` directories) to flat token arrays, validated per row.

``pyarrow`` and ``datasets`` are optional: they are imported here, inside the functions, and a missing
one raises an ``ImportError`` (:func:`lit_seqpack._imports.require`) that names the extra to install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack._imports import require
from lit_seqpack.batch import IGNORE_INDEX

_INT32_MAX = int(np.iinfo(np.int32).max)


def parquet_table(path: Path, columns: tuple[str, ...]) -> tuple[Any, list[str]]:
    """Read the wanted columns (those present) of a Parquet file as a ``pyarrow.Table``, and all column names."""
    pq = require("pyarrow.parquet", purpose="reading Parquet files")
    pa = require("pyarrow", purpose="reading Parquet files")
    try:
        names = pq.read_schema(path).names
        if "input_ids" not in names:  # before reading: the table read holds only the wanted columns
            raise ValueError(f"{path}: no 'input_ids' column (columns: {list(names)})")
        return pq.read_table(path, columns=[c for c in columns if c in names]), list(names)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from err


def load_disk_split(path: Path, split: str | None) -> Any:
    """The ``datasets.Dataset`` of a ``save_to_disk`` folder: the folder itself, or its ``split`` of a DatasetDict.

    Raises:
        ValueError: a DatasetDict without ``split`` among its splits, or a ``split`` for a single Dataset.
    """
    datasets = require("datasets", purpose="reading save_to_disk folders")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{path} holds a DatasetDict with splits {sorted(loaded)}; split={split!r} is not one: choose one "
                "with the source's split (val_split / test_split for val_path / test_path)"
            )
        return loaded[split]
    if split is not None:
        raise ValueError(f"split={split!r} was given but {path} holds a single Dataset, not a DatasetDict")
    return loaded


def hf_disk_table(path: Path, split: str | None, fields: tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    """Load a ``save_to_disk`` directory; return its ``input_ids``/``labels``/``loss_mask`` columns and the
    declared ``fields`` present as a Table, and all its column names."""
    loaded = load_disk_split(path, split)
    columns = [c for c in ("input_ids", "labels", "loss_mask", *fields) if c in loaded.column_names]
    if "input_ids" not in columns:
        raise ValueError(f"{path}: no 'input_ids' column (columns: {loaded.column_names})")
    return loaded.select_columns(columns).with_format("arrow")[:], list(loaded.column_names)


def table_fields(
    table: Any, where: str, offsets: np.ndarray, token_fields: tuple[str, ...], sample_fields: tuple[str, ...]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The declared fields of a validated table: flat token-field buffers and per-row sample values.

    Raises:
        ValueError: a declared column is missing, not numeric, null in a row, or (token field) of another length
            than ``input_ids`` in a row, naming ``where``, the row, the field and both lengths.
    """
    pa = require("pyarrow", purpose="reading Arrow tables")
    lengths = np.diff(offsets)
    for name in (*token_fields, *sample_fields):
        if name not in table.column_names:
            raise ValueError(f"{where}: no column {name!r} for the declared field (columns: {table.column_names})")
    tokens = {}
    for name in token_fields:
        values, value_lengths, valid = _number_lists(table.column(name), name, where, pa)
        if not valid.all():
            raise ValueError(f"{where}, row {int(np.argmin(valid))}: the declared token field {name!r} is null")
        mismatch = value_lengths != lengths
        if mismatch.any():
            row = int(np.argmax(mismatch))
            raise ValueError(
                f"{where}, row {row}: token field {name!r} has {int(value_lengths[row])} values but 'input_ids' has "
                f"{int(lengths[row])} tokens"
            )
        tokens[name] = values.astype(np.float32 if values.dtype.kind == "f" else np.int64)
    samples = {}
    for name in sample_fields:
        column = table.column(name)
        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        kind = array.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ValueError(f"{where}: column {name!r} (a declared sample field) must hold numbers, not {kind}")
        if array.null_count:
            row = int(np.argmin(np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)))
            raise ValueError(f"{where}, row {row}: the declared sample field {name!r} is null")
        values = np.asarray(array.to_numpy(zero_copy_only=False))
        samples[name] = values.astype(np.float64 if values.dtype.kind == "f" else np.int64)
    return tokens, samples


def _number_lists(column: Any, key: str, where: str, pa: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values, per-row lengths and validity of a list-of-numbers column (a declared token field)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    list_type = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
    value_type = array.type.value_type if list_type else None
    numeric = value_type is not None and (
        pa.types.is_integer(value_type) or pa.types.is_floating(value_type) or pa.types.is_boolean(value_type)
    )
    if not numeric:
        raise ValueError(f"{where}: column {key!r} (a declared token field) needs lists of numbers, not {array.type}")
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.asarray(array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    flat = array.flatten()
    if flat.null_count:
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        first = int(np.argmin(np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool)))
        raise ValueError(f"{where}, row {_row_of(first, offsets)}: token field {key!r} contains a null")
    values = np.asarray(flat.to_numpy(zero_copy_only=False))
    return (values.astype(np.int64) if values.dtype.kind == "b" else values), lengths, valid


def table_to_arrays(table: Any, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Validate a table with an ``input_ids`` column (and optional ``labels`` / ``loss_mask``) and flatten it.

    ``loss_mask`` (0/1 or bool per token, 1 = train on it) becomes labels, as in JSONL; a row may have labels or
    a loss mask, not both. A row whose ``labels`` (and ``loss_mask``, when both columns exist) is null is refused,
    as a JSONL ``"labels": null`` is: reading it as "no labels" would train every token of the row, prompt included.

    Returns:
        ``(tokens, offsets, labels)``; ``labels`` is ``None`` when the table has neither column.
    """
    if "input_ids" not in table.column_names:
        raise ValueError(f"{where}: no 'input_ids' column (columns: {table.column_names})")
    if table.num_rows == 0:
        raise ValueError(f"{where}: no samples")
    tokens, lengths, _ = _list_column(table.column("input_ids"), "input_ids", where, allow_null=False)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    if (lengths == 0).any():
        raise ValueError(f"{where}, row {int(np.argmax(lengths == 0))}: 'input_ids' is empty")
    _check_values(tokens, tokens < 0, offsets, "input_ids", where, "ids must be >= 0")
    present = [key for key in ("labels", "loss_mask") if key in table.column_names]
    if not present:
        return tokens, offsets, None
    labels = tokens.copy()
    with_labels = np.zeros(len(lengths), dtype=bool)
    for key in present:
        values, value_lengths, valid = _list_column(table.column(key), key, where, allow_null=True)
        mismatch = valid & (value_lengths != lengths)
        if mismatch.any():
            row = int(np.argmax(mismatch))
            counts = f"{int(value_lengths[row])} entries but 'input_ids' has {int(lengths[row])}"
            raise ValueError(f"{where}, row {row}: '{key}' has {counts}")
        both = valid & with_labels
        if both.any():
            raise ValueError(f"{where}, row {int(np.argmax(both))}: give either 'labels' or 'loss_mask', not both")
        with_labels |= valid
        positions = np.repeat(valid, lengths)
        if key == "labels":
            labels[positions] = values
            continue
        bad = (values != 0) & (values != 1)
        if bad.any():
            row = _row_of(int(np.flatnonzero(positions)[int(np.argmax(bad))]), offsets)
            raise ValueError(f"{where}, row {row}: 'loss_mask' must hold only 0 and 1, got {int(values[bad][0])}")
        labels[positions] = np.where(values == 1, tokens[positions], IGNORE_INDEX)
    if not with_labels.all():
        _refuse_null(present, int(np.argmin(with_labels)), where)
    _check_values(
        labels, (labels < 0) & (labels != IGNORE_INDEX), offsets, "labels", where, "labels are ids >= 0 or -100"
    )
    return tokens, offsets, labels


def _refuse_null(present: list[str], row: int, where: str) -> None:
    """Refuse a row whose ``labels`` / ``loss_mask`` is null (it would train every token, prompt included)."""
    named = " and ".join(f"'{key}'" for key in present)
    raise ValueError(
        f"{where}, row {row}: {named} {'is' if len(present) == 1 else 'are'} null; write the row's labels (-100 on "
        "the tokens not to train) or its loss_mask, or leave the column out of the file to train on every token "
        "(a null would train every token of the row, the prompt included)"
    )


def _list_column(column: Any, key: str, where: str, *, allow_null: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values (int64), per-row lengths (0 for null rows) and the validity mask of a list-of-int column."""
    pa = require("pyarrow", purpose="reading Arrow tables")
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    list_type = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
    value_type = array.type.value_type if list_type else None
    mask_type = key == "loss_mask" and value_type is not None and pa.types.is_boolean(value_type)
    if not list_type or not (pa.types.is_integer(value_type) or mask_type):
        raise ValueError(f"{where}: column '{key}' must hold lists of ints, its type is {array.type}")
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if not allow_null and not valid.all():
        raise ValueError(f"{where}, row {int(np.argmin(valid))}: '{key}' is null")
    lengths = np.asarray(array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    flat = array.flatten()
    if flat.null_count:
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        first = int(np.argmin(np.asarray(flat.is_valid().to_numpy(zero_copy_only=False), dtype=bool)))
        raise ValueError(f"{where}, row {_row_of(first, offsets)}: '{key}' contains a null")
    values = np.asarray(flat.to_numpy(zero_copy_only=False))
    if values.size and values.max() > _INT32_MAX:
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        raise ValueError(
            f"{where}, row {_row_of(int(np.argmax(values)), offsets)}: '{key}' has an id above {_INT32_MAX}"
        )
    return values.astype(np.int64), lengths, valid


def _check_values(values: np.ndarray, bad: np.ndarray, offsets: np.ndarray, key: str, where: str, rule: str) -> None:
    if bad.any():
        first = int(np.argmax(bad))
        row = _row_of(first, offsets)
        raise ValueError(
            f"{where}, row {row}: '{key}' has {int(values[first])} at position {first - offsets[row]}; {rule}"
        )


def _row_of(flat_index: int, offsets: np.ndarray) -> int:
    return int(np.searchsorted(offsets, flat_index, side="right") - 1)
