from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from lit_seqpack.data.batching.overlong import (
    DroppedDataset,
    OverlongReport,
    TruncatedDataset,
    apply_overlong_policy,
)
from lit_seqpack.data.indexed.lengths import compute_lengths, compute_loss_tokens
from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset
from lit_seqpack.data.sources.tokenized import TokenizedDataset

LENGTHS = [3, 9, 4, 12, 5, 7]


def _data():
    records = [
        {"input_ids": list(range(1, n + 1)), "labels": [-100] * (n // 2) + list(range(n // 2, n))} for n in LENGTHS
    ]
    return TokenizedDataset.from_records(records)


def test_nothing_overlong_returns_the_dataset_itself():
    data = _data()
    for policy in ("error", "truncate", "drop"):
        view, lengths, report = apply_overlong_policy(data, data.lengths, 12, policy)
        assert view is data and lengths.tolist() == LENGTHS
        assert report == OverlongReport(policy=policy, max_tokens=12, num_samples=6)
        assert report.summary() == "0 of 6 samples are longer than max_tokens=12"


def test_error_lists_count_indices_lengths_and_settings():
    data = _data()
    with pytest.raises(ValueError) as info:
        apply_overlong_policy(data, data.lengths, 6, "error")
    text = str(info.value)
    assert "3 of 6 samples are longer than max_tokens=6" in text
    assert "#1: 9, #3: 12, #5: 7" in text
    assert "overlong='truncate'" in text and "overlong='drop'" in text and "raise max_tokens" in text


def test_truncate_cuts_and_counts(caplog):
    data = _data()
    with caplog.at_level(logging.WARNING, logger="lit_seqpack.data.batching.overlong"):
        view, lengths, report = apply_overlong_policy(data, data.lengths, 6, "truncate")
    assert isinstance(view, TruncatedDataset) and len(view) == 6
    assert lengths.tolist() == [3, 6, 4, 6, 5, 6]
    assert report.num_overlong == report.num_truncated == 3 and report.num_dropped == 0
    assert report.tokens_truncated == (9 - 6) + (12 - 6) + (7 - 6) and report.tokens_dropped == 0
    assert report.indices == (1, 3, 5) and report.lengths == (9, 12, 7)
    assert "overlong='truncate' cut 3 samples (10 tokens)" in caplog.text
    for i in range(6):
        sample, source = view[i], data[i]
        assert sample["input_ids"].tolist() == source["input_ids"].tolist()[:6]
        assert sample["labels"].tolist() == source["labels"].tolist()[:6]
    assert compute_lengths([view[i] for i in range(6)]).tolist() == lengths.tolist()
    scanned = compute_loss_tokens([view[i] for i in range(6)])
    assert view.loss_tokens.tolist() == scanned.tolist()
    assert view.loss_tokens[3] == 0  # 12 tokens, first 6 masked: the response was cut away entirely
    assert view.loss_tokens[0] == data.loss_tokens[0]


def test_truncate_without_loss_token_fast_path_and_other_keys_kept():
    data = [{"input_ids": torch.arange(n), "id": n} for n in LENGTHS]
    view, _, _ = apply_overlong_policy(data, LENGTHS, 5, "truncate")
    assert view.loss_tokens is None
    assert compute_loss_tokens(view).tolist() == [2, 4, 3, 4, 4, 4]
    assert view[3]["id"] == 12 and len(view[3]["input_ids"]) == 5


def test_drop_removes_from_index_space_and_counts():
    data = _data()
    view, lengths, report = apply_overlong_policy(data, data.lengths, 6, "drop")
    assert isinstance(view, DroppedDataset) and len(view) == 3
    assert view.original_indices.tolist() == [0, 2, 4]
    assert lengths.tolist() == [3, 4, 5]
    assert report.num_dropped == 3 and report.tokens_dropped == 9 + 12 + 7 and report.num_truncated == 0
    for new, old in enumerate([0, 2, 4]):
        assert torch.equal(view[new]["input_ids"], data[old]["input_ids"])
    assert view.loss_tokens.tolist() == data.loss_tokens[[0, 2, 4]].tolist()
    assert compute_loss_tokens([view[i] for i in range(3)]).tolist() == view.loss_tokens.tolist()
    assert view.fingerprint.startswith(data.fingerprint) and view.fingerprint != data.fingerprint
    assert "overlong='drop' removed 3 samples (28 tokens)" in report.summary()


def test_drop_everything_is_an_error():
    data = _data()
    with pytest.raises(ValueError, match="would drop all 6 samples"):
        apply_overlong_policy(data, data.lengths, 2, "drop")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "skip"}, "overlong='skip' must be one of"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"max_tokens": 4.5}, "max_tokens must be an int >= 1, got 4.5"),
        ({"max_tokens": True}, "max_tokens must be an int >= 1, got True"),
        ({"lengths": [1, 2]}, r"lengths has shape \(2,\) but the dataset has 6 samples"),
    ],
)
def test_bad_arguments(kwargs, message):
    data = _data()
    args = {"lengths": data.lengths, "max_tokens": 6, "policy": "error", **kwargs}
    with pytest.raises(ValueError, match=message):
        apply_overlong_policy(data, **args)


