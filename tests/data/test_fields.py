"""Open fields: declared per-token and per-sample fields travel aligned with the tokens through every collator."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.batching.context_parallel import ContextParallelCollator, TensorParallelCollator
from lit_seqpack.data.batching.fields import check_fields, sample_field_tensor
from lit_seqpack.parallel.context import context_parallel_index, gather_packed_batches, shard_packed_batch

DOCS = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]
PAD = -7.5


def _samples(docs=DOCS, *, as_type=list):
    """Samples whose token field is a function of the token (``id / 4``) and whose sample field is the first id."""
    return [
        {
            "input_ids": doc,
            "score": as_type([t / 4 for t in doc]) if as_type is not torch.tensor else torch.tensor(doc) / 4,
            "reward": doc[0],
        }
        for doc in docs
    ]


def _check_aligned(batch, pad=PAD):
    """Every real token's score is its id / 4, every padding position holds ``pad``; rewards follow documents."""
    ids, score = batch["input_ids"], batch["score"]
    assert score.shape == ids.shape and score.dtype == torch.float32
    real = batch["attention_mask"].bool() if "attention_mask" in batch else _real_positions(batch)
    torch.testing.assert_close(score[real], ids[real].float() / 4, rtol=0, atol=0)
    assert bool((score[~real] == pad).all())
    firsts = ids[:, 0] if "attention_mask" in batch else ids[0, batch["cu_seqlens"][: batch["num_documents"]].long()]
    assert batch["reward"].tolist() == firsts.tolist()


def _real_positions(batch):
    cu = batch["cu_seqlens"].tolist()
    real_cu = batch.get("cu_seqlens_unpadded", batch["cu_seqlens"]).tolist()
    mask = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    for d in range(batch["num_documents"]):
        mask[0, cu[d] : cu[d] + real_cu[d + 1] - real_cu[d]] = True
    return mask


FIELDS = {"token_fields": {"score": PAD}, "sample_fields": ["reward"]}


@pytest.mark.parametrize("as_type", [list, np.array, torch.tensor])
@pytest.mark.parametrize(
    "collator",
    [
        PackedCollator(**FIELDS),
        PackedCollator(pad_to_multiple_of=8, **FIELDS),
        PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=24, **FIELDS),
        PaddedCollator(**FIELDS),
        PaddedCollator(pad_to_multiple_of=8, **FIELDS),
    ],
    ids=["packed", "packed-tail", "packed-per-document", "padded", "padded-round"],
)
def test_declared_fields_travel_aligned_with_the_tokens(collator, as_type):
    _check_aligned(collator(_samples(as_type=as_type)))


def test_packed_field_layout_of_the_docstring_example():
    samples = [{"input_ids": [1, 2], "w": [1, 1], "r": 0.5}, {"input_ids": [3, 4, 5], "w": [0, 1, 1], "r": 2}]
    batch = PackedCollator(pad_document_to_multiple_of=4, token_fields={"w": 0}, sample_fields=["r"])(samples)
    assert batch["w"].tolist() == [[1, 1, 0, 0, 0, 1, 1, 0]] and batch["w"].dtype == torch.int64
    assert batch["r"].tolist() == [0.5, 2.0] and batch["r"].dtype == torch.float32
    assert batch["w"].shape == batch["input_ids"].shape


def test_dtype_rule_float_when_the_pad_or_any_value_is_a_float():
    samples = [{"input_ids": [1, 2], "w": [1, 0]}]
    assert PackedCollator(token_fields={"w": 0})(samples)["w"].dtype == torch.int64
    assert PackedCollator(token_fields={"w": 0.0})(samples)["w"].dtype == torch.float32
    floats = [{"input_ids": [1, 2], "w": [0.5, 0.0]}]
    assert PackedCollator(token_fields={"w": 0})(floats)["w"].tolist() == [[0.5, 0.0]]
    bools = [{"input_ids": [1, 2], "w": torch.tensor([True, False])}]
    assert PaddedCollator(token_fields={"w": 0})(bools)["w"].dtype == torch.int64
    assert sample_field_tensor([1, np.int64(2)]).dtype == torch.int64
    assert sample_field_tensor([torch.tensor(1.5), 2]).tolist() == [1.5, 2.0]


def test_sample_fields_that_are_not_numbers_arrive_as_a_list():
    samples = [{"input_ids": [1], "group": "a"}, {"input_ids": [2], "group": "b"}]
    assert PaddedCollator(sample_fields=["group"])(samples)["group"] == ["a", "b"]


def test_empty_microbatch_keeps_every_declared_field():
    empty = Microbatch([], meta=MicrobatchMeta(step=0, step_loss_tokens=4, world_size=1, accumulate_grad_batches=1))
    for collator in (PackedCollator(pad_to_multiple_of=4, **FIELDS), PaddedCollator(pad_to_multiple_of=4, **FIELDS)):
        batch = collator(empty)
        assert batch["score"].shape == batch["input_ids"].shape and bool((batch["score"] == PAD).all())
        assert batch["reward"].shape == (0,)


