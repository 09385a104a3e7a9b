"""Multi-process checks of the samplers on CPU (gloo): plain torch.distributed, then a Lightning DDP fit."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_seqpack.batch import Microbatch
from lit_seqpack.data import PlannedDataset
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests._samplers import planned_sampler

WORLD = 2
LENGTHS = np.random.default_rng(7).integers(1, 200, 120).tolist()


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Both checks on one pair of ranks: the samplers under plain ``torch.distributed`` (``gloo{rank}.json``), then a
    Lightning DDP fit in the same process group (``rank{rank}.json``, written by :class:`RecordingModule`)."""
    join_ranks(rank, WORLD, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        _samplers(rank, out_dir)
        _fit(out_dir)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_worker`'s results (one spawned pair of ranks for both tests)."""
    out = tmp_path_factory.mktemp("samplers_ddp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return out


def _samplers(rank: int, out_dir: str) -> None:
    """Each sampler's microbatches gathered over the ranks, and a rank with other settings."""
    outcome: dict[str, object] = {}
    samplers = {
        "packing": planned_sampler("packing", LENGTHS, max_tokens=256, accumulate_grad_batches=2),
        "dynamic": planned_sampler("dynamic", LENGTHS, max_tokens=256, accumulate_grad_batches=3),
        "padded": planned_sampler("padded", LENGTHS, batch_size=7, accumulate_grad_batches=2),
    }
    for mode, sampler in samplers.items():
        assert (sampler.config.world_size, sampler.rank) == (WORLD, rank)  # resolved from torch.distributed
        sampler.check_plan()
        mine = [list(mb) for mb in sampler]
        everyone: list[list[list[int]] | None] = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        outcome[mode] = {
            "counts": [len(b) for b in everyone],
            "indices": sorted(i for b in everyone for mb in b for i in mb),
        }
    # a rank with different settings: every rank must fail loudly instead of hanging or training on garbage
    odd = planned_sampler("packing", LENGTHS, max_tokens=256, seed=rank)
    try:
        odd.check_plan()  # in the main process before iterating (the batch sampler's __iter__ never talks to ranks)
        outcome["mismatch"] = "no error"
    except RuntimeError as err:
        outcome["mismatch"] = str(err)
    Path(out_dir, f"gloo{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_samplers_under_torch_distributed(runs: Path) -> None:
    for rank in range(WORLD):
        outcome = json.loads((runs / f"gloo{rank}.json").read_text())
        for mode in ("packing", "dynamic", "padded"):
            assert len(set(outcome[mode]["counts"])) == 1
            assert outcome[mode]["indices"] == list(range(len(LENGTHS)))
        assert "computed a different plan" in outcome["mismatch"]


def _collate(samples: Microbatch) -> dict[str, list[int] | int]:
    # plain values only: Lightning's batch_to_device refuses frozen dataclasses such as MicrobatchMeta
    return {"indices": list(samples), "step": samples.meta.step}


class RecordingModule(L.LightningModule):
    """Trains a single weight on nothing; records the indices and plan step of every microbatch it sees."""

    def __init__(self, out_dir: str, accumulate: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.out_dir, self.accumulate = out_dir, accumulate
        self.seen: list[dict] = []

    def train_dataloader(self) -> StatefulDataLoader:
        # the world size and rank from the process group Lightning set up
        sampler = planned_sampler("packing", LENGTHS, max_tokens=256, accumulate_grad_batches=self.accumulate, seed=3)
        dataset = PlannedDataset(list(range(len(LENGTHS))))
        return StatefulDataLoader(dataset, batch_sampler=sampler, collate_fn=_collate)

    def training_step(self, batch: dict[str, list[int] | int], batch_idx: int) -> torch.Tensor:
        indices = batch["indices"]
        self.seen.append({"epoch": self.current_epoch, "indices": indices, "step": batch["step"]})
        return (self.weight * (float(len(indices)) - 1.0)).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))


ACCUMULATE, EPOCHS = 2, 2


def _fit(out_dir: str) -> None:
    """A Lightning DDP fit of :class:`RecordingModule` (``EPOCHS`` epochs, accumulation ``ACCUMULATE``)."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT),
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RecordingModule(out_dir, ACCUMULATE))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_lightning_ddp_fit_sees_every_sample_once_per_epoch(runs: Path) -> None:
    seen = [json.loads((runs / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for epoch in range(EPOCHS):
        per_rank = [[rec for rec in records if rec["epoch"] == epoch] for records in seen]
        assert len({len(records) for records in per_rank}) == 1  # lock-step: no hang, same count
        assert len(per_rank[0]) % ACCUMULATE == 0
        assert [rec["step"] for rec in per_rank[0]] == [rec["step"] for rec in per_rank[1]]
        indices = Counter(i for records in per_rank for rec in records for i in rec["indices"])
        assert indices == Counter(range(len(LENGTHS)))  # every sample exactly once per epoch
    # Lightning's set_epoch reached the batch sampler: the second epoch is planned differently
    for records in seen:
        orders = [[rec["indices"] for rec in records if rec["epoch"] == e] for e in range(EPOCHS)]
        assert orders[0] != orders[1]
