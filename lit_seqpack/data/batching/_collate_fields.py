"""What the collators do with declared fields and loss weights (shared by the packed and padded collator).

The collators are frozen dataclasses with ``token_fields``, ``sample_fields``, ``loss_weight_field`` and a private
``_reported`` set; these helpers read those settings (see :mod:`lit_seqpack.data.batching.fields` and
:mod:`lit_seqpack.data.batching.loss_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_seqpack.data.batching._samples import sample_names
from lit_seqpack.data.batching.fields import FieldValues, check_fields, empty_fields, read_fields
from lit_seqpack.data.batching.loss_weights import (
    check_loss_weight_field,
    loss_weight_scalars,
    read_loss_weights,
)

__all__ = ["declare_fields", "empty_collator_fields", "read_collator_fields", "token_pads", "weight_scalars"]


def declare_fields(collator: Any) -> None:
    """Validate and normalise a collator's ``token_fields`` / ``sample_fields`` (frozen, so via ``object``)."""
    tokens, samples = check_fields(collator.token_fields, collator.sample_fields)
    check_loss_weight_field(collator.loss_weight_field, tokens)
    object.__setattr__(collator, "token_fields", tokens)
    object.__setattr__(collator, "sample_fields", samples)


def read_collator_fields(
    collator: Any, samples: Sequence[Mapping[str, Any]], docs: Sequence[np.ndarray], labels: torch.Tensor
) -> FieldValues:
    """The declared fields of the samples, plus their ``loss_weights`` when a ``loss_weight_field`` is set."""
    names = sample_names(samples)
    fields = read_fields(samples, docs, names, collator.token_fields, collator.sample_fields, collator._reported)
    if collator.loss_weight_field is not None:
        per_doc = labels.split([len(d) for d in docs])
        fields.tokens["loss_weights"] = read_loss_weights(samples, per_doc, collator.loss_weight_field, names)
    return fields


def token_pads(collator: Any) -> dict[str, float | int]:
    """Pad value of every per-token field the collator places (the declared ones and ``loss_weights``)."""
    return collator.token_fields | ({"loss_weights": 0.0} if collator.loss_weight_field is not None else {})


def weight_scalars(collator: Any, batch: dict[str, Any], meta: Any, stats: dict[str, Any]) -> dict[str, Any]:
    if collator.loss_weight_field is None:
        return {}
    return loss_weight_scalars(batch["loss_weights"], meta, stats["step_loss_tokens"], stats["is_empty"])


def empty_collator_fields(collator: Any) -> FieldValues:
    fields = empty_fields(collator.token_fields, collator.sample_fields)
    if collator.loss_weight_field is not None:
        fields.tokens["loss_weights"] = []
    return fields
