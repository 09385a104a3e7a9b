"""Model layer: varlen attention backends, the LightningModule mixin, the loss, model adapters, isolation checks.

Public names are imported lazily (PEP 562), and transformers only inside the functions that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BACKENDS": "lit_seqpack.model.attention",
    "BackendUnavailableError": "lit_seqpack.model.attention",
    "available_backends": "lit_seqpack.model.attention",
    "reference_varlen_attention": "lit_seqpack.model.attention",
    "use_backend": "lit_seqpack.model.attention",
    "varlen_attention": "lit_seqpack.model.attention",
    "context_parallel_scope": "lit_seqpack.model.cp_attention",
    "FabricAccumulation": "lit_seqpack.model.fabric",
    "UnsupportedAttentionError": "lit_seqpack.model.hf",
    "hf_model_inputs": "lit_seqpack.model.hf",
    "prepare_hf_model": "lit_seqpack.model.hf",
    "restore_hf_attention": "lit_seqpack.model.hf",
    "export_hf_model": "lit_seqpack.model.hf_load",
    "load_hf_model": "lit_seqpack.model.hf_load",
    "IsolationReport": "lit_seqpack.model.isolation",
    "PackingLeakError": "lit_seqpack.model.isolation",
    "PackingReport": "lit_seqpack.model.isolation",
    "check_packing_equivalence": "lit_seqpack.model.isolation",
    "documents_batch": "lit_seqpack.model.isolation",
    "probe_packing_isolation": "lit_seqpack.model.isolation",
    "HFCausalLM": "lit_seqpack.model.lm",
    "ReferenceLM": "lit_seqpack.model.lm",
    "LossOutput": "lit_seqpack.model.loss",
    "exact_loss": "lit_seqpack.model.loss",
    "sequence_cross_entropy": "lit_seqpack.model.loss",
    "token_cross_entropy": "lit_seqpack.model.loss",
    "PackedSequenceMixin": "lit_seqpack.model.mixin",
    "REFERENCE_PRESETS": "lit_seqpack.model.reference",
    "ReferenceConfig": "lit_seqpack.model.reference",
    "ReferenceDecoder": "lit_seqpack.model.reference",
    "model_vocab_size": "lit_seqpack.model.vocab",
}

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "FabricAccumulation",
    "HFCausalLM",
    "IsolationReport",
    "LossOutput",
    "PackedSequenceMixin",
    "PackingLeakError",
    "PackingReport",
    "REFERENCE_PRESETS",
    "ReferenceConfig",
    "ReferenceDecoder",
    "ReferenceLM",
    "UnsupportedAttentionError",
    "available_backends",
    "check_packing_equivalence",
    "context_parallel_scope",
    "documents_batch",
    "exact_loss",
    "export_hf_model",
    "hf_model_inputs",
    "load_hf_model",
    "model_vocab_size",
    "prepare_hf_model",
    "probe_packing_isolation",
    "reference_varlen_attention",
    "restore_hf_attention",
    "sequence_cross_entropy",
    "token_cross_entropy",
    "use_backend",
    "varlen_attention",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover - static analysers see the eager imports
    from lit_seqpack.model.attention import (
        BACKENDS,
        BackendUnavailableError,
        available_backends,
        reference_varlen_attention,
        use_backend,
        varlen_attention,
    )
    from lit_seqpack.model.cp_attention import context_parallel_scope
    from lit_seqpack.model.fabric import FabricAccumulation
    from lit_seqpack.model.hf import UnsupportedAttentionError, hf_model_inputs, prepare_hf_model, restore_hf_attention
    from lit_seqpack.model.hf_load import export_hf_model, load_hf_model
    from lit_seqpack.model.isolation import (
        IsolationReport,
        PackingLeakError,
        PackingReport,
        check_packing_equivalence,
        documents_batch,
        probe_packing_isolation,
    )
    from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
    from lit_seqpack.model.loss import LossOutput, exact_loss, sequence_cross_entropy, token_cross_entropy
    from lit_seqpack.model.mixin import PackedSequenceMixin
    from lit_seqpack.model.reference import REFERENCE_PRESETS, ReferenceConfig, ReferenceDecoder
    from lit_seqpack.model.vocab import model_vocab_size
