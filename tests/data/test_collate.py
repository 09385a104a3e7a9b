from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.batch import Microbatch, MicrobatchMeta
from lit_seqpack.data.batching.collate import IGNORE_INDEX, PackedCollator, PaddedCollator
from lit_seqpack.planning.config import PlanConfig

X = IGNORE_INDEX
DOCS = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]]  # DESIGN.md's example: 3, 5, 2 tokens


def _samples(docs=DOCS, **extra):
    return [{"input_ids": doc, **{key: value[i] for key, value in extra.items()}} for i, doc in enumerate(docs)]


def _meta(**changes):
    return MicrobatchMeta(
        **{"step": 3, "step_loss_tokens": 50, "world_size": 2, "accumulate_grad_batches": 4} | changes
    )


def test_packed_layout_of_the_design_example():
    batch = PackedCollator(pad_to_multiple_of=4, pad_token_id=7)(_samples())
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 23, 24, 25, 31, 32, 7, 7]]
    assert batch["labels"].tolist() == [[X, 12, 13, X, 22, 23, 24, 25, X, 32, X, X]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 12]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["max_seqlen"] == 5 and type(batch["max_seqlen"]) is int
    assert "attention_mask" not in batch and "cu_seqlens_unpadded" not in batch
    scalars = {key: batch[key] for key in batch if not isinstance(batch[key], torch.Tensor)}
    assert scalars == {
        "max_seqlen": 5,
        "num_documents": 3,
        "num_real_tokens": 10,
        "num_padding_tokens": 2,
        "num_loss_tokens": 7,
        "step_loss_tokens": 7,
        "world_size": 1,
        "accumulate_grad_batches": 1,
        "max_tokens": None,
        "is_empty": False,
    }


def test_default_collator_adds_no_padding():
    batch = PackedCollator()(_samples())
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10] and batch["num_padding_tokens"] == 0
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]


def test_already_aligned_row_gets_no_tail_and_long_tail_sets_max_seqlen():
    assert PackedCollator(pad_to_multiple_of=5)(_samples())["cu_seqlens"].tolist() == [0, 3, 8, 10]
    batch = PackedCollator(pad_to_multiple_of=32)(_samples())
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 32] and batch["max_seqlen"] == 22
    assert batch["position_ids"][0, 10:].tolist() == list(range(22))


def test_per_document_padding_layout():
    batch = PackedCollator(pad_document_to_multiple_of=4)(_samples())
    assert batch["input_ids"].tolist() == [[11, 12, 13, 0, 21, 22, 23, 24, 25, 0, 0, 0, 31, 32, 0, 0]]
    assert batch["labels"].tolist() == [[X, 12, 13, X, X, 22, 23, 24, 25, X, X, X, X, 32, X, X]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert batch["cu_seqlens"].tolist() == [0, 4, 12, 16]
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 3, 8, 10]
    assert batch["cu_seqlens_unpadded"].dtype == torch.int32
    assert (batch["max_seqlen"], batch["num_real_tokens"], batch["num_padding_tokens"]) == (8, 10, 6)
    assert batch["num_loss_tokens"] == 7


def test_per_document_padding_with_a_row_tail():
    batch = PackedCollator(pad_document_to_multiple_of=4, pad_to_multiple_of=20)(_samples())
    assert batch["cu_seqlens"].tolist() == [0, 4, 12, 16, 20]
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 3, 8, 10, 10]  # the tail is a zero-length real segment
    assert batch["position_ids"][0, 16:].tolist() == [0, 1, 2, 3]
    assert batch["num_padding_tokens"] == 10


def test_labels_from_sample_keep_prompt_masking():
    labels = [[X, X, 13], [X, 22, 23, 24, 25], [31, 32]]
    batch = PackedCollator()(_samples(labels=labels))
    assert batch["labels"].tolist() == [[X, X, 13, X, 22, 23, 24, 25, X, 32]]
    assert batch["num_loss_tokens"] == 6


def test_loss_mask_becomes_labels():
    masks = [[0, 1, 1], [False, False, True, True, True], np.array([1, 1])]
    batch = PackedCollator()(_samples(loss_mask=masks))
    assert batch["labels"].tolist() == [[X, 12, 13, X, X, 23, 24, 25, X, 32]]


