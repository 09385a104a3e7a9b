"""A stream's prefix as training reads it: the samples ``lit-seqpack inspect`` plans and the microbatches they train in.

Under ``stream_split="replicate"`` every rank reads the stream from its start, so the prefix is the stream's first
``max_samples`` samples, planned for all ranks at once. Under ``stream_split="rank"`` rank ``r`` reads its own share
(``source.split(r, world_size)``) from the share's start: what training reads first is the first samples of *each
share*, not the stream's first samples dealt out (a JSONL stream is split by bytes: its first lines all belong to rank
0's share). So the prefix of ``max_samples`` samples is :func:`share_sizes` samples from the start of each share, each
share planned alone in windows as its rank plans it, and the ranks kept in lock step as the loader keeps them
(:mod:`~lit_seqpack.data.streaming.lockstep`): every rank runs the steps of the rank with the most, a rank with fewer
runs empty fillers (:class:`LockStepPrefix`). When ``num_workers >= 2`` loader workers read lanes of a share
(:mod:`~lit_seqpack.data.streaming.lanes`), the share's prefix is :func:`share_sizes` samples from the start of each
lane, each lane planned alone (:func:`combined_shares` adds them up), as the workers plan them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from lit_seqpack.data.batching._samples import sample_loss_tokens
from lit_seqpack.data.batching.overlong import OverlongReport
from lit_seqpack.data.streaming.buffer import OverlongCounter, stream_windows
from lit_seqpack.planning.plan import PlanConfig

__all__ = ["LockStepPrefix", "SharePrefix", "combined_shares", "plan_share_prefix", "prefix_lengths", "share_sizes"]


def share_sizes(max_samples: int, world_size: int) -> list[int]:
    """Samples read from the start of each rank's share for a prefix of ``max_samples`` (the first ranks one more).

    Example:
        >>> share_sizes(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(max_samples, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SharePrefix:
    """One rank's share of a prefix, planned in windows as that rank's loader plans it.

    Args:
        samples: the share's samples planned (after the over-long policy).
        steps: the optimizer steps of its windows.
        microbatches: its own microbatches (``steps x accumulate_grad_batches``).
        empty: its windows' empty microbatches (bins fewer than a step's slots).
        real_tokens: the planned tokens of its samples (packing: each document rounded up to ``pad_to_multiple_of``).
    """

    samples: int
    steps: int
    microbatches: int
    empty: int
    real_tokens: int


def combined_shares(parts: Sequence[SharePrefix]) -> SharePrefix:
    """One rank's share from its lanes' (each planned alone by its loader worker): every count added up.

    Example:
        >>> lane = SharePrefix(samples=9, steps=3, microbatches=6, empty=1, real_tokens=500)
        >>> combined_shares([lane, lane]).microbatches
        12
    """
    return SharePrefix(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(SharePrefix)})


@dataclass(frozen=True, kw_only=True, slots=True)
class LockStepPrefix:
    """The shares of a prefix trained in lock step: each rank runs the most steps of any rank.

    Args:
        shares: each rank's :class:`SharePrefix`, in rank order.
        accumulate_grad_batches: microbatches per rank per optimizer step.
        max_tokens: the budget of a microbatch (the efficiency's denominator).

    Example:
        >>> shares = [SharePrefix(samples=9, steps=3, microbatches=6, empty=1, real_tokens=500),
        ...           SharePrefix(samples=6, steps=2, microbatches=4, empty=0, real_tokens=380)]
        >>> prefix = LockStepPrefix(shares=tuple(shares), accumulate_grad_batches=2, max_tokens=100)
        >>> prefix.microbatches_per_rank, prefix.empty_per_rank, round(prefix.efficiency, 4)
        (6, [1, 2], 0.7333)
    """

    shares: tuple[SharePrefix, ...]
    accumulate_grad_batches: int
    max_tokens: int

    @property
    def microbatches_per_rank(self) -> int:
        """Microbatches every rank runs: the most steps of any share, each of ``accumulate_grad_batches``."""
        return max((share.steps for share in self.shares), default=0) * self.accumulate_grad_batches

    @property
    def empty_per_rank(self) -> list[int]:
        """Each rank's microbatches without a sample: its windows' empty ones and its lock-step fillers."""
        total = self.microbatches_per_rank
        return [share.empty + total - share.microbatches for share in self.shares]

    @property
    def efficiency(self) -> float:
        """``real tokens / (microbatches over all ranks x max_tokens)``: empty microbatches count as waste."""
        slots = self.microbatches_per_rank * len(self.shares) * self.max_tokens
        return sum(share.real_tokens for share in self.shares) / slots if slots else 0.0


def plan_share_prefix(
    samples: Iterator[Mapping[str, Any]],
    *,
    config: PlanConfig,
    window_size: int,
    counter: OverlongCounter | None,
    document_multiple: int,
) -> SharePrefix:
    """Plan one share's prefix in windows (``config`` plans one rank, as the loader of a rank's share does)."""
    steps = microbatches = empty = real = kept = 0
    for window in stream_windows(
        samples,
        config=config,
        window_size=window_size,
        epoch=0,
        counter=counter,
        document_multiple=document_multiple,
    ):
        stats = window.plan.stats
        steps += window.plan.num_steps
        microbatches += window.plan.microbatches_per_rank
        empty += stats.num_empty_microbatches
        real += stats.real_tokens
        kept += stats.num_samples
    return SharePrefix(samples=kept, steps=steps, microbatches=microbatches, empty=empty, real_tokens=real)


def prefix_lengths(
    samples: Iterable[Mapping[str, Any]], counter: OverlongCounter | None
) -> tuple[np.ndarray, np.ndarray, OverlongReport | None]:
    """Lengths and loss tokens of ``samples`` under the over-long policy (samples numbered in their order), and the
    policy's counts (``None`` without a ``counter``).

    Example:
        >>> counter = OverlongCounter(policy="drop", max_tokens=3)
        >>> lengths, loss, report = prefix_lengths([{"input_ids": [1, 2]}, {"input_ids": [1] * 5}], counter)
        >>> lengths.tolist(), loss.tolist(), report.num_dropped
        ([2], [1], 1)
    """
    lengths, loss = [], []
    for number, sample in enumerate(samples):
        for kept in [sample] if counter is None else counter.pieces(number, sample):
            lengths.append(len(kept["input_ids"]))
            loss.append(sample_loss_tokens(kept))
    report = None if counter is None else counter.report()
    return np.array(lengths, dtype=np.int64), np.array(loss, dtype=np.int64), report
