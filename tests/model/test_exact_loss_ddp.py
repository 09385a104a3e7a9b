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
import torch.multiprocessing as mp
from lightning.pytorch import LightningDataModule

from tests._limits import TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
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


CASES = [("reference", "packed"), ("reference", "dynamic")]


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Every case on one pair of ranks, one Trainer after the other: rank 0's gradients to ``{kind}-{mode}.pt``."""
    join_ranks(rank, 2, port)
    samples = make_samples(count=14, seed=3)
    for kind, mode in CASES:
        trainer = spawned_step_trainer(2, str(Path(out_dir, f"{kind}-{mode}.pt")), start_method="popen")
        trainer.fit(make_module(kind), datamodule=PerRankBatches(step_batches(samples, GROUPS, mode)))


@pytest.fixture(scope="module")
def ddp_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of every case's gradients (one spawned pair of ranks for all the cases)."""
    out = tmp_path_factory.mktemp("exact_loss_ddp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return out


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_ddp_step_equals_the_big_padded_batch(kind: str, mode: str, ddp_steps: Path) -> None:
    expected = reference_gradients(make_module(kind), make_samples(count=14, seed=3))  # the ranks' initial weights
    assert_gradients_match(torch.load(ddp_steps / f"{kind}-{mode}.pt"), expected, rtol=1e-5)
