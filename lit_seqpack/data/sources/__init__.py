"""Data sources: objects that own their settings and say where samples come from.

=====================================  ==========================================================
name                                   what
=====================================  ==========================================================
:class:`IndexedSource`                 a map-style source: ``load(split)`` -> the dataset of
                                       ``"train"`` / ``"val"`` / ``"test"`` (``base.py``)
any map-style dataset                  its own training split (:class:`DatasetSource`); a
                                       ``torch.utils.data.Dataset`` subclass is chosen in YAML
                                       by ``class_path``
:class:`SyntheticInstructionDataset`   embedded default (``source="synthetic"``): a generated,
                                       learnable instruction task with heavy-tailed lengths
:class:`TokenizedSource`               pre-tokenised JSONL / Parquet / ``save_to_disk`` files,
                                       with their validation and test files (``files.py``)
:class:`TextSource`                    raw text + a local Hugging Face tokenizer (``text.py``)
:class:`ChatSource`                    conversations + the tokenizer's chat template (``chat.py``)
:class:`StreamSource`                  read in order, never indexed (split by rank where it is a
                                       :class:`SplittableStream`): :class:`JsonlStream`,
                                       :class:`ParquetStream`, :class:`HFIterableStream`,
                                       :class:`GeneratorStream`, :class:`SyntheticStream`,
                                       :class:`MixtureStream` (``streams.py``; the file streams
                                       in ``file_streams.py``),
                                       :class:`LitDataStream` (a ``litdata.optimize`` folder,
                                       ``litdata.py``)
:class:`TokenDataset`                  what a dataset may declare so it is never scanned:
                                       ``lengths``, ``loss_tokens``, ``fingerprint``
                                       (``protocol.py``)
=====================================  ==========================================================

Every dataset here is map-style, picklable (DataLoader workers) and returns samples
``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` (``labels`` omitted when every token is trained on).

Example:
    >>> source = resolve_source("synthetic")
    >>> dataset = source.load("train")
    >>> isinstance(dataset, TokenDataset), len(dataset) > 0
    (True, True)
"""

from __future__ import annotations

from lit_seqpack.data.sources.base import SHORTCUTS, DatasetSource, IndexedSource, resolve_source
from lit_seqpack.data.sources.chat import ChatDataset, ChatSource
from lit_seqpack.data.sources.file_streams import JsonlStream, ParquetStream
from lit_seqpack.data.sources.files import FileSource, TokenizedSource
from lit_seqpack.data.sources.litdata import LitDataStream, write_litdata
from lit_seqpack.data.sources.protocol import TokenDataset, declared_counts, declared_fingerprint
from lit_seqpack.data.sources.streams import (
    GeneratorStream,
    HFIterableStream,
    MixtureStream,
    SplittableStream,
    StreamReader,
    StreamSource,
    SyntheticStream,
)
from lit_seqpack.data.sources.synthetic import (
    LENGTH_DISTRIBUTIONS,
    SYNTHETIC_TASKS,
    SyntheticInstructionDataset,
    SyntheticTaskConfig,
)
from lit_seqpack.data.sources.text import TextDataset, TextSource
from lit_seqpack.data.sources.tokenized import TOKENIZED_FORMATS, TokenizedDataset, load_tokenized, validate_record

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "SHORTCUTS",
    "SYNTHETIC_TASKS",
    "TOKENIZED_FORMATS",
    "ChatDataset",
    "ChatSource",
    "DatasetSource",
    "FileSource",
    "GeneratorStream",
    "HFIterableStream",
    "IndexedSource",
    "JsonlStream",
    "LitDataStream",
    "MixtureStream",
    "ParquetStream",
    "SplittableStream",
    "StreamReader",
    "StreamSource",
    "SyntheticInstructionDataset",
    "SyntheticStream",
    "SyntheticTaskConfig",
    "TextDataset",
    "TextSource",
    "TokenDataset",
    "TokenizedDataset",
    "TokenizedSource",
    "declared_counts",
    "declared_fingerprint",
    "load_tokenized",
    "resolve_source",
    "validate_record",
    "write_litdata",
]
