"""``RolloutPlanner``: a rollout's log-prob pass and training microbatches on this rank, in lock step, exact.

Every rank builds the same torch-free :class:`~lit_seqpack.planning.rollout.RolloutPlan` from the same rollout and
runs its own share; no collective is needed to agree on microbatch counts (``compute_per_token(gather=True)``
gathers the results, the only communication). Batches are built by the library's collators
(:class:`~lit_seqpack.data.collate.PackedCollator` in ``packing`` mode,
:class:`~lit_seqpack.data.collate.PaddedCollator` in ``dynamic`` mode) with the rollout's declared fields, plus the
plan's facts:

=========================  =======================================================================================
``sample_indices``         the rollout indices of the batch's documents (Python ints, in document order)
``group_ids``              ``[num_documents]`` int64 dense group labels (every sample its own group without groups)
``document_loss_tokens``   ``[num_documents]`` int64 loss tokens of each document
``group_loss_tokens``      ``[num_documents]`` int64 loss tokens of each document's group over the whole step
``num_groups``             distinct groups in the batch
``step``                   the optimizer step (0-based) within the rollout
``step_loss_tokens``       loss tokens of the step over all ranks (also ``step_documents``, ``step_groups``)
``is_last_in_step``        the last microbatch of this rank in the step: call ``optimizer.step()`` after it
=========================  =======================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import torch

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.collate import PackedCollator, PaddedCollator
from lit_seqpack.planning.rollout import RolloutPlan, RolloutPlanConfig, dense_group_labels, plan_rollout
from lit_seqpack.rl._world import resolve_world
from lit_seqpack.rl.rollout import Rollout
from lit_seqpack.rl.unpack import unpack

__all__ = ["RolloutPlanner"]


class RolloutPlanner:
    """Plans a rollout over data-parallel ranks: a log-prob pass and the training microbatches of each step.

    Args:
        train_max_tokens: token budget of a training microbatch.
        logprob_max_tokens: token budget of a log-prob (no grad) microbatch; default ``train_max_tokens``.
        mode: ``"packing"`` (one packed row per microbatch, needs a varlen-attention model) or ``"dynamic"``
            (padded ``[B, L]`` blocks, any model).
        algorithm: the packer (packing mode).
        samples_per_step: samples of one optimizer step over all ranks.
        steps_per_rollout: instead, the exact number of optimizer steps per rollout.
        accumulate_grad_batches: fixed microbatches per rank per step (automatic optimization needs the
            Trainer's); ``None``: as many as the fullest rank needs (manual optimization).
        keep_together: ``None``, ``"microbatch"`` or ``"rank"``: a group (``Rollout.group_ids``) is never split
            across microbatches, or across ranks.
        world_size: data-parallel ranks; with ``rank``, overrides ``trainer`` and ``torch.distributed``.
        rank: this process's data-parallel rank.
        trainer: read the world size and rank from it (its device mesh's data-parallel layout if it has one).
        pad_token_id: the id written on padding.
        pad_to_multiple_of: pad every row to a multiple of this (packing: the row; dynamic: the block length).
        cost_linear: ``a`` of the balance cost ``a*L + b*L^2``.
        cost_quadratic: ``b`` (``"auto"``: ``cost_linear / budget``).
        shuffle: shuffle samples (groups) before cutting steps.
        seed: the shuffle's seed.

    Example:
        >>> rollout = Rollout(input_ids=[[5, 6, 7], [8, 9], [1, 2, 3, 4]])
        >>> planner = RolloutPlanner(train_max_tokens=8, world_size=1, rank=0)
        >>> [(b["sample_indices"], b["is_last_in_step"]) for b in planner.train_microbatches(rollout)]
        [([2, 0], False), ([1], True)]
    """

    def __init__(
        self,
        *,
        train_max_tokens: int,
        logprob_max_tokens: int | None = None,
        mode: Literal["packing", "dynamic"] = "packing",
        algorithm: str | None = None,
        samples_per_step: int | None = None,
        steps_per_rollout: int | None = None,
        accumulate_grad_batches: int | None = None,
        keep_together: Literal["microbatch", "rank"] | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        trainer: Any = None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        cost_linear: float = 1.0,
        cost_quadratic: float | Literal["auto"] = "auto",
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if (world_size is None) != (rank is None):
            raise ValueError(f"give both world_size and rank, or neither (got {world_size=}, {rank=})")
        if world_size is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        self._world, self._trainer = (world_size, rank) if world_size is not None else None, trainer
        common = {
            "mode": mode,
            "algorithm": algorithm,
            "cost_linear": cost_linear,
            "cost_quadratic": cost_quadratic,
            "sequence_length_round": 1 if mode == "packing" else pad_to_multiple_of or 1,
            "seed": seed,
        }
        self._train = RolloutPlanConfig(
            max_tokens=train_max_tokens,
            samples_per_step=samples_per_step,
            steps_per_rollout=steps_per_rollout,
            accumulate_grad_batches=accumulate_grad_batches,
            keep_together=keep_together,
            shuffle=shuffle,
            **common,
        )
        logprob_budget = train_max_tokens if logprob_max_tokens is None else logprob_max_tokens
        self._logprob = RolloutPlanConfig(max_tokens=logprob_budget, **common)
        self.budgets = {"train_max_tokens": train_max_tokens, "logprob_max_tokens": logprob_budget}
        collator = PackedCollator if mode == "packing" else PaddedCollator
        self._collator_type, self._collator_args = (
            collator,
            {"pad_token_id": pad_token_id, "pad_to_multiple_of": pad_to_multiple_of},
        )
        self._collator_type(**self._collator_args)  # validates the padding knobs now

    # --------------------------------------------------------------------------------------------- plans
    @property
    def world(self) -> tuple[int, int]:
        """``(world_size, rank)`` of data parallelism, resolved now (explicit, trainer, torch.distributed, or 1)."""
        return self._world if self._world is not None else resolve_world(self._trainer)

    def plan(self, rollout: Rollout) -> RolloutPlan:
        """The training plan of ``rollout`` (the same on every rank)."""
        return self._plan(rollout, self._train, "train_max_tokens")

    def logprob_plan(self, rollout: Rollout) -> RolloutPlan:
        """The log-prob pass's plan of ``rollout``: one step, balanced over ranks."""
        return self._plan(rollout, self._logprob, "logprob_max_tokens")

    def _plan(self, rollout: Rollout, config: RolloutPlanConfig, budget: str) -> RolloutPlan:
        if not isinstance(rollout, Rollout):
            raise TypeError(f"expected a lit_seqpack.rl.Rollout, got {type(rollout).__name__}")
        world_size, _ = self.world
        config = RolloutPlanConfig(**{**_fields(config), "world_size": world_size})
        lengths = rollout.lengths
        over = np.flatnonzero(lengths > config.max_tokens)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"sample {i} of the rollout has {int(lengths[i])} tokens > {budget}={config.max_tokens} "
                f"({over.size} such samples): raise {budget} or cap the generation length"
            )
        groups = None if rollout.group_ids is None else rollout.group_ids.numpy()
        return plan_rollout(lengths, config, loss_tokens=rollout.loss_tokens, group_ids=groups)

    # --------------------------------------------------------------------------------------------- batches
    def logprob_microbatches(self, rollout: Rollout, *, device: Any = None) -> Iterator[dict[str, Any]]:
        """This rank's log-prob batches (every rank yields as many; fillers have ``is_empty``)."""
        plan = self.logprob_plan(rollout)
        yield from self._batches(rollout, plan, device)

    def train_microbatches(self, rollout: Rollout, *, device: Any = None) -> Iterator[dict[str, Any]]:
        """This rank's training batches, ``accumulate_grad_batches`` per step, with the step totals."""
        plan = self.plan(rollout)
        yield from self._batches(rollout, plan, device)

    @torch.no_grad()
    def compute_per_token(
        self,
        fn: Callable[[dict[str, Any]], torch.Tensor],
        rollout: Rollout,
        *,
        gather: bool = False,
        device: Any = None,
    ) -> list[torch.Tensor | None]:
        """Run ``fn`` (a batch to a per-token ``[B, T]`` tensor, e.g. :func:`~lit_seqpack.rl.token_logprobs`) over
        this rank's log-prob batches without grad; one tensor per sample, in the rollout's order.

        Args:
            fn: called on each non-empty batch; returns values shaped like its ``input_ids``.
            rollout: the rollout.
            gather: all-gather every rank's values (``torch.distributed``), so every entry is filled on every rank;
                raises ``RuntimeError`` when the ranks hold different rollouts.
            device: move the batches there first.

        Returns:
            ``N`` tensors (on the device ``fn`` returned); without ``gather``, entries of other ranks are ``None``.
        """
        out: list[torch.Tensor | None] = [None] * len(rollout)
        for batch in self.logprob_microbatches(rollout, device=device):
            if batch["is_empty"]:
                continue
            values = fn(batch)
            for index, value in zip(batch["sample_indices"], unpack(values, batch), strict=True):
                out[index] = value.detach().clone()
        if gather and self.world[0] > 1:
            from lit_seqpack.rl._world import gather_per_sample

            return gather_per_sample(
                out, self.logprob_plan(rollout), rollout.lengths, self.world[1], rollout.fingerprint()
            )
        return out

    def _batches(self, rollout: Rollout, plan: RolloutPlan, device: Any) -> Iterator[dict[str, Any]]:
        world_size, rank = self.world
        groups = dense_group_labels(None if rollout.group_ids is None else rollout.group_ids.numpy(), len(rollout))
        loss_tokens, accumulate = rollout.loss_tokens, plan.accumulate_grad_batches
        collate = self._collator(rollout)
        for step, slot, indices in plan.rank_microbatches(rank):
            meta = MicrobatchMeta(
                step=step,
                step_loss_tokens=int(plan.step_loss_tokens[step]),
                world_size=world_size,
                accumulate_grad_batches=accumulate,
                max_tokens=plan.config.max_tokens,
                is_empty=not indices,
                loss_tokens=int(loss_tokens[indices].sum()) if indices else None,
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
            yield batch if device is None else _to_device(batch, device)

    def _collator(self, rollout: Rollout) -> Callable[[Any], dict[str, Any]]:
        fields: dict[str, Any] = {}
        if rollout.token_fields:
            fields["token_fields"] = {name: 0.0 for name in rollout.token_fields}
        if rollout.sample_fields:
            fields["sample_fields"] = list(rollout.sample_fields)
        return self._collator_type(**self._collator_args, **fields)


def _fields(config: RolloutPlanConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in RolloutPlanConfig.__dataclass_fields__}


def _to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
