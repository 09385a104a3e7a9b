"""Token throughput over all ranks: tokens summed over ranks, divided by the slowest rank's elapsed time."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_seqpack.metrics.counts import BatchCounts, TokenKind, batch_counts, check_token_kind
from lit_seqpack.metrics.functional import tokens_per_second

__all__ = ["TokensPerSecond"]


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
