"""Bad samples are refused once, at setup, for every source, naming the dataset index (and the file and row).

Regressions of issue 17: ``loss_mask`` ignored by the Parquet and ``save_to_disk`` readers, ``labels: None``
accepted at setup and failing mid-epoch, booleans read as token ids, ids outside the model's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lit_seqpack import PackedCollator, PaddedCollator, ReferenceLM, SeqPackDataModule
from lit_seqpack.data.indexed.validation import DataScan, check_vocab_range, scan_dataset
from lit_seqpack.data.sources import SyntheticInstructionDataset, TokenizedSource
from lit_seqpack.data.sources.tokenized import TokenizedDataset

MASKED = [
    {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1]},
    {"input_ids": [5, 6, 7], "loss_mask": [False, True, True]},
]
MASKED_LABELS = [[[-100, -100, -100, 8, 9, -100, 6, 7]]]  # one packed row


class _WithLengths(list):
    """A list dataset that offers (possibly lying) lengths: the planner's fast path."""

    def __init__(self, records: list[dict[str, Any]], lengths: list[int] | None = None) -> None:
        super().__init__(records)
        self._offered = lengths

    @property
    def lengths(self) -> list[int]:
        return self._offered if self._offered is not None else [len(r["input_ids"]) for r in self]


def _loss_tokens_of(dm: SeqPackDataModule) -> list[list[int]]:
    return [b["labels"].tolist() for b in dm.train_dataloader()]


def test_a_loss_mask_is_honoured_by_the_parquet_reader(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    ids, masks = [r["input_ids"] for r in MASKED], [[int(v) for v in r["loss_mask"]] for r in MASKED]
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), tmp_path / "m.parquet")
    bools = pa.array([[bool(v) for v in m] for m in masks], type=pa.list_(pa.bool_()))
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": bools}), tmp_path / "b.parquet")
    for name in ("m.parquet", "b.parquet"):
        dm = SeqPackDataModule(
            source=TokenizedSource(str(tmp_path / name), format="parquet"), max_tokens=16, shuffle=False
        )
        assert _loss_tokens_of(dm) == MASKED_LABELS and dm.dataset.loss_tokens.tolist() == [2, 2]
    bad = {
        "both.parquet": ({"input_ids": [[1, 2]], "labels": [[1, 2]], "loss_mask": [[0, 1]]}, "row 0: give either"),
        "two.parquet": ({"input_ids": [[1], [1, 2]], "loss_mask": [[1], [1, 2]]}, "row 1: 'loss_mask' must hold only"),
        "len.parquet": ({"input_ids": [[1, 2]], "loss_mask": [[1]]}, "row 0: 'loss_mask' has 1 entries"),
    }
    for name, (columns, message) in bad.items():
        pq.write_table(pa.table(columns), tmp_path / name)
        with pytest.raises(ValueError, match=rf"{name}, {message}"):
            TokenizedDataset.from_parquet(tmp_path / name)


def test_a_loss_mask_is_honoured_by_the_save_to_disk_reader(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {k: [r[k] for r in MASKED] for k in ("input_ids", "loss_mask")}
    rows["loss_mask"] = [[int(v) for v in mask] for mask in rows["loss_mask"]]
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "disk"))
    dm = SeqPackDataModule(
        source=TokenizedSource(str(tmp_path / "disk"), format="hf_disk"), max_tokens=16, shuffle=False
    )
    assert _loss_tokens_of(dm) == MASKED_LABELS


def test_a_loss_mask_is_honoured_in_memory_and_in_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MASKED))
    for dm in (
        SeqPackDataModule(source=MASKED, max_tokens=16, shuffle=False),
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16, shuffle=False),
    ):
        assert _loss_tokens_of(dm) == MASKED_LABELS


@pytest.mark.parametrize("wrap", [list, _WithLengths])
def test_labels_none_fails_at_setup_naming_the_dataset_index(wrap: type) -> None:
    """Regression: it passed setup and failed after 21 of 68 microbatches naming 'sample 3' (of the microbatch)."""
    records = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in range(200)]
    records[150] = {"input_ids": [1, 2, 3], "labels": None}
    with pytest.raises(ValueError, match=r"dataset\[150\]: 'labels' is None; omit the key"):
        SeqPackDataModule(source=wrap(records), max_tokens=16).setup("fit")


def test_a_collator_error_names_the_dataset_index_not_only_the_position() -> None:
    dm = SeqPackDataModule(source=[{"input_ids": [1, 2, 3]} for _ in range(40)], max_tokens=16, val_fraction=0.25)
    dm.setup("fit")
    data = dm.splits["train"].dataset
    index = int(data.indices[7])
    data.dataset[index]["labels"] = None  # corrupted after setup validated it
    with pytest.raises(ValueError, match=rf"of the microbatch \(dataset index {index}\): labels is None"):
        list(dm.train_dataloader())


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"input_ids": [5, True, 7]}, r"dataset\[1\]: 'input_ids' must be a flat list of ints, found bool \(True at"),
        ({"input_ids": [5, 6], "labels": [5, False]}, r"dataset\[1\]: 'labels' must be a flat list of ints, found bo"),
        ({"input_ids": np.array([True, False])}, r"dataset\[1\]: 'input_ids' must be a flat list of ints, found bool"),
    ],
)
def test_booleans_are_not_tokens(record: dict[str, Any], message: str) -> None:
    """Regression: [5, True, 7] trained as [5, 1, 7]."""
    with pytest.raises(ValueError, match=message):
        SeqPackDataModule(source=[{"input_ids": [1, 2]}, record], max_tokens=16).setup("fit")
    for collator in (PackedCollator(), PaddedCollator()):
        with pytest.raises(ValueError, match="must hold integers"):
            collator([record])


