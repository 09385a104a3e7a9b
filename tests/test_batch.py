from __future__ import annotations

import importlib
import pickle
import warnings

import pytest
import torch

from lit_seqpack import batch as contract
from lit_seqpack.batch import (
    IGNORE_INDEX,
    SCALAR_KEYS,
    Microbatch,
    MicrobatchMeta,
    PackedBatch,
    PaddedBatch,
    is_packed_batch,
    shift_labels,
)
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.indexed.splits import IndexView

DOCS = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
DECLARED = contract.CONTRACT_KEYS


def _meta(**kwargs):
    base = {"step": 2, "step_loss_tokens": 17, "world_size": 2, "accumulate_grad_batches": 3, "max_tokens": 64}
    base.update(kwargs)
    return MicrobatchMeta(**base)


def test_shift_labels_aligns_each_position_with_the_next_label():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7]])
    assert shift_labels(labels).tolist() == [[5, 6, IGNORE_INDEX, 7, IGNORE_INDEX]]
    assert labels.tolist() == [[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7]]  # the input is not modified


@pytest.mark.parametrize(
    ("collator", "view", "row_keys"),
    [
        (PackedCollator(), PackedBatch, {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen"}),
        (PackedCollator(pad_document_to_multiple_of=4), PackedBatch, {"cu_seqlens", "cu_seqlens_unpadded"}),
        (PaddedCollator(), PaddedBatch, {"input_ids", "labels", "attention_mask", "position_ids"}),
    ],
)
def test_the_collators_write_only_declared_keys_and_every_required_one(collator, view, row_keys):
    out = collator(DOCS)
    assert set(out) <= DECLARED
    assert set(out) <= set(view.__annotations__) | set(SCALAR_KEYS)
    assert set(view.__required_keys__) | row_keys <= set(out)
    assert all(not isinstance(out[key], torch.Tensor) for key in SCALAR_KEYS)  # no device sync to read them


def test_labels_travel_unshifted_and_aligned_with_input_ids():
    out = PackedCollator()([{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}, {"input_ids": [8, 9]}])
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert out["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9]]  # labels[t] is input_ids[t]


def test_is_packed_batch_tells_packed_rows_from_padded_batches():
    assert is_packed_batch(PackedCollator()(DOCS))
    assert not is_packed_batch(PaddedCollator()(DOCS))
    assert not is_packed_batch({"input_ids": torch.zeros(1, 3), "cu_seqlens": None})


def test_microbatch_pickles_with_meta():
    mb = Microbatch([4, 1, 9], meta=_meta())
    clone = pickle.loads(pickle.dumps(mb))
    assert isinstance(clone, Microbatch)
    assert list(clone) == [4, 1, 9]
    assert clone.meta == mb.meta


def test_planned_dataset_forwards_meta_to_samples():
    data = [{"input_ids": [i] * (i + 1)} for i in range(5)]
    planned = PlannedDataset(data)
    samples = planned.__getitems__(Microbatch([3, 0], meta=_meta(step=5)))
    assert [s["input_ids"] for s in samples] == [[3, 3, 3, 3], [0]]
    assert samples.meta.step == 5
    assert planned.__getitems__([1]).meta is None
    assert len(planned) == 5


def test_planned_dataset_names_the_original_index_through_a_split():
    view = IndexView([{"input_ids": [i + 1]} for i in range(10)], [2, 5, 7])
    samples = PlannedDataset(view).__getitems__([2, 0])
    assert list(samples.indices) == [7, 2]
    assert pickle.loads(pickle.dumps(samples.indices)) == [7, 2]  # resolved: the dataset is not shipped


@pytest.mark.parametrize(
    ("setting", "value"),
    [("step_loss_tokens", -1), ("world_size", 0), ("accumulate_grad_batches", 0), ("world_size", 2.0)],
)
def test_meta_rejects_bad_values(setting, value):
    with pytest.raises(ValueError, match=rf"{setting} must be an int >= \d, got {value!r}"):
        _meta(**{setting: value})


@pytest.mark.parametrize(
    "old",
    [
        "lit_seqpack.data.labels",
        "lit_seqpack.data.microbatch",
        "lit_seqpack.data.sources_factory",
        "lit_seqpack.data.synthetic",
        "lit_seqpack.data.text",
        "lit_seqpack.data.datasets",
        "lit_seqpack.data._planned_sampler",
        "lit_seqpack.data.streaming.module",
    ],
)
def test_the_deprecated_alias_modules_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_names_that_did_not_move_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lit_seqpack.data.indexed.validation import scan_dataset
        from lit_seqpack.data.sources.tokenized import (  # the package took the module's path
            TokenizedDataset,
            load_tokenized,
        )
    assert callable(load_tokenized) and callable(scan_dataset)
    assert TokenizedDataset.__module__ == "lit_seqpack.data.sources.tokenized"


def test_the_contract_keys_have_one_spelling():
    """Plain strings declared once in the TypedDicts: no module defines its own constant for a contract key."""
    import ast
    from pathlib import Path

    import lit_seqpack

    assert {"input_ids", "cu_seqlens", "loss_mask", "loss_weights", "step_loss_weight"} <= contract.CONTRACT_KEYS
    assert contract.SCALAR_KEYS[:2] == ("num_documents", "num_real_tokens")
    offenders = []
    for path in Path(lit_seqpack.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            constant = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            if constant and node.value.value in contract.CONTRACT_KEYS:
                offenders.append(f"{path.name}: {ast.unparse(node)}")
    assert offenders == []
