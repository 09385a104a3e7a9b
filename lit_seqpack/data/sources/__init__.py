"""Data sources: every dataset the DataModule can read, one :func:`build_dataset` entry point, and their protocol.

=====================================  ==========================================================
name                                   what
=====================================  ==========================================================
:class:`TokenDataset`                  the protocol every dataset here implements: ``len``,
                                       ``[i]``, ``lengths``, ``loss_tokens``, ``fingerprint``
                                       (``protocol.py``)
:func:`build_dataset`                  the dataset a ``source`` name of the DataModule means
                                       (``factory.py``)
:class:`SyntheticInstructionDataset`   embedded default: a generated, learnable instruction task
                                       with heavy-tailed lengths (``synthetic.py``)
:class:`TokenizedDataset`              pre-tokenised JSONL / Parquet / ``save_to_disk`` data;
:func:`load_tokenized`                 ``load_tokenized(path)`` picks the reader (``tokenized.py``)
:class:`TextDataset`                   raw text with a local Hugging Face tokenizer (``text.py``)
=====================================  ==========================================================

Every dataset here is map-style, picklable (DataLoader workers) and returns samples
``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` (``labels`` omitted when every token is
trained on). Lengths, their cache and the over-long policy live beside this package
(:mod:`lit_seqpack.data.lengths`, :mod:`lit_seqpack.data.overlong`).

Example:
    >>> dataset = build_dataset("synthetic", synthetic={"num_samples": 4, "seed": 1})
    >>> isinstance(dataset, TokenDataset), len(dataset)
    (True, 4)
"""

from __future__ import annotations

from lit_seqpack.data.sources.chat import ChatDataset
from lit_seqpack.data.sources.factory import SOURCES, build_dataset
from lit_seqpack.data.sources.protocol import TokenDataset, declared_counts, declared_fingerprint
from lit_seqpack.data.sources.synthetic import (
    LENGTH_DISTRIBUTIONS,
    SYNTHETIC_TASKS,
    SyntheticInstructionDataset,
    SyntheticTaskConfig,
)
from lit_seqpack.data.sources.text import TextDataset
from lit_seqpack.data.sources.tokenized import TOKENIZED_FORMATS, TokenizedDataset, load_tokenized, validate_record

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "SOURCES",
    "SYNTHETIC_TASKS",
    "TOKENIZED_FORMATS",
    "ChatDataset",
    "SyntheticInstructionDataset",
    "SyntheticTaskConfig",
    "TextDataset",
    "TokenDataset",
    "TokenizedDataset",
    "build_dataset",
    "declared_counts",
    "declared_fingerprint",
    "load_tokenized",
    "validate_record",
]
