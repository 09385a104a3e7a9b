"""Streams of files: :class:`JsonlStream` (JSON lines) and :class:`ParquetStream`, read in order, each reopenable at
a saved position (``[file, byte offset]``; ``[file, row group, row]``) and split into disjoint shares by bytes or by
row groups (see :mod:`~lit_seqpack.data.sources.streams` for the protocol they implement).
"""

from __future__ import annotations

import copy
import glob
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack._imports import require
from lit_seqpack.data.sources.streams import (
    Sample,
    StreamReader,
    check_share,
    describe_stream,
    interval_share,
    weighted_share,
)

__all__ = ["JsonlStream", "ParquetStream"]

_TOKEN_KEYS = ("input_ids", "labels")
"""The token lists a JSONL reader hands on as int64 arrays (a ``loss_mask`` may hold booleans: it stays a list)."""


_NUMBER_BYTES = b"0123456789,- "
"""What a JSON list of integers is made of: none of it is in the literals ``true`` and ``false``."""


def _expand(paths: str | Sequence[str], suffixes: tuple[str, ...], setting: str) -> list[str]:
    """Files of ``paths`` (a glob, a folder, a file or a list of them) in sorted order, or a ``ValueError``."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[str] = []
    for item in items:
        item = str(item)
        if Path(item).is_dir():
            files += sorted(str(p) for p in Path(item).iterdir() if p.name.endswith(suffixes))
        elif any(ch in item for ch in "*?["):
            files += sorted(glob.glob(item))
        elif Path(item).is_file():
            files.append(item)
        else:
            raise ValueError(f"{setting}: no such file or folder: {item!r}")
    if not files:
        raise ValueError(f"{setting}={paths!r} matches no {'/'.join(suffixes)} file")
    return files


class _JsonlReader(StreamReader):
    def __init__(
        self, files: list[str], file: int, offset: int, *, starts: list[int] | None = None, end: int | None = None
    ) -> None:
        self._files, self.position = files, [file, offset]
        self._handle: Any = None
        self._starts, self._end = starts, end  # a share: the lines starting before byte `end` of the joined files

    def __next__(self) -> Sample:
        while True:
            file, offset = self.position
            if file >= len(self._files):
                raise StopIteration
            if self._end is not None and self._starts[file] + offset >= self._end:  # type: ignore[index]
                raise StopIteration
            if self._handle is None:
                self._handle = open(self._files[file], "rb")  # noqa: SIM115 - closed at the file's end
                self._handle.seek(offset)
            line = self._handle.readline()
            if not line:
                self._handle.close()
                self._handle, self.position = None, [file + 1, 0]
                continue
            self.position = [file, offset + len(line)]
            if not line.isspace():  # a blank line is skipped (isspace copies nothing, unlike strip)
                try:
                    return _with_token_arrays(json.loads(line), line)
                except UnicodeDecodeError as err:
                    where = f"{self._files[file]}, line {_line_at(self._files[file], offset)}"
                    raise ValueError(
                        f"{where}: not UTF-8 text (byte {line[err.start]:#04x} at column {err.start + 1}); JSONL "
                        "files must be UTF-8"
                    ) from err
                except json.JSONDecodeError as err:
                    where = f"{self._files[file]}, line {_line_at(self._files[file], offset)} (byte {offset})"
                    raise ValueError(f"{where}: not a JSON line ({err.msg})") from err


def _with_token_arrays(sample: Any, line: bytes) -> Any:
    """``sample`` (one decoded line) with its token lists as int64 arrays when they certainly hold only integers.

    A stream converts every token list before it counts, plans and collates it; here the raw line tells cheaply what
    a scan of every item would: without the literals ``true`` and ``false`` the line holds no bool, and
    ``struct.pack`` refuses every other non-integer (a float, a string, ``None``, a nested list, an id beyond int64),
    at about a third of the cost of a type scan and ``np.fromiter``. A list that is not converted stays a list, for the
    stream's checks to refuse it by name.

    Example:
        >>> _with_token_arrays({"input_ids": [5, 6], "labels": [-100, 6.0]}, b"...")
        {'input_ids': array([5, 6]), 'labels': [-100, 6.0]}
        >>> _with_token_arrays({"input_ids": [5, True]}, b'{"input_ids": [5, true]}')
        {'input_ids': [5, True]}
    """
    if type(sample) is not dict:
        return sample
    literals = line.translate(None, _NUMBER_BYTES)  # searching the few bytes left is 2x faster than the whole line
    if b"true" in literals or b"false" in literals:
        return sample
    ids, labels = sample.get("input_ids"), sample.get("labels")
    if type(ids) is list and type(labels) is list:  # both in one call (one array; each key a view of its part)
        try:
            tokens = _int64_array(struct.pack(f"{len(ids) + len(labels)}q", *ids, *labels))
        except struct.error:  # one of them is not plain ints: each is tried alone below
            pass
        else:
            sample["input_ids"], sample["labels"] = tokens[: len(ids)], tokens[len(ids) :]
            return sample
    for key in _TOKEN_KEYS:
        value = sample.get(key)
        if type(value) is list:
            try:
                sample[key] = _int64_array(struct.pack(f"{len(value)}q", *value))
            except struct.error:  # not plain ints: left for the checks that name the sample
                continue
    return sample


def _int64_array(packed: bytes) -> np.ndarray:
    """The int64 array of ``packed``, owning its memory: a view of the bytes would keep objects the garbage collector
    tracks alive per sample (numpy's memoryview and buffer), which made full collections a fifth of a stream's time."""
    return np.frombuffer(packed, dtype=np.int64).copy()


def _line_at(path: str, offset: int) -> int:
    """The line number of the line starting at byte ``offset`` of ``path`` (read on the error path only)."""
    with open(path, "rb") as handle:
        return handle.read(offset).count(b"\n") + 1


class JsonlStream:
    """JSON Lines shards read in order (sorted names), one sample a line; no index, the position is a byte offset.

    Split into shares by bytes: share ``i`` of ``n`` reads the lines that *start* in the ``i``-th ``n``-th of the
    files' joined bytes, so with many files a share reads whole files (only the files at its edges are cut), with fewer
    files than shares it reads a line range of one, and the shares are disjoint, cover every line and hold about the
    same bytes. The file sizes are read once, at the split: the files must not change while training.

    A sample's ``input_ids`` and ``labels`` come out as int64 numpy arrays when they hold plain integers (and its line
    no JSON ``true``/``false``), else as the lists read, for the stream's checks to refuse by name.

    Args:
        paths: a file, a folder (its ``*.jsonl`` files), a glob, or a list of them.
        vocab_size: the vocabulary the samples need (optional).
    """

    def __init__(self, paths: str | Sequence[str], *, vocab_size: int | None = None) -> None:
        self.files, self.vocab_size = _expand(paths, (".jsonl", ".json"), "JsonlStream.paths"), vocab_size
        self.span: tuple[int, int] | None = None  # a share: the bytes of the joined files it reads (split)
        self._starts: list[int] | None = None

    def split(self, index: int, count: int) -> JsonlStream:
        """Share ``index`` of ``count`` of the files' joined bytes (see the class docstring)."""
        check_share(index, count, describe_stream(self))
        starts = self._starts
        if starts is None:
            starts = np.concatenate(([0], np.cumsum([os.path.getsize(f) for f in self.files]))).tolist()
        share = copy.copy(self)
        share._starts = starts
        share.span = interval_share(*(self.span or (0, starts[-1])), index, count)
        return share

    def open(self, position: Any = None) -> StreamReader:
        if self.span is None:
            file, offset = [0, 0] if position is None else position
            return _JsonlReader(self.files, int(file), int(offset))
        file, offset = self._share_start() if position is None else (int(position[0]), int(position[1]))
        return _JsonlReader(self.files, file, offset, starts=self._starts, end=self.span[1])

    def _share_start(self) -> tuple[int, int]:
        """``[file, offset]`` of the first line starting at or after the share's first byte."""
        starts, begin = self._starts, self.span[0]  # type: ignore[index]
        file = int(np.searchsorted(starts, begin, side="right")) - 1  # type: ignore[arg-type]
        if file >= len(self.files):
            return len(self.files), 0
        offset = begin - starts[file]  # type: ignore[index]
        if offset == 0:
            return file, 0
        with open(self.files[file], "rb") as handle:
            handle.seek(offset - 1)
            return file, offset - 1 + len(handle.readline())  # past the line the previous share owns


