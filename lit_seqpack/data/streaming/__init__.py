"""Streaming data: datasets too big to index, packed online with a bounded look-ahead buffer.

``SeqPackDataModule(stream=..., stream_buffer=1000)`` trains on a :class:`StreamSource` (a generator, sharded JSONL
or Parquet files, a Hugging Face ``IterableDataset``, a weighted mixture of those) without reading it up front:

- :mod:`~lit_seqpack.data.streaming.sources`: the readers, each reopenable at a saved position;
- :mod:`~lit_seqpack.data.streaming.buffer`: the stream cut into windows of ``stream_buffer`` samples, each planned
  by the offline planner for all ranks (lock step, exact loss, every sample once) with the over-long policy counted;
- :mod:`~lit_seqpack.data.streaming.dataset`: the rank's ``IterableDataset`` of collated microbatches;
- :mod:`~lit_seqpack.data.streaming.loader`: the DataLoader and its mid-stream resume state;
- :mod:`~lit_seqpack.data.streaming.rank_check`: the windows' digests, compared across ranks (every rank must read
  the same stream);
- :mod:`~lit_seqpack.data.streaming.module`: what the DataModule delegates to.
"""

from lit_seqpack.data.streaming.buffer import OverlongCounter, StreamWindow, stream_windows
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.data.streaming.sources import (
    GeneratorStream,
    HFIterableStream,
    JsonlStream,
    MixtureStream,
    ParquetStream,
    StreamReader,
    StreamSource,
    SyntheticStream,
)

__all__ = [
    "GeneratorStream",
    "HFIterableStream",
    "JsonlStream",
    "MixtureStream",
    "OverlongCounter",
    "ParquetStream",
    "StreamReader",
    "StreamSource",
    "StreamWindow",
    "StreamingDataLoader",
    "StreamingDataset",
    "SyntheticStream",
    "stream_windows",
]
