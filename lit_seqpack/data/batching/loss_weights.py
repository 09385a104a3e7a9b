"""Weighted token losses: per-token weights that scale the loss, with the exact step normalisation kept.

The weights come from one place, ``loss_weight_field``: either ``"loss_mask"`` (a sample's ``loss_mask`` may then
hold weights in ``[0, 1]`` instead of only 0 and 1) or the name of a declared token field (any finite weight
``>= 0``). A weight belongs to its token like a label does (unshifted): the weight at position ``t`` scales the
loss of predicting token ``t``. The collator puts them in the batch as ``loss_weights`` (float32, aligned with
``labels``, 0 wherever ``labels`` is ``-100``: padding, each document's first token, masked prompts), with::

    num_loss_weight    sum of this microbatch's loss_weights (a Python float)
    step_loss_weight   sum of the loss weights of the whole optimizer step over all ranks

so the token loss ``sum(w * ce) / step_loss_weight`` is exact over accumulation and ranks, as
``step_loss_tokens`` is for the unweighted loss. ``step_loss_weight`` comes from the plan
(:class:`StepWeightedBatchSampler` sums the samples' weight sums, known up front, over the step's microbatches of
every rank); when a batch has no planned weight sum it is the microbatch's own sum without plan metadata (a plain
DataLoader), or ``step_loss_tokens`` when every target weighs exactly 1 (then the two are the same number), and an
error otherwise (a local sum would give a different gradient than the unpacked run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import IGNORE_INDEX, Microbatch

__all__ = [
    "StepWeightedBatchSampler",
    "check_loss_weight_field",
    "dataset_loss_weights",
    "loss_weight_scalars",
    "read_loss_weights",
    "sample_loss_weight",
    "with_step_loss_weights",
]


def check_loss_weight_field(field: str | None, token_fields: Mapping[str, float | int]) -> None:
    """Fail unless ``field`` is ``None``, ``"loss_mask"`` or a declared token field.

    Raises:
        ValueError: naming ``loss_weight_field`` and the bad value.
    """
    if field is None or field == "loss_mask":
        return
    if not isinstance(field, str) or field not in token_fields:
        raise ValueError(
            f"loss_weight_field={field!r} must be 'loss_mask' or one of the declared token_fields "
            f"{sorted(token_fields)}: declare the weights with token_fields={{{field!r}: 0.0}}"
        )


def dataset_loss_weights(dataset: Sequence[Mapping[str, Any]], field: str) -> np.ndarray:
    """Every sample's loss-weight sum (:func:`sample_loss_weight`), read once (float64)."""
    return np.fromiter((sample_loss_weight(dataset[i], field) for i in range(len(dataset))), np.float64, len(dataset))


def with_step_loss_weights(sampler: Any, dataset: Sequence[Mapping[str, Any]], field: str | None) -> Any:
    """``sampler`` itself without a ``field``, else wrapped in :class:`StepWeightedBatchSampler` for ``dataset``."""
    return sampler if field is None else StepWeightedBatchSampler(sampler, dataset_loss_weights(dataset, field))


def _weights_of(sample: Mapping[str, Any], field: str, length: int, name: str) -> np.ndarray:
    """The raw float64 weights of one sample (1 everywhere for a sample without ``loss_mask`` under ``loss_mask``)."""
    value = sample.get(field)
    if value is None:
        if field == "loss_mask":
            return np.ones(length)
        raise ValueError(f"{name}: the loss weight field {field!r} is missing")
    weights = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value, dtype=np.float64)
    if weights.shape != (length,):
        raise ValueError(f"{name}: {field} has shape {weights.shape} but input_ids has {length} tokens")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"{name}: loss weights ({field}) must be finite and >= 0, got {weights.tolist()!r:.80}")
    if field == "loss_mask" and (weights > 1).any():
        raise ValueError(f"{name}: loss_mask weights must be in [0, 1], got {weights.tolist()!r:.80}")
    return weights


def read_loss_weights(
    samples: Sequence[Mapping[str, Any]], labels: Sequence[torch.Tensor], field: str, names: Sequence[str]
) -> list[torch.Tensor]:
    """Each document's float32 loss weights, 0 where its label is ``-100`` and on its first token.

    Args:
        samples: the microbatch's samples.
        labels: each document's labels as the collator read them (``-100`` where nothing is trained).
        field: ``"loss_mask"`` or the declared token field holding the weights.
        names: each sample's name for error messages.
    """
    out = []
    for sample, target, name in zip(samples, labels, names, strict=True):
        weights = _weights_of(sample, field, len(target), name)
        weights[target.numpy() == IGNORE_INDEX] = 0.0
        weights[:1] = 0.0  # the first token of a document has no previous token to be predicted from
        out.append(torch.from_numpy(weights.astype(np.float32)))
    return out