class _ParquetReader(StreamReader):
    def __init__(self, files: list[str], position: list[int], stop: tuple[int, int] | None = None) -> None:
        self._files, self.position = files, list(position)
        self._rows: list[Sample] | None = None
        self._stop = stop  # a share: ``(file, row group)`` of the first row group it does not read

    def __next__(self) -> Sample:
        pq = require("pyarrow.parquet", purpose="streaming Parquet files")

        while True:
            file, group, row = self.position
            if file >= len(self._files) or (self._stop is not None and (file, group) >= self._stop):
                raise StopIteration
            if self._rows is None:
                try:
                    handle = pq.ParquetFile(self._files[file])
                    if group >= handle.num_row_groups:
                        self._rows, self.position = None, [file + 1, 0, 0]
                        continue
                    self._rows = _row_group_samples(handle.read_row_group(group))  # one row group in memory
                except (require("pyarrow", purpose="streaming Parquet files").ArrowException, OSError) as err:
                    raise ValueError(
                        f"{self._files[file]}: not a readable Parquet file (row group {group}; "
                        f"{type(err).__name__}: {err})"
                    ) from err
            if row >= len(self._rows):
                self._rows, self.position = None, [file, group + 1, 0]
                continue
            self.position = [file, group, row + 1]
            sample = self._rows[row]
            _check_token_columns(sample, self._files[file], group, row)
            return sample


