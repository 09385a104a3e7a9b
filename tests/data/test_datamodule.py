from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import SyntheticInstructionDataset
from lit_seqpack.data.sources.tokenized import TokenizedDataset

SYNTH = {"num_samples": 120, "median_length": 24, "max_length": 96, "vocab_size": 64, "seed": 1}


def _indices_of_epoch(dm: SeqPackDataModule, epoch: int) -> list[int]:
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return [i for mb in loader.batch_sampler for i in mb]


@pytest.mark.parametrize(("mode", "extra"), [("packing", {}), ("dynamic", {}), ("padded", {"batch_size": 4})])
def test_every_train_sample_once_per_epoch_and_contract_keys(mode, extra):
    max_tokens = None if mode == "padded" else 128
    dm = SeqPackDataModule(
        source=SyntheticInstructionDataset(**SYNTH), **extra, mode=mode, max_tokens=max_tokens, val_fraction=0.1
    )
    dm.setup("fit")
    train_len = len(dm.pipeline.splits["train"][0])
    for epoch in (0, 1):
        seen = _indices_of_epoch(dm, epoch)
        assert sorted(seen) == list(range(train_len))
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].dtype == torch.long
    assert ("cu_seqlens" in batch) == (mode == "packing")
    assert batch["num_real_tokens"] + batch["num_padding_tokens"] == batch["input_ids"].numel()
    val = list(dm.val_dataloader())
    assert sum(b["num_documents"] for b in val) == len(dm.pipeline.splits["val"][0]) == 12


def test_packing_plans_on_per_document_padded_lengths():
    dm = SeqPackDataModule(
        source=SyntheticInstructionDataset(**SYNTH), mode="packing", max_tokens=128, pad_to_multiple_of=8
    )
    for batch in dm.train_dataloader():
        assert batch["input_ids"].shape[1] <= 128
        assert (torch.diff(batch["cu_seqlens"]) % 8 == 0).all()


def test_overlong_drop_is_counted_not_silent():
    records = [{"input_ids": list(range(1, n + 1))} for n in (5, 40, 7, 9, 33)]
    dm = SeqPackDataModule(
        source=TokenizedDataset.from_records(records),
        mode="packing",
        max_tokens=16,
        overlong="drop",
    )
    dm.setup("fit")
    assert dm.overlong_report.num_dropped == 2 and dm.overlong_report.tokens_dropped == 73
    seen = sorted(i for mb in dm.train_dataloader().batch_sampler for i in mb)
    assert seen == [0, 1, 2]


def test_overlong_error_names_the_knob():
    records = [{"input_ids": [1] * 30}, {"input_ids": [2] * 3}]
    dm = SeqPackDataModule(source=TokenizedDataset.from_records(records), max_tokens=16)
    with pytest.raises(ValueError, match="overlong"):
        dm.setup("fit")


def test_truncate_recounts_loss_tokens_for_datasets_without_fast_path():
    records = [{"input_ids": list(range(1, 31))}, {"input_ids": [2, 3, 4]}]
    plain = [{"input_ids": torch.tensor(r["input_ids"])} for r in records]
    dm = SeqPackDataModule(source=plain, max_tokens=16, overlong="truncate", shuffle=False)
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
def test_bad_settings_fail_at_construction(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), **kwargs)


def test_empty_dataset_is_an_error():
    dm = SeqPackDataModule(source=TokenizedDataset.from_records([{"input_ids": [1]}]))
    dm.pipeline._dataset = []
    with pytest.raises(ValueError, match="empty"):
        dm.setup("fit")


def test_resume_refuses_another_layout_or_dataset():
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH))
    dm.setup("fit")
    state = dm.state_dict()
    dm.load_state_dict(dict(state))
    with pytest.raises(ValueError, match="world_size"):
        dm.load_state_dict({**state, "world_size": 4})
    with pytest.raises(ValueError, match="num_samples"):
        dm.load_state_dict({**state, "num_samples": 7})


def test_vocab_size_from_config_and_from_tokens():
    assert SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH)).vocab_size == 64
    data = TokenizedDataset.from_records([{"input_ids": [3, 41]}, {"input_ids": [7]}])
    assert SeqPackDataModule(source=data).vocab_size == 42


def test_trainer_with_distributed_sampler_is_refused():
    class _Conn:
        use_distributed_sampler = True

    class _Trainer:
        world_size, global_rank, accumulate_grad_batches = 2, 0, 1
        _accelerator_connector = _Conn()

    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH))
    dm.trainer = _Trainer()
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        dm.setup("fit")
    assert np.all(dm.pipeline.scan().lengths > 0)


# ---------------------------------------------------------------- context / tensor parallelism (issue 8)
class _FakeTrainer:
    """The attributes SeqPackDataModule reads from a Trainer, for one global rank of a multi-process run."""

    class _Conn:
        use_distributed_sampler = False

    _accelerator_connector = _Conn()

    def __init__(self, world_size: int, global_rank: int) -> None:
        from types import SimpleNamespace

        self.world_size, self.global_rank, self.accumulate_grad_batches = world_size, global_rank, 1
        self.fit_loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))


def _rank_batches(world_size: int, global_rank: int, **knobs) -> tuple[SeqPackDataModule, list[dict]]:
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), **({"max_tokens": 240} | knobs), mode="packing")
    dm.trainer = _FakeTrainer(world_size, global_rank)
    dm.setup("fit")
    return dm, list(dm.train_dataloader())


