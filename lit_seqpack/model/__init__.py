"""Model layer: varlen attention backends, the LightningModule mixin, the loss, model adapters, isolation checks.

Names are imported lazily (PEP 562), and transformers only inside the functions that need it.
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PackedSequenceMixin": "lit_seqpack.model.mixin",
    "HFCausalLM": "lit_seqpack.model.lm",
    "ReferenceLM": "lit_seqpack.model.lm",
    "ReferenceConfig": "lit_seqpack.model.reference",
    "ReferenceDecoder": "lit_seqpack.model.reference",
    "LossOutput": "lit_seqpack.model.loss",
    "token_cross_entropy": "lit_seqpack.model.loss",
    "varlen_attention": "lit_seqpack.model.attention",
    "available_backends": "lit_seqpack.model.attention",
    "use_backend": "lit_seqpack.model.attention",
    "prepare_hf_model": "lit_seqpack.model.hf",
    "check_packing_equivalence": "lit_seqpack.model.isolation",
    "documents_batch": "lit_seqpack.model.isolation",
    "PackingLeakError": "lit_seqpack.model.isolation",
    "FabricAccumulation": "lit_seqpack.model.mixin",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