def test_tensor_and_numpy_inputs_and_extra_keys():
    samples = [
        {"input_ids": torch.tensor(DOCS[0], dtype=torch.int32), "text": "ignored"},
        {"input_ids": np.array(DOCS[1], dtype=np.uint16)},
        {"input_ids": torch.tensor(DOCS[2]), "labels": torch.tensor([5, 6], dtype=torch.int32)},
    ]
    batch = PackedCollator()(samples)
    assert batch["input_ids"].tolist() == [sum(DOCS, [])]
    assert batch["labels"][0, -1].item() == 6 and batch["labels"].dtype == torch.int64


def test_meta_scalars_come_from_the_plan():
    batch = PackedCollator()(Microbatch(_samples(), meta=_meta(max_tokens=16)))
    assert (batch["step_loss_tokens"], batch["world_size"], batch["accumulate_grad_batches"]) == (50, 2, 4)
    assert batch["max_tokens"] == 16 and batch["num_loss_tokens"] == 7 and batch["is_empty"] is False
    padded = PaddedCollator()(Microbatch(_samples(), meta=_meta()))
    assert (padded["step_loss_tokens"], padded["world_size"], padded["accumulate_grad_batches"]) == (50, 2, 4)


def test_meta_with_fewer_step_loss_tokens_than_the_microbatch_is_an_error():
    with pytest.raises(ValueError, match="step_loss_tokens=5 .* 7 loss tokens"):
        PackedCollator()(Microbatch(_samples(), meta=_meta(step_loss_tokens=5)))


@pytest.mark.parametrize(
    ("collator", "length"),
    [
        (PackedCollator(), 1),
        (PackedCollator(pad_to_multiple_of=8), 8),
        (PackedCollator(pad_to_multiple_of=4, pad_document_to_multiple_of=6), 12),
    ],
)
@pytest.mark.parametrize("with_meta", [False, True])
def test_empty_microbatch_becomes_zero_weight_packed_dummy(collator, length, with_meta):
    samples = Microbatch([], meta=_meta(is_empty=True)) if with_meta else []
    batch = collator(samples)
    assert batch["input_ids"].tolist() == [[0] * length]
    assert batch["labels"].tolist() == [[X] * length]
    assert batch["position_ids"].tolist() == [list(range(length))]
    assert batch["cu_seqlens"].tolist() == [0, length] and batch["max_seqlen"] == length
    assert (batch["num_documents"], batch["num_real_tokens"], batch["num_loss_tokens"]) == (0, 0, 0)
    assert batch["num_padding_tokens"] == length and batch["is_empty"] is True
    assert batch["step_loss_tokens"] == (50 if with_meta else 0)
    if collator.pad_document_to_multiple_of:
        assert batch["cu_seqlens_unpadded"].tolist() == [0, 0]


def test_empty_microbatch_becomes_zero_weight_padded_dummy():
    batch = PaddedCollator(pad_to_multiple_of=4)(Microbatch([], meta=_meta(is_empty=True)))
    assert batch["input_ids"].tolist() == [[0] * 4] and batch["labels"].tolist() == [[X] * 4]
    assert batch["attention_mask"].tolist() == [[1] * 4]  # no fully masked attention row
    assert (batch["num_documents"], batch["num_real_tokens"], batch["num_padding_tokens"]) == (0, 0, 4)
    assert batch["is_empty"] is True and batch["num_loss_tokens"] == 0


def test_meta_says_empty_but_samples_are_present():
    with pytest.raises(ValueError, match="is_empty is True but the microbatch holds 3 samples"):
        PackedCollator()(Microbatch(_samples(), meta=_meta(is_empty=True)))


