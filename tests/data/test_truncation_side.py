"""``truncation_side="left"``: ``overlong="truncate"`` keeps the last ``max_tokens`` tokens, exactly; refusals."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.batching.overlong import TruncatedDataset, apply_overlong_policy
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.settings import BatchingSettings
from lit_seqpack.data.streaming.buffer import OverlongCounter
from tests.data.test_overlong_split import MAX_TOKENS, documents, module, records, stream


def kept(sample: dict[str, Any], side: str) -> slice:
    """The tokens ``truncation_side`` keeps of ``sample``."""
    size = len(sample["input_ids"])
    return slice(max(size - MAX_TOKENS, 0), size) if side == "left" else slice(0, min(size, MAX_TOKENS))


def check_trained(batches: list[dict[str, Any]], samples: list[dict[str, Any]], side: str) -> None:
    """Each sample trained once, on exactly the tokens ``side`` keeps, its first kept token without a label."""
    seen: Counter[int] = Counter()
    loss = 0
    for batch in batches:
        loss += int((batch["labels"] != IGNORE_INDEX).sum())
        for doc in documents(batch):
            source = samples[doc["sid"]]
            part = kept(source, side)
            assert doc["origin"].tolist() == source["origin"][part]
            assert doc["input_ids"].tolist() == source["input_ids"][part]
            assert doc["labels"].tolist() == [IGNORE_INDEX, *source["labels"][part][1:]]
            assert doc["position_ids"].tolist() == list(range(len(source["input_ids"][part])))
            seen[doc["sid"]] += 1
    assert seen == Counter(range(len(samples)))
    labels = [np.asarray(s["labels"][kept(s, side)]) for s in samples]
    assert loss == sum(int(np.count_nonzero(x[1:] != IGNORE_INDEX)) for x in labels)


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_left_truncation_trains_exactly_the_last_max_tokens_tokens(mode: str) -> None:
    samples = records()
    dm = module(samples, mode, overlong="truncate", truncation_side="left")
    dm.setup("fit")
    check_trained(list(dm.train_dataloader()), samples, "left")
    report = dm.overlong_report
    over = [len(s["input_ids"]) for s in samples if len(s["input_ids"]) > MAX_TOKENS]
    assert report.num_truncated == len(over) and report.tokens_truncated == sum(n - MAX_TOKENS for n in over)
    assert "from the left (truncation_side='left')" in report.summary()
    right = module(samples, mode, overlong="truncate")
    right.setup("fit")
    check_trained(list(right.train_dataloader()), samples, "right")


def test_left_truncation_of_a_stream_and_its_resume() -> None:
    samples = records(50)
    settings = {"overlong": "truncate", "truncation_side": "left", "window": 8}
    dm = module(stream(samples), **settings)
    reference = list(dm.train_dataloader())
    check_trained(reference, samples, "left")
    state = module(stream(samples), **settings)
    batches = iter(state.train_dataloader())
    head = [next(batches)["origin"].tolist() for _ in range(4)]
    resumed = module(stream(samples), **settings)
    resumed.load_state_dict(state.state_dict())
    assert head + [b["origin"].tolist() for b in resumed.train_dataloader()] == [
        b["origin"].tolist() for b in reference
    ]
    with pytest.raises(ValueError, match=r"truncation_side: 'left' -> 'right'"):
        module(stream(samples), overlong="truncate", window=8).load_state_dict(state.state_dict())


def test_the_view_and_the_counter_keep_the_same_end() -> None:
    samples = records(8)
    lengths = [len(s["input_ids"]) for s in samples]
    view, view_lengths, _ = apply_overlong_policy(samples, lengths, MAX_TOKENS, "truncate", ["origin"], "left")
    assert isinstance(view, TruncatedDataset) and view_lengths.tolist() == [min(n, MAX_TOKENS) for n in lengths]
    counter = OverlongCounter(
        policy="truncate", max_tokens=MAX_TOKENS, token_fields=("origin",), truncation_side="left"
    )
    for i, sample in enumerate(samples):
        assert view[i]["origin"] == counter.admit(i, sample)["origin"] == sample["origin"][kept(sample, "left")]
    assert counter.report().truncation_side == "left" and counter.report().num_truncated > 0


@pytest.mark.parametrize("policy", ["error", "drop", "split"])
def test_a_left_side_with_another_policy_is_refused_by_name(policy: str) -> None:
    with pytest.raises(
        ValueError, match=f"truncation_side='left' only applies to overlong='truncate', got overlong='{policy}'"
    ):
        SeqPackDataModule(source=records(4), max_tokens=MAX_TOKENS, overlong=policy, truncation_side="left")
    with pytest.raises(ValueError, match="truncation_side='left' only applies"):
        OverlongCounter(policy=policy, max_tokens=MAX_TOKENS, truncation_side="left")


def test_bad_values_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"truncation_side='middle' must be one of \('right', 'left'\)"):
        BatchingSettings(overlong="truncate", truncation_side="middle")
    with pytest.raises(ValueError, match=r"overlong='chunk'.*'split'"):
        BatchingSettings(overlong="chunk")
    with pytest.raises(ValueError, match="set overlong='split' \\(every token kept, in pieces\\)"):
        SeqPackDataModule(source=records(4), max_tokens=MAX_TOKENS).setup("fit")
    with pytest.raises(ValueError, match="read them with OverlongCounter.pieces"):
        OverlongCounter(policy="split", max_tokens=4).admit(0, {"input_ids": [1] * 9})
