"""The logits (or straight the token log-probabilities) of a rollout batch through a
:class:`~lit_seqpack.model.mixin.PackedSequenceMixin` module, with the mixin's guards, for the loops that call the
model themselves (the log-prob pass, manual optimization)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_seqpack.model.chunked_loss import chunked_token_logprobs, with_temperature
from lit_seqpack.model.mixin import is_packed_batch
from lit_seqpack.rl.loss import token_logprobs
from lit_seqpack.rl.objectives import temperature_scaled

__all__ = ["policy_logits", "policy_token_logprobs"]


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
    _check(module, batch)
    return module.seqpack_forward(batch)


def _check(module: Any, batch: Mapping[str, Any]) -> None:
    if not hasattr(module, "seqpack_forward"):
        raise TypeError(f"{type(module).__name__} is not a PackedSequenceMixin module (no seqpack_forward)")
    module.seqpack_check_vocab(batch)
    if is_packed_batch(batch) and not batch.get("is_empty", False):
        module.seqpack_verify_packing(batch)


def policy_token_logprobs(module: Any, batch: Mapping[str, Any], *, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log-probabilities of the batch's labelled tokens under ``module`` (differentiable), after the checks
    of :func:`policy_logits`.

    A module with an output head for the chunked loss (``ReferenceLM``, ``HFCausalLM`` with ``chunked_loss=True``)
    computes them from its hidden states in chunks
    (:func:`~lit_seqpack.model.chunked_loss.chunked_token_logprobs`): no ``[tokens, vocab]`` logits, forward or
    backward. Any other module goes through its full logits and :func:`~lit_seqpack.rl.token_logprobs`. Either way
    ``out[:, t]`` is ``log softmax(logits[:, t - 1] / temperature)[labels[:, t]]``, 0 where the label is -100.

    Args:
        module: a LightningModule with :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`.
        batch: a batch of :class:`~lit_seqpack.rl.RolloutPlanner` (on the module's device).
        temperature: the sampler's temperature (see :func:`~lit_seqpack.rl.temperature_scaled`).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    head = module.seqpack_output_head() if hasattr(module, "seqpack_output_head") else None
    if head is None:
        return token_logprobs(temperature_scaled(policy_logits(module, batch), temperature), batch["labels"])
    _check(module, batch)
    hidden = module.seqpack_hidden_states(batch)
    return chunked_token_logprobs(hidden, with_temperature(head, temperature), batch["labels"])
