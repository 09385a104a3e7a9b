"""The logits of a rollout batch through a :class:`~lit_seqpack.model.mixin.PackedSequenceMixin` module, with the
mixin's guards, for the loops that call the model themselves (the log-prob pass, manual optimization)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_seqpack.model.mixin import is_packed_batch

__all__ = ["policy_logits"]


def policy_logits(module: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """``module.seqpack_forward(batch)`` after the checks ``training_step`` of the mixin runs.

    The ids are checked against the vocabulary, and the first packed batch per module and mode runs the structural
    isolation probe (:meth:`~lit_seqpack.model.mixin.PackedSequenceMixin.seqpack_verify_packing`): a model that
    mixes the documents of a packed row raises :class:`~lit_seqpack.model.isolation.PackingLeakError` instead of
    returning log-probs that silently differ from the unpacked run. Works under ``torch.no_grad``.

    Args:
        module: a LightningModule with :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`.
        batch: a batch of :class:`~lit_seqpack.rl.RolloutPlanner` (on the module's device).
    """
    if not hasattr(module, "seqpack_forward"):
        raise TypeError(f"{type(module).__name__} is not a PackedSequenceMixin module (no seqpack_forward)")
    module.seqpack_check_vocab(batch)
    if is_packed_batch(batch) and not batch.get("is_empty", False):
        module.seqpack_verify_packing(batch)
    return module.seqpack_forward(batch)
