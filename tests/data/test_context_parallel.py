from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.batching.collate import IGNORE_INDEX, PackedCollator
from lit_seqpack.data.batching.context_parallel import ContextParallelCollator
from lit_seqpack.parallel import ParallelLayout
from lit_seqpack.parallel.context import (
    context_parallel_index,
    gather_packed_batches,
    shard_packed_batch,
    shard_tokens,
    unshard_tokens,
)

X = IGNORE_INDEX


def _assert_same_batch(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        else:
            assert actual[key] == value and type(actual[key]) is type(value), key


def test_design_example_two_documents_on_two_ranks():
    batch = PackedCollator()([{"input_ids": list(range(10, 18))}, {"input_ids": [20, 21, 22, 23]}])
    shards = [shard_packed_batch(batch, 2, rank) for rank in (0, 1)]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 16, 17, 20, 23]]
    assert shards[1]["input_ids"].tolist() == [[12, 13, 14, 15, 21, 22]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 6, 7, 0, 3]]  # global positions, not restarted
    assert shards[1]["position_ids"].tolist() == [[2, 3, 4, 5, 1, 2]]
    # targets come from the whole row: rank 0's token 11 predicts 12, which lives on rank 1
    assert shards[0]["shift_labels"].tolist() == [[11, 12, 17, X, 21, X]]
    assert shards[0]["labels"].tolist() == [[X, 11, 16, 17, X, 23]]
    for shard in shards:
        assert shard["cu_seqlens"].tolist() == [0, 8, 12] and shard["max_seqlen"] == 8
    assert [s["num_loss_tokens"] for s in shards] == [4, 6] and sum(s["num_loss_tokens"] for s in shards) == 10
    assert [s["num_real_tokens"] for s in shards] == [6, 6] and shards[0]["num_padding_tokens"] == 0
    assert (shards[1]["context_parallel_size"], shards[1]["context_parallel_rank"]) == (2, 1)
    assert shards[1]["num_documents"] == 2 and shards[1]["step_loss_tokens"] == 10 and shards[1]["world_size"] == 1


def test_padding_is_counted_locally_and_unpadded_boundaries_stay_global():
    collate = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=8)
    batch = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}])  # padded 4 + 8, tail 4
    assert batch["cu_seqlens"].tolist() == [0, 4, 12, 16]
    shards = [shard_packed_batch(batch, 2, rank) for rank in (0, 1)]
    # rank 0 holds chunk 3 of each segment, where the per-document padding sits
    assert [s["num_real_tokens"] for s in shards] == [3, 5]
    assert [s["num_padding_tokens"] for s in shards] == [5, 3]
    assert all(torch.equal(s["cu_seqlens_unpadded"], batch["cu_seqlens_unpadded"]) for s in shards)


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.sampled_from([1, 2, 4]),
    extra=st.sampled_from([1, 3]),
    prompt=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shard_then_gather_gives_back_the_batch(docs, cp, extra, prompt, seed):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in docs:
        ids = torch.randint(0, 100, (n,), generator=gen).tolist()
        cut = n // 2 if prompt else 0
        samples.append({"input_ids": ids, "labels": [X] * cut + ids[cut:]})
    meta = MicrobatchMeta(step=0, step_loss_tokens=10_000, world_size=3, accumulate_grad_batches=2, max_tokens=960)
    collate = PackedCollator(pad_document_to_multiple_of=2 * cp * extra, pad_to_multiple_of=8 * cp)
    batch = collate(Microbatch(samples, meta=meta))
    shards = [shard_packed_batch(batch, cp, rank) for rank in range(cp)]
    length = batch["input_ids"].shape[1]
    for shard in shards:
        assert shard["input_ids"].shape == (1, length // cp)
        assert shard["max_tokens"] * cp == 960
    expected_shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=X)
    assert torch.equal(unshard_tokens([s["shift_labels"] for s in shards], batch["cu_seqlens"]), expected_shift)
    _assert_same_batch(gather_packed_batches(shards[::-1]), batch)


def test_index_of_every_rank_is_a_partition_and_tokens_round_trip_on_any_dim():
    cu = torch.tensor([0, 8, 8, 24, 32], dtype=torch.int32)  # an empty segment too
    indices = torch.cat([context_parallel_index(cu, 4, r) for r in range(4)])
    assert sorted(indices.tolist()) == list(range(32))
    x = torch.randn(3, 32, 5)
    parts = [shard_tokens(x, cu, 4, r, dim=1) for r in range(4)]
    assert torch.equal(unshard_tokens(parts, cu, dim=1), x)


