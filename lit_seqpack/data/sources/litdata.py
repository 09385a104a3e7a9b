"""``LitDataStream``: a folder written by ``litdata.optimize`` (local or any URL litdata reads) as a stream source.

`litdata <https://github.com/Lightning-AI/litdata>`_ is Lightning's streaming library: ``litdata.optimize`` writes
samples into binary chunks plus an ``index.json``, and ``litdata.StreamingDataset`` reads them back from a local
folder or object storage (``s3://``, ``gs://``, ``hf://``, ...), downloading chunks ahead and evicting them.

The stream reads the folder's samples in their written order (chunk after chunk):

- a position is the number of samples read in the stream's share, and ``open(n)`` restricts the
  ``StreamingDataset`` to the samples after the first ``n`` (its chunks' regions of interest, as
  ``StreamingDataset.subset`` does), so a resume reads nothing twice and needs no litdata state;
- ``split(index, count)`` gives share ``index`` of ``count`` contiguous, nearly equal runs of samples (a
  chunk may straddle two shares, as in litdata's own assignment to ranks and workers); a share splits again the same
  way, so the shares of every rank and DataLoader worker are disjoint and hold every sample once;
- litdata's own rank and worker detection is switched off: the share already says what this reader reads.

A stream sample is a mapping with ``input_ids`` and optionally ``labels`` or ``loss_mask`` (1-D integer arrays of
one length), as for :class:`~lit_seqpack.data.sources.file_streams.JsonlStream`; other keys travel as they are. Arrays
are returned as tensors (a checkpoint holding carried samples then loads with ``weights_only=True``).
:func:`write_litdata` writes such samples into a folder.

litdata is an optional extra, imported only when a folder is read or written. Its release depends on torchvision,
which pulls another torch; install it without its dependencies: see :data:`lit_seqpack._imports.LITDATA_INSTALL_HINT`.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import numbers
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_seqpack._imports import LITDATA_INSTALL_HINT
from lit_seqpack.data.sources.streams import StreamReader

__all__ = ["LitDataStream", "write_litdata"]

_TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


def _litdata() -> Any:
    try:
        import litdata
    except ImportError as err:
        raise ImportError(
            f"LitDataStream and write_litdata need the optional package litdata ({err}): {LITDATA_INSTALL_HINT}"
        ) from err
    return litdata


def _restrict(files: list[str], regions: list[tuple[int, int]], start: int, stop: int) -> tuple[list, list]:
    """The chunks and regions of interest holding samples ``[start, stop)`` of the chunks' samples in order.

    Example:
        >>> _restrict(["a.bin", "b.bin"], [(0, 4), (0, 3)], 2, 5)
        (['a.bin', 'b.bin'], [(2, 4), (0, 1)])
    """
    kept_files, kept_regions, cursor = [], [], 0
    for name, (first, last) in zip(files, regions, strict=True):
        low, high = max(start, cursor), min(stop, cursor + last - first)
        if low < high:
            kept_files.append(name)
            kept_regions.append((first + low - cursor, first + high - cursor))
        cursor += last - first
    return kept_files, kept_regions


class LitDataStream:
    """The samples of a folder written by ``litdata.optimize``, read in order, resumable at a sample count.

    Args:
        input_dir: the optimized folder: a local path or a URL litdata reads (``s3://bucket/data``, ...).
        vocab_size: the vocabulary the samples need (optional; read by ``SeqPackDataModule.vocab_size``).
        cache_dir: where litdata caches downloaded chunks of a remote folder (``None``: litdata's default).
        storage_options: litdata's connection options for the remote store (credentials, endpoint, ...).
        max_cache_size: litdata's cache budget (``"50GB"``, a fraction of the free disk; ``None``: its default).
    """

    def __init__(
        self,
        input_dir: str,
        *,
        vocab_size: int | None = None,
        cache_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        max_cache_size: int | float | str | None = None,
    ) -> None:
        if not isinstance(input_dir, (str, Path)) or not str(input_dir):
            raise ValueError(
                f"LitDataStream.input_dir must be a folder or URL written by litdata.optimize, got {input_dir!r}"
            )
        self.input_dir, self.vocab_size, self.cache_dir = str(input_dir), vocab_size, cache_dir
        self.storage_options, self.max_cache_size = storage_options, max_cache_size
        self.share: tuple[int, int] | None = None  # samples [start, stop) of the folder (None: all, counted lazily)
        self._checked = False  # the local folder's index and chunks were checked (check_folder)

    def __repr__(self) -> str:
        share = "" if self.share is None else f", samples [{self.share[0]}, {self.share[1]})"
        return f"LitDataStream({self.input_dir!r}{share})"

    def _dataset(self) -> Any:
        """A fresh ``StreamingDataset`` of the whole folder, in order, with litdata's own sharding off."""
        litdata = _litdata()
        from litdata.utilities.env import _DistributedEnv, _WorkerEnv

        if not self._checked:
            check_folder(self.input_dir)
            self._checked = True
        try:
            dataset = litdata.StreamingDataset(
                self.input_dir,
                cache_dir=self.cache_dir,
                shuffle=False,
                storage_options=self.storage_options,
                max_cache_size=self.max_cache_size,
            )
        except (ValueError, FileNotFoundError, OSError, KeyError, TypeError, IndexError) as err:
            raise ValueError(
                f"{self!r}: not a folder written by litdata.optimize ({type(err).__name__}: {err}); its index is "
                f"{self.input_dir.rstrip('/')}/index.json"
            ) from None
        dataset.set_drop_last(False)
        dataset.distributed_env = _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)  # a share is read whole
        dataset._forced_worker_env = _WorkerEnv(world_size=1, rank=0)  # not cut again per DataLoader worker
        return dataset

    def _range(self, dataset: Any = None) -> tuple[int, int]:
        if self.share is None:
            regions = (dataset if dataset is not None else self._dataset()).region_of_interest
            self.share = (0, sum(last - first for first, last in regions))
        return self.share

    @property
    def num_samples(self) -> int:
        """Samples in this stream (its share of the folder); reads the folder's index once."""
        start, stop = self._range()
        return stop - start

    def split(self, index: int, count: int) -> LitDataStream:
        """Share ``index`` of ``count``: the ``index``-th of ``count`` contiguous runs of nearly equal size.

        Raises:
            ValueError: ``count < 1`` or ``index`` outside ``[0, count)``, naming the stream.
        """
        ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (index, count))
        if not ints or count < 1 or not 0 <= index < count:
            raise ValueError(
                f"{self!r}.split(index={index!r}, count={count!r}): index must be in [0, count) and count >= 1"
            )
        start, stop = self._range()
        share = copy.copy(self)
        share.share = (start + (stop - start) * index // count, start + (stop - start) * (index + 1) // count)
        return share

    def open(self, position: Any = None) -> StreamReader:
        """A reader after the first ``position`` samples of this stream (``None``: from its start).

        Raises:
            ValueError: ``position`` is not a sample count in ``[0, num_samples]``.
        """
        dataset = self._dataset()
        start, stop = self._range(dataset)
        skip = 0 if position is None else position
        if isinstance(skip, bool) or not isinstance(skip, numbers.Integral) or not 0 <= skip <= stop - start:
            raise ValueError(f"{self!r}: a position is a sample count in [0, {stop - start}], got {position!r}")
        return _LitDataReader(self, dataset, int(skip))


class _LitDataReader(StreamReader):
    """Samples ``start + position`` to ``stop - 1`` of the folder; ``position`` counts the share's samples read."""

    def __init__(self, stream: LitDataStream, dataset: Any, position: int) -> None:
        start, stop = stream._range(dataset)
        self.position, self._number, self._stream = position, start + position, stream
        self._chunks = [
            (name, last - first)
            for name, (first, last) in zip(dataset.subsampled_files, dataset.region_of_interest, strict=True)
        ]
        self._items: Any = iter(())
        if start + position < stop:
            dataset.subsampled_files, dataset.region_of_interest = _restrict(
                dataset.subsampled_files, dataset.region_of_interest, start + position, stop
            )
            self._items = iter(dataset)

    def __next__(self) -> Mapping[str, Any]:
        try:
            item = next(self._items)
        except StopIteration:
            raise
        except Exception as err:  # noqa: BLE001 - litdata's errors name neither the chunk nor the sample
            raise ValueError(
                f"{self._stream.input_dir}: sample {self._number} (in {self._chunk_name()}) cannot be read: "
                f"{type(err).__name__}: {err}. The chunk is damaged, truncated or missing: rewrite the folder"
            ) from err
        sample = _stream_sample(item, f"{self._stream.input_dir}: sample {self._number}")
        self.position, self._number = self.position + 1, self._number + 1
        return sample

    def _chunk_name(self) -> str:
        """The chunk file holding the folder's sample ``self._number``."""
        cursor = 0
        for name, count in self._chunks:
            if self._number < cursor + count:
                return str(Path(self._stream.input_dir, name)) if "://" not in self._stream.input_dir else name
            cursor += count
        return "no chunk of index.json"


def check_folder(input_dir: str) -> None:
    """Refuse a local litdata folder whose ``index.json`` or chunks are damaged, naming the file and what is wrong.

    Checks that ``index.json`` is litdata's JSON index, and that every chunk it lists exists with the listed size and
    (for uncompressed ``PyTreeLoader`` chunks, which ``write_litdata`` writes) a header of the listed sample count
    whose offsets end at the file's end. A remote folder (a URL) is left to litdata.

    Raises:
        ValueError: naming the damaged file and what is wrong with it.
    """
    folder = Path(input_dir)
    if "://" in str(input_dir) or not folder.is_dir():
        return
    index = folder / "index.json"
    if not index.is_file():
        return  # not a litdata folder at all: litdata's own error names the folder
    try:
        data = json.loads(index.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{index}: not valid JSON ({err}): the index is truncated or damaged; rewrite the folder"
        ) from None
    chunks, config = (data.get("chunks"), data.get("config")) if isinstance(data, dict) else (None, None)
    if not isinstance(chunks, list) or not isinstance(config, dict):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{index}: not an index written by litdata.optimize (expected 'chunks', a list, and 'config', a "
            f"mapping; found {found})"
        )
    if not chunks:
        raise ValueError(
            f"{index}: lists no chunk: the writer wrote nothing (an interrupted or failed litdata.optimize, or a "
            "write_litdata whose worker could not start); rewrite the folder"
        )
    plain = config.get("compression") is None and config.get("item_loader", "PyTreeLoader") == "PyTreeLoader"
    for number, chunk in enumerate(chunks):
        _check_chunk(folder, index, number, chunk, plain)


def _check_chunk(folder: Path, index: Path, number: int, chunk: Any, plain: bool) -> None:
    keys = ("filename", "chunk_size", "chunk_bytes")
    if not isinstance(chunk, dict) or any(key not in chunk for key in keys):
        raise ValueError(
            f"{index}: chunk entry {number} is not litdata's (expected the keys {list(keys)}): {chunk!r:.120}"
        )
    path = folder / str(chunk["filename"])
    if not path.is_file():
        raise ValueError(f"{path}: missing (index.json lists it as chunk {number}); rewrite the folder")
    if not plain:
        return
    size, listed = path.stat().st_size, chunk["chunk_bytes"]
    if size != listed:
        raise ValueError(f"{path}: {size} bytes but index.json lists {listed}: the chunk is truncated or damaged")
    count = chunk["chunk_size"]
    with path.open("rb") as file:
        head = file.read(4 * (count + 2))
    damaged = len(head) < 4 * (count + 2) or struct.unpack_from("<I", head)[0] != count
    if not damaged:
        offsets = struct.unpack_from(f"<{count + 1}I", head, 4)
        damaged = (
            offsets[0] != 4 * (count + 2)
            or offsets[-1] != size
            or any(a > b for a, b in zip(offsets, offsets[1:], strict=False))
        )
    if damaged:
        raise ValueError(
            f"{path}: its header does not describe {count} samples ending at byte {size} (as index.json lists): "
            "the chunk is damaged; rewrite the folder"
        )


def _stream_sample(item: Any, where: str) -> dict[str, Any]:
    """A stored item as a stream sample (arrays as tensors), or a ``ValueError`` naming ``where``."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        found = sorted(item) if isinstance(item, Mapping) else type(item).__name__
        raise ValueError(f"{where}: expected a mapping with 'input_ids', got {found}")
    sample = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for key, value in item.items()}
    length = None
    for key in _TOKEN_KEYS:
        value = sample.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() or value.is_complex():
            shown = f"a {value.dim()}-D {value.dtype} tensor" if isinstance(value, torch.Tensor) else repr(value)[:60]
            raise ValueError(f"{where}: {key} must be a 1-D array of integers, got {shown}")
        if length is not None and len(value) != length:
            raise ValueError(f"{where}: {key} has {len(value)} entries but input_ids has {length}")
        length = len(value) if length is None else length
    if not length:
        raise ValueError(f"{where}: input_ids is empty (a document needs at least one token)")
    return sample


def _stored_value(value: Any, key: str, number: int) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple, np.ndarray)):
        array = np.asarray(value)
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype.kind not in ("biu" if key in _TOKEN_KEYS else "biuf"):
            kind = "integers" if key in _TOKEN_KEYS else "numbers"
            raise ValueError(f"write_litdata: sample {number}: {key} must hold {kind}, got {array.dtype}")
        return array
    return value


def _smallest_int(arrays: list[np.ndarray]) -> np.dtype:
    low = min((int(a.min()) for a in arrays if a.size), default=0)
    high = max((int(a.max()) for a in arrays if a.size), default=0)
    return next(
        np.dtype(t) for t in (np.int16, np.int32, np.int64) if np.iinfo(t).min <= low and high <= np.iinfo(t).max
    )


def _identity(item: Any) -> Any:
    return item


def write_litdata(
    samples: Iterable[Mapping[str, Any]],
    output_dir: str | Path,
    *,
    chunk_bytes: int | str = "64MB",
    overwrite: bool = False,
) -> int:
    """Write stream samples into an optimized folder that :class:`LitDataStream` (or ``StreamingDataset``) reads.

    litdata stores one layout for every sample, so every sample must have the keys of the first one, and each array
    key is stored in one dtype: the smallest integer type holding every value of ``input_ids`` / ``labels`` /
    ``loss_mask``, numpy's common type for other arrays. The samples are held in memory while written (one worker
    process); for a large corpus call ``litdata.optimize`` with your own function returning such dicts.

    Args:
        samples: mappings with ``input_ids`` (and optionally ``labels`` or ``loss_mask``, other numbers or arrays).
        output_dir: the folder (or a URL litdata writes to).
        chunk_bytes: the most bytes a chunk holds (``"64MB"``, or an int).
        overwrite: replace what the folder holds (``False``: a non-empty folder is refused by litdata).

    Returns:
        The number of samples written.

    Raises:
        ValueError: no sample, a sample without ``input_ids``, keys that differ from the first sample's, a
            non-numeric array, or a value whose type differs from the first sample's, naming the sample and key.
    """
    litdata = _litdata()
    _refuse_unguarded_import()
    items: list[dict[str, Any]] = []
    for number, sample in enumerate(samples):
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            raise ValueError(f"write_litdata: sample {number} is not a mapping with 'input_ids'")
        item = {str(key): _stored_value(value, key, number) for key, value in sample.items()}
        if items and set(item) != set(items[0]):
            raise ValueError(
                f"write_litdata: sample {number} has the keys {sorted(item)} but sample 0 has {sorted(items[0])}; "
                "litdata stores one layout for every sample (give every sample the same keys, e.g. labels on all)"
            )
        for key, value in item.items():
            if items and isinstance(value, np.ndarray) != isinstance(items[0][key], np.ndarray):
                raise ValueError(
                    f"write_litdata: sample {number}: {key} is {type(value).__name__} but "
                    f"{type(items[0][key]).__name__} in sample 0"
                )
        items.append(item)
    if not items:
        raise ValueError("write_litdata: no sample to write")
    for key, value in items[0].items():
        if isinstance(value, np.ndarray):
            arrays = [item[key] for item in items]
            dtype = _smallest_int(arrays) if key in _TOKEN_KEYS else np.result_type(*arrays)
            for item in items:
                item[key] = item[key].astype(dtype)
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(
            fn=_identity,
            inputs=items,
            output_dir=str(output_dir),
            chunk_bytes=chunk_bytes,
            num_workers=1,
            mode="overwrite" if overwrite else None,
            verbose=False,
        )
    finally:  # litdata forces the process-wide start method to "spawn"; every later DataLoader would spawn too
        multiprocessing.set_start_method(start_method, force=True)
    _check_written(str(output_dir), len(items))
    return len(items)


def _refuse_unguarded_import() -> None:
    """Raise if called from the top level of a script that a spawned process is importing (no ``__main__`` guard):
    litdata's writer runs in such a process, which would call ``write_litdata`` again instead of writing."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise RuntimeError(
                f"write_litdata was called at the top level of {frame.f_code.co_filename}, which a spawned process "
                '(litdata\'s writer) is importing: put the call under `if __name__ == "__main__":`'
            )
        frame = frame.f_back


def _check_written(output_dir: str, count: int) -> None:
    """Raise naming the folder if a local folder's index does not list the ``count`` samples just written."""
    index = Path(output_dir, "index.json")
    if "://" in output_dir:
        return
    try:
        chunks = json.loads(index.read_bytes())["chunks"]
        written = sum(int(chunk["chunk_size"]) for chunk in chunks)
    except (OSError, ValueError, KeyError, TypeError) as err:
        written, chunks = 0, f"unreadable ({type(err).__name__}: {err})"
    if written != count:
        raise RuntimeError(
            f"write_litdata wrote {written} of {count} samples to {output_dir} (index.json lists {chunks!r:.80}): "
            "litdata's writer process failed; it starts with 'spawn', which imports the calling script again, so a "
            'script must call write_litdata under `if __name__ == "__main__":` (its error, if any, is on stderr)'
        )
