"""Lightning's debugging flags on the DataModule: ``overfit_batches`` trains the same microbatches every epoch."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset
from lit_seqpack.model.lm import ReferenceLM

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
]


class Recording(ReferenceLM):
    """Records the tokens of every training and validation microbatch, by epoch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trained: dict[int, list[tuple[int, ...]]] = {}
        self.validated: dict[int, list[tuple[int, ...]]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.setdefault(self.current_epoch, []).append(tuple(batch["input_ids"].flatten().tolist()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        self.validated.setdefault(self.current_epoch, []).append(tuple(batch["input_ids"].flatten().tolist()))
        return super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_overfit_batches_trains_the_same_microbatches_every_epoch(mode):
    source = SyntheticInstructionDataset(num_samples=200, median_length=16, max_length=64, vocab_size=32)
    data = SeqPackDataModule(source=source, mode=mode, max_tokens=64, val_fraction=0.2)
    model = Recording(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=64)
    trainer = L.Trainer(
        max_epochs=3,
        overfit_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)
    assert sorted(model.trained) == [0, 1, 2]
    assert all(len(batches) == 2 for batches in model.trained.values())
    assert model.trained[0] == model.trained[1] == model.trained[2]  # the same two microbatches, in the same order
    assert all(len(batches) == 2 for batches in model.validated.values())  # Lightning: the first 2 val batches
    assert model.validated[0] == model.validated[2]
    without = Recording(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=64)
    plain = L.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    plain.fit(without, SeqPackDataModule(source=source, mode=mode, max_tokens=64, val_fraction=0.2))
    assert without.trained[0] != without.trained[1]  # without the flag, epochs shuffle (the test can fail)


def test_overfit_batches_is_refused_by_name_on_a_stream(tmp_path):
    from lit_seqpack.data.sources.file_streams import JsonlStream

    path = tmp_path / "s.jsonl"
    path.write_text("".join(f'{{"input_ids": [1, 2, {i % 7 + 1}]}}\n' for i in range(20)))
    data = SeqPackDataModule(source=JsonlStream(str(path)), max_tokens=16)
    model = ReferenceLM(vocab_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=16)
    trainer = L.Trainer(overfit_batches=2, max_epochs=1, use_distributed_sampler=False, logger=False)
    with pytest.raises(ValueError, match=r"overfit_batches=2"):
        trainer.fit(model, data)
