"""How unevenly the ranks were loaded: max over ranks / mean over ranks of each optimizer step's tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from lit_seqpack.metrics.counts import BatchCounts, TokenKind, batch_counts, check_token_kind
from lit_seqpack.metrics.functional import rank_imbalance_per_step

__all__ = ["RankImbalance", "imbalance_per_step"]

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
