"""Where a stream sample comes from, for errors: its number in the stream and, for file streams, its file and line
(JSONL) or row group and row (Parquet).

:class:`LocatedReader` wraps a stream reader and tags each sample with its stream number and the reader's position
before it (a dict subclass with the same keys, so nothing downstream sees a difference; it pickles as a plain dict).
The file and line are only worked out when an error names the sample (:func:`describe_position`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["LocatedReader", "ReadSample", "StreamSampleNames", "describe_position", "stream_sample_name"]


class _Located(dict):
    """A sample tagged with its stream number and the reader's position before it."""

    __slots__ = ("number", "position")

    def __reduce__(self) -> tuple[Any, ...]:  # a checkpoint holds plain dicts (weights-only loading)
        return (dict, (dict(self),))

    def relocated(self, values: Mapping[str, Any]) -> _Located:
        """``values`` (this sample changed, e.g. truncated) tagged with this sample's number and position."""
        located = _Located(values)
        located.number, located.position = self.number, self.position
        return located


def stream_sample_name(number: int, position: Any, source: Any, share: tuple[int, int] | None = None) -> str:
    """``stream sample 33, data.jsonl, line 34``: the sample's number, in rank 1's share when ranks read their own
    shares (``share=(rank, world_size)``, more than one rank), and its place in its file when the source has files.

    Example:
        >>> stream_sample_name(33, None, object()), stream_sample_name(4, None, object(), share=(1, 2))
        ('stream sample 33', "sample 4 of rank 1's share of the stream")
    """
    where = describe_position(source, position)
    return _numbered(number, share) + (f", {where}" if where else "")


def _numbered(number: int, share: tuple[int, ...] | None) -> str:
    """``share`` may name a lane too, ``(rank, world_size, lane, lanes)`` (numbers then count in the lane)."""
    lane = f"lane {share[2]} of " if share is not None and len(share) == 4 and share[3] > 1 else ""
    if share is not None and share[1] > 1:
        return f"sample {number} of {lane}rank {share[0]}'s share of the stream"
    if lane:
        return f"sample {number} of {lane}the stream"
    return f"stream sample {number}"


class ReadSample:
    """The name of the sample a :class:`LocatedReader` read last (:func:`stream_sample_name`), worked out only when an
    error message formats it: the checks right after the read name the sample with it."""

    __slots__ = ("number", "position", "share", "source")

    def __init__(self, source: Any, share: tuple[int, int] | None) -> None:
        self.source, self.share, self.number, self.position = source, share, 0, None

    def __str__(self) -> str:
        where = describe_position(self.source, self.position)
        return _numbered(self.number, self.share) + (f" ({where})" if where else "")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class LocatedReader(Iterator[Mapping[str, Any]]):
    """A stream reader whose samples know their stream number (from ``first``) and position.

    Args:
        reader: the source's reader.
        first: the stream number of the reader's next sample.
        source: the stream (or this rank's share of it) that ``reader`` reads, to name the file of a sample.
        share: ``(rank, world_size)`` when ``source`` is this rank's share (numbers then count in the share).
    """

    def __init__(self, reader: Any, first: int, *, source: Any = None, share: tuple[int, int] | None = None) -> None:
        self._reader, self._number = reader, first
        self.last = ReadSample(source, share)
        """The name of the sample read last (updated at every read, not a new object: a read costs microseconds)."""

    @property
    def position(self) -> Any:
        return self._reader.position

    def __next__(self) -> Mapping[str, Any]:
        position = getattr(self._reader, "position", None)
        if type(position) is list:  # a tuple of numbers is one object fewer for the garbage collector to walk
            position = tuple(position)
        sample = next(self._reader)
        number, self._number = self._number, self._number + 1
        self.last.number, self.last.position = number, position
        if type(sample) is not dict:
            return sample
        located = _Located(sample)
        located.number, located.position = number, position
        return located


def describe_position(source: Any, position: Any) -> str | None:
    """``"data.jsonl, line 34"`` or ``"data.parquet, row group 2, row 5"`` for a reader position, else ``None``.

    Example:
        >>> class Files:
        ...     files = ["a.parquet"]
        >>> describe_position(Files(), [0, 2, 5])
        'a.parquet, row group 2, row 5'
    """
    files = getattr(source, "files", None)
    if not isinstance(files, list) or not isinstance(position, (list, tuple)) or not position:
        return None
    if not isinstance(position[0], int) or not 0 <= position[0] < len(files):
        return None
    path = files[position[0]]
    if len(position) == 3:
        return f"{path}, row group {position[1]}, row {position[2]}"
    if len(position) == 2:
        try:
            with open(path, "rb") as handle:  # the error path only: count the lines before the sample's offset
                line = handle.read(int(position[1])).count(b"\n") + 1
        except OSError:
            return f"{path}, byte {position[1]}"
        return f"{path}, line {line}"
    return None


class StreamSampleNames(Sequence[int]):
    """The stream numbers of a microbatch's samples, with :meth:`describe` for the collators' errors.

    Args:
        samples: the microbatch's samples (tagged by :class:`LocatedReader`, or not when carried in by a resume).
        source: the stream source (its ``files`` name the file).
        share: ``(rank, world_size)`` when ``source`` is this rank's share of the stream.
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], source: Any, share: tuple[int, int] | None = None) -> None:
        self._samples, self._source, self._share = list(samples), source, share

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return [getattr(sample, "number", None) for sample in self._samples[position]]
        return getattr(self._samples[position], "number", None)

    def describe(self, position: int) -> str:
        """``stream sample 33, data.jsonl, line 34`` (what is known of the sample at ``position``)."""
        sample = self._samples[position]
        number = getattr(sample, "number", None)
        if number is None:
            return "a stream sample carried over from before the resume"
        return stream_sample_name(number, getattr(sample, "position", None), self._source, self._share)
