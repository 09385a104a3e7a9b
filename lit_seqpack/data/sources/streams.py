"""Stream sources: samples read in order, never indexed, each reopenable at a saved position.

A source is any object with ``open(position)`` returning a :class:`StreamReader`: an iterator of sample mappings
(``input_ids``, optionally ``labels`` or ``loss_mask``) whose :attr:`~StreamReader.position` is where the *next*
sample starts. ``open(reader.position)`` on a fresh object reads the same samples from there, which is how a
checkpoint stores the start of the look-ahead buffer instead of its contents. Positions are small JSON-like values
(ints, lists, dicts) so they travel in a checkpoint.

================================  ============================================  ==================================
source                            position                                      reopening costs
================================  ============================================  ==================================
:class:`GeneratorStream`          samples read so far                           re-reading (and skipping) them
:class:`SyntheticStream`          samples read so far                           nothing (each sample is seeded)
:class:`JsonlStream`              ``[file, byte offset]``                       one seek
:class:`ParquetStream`            ``[file, row group, row]``                    reading one row group
:class:`HFIterableStream`         samples read so far                           ``IterableDataset.skip`` (a read)
:class:`MixtureStream`            the children's positions + the draw count     the children's, plus the draws
================================  ============================================  ==================================
"""

from __future__ import annotations

import copy
import glob
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lit_seqpack._imports import require
from lit_seqpack.data.sources._split import check_share, interval_share, stride_share, weighted_share

__all__ = [
    "GeneratorStream",
    "HFIterableStream",
    "JsonlStream",
    "MixtureStream",
    "ParquetStream",
    "StreamReader",
    "SplittableStream",
    "StreamSource",
    "SyntheticStream",
    "describe_stream",
]

Sample = Mapping[str, Any]


class StreamReader(Iterator[Sample]):
    """An iterator of samples that knows where the next one starts (:attr:`position`)."""

    position: Any

    def __iter__(self) -> StreamReader:
        return self


@runtime_checkable
class StreamSource(Protocol):
    """What the streaming loader reads: ``open(None)`` starts at the beginning, ``open(p)`` at a saved position.

    A source that can be read by shares also has ``split(index, count)`` (:class:`SplittableStream`), which
    ``stream_split="rank"`` needs on more than one rank.
    """

    def open(self, position: Any = None) -> StreamReader: ...


@runtime_checkable
class SplittableStream(StreamSource, Protocol):
    """A stream that can be read by disjoint shares: each data-parallel rank (and each of its loader workers) reads
    its own."""

    def split(self, index: int, count: int) -> StreamSource:
        """The source reading only share ``index`` of ``count`` disjoint shares that together hold every sample once.

        Deterministic (every rank computes every share alike); a share may be split again (by loader worker), and
        may be empty (more shares than the stream can be cut into).

        Raises:
            ValueError: the stream cannot be split this way, naming it.
        """
        ...


def describe_stream(source: Any) -> str:
    """A stream named for an error: its class, and its files where it reads files (children for a mixture).

    Example:
        >>> describe_stream(GeneratorStream(lambda: iter(())))
        'GeneratorStream(<lambda>)'
    """
    name = type(source).__name__
    files = getattr(source, "files", None)
    if isinstance(files, list) and files:
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return f"{name}({shown})"
    if isinstance(getattr(source, "input_dir", None), str):  # a folder of chunks (LitDataStream)
        return f"{name}({source.input_dir})"
    if isinstance(source, MixtureStream):
        return f"{name}({', '.join(describe_stream(child) for child in source.sources)})"
    factory = getattr(source, "factory", None)
    if factory is not None:
        return f"{name}({getattr(factory, '__qualname__', type(factory).__name__)})"
    return name


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


class _CountingReader(StreamReader):
    """A reader over an iterator whose position is the number of samples read from the start."""

    def __init__(self, samples: Iterator[Sample], position: int) -> None:
        self._samples, self.position = samples, position

    def __next__(self) -> Sample:
        sample = next(self._samples)
        self.position += 1
        return sample


