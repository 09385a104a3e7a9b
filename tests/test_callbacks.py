"""PackingMonitor in a real Trainer: logged CSV columns, progress bar, end-of-fit summary, eval loops, resume."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lit_seqpack import PackingMonitor
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`.*"),
]

VOCAB = 32
SECONDS_PER_STEP = 0.5


class FakeClock:
    """A clock that only the model advances: each training step "takes" SECONDS_PER_STEP."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _scalars(real: int, padding: int, loss: int, docs: int, max_tokens: int | None, empty: bool = False) -> dict:
    return {
        "num_documents": docs,
        "num_real_tokens": real,
        "num_padding_tokens": padding,
        "num_loss_tokens": loss,
        "step_loss_tokens": loss,
        "world_size": 1,
        "accumulate_grad_batches": 1,
        "max_tokens": max_tokens,
        "is_empty": empty,
    }


def packed_batch(lengths: list[int], total: int, max_tokens: int, seed: int = 0) -> dict:
    """One packed row in the batch contract: documents back to back, then a padding tail of its own segment."""
    ids = torch.cat([_ids(n, seed + i) for i, n in enumerate(lengths)] + [torch.zeros(total - sum(lengths))]).long()
    labels, positions, bounds = ids.clone(), [], [0]
    for n in lengths:
        labels[bounds[-1]] = -100
        positions.append(torch.arange(n))
        bounds.append(bounds[-1] + n)
    labels[bounds[-1] :] = -100
    if bounds[-1] < total:
        positions.append(torch.arange(total - bounds[-1]))
        bounds.append(total)
    return {
        "input_ids": ids[None],
        "labels": labels[None],
        "position_ids": torch.cat(positions)[None],
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": max(b - a for a, b in zip(bounds, bounds[1:], strict=False)),
        **_scalars(sum(lengths), total - sum(lengths), sum(lengths) - len(lengths), len(lengths), max_tokens),
    }


def empty_batch(total: int, max_tokens: int) -> dict:
    """A lock-step filler: one row of padding, every label -100."""
    return {
        "input_ids": torch.zeros(1, total, dtype=torch.long),
        "labels": torch.full((1, total), -100),
        "position_ids": torch.arange(total)[None],
        "cu_seqlens": torch.tensor([0, total], dtype=torch.int32),
        "max_seqlen": total,
        **_scalars(0, total, 0, 0, max_tokens, empty=True),
    }


def padded_batch(lengths: list[int], width: int, seed: int = 0) -> dict:
    """A right-padded [B, L] batch in the contract (no cu_seqlens)."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = _ids(n, seed + row), 1
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, 0] = -100
    real = sum(lengths)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": torch.arange(width).expand(len(lengths), width),
        **_scalars(real, len(lengths) * width - real, real - len(lengths), len(lengths), None),
    }


# 16-token budget: fills 14, 10, 0 (dummy of 8 tokens), 16 -> padding 16 of 56 computed, 40 real tokens
PACKED = [
    packed_batch([5, 9], 16, 16, seed=1),
    packed_batch([10], 16, 16, seed=2),
    empty_batch(8, 16),
    packed_batch([4, 4, 8], 16, 16, seed=3),
]
# the same documents, padded to the longest of each batch
PADDED = [padded_batch([5, 9], 9, 1), padded_batch([10], 10, 2), padded_batch([4, 4, 8], 8, 3)]


class TinyModule(LightningModule):
    """A few parameters; consumes contract batches and logs train/loss; advances the fake clock per step."""

    def __init__(self, clock: FakeClock | None = None, val_seconds: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)
        self.clock = clock
        self.val_seconds = val_seconds
        self.trained: list[tuple[int, int]] = []
        self.losses: list[float] = []

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        if batch["is_empty"]:
            return logits.sum() * 0.0
        targets = batch["labels"][:, 1:].flatten()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets, ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock.now += SECONDS_PER_STEP
        self.trained.append((batch["num_real_tokens"], batch["num_padding_tokens"]))
        loss = self._loss(batch)
        self.losses.append(loss.item())
        self.log("train/loss", loss, batch_size=1)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if self.clock is not None:
            self.clock.now += self.val_seconds
        self.log("val/loss", self._loss(batch), batch_size=1)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if self.clock is not None:
            self.clock.now += self.val_seconds
        self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def loader(batches: list[dict]) -> DataLoader:
    return DataLoader(batches, batch_size=None)


def trainer(tmp_path: Path, monitor: PackingMonitor, **kwargs) -> Trainer:
    options = {
        "max_steps": 8,
        "log_every_n_steps": 4,
        "logger": CSVLogger(tmp_path),
        "callbacks": [monitor],
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "num_sanity_val_steps": 0,
    }
    return Trainer(**(options | kwargs))


def read_rows(trainer: Trainer | Path, key: str) -> list[dict[str, float]]:
    """The logged rows holding ``key``, from a Trainer's CSV logger or from its log folder."""
    log_dir = trainer if isinstance(trainer, Path) else Path(trainer.logger.log_dir)
    with open(log_dir / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get(key)]
    return [{k: float(v) for k, v in row.items() if v != ""} for row in rows]


