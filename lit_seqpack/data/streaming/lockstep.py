"""Lock step for ranks that read their own shares of a stream (``stream_split="rank"``): one small collective a window.

Each rank plans the windows of its own share alone (so its ``k``-th optimizer step is the epoch's step ``k``), and
knows the steps of the windows it has read. Before step ``j`` every rank must know every rank's loss tokens of step
``j`` (the exact-loss normaliser is the step's total over all ranks). So whenever some rank has not yet read the
window holding step ``j``, every rank calls one ``all_gather_object``: the ranks lacking that window read it (its
step count and loss tokens per step, :class:`ShareFacts`) or say their share has ended, the others send nothing
new. Every rank sees the same gathered facts and so decides the next collective alike: every collective runs on
every rank the same number of times, and no rank ever waits for one another skips.

A rank whose share has ended yields lock-step fillers (zero-loss microbatches) until every rank's share has ended;
then the epoch ends on every rank at the same microbatch. A rank's plan is never changed by the others, so a
checkpoint needs each rank's own window records only; the collectives are replayed from there on resume.

Example:
    >>> lock = LockStep(rank=0, world_size=2, epoch=0)
    >>> lock.exchange([ShareFacts(epoch=0, first_step=0, step_loss_tokens=(5, 7)), ShareFacts(epoch=0, ended=True)])
    >>> lock.missing(1), lock.step_loss_tokens(1), lock.runs_own(1), lock.missing(2)  # rank 0 must read on at step 2
    ([], 7, True, [0])
    >>> lock.exchange([ShareFacts(epoch=0, ended=True), ShareFacts(epoch=0, idle=True)])
    >>> lock.finished(2)
    True
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["Gather", "LockStep", "ShareFacts", "gather_object"]


Gather = Callable[[Any], Sequence[Any]]
"""``value -> every data-parallel rank's value``, in rank order (an ``all_gather_object``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShareFacts:
    """What one rank sends in a lock-step collective.

    Args:
        epoch: the epoch the rank reads (ranks in different epochs raise).
        first_step: the epoch step of the window's first step.
        step_loss_tokens: the loss tokens of each of the window's steps, on this rank.
        ended: the rank's share has no more window this epoch.
        idle: the rank had no window to read for this collective (it knows its next steps already).
        error: reading the rank's next window failed (a bad line, an over-long sample under ``overlong="error"``):
            every rank raises, naming it, instead of waiting for that rank at the next collective.
    """

    epoch: int
    first_step: int = 0
    step_loss_tokens: tuple[int, ...] = ()
    ended: bool = False
    idle: bool = False
    error: str | None = None


def gather_object(value: Any, world_size: int, rank: int) -> list[Any]:
    """Every data-parallel rank's ``value`` (one ``all_gather_object``); ``[value]`` without ``torch.distributed``.

    Each process sends its data-parallel ``rank`` with its value, so the model-parallel (tensor / context parallel)
    processes of a data-parallel rank are found wherever the strategy's device mesh places them
    (:func:`_data_parallel`).

    Example:
        >>> gather_object({"steps": 3}, world_size=1, rank=0)
        [{'steps': 3}]
    """
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, value))
    return _data_parallel(everyone, world_size)


def _data_parallel(everyone: Sequence[tuple[int, Any]], world_size: int) -> list[Any]:
    """One value per data-parallel rank, in rank order, from every process's ``(data-parallel rank, value)``.

    The model-parallel processes of a data-parallel rank read the same share and send the same value; where they
    sit among the global ranks is the mesh's business (:class:`~lit_seqpack.parallel.ParallelLayout` and Lightning's
    ``ModelParallelStrategy`` put them innermost, a custom mesh may not), so they are found by the rank they send.

    Raises:
        RuntimeError: on every process alike, when the processes do not hold ``world_size`` data-parallel ranks of
            equal size, or the processes of one data-parallel rank sent different values (their shares diverged:
            one failed to read, or a layout is wrong), naming the global ranks.

    Example:
        >>> _data_parallel([(0, "a"), (0, "a"), (1, "b"), (1, "b")], world_size=2)  # 2 data- x 2 tensor-parallel
        ['a', 'b']
    """
    groups: dict[int, list[int]] = {}
    for process, (rank, _) in enumerate(everyone):
        groups.setdefault(rank, []).append(process)
    sizes = {len(processes) for processes in groups.values()}
    if sorted(groups) != list(range(world_size)) or len(sizes) != 1:
        found = {rank: processes for rank, processes in sorted(groups.items())}
        raise RuntimeError(
            f"{len(everyone)} processes cannot hold {world_size} data-parallel ranks of equal size: the global ranks "
            f"of each data-parallel rank are {found}"
        )
    values = []
    for rank in range(world_size):
        first, *peers = groups[rank]
        differ = [process for process in peers if not _same(everyone[process][1], everyone[first][1])]
        if differ:
            raise RuntimeError(
                f"the model-parallel processes of data-parallel rank {rank} (global ranks {groups[rank]}) read "
                f"different stream shares: global rank {first} sent {everyone[first][1]!r}, global rank {differ[0]} "
                f"sent {everyone[differ[0]][1]!r}"
            )
        values.append(everyone[first][1])
    return values