def _check_token_columns(sample: Sample, path: str, group: int, row: int) -> None:
    """Refuse a row whose ``input_ids`` is null or whose token column is not a list of integers, naming the file,
    row group and row (arrays from :func:`_int_lists` are checked already).

    Example:
        >>> _check_token_columns({"input_ids": None}, "a.parquet", 0, 3)
        Traceback (most recent call last):
        ...
        ValueError: a.parquet: row group 0, row 3: input_ids is null (every row needs its tokens)
    """
    for key in _TOKEN_KEYS:
        value = sample.get(key)
        if isinstance(value, np.ndarray):
            continue
        if value is None:
            if key == "input_ids":
                raise ValueError(
                    f"{path}: row group {group}, row {row}: input_ids is null (every row needs its tokens)"
                )
            continue
        if not isinstance(value, list):
            raise ValueError(
                f"{path}: row group {group}, row {row}: {key} must be a list of integers, got "
                f"{type(value).__name__} {value!r:.60}"
            )
        bad = next((v for v in value if isinstance(v, bool) or not isinstance(v, int)), _NONE)
        if bad is not _NONE:
            raise ValueError(
                f"{path}: row group {group}, row {row}: {key} must be a list of integers, holds {bad!r:.40} "
                f"({type(bad).__name__})"
            )


_NONE = object()


def _row_group_samples(table: Any) -> list[Sample]:
    """The rows of one Parquet row group as samples, with each integer token list column as int64 array views.

    ``to_pylist`` turns every token into a Python int that the stream then converts back; a column of integer lists
    without nulls is converted once, as a whole (each row's array a view of the column's one owned array, which
    holds nothing the garbage collector walks). Any other column, or a token column with nulls, bools, floats or
    ``uint64`` ids, is read as lists for the stream's checks to refuse by name.

    Example:
        >>> import pyarrow as pa
        >>> rows = _row_group_samples(pa.table({"input_ids": [[5, 6], [7]], "score": [[0.5], [1.0]]}))
        >>> rows[1]["input_ids"], rows[1]["score"]
        (array([7]), [1.0])
    """
    tokens = {key: arrays for key in _TOKEN_KEYS if key in table.column_names and (arrays := _int_lists(table[key]))}
    rows = table.drop_columns(list(tokens)).to_pylist() if tokens else table.to_pylist()
    for key, arrays in tokens.items():
        for row, array in zip(rows, arrays, strict=True):
            row[key] = array
    return rows


def _int_lists(column: Any) -> list[np.ndarray] | None:
    """Each row's int64 array of a column of integer lists without nulls (``None``: read the column as lists)."""
    pa = require("pyarrow", purpose="streaming Parquet files")
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or len(column) == 0:
        return None
    if not pa.types.is_integer(kind.value_type) or kind.value_type == pa.uint64():  # uint64 may not fit int64
        return None
    lists = column.combine_chunks()
    values = lists.flatten()  # the rows' values, whatever the array's slice offset
    if lists.null_count or values.null_count:
        return None
    tokens = np.array(values.to_numpy(), dtype=np.int64)  # owned and writable, as a JSONL line's arrays
    ends = np.cumsum(require("pyarrow.compute", purpose="streaming Parquet files").list_value_length(lists))
    starts = np.concatenate(([0], ends[:-1]))
    return [tokens[start:end] for start, end in zip(starts.tolist(), ends.tolist(), strict=True)]


class ParquetStream:
    """Parquet shards read one row group at a time, in order; the position is ``[file, row group, row]``.

    Split into shares by row group: the files' row groups in order are cut into contiguous runs of about equal rows
    (read from the footers at the split), so a share reads whole files when there are many and some row groups of
    one file when there are fewer files than shares; a share without a row group is empty.

    Args:
        paths: a file, a folder (its ``*.parquet`` files), a glob, or a list of them.
        vocab_size: the vocabulary the samples need (optional).
    """

    def __init__(self, paths: str | Sequence[str], *, vocab_size: int | None = None) -> None:
        self.files, self.vocab_size = _expand(paths, (".parquet",), "ParquetStream.paths"), vocab_size
        self.groups: tuple[int, int] | None = None  # a share: the row groups it reads, numbered over all files
        self._units: list[tuple[int, int, int]] | None = None  # (file, row group, rows) of every row group

    def split(self, index: int, count: int) -> ParquetStream:
        """Share ``index`` of ``count`` of the row groups, cut by rows (see the class docstring)."""
        check_share(index, count, describe_stream(self))
        units = self._units
        if units is None:
            pq = require("pyarrow.parquet", purpose="streaming Parquet files")
            units = []
            for file, path in enumerate(self.files):
                meta = pq.ParquetFile(path).metadata
                units += [(file, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        share = copy.copy(self)
        share._units = units
        rows = [unit[2] for unit in units]
        share.groups = weighted_share(rows, *(self.groups or (0, len(units))), index, count)
        return share

    def open(self, position: Any = None) -> StreamReader:
        if self.groups is None:
            return _ParquetReader(self.files, [0, 0, 0] if position is None else [int(p) for p in position])
        units, (first, end) = self._units, self.groups
        stop = (units[end][0], units[end][1]) if end < len(units) else (len(self.files), 0)  # type: ignore[index]
        if position is None:
            position = [*units[first][:2], 0] if first < end else [*stop, 0]  # type: ignore[index]
        return _ParquetReader(self.files, [int(p) for p in position], stop)