def test_one_pad_multiple_feeds_the_planner_and_the_collator():
    dm, batches = _rank_batches(2, 1, context_parallel_size=2, pad_to_multiple_of=3)
    assert dm.settings.document_multiple == 12 and dm.settings.row_multiple == 12  # lcm(3, 2 x cp)
    sampler = dm.pipeline.train_sampler
    assert sampler.config.world_size == 1 and sampler.config.sequence_length_round == 12
    assert (sampler._lengths % 12 == 0).all()  # the plan's lengths are the padded ones
    for batch in batches:
        assert (torch.diff(batch["cu_seqlens"]) % 12 == 0).all()  # the collator pads with the same multiple
        assert batch["context_parallel_rank"] == 1 and batch["input_ids"].shape[1] * 2 == int(batch["cu_seqlens"][-1])
        assert batch["input_ids"].shape[1] * 2 <= 240


def test_ranks_of_one_cp_group_share_microbatches_and_dp_ranks_split_the_data():
    """world 4 = 2 data-parallel x 2 context-parallel ranks; cp is the inner dimension (ranks 0, 1 are a group)."""
    from lit_seqpack.parallel.context import gather_packed_batches

    runs = [_rank_batches(4, rank, context_parallel_size=2) for rank in range(4)]
    indices = [[list(mb) for mb in dm.pipeline.train_sampler] for dm, _ in runs]
    assert indices[0] == indices[1] and indices[2] == indices[3] and indices[0] != indices[2]
    everything = sorted(i for rank in (0, 2) for mb in indices[rank] for i in mb)
    assert everything == list(range(len(runs[0][0].pipeline.splits["train"][0])))
    for dp in (0, 1):  # the two shards of every microbatch are the two halves of one packed row
        for first, second in zip(runs[2 * dp][1], runs[2 * dp + 1][1], strict=True):
            whole = gather_packed_batches([first, second])
            assert whole["num_real_tokens"] == sum(whole["cu_seqlens_unpadded"].diff().tolist())
            assert whole["world_size"] == 2 and first["step_loss_tokens"] == second["step_loss_tokens"]


def test_tensor_parallel_alone_pads_rows_not_documents():
    dm, batches = _rank_batches(2, 0, tensor_parallel_size=2, sequence_length_round=3, max_tokens=246)
    assert dm.settings.document_multiple == 1 and dm.settings.row_multiple == 6
    for batch in batches:
        assert batch["input_ids"].shape[1] % 6 == 0 and "cu_seqlens_unpadded" not in batch
        assert batch["tensor_parallel_size"] == 2 and batch.get("context_parallel_size", 1) == 1
    assert dm.state_dict()["tensor_parallel_size"] == 2 and dm.state_dict()["world_size"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"context_parallel_size": 0}, "context_parallel_size must be an int >= 1"),
        ({"tensor_parallel_size": 1.5}, "tensor_parallel_size"),
        ({"context_parallel_size": 2, "mode": "dynamic"}, "needs mode='packing'"),
        ({"context_parallel_size": 4, "max_tokens": 100}, "max_tokens=100 must be a multiple of 8"),
    ],
)
def test_bad_parallel_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), **kwargs)


def test_a_world_size_that_cp_does_not_divide_is_refused():
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), context_parallel_size=2)
    dm.trainer = _FakeTrainer(3, 0)
    with pytest.raises(ValueError, match="world_size=3 is not a multiple of context_parallel_size"):
        dm.setup("fit")


def test_train_loader_plans_the_epoch_the_fit_loop_is_in():
    """Lightning #21938: after an end-of-epoch resume the first epoch must not replay epoch 0's order."""
    from types import SimpleNamespace

    progress = SimpleNamespace(current=SimpleNamespace(processed=3))
    trainer = SimpleNamespace(
        world_size=1,
        global_rank=0,
        accumulate_grad_batches=1,
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        fit_loop=SimpleNamespace(epoch_progress=progress),
    )
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=128)
    dm.trainer = trainer
    dm.setup("fit")
    assert dm.train_dataloader().batch_sampler.epoch == 3


def test_test_split_is_held_out_and_disjoint():
    dm = SeqPackDataModule(
        source=SyntheticInstructionDataset(**SYNTH), max_tokens=128, val_fraction=0.1, test_fraction=0.2
    )
    splits = dm.splits
    indices = {name: set(split.dataset.indices.tolist()) for name, split in splits.items()}
    assert [len(indices[n]) for n in ("train", "val", "test")] == [84, 12, 24]
    assert set.union(*indices.values()) == set(range(120))
    assert sum(b["num_documents"] for b in dm.test_dataloader()) == 24
    with pytest.raises(ValueError, match="test_fraction"):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), test_fraction=1.5)


def test_validate_or_test_from_a_checkpoint_of_another_layout_is_allowed():
    """Lightning hands the DataModule its checkpoint state for validate/test too; only fit resumes training."""
    from types import SimpleNamespace

    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH))
    dm.setup("fit")
    state = {**dm.state_dict(), "world_size": 2, "accumulate_grad_batches": 4}
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="validate"))
    dm.load_state_dict(state)
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    with pytest.raises(ValueError, match="world_size: checkpoint 2 vs now 1"):
        dm.load_state_dict(state)


def test_a_training_split_without_any_loss_token_is_refused_at_setup():
    """Every label -100: training would run at loss 0 while weight decay moves the weights, silently."""
    masked = [{"input_ids": [1, 2, 3, 4], "labels": [-100] * 4} for _ in range(8)]
    with pytest.raises(ValueError, match=r"the training split \(8 samples of DatasetSource\) has no loss token"):
        SeqPackDataModule(source=masked, max_tokens=16).setup("fit")
    one = [*masked, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]  # a single trained sample is enough
    SeqPackDataModule(source=one, max_tokens=16).setup("fit")