def test_stale_lengths_are_detected_on_read():
    data = _data()
    stale = np.array(LENGTHS)
    stale[2] = 20  # says sample 2 is over-long although it has 4 tokens
    view, _, _ = apply_overlong_policy(data, stale, 8, "truncate")
    with pytest.raises(ValueError, match="sample 2 has 4 tokens but the lengths array says 20"):
        view[2]
    dropped, _, _ = apply_overlong_policy(data, np.array([3, 1, 4, 12, 5, 7]), 8, "drop")
    with pytest.raises(ValueError, match="stale"):
        dropped[1]


def test_views_pickle():
    data = _data()
    for policy in ("truncate", "drop"):
        view, _, _ = apply_overlong_policy(data, data.lengths, 6, policy)
        clone = pickle.loads(pickle.dumps(view))
        assert [clone[i]["input_ids"].tolist() for i in range(len(clone))] == [
            view[i]["input_ids"].tolist() for i in range(len(view))
        ]


def test_synthetic_heavy_tail_truncated_to_the_budget():
    ds = SyntheticInstructionDataset(num_samples=3000, median_length=128, max_length=4096, seed=6)
    view, lengths, report = apply_overlong_policy(ds, ds.lengths, 512, "truncate")
    over = ds.lengths > 512
    assert report.num_truncated == int(over.sum()) > 0
    assert report.tokens_truncated == int((ds.lengths[over] - 512).sum())
    assert lengths.max() == 512 and lengths.sum() == ds.lengths.sum() - report.tokens_truncated
    first = report.indices[0]
    assert len(view[first]["input_ids"]) == 512 and view.loss_tokens[first] == int(
        (view[first]["labels"][1:] != -100).sum()
    )


def test_report_validates():
    with pytest.raises(ValueError, match="overlong='cut'"):
        OverlongReport(policy="cut", max_tokens=4, num_samples=1)
    with pytest.raises(ValueError, match="cannot exceed num_overlong"):
        OverlongReport(policy="drop", max_tokens=4, num_samples=3, num_overlong=1, num_dropped=2)


def test_views_reject_out_of_range_indices():
    data = _data()
    for policy in ("truncate", "drop"):
        view, _, _ = apply_overlong_policy(data, data.lengths, 6, policy)
        for bad in (len(view), -1):
            with pytest.raises(IndexError):
                view[bad]


def test_unchanged_lengths_come_back_read_only_without_a_copy():
    lengths = np.array([3, 4, 5], dtype=np.int32)
    data = [{"input_ids": [1] * n} for n in lengths]
    view, kept, report = apply_overlong_policy(data, lengths, max_tokens=8, policy="truncate")
    assert view is data and report.num_overlong == 0
    assert np.shares_memory(kept, lengths) and kept.dtype == np.int32
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 1
