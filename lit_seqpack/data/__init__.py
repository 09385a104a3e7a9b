"""Data layer: sources, batching settings, and the two pipelines behind one DataModule.

==========================  ================================================================================
module                      what
==========================  ================================================================================
``datamodule.py``           :class:`SeqPackDataModule`: a thin face; every Lightning hook delegates to ONE pipeline
``settings.py``             :class:`BatchingSettings`: mode, budgets, plan, layout, fields; checked once
``sources/``                where samples come from: one class per source, any map-style dataset, the streams
``batching/``               what both pipelines share: collation, fields, sample rules, over-long policy, loss
                            weights, context-parallel sharding
``indexed/``                :class:`IndexedPipeline`: scan, over-long policy, splits, samplers, loaders, resume
``streaming/``              :class:`StreamPipeline`: windows, loader, cross-rank checks, resume
``_trainer.py``             what the pipelines read from the Trainer: the layout and where training resumes
==========================  ================================================================================

Public names are imported lazily (PEP 562): ``import lit_seqpack.data.indexed.splits`` does not load the DataModule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SeqPackDataModule": "lit_seqpack.data.datamodule",
    "BatchingSettings": "lit_seqpack.data.settings",
    "PackedCollator": "lit_seqpack.data.batching.collate",
    "PaddedCollator": "lit_seqpack.data.batching.collate",
    "ContextParallelCollator": "lit_seqpack.data.batching.context_parallel",
    "TensorParallelCollator": "lit_seqpack.data.batching.context_parallel",
    "OVERLONG_POLICIES": "lit_seqpack.data.batching.overlong",
    "DroppedDataset": "lit_seqpack.data.batching.overlong",
    "OverlongReport": "lit_seqpack.data.batching.overlong",
    "TruncatedDataset": "lit_seqpack.data.batching.overlong",
    "apply_overlong_policy": "lit_seqpack.data.batching.overlong",
    "sample_loss_tokens": "lit_seqpack.data.batching._samples",
    "cache_path": "lit_seqpack.data.indexed.lengths",
    "cached_lengths": "lit_seqpack.data.indexed.lengths",
    "cached_lengths_and_loss_tokens": "lit_seqpack.data.indexed.lengths",
    "cached_loss_tokens": "lit_seqpack.data.indexed.lengths",
    "compute_lengths": "lit_seqpack.data.indexed.lengths",
    "compute_lengths_and_loss_tokens": "lit_seqpack.data.indexed.lengths",
    "compute_loss_tokens": "lit_seqpack.data.indexed.lengths",
    "dataset_fingerprint": "lit_seqpack.data.indexed.lengths",
    "DynamicBatchSampler": "lit_seqpack.data.indexed.samplers",
    "PackedBatchSampler": "lit_seqpack.data.indexed.samplers",
    "PaddedBatchSampler": "lit_seqpack.data.indexed.samplers",
    "PlannedBatchSampler": "lit_seqpack.data.indexed.planned_sampler",
    "PlannedDataset": "lit_seqpack.data.indexed.planned_dataset",
    "IndexView": "lit_seqpack.data.indexed.splits",
    "Split": "lit_seqpack.data.indexed.splits",
    "source_index": "lit_seqpack.data.indexed.splits",
    "split_indices": "lit_seqpack.data.indexed.splits",
    "DataScan": "lit_seqpack.data.indexed.validation",
    "check_vocab_range": "lit_seqpack.data.indexed.validation",
    "scan_dataset": "lit_seqpack.data.indexed.validation",
    "IndexedPipeline": "lit_seqpack.data.indexed.pipeline",
    "StreamPipeline": "lit_seqpack.data.streaming.pipeline",
    "StreamingDataLoader": "lit_seqpack.data.streaming.loader",
    "LENGTH_DISTRIBUTIONS": "lit_seqpack.data.sources",
    "SYNTHETIC_TASKS": "lit_seqpack.data.sources",
    "TOKENIZED_FORMATS": "lit_seqpack.data.sources",
    "ChatDataset": "lit_seqpack.data.sources",
    "ChatSource": "lit_seqpack.data.sources",
    "DatasetSource": "lit_seqpack.data.sources",
    "FileSource": "lit_seqpack.data.sources",
    "GeneratorStream": "lit_seqpack.data.sources",
    "HFIterableStream": "lit_seqpack.data.sources",
    "IndexedSource": "lit_seqpack.data.sources",
    "JsonlStream": "lit_seqpack.data.sources",
    "LitDataStream": "lit_seqpack.data.sources",
    "MixtureStream": "lit_seqpack.data.sources",
    "ParquetStream": "lit_seqpack.data.sources",
    "StreamSource": "lit_seqpack.data.sources",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources",
    "SyntheticStream": "lit_seqpack.data.sources",
    "SyntheticTaskConfig": "lit_seqpack.data.sources",
    "TextDataset": "lit_seqpack.data.sources",
    "TextSource": "lit_seqpack.data.sources",
    "TokenDataset": "lit_seqpack.data.sources",
    "TokenizedDataset": "lit_seqpack.data.sources",
    "TokenizedSource": "lit_seqpack.data.sources",
    "load_tokenized": "lit_seqpack.data.sources",
    "resolve_source": "lit_seqpack.data.sources",
    "write_litdata": "lit_seqpack.data.sources",
}

__all__ = [
    "BatchingSettings",
    "ChatDataset",
    "ChatSource",
    "ContextParallelCollator",
    "DataScan",
    "DatasetSource",
    "DroppedDataset",
    "DynamicBatchSampler",
    "FileSource",
    "GeneratorStream",
    "HFIterableStream",
    "IndexView",
    "IndexedPipeline",
    "IndexedSource",
    "JsonlStream",
    "LENGTH_DISTRIBUTIONS",
    "LitDataStream",
    "MixtureStream",
    "OVERLONG_POLICIES",
    "OverlongReport",
    "PackedBatchSampler",
    "PackedCollator",
    "PaddedBatchSampler",
    "PaddedCollator",
    "ParquetStream",
    "PlannedBatchSampler",
    "PlannedDataset",
    "SYNTHETIC_TASKS",
    "SeqPackDataModule",
    "Split",
    "StreamPipeline",
    "StreamSource",
    "StreamingDataLoader",
    "SyntheticInstructionDataset",
    "SyntheticStream",
    "SyntheticTaskConfig",
    "TOKENIZED_FORMATS",
    "TensorParallelCollator",
    "TextDataset",
    "TextSource",
    "TokenDataset",
    "TokenizedDataset",
    "TokenizedSource",
    "TruncatedDataset",
    "apply_overlong_policy",
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
    "resolve_source",
    "sample_loss_tokens",
    "scan_dataset",
    "source_index",
    "split_indices",
    "write_litdata",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - static analysers see the eager imports
    from lit_seqpack.data.batching._samples import sample_loss_tokens
    from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
    from lit_seqpack.data.batching.context_parallel import ContextParallelCollator, TensorParallelCollator
    from lit_seqpack.data.batching.overlong import (
        OVERLONG_POLICIES,
        DroppedDataset,
        OverlongReport,
        TruncatedDataset,
        apply_overlong_policy,
    )
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.data.indexed.lengths import (
        cache_path,
        cached_lengths,
        cached_lengths_and_loss_tokens,
        cached_loss_tokens,
        compute_lengths,
        compute_lengths_and_loss_tokens,
        compute_loss_tokens,
        dataset_fingerprint,
    )
    from lit_seqpack.data.indexed.pipeline import IndexedPipeline
    from lit_seqpack.data.indexed.planned_dataset import PlannedDataset
    from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler
    from lit_seqpack.data.indexed.samplers import DynamicBatchSampler, PackedBatchSampler, PaddedBatchSampler
    from lit_seqpack.data.indexed.splits import IndexView, Split, source_index, split_indices
    from lit_seqpack.data.indexed.validation import DataScan, check_vocab_range, scan_dataset
    from lit_seqpack.data.settings import BatchingSettings
    from lit_seqpack.data.sources import (
        LENGTH_DISTRIBUTIONS,
        SYNTHETIC_TASKS,
        TOKENIZED_FORMATS,
        ChatDataset,
        ChatSource,
        DatasetSource,
        FileSource,
        GeneratorStream,
        HFIterableStream,
        IndexedSource,
        JsonlStream,
        LitDataStream,
        MixtureStream,
        ParquetStream,
        StreamSource,
        SyntheticInstructionDataset,
        SyntheticStream,
        SyntheticTaskConfig,
        TextDataset,
        TextSource,
        TokenDataset,
        TokenizedDataset,
        TokenizedSource,
        load_tokenized,
        resolve_source,
        write_litdata,
    )
    from lit_seqpack.data.streaming.loader import StreamingDataLoader
    from lit_seqpack.data.streaming.pipeline import StreamPipeline
