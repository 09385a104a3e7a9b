"""``RolloutPlanner``: a rollout's log-prob pass and training microbatches on this rank, in lock step, exact.

Every rank builds the same torch-free :class:`~lit_seqpack.planning.rollout.RolloutPlan` from the same rollout and
runs its own share; no collective is needed to agree on microbatch counts (``compute_per_token(gather=True)``
gathers the results, the only communication). Batches are built by the library's collators
(:class:`~lit_seqpack.data.batching.collate.PackedCollator` in ``packing`` mode,
:class:`~lit_seqpack.data.PaddedCollator` in ``dynamic`` mode) with the rollout's declared fields, plus the
plan's facts:

=========================  =======================================================================================
``sample_indices``         the rollout indices of the batch's documents (Python ints, in document order)
``group_ids``              ``[num_documents]`` int64 dense group labels (every sample its own group without groups)
``document_loss_tokens``   ``[num_documents]`` int64 loss tokens of each document
``group_loss_tokens``      ``[num_documents]`` int64 loss tokens of each document's group over the whole step
``num_groups``             distinct groups in the batch
``num_loss_documents``     documents of the batch with a loss (loss tokens, or a weight sum above 0); also
                           ``num_loss_groups``: the batch's groups with a loss
``step``                   the optimizer step (0-based) within the rollout
``step_loss_tokens``       loss tokens of the step over all ranks (also ``step_documents``, ``step_groups``)
``step_loss_documents``    samples of the step with a loss over all ranks (also ``step_loss_groups``): the
                           denominators of the sequence and group means (samples without a loss are left out)
``step_loss_weight``       with ``loss_weight_field``: the step's loss-weight sum over all ranks (and the batch's
                           ``loss_weights``, ``num_loss_weight``, as the collators place them,
                           ``document_loss_weight`` and ``group_loss_weight``: ``[num_documents]`` float64 weight sums
                           of each document and of its group)
``is_last_in_step``        the last microbatch of this rank in the step: call ``optimizer.step()`` after it
=========================  =======================================================================================

Under ``torch.distributed`` the planner also checks, once per call of ``train_microbatches``,
``logprob_microbatches`` or ``compute_per_token`` and before any batch is built, that every rank holds the same
rollout (``check_rollout``): one ``all_gather_object`` of :meth:`~lit_seqpack.rl.Rollout.fingerprint`, so that ranks
fed different rollouts (a DataLoader sharded by Lightning's ``DistributedSampler``) raise on every rank instead of
training on different data.

Plans are made once per rollout: the planner keeps the plans of the last rollout it saw, keyed by
:attr:`~lit_seqpack.rl.Rollout.identity`, which the copies of :meth:`~lit_seqpack.rl.Rollout.with_fields` share, so
the old-log-prob, reference and training passes of one rollout plan once per budget (the fingerprint, too, is
computed once per rollout).

A rank's microbatches of a :class:`~lit_seqpack.planning.rollout.RolloutPlan` as collated batches that carry
the plan's facts (sample indices, groups, the loss units of documents, groups and the step).

A sample's *loss mass* is its loss-token count, or with a ``loss_weight_field`` its loss-weight sum. A sample (a
group) whose mass is 0 (a truncated, filtered or over-long completion with an all-zero mask or weights) is planned and
run like any other but has no loss: the token, sequence and group means of :mod:`lit_seqpack.rl.loss` leave it out of
their numerator and denominator (``step_loss_documents``, ``step_loss_groups`` count only samples and groups with a
loss), and a step where nothing has a loss is a zero-gradient step.

Where this process sits among data-parallel ranks, and the one gather of per-sample results over ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from lit_seqpack._checks import check_int
from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.planning.rollout import RolloutPlan, RolloutPlanConfig, dense_group_labels, plan_rollout
from lit_seqpack.rl.rollout import Rollout
from lit_seqpack.rl.unpack import unpack

__all__ = [
    "RolloutPlanner",
    "RolloutSettings",
    "LossMass",
    "collator_fields",
    "loss_mass",
    "plan_batches",
    "DataParallelWorld",
    "check_same_rollout",
    "gather_per_sample",
    "resolve_world",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSettings:
    """How a :class:`RolloutPlanner` plans: budgets, mode, steps, balance and the rollout check, checked once.

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
            across microbatches, or across ranks (its samples are packed one by one on its rank); see
            :class:`~lit_seqpack.planning.rollout.RolloutPlanConfig`.
        pad_token_id: the id written on padding.
        pad_to_multiple_of: pad every row to a multiple of this (packing: the row; dynamic: the block length).
        cost_linear: ``a`` of the balance cost ``a*L + b*L^2``.
        cost_quadratic: ``b`` (``"auto"``: ``cost_linear / budget``).
        shuffle: shuffle samples (groups) before cutting steps.
        seed: the shuffle's seed.
        loss_weight_field: a token field of the rollout holding per-token loss weights (``>= 0``): training
            batches then carry ``loss_weights`` and the step's ``step_loss_weight``, and ``step_loss(...,
            normalize="token")`` is the weighted token mean of the step. ``None``: no weights.
        check_rollout: compare the rollout's fingerprint over ranks once per pass (one ``all_gather_object``);
            ``None``: whenever ``torch.distributed`` is initialised, there is more than one rank and the pass runs
            in the main process (not in a DataLoader worker).

    Example:
        >>> RolloutSettings(train_max_tokens=64).logprob_budget
        64
    """

    train_max_tokens: int
    logprob_max_tokens: int | None = None
    mode: Literal["packing", "dynamic"] = "packing"
    algorithm: str | None = None
    samples_per_step: int | None = None
    steps_per_rollout: int | None = None
    accumulate_grad_batches: int | None = None
    keep_together: Literal["microbatch", "rank"] | None = None
    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    cost_linear: float = 1.0
    cost_quadratic: float | Literal["auto"] = "auto"
    shuffle: bool = False
    seed: int = 0
    loss_weight_field: str | None = None
    check_rollout: bool | None = None

    def __post_init__(self) -> None:
        field = self.loss_weight_field
        if field is not None and (not isinstance(field, str) or not field):
            raise ValueError(f"loss_weight_field must be None or a token field name, got {field!r}")
        if field == "loss_mask":
            raise ValueError(
                "loss_weight_field='loss_mask' is not supported: a Rollout's loss_mask is 0/1. Put the weights in a "
                "token field (token_fields={'weights': ...}) and pass loss_weight_field='weights'"
            )
        check_int("train_max_tokens", self.train_max_tokens, minimum=1)  # named as the user spells them
        if self.logprob_max_tokens is not None:
            check_int("logprob_max_tokens", self.logprob_max_tokens, minimum=1)
        if self.check_rollout is not None and not isinstance(self.check_rollout, bool):
            raise ValueError(f"check_rollout must be None, True or False, got {self.check_rollout!r}")
        self.plan_config("train")  # the planner's own checks (mode, algorithm, steps, keep_together, costs)
        self.collator()  # the padding settings

    @property
    def logprob_budget(self) -> int:
        """The log-prob pass's budget: ``logprob_max_tokens``, else ``train_max_tokens``."""
        return self.train_max_tokens if self.logprob_max_tokens is None else self.logprob_max_tokens

    def plan_config(self, kind: Literal["train", "logprob"]) -> RolloutPlanConfig:
        """The planner's config of one pass: training (steps, accumulation, groups, shuffle) or log-prob."""
        common = {
            "mode": self.mode,
            "algorithm": self.algorithm,
            "cost_linear": self.cost_linear,
            "cost_quadratic": self.cost_quadratic,
            "sequence_length_round": 1 if self.mode == "packing" else self.pad_to_multiple_of or 1,
            "seed": self.seed,
        }
        if kind == "logprob":
            return RolloutPlanConfig(max_tokens=self.logprob_budget, **common)
        return RolloutPlanConfig(
            max_tokens=self.train_max_tokens,
            samples_per_step=self.samples_per_step,
            steps_per_rollout=self.steps_per_rollout,
            accumulate_grad_batches=self.accumulate_grad_batches,
            keep_together=self.keep_together,
            shuffle=self.shuffle,
            **common,
        )

    def collator(self, **fields: Any) -> PackedCollator | PaddedCollator:
        """The mode's collator with the padding settings (and the rollout's declared ``fields``)."""
        collator = PackedCollator if self.mode == "packing" else PaddedCollator
        return collator(pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of, **fields)