def _strided(samples: Iterable[Sample], offset: int, stride: int) -> Iterator[Sample]:
    """Samples ``offset, offset + stride, ...`` of ``samples`` (all of them for ``(0, 1)``)."""
    if (offset, stride) == (0, 1):
        return iter(samples)
    return itertools.islice(samples, offset, None, stride)


def _check_count_position(position: Any, source: str) -> int:
    if position is None:
        return 0
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"{source}: a position is a sample count >= 0, got {position!r}")
    return position


class GeneratorStream:
    """Samples from a Python generator function (or any re-iterable), e.g. data generated on the fly.

    Reopening at position ``n`` calls ``factory()`` again and skips ``n`` samples, so the factory must give the
    same samples every call (seed it); the cost is reading those ``n`` samples again.

    Args:
        factory: a callable returning a fresh iterable of samples on every call.
        vocab_size: the vocabulary the samples need (optional; read by ``SeqPackDataModule.vocab_size``).

    Example:
        >>> stream = GeneratorStream(lambda: ({"input_ids": [1] * n} for n in (2, 3, 4)))
        >>> reader = stream.open(1)
        >>> [len(s["input_ids"]) for s in reader], reader.position
        ([3, 4], 3)
    """

    def __init__(self, factory: Callable[[], Iterable[Sample]], *, vocab_size: int | None = None) -> None:
        if not callable(factory):
            raise ValueError(
                f"factory must be a callable returning a fresh iterable of samples, got {type(factory).__name__} "
                "(a generator object cannot be read twice: pass the generator function)"
            )
        self.factory, self.vocab_size = factory, vocab_size
        self.offset, self.stride = 0, 1  # a share reads samples offset, offset + stride, ... (split)

    def split(self, index: int, count: int) -> GeneratorStream:
        """Share ``index`` of ``count``: every ``count``-th sample from ``index`` (each share reads the whole
        generator and keeps its own samples)."""
        check_share(index, count, describe_stream(self))
        share = copy.copy(self)
        share.offset, share.stride = stride_share(self.offset, self.stride, index, count)
        return share

    def open(self, position: Any = None) -> StreamReader:
        start = _check_count_position(position, "GeneratorStream")
        samples = _strided(self.factory(), self.offset, self.stride)
        for skipped in range(start):
            if next(samples, None) is None:
                raise ValueError(f"GeneratorStream: position {start} is past the end ({skipped} samples)")
        return _CountingReader(samples, start)


