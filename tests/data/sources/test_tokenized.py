from __future__ import annotations

import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from lit_seqpack.data.sources.tokenized import TokenizedDataset, load_tokenized, validate_record

RECORDS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [9]},
    {"input_ids": [3, 4, 5], "labels": [3, 4, 5], "meta": "extra keys are ignored"},
]


def _write_jsonl(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def _assert_matches_records(ds):
    assert len(ds) == 3
    assert ds[0]["input_ids"].tolist() == [5, 6, 7, 8] and ds[0]["labels"].tolist() == [-100, -100, 7, 8]
    assert ds[1]["input_ids"].tolist() == [9] and ds[1]["labels"].tolist() == [9]  # filled with its ids
    assert ds[2]["labels"].tolist() == [3, 4, 5]
    assert ds[0]["input_ids"].dtype == torch.int64
    assert ds.lengths.tolist() == [4, 1, 3]
    assert ds.loss_tokens.tolist() == [2, 0, 2]


def test_jsonl_round_trip(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", [RECORDS[0], "\n", RECORDS[1], "   \n", RECORDS[2]])
    ds = TokenizedDataset.from_jsonl(path)
    _assert_matches_records(ds)
    assert ds.source == str(path)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[2]["input_ids"], ds[2]["input_ids"])
    assert load_tokenized(path).lengths.tolist() == [4, 1, 3]
    assert load_tokenized(str(path), format="jsonl").lengths.tolist() == [4, 1, 3]


def test_without_any_labels_samples_have_no_labels_key(tmp_path):
    ds = TokenizedDataset.from_jsonl(_write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]))
    assert "labels" not in ds[0]
    assert ds.loss_tokens.tolist() == [2, 0]


def test_from_records_matches_and_returned_tensors_do_not_share_the_buffer():
    ds = TokenizedDataset.from_records(RECORDS)
    _assert_matches_records(ds)
    sample = ds[0]["input_ids"]
    sample[0] = 99
    assert ds[0]["input_ids"][0] == 5
    assert len(pickle.dumps(ds[2]["input_ids"])) < len(pickle.dumps(torch.zeros(1000, dtype=torch.int64)))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json}\n", "line 2: invalid JSON"),
        ("[1, 2]\n", "line 2: expected an object with 'input_ids', got list"),
        ({"labels": [1]}, "line 2: missing 'input_ids'"),
        ({"input_ids": "1 2 3"}, "line 2: 'input_ids' must be a list of ints, got str"),
        ({"input_ids": [1, 2.5]}, "line 2: 'input_ids' must be a flat list of ints, found float"),
        ({"input_ids": [True, False]}, "line 2: 'input_ids' must be a flat list of ints, found bool"),
        ({"input_ids": [1, "2"]}, "line 2: 'input_ids' must be a flat list of ints, found str"),
        ({"input_ids": [[1, 2], [3]]}, "line 2: 'input_ids' must be a flat list of ints"),
        ({"input_ids": [[1, 2], [3, 4]]}, "line 2: 'input_ids' must be a flat list of ints, found nested lists"),
        ({"input_ids": [1, 2**70]}, "line 2: 'input_ids' must be a flat list of ints, found ids beyond int64"),
        ({"input_ids": [1, 2**40]}, "line 2: 'input_ids' has id 1099511627776 above 2147483647"),
        ({"input_ids": [4, -3]}, "line 2: 'input_ids' has negative id -3 at position 1"),
        ({"input_ids": []}, "line 2: 'input_ids' is empty"),
        ({"input_ids": [1, 2], "labels": [1]}, "line 2: 'labels' has 1 entries but 'input_ids' has 2"),
        ({"input_ids": [1, 2], "labels": [1, -5]}, "line 2: 'labels' has -5 at position 1"),
        ({"input_ids": [1, 2], "labels": [1, None]}, "line 2: 'labels' must be a flat list of ints, found NoneType"),
        ({"input_ids": [1, 2], "labels": "12"}, "line 2: 'labels' must be a list of ints, got str"),
    ],
)
def test_jsonl_validation_names_file_line_and_problem(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1]}, line])
    with pytest.raises(ValueError, match="bad.jsonl") as info:
        TokenizedDataset.from_jsonl(path)
    assert message in str(info.value)


