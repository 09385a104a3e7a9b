"""Exact loss under real DDP: 2 spawned CPU processes on gloo, accumulation 2, packed and dynamic microbatches.

After one optimizer step the (DDP-averaged) gradient equals the gradient of one big padded batch of every sample
of the step with a token-mean loss. Rank 1 ends on a zero-weight dummy filler, as a lock-step plan produces.
The normalisation does not depend on the model, so the HF model's exactness is tested in one process
(tests/model/test_exact_loss.py); each spawned case costs ~40 s of the suite's budget on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule

from tests._limits import TEST_TIMEOUT_S
from tests.model.test_exact_loss import (
    assert_gradients_match,
    make_module,
    make_samples,
    reference_gradients,
    spawned_step_trainer,
    step_batches,
)

GROUPS = [[[0, 1, 2], [3, 4, 5, 6]], [[7, 8, 9, 10, 11, 12, 13], []]]  # 2 ranks x 2 microbatches


class PerRankBatches(LightningDataModule):
    """Hands each rank its own list of prepared microbatches."""

    def __init__(self, batches: list[list[dict[str, Any]]]) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.batches[self.trainer.global_rank], batch_size=None)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("kind", "mode"), [("reference", "packed"), ("reference", "dynamic")])
def test_ddp_step_equals_the_big_padded_batch(kind: str, mode: str, tmp_path: Path) -> None:
    samples = make_samples(count=14, seed=3)
    module = make_module(kind)
    expected = reference_gradients(module, samples)
    batches = step_batches(samples, GROUPS, mode)
    path = tmp_path / "grads.pt"
    trainer = spawned_step_trainer(2, str(path))
    trainer.fit(module, datamodule=PerRankBatches(batches))
    assert_gradients_match(torch.load(path), expected, rtol=1e-5)
