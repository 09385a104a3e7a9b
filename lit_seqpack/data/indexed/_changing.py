"""Datasets whose samples change between epochs (``lengths_change_per_epoch = True``): what they need to be re-planned.

Such a dataset (augmentation, a prompt that grows, a file re-tokenised between epochs) is re-scanned at the start of
every epoch (:meth:`~lit_seqpack.data.indexed.pipeline.IndexedPipeline.train_loader`) and planned again on its new
lengths. The new plan has its own number of microbatches, which Lightning only reads from a rebuilt loader, and the
over-long policy must keep every sample, or the samples trained would change from epoch to epoch.
"""

from __future__ import annotations

from typing import Any

from lit_seqpack.data.sources.protocol import lengths_change_per_epoch

__all__ = ["check_changing_lengths"]


def check_changing_lengths(dataset: Any, *, overlong: str, trainer: Any) -> None:
    """Refuse the settings a dataset that declares ``lengths_change_per_epoch`` cannot be re-planned under.

    Args:
        dataset: the training dataset.
        overlong: the over-long policy (``"drop"`` is refused).
        trainer: the Lightning Trainer (``None``: not checked); its ``reload_dataloaders_every_n_epochs`` must be 1.

    Raises:
        ValueError: naming the setting and the value to use.
    """
    if not lengths_change_per_epoch(dataset):
        return
    name = type(dataset).__name__
    if overlong == "drop":
        raise ValueError(
            f"overlong='drop' cannot be used with {name}, which declares lengths_change_per_epoch=True: the samples "
            "dropped would change from epoch to epoch; use overlong='truncate' or 'error'"
        )
    reload = getattr(trainer, "reload_dataloaders_every_n_epochs", 1)
    if trainer is not None and reload != 1:
        raise ValueError(
            f"{name} declares lengths_change_per_epoch=True, so every epoch is re-planned with its own number of "
            "microbatches, which Lightning only reads from a rebuilt loader: set the Trainer's "
            f"reload_dataloaders_every_n_epochs=1 (got {reload})"
        )
