"""NeMo-RL's packing statistics, measured on the microbatches actually trained.

Share of the computed tokens that were padding, comparable across packed, dynamic and padded batches.

How unevenly the ranks were loaded: max over ranks / mean over ranks of each optimizer step's tokens.

Token throughput over all ranks: tokens summed over ranks, divided by the slowest rank's elapsed time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from lit_seqpack.metrics.counts import BatchCounts, TokenKind, batch_counts, check_token_kind
from lit_seqpack.metrics.functional import packing_summary, padding_ratio, rank_imbalance_per_step, tokens_per_second

__all__ = ["PackingEfficiency", "PaddingRatio", "RankImbalance", "imbalance_per_step", "TokensPerSecond"]


class PaddingRatio(Metric):
    """Padded tokens / computed tokens, summed over batches and ranks.

    A packed row counts its padding tail, a ``[B, L]`` batch its ``B * L - real`` pad positions and an
    empty dummy batch all its tokens, so the ratio of a packed, a dynamic and a padded run compare
    directly: it is the share of the model's token compute that went to nothing.

    ``update(batch)`` takes a batch in the contract (or :class:`~lit_seqpack.metrics.BatchCounts`) and reads
    only its Python scalars: no device sync. ``compute()`` returns a scalar tensor (0.0 before any token).

    Example:
        >>> metric = PaddingRatio()
        >>> metric.update({"num_real_tokens": 14, "num_padding_tokens": 2})
        >>> metric.update({"num_real_tokens": 0, "num_padding_tokens": 8, "is_empty": True})
        >>> round(float(metric.compute()), 4)
        0.4167
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    real_tokens: Tensor
    padding_tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("real_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("padding_tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, batch: Mapping[str, Any] | BatchCounts) -> None:
        """Add one microbatch.

        Args:
            batch: a batch in the contract, or its counts.
        """
        counts = batch_counts(batch)
        self.real_tokens += counts.real_tokens
        self.padding_tokens += counts.padding_tokens

    def compute(self) -> Tensor:
        """Padding tokens / (real + padding tokens)."""
        padding = int(self.padding_tokens)
        value = padding_ratio(padding, padding + int(self.real_tokens))
        return torch.tensor(value, device=self.device)


