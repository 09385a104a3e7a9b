"""Streaming data: datasets too big to index, packed online with a bounded look-ahead buffer.

``SeqPackDataModule(source=JsonlStream(...), window=1000)`` trains on a
:class:`~lit_seqpack.data.sources.streams.StreamSource` (a generator, sharded JSONL or Parquet files, a Hugging Face
``IterableDataset``, a weighted mixture of those) without reading it up front:

- :mod:`~lit_seqpack.data.sources.streams`: the readers, each reopenable at a saved position;
- :mod:`~lit_seqpack.data.streaming.buffer`: the stream cut into windows of ``window`` samples, each planned by the
  offline planner (for all ranks under ``stream_split="replicate"``, for the rank's own share under ``"rank"``) with
  the over-long policy counted, and how a window is packed (its least-full rows wait for the next window);
- :mod:`~lit_seqpack.data.streaming.dataset`: the rank's ``IterableDataset`` of collated microbatches, and each
  sample's stream number and file position, named by the errors;
- :mod:`~lit_seqpack.data.streaming.lanes`: a rank's share read in lanes by its loader workers;
- :mod:`~lit_seqpack.data.streaming.loader`: the DataLoader, its mid-stream resume state, and the lock step of ranks
  reading their own shares (one small collective a window; fillers once a share ends);
- :mod:`~lit_seqpack.data.streaming.rank_check`: the windows' digests, compared across ranks under
  ``stream_split="replicate"`` (every rank must read the same stream);
- :mod:`~lit_seqpack.data.streaming.pipeline`: what the DataModule delegates to, the resume checks, and the samples
  training reads first, planned as the loaders plan them (``lit-seqpack inspect``).
"""

from __future__ import annotations
