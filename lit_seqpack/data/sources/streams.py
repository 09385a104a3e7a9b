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
:class:`~.file_streams.JsonlStream` ``[file, byte offset]``                     one seek
:class:`~.file_streams.ParquetStream` ``[file, row group, row]``              reading one row group
:class:`HFIterableStream`         samples read so far                           ``IterableDataset.skip`` (a read)
:class:`MixtureStream`            the children's positions + the draw count     the children's, plus the draws
================================  ============================================  ==================================

How a stream is cut into disjoint shares (``StreamSource.split``): the arithmetic every source shares.

A share is always a contiguous piece of what the stream reads (a byte interval of the concatenated JSONL files, an
interval of the Parquet row groups) or every ``stride``-th sample from ``offset`` (counted sources), so splitting a
share again (by DataLoader worker after the rank) cuts that piece the same way, and the shares of one split are
disjoint and cover the stream exactly.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lit_seqpack._imports import require

__all__ = [
    "GeneratorStream",
    "HFIterableStream",
    "MixtureStream",
    "StreamReader",
    "SplittableStream",
    "StreamSource",
    "SyntheticStream",
    "describe_stream",
    "check_share",
    "interval_share",
    "stride_share",
    "weighted_share",
]


def check_share(index: int, count: int, stream: str) -> None:
    """Refuse a share that does not exist: ``count >= 1`` and ``0 <= index < count``, both ints.

    Raises:
        ValueError: naming the stream and the bad numbers.

    Example:
        >>> check_share(2, 2, "JsonlStream(a.jsonl)")
        Traceback (most recent call last):
        ...
        ValueError: JsonlStream(a.jsonl).split(index=2, count=2): index must be in [0, count) and count >= 1
    """
    ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (index, count))
    if not ints or count < 1 or not 0 <= index < count:
        raise ValueError(
            f"{stream}.split(index={index!r}, count={count!r}): index must be in [0, count) and count >= 1"
        )


def interval_share(start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of ``count`` equal pieces of the interval ``[start, end)``.

    Example:
        >>> [interval_share(0, 10, i, 3) for i in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    size = end - start
    return start + size * index // count, start + size * (index + 1) // count


def weighted_share(weights: Sequence[int], start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of the units ``[start, end)`` cut into ``count`` contiguous runs of about equal weight.

    Unit ``u`` goes to the share its first weight unit falls in (``count * weight before u // total``); with no
    weight at all the units are cut by number.

    Example:
        >>> [weighted_share([5, 1, 1, 1, 2], 0, 5, i, 2) for i in range(2)]
        [(0, 1), (1, 5)]
    """
    units = np.asarray(weights[start:end], dtype=np.int64)
    total = int(units.sum())
    if total == 0:
        first, last = interval_share(0, len(units), index, count)
        return start + first, start + last
    owner = np.concatenate(([0], np.cumsum(units)[:-1])) * count // total
    first, last = np.searchsorted(owner, index, side="left"), np.searchsorted(owner, index, side="right")
    return start + int(first), start + int(last)


def stride_share(offset: int, stride: int, index: int, count: int) -> tuple[int, int]:
    """Share ``index`` of ``count`` of the samples ``offset, offset + stride, ...``: a new ``(offset, stride)``.

    Example:
        >>> stride_share(1, 2, 1, 3)  # samples 1, 3, 5, 7, ... -> 3, 9, 15, ...
        (3, 6)
    """
    return offset + index * stride, stride * count


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


class HFIterableStream:
    """A Hugging Face ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)`` or ``to_iterable_dataset``).

    Reopening at ``n`` uses ``dataset.skip(n)``: the skipped samples are read again, so the dataset must give the
    same order every pass (a ``shuffle`` with a fixed seed does).

    Args:
        dataset: the iterable dataset (already tokenised: rows with ``input_ids``).
        vocab_size: the vocabulary the samples need (optional).
    """

    splits_by_worker = True
    """Inside a DataLoader worker ``datasets`` reads only that worker's shards: a lane is not read exactly there."""

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
