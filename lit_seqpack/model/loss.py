"""Causal-LM loss on the batch contract, and the exact normalisation over accumulation and ranks.

A loss is described by a :class:`LossOutput`: the *sum* of per-unit losses of one microbatch (units are tokens
for the default token-mean loss), how many units it holds, and how many units the whole optimizer step holds
over all ranks. :func:`exact_loss` turns it into the value to back-propagate so that, after Lightning divides by
``accumulate_grad_batches`` and DDP averages over ``world_size`` ranks, the gradient is the one of the mean over
every unit of the optimizer step, as if all its samples had been one big padded batch.

Example:
    >>> import torch
    >>> logits = torch.zeros(1, 4, 8)
    >>> labels = torch.tensor([[-100, 1, 2, -100]])
    >>> out = token_cross_entropy(logits, labels)
    >>> round(out.loss_sum.item() / out.num_units, 4), out.num_units
    (2.0794, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lit_seqpack.batch import IGNORE_INDEX, shift_labels

__all__ = [
    "IGNORE_INDEX",
    "LossOutput",
    "exact_loss",
    "sequence_cross_entropy",
    "shift_labels",
    "token_cross_entropy",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossOutput:
    """What a loss hook returns for one microbatch.

    Args:
        loss_sum: scalar tensor, the sum of the per-unit losses of this microbatch (attached to the graph).
        num_units: units (tokens for a token-mean loss, documents for a sequence-mean loss, the loss-weight sum
            for a weighted token loss) summed in ``loss_sum``; the logged value is ``loss_sum / num_units``.
        step_units: units of the whole optimizer step over all ranks. With it the loss is exact (the gradient
            of the mean over every unit of the step). ``None`` normalises locally: the microbatch mean, which
            Lightning and DDP then average (exact only when every microbatch holds as many units).
    """

    loss_sum: torch.Tensor
    num_units: int | float
    step_units: int | float | None = None

    def __post_init__(self) -> None:
        if self.loss_sum.ndim != 0:
            raise ValueError(f"loss_sum must be a scalar tensor, got shape {tuple(self.loss_sum.shape)}")
        if self.num_units < 0:
            raise ValueError(f"num_units must be >= 0, got {self.num_units}")
        # weight sums (floats) are compared with a relative tolerance for the rounding of a different summation order
        slack = 1e-6 * self.num_units if isinstance(self.num_units, float) else 0
        if self.step_units is not None and self.step_units < self.num_units - slack:
            raise ValueError(
                f"step_units ({self.step_units}) must be >= num_units ({self.num_units}): the step total includes "
                "this microbatch"
            )


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_loss_tokens: int | float | None = None,
    step_loss_tokens: int | float | None = None,
    chunk_size: int | None = None,
    shifted: bool = False,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """Summed next-token cross-entropy over the labels that are not ``-100`` (HF shift convention).

    With ``weights`` each target's loss is scaled by its weight (``sum(w * ce)``) and the units are weight sums:
    ``num_loss_tokens`` / ``step_loss_tokens`` are then the microbatch's and the step's loss-weight sums (the
    batch's ``num_loss_weight`` and ``step_loss_weight``).

    Args:
        logits: ``[B, T, V]``; ``logits[:, t]`` predicts ``labels[:, t + 1]``.
        labels: ``[B, T]`` with ``-100`` on positions without a target.
        num_loss_tokens: the count of target positions if the caller knows it (the collator's Python int);
            computed otherwise (one device sync).
        step_loss_tokens: the optimizer step's loss tokens over all ranks, passed through to the output.
        chunk_size: compute the loss over this many positions at a time, each chunk upcast to float32 on its
            own, so a bf16 model never holds a float32 copy of all its logits; ``None`` does it in one go.
            Half-precision logits are upcast to float32; float32 and float64 logits are used as they are.
        shifted: ``labels`` are already the targets of the logits (``labels[:, t]`` for ``logits[:, t]``), e.g. the
            ``shift_labels`` of a context-parallel shard, whose next token may live on another rank.
        weights: ``[B, T]`` per-token loss weights aligned with ``labels`` (the weight at ``t`` scales the loss of
            predicting ``labels[:, t]``; shifted with them unless ``shifted``), e.g. the batch's ``loss_weights``.

    Example:
        >>> out = token_cross_entropy(torch.zeros(1, 3, 4), torch.tensor([[-100, 1, 2]]), weights=torch.tensor(
        ...     [[0.0, 0.5, 1.0]]))
        >>> round(out.loss_sum.item(), 4), out.num_units
        (2.0794, 1.5)
    """
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"weights must have the shape of labels {tuple(labels.shape)}, got {tuple(weights.shape)}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = (labels if shifted else shift_labels(labels)).reshape(-1)
    step = max(flat_labels.numel(), 1) if chunk_size is None else chunk_size
    if weights is None:
        parts = [
            F.cross_entropy(_upcast(chunk), target, ignore_index=IGNORE_INDEX, reduction="sum")
            for chunk, target in zip(flat_logits.split(step), flat_labels.split(step), strict=True)
        ]
    else:
        flat_weights = (weights if shifted else F.pad(weights[..., 1:], (0, 1))).reshape(-1)
        parts = [
            (F.cross_entropy(_upcast(chunk), target, ignore_index=IGNORE_INDEX, reduction="none") * weight).sum()
            for chunk, target, weight in zip(
                flat_logits.split(step), flat_labels.split(step), flat_weights.split(step), strict=True
            )
        ]
    loss_sum = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    if num_loss_tokens is None and weights is None:
        num_loss_tokens = int((flat_labels != IGNORE_INDEX).sum())
    elif num_loss_tokens is None:
        num_loss_tokens = float(flat_weights[flat_labels != IGNORE_INDEX].double().sum())
    return LossOutput(loss_sum=loss_sum, num_units=num_loss_tokens, step_units=step_loss_tokens)


def sequence_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    num_documents: int | None = None,
    step_documents: int | None = None,
) -> LossOutput:
    """Summed per-document mean cross-entropy: every document weighs the same, whatever its length.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]`` with ``-100`` on positions without a target.
        cu_seqlens: the segments of a packed row (``B == 1``); ``None`` makes every row a document.
        num_documents: documents of a packed row (its first segments; a padding tail is not one); ``None``
            counts every segment.
        step_documents: documents of the whole optimizer step over all ranks (exact normalisation); ``None``
            normalises by this microbatch's documents.

    Example:
        >>> logits = torch.zeros(1, 5, 4)
        >>> labels = torch.tensor([[-100, 1, -100, 2, 3]])  # documents [0, 2) and [2, 5)
        >>> out = sequence_cross_entropy(logits, labels, cu_seqlens=torch.tensor([0, 2, 5]))
        >>> round(out.loss_sum.item(), 4), out.num_units
        (2.7726, 2)
    """
    targets = shift_labels(labels)
    token_loss = F.cross_entropy(
        _upcast(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if cu_seqlens is None:
        lengths = torch.full((labels.shape[0],), labels.shape[1], device=labels.device)
    elif labels.shape[0] != 1:
        raise ValueError(
            f"a packed row (cu_seqlens given) must have batch size 1, got labels of shape {tuple(labels.shape)}"
        )
    else:
        lengths = cu_seqlens.diff().long()
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=labels.device), lengths)
    n = len(lengths) if num_documents is None else num_documents
    loss_per_doc = token_loss.new_zeros(len(lengths)).index_add(0, segment, token_loss)[:n]
    has_target = (targets.reshape(-1) != IGNORE_INDEX).to(token_loss.dtype)
    targets_per_doc = token_loss.new_zeros(len(lengths)).index_add(0, segment, has_target)[:n]
    loss_sum = (loss_per_doc / targets_per_doc.clamp(min=1)).sum()
    return LossOutput(loss_sum=loss_sum, num_units=n, step_units=step_documents)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def exact_loss(output: LossOutput, batch: Mapping[str, Any]) -> torch.Tensor:
    """The value to back-propagate for one microbatch of an optimizer step.

    ``loss_sum * world_size * accumulate_grad_batches / step_units``: Lightning divides the returned loss by
    ``accumulate_grad_batches`` and DDP averages the gradients over ``world_size`` ranks, so the update is the
    gradient of ``sum(all loss_sums of the step) / step_units`` with no collective. Without ``step_units`` the
    local mean ``loss_sum / num_units`` is returned (Lightning's usual semantics).

    Context parallelism (a batch with ``context_parallel_size = cp``): each of the ``cp`` ranks sharing a
    microbatch holds the loss of its own tokens only, so the microbatch's gradient is the *sum* of theirs, while
    DDP averages over all ``world_size x cp`` ranks; the scale is therefore ``world_size x cp x
    accumulate_grad_batches`` (``world_size`` counts data-parallel ranks, as planned).

    Args:
        output: the microbatch's loss.
        batch: the batch (its ``world_size`` and ``accumulate_grad_batches`` scalars, 1 when absent).
    """
    if output.step_units is None:
        return output.loss_sum / (output.num_units or 1)  # a weight sum may be below 1
    if output.step_units == 0:  # no target in the whole step: a zero that still reaches every parameter
        return output.loss_sum * 0.0
    scale = int(batch.get("world_size", 1)) * int(batch.get("accumulate_grad_batches", 1))
    scale *= int(batch.get("context_parallel_size", 1))
    return output.loss_sum * (scale / output.step_units)
