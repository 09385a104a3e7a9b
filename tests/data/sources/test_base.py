"""What a source is: ``resolve_source``, a dataset as a source, a user's own ``IndexedSource``, file sources' splits."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from lit_seqpack.data import SeqPackDataModule
from lit_seqpack.data.sources import (
    DatasetSource,
    IndexedSource,
    SyntheticInstructionDataset,
    SyntheticStream,
    TokenizedSource,
)
from lit_seqpack.data.sources.base import resolve_source
from lit_seqpack.data.streaming.pipeline import StreamPipeline


def _records(n: int, offset: int = 0) -> list[dict[str, list[int]]]:
    return [{"input_ids": [offset + i + 1] * (3 + i % 5)} for i in range(n)]


class _Splits(IndexedSource):
    """A user's source holding a train and a val split (the test split is absent)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def load(
        self, split: str, *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> Sequence[Mapping[str, Any]] | None:
        self.asked.append((split, tuple(token_fields)))
        return {"train": _records(30), "val": _records(6, offset=100)}.get(split)

    def splits(self) -> tuple[str, ...]:
        return ("train", "val")


class _TorchDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1, 3 + index % 4)}


def test_resolve_source_takes_objects_datasets_and_the_one_shortcut():
    assert isinstance(resolve_source("synthetic").load("train"), SyntheticInstructionDataset)
    stream = SyntheticStream(num_samples=4)
    assert resolve_source(stream) is stream
    source = _Splits()
    assert resolve_source(source) is source
    for dataset in (_records(3), _TorchDataset(), SyntheticInstructionDataset(num_samples=4)):
        wrapped = resolve_source(dataset)
        assert isinstance(wrapped, DatasetSource) and wrapped.load("train") is dataset and wrapped.load("val") is None
    with pytest.raises(ValueError, match=r"val_source='jsonl' is not a built-in source name"):
        resolve_source("jsonl", "val_source")
    with pytest.raises(ValueError, match=r"source must be a map-style dataset .* got dict"):
        resolve_source({"input_ids": [1]})


def test_a_users_indexed_source_gives_the_train_and_val_splits_and_sees_the_declared_fields():
    source = _Splits()
    dm = SeqPackDataModule(source=source, max_tokens=32, token_fields={"w": 0.0})
    assert {name: len(split.lengths) for name, split in dm.splits.items()} == {"train": 30, "val": 6}
    assert ("val", ("w",)) in source.asked and ("train", ("w",)) in source.asked
    with pytest.raises(ValueError, match=r"the source's val data \(val_path / val_split of _Splits\) and val_fraction"):
        SeqPackDataModule(source=_Splits(), max_tokens=32, val_fraction=0.2)
    with pytest.raises(ValueError, match=r"no 'test' data: set test_fraction > 0 .* or test_source"):
        dm.test_dataloader()


def test_val_and_test_sources_are_read_with_the_training_budget():
    dm = SeqPackDataModule(source=_records(20), val_source=_records(5, 50), test_source=_TorchDataset(), max_tokens=16)
    assert {name: len(split.lengths) for name, split in dm.splits.items()} == {"train": 20, "val": 5, "test": 12}
    seen = sorted(int(i) for batch in dm.test_dataloader() for i in batch["input_ids"].flatten() if i > 0)
    assert len(seen) == sum(len(_TorchDataset()[i]["input_ids"]) for i in range(12))
    with pytest.raises(ValueError, match=r"test_source must be an indexed source or dataset, got the stream"):
        SeqPackDataModule(source=_records(4), test_source=SyntheticStream(num_samples=4))


def test_the_pipeline_follows_the_source_kind():
    assert isinstance(SeqPackDataModule(source=SyntheticStream(num_samples=8, vocab_size=32)).pipeline, StreamPipeline)
    with pytest.raises(ValueError, match="a stream source has no splits"):
        SeqPackDataModule(source=SyntheticStream(num_samples=8)).splits  # noqa: B018


def test_file_sources_own_their_files_and_splits(tmp_path):
    for name, records in (("train", _records(10)), ("val", _records(4, 40))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = TokenizedSource(str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "val.jsonl"))
    assert source.splits() == ("train", "val") and source.load("test") is None
    assert len(source.load("val")) == 4 and "val.jsonl" in repr(source)
    with pytest.raises(ValueError, match=r"split='x' must be one of"):
        source.load("x")
    with pytest.raises(ValueError, match=r"TokenizedSource\(format='csv'\) must be one of"):
        TokenizedSource(str(tmp_path / "train.jsonl"), format="csv")
    with pytest.raises(TypeError, match=r"TokenizedSource\(path=...\) is required"):
        TokenizedSource(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"TextSource\(tokenizer=.*\) is not a local folder"):
        from lit_seqpack.data.sources import TextSource

        TextSource(str(tmp_path / "train.jsonl"), str(tmp_path / "no-such-tokenizer"))
