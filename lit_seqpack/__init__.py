"""lit_seqpack: sequence packing and dynamic (token-budget) batching for PyTorch Lightning.

The names a quick start or guide imports; everything else is reached through its layer (``lit_seqpack.data``,
``lit_seqpack.planning``, ``lit_seqpack.model``, ``lit_seqpack.metrics``, ``lit_seqpack.rl``, ``lit_seqpack.parallel``)
or the module that defines it. Names are imported lazily (PEP 562) so that ``import lit_seqpack`` stays cheap, never
touches CUDA, and the torch-free planner can be used without importing torch or Lightning.
"""

from __future__ import annotations

__version__ = "0.1.0"

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SeqPackDataModule": "lit_seqpack.data.datamodule",
    "BatchingSettings": "lit_seqpack.data.settings",
    "PlannedBatchSampler": "lit_seqpack.data.indexed.planned_sampler",
    "PlannedDataset": "lit_seqpack.data.indexed.planned_sampler",
    "PackedCollator": "lit_seqpack.data.batching.collate",
    "PaddedCollator": "lit_seqpack.data.batching.collate",
    "OverlongReport": "lit_seqpack.data.batching.overlong",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources.synthetic",
    "TokenizedSource": "lit_seqpack.data.sources.files",
    "TextSource": "lit_seqpack.data.sources.text",
    "ChatSource": "lit_seqpack.data.sources.chat",
    "JsonlStream": "lit_seqpack.data.sources.file_streams",
    "ParquetStream": "lit_seqpack.data.sources.file_streams",
    "PlanConfig": "lit_seqpack.planning.config",
    "Plan": "lit_seqpack.planning.plan",
    "build_plan": "lit_seqpack.planning.plan",
    "get_packer": "lit_seqpack.planning.algorithms",
    "packing_stats": "lit_seqpack.planning.stats",
    "PACKING_ALGORITHMS": "lit_seqpack.planning.algorithms",
    "MicrobatchMeta": "lit_seqpack.batch",
    "PackedSequenceMixin": "lit_seqpack.model.mixin",
    "HFCausalLM": "lit_seqpack.model.lm",
    "ReferenceLM": "lit_seqpack.model.lm",
    "LossOutput": "lit_seqpack.model.loss",
    "varlen_attention": "lit_seqpack.model.attention",
    "available_backends": "lit_seqpack.model.attention",
    "prepare_hf_model": "lit_seqpack.model.hf",
    "check_packing_equivalence": "lit_seqpack.model.isolation",
    "PackingLeakError": "lit_seqpack.model.isolation",
    "FabricAccumulation": "lit_seqpack.model.mixin",
    "PaddingRatio": "lit_seqpack.metrics.packing",
    "TokensPerSecond": "lit_seqpack.metrics.packing",
    "PackingEfficiency": "lit_seqpack.metrics.packing",
    "PackingMonitor": "lit_seqpack.callbacks",
    "SeqPackCLI": "lit_seqpack.cli",
    "predictions_in_order": "lit_seqpack.prediction",
    "DataParallelLayout": "lit_seqpack.parallel.layout",
    "Rollout": "lit_seqpack.rl.rollout",
    "RolloutPlanner": "lit_seqpack.rl.planner",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