@pytest.mark.parametrize(
    ("cu", "cp", "rank", "match"),
    [
        ([0, 6, 12], 2, 0, "segment 0 of cu_seqlens has 6 tokens, not a multiple of 2 x context_parallel_size = 4"),
        ([0, 8], 2, 2, "context_parallel_rank must be in"),
        ([0, 8], 0, 0, "context_parallel_size must be an int >= 1"),
        ([3, 8], 1, 0, "start at 0"),
    ],
)
def test_bad_index_requests_name_the_problem(cu, cp, rank, match):
    with pytest.raises(ValueError, match=match):
        context_parallel_index(torch.tensor(cu), cp, rank)


def test_bad_batches_are_refused():
    batch = PackedCollator(pad_document_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])
    shard = shard_packed_batch(batch, 2, 0)
    with pytest.raises(ValueError, match="already sharded"):
        shard_packed_batch(shard, 2, 0)
    with pytest.raises(ValueError, match="packed batch"):
        shard_packed_batch({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, 2, 0)
    with pytest.raises(ValueError, match="max_tokens=6 must be a multiple"):
        shard_packed_batch({**batch, "max_tokens": 6}, 4, 0)
    with pytest.raises(ValueError, match="one shard per CP rank"):
        gather_packed_batches([shard, shard])
    with pytest.raises(ValueError, match="different batches"):
        gather_packed_batches([shard, shard_packed_batch(PackedCollator()([{"input_ids": [1] * 8}]), 2, 1)])


def test_layout_multiples_ranks_and_groups():
    assert ParallelLayout().document_multiple(8) == 8 and ParallelLayout().row_multiple(1) == 1
    cp_only = ParallelLayout(context_parallel_size=4)
    assert cp_only.document_multiple(1) == 8 and cp_only.document_multiple(12) == 24
    assert cp_only.row_multiple(sequence_length_round=16) == 16 and cp_only.row_multiple(3) == 24
    tp_only = ParallelLayout(tensor_parallel_size=4)
    assert tp_only.document_multiple(1) == 1 and tp_only.row_multiple(6) == 12  # sequence parallelism: rows only
    layout = ParallelLayout(context_parallel_size=2, tensor_parallel_size=2)
    assert layout.document_multiple(1) == 8
    coords = [layout.coordinates(rank) for rank in range(8)]
    assert len(set(coords)) == 8 and coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    groups = layout.context_parallel_groups(8)
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for group in groups:  # a CP group: one dp rank, one tp rank, CP ranks in order
        coordinates = [layout.coordinates(r) for r in group]
        assert [c.context_parallel_rank for c in coordinates] == [0, 1]
        assert len({(c.data_parallel_rank, c.tensor_parallel_rank) for c in coordinates}) == 1
    with pytest.raises(ValueError, match="world_size=6 is not a multiple"):
        layout.data_parallel_size(6)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelLayout(tensor_parallel_size=0)


def test_collator_shards_every_microbatch_and_the_lock_step_dummy():
    base = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=4)
    collate = ContextParallelCollator(collator=base, context_parallel_size=2, context_parallel_rank=1)
    samples = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7]}]
    batch = collate(samples)
    assert batch["tensor_parallel_size"] == 1
    _assert_same_batch(
        {k: v for k, v in batch.items() if k != "tensor_parallel_size"}, shard_packed_batch(base(samples), 2, 1)
    )
    meta = MicrobatchMeta(step=0, step_loss_tokens=5, world_size=1, accumulate_grad_batches=1, is_empty=True)
    dummy = collate(Microbatch([], meta=meta))
    assert dummy["is_empty"] and dummy["input_ids"].shape == (1, 2) and dummy["num_loss_tokens"] == 0
    assert pickle.loads(pickle.dumps(collate)) == collate  # crosses DataLoader worker processes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"collator": PackedCollator(pad_document_to_multiple_of=2), "context_parallel_size": 2}, "multiple of 2 x"),
        (
            {
                "collator": PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=6),
                "context_parallel_size": 2,
            },
            "pad_to_multiple_of=6",
        ),
        (
            {"collator": PackedCollator(pad_to_multiple_of=4), "context_parallel_size": 2, "context_parallel_rank": 2},
            "rank",
        ),
    ],
)
def test_collator_settings_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelCollator(**({"context_parallel_rank": 0} | kwargs))
