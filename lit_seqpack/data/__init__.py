"""Data layer: the sources, lengths and over-long policy, the samplers (a rank's view of the plan), collation into
the batch contract (:mod:`lit_seqpack.batch`), and the DataModule that wires them.

Public names are imported lazily (PEP 562): ``import lit_seqpack.data.splits`` does not load the DataModule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PackedCollator": "lit_seqpack.data.collate",
    "PaddedCollator": "lit_seqpack.data.collate",
    "ContextParallelCollator": "lit_seqpack.data.context_parallel",
    "TensorParallelCollator": "lit_seqpack.data.context_parallel",
    "SeqPackDataModule": "lit_seqpack.data.datamodule",
    "cache_path": "lit_seqpack.data.lengths",
    "cached_lengths": "lit_seqpack.data.lengths",
    "cached_lengths_and_loss_tokens": "lit_seqpack.data.lengths",
    "cached_loss_tokens": "lit_seqpack.data.lengths",
    "compute_lengths": "lit_seqpack.data.lengths",
    "compute_lengths_and_loss_tokens": "lit_seqpack.data.lengths",
    "compute_loss_tokens": "lit_seqpack.data.lengths",
    "dataset_fingerprint": "lit_seqpack.data.lengths",
    "sample_loss_tokens": "lit_seqpack.data.lengths",
    "OVERLONG_POLICIES": "lit_seqpack.data.overlong",
    "DroppedDataset": "lit_seqpack.data.overlong",
    "OverlongReport": "lit_seqpack.data.overlong",
    "TruncatedDataset": "lit_seqpack.data.overlong",
    "apply_overlong_policy": "lit_seqpack.data.overlong",
    "DynamicBatchSampler": "lit_seqpack.data.samplers",
    "PackedBatchSampler": "lit_seqpack.data.samplers",
    "PaddedBatchSampler": "lit_seqpack.data.samplers",
    "LENGTH_DISTRIBUTIONS": "lit_seqpack.data.sources",
    "SOURCES": "lit_seqpack.data.sources",
    "SYNTHETIC_TASKS": "lit_seqpack.data.sources",
    "TOKENIZED_FORMATS": "lit_seqpack.data.sources",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources",
    "SyntheticTaskConfig": "lit_seqpack.data.sources",
    "TextDataset": "lit_seqpack.data.sources",
    "TokenDataset": "lit_seqpack.data.sources",
    "TokenizedDataset": "lit_seqpack.data.sources",
    "build_dataset": "lit_seqpack.data.sources",
    "load_tokenized": "lit_seqpack.data.sources",
    "IndexView": "lit_seqpack.data.splits",
    "Split": "lit_seqpack.data.splits",
    "source_index": "lit_seqpack.data.splits",
    "split_indices": "lit_seqpack.data.splits",
    "DataScan": "lit_seqpack.data.validation",
    "check_vocab_range": "lit_seqpack.data.validation",
    "scan_dataset": "lit_seqpack.data.validation",
    "ChatDataset": "lit_seqpack.data.sources",
    "PlannedBatchSampler": "lit_seqpack.data.planned_sampler",
    "GeneratorStream": "lit_seqpack.data.streaming",
    "HFIterableStream": "lit_seqpack.data.streaming",
    "JsonlStream": "lit_seqpack.data.streaming",
    "MixtureStream": "lit_seqpack.data.streaming",
    "ParquetStream": "lit_seqpack.data.streaming",
    "StreamSource": "lit_seqpack.data.streaming",
    "StreamingDataLoader": "lit_seqpack.data.streaming",
    "SyntheticStream": "lit_seqpack.data.streaming",
}

__all__ = [
    "ChatDataset",
    "ContextParallelCollator",
    "DataScan",
    "DroppedDataset",
    "DynamicBatchSampler",
    "GeneratorStream",
    "HFIterableStream",
    "IndexView",
    "JsonlStream",
    "LENGTH_DISTRIBUTIONS",
    "MixtureStream",
    "OVERLONG_POLICIES",
    "OverlongReport",
    "PackedBatchSampler",
    "PackedCollator",
    "PaddedBatchSampler",
    "PaddedCollator",
    "ParquetStream",
    "PlannedBatchSampler",
    "SOURCES",
    "SYNTHETIC_TASKS",
    "SeqPackDataModule",
    "Split",
    "StreamSource",
    "StreamingDataLoader",
    "SyntheticInstructionDataset",
    "SyntheticStream",
    "SyntheticTaskConfig",
    "TOKENIZED_FORMATS",
    "TensorParallelCollator",
    "TextDataset",
    "TokenDataset",
    "TokenizedDataset",
    "TruncatedDataset",
    "apply_overlong_policy",
    "build_dataset",
    "cache_path",
    "cached_lengths",
    "cached_lengths_and_loss_tokens",
    "cached_loss_tokens",
    "check_vocab_range",
    "compute_lengths",
    "compute_lengths_and_loss_tokens",
    "compute_loss_tokens",
    "dataset_fingerprint",
    "load_tokenized",
    "sample_loss_tokens",
    "scan_dataset",
    "source_index",
    "split_indices",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - static analysers see the eager imports
    from lit_seqpack.data.collate import PackedCollator, PaddedCollator
    from lit_seqpack.data.context_parallel import ContextParallelCollator, TensorParallelCollator
    from lit_seqpack.data.datamodule import SeqPackDataModule
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
    from lit_seqpack.data.planned_sampler import PlannedBatchSampler
    from lit_seqpack.data.samplers import DynamicBatchSampler, PackedBatchSampler, PaddedBatchSampler
    from lit_seqpack.data.sources import (
        LENGTH_DISTRIBUTIONS,
        SOURCES,
        SYNTHETIC_TASKS,
        TOKENIZED_FORMATS,
        ChatDataset,
        SyntheticInstructionDataset,
        SyntheticTaskConfig,
        TextDataset,
        TokenDataset,
        TokenizedDataset,
        build_dataset,
        load_tokenized,
    )
    from lit_seqpack.data.splits import IndexView, Split, source_index, split_indices
    from lit_seqpack.data.streaming import (
        GeneratorStream,
        HFIterableStream,
        JsonlStream,
        MixtureStream,
        ParquetStream,
        StreamingDataLoader,
        StreamSource,
        SyntheticStream,
    )
    from lit_seqpack.data.validation import DataScan, check_vocab_range, scan_dataset