def test_packed_run_logs_exact_values_progress_bar_and_summary(tmp_path, caplog):
    clock = FakeClock()
    monitor = PackingMonitor(clock=clock, loss_window=1)
    fit, model = trainer(tmp_path, monitor), TinyModule(clock)
    with caplog.at_level(logging.INFO):
        fit.fit(model, loader(PACKED))
    rows = read_rows(fit, "train/padding_ratio")
    assert [row["step"] for row in rows] == [3, 7]
    for window, row in enumerate(rows, start=1):
        assert row["train/padding_ratio"] == pytest.approx(16 / 56)
        # 40 real (56 computed) tokens in 4 steps of 0.5 s on the fake clock
        assert row["train/tokens_per_sec"] == pytest.approx(40 / 2.0)
        assert row["train/computed_tokens_per_sec"] == pytest.approx(56 / 2.0)
        assert row["train/packing_efficiency"] == pytest.approx(3 / 4)
        assert row["train/bin_utilization"] == pytest.approx(40 / 64)
        assert row["train/waste_ratio"] == pytest.approx(24 / 64)
        assert row["train/bin_balance"] == pytest.approx(1 - math.sqrt(38) / 10, rel=1e-6)
        assert row["train/rank_imbalance"] == 1.0 and row["train/rank_imbalance_max"] == 1.0
        assert row["train/real_tokens"] == 40 * window and row["train/padding_tokens"] == 16 * window
    progress = fit.progress_bar_metrics
    assert progress["train/tokens_per_sec"] == pytest.approx(20.0)
    assert progress["train/padding_ratio"] == pytest.approx(16 / 56)
    assert "train/packing_efficiency" not in progress
    summary = [r.getMessage() for r in caplog.records if "PackingMonitor summary" in r.getMessage()]
    assert len(summary) == 1
    text = summary[0]
    assert "real tokens        80" in text and "padding tokens     32" in text and "28.57%" in text
    assert "20.0 real, 28.0 computed over 4.00 s" in text and "packing efficiency 0.6250" in text
    # the loss of the first and of the last logging step (batches 3 and 7), not of the first microbatch
    assert f"train/loss         {model.losses[3]:.4f} -> {model.losses[7]:.4f} (the first and the last of 2 " in text
    # over the run: ceil(80 / 16) = 5 bins would hold the 80 real tokens, 8 were trained
    assert monitor.last_summary["packing_efficiency"] == pytest.approx(5 / 8)


