"""Rank-aware, resumable batch sampling: one rank's view of the global :class:`~lit_seqpack.planning.Plan`.

Every rank builds the same plan (a pure function of the lengths, the config, the seed and the epoch) and yields its
own column of it, as :class:`~lit_seqpack.batch.Microbatch` lists of dataset indices carrying a
:class:`~lit_seqpack.batch.MicrobatchMeta` (step, loss tokens of the whole step over all ranks, world size,
accumulation, budget, empty filler or not)::

    plan, epoch e        step 0        step 1       ...
      rank 0           [mb0, mb1]    [mb4, mb5]           <- PlannedBatchSampler(lengths, config, rank=0)
      rank 1           [mb2, mb3]    [mb6, mb7]           <- PlannedBatchSampler(lengths, config, rank=1)

One class serves every mode: the :class:`~lit_seqpack.planning.PlanConfig` says which. Use it as
``DataLoader(PlannedDataset(ds), batch_sampler=sampler, collate_fn=collator)`` (torchdata's ``StatefulDataLoader``
for exact mid-epoch resume with workers) under ``Trainer(use_distributed_sampler=False)``.

- A sampler holds the lengths (in their smallest dtype), counts the current epoch's steps once and plans one window
  at a time as this rank reaches it (:class:`~lit_seqpack.planning.lazy.LazyPlan`: memory O(window)).
- ``len(sampler)`` is the exact number of microbatches of the current epoch, equal on every rank.
- ``__iter__`` is lazy: the epoch is read at the first ``next()``, so ``set_epoch`` may come after ``iter()``.
  Lightning calls ``set_epoch`` only on ``loader.sampler`` and ``loader.batch_sampler.sampler``, so the sampler
  exposes ``.sampler`` (this rank's sample indices) whose ``set_epoch`` forwards.
- ``state_dict`` holds the epoch and the microbatches consumed, never the rank: rank 0's checkpoint resumes every
  rank. StatefulDataLoader snapshots it when each batch is requested, so prefetching by workers does not move the
  resume point.
- With ``torch.distributed`` initialised, :meth:`PlannedBatchSampler.check_plan` compares a digest of the plan's
  inputs (config, lengths, loss tokens, epoch; and the data's ``content_digest`` when given) across ranks (one
  ``all_gather_object``) and fails loudly, on every rank, on a mismatch; never the whole plan, which is a pure
  function of them. The comparison is a collective, so the loader calls it in the main process before its workers
  start (:class:`~lit_seqpack.data.indexed._loader.ResumableDataLoader`), on every rank alike; iterating never talks
  to other ranks, so no rank can wait in a collective behind another rank's wait for its loader workers.
- Lightning reads ``len(dataloader)`` once. The count is constant across epochs with ``window=None`` and a sort-based
  packer (or dynamic or padded batching); otherwise reload the dataloaders every epoch (a warning says so when the
  count changes).

``PlannedDataset``: a map-style dataset whose batched reads carry the batch sampler's microbatch metadata.

A planned batch sampler yields :class:`~lit_seqpack.batch.Microbatch` lists of indices with a
:class:`~lit_seqpack.batch.MicrobatchMeta`; wrapping the dataset in :class:`PlannedDataset` hands the collator the
samples as a ``Microbatch`` with the same metadata and the original dataset indices (named in its errors).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lit_seqpack._checks import check_int, is_int
from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.indexed.splits import read_sample, source_index
from lit_seqpack.planning._windows import compact_counts
from lit_seqpack.planning.config import PlanConfig
from lit_seqpack.planning.lazy import LazyPlan
from lit_seqpack.planning.plan import Plan, build_plan

__all__ = [
    "IndexedCollator",
    "PLAN_FORMAT",
    "PlannedBatchSampler",
    "RankSampler",
    "distributed",
    "resolve_replicas",
    "PlannedDataset",
    "SourceIndices",
]


log = logging.getLogger(__name__)
# the version of the plan's format (sample order, chunks): bumped when the same inputs would plan differently.
# 2: auto-order chunks made of shuffled blocks of samples (was: one shuffle of every sample)
PLAN_FORMAT = 2
_STATE_KEYS = ("epoch", "position", "plan_key", "world_size", "accumulate_grad_batches", "num_samples")


def distributed() -> bool:
    """Whether ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``, each defaulting to ``torch.distributed``'s (or 1 and 0), validated."""
    if num_replicas is None:
        num_replicas = dist.get_world_size() if distributed() else 1
    if rank is None:
        rank = dist.get_rank() if distributed() else 0
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    if not is_int(rank) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, num_replicas={num_replicas}), got {rank!r}")
    return num_replicas, int(rank)