def test_booleans_in_a_jsonl_file_fail_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, true]}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl, line 2: 'input_ids' must be a flat list of ints, found bool"):
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16).setup("fit")
    path.write_text('{"input_ids": [1, 2], "loss_mask": [false, true]}\n')  # a loss mask may be boolean
    assert TokenizedDataset.from_jsonl(path).loss_tokens.tolist() == [1]


def test_lengths_a_dataset_offers_must_agree_with_its_samples() -> None:
    records = [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2]}]
    with pytest.raises(ValueError, match=r"dataset.lengths\[1\] = 9 but dataset\[1\] has 2 \(1 samples disagree\)"):
        SeqPackDataModule(source=_WithLengths(records, [3, 9]), max_tokens=16).setup("fit")


def _tiny_lm(vocab_size: int) -> ReferenceLM:
    return ReferenceLM(vocab_size=vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32)


@pytest.mark.parametrize(
    ("records", "pad", "message"),
    [
        ([{"input_ids": [1, 2]}, {"input_ids": [3, 70]}], 0, r"token id 70 \(dataset\[1\]\) is >= the model's vocab"),
        ([{"input_ids": [1, 2], "labels": [1, 99]}], 0, r"token id 99 \(dataset\[0\]\) is >= the model's vocab_size"),
        ([{"input_ids": [1, 2]}], 64, r"pad_token_id=64 is >= the model's vocab_size=64.*data.pad_token_id"),
    ],
)
def test_ids_outside_the_models_vocabulary_fail_at_setup(records: list[dict], pad: int, message: str) -> None:
    """Regression: IndexError: index out of range in self, deep in the embedding (Target 100 is out of bounds)."""
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=1)
    dm = SeqPackDataModule(source=records, max_tokens=16, pad_token_id=pad)
    with pytest.raises(ValueError, match=message):
        trainer.fit(_tiny_lm(64), datamodule=dm)


def test_the_datas_vocabulary_counts_labels_and_the_pad_id(tmp_path: Path) -> None:
    records = [{"input_ids": [1, 2], "labels": [-100, 40]}]
    assert SeqPackDataModule(source=records, max_tokens=16).vocab_size == 41
    assert SeqPackDataModule(source=records, max_tokens=16, pad_token_id=90).vocab_size == 91
    synthetic = {"num_samples": 10, "vocab_size": 32, "median_length": 10, "max_length": 20}
    assert (
        SeqPackDataModule(source=SyntheticInstructionDataset(**synthetic), max_tokens=32, pad_token_id=50).vocab_size
        == 51
    )


def test_the_cli_links_a_vocabulary_that_counts_the_pad_id(tmp_path: Path) -> None:
    from lit_seqpack.cli import SeqPackCLI

    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    config = {
        "model": {"class_path": "lit_seqpack.ReferenceLM", "init_args": {"n_layer": 1, "n_embd": 16, "n_head": 2}},
        "data": {
            "source": {"class_path": "lit_seqpack.data.sources.TokenizedSource", "init_args": {"path": str(path)}},
            "max_tokens": 16,
            "pad_token_id": 9,
        },
    }
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    cli = SeqPackCLI(args=["--config", str(tmp_path / "c.yaml"), "--trainer.logger", "false"], run=False)
    assert cli.model.hparams.vocab_size == 10  # max id 5, pad 9