def sample_loss_weight(sample: Mapping[str, Any], field: str) -> float:
    """The weight sum of one sample's targets, as the collator computes it (for planning the step's sum).

    Example:
        >>> sample_loss_weight({"input_ids": [5, 6, 7], "loss_mask": [1.0, 0.5, 0.25]}, "loss_mask")
        0.75
    """
    ids = sample["input_ids"]
    weights = _weights_of(sample, field, len(ids), "sample")
    labels = sample.get("labels")
    if labels is not None:
        weights = np.where(np.asarray(labels) == IGNORE_INDEX, 0.0, weights)
    return math.fsum(weights[1:].astype(np.float32).astype(np.float64))


def loss_weight_scalars(weights: torch.Tensor, meta: Any, step_loss_tokens: int, is_empty: bool) -> dict[str, Any]:
    """``num_loss_weight`` and ``step_loss_weight`` of a microbatch whose placed ``loss_weights`` are ``weights``.

    Raises:
        ValueError: the plan has no weight sum for the step and the weights are not all 1 on the targets, or
            the planned step sum is below this microbatch's own sum.
    """
    local = math.fsum(weights[weights != 0].double().tolist())
    planned = None if meta is None else getattr(meta, "step_loss_weight", None)
    if planned is None and meta is not None and not is_empty:
        if not bool((weights[weights != 0] == 1).all()):
            raise ValueError(
                "the microbatch has loss weights other than 0 and 1 but its plan carries no step_loss_weight: the "
                "exact loss needs the weight sum of the whole optimizer step. Use "
                "SeqPackDataModule(loss_weight_field=...) or wrap the batch sampler in StepWeightedBatchSampler"
            )
        planned = float(step_loss_tokens)  # every target weighs 1: the weight sum is the loss-token count
    if planned is None:
        planned = local if meta is None else float(step_loss_tokens)
    if planned < local * (1 - 1e-6):
        raise ValueError(
            f"the plan says step_loss_weight={planned} for this optimizer step, but this microbatch alone weighs "
            f"{local}: the weight sums given to the planner do not match the samples"
        )
    return {"num_loss_weight": local, "step_loss_weight": planned}


class StepWeightedBatchSampler:
    """A planned batch sampler whose microbatches also carry the step's loss-weight sum over all ranks.

    Every rank computes the same sum (a ``math.fsum`` of the samples' weight sums over the step's microbatches of
    every rank, read from the same plan), so no collective is needed. Everything but iteration is the wrapped
    sampler's (its length, epoch, state and ``sampler`` for Lightning's ``set_epoch``).

    Args:
        sampler: a lit_seqpack planned batch sampler (its ``lazy_plan`` gives every rank's microbatches).
        weight_sums: each sample's loss-weight sum (:func:`sample_loss_weight`), indexed like the sampler's data.
    """

    def __init__(self, sampler: Any, weight_sums: np.ndarray) -> None:
        self.batch_sampler = sampler
        self.weight_sums = np.asarray(weight_sums, dtype=np.float64)

    def __getattr__(self, name: str) -> Any:
        if name == "batch_sampler":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Microbatch]:
        cache: tuple[int, int, float] | None = None
        for microbatch in self.batch_sampler:
            meta = microbatch.meta
            plan = self.batch_sampler.lazy_plan
            if cache is None or cache[:2] != (plan.epoch, meta.step):
                cache = (plan.epoch, meta.step, self._step_weight(plan, meta.step))
            meta = dataclasses.replace(meta, step_loss_weight=cache[2])
            yield Microbatch(microbatch, meta=meta)

    def _step_weight(self, plan: Any, step: int) -> float:
        config = plan.config
        accumulate = config.accumulate_grad_batches
        parts = [
            self.weight_sums[plan.microbatch(rank, step * accumulate + slot).indices]
            for rank in range(config.world_size)
            for slot in range(accumulate)
        ]
        return math.fsum(np.concatenate(parts).tolist()) if parts else 0.0