class RankSampler(Sampler[int]):
    """``batch_sampler.sampler``: this rank's sample indices of the epoch; ``set_epoch`` forwards to the owner."""

    def __init__(self, owner: PlannedBatchSampler) -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        plan, rank = self._owner.lazy_plan, self._owner.rank
        for position in range(plan.microbatches_per_rank):
            yield from plan.microbatch(rank, position).indices

    def __len__(self) -> int:
        return sum(1 for _ in self)


class PlannedBatchSampler(Sampler[Microbatch]):
    """One rank's planned microbatches of a :class:`~lit_seqpack.planning.PlanConfig`, in any mode.

    The one batch sampler of every mode: the config says which (``mode="packing" | "dynamic" | "padded"``), how
    many ranks and microbatches a step holds, and how the plan is made.

    Args:
        lengths: token count of every sample of the dataset.
        config: the plan configuration; its ``world_size`` is the number of data-parallel ranks.
        rank: this process's data-parallel rank (default: ``torch.distributed`` rank, or 0).
        loss_tokens: loss tokens per sample (default ``max(length - 1, 0)``).
        verify_plan: compare the plan across ranks (:meth:`check_plan`) when ``torch.distributed`` is initialised.
        content_digest: a digest of the data's content (e.g. :func:`~lit_seqpack._hashing.content_digest`
            of a few samples' tokens), or a function computing it, compared with the plan: ranks that read
            different data with the same lengths then fail too. ``None``: lengths only.

    Example:
        >>> from lit_seqpack.planning import PlanConfig
        >>> config = PlanConfig(mode="packing", max_tokens=8, world_size=2, shuffle=False)
        >>> [list(mb) for mb in PlannedBatchSampler([5, 3, 4, 4], config, rank=1)]
        [[2, 3]]
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        config: PlanConfig,
        *,
        rank: int | None = None,
        loss_tokens: Sequence[int] | np.ndarray | None = None,
        verify_plan: bool = True,
        content_digest: str | Callable[[], str] | None = None,
    ) -> None:
        if not isinstance(config, PlanConfig):
            raise TypeError(f"config must be a PlanConfig, got {type(config).__name__}")
        _, rank = resolve_replicas(config.world_size, rank)
        self._setup(lengths, config, rank, loss_tokens, verify_plan, False)
        self.content_digest = content_digest

    def _setup(
        self,
        lengths: Sequence[int] | np.ndarray,
        config: PlanConfig,
        rank: int,
        loss_tokens: Sequence[int] | np.ndarray | None,
        verify_plan: bool,
        world_defaulted: bool,
    ) -> None:
        if not isinstance(verify_plan, (bool, np.bool_)):
            raise TypeError(f"verify_plan={verify_plan!r} must be a bool (True or False)")
        self.config, self.rank, self.verify_plan = config, rank, bool(verify_plan)
        self._lengths = compact_counts("lengths", lengths)
        self._loss_tokens = None
        if loss_tokens is not None:
            self._loss_tokens = compact_counts("loss_tokens", loss_tokens, self._lengths.size)
            above = np.flatnonzero(self._loss_tokens > self._lengths)
            if above.size:
                i = int(above[0])
                raise ValueError(f"loss_tokens[{i}] = {int(self._loss_tokens[i])} exceeds the sample's length")
        self._world_defaulted = world_defaulted
        self._epoch, self._position, self._resume = 0, 0, False
        self._lazy: LazyPlan | None = None
        self._start_source: Callable[[int, int], tuple[int, int]] | None = None
        self._plan: Plan | None = None
        self._verified_epoch: int | None = None
        self._unchecked_warned = False
        self._reported_len: tuple[int, int] | None = None
        self._plan_key = self._key()
        self.sampler = RankSampler(self)
        self._plan_for(0)  # validates the lengths: over-long samples fail at construction, not mid-epoch

    def _key(self) -> str:
        """SHA-256 of the plan format's version, the config, the lengths and the loss tokens.

        The arrays are hashed in their compact dtype (named in the digest), which is a function of their
        values, so equal inputs give equal keys whatever dtype they came in. ``PLAN_FORMAT`` changes when
        the same inputs would plan differently: a mid-epoch checkpoint of an older layout then fails to
        resume loudly instead of replaying other samples.
        """
        digest = hashlib.sha256(f"{PLAN_FORMAT}|{self.config!r}".encode())
        for array in (self._lengths, self._loss_tokens):
            digest.update(b"-" if array is None else f"|{array.dtype.str}|".encode())
            if array is not None:
                digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        return digest.hexdigest()

    def _plan_for(self, epoch: int) -> LazyPlan:
        lazy = self._lazy
        if lazy is None or lazy.epoch != epoch:
            known = {} if lazy is None else {"partition": lazy.partition, "chunk_steps": lazy.chunk_steps}
            self._lazy = None  # drop the previous epoch's window first
            lazy = self._lazy = LazyPlan(
                self._lengths, self.config, epoch=epoch, loss_tokens=self._loss_tokens, **known
            )
        return lazy

    @property
    def lazy_plan(self) -> LazyPlan:
        """The current epoch's plan as this sampler reads it: a window at a time (memory O(window))."""
        return self._plan_for(self._epoch)

    @property
    def plan(self) -> Plan:
        """The current epoch's whole plan, every window materialised (for inspection: memory O(epoch)).

        Iteration never builds it; it yields the same microbatches from :attr:`lazy_plan`.
        """
        if self._plan is None or self._plan.epoch != self._epoch:
            self._plan = build_plan(self._lengths, self.config, epoch=self._epoch, loss_tokens=self._loss_tokens)
        return self._plan

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will plan."""
        return self._epoch

    @property
    def batch_size(self) -> int:
        """Samples per microbatch as batch-size readers see it: ``batch_size`` (padded) or 1 (packing, dynamic).

        Lightning's DeepSpeed strategy reads ``loader.batch_sampler.batch_size`` for DeepSpeed's
        ``train_micro_batch_size_per_gpu`` (used for its throughput logs and ``train_batch_size`` bookkeeping, not
        for the gradient). A packed microbatch is one row and a dynamic one a variable number of rows, so the unit
        is one microbatch per rank per forward: 1.
        """
        return int(self.config.batch_size) if self.config.mode == "padded" else 1

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration; a new epoch starts from its first microbatch."""
        check_int("epoch", epoch, minimum=0)
        if int(epoch) != self._epoch:
            self._epoch, self._position, self._resume = int(epoch), 0, False

    def set_start_source(self, source: Callable[[int, int], tuple[int, int]] | None) -> None:
        """Let a training loop decide where each iteration starts (``None``: the sampler's own epoch and position).

        Args:
            source: called at the first ``next()`` of every iteration with ``(epoch, start)``, the epoch and the
                microbatch the sampler would start from; returns the ``(epoch, microbatch)`` to start from, or
                raises.
        """
        self._start_source = source

    def __len__(self) -> int:
        count = self.lazy_plan.microbatches_per_rank
        self._reported_len = (self._epoch, count)
        return count

    def __iter__(self) -> Iterator[Microbatch]:
        plan = self._plan_for(self._epoch)  # runs at the first next(): the epoch is read lazily
        total = plan.microbatches_per_rank
        start = min(self._position, total) if self._resume else 0
        self._resume = False
        if self._start_source is not None:
            epoch, start = self._start_source(self._epoch, start)
            if epoch != self._epoch:
                self.set_epoch(epoch)
                plan = self._plan_for(epoch)
                total = plan.microbatches_per_rank
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= total:
                raise ValueError(f"the start source returned microbatch {start!r}, not one in [0, {total}]")
        self._check_local(plan)
        self._position = start
        config = self.config
        for position in range(start, total):
            indices, step, step_loss_tokens = plan.microbatch(self.rank, position)
            meta = MicrobatchMeta(
                step=step,
                step_loss_tokens=step_loss_tokens,
                world_size=config.world_size,
                accumulate_grad_batches=config.accumulate_grad_batches,
                max_tokens=config.max_tokens,
                is_empty=not indices,
                loss_tokens=plan.microbatch_loss_tokens(self.rank, position) if indices else 0,
                lengths=tuple(self._lengths[indices].tolist()) if indices else (),
            )
            self._position = position + 1
            yield Microbatch(indices, meta=meta)

    def _check_local(self, plan: LazyPlan) -> None:
        """The checks of an iteration's start that need no other rank (iteration never talks to other ranks)."""
        reported = self._reported_len
        if self.rank == 0 and reported and reported[0] != plan.epoch and reported[1] != plan.microbatches_per_rank:
            log.warning(
                "The number of microbatches changed from %d (epoch %d) to %d (epoch %d). Lightning reads "
                "len(dataloader) once: reload the dataloaders every epoch, or use window=None with a sort-based "
                "packer or dynamic batching, which keep the count constant.",
                reported[1],
                reported[0],
                plan.microbatches_per_rank,
                plan.epoch,
            )
        if not distributed():
            return
        self._check_world()
        if self.verify_plan and self._verified_epoch is None and not self._unchecked_warned:
            self._unchecked_warned = True
            log.warning(
                "lit_seqpack: this PlannedBatchSampler's plan was not compared across ranks: call "
                "sampler.check_plan() on every rank before iterating (ResumableDataLoader does it before its workers "
                "start), or pass verify_plan=False"
            )

    def _check_world(self) -> None:
        world = dist.get_world_size()
        if self._world_defaulted and world != self.config.world_size:
            raise RuntimeError(
                f"the sampler was built for {self.config.world_size} ranks but torch.distributed has {world}: "
                "build it after the process group is initialised (e.g. in train_dataloader) or pass num_replicas"
            )

    def check_plan(self) -> None:
        """Compare this rank's plan inputs (settings, lengths, loss tokens, content digest) and epoch with every rank's.

        A collective (one ``all_gather_object``) when ``torch.distributed`` is initialised and ``verify_plan`` is on,
        once per epoch; nothing otherwise. Call it on every rank alike, in the main process, before the loader's
        workers start: :class:`~lit_seqpack.data.indexed._loader.ResumableDataLoader` does it when an epoch's
        iterator starts. Iterating never calls it.

        Raises:
            RuntimeError: on every rank, when some rank planned with other inputs or reads other data, naming them.
        """
        if not distributed():
            return
        self._check_world()
        epoch = self._epoch
        if not self.verify_plan or self._verified_epoch == epoch:
            return
        world = dist.get_world_size()
        # the plan is a pure function of these: equal digests, equal plans (no need to hash the plan itself)
        content = self.content_digest() if callable(self.content_digest) else self.content_digest
        mine = (self._plan_key, epoch, self.config.world_size, content)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        if len(set(everyone)) > 1:  # every rank sees the same list, so every rank raises: no hang
            others = [r for r, f in enumerate(everyone) if f[:3] != mine[:3]]
            if others:
                raise RuntimeError(
                    f"rank {dist.get_rank()} computed a different plan for epoch {epoch} than ranks {others}: "
                    "every rank must pass the same lengths, loss tokens and settings (seed, max_tokens, window, ...)"
                )
            others = [r for r, f in enumerate(everyone) if f[3] != content]
            raise RuntimeError(
                f"rank {dist.get_rank()} reads different data than ranks {others}: the lengths agree but the tokens of "
                f"the sampled samples do not (content digest {content} vs {[everyone[r][3] for r in others]}); every "
                "rank must read the same dataset (same files, tokenizer and preprocessing). A dataset whose samples "
                "change between reads (random augmentation) needs the check off (content_check_samples=0)"
            )
        self._verified_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Progress through the epoch; identical on every rank (rank 0 writes the checkpoint).

        Once the last microbatch of epoch ``e`` is out, the state is the start of epoch ``e + 1``: a
        loader restored from an end-of-epoch checkpoint may create its iterator before Lightning calls
        ``set_epoch``, and must then plan the next epoch, not replay this one.
        """
        total = self.lazy_plan.microbatches_per_rank
        finished = total > 0 and self._position >= total
        return {
            "epoch": self._epoch + 1 if finished else self._epoch,
            "position": 0 if finished else self._position,
            "plan_key": self._plan_key,
            "world_size": self.config.world_size,
            "accumulate_grad_batches": self.config.accumulate_grad_batches,
            "num_samples": int(self._lengths.size),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume: the next iteration yields exactly the microbatches the saved run had not consumed.

        A checkpoint of another configuration (world size, lengths, settings) can only be resumed at an
        epoch boundary; mid-epoch it raises ``ValueError``.
        """
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"sampler state_dict lacks {missing}")
        epoch, position = state_dict["epoch"], state_dict["position"]
        for name, value in (("epoch", epoch), ("position", position)):
            check_int(f"state_dict[{name!r}]", value, minimum=0)
        if position and state_dict["plan_key"] != self._plan_key:
            changed = {
                k: (state_dict[k], v)
                for k, v in (
                    ("world_size", self.config.world_size),
                    ("accumulate_grad_batches", self.config.accumulate_grad_batches),
                    ("num_samples", int(self._lengths.size)),
                )
                if state_dict[k] != v
            }
            named = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                f"cannot resume mid-epoch (epoch {epoch}, microbatch {position}) on another layout or plan "
                f"({named or 'lengths, loss tokens or settings differ'}): only a checkpoint written at an epoch "
                "boundary continues on another world size, accumulate_grad_batches or max_tokens; resume this one "
                "with the checkpoint's values, or from an epoch-boundary checkpoint"
            )
        self._epoch, self._position, self._resume = int(epoch), int(position), True


