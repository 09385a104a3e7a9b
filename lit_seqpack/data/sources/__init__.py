"""Data sources: one import for every dataset, the length statistics the planner needs, and the over-long policy.

=====================================  ==========================================================
name                                   what
=====================================  ==========================================================
:class:`SyntheticInstructionDataset`   embedded default: a generated, learnable instruction task
                                       with heavy-tailed lengths (``synthetic.py``)
:class:`TokenizedDataset`              pre-tokenised JSONL / Parquet / ``save_to_disk`` data;
:func:`load_tokenized`                 ``load_tokenized(path)`` picks the reader (``sources.py``)
:class:`TextDataset`                   raw text with a local Hugging Face tokenizer (``text.py``)
:func:`compute_lengths`, ...           lengths and loss tokens, fast path or one read; a cache
                                       keyed by the dataset's fingerprint (``lengths.py``)
:func:`apply_overlong_policy`          ``overlong: error | truncate | drop`` with a report
                                       (``overlong.py``)
=====================================  ==========================================================

Every dataset here is map-style, picklable (DataLoader workers) and returns samples
``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` (``labels`` omitted when every token is
trained on), and offers ``lengths``, ``loss_tokens`` and ``fingerprint`` attributes.
"""

from __future__ import annotations

from lit_seqpack.data.lengths import (
    cache_path,
    cached_lengths,
    cached_lengths_and_loss_tokens,
    cached_loss_tokens,
    compute_lengths,
    compute_lengths_and_loss_tokens,
    compute_loss_tokens,
    dataset_fingerprint,
    sample_loss_tokens,
)
from lit_seqpack.data.overlong import (
    OVERLONG_POLICIES,
    DroppedDataset,
    OverlongReport,
    TruncatedDataset,
    apply_overlong_policy,
)
from lit_seqpack.data.sources import TOKENIZED_FORMATS, TokenizedDataset, load_tokenized
from lit_seqpack.data.synthetic import (
    LENGTH_DISTRIBUTIONS,
    SYNTHETIC_TASKS,
    SyntheticInstructionDataset,
    SyntheticTaskConfig,
)
from lit_seqpack.data.text import TextDataset

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "OVERLONG_POLICIES",
    "SYNTHETIC_TASKS",
    "TOKENIZED_FORMATS",
    "DroppedDataset",
    "OverlongReport",
    "SyntheticInstructionDataset",
    "SyntheticTaskConfig",
    "TextDataset",
    "TokenizedDataset",
    "TruncatedDataset",
    "apply_overlong_policy",
    "cache_path",
    "cached_lengths",
    "cached_lengths_and_loss_tokens",
    "cached_loss_tokens",
    "compute_lengths",
    "compute_lengths_and_loss_tokens",
    "compute_loss_tokens",
    "dataset_fingerprint",
    "load_tokenized",
    "sample_loss_tokens",
]
