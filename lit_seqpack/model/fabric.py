"""Exact gradient accumulation in a Lightning Fabric loop: the accumulation is declared once and checked.

A Trainer knows ``accumulate_grad_batches`` and the mixin checks every batch against it. A Fabric loop has no such
setting, so the plan (``SeqPackDataModule.attach_fabric`` or a batch sampler's ``accumulate_grad_batches``) and the
loop could disagree silently: a plan made for accumulation 1 and a loop accumulating 2 microbatches gives a
relative gradient error of ~0.35. :class:`FabricAccumulation` is the loop's side::

    accumulation = FabricAccumulation(fabric, accumulate_grad_batches=2)
    datamodule.attach_fabric(fabric, accumulate_grad_batches=accumulation.accumulate_grad_batches)
    for batch in loader:
        loss = model.training_step(batch, 0)             # exact: normalised over the plan's optimizer step
        if accumulation.backward(model, loss, batch):    # checks the batch's plan, skips the sync until the step
            optimizer.step()
            optimizer.zero_grad()

``backward`` divides by the accumulation (as Lightning's loop does), so with the mixin's exact loss the update is
the gradient of the token mean over every microbatch of the optimizer step and every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_seqpack._checks import check_int
from lit_seqpack.model.mixin import check_batch_layout

__all__ = ["FabricAccumulation"]


class FabricAccumulation:
    """The gradient accumulation of a Fabric loop: backward without sync until the step, and a check per batch.

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        accumulate_grad_batches: microbatches per rank per optimizer step.
    """

    def __init__(self, fabric: Any, *, accumulate_grad_batches: int = 1) -> None:
        self.fabric = fabric
        self.accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
        self.microbatches = 0

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``batch`` was planned for this loop's world size, mesh and accumulation."""
        check_batch_layout(
            batch,
            world_size=int(self.fabric.world_size),
            accumulate_grad_batches=self.accumulate_grad_batches,
            strategy=getattr(self.fabric, "strategy", None),
        )

    def backward(self, model: Any, loss: torch.Tensor, batch: Mapping[str, Any]) -> bool:
        """Back-propagate one microbatch's loss; ``True`` when the optimizer should step now.

        Args:
            model: the module returned by ``fabric.setup`` (its gradient sync is skipped until the last microbatch).
            loss: the microbatch's loss (the mixin's ``training_step`` value, exactly normalised over the step).
            batch: the microbatch, checked against the loop's layout.

        Raises:
            ValueError: the batch was planned for another world size, device mesh or accumulation.
        """
        self.check(batch)
        self.microbatches += 1
        last = self.microbatches % self.accumulate_grad_batches == 0
        with self.fabric.no_backward_sync(model, enabled=not last):
            self.fabric.backward(loss / self.accumulate_grad_batches)
        return last