def test_padded_batches_report_their_padding_comparably(tmp_path):
    clock = FakeClock()
    fit = trainer(tmp_path, PackingMonitor(clock=clock), max_steps=3, log_every_n_steps=3)
    fit.fit(TinyModule(clock), loader(PADDED))
    (row,) = read_rows(fit, "train/padding_ratio")
    # rows padded to 9, 10 and 8 tokens: 4 + 0 + 8 = 12 padding of 18 + 10 + 24 = 52 computed tokens
    assert row["train/padding_ratio"] == pytest.approx(12 / 52)
    assert row["train/tokens_per_sec"] == pytest.approx(40 / 1.5)
    # no budget in a padded batch: each batch's capacity is its computed tokens, the largest 24
    assert row["train/bin_utilization"] == pytest.approx(40 / 52)
    assert row["train/packing_efficiency"] == pytest.approx(2 / 3)
    packed = trainer(tmp_path / "packed", PackingMonitor(clock=clock), max_steps=3, log_every_n_steps=3)
    packed.fit(TinyModule(clock), loader([PACKED[0], PACKED[1], PACKED[3]]))
    (packed_row,) = read_rows(packed, "train/padding_ratio")
    assert packed_row["train/padding_ratio"] == pytest.approx(8 / 48)  # the same documents, packed


def test_gradient_accumulation_logs_after_optimizer_steps_only(tmp_path):
    clock = FakeClock()
    monitor = PackingMonitor(clock=clock)
    fit = trainer(tmp_path, monitor, max_steps=4, log_every_n_steps=2, accumulate_grad_batches=2)
    fit.fit(TinyModule(clock), loader(PACKED))
    rows = read_rows(fit, "train/padding_ratio")
    assert len(rows) == 2
    for row in rows:  # each window: 2 optimizer steps of 2 microbatches = the 4 batches, 2 s
        assert row["train/padding_ratio"] == pytest.approx(16 / 56)
        assert row["train/tokens_per_sec"] == pytest.approx(20.0)
    assert monitor.trackers["train"].totals.steps == 4
    assert monitor.trackers["train"].totals.num_bins == 8


def test_validation_and_test_get_the_same_metrics_and_do_not_slow_training(tmp_path):
    clock = FakeClock()
    model = TinyModule(clock, val_seconds=10.0)
    fit = trainer(tmp_path, PackingMonitor(clock=clock))
    fit.fit(model, loader(PACKED), loader(PACKED))
    for row in read_rows(fit, "train/padding_ratio"):
        assert row["train/tokens_per_sec"] == pytest.approx(20.0)  # the validation's 40 s are not training time
    val_rows = read_rows(fit, "val/padding_ratio")
    assert len(val_rows) == 2  # one validation per epoch of 4 batches
    for row in val_rows:
        assert row["val/padding_ratio"] == pytest.approx(16 / 56)
        assert row["val/tokens_per_sec"] == pytest.approx(40 / 40.0)
        assert row["val/packing_efficiency"] == pytest.approx(3 / 4)
        assert row["val/real_tokens"] == 40
    fit.test(model, loader(PADDED))
    (test_row,) = read_rows(fit, "test/padding_ratio")
    assert test_row["test/padding_ratio"] == pytest.approx(12 / 52)
    assert test_row["test/tokens_per_sec"] == pytest.approx(40 / 30.0)


