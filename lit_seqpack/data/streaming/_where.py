"""Where a stream sample comes from, for errors: its number in the stream and, for file streams, its file and line
(JSONL) or row group and row (Parquet).

:class:`LocatedReader` wraps a stream reader and tags each sample with its stream number and the reader's position
before it (a dict subclass with the same keys, so nothing downstream sees a difference; it pickles as a plain dict).
The file and line are only worked out when an error names the sample (:func:`describe_position`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["LocatedReader", "StreamSampleNames", "describe_position"]


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


class LocatedReader(Iterator[Mapping[str, Any]]):
    """A stream reader whose samples know their stream number (from ``first``) and position.

    Args:
        reader: the source's reader.
        first: the stream number of the reader's next sample.
    """

    def __init__(self, reader: Any, first: int) -> None:
        self._reader, self._number = reader, first

    @property
    def position(self) -> Any:
        return self._reader.position

    def __next__(self) -> Mapping[str, Any]:
        position = getattr(self._reader, "position", None)
        if type(position) is list:  # a tuple of numbers is one object fewer for the garbage collector to walk
            position = tuple(position)
        sample = next(self._reader)
        number, self._number = self._number, self._number + 1
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
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], source: Any) -> None:
        self._samples, self._source = list(samples), source

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
        where = describe_position(self._source, getattr(sample, "position", None))
        return f"stream sample {number}" + (f", {where}" if where else "")