class PackingEfficiency(Metric):
    """Bin utilisation, waste ratio, bin balance and packing efficiency of the trained microbatches.

    Each microbatch is a bin holding its real tokens, of capacity the plan's ``max_tokens`` (or its
    computed tokens when the batch carries no budget, as in the padded baseline). The formulas are
    NeMo-RL's (see :func:`~lit_seqpack.metrics.functional.packing_summary`). Measured on what was trained
    rather than on the plan, so empty lock-step dummies (bins holding nothing) and tokens lost to
    over-long truncation lower the numbers.

    The fills are kept as exact integer moments (count, sum, sum of squares; ``dist_reduce_fx="sum"``)
    rather than as a list of every fill, so the state stays constant-size over a long run and syncing
    it is cheap; the balance computed from them equals ``stats.bin_balance`` on the fills.

    ``update(batch)`` reads only the batch's Python scalars (no device sync). ``compute()`` returns a
    dict of scalar tensors: ``packing_efficiency``, ``bin_utilization``, ``waste_ratio``, ``bin_balance``
    (``higher_is_better`` refers to ``packing_efficiency``; ``waste_ratio`` is ``1 - bin_utilization``).

    Example:
        >>> metric = PackingEfficiency()
        >>> for real, pad in [(14, 2), (10, 6), (0, 8), (16, 0)]:
        ...     metric.update({"num_real_tokens": real, "num_padding_tokens": pad, "max_tokens": 16})
        >>> {k: round(float(v), 4) for k, v in metric.compute().items()}
        {'packing_efficiency': 0.75, 'bin_utilization': 0.625, 'waste_ratio': 0.375, 'bin_balance': 0.3836}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    num_bins: Tensor
    fill_sum: Tensor
    fill_sq_sum: Tensor
    capacity_sum: Tensor
    max_capacity: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("num_bins", "fill_sum", "fill_sq_sum", "capacity_sum"):
            self.add_state(name, default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("max_capacity", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="max")

    def update(self, batch: Mapping[str, Any] | BatchCounts) -> None:
        """Add one trained microbatch as a bin.

        Args:
            batch: a batch in the contract, or its counts.
        """
        counts = batch_counts(batch)
        self.num_bins += 1
        self.fill_sum += counts.real_tokens
        self.fill_sq_sum += counts.real_tokens * counts.real_tokens
        self.capacity_sum += counts.capacity
        self.max_capacity.clamp_(min=counts.capacity)

    def compute(self) -> dict[str, Tensor]:
        """The four statistics as scalar tensors (a bin-less metric counts as perfect, as in ``stats``)."""
        summary = packing_summary(
            num_bins=int(self.num_bins),
            fill_sum=int(self.fill_sum),
            fill_sq_sum=int(self.fill_sq_sum),
            capacity_sum=int(self.capacity_sum),
            max_capacity=int(self.max_capacity),
        )
        return {key: torch.tensor(value, device=self.device) for key, value in summary.items()}


_Step = Mapping[str, Any] | BatchCounts


def imbalance_per_step(step_tokens: Tensor | list[Tensor], step_ranks: Tensor | list[Tensor]) -> list[float]:
    """The imbalance of each optimizer step from :class:`RankImbalance`'s states (rows of every rank).

    Args:
        step_tokens: tokens of each recorded step, the rows of all ranks concatenated.
        step_ranks: the rank that recorded each row.

    Raises:
        RuntimeError: the ranks recorded different numbers of steps (lock-step broken).

    Example:
        >>> imbalance_per_step(torch.tensor([100.0, 300.0, 300.0, 300.0]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
        [1.5, 1.0]
    """
    if isinstance(step_tokens, list) and not step_tokens:
        return []
    tokens, ranks = dim_zero_cat(step_tokens), dim_zero_cat(step_ranks).long()
    if tokens.numel() == 0:
        return []
    counts = torch.bincount(ranks).tolist()
    if min(counts) != max(counts):
        raise RuntimeError(f"ranks recorded different numbers of optimizer steps: {counts} (lock-step broken)")
    matrix = tokens[torch.argsort(ranks, stable=True)].reshape(len(counts), counts[0])
    return rank_imbalance_per_step(matrix.tolist())


class RankImbalance(Metric):
    """Per optimizer step, the busiest rank's tokens over the ranks' mean; averaged over steps, and the max.

    In data-parallel training every rank waits for the slowest at each optimizer step, so an imbalance of
    1.25 means that the step took about 25% longer than a perfectly balanced one would have. Each rank
    calls ``update`` once per optimizer step with the microbatches it trained in that step; the states
    are lists of (rank, tokens) per step concatenated over ranks (``dist_reduce_fx="cat"``), and
    ``compute`` lines the ranks' steps up. Rows are ``float32`` (exact up to 2**24 tokens a rank a step);
    every rank must have closed the same number of steps (lock-step), otherwise ``compute`` raises.

    ``compute()`` returns a dict of scalar tensors: ``rank_imbalance`` (mean over steps) and
    ``rank_imbalance_max`` (worst step); 1.0 without steps. Single-process, every step is 1.0.

    Args:
        tokens: ``"real"`` (the default) balances document tokens; ``"computed"`` real + padding tokens.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> metric = RankImbalance()
        >>> step = [{"num_real_tokens": 300, "num_padding_tokens": 0}, BatchCounts(real_tokens=100, padding_tokens=4)]
        >>> metric.update(step)
        >>> metric.compute()["rank_imbalance"].item()
        1.0
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    step_tokens: list[Tensor]
    step_ranks: list[Tensor]

    def __init__(self, tokens: TokenKind = "real", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_kind: TokenKind = check_token_kind(tokens)
        self.add_state("step_tokens", default=[], dist_reduce_fx="cat")
        self.add_state("step_ranks", default=[], dist_reduce_fx="cat")

    def _rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group)
        return 0

    def update(self, step: _Step | Sequence[_Step]) -> None:
        """Record one optimizer step of this rank.

        Args:
            step: the microbatches this rank trained in the step (batches in the contract or their counts);
                a single batch is a step of one microbatch.
        """
        batches = [step] if isinstance(step, (Mapping, BatchCounts)) else list(step)
        tokens = sum(batch_counts(batch).tokens(self.token_kind) for batch in batches)
        # torch.full fills on the device: no host-to-device copy, so no sync on an accelerator
        self.step_tokens.append(torch.full((1,), tokens, dtype=self.dtype, device=self.device))
        self.step_ranks.append(torch.full((1,), self._rank(), dtype=self.dtype, device=self.device))

    def compute(self) -> dict[str, Tensor]:
        """Mean and max over steps of the per-step imbalance."""
        values = imbalance_per_step(self.step_tokens, self.step_ranks)
        mean = sum(values) / len(values) if values else 1.0
        worst = max(values) if values else 1.0
        return {
            "rank_imbalance": torch.tensor(mean, device=self.device),
            "rank_imbalance_max": torch.tensor(worst, device=self.device),
        }


class TokensPerSecond(Metric):
    """Real (or computed) tokens per second, aggregated correctly over ranks.

    Tokens are summed over batches and ranks (``dist_reduce_fx="sum"``); ``elapsed`` is a clock reading,
    the seconds from the start of the measurement to the latest update on this rank, and the metric keeps
    the largest one, locally and over ranks (``dist_reduce_fx="max"``), since the ranks run in parallel and
    the slowest sets the pace. Unlike Lightning's ``ThroughputMonitor`` (rank 0's rate times the world size)
    this is right when ranks train different token counts.

    Call ``update(batch)`` for each microbatch and ``update(elapsed=seconds)`` whenever the clock is read
    (both in one call works too); a batch costs no device sync. Because ``elapsed`` is a running clock,
    the batch value that ``forward`` returns is not a rate of that batch alone: use ``update``/``compute``.

    Args:
        tokens: ``"real"`` counts document tokens (the default); ``"computed"`` counts real + padding tokens.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example:
        >>> metric = TokensPerSecond()
        >>> metric.update({"num_real_tokens": 3000, "num_padding_tokens": 96}, elapsed=1.5)
        >>> metric.update({"num_real_tokens": 1000, "num_padding_tokens": 0}, elapsed=2.0)
        >>> float(metric.compute())
        2000.0
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    tokens: Tensor
    elapsed: Tensor

    def __init__(self, tokens: TokenKind = "real", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_kind: TokenKind = check_token_kind(tokens)
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("elapsed", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, batch: Mapping[str, Any] | BatchCounts | None = None, elapsed: float | None = None) -> None:
        """Count a microbatch's tokens and/or read the clock.

        Args:
            batch: a batch in the contract, or its counts.
            elapsed: seconds since the measurement started on this rank (monotonic; the largest is kept).

        Raises:
            ValueError: neither argument is given, or ``elapsed`` is negative or not finite.
        """
        if batch is None and elapsed is None:
            raise ValueError("TokensPerSecond.update needs a batch, elapsed, or both")
        if batch is not None:
            self.tokens += batch_counts(batch).tokens(self.token_kind)
        if elapsed is not None:
            if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed):
                raise ValueError(f"elapsed must be a finite number of seconds, got {elapsed!r}")
            if elapsed < 0:
                raise ValueError(f"elapsed must be >= 0 seconds, got {elapsed!r}")
            self.elapsed.clamp_(min=float(elapsed))

    def compute(self) -> Tensor:
        """Tokens / elapsed seconds (0.0 before the clock was read)."""
        return torch.tensor(tokens_per_second(int(self.tokens), float(self.elapsed)), device=self.device)
