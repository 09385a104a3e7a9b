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
``workers.py``              loader workers under ``torch.distributed``: start method, finite waits, stuck ranks named
==========================  ================================================================================

Names are imported lazily (PEP 562): ``import lit_seqpack.data.indexed.splits`` does not load the DataModule.
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SeqPackDataModule": "lit_seqpack.data.datamodule",
    "BatchingSettings": "lit_seqpack.data.settings",
    "PlannedBatchSampler": "lit_seqpack.data.indexed.planned_sampler",
    "PlannedDataset": "lit_seqpack.data.indexed.planned_sampler",
    "PackedCollator": "lit_seqpack.data.batching.collate",
    "PaddedCollator": "lit_seqpack.data.batching.collate",
    "OverlongReport": "lit_seqpack.data.batching.overlong",
    "IndexedSource": "lit_seqpack.data.sources.base",
    "DatasetSource": "lit_seqpack.data.sources.base",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources.synthetic",
    "TokenizedSource": "lit_seqpack.data.sources.files",
    "TextSource": "lit_seqpack.data.sources.text",
    "ChatSource": "lit_seqpack.data.sources.chat",
    "StreamSource": "lit_seqpack.data.sources.streams",
    "JsonlStream": "lit_seqpack.data.sources.file_streams",
    "ParquetStream": "lit_seqpack.data.sources.file_streams",
    "LitDataStream": "lit_seqpack.data.sources.litdata",
    "HFIterableStream": "lit_seqpack.data.sources.streams",
    "GeneratorStream": "lit_seqpack.data.sources.streams",
    "MixtureStream": "lit_seqpack.data.sources.streams",
    "SyntheticStream": "lit_seqpack.data.sources.streams",
    "write_litdata": "lit_seqpack.data.sources.litdata",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