def test_blank_lines_keep_line_numbers(tmp_path):
    path = _write_jsonl(tmp_path / "gap.jsonl", [{"input_ids": [1]}, "\n", "\n", {"input_ids": []}])
    with pytest.raises(ValueError, match=r"gap.jsonl, line 4: 'input_ids' is empty"):
        TokenizedDataset.from_jsonl(path)


def test_empty_file_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no samples"):
        TokenizedDataset.from_jsonl(_write_jsonl(tmp_path / "empty.jsonl", ["\n"]))


def test_validate_record_accepts_tensors_and_arrays():
    ids, labels = validate_record({"input_ids": torch.tensor([3, 4]), "labels": np.array([-100, 4])}, "x")
    assert ids.tolist() == [3, 4] and labels.tolist() == [-100, 4]


def test_load_tokenized_rejects_bad_arguments(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}])
    with pytest.raises(ValueError, match="format='csv'"):
        load_tokenized(path, format="csv")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenized(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="split='train' only applies"):
        load_tokenized(path, split="train")
    other = tmp_path / "d.txt"
    other.write_text("{}")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_tokenized(other)


def test_file_fingerprint_is_a_hash_of_the_content(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    first = TokenizedDataset.from_jsonl(path).fingerprint
    assert first == TokenizedDataset.from_jsonl(path).fingerprint
    stat = path.stat()
    _write_jsonl(path, [{"input_ids": [1, 3]}])  # the same size and mtime, another content
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and TokenizedDataset.from_jsonl(path).fingerprint != first
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    assert TokenizedDataset.from_jsonl(copy).fingerprint == TokenizedDataset.from_jsonl(path).fingerprint


def test_memory_fingerprint_is_a_content_hash():
    a = TokenizedDataset.from_records([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    b = TokenizedDataset.from_records([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    c = TokenizedDataset.from_records([{"input_ids": [1]}, {"input_ids": [2, 3]}])
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_constructor_checks_offsets():
    with pytest.raises(ValueError, match="offsets must increase"):
        TokenizedDataset(np.array([1, 2, 3]), np.array([0, 2, 2, 3]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        TokenizedDataset(np.array([1, 2]), np.array([1, 2]))
    with pytest.raises(ValueError, match="labels hold 1 entries"):
        TokenizedDataset(np.array([1, 2]), np.array([0, 2]), np.array([1]))
    with pytest.raises(IndexError):
        TokenizedDataset(np.array([1, 2]), np.array([0, 2]))[1]


@pytest.mark.parametrize("module", ["pyarrow", "datasets"])
def test_missing_optional_dependency_names_the_extra(tmp_path, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    extra = "parquet" if module == "pyarrow" else "datasets"
    with pytest.raises(ImportError, match=rf"lit-seqpack\[{extra}\]"):
        if module == "pyarrow":
            TokenizedDataset.from_parquet(tmp_path / "x.parquet")
        else:
            TokenizedDataset.from_hf_disk(tmp_path)


def test_parquet_round_trip_and_validation(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {"input_ids": [r["input_ids"] for r in RECORDS], "labels": [r.get("labels", r["input_ids"]) for r in RECORDS]}
    )
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    _assert_matches_records(load_tokenized(tmp_path / "d.parquet"))
    bad = {
        "neg.parquet": ({"input_ids": [[1], [2, -4]]}, "neg.parquet, row 1: 'input_ids' has -4 at position 1"),
        "null.parquet": ({"input_ids": [[1], None]}, "null.parquet, row 1: 'input_ids' is null"),
        "empty.parquet": ({"input_ids": [[1], []]}, "empty.parquet, row 1: 'input_ids' is empty"),
        "type.parquet": ({"input_ids": [[1.5]]}, "column 'input_ids' must hold lists of ints"),
        "nocol.parquet": ({"tokens": [[1]]}, "nocol.parquet: no 'input_ids' column (columns: ['tokens'])"),
        "len.parquet": ({"input_ids": [[1], [1, 2]], "labels": [[1], [2]]}, "row 1: 'labels' has 1 entries"),
        "lab.parquet": ({"input_ids": [[1, 2]], "labels": [[1, -7]]}, "row 0: 'labels' has -7 at position 1"),
    }
    for name, (columns, message) in bad.items():
        pq.write_table(pa.table(columns), tmp_path / name)
        with pytest.raises(ValueError) as info:
            TokenizedDataset.from_parquet(tmp_path / name)
        assert message in str(info.value)


def test_hf_disk_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {
        "input_ids": [r["input_ids"] for r in RECORDS],
        "labels": [r.get("labels", r["input_ids"]) for r in RECORDS],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "single"))
    _assert_matches_records(load_tokenized(tmp_path / "single"))
    both = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "val": datasets.Dataset.from_dict(rows)})
    both.save_to_disk(str(tmp_path / "dict"))
    _assert_matches_records(load_tokenized(tmp_path / "dict", split="val"))
    with pytest.raises(ValueError, match="splits"):
        load_tokenized(tmp_path / "dict")
    with pytest.raises(ValueError, match="single Dataset"):
        load_tokenized(tmp_path / "single", split="train")
    shuffled = datasets.Dataset.from_dict(rows).select([2, 0])
    shuffled.save_to_disk(str(tmp_path / "selected"))
    assert load_tokenized(tmp_path / "selected").lengths.tolist() == [3, 4]


def _null_tables(pa):
    """Tables whose labels / loss_mask are null in row 1 (read as "no labels" they would train the prompt)."""
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    return {
        "labels": (pa.table({"input_ids": ids, "labels": [[-100, 6, 7], None]}), "'labels' is null"),
        "loss_mask": (pa.table({"input_ids": ids, "loss_mask": [[0, 1, 1], None]}), "'loss_mask' is null"),
        "both": (
            pa.table(
                {
                    "input_ids": ids,
                    "labels": [[-100, 6, 7], None],
                    "loss_mask": pa.array([None, None], pa.list_(pa.int8())),
                }
            ),
            "'labels' and 'loss_mask' are null",
        ),
    }


@pytest.mark.parametrize("column", ["labels", "loss_mask", "both"])
def test_a_null_label_row_in_parquet_is_refused_naming_file_row_and_column(tmp_path, column):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table, named = _null_tables(pa)[column]
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=rf"d\.parquet, row 1: {named}; write the row's labels"):
        load_tokenized(tmp_path / "d.parquet")


@pytest.mark.parametrize("column", ["labels", "loss_mask"])
def test_a_null_label_row_in_save_to_disk_is_refused_naming_folder_row_and_column(tmp_path, column):
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    table, named = _null_tables(pa)[column]
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=rf"saved, row 1: {named}; write the row's labels"):
        load_tokenized(tmp_path / "saved")


def test_a_null_label_in_jsonl_is_refused_naming_the_line(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [RECORDS[0], {"input_ids": [1, 2], "labels": None}])
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: 'labels' is null; omit the key to train on every token"):
        load_tokenized(path)


def test_a_file_that_is_not_parquet_or_not_utf8_names_the_file_and_chains_the_cause(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    path.write_text('{"input_ids": [1, 2]}\n')  # JSONL under a Parquet name
    with pytest.raises(ValueError, match=r"d\.parquet: not a readable Parquet file") as info:
        load_tokenized(path)
    assert type(info.value.__cause__).__name__ == "ArrowInvalid"
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3], "text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: not UTF-8 text") as info:
        load_tokenized(path)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)