class RolloutPlanner:
    """Plans a rollout over data-parallel ranks: a log-prob pass and the training microbatches of each step.

    Args:
        settings: how to plan (see :class:`RolloutSettings`); or give its fields as keywords.
        world_size: data-parallel ranks; with ``rank``, overrides ``trainer`` and ``torch.distributed``.
        rank: this process's data-parallel rank.
        trainer: read the world size and rank from it (its device mesh's data-parallel layout if it has one).
        **fields: the fields of :class:`RolloutSettings`, when ``settings`` is not given.

    Example:
        >>> rollout = Rollout(input_ids=[[5, 6, 7], [8, 9], [1, 2, 3, 4]])
        >>> planner = RolloutPlanner(RolloutSettings(train_max_tokens=8), world_size=1, rank=0)
        >>> [(b["sample_indices"], b["is_last_in_step"]) for b in planner.train_microbatches(rollout)]
        [([2, 0], False), ([1], True)]
    """

    def __init__(
        self,
        settings: RolloutSettings | None = None,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        trainer: Any = None,
        **fields: Any,
    ) -> None:
        if (world_size is None) != (rank is None):
            raise ValueError(f"give both world_size and rank, or neither (got {world_size=}, {rank=})")
        if world_size is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if settings is None:
            settings = RolloutSettings(**fields)
        elif fields:
            raise TypeError(f"give the settings as a RolloutSettings or as keywords, not both (got {sorted(fields)})")
        if not isinstance(settings, RolloutSettings):
            raise TypeError(f"settings must be a RolloutSettings, got {type(settings).__name__}")
        self.settings = settings
        self._world = DataParallelWorld(world_size, rank) if world_size is not None else None
        self._trainer = trainer
        self._train, self._logprob = settings.plan_config("train"), settings.plan_config("logprob")
        self._plans: dict[tuple[str, int], RolloutPlan] = {}  # the plans of the rollout ``self._planned``
        self._planned: object | None = None

    @property
    def budgets(self) -> dict[str, int]:
        """The two budgets by the names the settings give them."""
        return {"train_max_tokens": self.settings.train_max_tokens, "logprob_max_tokens": self.settings.logprob_budget}

    @property
    def loss_weight_field(self) -> str | None:
        """See :attr:`RolloutSettings.loss_weight_field`."""
        return self.settings.loss_weight_field

    @property
    def check_rollout(self) -> bool | None:
        """See :attr:`RolloutSettings.check_rollout`."""
        return self.settings.check_rollout

    # --------------------------------------------------------------------------------------------- plans
    @property
    def world(self) -> DataParallelWorld:
        """``world_size`` and ``rank`` of data parallelism, resolved now (explicit, trainer, torch.distributed or 1)."""
        return self._world if self._world is not None else resolve_world(self._trainer)

    def plan(self, rollout: Rollout) -> RolloutPlan:
        """The training plan of ``rollout`` (the same on every rank), made once per rollout (see :meth:`_plan`)."""
        return self._plan(rollout, self._train, "train_max_tokens")

    def logprob_plan(self, rollout: Rollout) -> RolloutPlan:
        """The log-prob pass's plan of ``rollout``: one step, balanced over ranks, made once per rollout."""
        return self._plan(rollout, self._logprob, "logprob_max_tokens")

    def _plan(self, rollout: Rollout, config: RolloutPlanConfig, budget: str) -> RolloutPlan:
        """The plan of ``rollout`` for ``budget``, kept for the rollout's :attr:`~lit_seqpack.rl.Rollout.identity`
        (shared by its :meth:`~lit_seqpack.rl.Rollout.with_fields` copies): every pass over one rollout (old and
        reference log-probs, training, several epochs) reuses it; a new rollout drops the previous one's plans."""
        if not isinstance(rollout, Rollout):
            raise TypeError(f"expected a lit_seqpack.rl.Rollout, got {type(rollout).__name__}")
        config = dataclasses.replace(config, world_size=self.world.world_size)
        if self._planned is not rollout.identity:
            self._plans, self._planned = {}, rollout.identity
        key = (budget, config.world_size)
        if key not in self._plans:
            self._plans[key] = self._new_plan(rollout, config, budget)
        return self._plans[key]

    def _new_plan(self, rollout: Rollout, config: RolloutPlanConfig, budget: str) -> RolloutPlan:
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
        self._check_same_rollout(rollout)
        yield from self._batches(rollout, self.logprob_plan(rollout), device)

    def train_microbatches(self, rollout: Rollout, *, device: Any = None) -> Iterator[dict[str, Any]]:
        """This rank's training batches, ``accumulate_grad_batches`` per step, with the step totals."""
        self._check_same_rollout(rollout)
        plan = self.plan(rollout)
        yield from self._batches(rollout, plan, device, weight_field=self.loss_weight_field)

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
                raises ``RuntimeError`` when the ranks hold different rollouts (checked before the first forward
                with ``check_rollout``, and again in the gather itself).
            device: move the batches there first.

        Returns:
            ``N`` tensors (on the device ``fn`` returned); without ``gather``, entries of other ranks are ``None``.
        """
        world_size, rank = self.world
        gathered = gather and world_size > 1
        self._check_same_rollout(rollout)  # before any forward: ranks holding other rollouts raise at once
        plan = self.logprob_plan(rollout)
        out: list[torch.Tensor | None] = [None] * len(rollout)
        for batch in self._batches(rollout, plan, device):
            if batch["is_empty"]:
                continue
            values = fn(batch)
            for index, value in zip(batch["sample_indices"], unpack(values, batch), strict=True):
                out[index] = value.detach().clone()
        if gathered:
            return gather_per_sample(out, plan, rollout.lengths, rank, rollout.fingerprint())
        return out

    def _check_same_rollout(self, rollout: Rollout) -> None:
        world_size = self.world.world_size
        if self.check_rollout is False or world_size == 1:
            return
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        in_worker = torch.utils.data.get_worker_info() is not None  # a DataLoader worker cannot join a collective
        if self.check_rollout and (in_worker or not initialised):
            where = "it runs in a DataLoader worker" if in_worker else "torch.distributed is not initialised"
            raise ValueError(
                f"check_rollout=True compares the rollout over ranks, but {where} (world_size={world_size}); "
                "pass check_rollout=False or None, or compare Rollout.fingerprint() in the main process"
            )
        if initialised and not in_worker:
            check_same_rollout(rollout.fingerprint(), world_size)

    def _batches(
        self, rollout: Rollout, plan: RolloutPlan, device: Any, *, weight_field: str | None = None
    ) -> Iterator[dict[str, Any]]:
        world_size, rank = self.world
        mass = loss_mass(plan, rollout, weight_field)  # first: it names a weight field the rollout lacks
        fields = {"loss_weight_field": weight_field} if weight_field is not None else {}
        collate = self.settings.collator(**collator_fields(rollout), **fields)
        for batch in plan_batches(rollout, plan, rank, world_size, collate, mass):
            yield batch if device is None else _to_device(batch, device)


def _to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


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


_DIFFERENT_ROLLOUTS = (
    "the ranks planned different rollouts (their Rollout.fingerprint() differ: {digests}): every rank must hold the "
    "same rollout. A DataLoader of rollouts (or prompts) needs use_distributed_sampler=False (or generate on every "
    "rank with the same seed and gather)"
)


class DataParallelWorld(NamedTuple):
    """The data-parallel ranks and this process's rank among them.

    Example:
        >>> DataParallelWorld(world_size=4, rank=1).world_size
        4
    """

    world_size: int = 1
    """Data-parallel ranks."""
    rank: int = 0
    """This process's data-parallel rank."""