def test_a_token_field_of_the_wrong_length_names_the_sample_the_field_and_both_lengths():
    samples = Microbatch([{"input_ids": [1, 2, 3], "w": [1.0, 1.0]}], indices=[41])
    with pytest.raises(ValueError, match=r"sample 0 .*dataset index 41.*'w' has 2 values but input_ids has 3"):
        PackedCollator(token_fields={"w": 0.0})(samples)


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ({"input_ids": [1, 2]}, "sample 0: the declared token field 'w' is missing"),
        ({"input_ids": [1, 2], "w": [[1.0, 1.0]]}, "'w' must be 1-D"),
        ({"input_ids": [1, 2], "w": ["a", "b"]}, "'w' is not a sequence of numbers"),
        ({"input_ids": [1, 2], "w": torch.tensor([1j, 2j])}, "'w' must hold numbers"),
        ({"input_ids": [1, 2], "w": None}, "'w' is missing"),
    ],
)
def test_bad_token_field_values_are_refused(sample, match):
    with pytest.raises(ValueError, match=match):
        PaddedCollator(token_fields={"w": 0.0})([sample])


def test_a_missing_sample_field_names_the_field_and_the_sample():
    with pytest.raises(ValueError, match="sample 1: the declared sample field 'reward' is missing"):
        PackedCollator(sample_fields=["reward"])([{"input_ids": [1], "reward": 1}, {"input_ids": [2]}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_fields": {"labels": 0}}, "token_fields declares 'labels', a key of the batch contract"),
        ({"sample_fields": ["cu_seqlens"]}, "sample_fields declares 'cu_seqlens'"),
        ({"token_fields": {"shift_w": 0}}, "prefix 'shift_' is reserved"),
        ({"token_fields": {"w": "0"}}, r"token_fields\['w'\] is the pad value"),
        ({"token_fields": {"w": True}}, "pad value"),
        ({"token_fields": ["w"]}, "token_fields must map each field name"),
        ({"sample_fields": "reward"}, "sample_fields must be a list"),
        ({"sample_fields": ["r", "r"]}, "names a field twice"),
        ({"token_fields": {"x": 0}, "sample_fields": ["x"]}, "both token_fields and sample_fields"),
        ({"sample_fields": [""]}, "non-empty strings"),
    ],
)
def test_bad_declarations_fail_at_construction(kwargs, match):
    for collator in (PackedCollator, PaddedCollator):
        with pytest.raises(ValueError, match=match):
            collator(**kwargs)
    with pytest.raises(ValueError, match=match):
        check_fields(kwargs.get("token_fields"), kwargs.get("sample_fields"))


def test_undeclared_keys_warn_once_per_collator_naming_them(caplog):
    collator = PackedCollator(token_fields={"score": 0.0})
    samples = [{"input_ids": [1, 2], "score": [0.0, 1.0], "advantages": [1.0, 2.0], "reward": 3}]
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.batching.fields"):
        batch = collator(samples)
        collator(samples)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert (
        "['advantages', 'reward']" in warnings[0] and "token_fields" in warnings[0] and "sample_fields" in warnings[0]
    )
    assert "advantages" not in batch
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.batching.fields"):
        PackedCollator()([{"input_ids": [1], "labels": [1]}])  # contract keys are not reported
        PaddedCollator()(samples)  # another collator reports again
    assert len(caplog.records) == 1


def test_collators_with_fields_pickle_for_dataloader_workers():
    collator = pickle.loads(pickle.dumps(PackedCollator(pad_to_multiple_of=8, **FIELDS)))
    assert collator.token_fields == {"score": PAD} and collator.sample_fields == ("reward",)
    _check_aligned(collator(_samples()))


def test_tensor_parallel_collator_passes_the_fields_through():
    batch = TensorParallelCollator(collator=PaddedCollator(pad_to_multiple_of=2, **FIELDS), tensor_parallel_size=2)(
        _samples()
    )
    _check_aligned(batch)


def _cp_shards(cp, samples, **fields):
    inner = PackedCollator(pad_document_to_multiple_of=2 * cp, pad_to_multiple_of=4 * cp, **fields)
    shards = [
        ContextParallelCollator(collator=inner, context_parallel_size=cp, context_parallel_rank=r)(samples)
        for r in range(cp)
    ]
    return inner(samples), shards


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_shards_fields_with_the_tokens_and_shifts_them_like_labels(cp):
    whole, shards = _cp_shards(cp, _samples(), **FIELDS)
    for shard in shards:
        assert shard["score"].shape == shard["input_ids"].shape == shard["shift_score"].shape
        # the value at each local token, and at each local token's target (the next position of the whole row)
        torch.testing.assert_close(shard["score"], _token_values(whole, shard, "score"))
        assert shard["reward"].tolist() == whole["reward"].tolist()  # per-document: the same on every rank
    shift = torch.cat([whole["score"][0, 1:], torch.tensor([PAD])])
    for shard, rank in zip(shards, range(cp), strict=True):
        index = context_parallel_index(whole["cu_seqlens"], cp, rank)
        torch.testing.assert_close(shard["shift_score"][0], shift[index])
        torch.testing.assert_close(
            shard["shift_labels"][0], torch.cat([whole["labels"][0, 1:], torch.tensor([-100])])[index]
        )
    gathered = gather_packed_batches(shards)
    assert "shift_score" not in gathered and "shift_labels" not in gathered
    torch.testing.assert_close(gathered["score"], whole["score"])
    _check_aligned(gathered)


def _token_values(whole, shard, key):
    index = context_parallel_index(whole["cu_seqlens"], shard["context_parallel_size"], shard["context_parallel_rank"])
    return whole[key][:, index]


def test_shard_refuses_a_declared_token_field_the_batch_lacks():
    batch = PackedCollator(pad_document_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match=r"token_fields \['w'\] are declared but the batch has no such key"):
        shard_packed_batch(batch, 2, 0, token_fields={"w": 0.0})