def test_totals_survive_a_resume(tmp_path):
    clock = FakeClock()
    monitor = PackingMonitor(clock=clock)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = trainer(tmp_path, monitor, max_steps=4, enable_checkpointing=True, callbacks=[monitor, checkpoint])
    first.fit(TinyModule(clock), loader(PACKED))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    state = saved["callbacks"][monitor.state_key]
    assert state["totals"]["real_tokens"] == 40 and state["totals"]["elapsed"] == pytest.approx(2.0)
    resumed_monitor, model = PackingMonitor(clock=clock), TinyModule(clock)
    resumed = trainer(tmp_path / "resumed", resumed_monitor, max_steps=8)
    resumed.fit(model, loader(PACKED), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    # Lightning decides which batches a resumed plain DataLoader yields; the totals add what was trained
    assert len(model.trained) == 4
    real, padding = (sum(counts) for counts in zip(*model.trained, strict=True))
    summary = resumed_monitor.last_summary
    assert summary["real_tokens"] == 40 + real and summary["padding_tokens"] == 16 + padding
    assert summary["tokens_per_sec"] == pytest.approx((40 + real) / 4.0)


def _packed_fit(tmp_path: Path, max_steps: int, ckpt_path: Path | None = None) -> PackingMonitor:
    """A tiny ReferenceLM on SeqPackDataModule (exact mid-epoch resume), 2 microbatches a step, logs every 3 steps."""
    from lit_seqpack import ReferenceLM, SeqPackDataModule
    from lit_seqpack.data.sources import SyntheticInstructionDataset

    source = SyntheticInstructionDataset(num_samples=160, vocab_size=40, median_length=20, max_length=60)
    data = SeqPackDataModule(source=source, max_tokens=64, seed=0)
    seed_everything(0)
    size = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "n_embd": 16, "intermediate_size": 32, "max_seq_len": 64}
    model = ReferenceLM(vocab_size=40, lr_schedule="constant", **size)  # the same steps whatever max_steps
    monitor = PackingMonitor(loss_window=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True)
    fit = trainer(
        tmp_path,
        monitor,
        max_steps=max_steps,
        log_every_n_steps=3,
        accumulate_grad_batches=2,
        callbacks=[monitor, checkpoint],
        enable_checkpointing=True,
        enable_progress_bar=False,
        use_distributed_sampler=False,
    )
    fit.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return monitor


_TIME_KEYS = ("tokens_per_sec", "computed_tokens_per_sec")


def test_a_resumed_run_ends_with_the_totals_and_losses_of_an_uninterrupted_one(tmp_path):
    """The checkpoint at step 5 lies between the log steps 3 and 6: the totals include steps 4 and 5."""
    whole = _packed_fit(tmp_path / "whole", max_steps=9)
    _packed_fit(tmp_path / "first", max_steps=5)
    resumed = _packed_fit(tmp_path / "resumed", max_steps=9, ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt")
    expected = {k: v for k, v in whole.last_summary.items() if k not in _TIME_KEYS}
    assert {k: v for k, v in resumed.last_summary.items() if k not in _TIME_KEYS} == expected
    assert expected["real_tokens"] > 0
    assert resumed._losses.state_dict() == whole._losses.state_dict()  # the logged losses at steps 3, 6 and 9
    assert whole._losses.count == 3


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="tokens=.all. must be one of"):
        PackingMonitor(imbalance_tokens="all")
    with pytest.raises(ValueError, match="clock"):
        PackingMonitor(clock=3.0)


class RankModule(TinyModule):
    """Each rank trains (and validates) its own batches and runs at its own fake speed."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, val_seconds=1.0)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.clock.now += SECONDS_PER_STEP * self.global_rank  # rank 1 is twice as slow as rank 0
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return loader(PACKED if self.global_rank == 0 else [packed_batch([16], 16, 16, seed=9)] * 4)

    def val_dataloader(self) -> DataLoader:
        return loader(PACKED if self.global_rank == 0 else PACKED[:2] * 2)


def _ddp(**kwargs) -> dict:
    """The Trainer arguments of a 2-rank DDP fit in a process that already is one of the ranks."""
    strategy = DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return {"strategy": strategy, "devices": 2, "use_distributed_sampler": False, "enable_progress_bar": False} | kwargs


def _ranks_worker(rank: int, port: int, out_dir: str) -> None:
    """Both 2-rank fits on one pair of ranks, one after the other: ``aggregate/`` logs every 4 steps (CSV, version
    0), ``checkpoint/`` saves the monitor's state at step 3 (``ckpt/step3.ckpt``)."""
    join_ranks(rank, 2, port)
    out = Path(out_dir)
    seed_everything(0, verbose=False)  # the same weights on both ranks, as ddp_spawn's copies of one module
    clock = FakeClock()
    logger = CSVLogger(out / "aggregate", version=0)
    trainer(out / "aggregate", PackingMonitor(clock=clock), **_ddp(max_steps=4, logger=logger)).fit(RankModule(clock))
    seed_everything(0, verbose=False)
    monitor = PackingMonitor(clock=FakeClock())
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", filename="step3", every_n_train_steps=3)
    options = _ddp(max_steps=4, callbacks=[monitor, checkpoint], enable_checkpointing=True)
    trainer(out / "checkpoint", monitor, **options).fit(RankModule(FakeClock()))


