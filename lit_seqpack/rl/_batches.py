"""A rank's microbatches of a :class:`~lit_seqpack.planning.rollout.RolloutPlan` as collated batches that carry
the plan's facts (sample indices, groups, loss-token totals of documents, groups and the step)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.planning.rollout import RolloutPlan, dense_group_labels
from lit_seqpack.rl.rollout import Rollout

__all__ = ["collator_fields", "plan_batches"]


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
    *,
    step_weights: np.ndarray | None = None,
) -> Iterator[dict[str, Any]]:
    """Every microbatch of ``rank`` in training order, collated, with the plan's facts added.

    Args:
        rollout: the planned rollout.
        plan: its plan (the same on every rank).
        rank: this process's data-parallel rank.
        world_size: data-parallel ranks (written in the batch for the exact loss scale).
        collate: a collator declared with the rollout's fields (:func:`collator_fields`).
        step_weights: each step's loss-weight sum over all ranks, with a weighted collator; ``None`` without.
    """
    groups = dense_group_labels(None if rollout.group_ids is None else rollout.group_ids.numpy(), len(rollout))
    loss_tokens, accumulate = rollout.loss_tokens, plan.accumulate_grad_batches
    for step, slot, indices in plan.rank_microbatches(rank):
        meta = MicrobatchMeta(
            step=step,
            step_loss_tokens=int(plan.step_loss_tokens[step]),
            world_size=world_size,
            accumulate_grad_batches=accumulate,
            max_tokens=plan.config.max_tokens,
            is_empty=not indices,
            loss_tokens=int(loss_tokens[indices].sum()) if indices else None,
            step_loss_weight=None if step_weights is None else float(step_weights[step]),
        )
        batch = collate(Microbatch([rollout.sample(i) for i in indices], meta=meta, indices=indices))
        batch.update(
            sample_indices=list(indices),
            group_ids=torch.as_tensor(groups[indices], dtype=torch.int64),
            document_loss_tokens=torch.as_tensor(loss_tokens[indices], dtype=torch.int64),
            group_loss_tokens=torch.as_tensor(plan.group_loss_tokens[indices], dtype=torch.int64),
            num_groups=int(np.unique(groups[indices]).size),
            step=step,
            step_documents=int(plan.step_documents[step]),
            step_groups=int(plan.step_groups[step]),
            is_last_in_step=slot == accumulate - 1,
        )
        yield batch
