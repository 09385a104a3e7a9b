"""A rank's microbatches of a :class:`~lit_seqpack.planning.rollout.RolloutPlan` as collated batches that carry
the plan's facts (sample indices, groups, the loss units of documents, groups and the step).

A sample's *loss mass* is its loss-token count, or with a ``loss_weight_field`` its loss-weight sum. A sample (a
group) whose mass is 0 (a truncated, filtered or over-long completion with an all-zero mask or weights) is planned and
run like any other but has no loss: the token, sequence and group means of :mod:`lit_seqpack.rl.loss` leave it out of
their numerator and denominator (``step_loss_documents``, ``step_loss_groups`` count only samples and groups with a
loss), and a step where nothing has a loss is a zero-gradient step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.planning.rollout import RolloutPlan, dense_group_labels
from lit_seqpack.rl.rollout import Rollout

__all__ = ["LossMass", "collator_fields", "loss_mass", "plan_batches"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossMass:
    """The loss units of a planned rollout, the same on every rank (no collective).

    Args:
        groups: dense group label of every sample.
        document: per sample, its loss tokens (or loss-weight sum with ``weighted``).
        group: per sample, its group's total of ``document``.
        step_documents: per step, the samples whose ``document`` is above 0.
        step_groups: per step, the groups whose total is above 0.
        step_weight: per step, the weight sum over all ranks (``weighted`` only).
        weighted: the masses are loss-weight sums.
    """

    groups: np.ndarray
    document: np.ndarray
    group: np.ndarray
    step_documents: np.ndarray
    step_groups: np.ndarray
    step_weight: np.ndarray | None
    weighted: bool


def loss_mass(plan: RolloutPlan, rollout: Rollout, weight_field: str | None = None) -> LossMass:
    """The :class:`LossMass` of ``rollout`` under ``plan`` (loss-weight sums of ``weight_field`` when given)."""
    groups = dense_group_labels(None if rollout.group_ids is None else rollout.group_ids.numpy(), len(rollout))
    weighted = weight_field is not None
    document = rollout.loss_weight_sums(weight_field) if weighted else rollout.loss_tokens.astype(np.float64)
    totals = np.zeros(int(groups.max()) + 1)
    np.add.at(totals, groups, document)
    members = ([i for share in ranks for mb in share for i in mb] for ranks in plan.microbatches)
    steps = [np.array(step, dtype=np.int64) for step in members]
    return LossMass(
        groups=groups,
        document=document,
        group=totals[groups],
        step_documents=np.array([int((document[s] > 0).sum()) for s in steps], dtype=np.int64),
        step_groups=np.array([np.unique(groups[s][totals[groups[s]] > 0]).size for s in steps], dtype=np.int64),
        step_weight=np.array([math.fsum(document[s].tolist()) for s in steps]) if weighted else None,
        weighted=weighted,
    )


def collator_fields(rollout: Rollout) -> dict[str, Any]:
    """The collator arguments that declare the rollout's token fields (pad value 0) and sample fields."""
    fields: dict[str, Any] = {}
    if rollout.token_fields:
        fields["token_fields"] = {name: 0.0 for name in rollout.token_fields}
    if rollout.sample_fields:
        fields["sample_fields"] = list(rollout.sample_fields)
    return fields


def plan_batches(
    rollout: Rollout,
    plan: RolloutPlan,
    rank: int,
    world_size: int,
    collate: Callable[[Microbatch], dict[str, Any]],
    mass: LossMass,
) -> Iterator[dict[str, Any]]:
    """Every microbatch of ``rank`` in training order, collated, with the plan's facts added.

    Args:
        rollout: the planned rollout.
        plan: its plan (the same on every rank).
        rank: this process's data-parallel rank.
        world_size: data-parallel ranks (written in the batch for the exact loss scale).
        collate: a collator declared with the rollout's fields (:func:`collator_fields`).
        mass: the rollout's loss units (:func:`loss_mass`); with ``mass.weighted`` the collator must place the
            weights (``loss_weight_field``).
    """
    groups, loss_tokens, accumulate = mass.groups, rollout.loss_tokens, plan.accumulate_grad_batches
    for step, slot, indices in plan.rank_microbatches(rank):
        meta = MicrobatchMeta(
            step=step,
            step_loss_tokens=int(plan.step_loss_tokens[step]),
            world_size=world_size,
            accumulate_grad_batches=accumulate,
            max_tokens=plan.config.max_tokens,
            is_empty=not indices,
            loss_tokens=int(loss_tokens[indices].sum()) if indices else None,
            step_loss_weight=None if mass.step_weight is None else float(mass.step_weight[step]),
        )
        batch = collate(Microbatch([rollout.sample(i) for i in indices], meta=meta, indices=indices))
        with_loss = mass.group[indices] > 0
        batch.update(
            sample_indices=list(indices),
            group_ids=torch.as_tensor(groups[indices], dtype=torch.int64),
            document_loss_tokens=torch.as_tensor(loss_tokens[indices], dtype=torch.int64),
            group_loss_tokens=torch.as_tensor(plan.group_loss_tokens[indices], dtype=torch.int64),
            num_groups=int(np.unique(groups[indices]).size),
            num_loss_documents=int((mass.document[indices] > 0).sum()),
            num_loss_groups=int(np.unique(groups[indices][with_loss]).size),
            step=step,
            step_documents=int(plan.step_documents[step]),
            step_groups=int(plan.step_groups[step]),
            step_loss_documents=int(mass.step_documents[step]),
            step_loss_groups=int(mass.step_groups[step]),
            is_last_in_step=slot == accumulate - 1,
        )
        if mass.weighted:
            batch.update(
                document_loss_weight=torch.as_tensor(mass.document[indices], dtype=torch.float64),
                group_loss_weight=torch.as_tensor(mass.group[indices], dtype=torch.float64),
            )
        yield batch
