"""Validation / test data from their own files or DatasetDict splits, and the evaluation token budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import SyntheticInstructionDataset, TokenizedSource

SYNTH = {"num_samples": 120, "median_length": 24, "max_length": 96, "vocab_size": 64, "seed": 1}


def _records(count: int, seed: int, *, low: int = 4, high: int = 60, offset: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": (rng.integers(1, 50, int(n)) + offset).tolist()} for n in rng.integers(low, high, count)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def files(tmp_path):
    return {
        "train": _jsonl(tmp_path / "train.jsonl", _records(80, 0)),
        "val": _jsonl(tmp_path / "val.jsonl", _records(30, 1)),
        "test": _jsonl(tmp_path / "test.jsonl", _records(20, 2)),
    }


def _evaluated(loader) -> list[list[int]]:
    """The input_ids of every document of every microbatch, in order (packed rows split at cu_seqlens)."""
    docs = []
    for batch in loader:
        if "cu_seqlens" in batch:
            bounds = batch["cu_seqlens"].tolist()
            row = batch["input_ids"][0].tolist()
            docs += [row[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)][: batch["num_documents"]]
        else:
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
                docs.append(ids[mask.bool()].tolist())
    return docs


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_val_path_and_test_path_are_evaluated_whole_and_exactly_once(files, mode):
    extra = {"batch_size": 4} if mode == "padded" else {"max_tokens": 128}
    dm = SeqPackDataModule(
        source=TokenizedSource(files["train"], format="jsonl", val_path=files["val"], test_path=files["test"]),
        **extra,
        mode=mode,
    )
    dm.setup("fit")
    assert len(dm.splits["train"].lengths) == 80  # nothing held out of the training file
    for name, count in (("val", 30), ("test", 20)):
        with open(files[name]) as handle:
            expected = sorted(json.loads(line)["input_ids"] for line in handle)
        loader = dm.val_dataloader() if name == "val" else dm.test_dataloader()
        assert sorted(_evaluated(loader)) == expected and len(expected) == count


def test_val_path_and_val_fraction_together_are_refused(files):
    with pytest.raises(ValueError, match=r"the source's val data .* and val_fraction=0.1 all choose the val samples"):
        SeqPackDataModule(
            source=TokenizedSource(files["train"], format="jsonl", val_path=files["val"]), val_fraction=0.1
        )
    with pytest.raises(ValueError, match=r"the source's test data .* and test_fraction=0.2 all choose"):
        SeqPackDataModule(
            source=TokenizedSource(files["train"], format="jsonl", test_path=files["test"]), test_fraction=0.2
        )


def test_val_path_that_is_the_training_data_or_has_no_source_is_refused(files):
    with pytest.raises(ValueError, match=r"is the training data itself"):
        SeqPackDataModule(source=TokenizedSource(files["train"], format="jsonl", val_path=files["train"]))
    with pytest.raises(ValueError, match=r"val_source and the source's val data .* all choose the val samples"):
        own_val = TokenizedSource(files["train"], val_path=files["val"])
        SeqPackDataModule(source=own_val, val_source=TokenizedSource(files["val"]))
    with pytest.raises(ValueError, match=r"val_source and val_fraction=0.1 all choose the val samples"):
        SeqPackDataModule(source=_records(4, 0), val_source=_records(4, 1), val_fraction=0.1)
    with pytest.raises(ValueError, match=r"no 'test' data: set test_fraction > 0 .* or test_source"):
        SeqPackDataModule(source=TokenizedSource(files["train"], format="jsonl")).test_dataloader()


def test_splits_of_one_dataset_dict_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    parts = {"train": _records(40, 0), "validation": _records(10, 1), "test": _records(6, 2)}
    folder = tmp_path / "dd"
    datasets.DatasetDict({name: datasets.Dataset.from_list(records) for name, records in parts.items()}).save_to_disk(
        str(folder)
    )
    with pytest.raises(
        ValueError, match=r"splits \['test', 'train', 'validation'\]; split=None is not one: .*the source's split"
    ):
        SeqPackDataModule(source=TokenizedSource(str(folder), format="hf_disk")).setup("fit")
    dm = SeqPackDataModule(
        source=TokenizedSource(str(folder), format="hf_disk", split="train", val_split="validation", test_split="test"),
        max_tokens=128,
    )
    assert {name: len(split.lengths) for name, split in dm.splits.items()} == {"train": 40, "val": 10, "test": 6}
    assert sorted(_evaluated(dm.val_dataloader())) == sorted(r["input_ids"] for r in parts["validation"])
    with pytest.raises(ValueError, match=r"is the training data itself"):
        SeqPackDataModule(source=TokenizedSource(str(folder), format="hf_disk", split="train", val_split="train"))
    with pytest.raises(
        ValueError, match=r"split='train'\) picks a split of a DatasetDict folder, which format='jsonl'"
    ):
        TokenizedSource(str(tmp_path / "x.jsonl"), format="jsonl", split="train")


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_eval_microbatches_respect_eval_max_tokens_and_cover_every_sample_once(mode):
    dm = SeqPackDataModule(
        source=SyntheticInstructionDataset(**SYNTH), mode=mode, max_tokens=128, eval_max_tokens=512, val_fraction=0.3
    )
    assert dm.settings.eval_max_tokens == 512
    val_count = len(dm.splits["val"].lengths)
    seen, largest = [], 0
    for batch in dm.val_dataloader():
        assert batch["input_ids"].numel() <= 512 and batch["max_tokens"] == 512
        largest = max(largest, batch["input_ids"].numel())
    for microbatch in dm.val_dataloader().batch_sampler:
        seen += list(microbatch)
    assert sorted(seen) == list(range(val_count))
    assert largest > 128  # the larger budget is used, not the training one
    for batch in dm.train_dataloader():
        assert batch["input_ids"].numel() <= 128


def test_eval_max_tokens_defaults_to_the_training_budget_and_bad_values_name_the_setting():
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=128, val_fraction=0.3)
    assert dm.settings.eval_max_tokens == 128
    assert all(b["input_ids"].numel() <= 128 for b in dm.val_dataloader())
    with pytest.raises(ValueError, match=r"eval_max_tokens=64 is below max_tokens=128"):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=128, eval_max_tokens=64)
    with pytest.raises(ValueError, match=r"eval_max_tokens=300 must be a multiple of 8"):
        SeqPackDataModule(
            source=SyntheticInstructionDataset(**SYNTH), max_tokens=128, sequence_length_round=8, eval_max_tokens=300
        )
    with pytest.raises(ValueError, match=r"eval_max_tokens=512 is a token budget, but mode='padded'"):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), mode="padded", batch_size=4, eval_max_tokens=512)


def test_eval_documents_keep_the_training_document_budget(tmp_path, files):
    long_val = _jsonl(tmp_path / "long.jsonl", _records(5, 3, low=4, high=20) + [{"input_ids": list(range(1, 200))}])
    with pytest.raises(ValueError, match=r"the val data: 1 of 6 samples are longer than max_tokens=128"):
        dm = SeqPackDataModule(
            source=TokenizedSource(files["train"], format="jsonl", val_path=long_val), max_tokens=128
        )
        dm.setup("fit")
    dm = SeqPackDataModule(
        source=TokenizedSource(files["train"], format="jsonl", val_path=long_val),
        max_tokens=128,
        eval_max_tokens=256,
        overlong="drop",
    )
    dm.setup("fit")
    assert dm.eval_overlong_reports["val"].num_overlong == 1 and len(dm.splits["val"].lengths) == 5


def test_the_vocabulary_counts_the_eval_files(tmp_path, files):
    high_val = _jsonl(tmp_path / "high.jsonl", _records(3, 4, offset=100))
    dm = SeqPackDataModule(source=TokenizedSource(files["train"], format="jsonl", val_path=high_val))
    assert dm.vocab_size == max(max(r["input_ids"]) for r in _records(3, 4, offset=100)) + 1


def test_padded_mode_without_batch_size_names_the_setting_and_the_mode():
    with pytest.raises(ValueError, match=r"mode='padded' needs batch_size \(data.batch_size"):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), mode="padded")
