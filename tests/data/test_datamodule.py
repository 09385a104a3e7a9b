from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import TokenizedDataset

SYNTH = {"num_samples": 120, "median_length": 24, "max_length": 96, "vocab_size": 64, "seed": 1}


def _indices_of_epoch(dm: SeqPackDataModule, epoch: int) -> list[int]:
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return [i for mb in loader.batch_sampler for i in mb]


@pytest.mark.parametrize(("mode", "extra"), [("packing", {}), ("dynamic", {}), ("padded", {"batch_size": 4})])
def test_every_train_sample_once_per_epoch_and_contract_keys(mode, extra):
    max_tokens = None if mode == "padded" else 128
    dm = SeqPackDataModule(mode=mode, max_tokens=max_tokens, synthetic=SYNTH, val_fraction=0.1, **extra)
    dm.setup("fit")
    train_len = len(dm._splits["train"][0])
    for epoch in (0, 1):
        seen = _indices_of_epoch(dm, epoch)
        assert sorted(seen) == list(range(train_len))
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].dtype == torch.long
    assert ("cu_seqlens" in batch) == (mode == "packing")
    assert batch["num_real_tokens"] + batch["num_padding_tokens"] == batch["input_ids"].numel()
    val = list(dm.val_dataloader())
    assert sum(b["num_documents"] for b in val) == len(dm._splits["val"][0]) == 12


def test_packing_plans_on_per_document_padded_lengths():
    dm = SeqPackDataModule(mode="packing", max_tokens=128, synthetic=SYNTH, pad_to_multiple_of=8)
    for batch in dm.train_dataloader():
        assert batch["input_ids"].shape[1] <= 128
        assert (torch.diff(batch["cu_seqlens"]) % 8 == 0).all()


def test_overlong_drop_is_counted_not_silent():
    records = [{"input_ids": list(range(1, n + 1))} for n in (5, 40, 7, 9, 33)]
    dm = SeqPackDataModule(
        mode="packing", max_tokens=16, overlong="drop", dataset=TokenizedDataset.from_records(records)
    )
    dm.setup("fit")
    assert dm.overlong_report.num_dropped == 2 and dm.overlong_report.tokens_dropped == 73
    seen = sorted(i for mb in dm.train_dataloader().batch_sampler for i in mb)
    assert seen == [0, 1, 2]


def test_overlong_error_names_the_knob():
    records = [{"input_ids": [1] * 30}, {"input_ids": [2] * 3}]
    dm = SeqPackDataModule(max_tokens=16, dataset=TokenizedDataset.from_records(records))
    with pytest.raises(ValueError, match="overlong"):
        dm.setup("fit")


def test_truncate_recounts_loss_tokens_for_datasets_without_fast_path():
    records = [{"input_ids": list(range(1, 31))}, {"input_ids": [2, 3, 4]}]
    plain = [{"input_ids": torch.tensor(r["input_ids"])} for r in records]
    dm = SeqPackDataModule(max_tokens=16, overlong="truncate", dataset=plain, shuffle=False)
    batches = list(dm.train_dataloader())
    assert sum(b["num_real_tokens"] for b in batches) == 16 + 3
    assert sorted(b["num_loss_tokens"] for b in batches) == [2, 15]
    assert all(b["step_loss_tokens"] == b["num_loss_tokens"] for b in batches)  # one microbatch per step


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"mode": "both"}, "mode"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"num_workers": -1}, "num_workers"),
        ({"mode": "padded", "max_tokens": None}, "batch_size"),
        ({"algorithm": "tetris"}, "tetris"),
    ],
)
def test_bad_knobs_fail_at_construction(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        SeqPackDataModule(synthetic=SYNTH, **kwargs)


def test_empty_dataset_is_an_error():
    dm = SeqPackDataModule(dataset=TokenizedDataset.from_records([{"input_ids": [1]}]))
    dm._dataset = []
    with pytest.raises(ValueError, match="empty"):
        dm.setup("fit")


def test_resume_refuses_another_layout_or_dataset():
    dm = SeqPackDataModule(synthetic=SYNTH)
    dm.setup("fit")
    state = dm.state_dict()
    dm.load_state_dict(dict(state))
    with pytest.raises(ValueError, match="world_size"):
        dm.load_state_dict({**state, "world_size": 4})
    with pytest.raises(ValueError, match="num_samples"):
        dm.load_state_dict({**state, "num_samples": 7})


def test_vocab_size_from_config_and_from_tokens():
    assert SeqPackDataModule(synthetic=SYNTH).vocab_size == 64
    data = TokenizedDataset.from_records([{"input_ids": [3, 41]}, {"input_ids": [7]}])
    assert SeqPackDataModule(dataset=data).vocab_size == 42


def test_trainer_with_distributed_sampler_is_refused():
    class _Conn:
        use_distributed_sampler = True

    class _Trainer:
        world_size, global_rank, accumulate_grad_batches = 2, 0, 1
        _accelerator_connector = _Conn()

    dm = SeqPackDataModule(synthetic=SYNTH)
    dm.trainer = _Trainer()
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        dm.setup("fit")
    assert np.all(dm._lengths()[0] > 0)
