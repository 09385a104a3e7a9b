"""Windows and run totals of the packing metrics: the bookkeeping behind :class:`~lit_seqpack.PackingMonitor`.

Lightning-free so it can be tested alone and reused in a custom loop. The microbatches of an optimizer step update
the window metrics when the step closes (no device sync), so a window only ever holds whole steps;
:meth:`PackingTracker.flush` (a collective: every rank must call it) reduces the window over ranks, returns its
values, folds its reduced sums into :class:`RunTotals` and starts a new window. Run totals are therefore identical
on every rank and exact across windows; :meth:`PackingTracker.snapshot` (a collective too) adds the open window to
them without closing it, which is what a checkpoint needs (written by rank 0, loaded by all; a checkpoint taken
inside an accumulation window leaves out that step's microbatches, which the resumed run trains again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_seqpack.metrics.counts import BatchCounts, TokenKind, batch_counts
from lit_seqpack.metrics.functional import packing_summary, padding_ratio, tokens_per_second
from lit_seqpack.metrics.packing import (
    PackingEfficiency,
    PaddingRatio,
    RankImbalance,
    TokensPerSecond,
    imbalance_per_step,
)

__all__ = ["PackingTracker", "RunTotals"]


@dataclass(kw_only=True, slots=True)
class RunTotals:
    """Sums over ranks and windows of everything the metrics need (one window, or a whole run).

    Args:
        real_tokens: document tokens (also the bins' total fill).
        padding_tokens: padding tokens.
        elapsed: seconds; per window the slowest rank's, summed over consecutive windows.
        num_bins: microbatches.
        fill_sq_sum: sum of the squared real tokens of each microbatch.
        capacity_sum: sum of the microbatches' capacities.
        max_capacity: the largest capacity.
        steps: optimizer steps with a rank-imbalance value.
        imbalance_sum: sum of the per-step imbalances.
        imbalance_max: the largest per-step imbalance (0.0 before any step).
    """

    real_tokens: int = 0
    padding_tokens: int = 0
    elapsed: float = 0.0
    num_bins: int = 0
    fill_sq_sum: int = 0
    capacity_sum: int = 0
    max_capacity: int = 0
    steps: int = 0
    imbalance_sum: float = 0.0
    imbalance_max: float = 0.0

    def add(self, other: RunTotals) -> None:
        """Fold a later window into these totals."""
        for field in fields(self):
            name = field.name
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, max(mine, theirs) if name in ("max_capacity", "imbalance_max") else mine + theirs)

    def values(self) -> dict[str, float]:
        """Every metric of these totals, keyed as the monitor logs them."""
        computed = self.real_tokens + self.padding_tokens
        packing = packing_summary(
            num_bins=self.num_bins,
            fill_sum=self.real_tokens,
            fill_sq_sum=self.fill_sq_sum,
            capacity_sum=self.capacity_sum,
            max_capacity=self.max_capacity,
        )
        return {
            "padding_ratio": padding_ratio(self.padding_tokens, computed),
            "tokens_per_sec": tokens_per_second(self.real_tokens, self.elapsed),
            "computed_tokens_per_sec": tokens_per_second(computed, self.elapsed),
            **packing,
            "rank_imbalance": self.imbalance_sum / self.steps if self.steps else 1.0,
            "rank_imbalance_max": self.imbalance_max if self.steps else 1.0,
            "real_tokens": float(self.real_tokens),
            "padding_tokens": float(self.padding_tokens),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers, for a checkpoint."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RunTotals:
        """Rebuild from :meth:`state_dict`; unknown keys raise ``ValueError``."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"unknown RunTotals keys in the checkpoint: {unknown}")
        return cls(**dict(state))


def _reduced_state(metric: Metric) -> dict[str, Tensor]:
    """The metric's states reduced over ranks (a collective when distributed); its local states stay as they were."""
    with metric.sync_context():
        state = metric.metric_state
        return {
            name: (torch.cat(value) if value else torch.zeros(0)) if isinstance(value, list) else value
            for name, value in state.items()
        }


class PackingTracker:
    """The four metrics over a window of microbatches, and the run totals of the flushed windows.

    Args:
        imbalance_tokens: which tokens :class:`RankImbalance` balances (``"real"`` or ``"computed"``).

    Example:
        >>> tracker = PackingTracker()
        >>> _ = tracker.update({"num_real_tokens": 14, "num_padding_tokens": 2, "max_tokens": 16})
        >>> _ = tracker.update({"num_real_tokens": 0, "num_padding_tokens": 16, "max_tokens": 16})
        >>> window = tracker.flush(elapsed=2.0)
        >>> window["padding_ratio"], window["tokens_per_sec"], window["packing_efficiency"]
        (0.5625, 7.0, 0.5)
    """

    def __init__(self, *, imbalance_tokens: TokenKind = "real") -> None:
        self.padding = PaddingRatio()
        self.throughput = TokensPerSecond(tokens="real")
        self.packing = PackingEfficiency()
        self.imbalance = RankImbalance(tokens=imbalance_tokens)
        self.totals = RunTotals()
        self.last_window = RunTotals()
        """The last flushed window, reduced over ranks (its ``elapsed`` is the slowest rank's)."""
        self._open_step: list[tuple[BatchCounts, bool]] = []

    @property
    def metrics(self) -> tuple[Metric, ...]:
        """The window metrics."""
        return (self.padding, self.throughput, self.packing, self.imbalance)

    def to(self, device: torch.device | str) -> PackingTracker:
        """Move the metric states to ``device`` (the strategy's root device, so that syncing works)."""
        for metric in self.metrics:
            metric.to(device)
        return self

    def update(
        self, batch: Mapping[str, Any] | BatchCounts, *, step_end: bool = True, replica: bool = False
    ) -> BatchCounts:
        """Add one microbatch; ``step_end`` closes the optimizer step it belongs to. Returns its counts.

        The window metrics see the microbatch when its step closes (:meth:`end_step`).

        Args:
            batch: the microbatch (or its counts).
            step_end: the microbatch closes its optimizer step.
            replica: another rank holds and counts the same microbatch (a tensor-parallel rank other than 0):
                it enters the rank balance only, so that token sums over ranks count every row once.
        """
        counts = batch_counts(batch)
        self._open_step.append((counts, replica))
        if step_end:
            self.end_step()
        return counts

    def end_step(self) -> None:
        """Close the open optimizer step, if any microbatch was added since the last one: the window counts it."""
        if not self._open_step:
            return
        step = None
        for counts, replica in self._open_step:
            if not replica:
                self.padding.update(counts)
                self.throughput.update(counts)
                self.packing.update(counts)
            step = counts if step is None else step + counts
        self.imbalance.update(step)
        self._open_step = []

    def add_elapsed(self, seconds: float) -> None:
        """Add seconds this rank spent in the open window (what :meth:`flush` adds too)."""
        self.throughput.update(elapsed=seconds)

    def snapshot(self) -> RunTotals:
        """The run totals with the open window's whole steps added, the window left open (a collective).

        What a checkpoint saves: a run restored from it continues the totals exactly where this one stands.
        """
        totals = RunTotals(**self.totals.state_dict())
        totals.add(self._window())
        return totals

    def _window(self) -> RunTotals:
        """The open window reduced over ranks (a collective), as totals."""
        padding = _reduced_state(self.padding)
        packing = _reduced_state(self.packing)
        imbalance = _reduced_state(self.imbalance)
        per_step = imbalance_per_step(imbalance["step_tokens"], imbalance["step_ranks"])
        return RunTotals(
            real_tokens=int(padding["real_tokens"]),
            padding_tokens=int(padding["padding_tokens"]),
            elapsed=float(_reduced_state(self.throughput)["elapsed"]),
            num_bins=int(packing["num_bins"]),
            fill_sq_sum=int(packing["fill_sq_sum"]),
            capacity_sum=int(packing["capacity_sum"]),
            max_capacity=int(packing["max_capacity"]),
            steps=len(per_step),
            imbalance_sum=sum(per_step),
            imbalance_max=max(per_step, default=0.0),
        )

    def flush(self, elapsed: float) -> dict[str, float]:
        """Close the window (a collective): reduce it over ranks, fold it into the totals, start a new one.

        Microbatches of a step that is still open stay out of the window (they join the next one).

        Args:
            elapsed: seconds this rank spent in the window (the slowest rank's counts).

        Returns:
            The window's rates and ratios, with ``real_tokens`` and ``padding_tokens`` cumulative (run totals).
        """
        self.add_elapsed(elapsed)
        window = self._window()
        for metric in self.metrics:
            metric.reset()
        self.totals.add(window)
        self.last_window = window
        return window.values() | {
            "real_tokens": float(self.totals.real_tokens),
            "padding_tokens": float(self.totals.padding_tokens),
        }

    def reset(self) -> None:
        """Drop the window and the totals (a new run, or a new evaluation epoch)."""
        for metric in self.metrics:
            metric.reset()
        self.totals = RunTotals()
        self._open_step = []