class PlannedDataset:
    """Wraps a map-style dataset so that a batch sampler's :class:`Microbatch` metadata reaches the collator.

    Use it to wire a planned batch sampler and a collator into a plain ``DataLoader`` by hand (the DataModule does
    it for you).

    Args:
        dataset: any object with ``__getitem__`` and ``__len__`` returning sample mappings.

    Example:
        >>> planned = PlannedDataset([{"input_ids": [5, 6]}, {"input_ids": [7]}])
        >>> batch = planned.__getitems__(Microbatch([1, 0], meta=None))
        >>> [sample["input_ids"] for sample in batch], list(batch.indices)
        ([[7], [5, 6]], [1, 0])
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return read_sample(self.dataset, index)

    def __getitems__(self, indices: Sequence[int]) -> Microbatch:
        return Microbatch(
            (read_sample(self.dataset, i) for i in indices),
            meta=getattr(indices, "meta", None),
            indices=SourceIndices(self.dataset, indices),
        )


class SourceIndices(Sequence[int]):
    """The original dataset indices of a microbatch's samples, resolved only when asked (in an error message).

    Args:
        dataset: the (possibly split, dropped or truncated) dataset the indices point into.
        indices: positions in ``dataset``.
    """

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self._dataset, self._indices = dataset, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, position: Any) -> Any:
        # the data layer's views (split, drop, truncate) know how to map back; resolved on the error path only
        if isinstance(position, slice):
            return [source_index(self._dataset, int(i)) for i in self._indices[position]]
        return source_index(self._dataset, int(self._indices[position]))

    def __reduce__(self) -> tuple[Any, ...]:  # never ship the dataset: the resolved indices are small
        return (list, (list(self),))


class IndexedCollator:
    """A collator that also writes ``sample_index``: each document's index in the source, in batch order.

    ``sample_index`` is int64 ``[num_documents]``: in ``cu_seqlens`` order for a packed row, one per row for a padded
    batch, empty for a lock-step filler. The indices are the source's (through split, drop and truncate views), as
    :class:`PlannedDataset` attaches them; ``trainer.predict`` returns them with each sample's outputs.

    Args:
        collate: the mode's collator (:class:`~lit_seqpack.data.batching.collate.PackedCollator`, ...).

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> planned = PlannedDataset([{"input_ids": [5, 6]}, {"input_ids": [7]}])
        >>> IndexedCollator(PackedCollator())(planned.__getitems__(Microbatch([1, 0])))["sample_index"].tolist()
        [1, 0]
    """

    def __init__(self, collate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        indices = getattr(samples, "indices", None)
        if indices is None and len(samples):
            raise ValueError("IndexedCollator needs the samples' indices: read them through PlannedDataset")
        batch = self.collate(samples)
        batch["sample_index"] = torch.tensor([int(i) for i in indices or ()], dtype=torch.int64)
        return batch