def resolve_world(trainer: Any = None) -> DataParallelWorld:
    """The data-parallel world: the trainer's (its device mesh first), ``torch.distributed``'s, or one rank."""
    if trainer is not None:
        from lit_seqpack.parallel.layout import mesh_layout, strategy_mesh

        mesh = strategy_mesh(getattr(trainer, "strategy", None))
        if mesh is not None:
            layout = mesh_layout(mesh)
            if layout.context_parallel_size * layout.tensor_parallel_size != 1:
                raise ValueError(
                    "RolloutPlanner supports data parallelism only; the device mesh has context x tensor parallel "
                    f"= {layout.context_parallel_size} x {layout.tensor_parallel_size}"
                )
            return DataParallelWorld(layout.data_parallel_size, layout.data_parallel_rank)
        return DataParallelWorld(int(trainer.world_size), int(trainer.global_rank))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DataParallelWorld(dist.get_world_size(), dist.get_rank())
    return DataParallelWorld()


def gather_per_sample(
    values: list[torch.Tensor | None], plan: RolloutPlan, lengths: np.ndarray, rank: int, fingerprint: str
) -> list[torch.Tensor | None]:
    """Fill every entry of ``values`` with the owning rank's tensor (one ``all_gather`` of flat values).

    Every rank knows from the plan which samples each rank computed and how long they are, so only the values
    travel: each rank sends its samples' values concatenated in plan order, padded to the longest rank's total.
    A small object gather first exchanges the dtype and the rollout's ``fingerprint``: ranks that planned
    different rollouts (e.g. a DataLoader sharded by a ``DistributedSampler``) raise instead of mixing values.
    """
    import torch.distributed as dist

    world_size = plan.config.world_size
    owned = [[i for _, _, mb in plan.rank_microbatches(r) for i in mb] for r in range(world_size)]
    mine = [values[i] for i in owned[rank]]
    if any(v is None for v in mine):
        raise RuntimeError("compute_per_token: a sample of this rank has no value (fn skipped a batch?)")
    meta: list[Any] = [None] * world_size
    first = mine[0] if mine else None
    described = None if first is None else (first.dtype, tuple(first.shape[1:]), str(first.device))
    dist.all_gather_object(meta, (fingerprint, described))
    _raise_unless_equal([m[0] for m in meta])
    meta = [m[1] for m in meta]
    known = next(m for m in meta if m is not None)
    dtype, trailing = known[0], known[1]
    if first is not None:
        device = first.device
    else:  # a rank without samples (more ranks than samples) sends zeros from the backend's device
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
    totals = [int(lengths[o].sum()) for o in owned]
    width = max(totals)
    flat = torch.zeros((width, *trailing), dtype=dtype, device=device)
    if mine:
        flat[: totals[rank]] = torch.cat(mine)
    buffers = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(buffers, flat)
    out = list(values)
    for r in range(world_size):
        for i, part in zip(owned[r], buffers[r][: totals[r]].split(lengths[owned[r]].tolist()), strict=True):
            out[i] = part
    return out


def check_same_rollout(fingerprint: str, world_size: int) -> None:
    """Raise on every rank unless all ``world_size`` ranks hold the rollout of ``fingerprint`` (one
    ``all_gather_object`` of the digest over the default process group).

    Raises:
        ValueError: the default process group is not the planner's data-parallel group.
        RuntimeError: the ranks' digests differ (on every rank, so none waits for the others).
    """
    import torch.distributed as dist

    if dist.get_world_size() != world_size:
        raise ValueError(
            f"check_rollout compares the rollout over the default process group ({dist.get_world_size()} ranks) "
            f"but the planner has {world_size} data-parallel ranks; pass check_rollout=False and compare "
            "Rollout.fingerprint() over your data-parallel group"
        )
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, fingerprint)
    _raise_unless_equal(digests)


def _raise_unless_equal(digests: list[str]) -> None:
    if len(set(digests)) > 1:
        shown = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise RuntimeError(_DIFFERENT_ROLLOUTS.format(digests=shown))
