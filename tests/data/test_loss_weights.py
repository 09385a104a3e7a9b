"""Loss weights on the collator side: validation, the placed ``loss_weights`` and the planned step weight sum."""

from __future__ import annotations

import math

import pytest
import torch

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.batching.loss_weights import StepWeightedBatchSampler, sample_loss_weight
from lit_seqpack.data.datamodule import SeqPackDataModule
from tests._samplers import planned_sampler

WEIGHTED = {"token_fields": {"w": 0.0}, "loss_weight_field": "w"}


def test_loss_weights_are_zero_where_nothing_is_trained_and_sum_to_num_loss_weight():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [-100, -100, 3], "w": [0.5, 0.5, 0.25]},
        {"input_ids": [4, 5], "w": [1.0, 0.75]},
    ]
    batch = PackedCollator(pad_to_multiple_of=8, **WEIGHTED)(samples)
    assert batch["loss_weights"].tolist() == [[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0, 0.0]]
    assert batch["num_loss_weight"] == batch["step_loss_weight"] == 1.0  # no plan: the microbatch's own sum
    assert batch["w"].tolist()[0][:5] == [0.5, 0.5, 0.25, 1.0, 0.75]  # the declared field itself is unchanged
    padded = PaddedCollator(**WEIGHTED)(samples)
    assert padded["loss_weights"].tolist() == [[0.0, 0.0, 0.25], [0.0, 0.75, 0.0]]
    assert [sample_loss_weight(s, "w") for s in samples] == [0.25, 0.75]


def test_a_fractional_loss_mask_is_a_weight_only_when_declared():
    samples = [{"input_ids": [1, 2, 3], "loss_mask": [0.0, 0.5, 1.0]}]
    batch = PackedCollator(loss_weight_field="loss_mask")(samples)
    assert batch["labels"].tolist() == [[-100, 2, 3]] and batch["loss_weights"].tolist() == [[0.0, 0.5, 1.0]]
    with pytest.raises(ValueError, match="loss_mask must hold"):
        PackedCollator()(samples)


@pytest.mark.parametrize(
    ("sample", "kwargs", "match"),
    [
        ({"input_ids": [1, 2], "w": [1.0, -0.5]}, WEIGHTED, "finite and >= 0"),
        ({"input_ids": [1, 2], "w": [1.0, float("nan")]}, WEIGHTED, "finite and >= 0"),
        ({"input_ids": [1, 2], "loss_mask": [1.0, 1.5]}, {"loss_weight_field": "loss_mask"}, r"in \[0, 1\]"),
    ],
)
def test_bad_weights_are_refused(sample, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedCollator(**kwargs)([sample])


def test_a_weight_field_must_be_declared():
    with pytest.raises(ValueError, match="loss_weight_field='w' must be 'loss_mask' or one of the declared"):
        PaddedCollator(loss_weight_field="w")


def test_step_weighted_sampler_sums_every_rank_and_slot_of_the_step():
    lengths, sums = [5, 7, 3, 9, 4, 6, 8, 2], [0.5, 1.25, 0.0, 2.0, 0.75, 1.5, 0.25, 1.0]
    kwargs = {"max_tokens": 12, "num_replicas": 2, "accumulate_grad_batches": 2, "seed": 0}
    per_rank = []
    for rank in range(2):
        sampler = StepWeightedBatchSampler(planned_sampler("packing", lengths, rank=rank, **kwargs), sums)
        per_rank.append(list(sampler))
        assert len(sampler) == len(per_rank[-1])
    steps = {mb.meta.step for mbs in per_rank for mb in mbs}
    for step in steps:
        members = [i for mbs in per_rank for mb in mbs if mb.meta.step == step for i in mb]
        planned = {mb.meta.step_loss_weight for mbs in per_rank for mb in mbs if mb.meta.step == step}
        assert planned == {math.fsum(sums[i] for i in members)}


def test_the_datamodule_resumes_a_weighted_loader_mid_epoch_with_a_worker():
    samples = []
    for i in range(40):
        n = 3 + i % 11
        samples.append({"input_ids": list(range(1, n + 1)), "w": [(i % 4) / 4 + 0.125] * n})
    kwargs = {"mode": "packing", "max_tokens": 32, "source": samples, "num_workers": 1, **WEIGHTED}
    loader = SeqPackDataModule(**kwargs).train_dataloader()
    batches = iter(loader)
    head = [next(batches) for _ in range(3)]
    state = loader.state_dict()
    rest = [(b["input_ids"], b["step_loss_weight"]) for b in batches]
    resumed = SeqPackDataModule(**kwargs).train_dataloader()
    resumed.load_state_dict(state)
    again = [(b["input_ids"], b["step_loss_weight"]) for b in resumed]
    assert len(head) == 3 and len(rest) == len(again) > 0
    assert all(torch.equal(a, b) and x == y for (a, x), (b, y) in zip(rest, again, strict=True))
