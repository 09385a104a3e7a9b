"""Rank-aware, resumable batch samplers: one rank's view of the global :class:`~lit_seqpack.planning.Plan`.

Every rank builds the same plan (a pure function of the lengths, the config, the seed and the epoch)
and yields its own column of it, as :class:`~lit_seqpack.batch.Microbatch` lists of dataset
indices carrying a :class:`~lit_seqpack.batch.MicrobatchMeta` (step, loss tokens of the whole
step over all ranks, world size, accumulation, budget, empty filler or not)::

    plan, epoch e        step 0        step 1       ...
      rank 0           [mb0, mb1]    [mb4, mb5]           <- PackedBatchSampler(..., rank=0)
      rank 1           [mb2, mb3]    [mb6, mb7]           <- PackedBatchSampler(..., rank=1)

Use them as ``DataLoader(PlannedDataset(ds), batch_sampler=sampler, collate_fn=collator)`` (torchdata's
``StatefulDataLoader`` for exact mid-epoch resume with workers) under ``Trainer(use_distributed_sampler=False)``.

- ``len(sampler)`` is the exact number of microbatches of the current epoch, equal on every rank.
- ``__iter__`` is lazy: the epoch is read at the first ``next()``, so ``set_epoch`` may come after
  ``iter()``. Lightning calls ``set_epoch`` only on ``loader.sampler`` and ``loader.batch_sampler.sampler``,
  so every batch sampler exposes ``.sampler`` (this rank's sample indices) whose ``set_epoch`` forwards.
- ``state_dict`` holds the epoch and the microbatches consumed, never the rank: rank 0's checkpoint
  resumes every rank. StatefulDataLoader snapshots it when each batch is requested, so prefetching by
  workers does not move the resume point.
- With ``torch.distributed`` initialised, the first iteration of each epoch compares a digest of the
  plan's inputs (config, lengths, loss tokens, epoch; and the data's ``content_digest`` when given) across
  ranks (one ``all_gather_object``) and fails loudly, on every rank, on a mismatch.
- Lightning reads ``len(dataloader)`` once. The count is constant across epochs with ``window=None`` and
  a sort-based packer (or dynamic or padded batching); otherwise reload the dataloaders every epoch
  (a warning says so when the count changes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler, distributed, resolve_replicas
from lit_seqpack.planning.algorithms import DEFAULT_ALGORITHM
from lit_seqpack.planning.config import PlanConfig

__all__ = ["DynamicBatchSampler", "PackedBatchSampler", "PaddedBatchSampler", "PlannedBatchSampler"]


class PackedBatchSampler(PlannedBatchSampler):
    """Packs samples into rows of at most ``max_tokens`` tokens; each microbatch is one row's indices.

    Args:
        lengths: token count of every sample of the dataset.
        max_tokens: the packed row length (a multiple of ``sequence_length_round``).
        num_replicas: number of data-parallel ranks (default: ``torch.distributed`` world size, or 1).
        rank: this process's rank (default: ``torch.distributed`` rank, or 0).
        seed: seed of the shuffles; the same on every rank.
        accumulate_grad_batches: microbatches per rank per optimizer step (the Trainer's value).
        shuffle: reshuffle every epoch (through ``set_epoch``, which Lightning calls).
        algorithm: packing algorithm (a name in :data:`~lit_seqpack.planning.algorithms.ALGORITHMS`).
        window: consecutive shuffled samples planned together (``None``: the whole epoch).
        sequence_length_round: the collator pads the row to a multiple of this.
        microbatch_order: ``"largest_first"`` or ``"packer"`` (see :class:`~lit_seqpack.planning.PlanConfig`).
        cost_linear: ``a`` of the per-document cost ``a*L + b*L^2`` that ranks are balanced on.
        cost_quadratic: ``b`` of that cost (attention-heavy long contexts); ``"auto"``: ``cost_linear / max_tokens``.
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``), for ``step_loss_tokens``.
        verify_plan: compare the plan across ranks once per epoch when ``torch.distributed`` is initialised.
        content_digest: a digest of the data's content (or a function computing it) compared with the plan, so
            ranks reading different tokens with the same lengths fail loudly (``None``: lengths only).

    Example:
        >>> sampler = PackedBatchSampler([5, 3, 4, 4], max_tokens=8, num_replicas=2, rank=1, shuffle=False)
        >>> [(list(mb), mb.meta.step_loss_tokens) for mb in sampler]
        [([2, 3], 12)]
    """

    _mode = "packing"

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        max_tokens: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        accumulate_grad_batches: int = 1,
        shuffle: bool = True,
        algorithm: str = DEFAULT_ALGORITHM,
        window: int | None = None,
        sequence_length_round: int = 1,
        microbatch_order: str = "largest_first",
        cost_linear: float = 1.0,
        cost_quadratic: float | Literal["auto"] = "auto",
        loss_tokens: Sequence[int] | np.ndarray | None = None,
        verify_plan: bool = True,
        content_digest: str | Callable[[], str] | None = None,
    ) -> None:
        world, rank = resolve_replicas(num_replicas, rank)
        config = PlanConfig(
            mode=self._mode,
            world_size=world,
            max_tokens=max_tokens,
            algorithm=algorithm,
            seed=seed,
            accumulate_grad_batches=accumulate_grad_batches,
            shuffle=shuffle,
            window=window,
            sequence_length_round=sequence_length_round,
            microbatch_order=microbatch_order,
            cost_linear=cost_linear,
            cost_quadratic=cost_quadratic,
        )
        super().__init__(
            lengths, config, rank=rank, loss_tokens=loss_tokens, verify_plan=verify_plan, content_digest=content_digest
        )
        self._world_defaulted = num_replicas is None and not distributed()  # checked against the process group


class DynamicBatchSampler(PlannedBatchSampler):
    """Groups length-sorted samples so that ``rows x round_up(longest, sequence_length_round) <= max_tokens``.

    Args:
        lengths: token count of every sample of the dataset.
        max_tokens: the token budget of a padded ``[rows, L]`` microbatch.
        num_replicas: number of data-parallel ranks (default: ``torch.distributed`` world size, or 1).
        rank: this process's rank (default: ``torch.distributed`` rank, or 0).
        seed: seed of the shuffles; the same on every rank.
        accumulate_grad_batches: microbatches per rank per optimizer step (the Trainer's value).
        shuffle: reshuffle every epoch (through ``set_epoch``, which Lightning calls).
        window: consecutive shuffled samples sorted and grouped together (``None``: the whole epoch).
        sequence_length_round: ``L`` is the longest row rounded up to a multiple of this.
        microbatch_order: ``"largest_first"`` or ``"packer"`` (see :class:`~lit_seqpack.planning.PlanConfig`).
        cost_linear: ``a`` of the cost ``rows x (a*L + b*L^2)`` that ranks are balanced on.
        cost_quadratic: ``b`` of that cost (``"auto"``: ``cost_linear / max_tokens``; 0 in padded mode).
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``), for ``step_loss_tokens``.
        verify_plan: compare the plan across ranks once per epoch when ``torch.distributed`` is initialised.
        content_digest: a digest of the data's content (or a function computing it) compared with the plan, so
            ranks reading different tokens with the same lengths fail loudly (``None``: lengths only).
    """

    _mode = "dynamic"

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        max_tokens: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        accumulate_grad_batches: int = 1,
        shuffle: bool = True,
        window: int | None = None,
        sequence_length_round: int = 1,
        microbatch_order: str = "largest_first",
        cost_linear: float = 1.0,
        cost_quadratic: float | Literal["auto"] = "auto",
        loss_tokens: Sequence[int] | np.ndarray | None = None,
        verify_plan: bool = True,
        content_digest: str | Callable[[], str] | None = None,
    ) -> None:
        world, rank = resolve_replicas(num_replicas, rank)
        config = PlanConfig(
            mode=self._mode,
            world_size=world,
            max_tokens=max_tokens,
            seed=seed,
            accumulate_grad_batches=accumulate_grad_batches,
            shuffle=shuffle,
            window=window,
            sequence_length_round=sequence_length_round,
            microbatch_order=microbatch_order,
            cost_linear=cost_linear,
            cost_quadratic=cost_quadratic,
        )
        super().__init__(
            lengths, config, rank=rank, loss_tokens=loss_tokens, verify_plan=verify_plan, content_digest=content_digest
        )
        self._world_defaulted = num_replicas is None and not distributed()  # checked against the process group


class PaddedBatchSampler(PlannedBatchSampler):
    """The baseline: shuffled batches of ``batch_size`` samples, each padded to its longest sample.

    The batches of a window are completed to a multiple of ``num_replicas x accumulate_grad_batches``
    with empty microbatches (zero-weight dummies), never by dropping samples.

    Args:
        lengths: token count of every sample of the dataset.
        batch_size: samples per microbatch.
        num_replicas: number of data-parallel ranks (default: ``torch.distributed`` world size, or 1).
        rank: this process's rank (default: ``torch.distributed`` rank, or 0).
        seed: seed of the shuffles; the same on every rank.
        accumulate_grad_batches: microbatches per rank per optimizer step (the Trainer's value).
        shuffle: reshuffle every epoch (through ``set_epoch``, which Lightning calls).
        window: consecutive shuffled samples planned together (``None``: the whole epoch).
        sequence_length_round: the padded length is a multiple of this.
        microbatch_order: ``"largest_first"`` or ``"packer"`` (see :class:`~lit_seqpack.planning.PlanConfig`).
        cost_linear: ``a`` of the cost ``rows x (a*L + b*L^2)`` that ranks are balanced on.
        cost_quadratic: ``b`` of that cost (``"auto"``: ``cost_linear / max_tokens``; 0 in padded mode).
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``), for ``step_loss_tokens``.
        verify_plan: compare the plan across ranks once per epoch when ``torch.distributed`` is initialised.
        content_digest: a digest of the data's content (or a function computing it) compared with the plan, so
            ranks reading different tokens with the same lengths fail loudly (``None``: lengths only).
    """

    _mode = "padded"

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        accumulate_grad_batches: int = 1,
        shuffle: bool = True,
        window: int | None = None,
        sequence_length_round: int = 1,
        microbatch_order: str = "largest_first",
        cost_linear: float = 1.0,
        cost_quadratic: float | Literal["auto"] = "auto",
        loss_tokens: Sequence[int] | np.ndarray | None = None,
        verify_plan: bool = True,
        content_digest: str | Callable[[], str] | None = None,
    ) -> None:
        world, rank = resolve_replicas(num_replicas, rank)
        config = PlanConfig(
            mode=self._mode,
            world_size=world,
            batch_size=batch_size,
            seed=seed,
            accumulate_grad_batches=accumulate_grad_batches,
            shuffle=shuffle,
            window=window,
            sequence_length_round=sequence_length_round,
            microbatch_order=microbatch_order,
            cost_linear=cost_linear,
            cost_quadratic=cost_quadratic,
        )
        super().__init__(
            lengths, config, rank=rank, loss_tokens=loss_tokens, verify_plan=verify_plan, content_digest=content_digest
        )
        self._world_defaulted = num_replicas is None and not distributed()  # checked against the process group
