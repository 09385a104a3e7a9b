"""Samples whose lengths differ from the plan's (a prompt that grows per epoch, a stale lengths cache) are refused by
name; a dataset that declares ``lengths_change_per_epoch`` is re-planned every epoch instead."""

from __future__ import annotations

import lightning as L
import pytest

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.model import ReferenceLM


class GrowingPrompt:
    """24 samples: a prompt of ``prompt_length(epoch)`` tokens (never trained) and an answer of 4 tokens."""

    def __init__(self, prompt_lengths: dict[int, int], *, declare: bool = False) -> None:
        self.prompt_lengths, self.epoch = prompt_lengths, 0
        if declare:
            self.lengths_change_per_epoch = True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        prompt = self.prompt_lengths[self.epoch]
        ids = [1 + (index + k) % 30 for k in range(prompt + 4)]
        return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_prompt_that_grows_after_planning_is_refused_naming_the_sample(mode):
    """The campaign's case: rows of 357 tokens packed under max_tokens=64 without an error."""
    data = GrowingPrompt({0: 3, 1: 353})
    dm = SeqPackDataModule(source=data, mode=mode, max_tokens=64, shuffle=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert sum(len(b["cu_seqlens"]) - 1 if mode == "packing" else len(b["input_ids"]) for b in loader) == 24
    data.set_epoch(1)  # the samples grew behind the planned lengths (7 tokens each)
    loader.batch_sampler.set_epoch(1)
    match = r"dataset index \d+\) has 357 tokens but the plan was made with a length of 7: .*lengths_change_per_epoch"
    with pytest.raises(ValueError, match=match):
        list(loader)


class Fingerprinted(list):
    """A list with a fingerprint that does not change with its content (a stale lengths cache's cause)."""

    fingerprint = "my-data-v1"


def test_a_stale_lengths_cache_is_refused_naming_the_changed_sample(tmp_path):
    """Content changed outside the 16 indices the cache check samples, with the same loss tokens: the plan's lengths
    came from the cache, and the collator compares them with each microbatch."""
    samples = Fingerprinted({"input_ids": [5] * 6, "labels": [-100] * 4 + [5, 5]} for _ in range(40))
    SeqPackDataModule(source=samples, max_tokens=256, cache_dir=str(tmp_path)).setup("fit")
    samples[1] = {"input_ids": [5] * 12, "labels": [-100] * 10 + [5, 5]}  # index 1 is not among the sampled 16
    # one row of 240 planned tokens, 246 read: under max_tokens, so only the per-sample check sees it
    dm = SeqPackDataModule(source=samples, max_tokens=256, cache_dir=str(tmp_path), shuffle=False)
    dm.setup("fit")
    match = r"dataset index 1\) has 12 tokens but the plan was made with a length of 6: .*stale lengths cache"
    with pytest.raises(ValueError, match=match):
        list(dm.train_dataloader())


def test_a_cache_dir_for_a_dataset_without_fingerprint_names_the_setting(tmp_path):
    dm = SeqPackDataModule(source=[{"input_ids": [1, 2, 3]}] * 4, max_tokens=8, cache_dir=str(tmp_path))
    with pytest.raises(
        ValueError, match=r"cache_dir=.* list declares no 'fingerprint': give the dataset a fingerprint"
    ):
        dm.setup("fit")


def _trainer(**kwargs) -> L.Trainer:
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**(settings | kwargs))