def test_padded_layout():
    batch = PaddedCollator(pad_to_multiple_of=3, pad_token_id=9)(_samples(labels=[[X, 12, 13], [21] * 5, [31, 32]]))
    assert batch["input_ids"].tolist() == [
        [11, 12, 13, 9, 9, 9],
        [21, 22, 23, 24, 25, 9],
        [31, 32, 9, 9, 9, 9],
    ]
    assert batch["labels"].tolist() == [[X, 12, 13, X, X, X], [X, 21, 21, 21, 21, X], [X, 32, X, X, X, X]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(6))] * 3
    assert "cu_seqlens" not in batch
    assert (batch["num_documents"], batch["num_real_tokens"], batch["num_padding_tokens"]) == (3, 10, 8)
    assert batch["num_loss_tokens"] == 7 and batch["is_empty"] is False


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    row_multiple=st.one_of(st.none(), st.integers(1, 16)),
    doc_multiple=st.one_of(st.none(), st.integers(1, 5)),
)
def test_packed_invariants(lengths, row_multiple, doc_multiple):
    docs = [list(range(100 * i + 1, 100 * i + 1 + n)) for i, n in enumerate(lengths)]
    collator = PackedCollator(pad_to_multiple_of=row_multiple, pad_document_to_multiple_of=doc_multiple)
    batch = collator(_samples(docs))
    total = batch["input_ids"].shape[1]
    cu = batch["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == total and total % (row_multiple or 1) == 0
    assert batch["max_seqlen"] == max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
    assert batch["num_real_tokens"] == sum(lengths) and batch["num_documents"] == len(lengths)
    assert batch["num_padding_tokens"] == total - sum(lengths)
    for i, doc in enumerate(docs):  # every document sits at its segment start, positions count from 0
        start, end = cu[i], cu[i + 1]
        assert (end - start) % (doc_multiple or 1) == 0
        assert batch["input_ids"][0, start : start + len(doc)].tolist() == doc
        assert batch["position_ids"][0, start:end].tolist() == list(range(end - start))
        assert batch["labels"][0, start : start + len(doc)].tolist() == [X, *doc[1:]]
    assert batch["num_loss_tokens"] == sum(n - 1 for n in lengths) == int((batch["labels"] != X).sum())


BAD_SAMPLES = [
    ({"labels": [1, 2]}, "sample 1: expected a mapping with 'input_ids', got \\['labels'\\]"),
    (5, "sample 1: expected a mapping with 'input_ids', got int"),
    ({"input_ids": [[1, 2], [3, 4]]}, "sample 1: input_ids must be 1-D, got shape \\(2, 2\\)"),
    ({"input_ids": torch.tensor(4)}, "sample 1: input_ids must be 1-D"),
    ({"input_ids": [1.0, 2.0]}, "sample 1: input_ids must hold integers, got dtype torch.float64"),
    ({"input_ids": [True, False]}, "sample 1: input_ids must hold integers"),
    ({"input_ids": ["a", "b"]}, "sample 1: input_ids is not a sequence of integers"),
    ({"input_ids": []}, "sample 1: input_ids is empty"),
    ({"input_ids": [1, -2, 3]}, "sample 1: input_ids must be >= 0"),
    ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "sample 1: labels has 2 entries but input_ids has 3"),
    ({"input_ids": [1, 2, 3], "labels": [1, -5, 3]}, "sample 1: labels must be >= 0 or -100"),
    ({"input_ids": [1, 2, 3], "labels": [0.5, 1, 2]}, "sample 1: labels must hold integers"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "sample 1: loss_mask has 2 entries but input_ids has 3"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 2, 0]}, "sample 1: loss_mask must hold only 0 and 1"),
    ({"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1, 1]}, "sample 1: give either 'labels' or 'loss_mask'"),
]


@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()], ids=["packed", "padded"])
@pytest.mark.parametrize(("bad", "message"), BAD_SAMPLES)
def test_bad_samples_name_the_sample_and_the_problem(collator, bad, message):
    samples = [{"input_ids": [1, 2]}, bad, {"input_ids": [3, -1]}]  # sample 2 is also bad: the first is reported
    with pytest.raises(ValueError, match=message):
        collator(samples)


def test_negative_id_in_a_later_sample_is_located():
    with pytest.raises(ValueError, match="sample 2: input_ids must be >= 0"):
        PackedCollator()([{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": [4, -1]}])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pad_token_id": -1}, "pad_token_id must be an int >= 0, got -1"),
        ({"pad_token_id": None}, "pad_token_id must be an int >= 0, got None"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be an int >= 1 or None, got 0"),
        ({"pad_to_multiple_of": 2.5}, "pad_to_multiple_of must be an int >= 1 or None, got 2.5"),
        ({"pad_document_to_multiple_of": True}, "pad_document_to_multiple_of must be an int >= 1 or None, got True"),
    ],
)
def test_bad_settings(kwargs, message):
    cls = PaddedCollator if "pad_document_to_multiple_of" not in kwargs else PackedCollator
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize(
    "collator",
    [PackedCollator(pad_to_multiple_of=8, pad_document_to_multiple_of=2, pad_token_id=3), PaddedCollator()],
)
def test_collators_pickle_and_work_after_a_round_trip(collator):
    clone = pickle.loads(pickle.dumps(collator))
    assert clone == collator
    samples = Microbatch(_samples(), meta=_meta())
    expected, got = collator(samples), clone(pickle.loads(pickle.dumps(samples)))
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]) if isinstance(value, torch.Tensor) else value == got[key]