def _same(one: Any, other: Any) -> bool:
    """Whether two gathered values are equal (by their pickles where ``==`` is ambiguous, e.g. numpy arrays inside)."""
    try:
        return bool(one == other)
    except (TypeError, ValueError):
        return pickle.dumps(one) == pickle.dumps(other)


class LockStep:
    """The steps every rank has read, their loss tokens over all ranks, and which ranks have ended.

    Args:
        rank: this data-parallel rank.
        world_size: the data-parallel ranks.
        epoch: the epoch being read.
        gather: ``value -> every data-parallel rank's value`` (:func:`gather_object` by default).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        epoch: int,
        gather: Gather | None = None,
    ) -> None:
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.gather = gather or (lambda value: gather_object(value, world_size, rank))
        self.known = [0] * world_size  # each rank's steps read so far (the end of its last window's steps)
        self.ended = [False] * world_size
        self.any_step = False  # some rank had a step this iteration
        self.collectives = 0
        self._totals: dict[int, int] = {}

    def missing(self, step: int) -> list[int]:
        """The ranks that must read a window (or end) before ``step`` can run."""
        return [r for r in range(self.world_size) if not self.ended[r] and self.known[r] <= step]

    def runs_own(self, step: int) -> bool:
        """Whether this rank trains its own microbatches at ``step`` (else a filler)."""
        return self.known[self.rank] > step

    def finished(self, step: int) -> bool:
        """Whether every rank's share ended before ``step``: the epoch ends here on every rank."""
        return all(self.ended) and max(self.known) <= step

    def step_loss_tokens(self, step: int) -> int:
        """The loss tokens of ``step`` over all ranks."""
        return self._totals.get(step, 0)

    def forget(self, step: int) -> None:
        """Drop what is known of ``step`` (trained): memory holds the steps of the windows being read only."""
        self._totals.pop(step, None)

    def exchange(self, everyone: Sequence[ShareFacts] | None = None, mine: ShareFacts | None = None) -> None:
        """One collective: send ``mine`` (or an idle note), fold in every rank's facts (``everyone``: given, in tests).

        Raises:
            RuntimeError: on every rank, when the ranks read different epochs or a rank failed to read its window.
        """
        if everyone is None:
            everyone = self.gather(mine or ShareFacts(epoch=self.epoch, idle=True))
        self.collectives += 1
        failed = [(r, facts.error) for r, facts in enumerate(everyone) if facts.error is not None]
        if failed:
            said = "; ".join(f"rank {r}: {error}" for r, error in failed)
            raise RuntimeError(f"reading the stream shares failed on rank(s) {[r for r, _ in failed]} ({said})")
        epochs = {facts.epoch for facts in everyone}
        if len(epochs) > 1:
            at = ", ".join(f"rank {r}: epoch {facts.epoch}" for r, facts in enumerate(everyone))
            raise RuntimeError(
                f"the ranks read their stream shares in different epochs at the same lock-step collective ({at}): "
                "every rank must run the same epochs (resume every rank from the same checkpoint)"
            )
        for r, facts in enumerate(everyone):
            if facts.idle:
                continue
            if facts.ended:
                self.ended[r] = True
                continue
            for k, loss in enumerate(facts.step_loss_tokens):
                self._totals[facts.first_step + k] = self._totals.get(facts.first_step + k, 0) + int(loss)
            self.known[r] = facts.first_step + len(facts.step_loss_tokens)
            self.any_step = self.any_step or bool(facts.step_loss_tokens)