@pytest.fixture(scope="module")
def ranks_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_ranks_worker`'s fits (one spawned pair of ranks for both tests)."""
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_ranks_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return out


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_ranks_log_the_true_aggregate(ranks_runs: Path) -> None:
    logged = ranks_runs / "aggregate" / "lightning_logs" / "version_0"
    (row,) = read_rows(logged, "train/padding_ratio")
    # rank 0: 40 real / 56 computed tokens in 4 x 0.5 s; rank 1: 64 real / 64 computed in 4 x 1.0 s
    assert row["train/tokens_per_sec"] == pytest.approx((40 + 64) / 4.0)  # rank 0 x 2 would say 40
    assert row["train/computed_tokens_per_sec"] == pytest.approx((56 + 64) / 4.0)
    assert row["train/padding_ratio"] == pytest.approx(16 / 120)
    assert row["train/packing_efficiency"] == pytest.approx(7 / 8)  # ceil(104 / 16) = 7 of 8 bins
    per_step = [16 / 15, 16 / 13, 16 / 8, 16 / 16]  # rank 1's 16 tokens over the mean of each step
    assert row["train/rank_imbalance"] == pytest.approx(sum(per_step) / 4, rel=1e-6)
    assert row["train/rank_imbalance_max"] == pytest.approx(2.0)
    (val,) = read_rows(logged, "val/padding_ratio")
    # rank 0 validates 40 real of 56 tokens, rank 1 48 of 64; 4 batches x 1 s on each rank
    assert val["val/padding_ratio"] == pytest.approx((16 + 16) / 120)
    assert val["val/tokens_per_sec"] == pytest.approx((40 + 48) / 4.0)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_checkpoint_between_log_steps_holds_the_totals_of_both_ranks(ranks_runs: Path) -> None:
    """Saved at step 3 (logs every 4): the state reduces the open window over the ranks (both take part)."""
    state_key = PackingMonitor(clock=FakeClock()).state_key  # the ranks' monitor: the same settings
    saved = torch.load(ranks_runs / "ckpt" / "step3.ckpt", weights_only=False)["callbacks"][state_key]
    totals = saved["totals"]
    # steps 1-3: rank 0 trains 14 + 10 + 0 real tokens (2 + 6 + 8 padding), rank 1 3 x 16 real tokens
    assert (totals["real_tokens"], totals["padding_tokens"], totals["num_bins"], totals["steps"]) == (72, 16, 6, 3)


def test_without_a_mesh_only_tensor_parallel_rank_zero_adds_to_the_token_sums() -> None:
    """lit_seqpack's layout (tensor-parallel innermost) decides which rank holds the counted copy of a row."""
    from types import SimpleNamespace

    from lit_seqpack.callbacks import _is_replica

    def replica(rank: int, batch: dict) -> bool:
        return _is_replica(SimpleNamespace(strategy=None, global_rank=rank), batch)

    assert [replica(r, {"tensor_parallel_size": 2}) for r in range(4)] == [False, True, False, True]
    with_cp = {"tensor_parallel_size": 2, "context_parallel_size": 2}
    assert [replica(r, with_cp) for r in range(8)] == [False, True] * 4
    assert not any(replica(r, {}) for r in range(4))  # no tensor parallelism: every rank counts its own rows