def test_collator_does_not_alias_the_samples():
    ids = torch.tensor([1, 2, 3])
    batch = PackedCollator()([{"input_ids": ids}])
    batch["input_ids"][0, 0] = 99
    assert ids.tolist() == [1, 2, 3]


def test_a_plan_that_miscounts_loss_tokens_is_refused_not_silently_rescaled():
    """A sampler given no loss_tokens assumes length - 1 per sample; prompt-masked labels then disagree."""
    from lit_seqpack.data import PlannedDataset
    from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler

    samples = [{"input_ids": list(range(1, 9)), "labels": [-100] * 6 + [7, 8]} for _ in range(4)]
    lengths = [8] * 4
    miscounted = PlannedBatchSampler(lengths, PlanConfig(mode="packing", max_tokens=16, shuffle=False))
    microbatch = next(iter(miscounted))
    with pytest.raises(ValueError, match="plan counted 14 loss tokens.*labels hold 4"):
        PackedCollator()(PlannedDataset(samples).__getitems__(microbatch))
    exact = PlannedBatchSampler(lengths, PlanConfig(mode="packing", max_tokens=16, shuffle=False), loss_tokens=[2] * 4)
    batch = PackedCollator()(PlannedDataset(samples).__getitems__(next(iter(exact))))
    assert batch["num_loss_tokens"] == 4 and batch["step_loss_tokens"] == 4


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_samples_longer_than_planned_are_refused_naming_them(mode):
    """A dataset whose samples grow after planning (a prompt that grows per epoch, a stale cache) would pack rows far
    above max_tokens without an error: the collator compares each microbatch with the plan's budget."""
    from lit_seqpack.data import PlannedBatchSampler, PlannedDataset

    samples = [{"input_ids": list(range(1, 9))} for _ in range(6)]
    planned_lengths = [4] * 6  # what the planner was told: stale by a factor 2
    if mode == "packing":
        sampler, collate = (
            PlannedBatchSampler(planned_lengths, PlanConfig(mode="packing", max_tokens=16)),
            PackedCollator(),
        )
    else:
        sampler, collate = (
            PlannedBatchSampler(planned_lengths, PlanConfig(mode="dynamic", max_tokens=16)),
            PaddedCollator(),
        )
    planned = PlannedDataset(samples)
    with pytest.raises(ValueError, match=r"dataset index \d\) has 8 tokens but the plan was made with a length of 4"):
        for indices in sampler:
            collate(planned.__getitems__(indices))
    unchecked = Microbatch(
        samples[:4],
        meta=MicrobatchMeta(step=0, step_loss_tokens=28, world_size=1, accumulate_grad_batches=1, max_tokens=16),
        indices=[0, 1, 2, 3],
    )
    with pytest.raises(
        ValueError, match=r"takes 32 token slots but the plan's budget is max_tokens=16 .*dataset index"
    ):
        collate(unchecked)  # a hand-built meta without the planned lengths: the budget still holds
    honest = PlannedBatchSampler([8] * 6, PlanConfig(mode=mode, max_tokens=16))
    for indices in honest:  # the same samples, planned on their real lengths, collate under the budget
        assert collate(planned.__getitems__(indices))["input_ids"].numel() <= 16


@pytest.mark.parametrize(
    ("samples", "error"),
    [
        ([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}], None),
        ([{"input_ids": [5, 6, 7], "labels": [5, 6]}], "sample 0: labels has 2 entries but input_ids has 3"),
        ([{"input_ids": [5, 6], "labels": [5, 6], "loss_mask": [1, 1]}], "give either 'labels' or 'loss_mask'"),
        ([{"input_ids": [5, -6]}], r"sample 0: input_ids must be >= 0"),
        ([{"input_ids": [5, 6]}, {"input_ids": [7], "labels": [-7]}], r"sample 1: labels must be >= 0 or -100"),
        ([{"input_ids": [5, 6], "labels": [[5, 6]]}], "sample 0: labels must be 1-D"),
    ],
)
@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()])
def test_int64_array_samples_collate_and_are_refused_as_lists_are(samples, error, collator):
    """A stream's samples arrive as int64 arrays and skip the per-sample checks that hold for them already."""
    arrays = [{k: np.array(v, dtype=np.int64) for k, v in s.items()} for s in samples]
    if error is not None:
        for form in (samples, arrays):
            with pytest.raises(ValueError, match=error):
                collator(form)
        return
    expected, got = collator(samples), collator(arrays)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]) if isinstance(value, torch.Tensor) else value == got[key], key
