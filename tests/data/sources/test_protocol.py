from __future__ import annotations

import numpy as np
import pytest

from lit_seqpack.data.batching.overlong import apply_overlong_policy
from lit_seqpack.data.indexed.lengths import compute_lengths, dataset_fingerprint
from lit_seqpack.data.sources import SyntheticInstructionDataset
from lit_seqpack.data.sources.base import TokenDataset, declared_counts, resolve_source
from lit_seqpack.data.sources.text import TextDataset
from lit_seqpack.data.sources.tokenized import TokenizedDataset

RECORDS = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}]


class _Declares:
    """A user dataset that declares only some of the protocol."""

    def __init__(self, **attributes):
        self.samples = [{"input_ids": [1] * n} for n in (3, 1, 2)]
        vars(self).update(attributes)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _tokenizer(texts, **_):
    return {"input_ids": [[1 + len(word) for word in text.split()] for text in texts]}


@pytest.mark.parametrize(
    "dataset",
    [
        SyntheticInstructionDataset(num_samples=5, seed=1),
        TokenizedDataset.from_records(RECORDS),
        TextDataset(["a bb", "ccc"], tokenizer=_tokenizer, add_eos=False),
        resolve_source("synthetic").load("train"),
    ],
    ids=["synthetic", "tokenized", "text", "shortcut"],
)
def test_every_built_in_dataset_declares_the_whole_protocol(dataset):
    assert isinstance(dataset, TokenDataset)
    assert declared_counts(dataset, "lengths").tolist() == [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    assert declared_counts(dataset, "loss_tokens").shape == (len(dataset),)
    assert isinstance(dataset_fingerprint(dataset), str)


def test_a_plain_list_or_a_partial_declaration_is_not_the_protocol():
    assert not isinstance(RECORDS, TokenDataset)
    partial = _Declares(lengths=np.array([3, 1, 2]))
    assert not isinstance(partial, TokenDataset)
    assert declared_counts(partial, "lengths").tolist() == [3, 1, 2]  # the part it declares is still read
    assert declared_counts(partial, "loss_tokens") is None
    assert compute_lengths(partial).tolist() == [3, 1, 2]


def test_declared_counts_keep_int32_and_never_alias_into_compute_lengths():
    lengths = np.array([3, 1, 2], dtype=np.int32)
    assert declared_counts(_Declares(lengths=lengths), "lengths").dtype == np.int32
    computed = compute_lengths(_Declares(lengths=lengths))
    computed[0] = 99
    assert lengths[0] == 3


@pytest.mark.parametrize(
    ("attributes", "error", "message"),
    [
        ({"lengths": [3.0, 1.5, 2.0]}, ValueError, "dataset.lengths must hold integers, got dtype float64"),
        ({"lengths": [True, True, False]}, ValueError, "dataset.lengths must hold integers, got dtype bool"),
        ({"loss_tokens": [1, 2]}, ValueError, r"dataset.loss_tokens has shape \(2,\) but the dataset has 3 samples"),
        ({"fingerprint": 7}, TypeError, "dataset.fingerprint must be a str or None, got int"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_attribute(attributes, error, message):
    dataset = _Declares(**attributes)
    with pytest.raises(error, match=message):
        name = next(iter(attributes))
        declared_counts(dataset, name) if name != "fingerprint" else dataset_fingerprint(dataset)


def test_a_method_named_lengths_is_not_a_declaration():
    class WithMethod(_Declares):
        def lengths(self):
            return [0, 0, 0]

    assert declared_counts(WithMethod(), "lengths") is None
    with pytest.raises(ValueError, match="name='sizes' must be one of"):
        declared_counts(WithMethod(), "sizes")


@pytest.mark.parametrize(
    ("policy", "loss_tokens", "lengths"), [("drop", [2, 1], [3, 2]), ("truncate", [2, 1, 3], [3, 2, 4])]
)
def test_an_overlong_view_declares_its_counts_for_the_budget(policy, loss_tokens, lengths):
    dataset = TokenizedDataset.from_records(RECORDS + [{"input_ids": list(range(1, 10))}])
    view, _, _ = apply_overlong_policy(dataset, dataset.lengths, 4, policy)
    assert declared_counts(view, "loss_tokens").tolist() == loss_tokens
    assert declared_counts(view, "lengths").tolist() == lengths