class _SyntheticReader(StreamReader):
    def __init__(self, stream: SyntheticStream, position: int) -> None:
        self._stream, self.position = stream, position

    def __next__(self) -> Sample:
        stream = self._stream
        number = stream.offset + self.position * stream.stride  # the sample's number in the whole stream
        if stream.num_samples is not None and number >= stream.num_samples:
            raise StopIteration
        rng = np.random.default_rng([stream.seed, number])
        length = int(np.clip(round(rng.lognormal(np.log(stream.median_length), stream.sigma)), 2, stream.max_length))
        ids = rng.integers(1, stream.vocab_size, length)
        prompt = int(rng.integers(0, length // 2 + 1))
        self.position += 1
        return {"input_ids": ids.tolist(), "labels": [-100] * prompt + ids[prompt:].tolist()}


class SyntheticStream:
    """Generated samples with lognormal lengths and a masked prompt, as long a stream as asked (no download).

    Sample ``i`` depends on ``(seed, i)`` only, so a reader reopens anywhere at no cost and the stream can be far
    larger than memory (``num_samples=None``: endless; bound it with ``max_steps``).

    Args:
        num_samples: samples in the stream (``None``: endless).
        vocab_size: token ids are drawn from ``[1, vocab_size)``.
        median_length: median sample length (tokens).
        sigma: the lognormal's shape (spread of the lengths).
        max_length: the longest sample generated (longer draws are clipped).
        seed: seed of the stream (>= 0).

    Example:
        >>> reader = SyntheticStream(num_samples=3, vocab_size=50).open(1)
        >>> len(list(reader)), reader.position
        (2, 3)
    """

    def __init__(
        self,
        *,
        num_samples: int | None = 10_000,
        vocab_size: int = 512,
        median_length: int = 128,
        sigma: float = 1.0,
        max_length: int = 4096,
        seed: int = 0,
    ) -> None:
        checks = {"vocab_size": (vocab_size, 2), "median_length": (median_length, 2), "max_length": (max_length, 2)}
        checks |= {"seed": (seed, 0)} | ({} if num_samples is None else {"num_samples": (num_samples, 0)})
        for name, (value, minimum) in checks.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"SyntheticStream.{name} must be an int >= {minimum}, got {value!r}")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma < 10:
            raise ValueError(f"SyntheticStream.sigma must be a number in [0, 10), got {sigma!r}")
        self.num_samples, self.vocab_size, self.seed = num_samples, vocab_size, seed
        self.median_length, self.sigma, self.max_length = median_length, float(sigma), max_length
        self.offset, self.stride = 0, 1  # a share reads samples offset, offset + stride, ... (split)

    def split(self, index: int, count: int) -> SyntheticStream:
        """Share ``index`` of ``count``: samples ``index, index + count, ...`` (each generated alone, nothing read)."""
        check_share(index, count, describe_stream(self))
        share = copy.copy(self)
        share.offset, share.stride = stride_share(self.offset, self.stride, index, count)
        return share

    def open(self, position: Any = None) -> StreamReader:
        return _SyntheticReader(self, _check_count_position(position, "SyntheticStream"))


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
                    return json.loads(line)
                except UnicodeDecodeError as err:
                    where = f"{self._files[file]}, line {_line_at(self._files[file], offset)}"
                    raise ValueError(
                        f"{where}: not UTF-8 text (byte {line[err.start]:#04x} at column {err.start + 1}); JSONL "
                        "files must be UTF-8"
                    ) from err
                except json.JSONDecodeError as err:
                    where = f"{self._files[file]}, line {_line_at(self._files[file], offset)} (byte {offset})"
                    raise ValueError(f"{where}: not a JSON line ({err.msg})") from err


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
                    self._rows = handle.read_row_group(group).to_pylist()  # one row group in memory at a time
                except (require("pyarrow", purpose="streaming Parquet files").ArrowException, OSError) as err:
                    raise ValueError(
                        f"{self._files[file]}: not a readable Parquet file (row group {group}; "
                        f"{type(err).__name__}: {err})"
                    ) from err
            if row >= len(self._rows):
                self._rows, self.position = None, [file, group + 1, 0]
                continue
            self.position = [file, group, row + 1]
            return self._rows[row]


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


class HFIterableStream:
    """A Hugging Face ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)`` or ``to_iterable_dataset``).

    Reopening at ``n`` uses ``dataset.skip(n)``: the skipped samples are read again, so the dataset must give the
    same order every pass (a ``shuffle`` with a fixed seed does).

    Args:
        dataset: the iterable dataset (already tokenised: rows with ``input_ids``).
        vocab_size: the vocabulary the samples need (optional).
    """

    def __init__(self, dataset: Any, *, vocab_size: int | None = None) -> None:
        if not hasattr(dataset, "skip") or not hasattr(dataset, "__iter__"):
            raise ValueError(f"dataset must be a datasets.IterableDataset, got {type(dataset).__name__}")
        self.dataset, self.vocab_size = dataset, vocab_size
        self.is_share = False  # a share of a split: reopened by reading past its first samples

    def split(self, index: int, count: int) -> HFIterableStream:
        """Share ``index`` of ``count`` by ``datasets.distributed.split_dataset_by_node`` (by shard when the number of
        shards divides by ``count``, else every ``count``-th sample)."""
        check_share(index, count, describe_stream(self))
        distributed = require("datasets.distributed", purpose="splitting a Hugging Face IterableDataset by rank")
        try:
            dataset = distributed.split_dataset_by_node(self.dataset, rank=index, world_size=count)
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{describe_stream(self)} cannot be split into {count} shares: {err}") from err
        share = HFIterableStream(dataset, vocab_size=self.vocab_size)
        share.is_share = True
        return share

    def open(self, position: Any = None) -> StreamReader:
        start = _check_count_position(position, "HFIterableStream")
        if self.is_share:  # ``skip`` on a split dataset skips samples of the whole one: read past them here
            return _CountingReader(itertools.islice(self.dataset, start, None), start)
        return _CountingReader(iter(self.dataset.skip(start) if start else self.dataset), start)


class _MixtureReader(StreamReader):
    def __init__(self, mixture: MixtureStream, position: Mapping[str, Any] | None) -> None:
        children = position["children"] if position else [None] * len(mixture.sources)
        self._draws = int(position["draws"]) if position else 0
        self._done = list(position["done"]) if position else [False] * len(mixture.sources)
        self._readers = [s.open(p) for s, p in zip(mixture.sources, children, strict=True)]
        self._weights = np.asarray(mixture.weights, dtype=np.float64)
        self._seed = mixture.seed

    @property
    def position(self) -> dict[str, Any]:  # type: ignore[override]
        return {"draws": self._draws, "done": list(self._done), "children": [r.position for r in self._readers]}

    def __next__(self) -> Sample:
        while not all(self._done):
            weights = np.where(self._done, 0.0, self._weights)
            # one counter-based draw per sample: the choice at draw d depends on (seed, d) only, so a reopened
            # reader continues the same sequence without any generator state in the position
            u = np.random.default_rng([self._seed, self._draws]).random()
            child = int(np.searchsorted(np.cumsum(weights) / weights.sum(), u, side="right"))
            child = min(child, len(weights) - 1)
            self._draws += 1
            sample = next(self._readers[child], None)
            if sample is not None:
                return sample
            self._done[child] = True  # that child is exhausted: the others share its weight from now on
        raise StopIteration


class MixtureStream:
    """A weighted mixture of streams: each sample comes from child ``i`` with probability ``weights[i]`` (renormalised
    over the children not yet exhausted), drawn from ``seed`` alone, so the mixture is the same on every rank and
    every pass. Every sample of every child is read exactly once: the mixture ends when all children end.

    Args:
        sources: the child streams.
        weights: one positive weight per child (normalised here).
        seed: seed of the draws (>= 0).

    Example:
        >>> a = GeneratorStream(lambda: ({"input_ids": [1]} for _ in range(3)))
        >>> b = GeneratorStream(lambda: ({"input_ids": [2, 2]} for _ in range(2)))
        >>> sorted(len(s["input_ids"]) for s in MixtureStream([a, b], [0.5, 0.5]).open())
        [1, 1, 1, 2, 2]
    """

    def __init__(self, sources: Sequence[StreamSource], weights: Sequence[float], *, seed: int = 0) -> None:
        if not sources:
            raise ValueError("MixtureStream.sources is empty: give at least one stream")
        if len(weights) != len(sources):
            raise ValueError(f"MixtureStream.weights has {len(weights)} entries for {len(sources)} sources")
        bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < np.inf]
        if bad:
            raise ValueError(f"MixtureStream.weights must be finite numbers > 0, got {list(weights)!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"MixtureStream.seed must be an int >= 0, got {seed!r}")
        self.sources, self.seed = list(sources), seed
        self.weights = [float(w) / float(sum(weights)) for w in weights]
        sizes = [getattr(s, "vocab_size", None) for s in self.sources]
        self.vocab_size = max(sizes) if sizes and all(isinstance(v, int) for v in sizes) else None

    def split(self, index: int, count: int) -> MixtureStream:
        """Share ``index`` of ``count``: every child split alike, mixed with the same weights and seeded draws."""
        check_share(index, count, describe_stream(self))
        children = []
        for child in self.sources:
            if not callable(getattr(child, "split", None)):
                raise ValueError(
                    f"{describe_stream(self)} cannot be split: its child {describe_stream(child)} has no "
                    "split(index, count)"
                )
            children.append(child.split(index, count))
        share = copy.copy(self)
        share.sources = children
        return share

    def open(self, position: Any = None) -> StreamReader:
        return _MixtureReader(self, position)
