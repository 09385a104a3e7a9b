"""lit_seqpack: sequence packing and dynamic (token-budget) batching for PyTorch Lightning.

Public names are imported lazily (PEP 562) so that ``import lit_seqpack`` stays cheap, never touches
CUDA, and the torch-free planner can be used without importing torch or Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_seqpack._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # planning (pure Python + numpy)
    "PACKING_ALGORITHMS": "lit_seqpack.planning",
    "Packer": "lit_seqpack.planning",
    "PackingStats": "lit_seqpack.planning",
    "get_packer": "lit_seqpack.planning",
    "packing_stats": "lit_seqpack.planning",
    "Plan": "lit_seqpack.planning",
    "PlanConfig": "lit_seqpack.planning",
    "PlanStats": "lit_seqpack.planning",
    "build_plan": "lit_seqpack.planning",
    # data
    "MicrobatchMeta": "lit_seqpack.batch",
    "PlannedDataset": "lit_seqpack.data",
    "PackedBatchSampler": "lit_seqpack.data",
    "DynamicBatchSampler": "lit_seqpack.data",
    "PaddedBatchSampler": "lit_seqpack.data",
    "PlannedBatchSampler": "lit_seqpack.data",
    "PackedCollator": "lit_seqpack.data",
    "PaddedCollator": "lit_seqpack.data",
    "SeqPackDataModule": "lit_seqpack.data",
    "BatchingSettings": "lit_seqpack.data",
    "IndexedSource": "lit_seqpack.data",
    "TokenizedSource": "lit_seqpack.data",
    "TextSource": "lit_seqpack.data",
    "ChatSource": "lit_seqpack.data",
    "SeqPackCLI": "lit_seqpack.cli",
    "PackingLeakError": "lit_seqpack.model.isolation",
    "prepare_hf_model": "lit_seqpack.model.hf",
    "LossOutput": "lit_seqpack.model.loss",
    "HFCausalLM": "lit_seqpack.model.lm",
    "ReferenceLM": "lit_seqpack.model.lm",
    "ReferenceDecoder": "lit_seqpack.model.reference",
    "ReferenceConfig": "lit_seqpack.model.reference",
    "apply_overlong_policy": "lit_seqpack.data",
    "OverlongReport": "lit_seqpack.data",
    "TextDataset": "lit_seqpack.data",
    "load_tokenized": "lit_seqpack.data",
    "TokenDataset": "lit_seqpack.data",
    "TokenizedDataset": "lit_seqpack.data",
    "SyntheticInstructionDataset": "lit_seqpack.data",
    "ChatDataset": "lit_seqpack.data",
    # streams too big to index
    "StreamSource": "lit_seqpack.data",
    "GeneratorStream": "lit_seqpack.data",
    "HFIterableStream": "lit_seqpack.data",
    "JsonlStream": "lit_seqpack.data",
    "LitDataStream": "lit_seqpack.data",
    "MixtureStream": "lit_seqpack.data",
    "ParquetStream": "lit_seqpack.data",
    "SyntheticStream": "lit_seqpack.data",
    # parallel layout of ranks (shared by data and model)
    "ParallelLayout": "lit_seqpack.parallel",
    "DataParallelLayout": "lit_seqpack.parallel",
    # model
    "varlen_attention": "lit_seqpack.model.attention",
    "available_backends": "lit_seqpack.model.attention",
    "PackedSequenceMixin": "lit_seqpack.model.mixin",
    "FabricAccumulation": "lit_seqpack.model.fabric",
    "check_packing_equivalence": "lit_seqpack.model.isolation",
    # metrics and callbacks
    "PaddingRatio": "lit_seqpack.metrics",
    "TokensPerSecond": "lit_seqpack.metrics",
    "PackingEfficiency": "lit_seqpack.metrics",
    "RankImbalance": "lit_seqpack.metrics",
    "PackingMonitor": "lit_seqpack.callbacks",
    # RL post-training
    "Rollout": "lit_seqpack.rl",
    "RolloutPlanner": "lit_seqpack.rl",
}

__all__ = [
    "BatchingSettings",
    "ChatSource",
    "DataParallelLayout",
    "IndexedSource",
    "TextSource",
    "TokenizedSource",
    "ChatDataset",
    "DynamicBatchSampler",
    "FabricAccumulation",
    "GeneratorStream",
    "HFCausalLM",
    "HFIterableStream",
    "JsonlStream",
    "LitDataStream",
    "LossOutput",
    "MicrobatchMeta",
    "MixtureStream",
    "OverlongReport",
    "PACKING_ALGORITHMS",
    "PackedBatchSampler",
    "PackedCollator",
    "PackedSequenceMixin",
    "Packer",
    "PackingEfficiency",
    "PackingLeakError",
    "PackingMonitor",
    "PackingStats",
    "PaddedBatchSampler",
    "PaddedCollator",
    "PaddingRatio",
    "ParallelLayout",
    "ParquetStream",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "PlannedBatchSampler",
    "PlannedDataset",
    "RankImbalance",
    "ReferenceConfig",
    "ReferenceDecoder",
    "ReferenceLM",
    "Rollout",
    "RolloutPlanner",
    "SeqPackCLI",
    "SeqPackDataModule",
    "StreamSource",
    "SyntheticInstructionDataset",
    "SyntheticStream",
    "TextDataset",
    "TokenDataset",
    "TokenizedDataset",
    "TokensPerSecond",
    "apply_overlong_policy",
    "available_backends",
    "build_plan",
    "check_packing_equivalence",
    "get_packer",
    "load_tokenized",
    "packing_stats",
    "prepare_hf_model",
    "varlen_attention",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover - static analysers see the eager imports
    from lit_seqpack.batch import MicrobatchMeta
    from lit_seqpack.callbacks import PackingMonitor
    from lit_seqpack.cli import SeqPackCLI
    from lit_seqpack.data import (
        BatchingSettings,
        ChatDataset,
        ChatSource,
        DynamicBatchSampler,
        GeneratorStream,
        HFIterableStream,
        IndexedSource,
        JsonlStream,
        LitDataStream,
        MixtureStream,
        OverlongReport,
        PackedBatchSampler,
        PackedCollator,
        PaddedBatchSampler,
        PaddedCollator,
        ParquetStream,
        PlannedBatchSampler,
        PlannedDataset,
        SeqPackDataModule,
        StreamSource,
        SyntheticInstructionDataset,
        SyntheticStream,
        TextDataset,
        TextSource,
        TokenDataset,
        TokenizedDataset,
        TokenizedSource,
        apply_overlong_policy,
        load_tokenized,
    )
    from lit_seqpack.metrics import PackingEfficiency, PaddingRatio, RankImbalance, TokensPerSecond
    from lit_seqpack.model.attention import available_backends, varlen_attention
    from lit_seqpack.model.hf import prepare_hf_model
    from lit_seqpack.model.isolation import PackingLeakError, check_packing_equivalence
    from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
    from lit_seqpack.model.loss import LossOutput
    from lit_seqpack.model.mixin import PackedSequenceMixin
    from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder
    from lit_seqpack.parallel import DataParallelLayout, ParallelLayout
    from lit_seqpack.planning import (
        PACKING_ALGORITHMS,
        Packer,
        PackingStats,
        Plan,
        PlanConfig,
        PlanStats,
        build_plan,
        get_packer,
        packing_stats,
    )
    from lit_seqpack.rl import Rollout, RolloutPlanner