def test_columnar_validation_is_vectorised_and_names_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating a million pre-tokenised samples at setup is one max over the token buffer: no sample is read."""
    lengths = np.full(1_000_000, 8)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = np.arange(offsets[-1], dtype=np.int32) % 50_000
    tokens[123_456 * 8 + 7] = 60_000
    data = TokenizedDataset(tokens, offsets, source="big.parquet")
    reads: list[int] = []  # structural, not timed: a per-sample scan would read every sample

    def read(self: TokenizedDataset, index: int) -> None:
        reads.append(index)
        raise AssertionError("the columnar scan read a sample")

    monkeypatch.setattr(TokenizedDataset, "__getitem__", read)
    monkeypatch.setattr(TokenizedDataset, "__iter__", lambda self: read(self, -1), raising=False)
    scan = scan_dataset(data)
    assert scan.max_id == 60_000 and scan.max_where == "big.parquet, sample 123456 (input_ids)"
    assert reads == []
    with pytest.raises(ValueError, match=r"token id 60000 \(big.parquet, sample 123456 \(input_ids\)\)"):
        check_vocab_range(scan, vocab_size=50_000, pad_token_id=0)
    check_vocab_range(DataScan(np.ones(1), np.zeros(1), 5, "x"), vocab_size=None, pad_token_id=99)  # unknown: ok


@pytest.mark.parametrize("key", ["input_ids", "labels"])
def test_the_mixin_checks_the_vocabulary_at_the_model_boundary(key: str) -> None:
    """A loader that no DataModule validated: the model step names the id instead of IndexError in the embedding."""
    batch = PackedCollator()([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5]}])
    batch[key][0, 1] = 100
    model = _tiny_lm(64)
    with pytest.raises(
        ValueError, match=rf"the batch's {key} holds id 100 but ReferenceLM has vocab_size=64.*at least 101"
    ):
        model.seqpack_step(batch, "train")
    batch[key][0, 1] = 63
    model.seqpack_step(batch, "train")  # in range: trains


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shuffle": "false"}, TypeError, "shuffle='false' must be a bool"),
        ({"shuffle": "no"}, TypeError, "shuffle='no' must be a bool"),
        ({"shuffle": 1}, TypeError, "shuffle=1 must be a bool"),
        ({"source": "csv"}, ValueError, "source='csv' is not a built-in source name"),
        ({"overlong": "skip"}, ValueError, "overlong='skip' must be one of"),
        ({"pad_token_id": -1}, ValueError, "pad_token_id must be an int >= 0, got -1"),
        ({"pad_token_id": True}, ValueError, "pad_token_id must be an int >= 0, got True"),
        ({"val_fraction": "0.1"}, TypeError, "val_fraction='0.1' must be a number"),
        ({"cache_dir": 3}, TypeError, "cache_dir=3 must be a str or None"),
    ],
)
def test_settings_of_the_wrong_type_fail_at_construction(kwargs: dict, error: type, message: str) -> None:
    """Regression: shuffle="false", "no" or 1 was accepted and planned as shuffle=True."""
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        SeqPackDataModule(**kwargs)


@pytest.mark.parametrize("knob", ["shuffle", "verify_plan"])
def test_sampler_flags_must_be_bools(knob: str) -> None:
    from tests._samplers import planned_sampler

    for mode in ("packing", "dynamic"):
        with pytest.raises((TypeError, ValueError), match=f"{knob}"):
            planned_sampler(mode, [3, 4], max_tokens=8, **{knob: "no"})
    assert SeqPackDataModule(shuffle=False).plan_config(world_size=1, accumulate_grad_batches=1).shuffle is False


def _random_records(seed: int, count: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        ids = rng.integers(0, 500, rng.integers(1, 20)).tolist()
        kind = rng.integers(0, 3)
        if kind == 0:
            records.append({"input_ids": ids})
        elif kind == 1:
            records.append({"input_ids": ids, "labels": [v if rng.random() < 0.6 else -100 for v in ids]})
        else:
            records.append({"input_ids": ids, "loss_mask": [int(rng.random() < 0.5) for _ in ids]})
    return records


@pytest.mark.parametrize("form", ["list", "tensor", "array"])
def test_the_vectorised_scan_agrees_with_the_per_sample_rules(form: str) -> None:
    import torch

    records = _random_records(form == "tensor", 5000)  # more than one chunk
    convert = {"list": lambda v: v, "tensor": torch.tensor, "array": np.array}[form]
    converted = [{k: convert(v) for k, v in r.items()} for r in records]
    expected = TokenizedDataset.from_records(records)  # validate_record, one record at a time
    scan = scan_dataset(converted)
    assert scan.lengths.tolist() == expected.lengths.tolist()
    assert scan.loss_tokens.tolist() == expected.loss_tokens.tolist()
    assert scan.max_id == max(int(expected.tokens.max()), int(expected.labels.max()))
    converted[4321] = {"input_ids": convert([3, -1])}  # a bad sample deep in the second chunk
    with pytest.raises(ValueError, match=r"dataset\[4321\]: 'input_ids' has negative id -1 at position 1"):
        scan_dataset(converted)


@pytest.mark.parametrize("knob", ["add_eos", "add_special_tokens"])
def test_text_dataset_flags_must_be_bools(knob: str) -> None:
    from lit_seqpack.data.sources.text import TextDataset

    with pytest.raises(TypeError, match=rf"{knob}='false' must be a bool"):
        TextDataset(["a"], tokenizer=lambda texts, **_: {"input_ids": [[1] for _ in texts]}, **{knob: "false"})


def test_collator_errors_map_positions_through_drop_and_split_views() -> None:
    records = [{"input_ids": [1] * n} for n in (3, 30, 4, 5, 40, 6)]
    dm = SeqPackDataModule(source=records, max_tokens=16, overlong="drop", shuffle=False)
    dm.setup("fit")
    for sample in records:
        sample["labels"] = None  # corrupted after setup
    with pytest.raises(ValueError, match=r"sample 0 of the microbatch \(dataset index (0|2|3|5)\)"):
        list(dm.train_dataloader())
    from lit_seqpack.data.indexed.splits import source_index

    view = dm.splits["train"].dataset
    assert [source_index(view, i) for i in range(len(view))] == [0, 2, 3, 5]  # 30 and 40 were dropped