class _Lengths(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        lengths = batch["cu_seqlens"].diff().tolist()[: batch["num_documents"]]
        self.seen.setdefault(trainer.current_epoch, []).extend(lengths)
        assert batch["input_ids"].numel() <= 64


def test_a_dataset_that_declares_changing_lengths_is_replanned_every_epoch():
    data = GrowingPrompt({0: 3, 1: 20}, declare=True)
    model = ReferenceLM(
        vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, max_seq_len=64
    )
    seen = _Lengths()
    _trainer(reload_dataloaders_every_n_epochs=1, callbacks=[seen]).fit(
        model, datamodule=SeqPackDataModule(source=data, max_tokens=64)
    )
    assert seen.seen == {0: [7] * 24, 1: [24] * 24}


def test_a_dataset_that_declares_changing_lengths_needs_its_loader_rebuilt_every_epoch():
    data = GrowingPrompt({0: 3}, declare=True)
    model = ReferenceLM(
        vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, max_seq_len=64
    )
    with pytest.raises(ValueError, match=r"lengths_change_per_epoch=True.*reload_dataloaders_every_n_epochs=1 \(got 0"):
        _trainer().fit(model, datamodule=SeqPackDataModule(source=data, max_tokens=64))
    with pytest.raises(ValueError, match=r"overlong='drop' cannot be used with GrowingPrompt"):
        SeqPackDataModule(source=data, max_tokens=64, overlong="drop").setup("fit")


def test_planned_lengths_are_compared_after_the_per_document_padding():
    """With pad_to_multiple_of the plan packs padded lengths: a sample may grow inside its padded slot, not past it."""
    from lit_seqpack.batch import Microbatch, MicrobatchMeta
    from lit_seqpack.data.batching.collate import PackedCollator

    meta = MicrobatchMeta(step=0, step_loss_tokens=20, world_size=1, accumulate_grad_batches=1, lengths=(8, 16))
    collate = PackedCollator(pad_document_to_multiple_of=8)
    samples = [{"input_ids": list(range(1, 7))}, {"input_ids": list(range(1, 17))}]  # 6 -> 8, 16 -> 16: as planned
    assert collate(Microbatch(samples, meta=meta, indices=[4, 9]))["input_ids"].shape == (1, 24)
    samples[0] = {"input_ids": list(range(1, 10))}  # 9 tokens take 16 slots, the plan gave 8
    with pytest.raises(
        ValueError, match=r"dataset index 4\) has 9 tokens \(16 padded to a multiple of 8\) but the plan"
    ):
        collate(Microbatch(samples, meta=meta, indices=[4, 9]))


def test_a_dataset_that_declares_changing_lengths_resumes_at_an_epoch_boundary(tmp_path):
    """The checkpoint holds epoch 1's lengths, a resumed run's setup reads epoch 0's: the lengths are not compared (the
    dataset is re-scanned for the epoch the run resumes at, and each microbatch checks its own)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_epochs: int, seen: _Lengths, ckpt_path=None) -> None:
        model = ReferenceLM(
            vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, max_seq_len=64
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=max_epochs,
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            reload_dataloaders_every_n_epochs=1,
            callbacks=[seen, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        )
        data = GrowingPrompt({0: 3, 1: 20, 2: 10}, declare=True)
        trainer.fit(model, datamodule=SeqPackDataModule(source=data, max_tokens=64), ckpt_path=ckpt_path)

    first, resumed = _Lengths(), _Lengths()
    fit(2, first)
    fit(3, resumed, ckpt_path=tmp_path / "last.ckpt")
    assert first.seen == {0: [7] * 24, 1: [24] * 24} and resumed.seen == {2: [14] * 24}


class _Rows(L.Callback):
    """Each training batch's epoch and token rows, in order (and stops the fit after ``stop_at`` steps)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.rows: list[tuple[int, list[list[int]]]] = []
        self.stop_at = stop_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append((trainer.current_epoch, batch["input_ids"].tolist()))

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def test_a_dataset_that_declares_changing_lengths_resumes_mid_epoch_exactly(tmp_path):
    """Stopped after 8 steps (3 of epoch 0's, 5 of epoch 1's, whose samples are 3x longer) and resumed from the last
    checkpoint: epoch 1 is re-scanned and re-planned for the resume, so the rows and the weights are the
    uninterrupted run's."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(rows: _Rows, folder: str, ckpt_path=None) -> ReferenceLM:
        L.seed_everything(0)
        model = ReferenceLM(
            vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, max_seq_len=64
        )
        every_step = ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=1, save_last=True, save_top_k=0)
        trainer = _trainer(reload_dataloaders_every_n_epochs=1, callbacks=[rows, every_step], enable_checkpointing=True)
        data = GrowingPrompt({0: 3, 1: 20}, declare=True)
        trainer.fit(model, datamodule=SeqPackDataModule(source=data, max_tokens=64), ckpt_path=ckpt_path)
        return model

    whole, first, resumed = _Rows(), _Rows(stop_at=8), _Rows()
    reference = fit(whole, "whole")
    fit(first, "stopped")
    model = fit(resumed, "stopped", ckpt_path=tmp_path / "stopped" / "last.ckpt")
    assert [epoch for epoch, _ in first.rows] == [0] * 3 + [1] * 5 and len(resumed.rows) == 7
    assert first.rows + resumed.rows == whole.rows
    for name, value in reference.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
