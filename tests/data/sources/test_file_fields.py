"""Declared token and sample fields read from JSONL, Parquet and ``save_to_disk`` files, through SeqPackDataModule
(packing, dynamic, padded; ``overlong: truncate``) and the CLI's YAML config."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import ChatSource, TokenizedSource
from lit_seqpack.data.sources.tokenized import FieldColumns, load_tokenized
from tests.data.test_datamodule_fields import FIELDS, PAD, _check_batch, _records

FORMATS = ["jsonl", "parquet", "hf_disk"]
MODES = [("packing", {}), ("dynamic", {}), ("padded", {"batch_size": 4})]


def _write(records: list[dict], tmp_path, fmt: str) -> str:
    """``records`` in a file of ``fmt``; returns its path."""
    if fmt == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        path = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "data_hf"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return str(path)


def _where(fmt: str, index: int) -> str:
    """How a message names record ``index`` of a file of ``fmt`` (JSONL lines count from 1, rows from 0)."""
    return f"line {index + 1}" if fmt == "jsonl" else f"row {index}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("mode", "extra"), MODES)
def test_file_fields_arrive_aligned_with_the_tokens_and_documents(tmp_path, fmt, mode, extra):
    records = _records()
    path = _write(records, tmp_path, fmt)
    max_tokens = None if mode == "padded" else 64
    dm = SeqPackDataModule(
        source=TokenizedSource(path, format=fmt), **FIELDS, **extra, mode=mode, max_tokens=max_tokens, val_fraction=0.1
    )
    dm.setup("fit")
    seen = []
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        _check_batch(batch, records)  # score == input_ids / 4 at every real position, PAD elsewhere; reward per doc
        seen += batch["reward"].tolist()
    assert sorted(seen) == [float(i) for i in range(len(records))]  # every document once, with its own reward


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sample_reads_back_its_exact_values_and_column_dtypes(tmp_path, fmt):
    records = [
        {"input_ids": [3, 4, 5], "score": [0.25, 0.5, 2.0], "count": [1, 0, 7], "reward": 2, "gain": 0.5},
        {"input_ids": [6, 7], "score": [1.0, -3.0], "count": [2, 2], "reward": 5, "gain": 1.0},
    ]
    ds = load_tokenized(
        _write(records, tmp_path, fmt), fmt, token_fields=["score", "count"], sample_fields=["reward", "gain"]
    )
    for i, record in enumerate(records):
        sample = ds[i]
        assert sample["input_ids"].tolist() == record["input_ids"]
        assert sample["score"].dtype == torch.float32 and sample["score"].tolist() == record["score"]
        assert sample["count"].dtype == torch.int64 and sample["count"].tolist() == record["count"]
        assert sample["reward"] == record["reward"] and type(sample["reward"]) is int
        assert sample["gain"] == record["gain"] and type(sample["gain"]) is float
    assert ds.lengths.tolist() == [3, 2]


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncate_cuts_the_file_fields_with_the_sample(tmp_path, fmt):
    records = _records(longest=70)
    dm = SeqPackDataModule(
        source=TokenizedSource(_write(records, tmp_path, fmt), format=fmt),
        **FIELDS,
        max_tokens=32,
        overlong="truncate",
    )
    dm.setup("fit")
    assert dm.overlong_report.num_truncated > 0
    for batch in dm.train_dataloader():
        _check_batch(batch, records, max_tokens=32)  # ids and score cut to the same 32 positions


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_token_field_of_the_wrong_length_fails_naming_the_line_and_field(tmp_path, fmt):
    records = _records(n=8)
    records[5]["score"] = records[5]["score"][:-1]
    dm = SeqPackDataModule(source=TokenizedSource(_write(records, tmp_path, fmt), format=fmt), **FIELDS, max_tokens=64)
    n = len(records[5]["input_ids"])
    expected = f"{_where(fmt, 5)}: token field 'score' has {n - 1} values but 'input_ids' has {n} tokens"
    with pytest.raises(ValueError, match=expected):
        dm.prepare_data()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_declared_column_or_value_is_an_error(tmp_path, fmt):
    records = _records(n=4)
    path = _write([{k: v for k, v in r.items() if k != "reward"} for r in records], tmp_path, fmt)
    missing = "the declared sample field 'reward' is missing" if fmt == "jsonl" else "no column 'reward'"
    with pytest.raises(ValueError, match=missing):
        load_tokenized(path, fmt, token_fields=["score"], sample_fields=["reward"])


def test_jsonl_null_and_non_numeric_values_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2], "score": [1.0, 2.0], "reward": "high"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: sample field 'reward' must be one number a sample"):
        load_tokenized(path, token_fields=["score"], sample_fields=["reward"])
    path.write_text(json.dumps({"input_ids": [1, 2], "score": [1.0, 2.0], "reward": 2**70}) + "\n")
    with pytest.raises(ValueError, match="sample field 'reward' holds an integer beyond int64"):
        load_tokenized(path, token_fields=["score"], sample_fields=["reward"])
    path.write_text(json.dumps({"input_ids": [1, 2], "score": None}) + "\n")
    with pytest.raises(ValueError, match="line 1: the declared token field 'score' is missing"):
        load_tokenized(path, token_fields=["score"])
    path.write_text(json.dumps({"input_ids": [1, 2], "score": [[1.0], [2.0]]}) + "\n")
    with pytest.raises(ValueError, match="line 1: token field 'score' must be a flat list of numbers"):
        load_tokenized(path, token_fields=["score"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_undeclared_keys_are_reported_once_naming_them(tmp_path, fmt, caplog):
    records = [r | {"note": f"sample {i}"} for i, r in enumerate(_records(n=12))]
    dm = SeqPackDataModule(
        source=TokenizedSource(_write(records, tmp_path, fmt), format=fmt), max_tokens=64, token_fields={"score": PAD}
    )
    with caplog.at_level(logging.WARNING):
        dm.setup("fit")
        for _ in dm.train_dataloader():
            pass
    reports = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage() or "declare" in r.getMessage()]
    assert len(reports) == 1, reports  # once, by the reader; the collator sees no undeclared key again
    assert "'note' (12 of 12 samples)" in reports[0] and "'reward' (12 of 12 samples)" in reports[0]
    assert "sample_fields=[name]" in reports[0]


def test_declared_fields_are_refused_for_a_source_that_cannot_carry_them():
    assets = Path(__file__).parents[3] / "lit_seqpack" / "data" / "assets" / "chat_demo"
    source = ChatSource(str(assets / "chat.jsonl"), str(assets / "tokenizer"))
    with pytest.raises(ValueError, match="ChatSource builds samples without them"):
        source.load("train", token_fields=["score"])


def test_field_columns_take_the_float_dtype_of_the_whole_column():
    columns = FieldColumns(["w"], ["r"])
    columns.add({"input_ids": [1, 2], "w": [1, 2], "r": 1}, "record 0", 2)
    columns.add({"input_ids": [1], "w": [0.5], "r": 2.5}, "record 1", 1)
    tokens, samples = columns.columns()
    assert tokens["w"].dtype == np.float32 and tokens["w"].tolist() == [1.0, 2.0, 0.5]  # every batch is float32
    assert samples["r"].dtype == np.float64 and samples["r"].tolist() == [1.0, 2.5]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*")
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_file_fields_from_a_yaml_config_reach_the_batches(tmp_path, fmt):
    from lit_seqpack.cli import SeqPackCLI

    records = _records(n=24)
    config = {
        "data": {
            "source": {
                "class_path": "lit_seqpack.data.sources.TokenizedSource",
                "init_args": {"path": _write(records, tmp_path, fmt), "format": fmt},
            },
            "max_tokens": 64,
            "token_fields": {"score": PAD},
            "sample_fields": ["reward"],
        },
        "trainer": {"logger": False},
    }
    path = tmp_path / "fields.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = SeqPackCLI(args=["--model", "lit_seqpack.model.lm.ReferenceLM", "--config", str(path)], run=False)
    cli.datamodule.setup("fit")
    seen = 0
    for batch in cli.datamodule.train_dataloader():
        _check_batch(batch, records)
        seen += batch["num_documents"]
    assert seen == len(records)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_val_path_file_keeps_its_fields_and_is_truncated_with_them(tmp_path, fmt):
    train, val = _records(n=20, seed=1), _records(n=16, seed=2, longest=70)
    (tmp_path / "train").mkdir(), (tmp_path / "val").mkdir()
    dm = SeqPackDataModule(
        source=TokenizedSource(
            _write(train, tmp_path / "train", fmt), format=fmt, val_path=_write(val, tmp_path / "val", fmt)
        ),
        **FIELDS,
        max_tokens=32,
        overlong="truncate",
    )
    dm.setup("fit")
    assert dm.eval_overlong_reports["val"].num_truncated > 0
    seen = 0
    for batch in dm.val_dataloader():
        _check_batch(batch, val, max_tokens=32)
        seen += batch["num_documents"]
    assert seen == len(val)
