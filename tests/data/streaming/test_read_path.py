"""The stream's per-sample read path: token lists converted once and checked by name, checkpoint-safe state."""

from __future__ import annotations

import gc
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.batching._samples import sample_loss_tokens, window_loss_tokens
from lit_seqpack.data.sources import JsonlStream, ParquetStream
from lit_seqpack.data.streaming.dataset import LocatedReader


def _write(path: Path, samples: list[dict]) -> str:
    path.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return str(path)


def _samples(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        ids = rng.integers(1, 60, int(rng.integers(2, 50))).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def test_a_checkpointed_stream_state_with_carried_samples_loads_weights_only(tmp_path: Path) -> None:
    """Windows carry samples (now arrays) into the next one; the state holds them as lists, so a ``weights_only``
    load (the default of ``torch.load``) of the checkpoint still works and resumes exactly."""
    path = _write(tmp_path / "data.jsonl", _samples(300))
    settings = {"window": 50, "max_tokens": 128, "num_workers": 0}
    reference = [
        b["input_ids"].tolist() for b in SeqPackDataModule(source=JsonlStream(path), **settings).train_dataloader()
    ]
    first = SeqPackDataModule(source=JsonlStream(path), **settings)
    batches = iter(first.train_dataloader())
    head = [next(batches)["input_ids"].tolist() for _ in range(12)]
    state = first.state_dict()
    assert any(w["carried"] for w in state["stream_loader"]["loader"]["windows"])  # the case under test
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = SeqPackDataModule(source=JsonlStream(path), **settings)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert head + [b["input_ids"].tolist() for b in resumed.train_dataloader()] == reference


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"input_ids": [5, True, 7]}, "input_ids must hold integers, found a bool"),
        ({"input_ids": [5, 6], "labels": [5, 6.5]}, "labels must hold integers, got dtype"),
        ({"input_ids": [[5, 6]]}, r"input_ids must be 1-D, got shape \(1, 2\)"),
        ({"input_ids": [5, 2**70]}, "input_ids is not a sequence of integers"),
    ],
)
def test_a_bad_token_list_is_refused_naming_the_stream_sample(tmp_path: Path, bad: dict, message: str) -> None:
    path = _write(tmp_path / "data.jsonl", [*_samples(3), bad, *_samples(2)])
    module = SeqPackDataModule(source=JsonlStream(path), window=50, max_tokens=128, num_workers=0)
    with pytest.raises(ValueError, match=r"stream sample 3 \(\S*data\.jsonl, line 4\): " + message):
        list(module.train_dataloader())


@pytest.mark.parametrize(
    "samples",
    [
        [{"input_ids": np.array(x), "labels": np.array(y)} for x, y in [([5, 6, 7], [-100, 6, 7]), ([8], [8])]],
        [{"input_ids": np.array([5, 6]), "labels": np.array([-100, -100])}, {"input_ids": np.array([1])}],
        [{"input_ids": np.array([5, 6, 7]), "labels": np.zeros(0, dtype=np.int64)}],  # refused later, counted alike
        [{"input_ids": [5, 6, 7]}, {"input_ids": np.array([4])}, {"input_ids": [1, 2]}],
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": np.array([4, 5]), "labels": np.array([4, 5])}],
        [{"input_ids": [5, 6], "labels": [5, -100]}, {"input_ids": np.array([4, 5]), "labels": np.array([4, 5])}],
        [],
    ],
)
def test_a_window_counts_the_loss_tokens_of_each_sample_as_one_sample_does(samples: list[dict]) -> None:
    counts = window_loss_tokens(samples)
    assert counts.dtype == np.int64
    assert counts.tolist() == [sample_loss_tokens(sample) for sample in samples]


def _read_line(tmp_path: Path, line: str) -> dict:
    path = tmp_path / "one.jsonl"
    path.write_text(line + "\n")
    return next(JsonlStream(str(path)).open())


def test_the_jsonl_reader_hands_on_plain_integer_token_lists_as_writable_int64_arrays(tmp_path: Path) -> None:
    extremes = [0, 1, -100, 2**63 - 1, -(2**63)]
    sample = _read_line(tmp_path, json.dumps({"input_ids": extremes, "labels": [], "loss_mask": [0, 1], "n": 3}))
    for key, values in (("input_ids", extremes), ("labels", [])):
        assert type(sample[key]) is np.ndarray and sample[key].dtype == np.int64 and sample[key].flags.writeable
        assert sample[key].tolist() == values
    assert sample["loss_mask"] == [0, 1] and sample["n"] == 3  # only the token lists are converted


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("input_ids", [5, True, 7]),  # a JSON true reads as 1 once converted: the line's `true` keeps the list
        ("labels", [5, False]),
        ("labels", [5, 6.0]),
        ("input_ids", [5, 1e3]),
        ("input_ids", [[5, 6]]),
        ("input_ids", [5, 2**63]),
        ("labels", [5, None]),
        ("input_ids", [5, "6"]),
    ],
)
def test_the_jsonl_reader_leaves_a_token_list_that_is_not_plain_integers_for_the_checks(
    tmp_path: Path, key: str, bad: list
) -> None:
    sample = _read_line(tmp_path, json.dumps({"input_ids": [5, 6], "labels": [-100, 6]} | {key: bad}))
    assert type(sample[key]) is list and sample[key] == bad
    other = "labels" if key == "input_ids" else "input_ids"
    if b"true" not in json.dumps(bad).encode() and b"false" not in json.dumps(bad).encode():
        assert type(sample[other]) is np.ndarray  # the other list is still converted on its own


def test_the_two_token_arrays_of_a_line_are_independent_and_hold_nothing_the_garbage_collector_walks(
    tmp_path: Path,
) -> None:
    """A window holds thousands of samples: an object the collector tracks per sample (a numpy view of a buffer
    holds two) made its full collections a fifth of a stream's time. Only the tagged sample itself is tracked."""
    path = _write(tmp_path / "data.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}])
    sample = next(LocatedReader(JsonlStream(path).open(), 0))
    sample["input_ids"][0] = 9  # writable, and not shared with the labels
    assert sample["input_ids"].tolist() == [9, 6, 7] and sample["labels"].tolist() == [-100, 6, 7]
    _assert_only_the_sample_is_tracked(sample)


def test_a_bool_elsewhere_on_a_line_keeps_its_tokens_checked_the_slow_way_and_trained_alike(tmp_path: Path) -> None:
    """``true`` in another field (a bool, a text) only skips the reader's conversion: the same batches."""
    plain = _samples(40)
    flagged = [{**s, "reviewed": True, "text": "false"} for s in plain]
    settings = {"window": 20, "max_tokens": 128, "num_workers": 0}
    batches = [
        [b["input_ids"].tolist() for b in SeqPackDataModule(source=JsonlStream(path), **settings).train_dataloader()]
        for path in (_write(tmp_path / "plain.jsonl", plain), _write(tmp_path / "flagged.jsonl", flagged))
    ]
    assert batches[0] == batches[1] and batches[0]


def _parquet_rows(tmp_path: Path, columns: dict, row_group_size: int = 2) -> list[dict]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), tmp_path / "d.parquet", row_group_size=row_group_size)
    return list(ParquetStream(str(tmp_path / "d.parquet")).open())


@pytest.mark.parametrize("value_type", ["int64", "int32", "uint8", "large_list"])
def test_the_parquet_reader_hands_on_integer_list_columns_as_writable_int64_arrays(
    tmp_path: Path, value_type: str
) -> None:
    pa = pytest.importorskip("pyarrow")
    ids, labels = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]], [[-100, 6, 7], [8], [9, -100], [1, 2, 3, 4], [0]]
    if value_type == "large_list":
        kind = pa.large_list(pa.int64())
    else:
        kind = pa.list_(getattr(pa, value_type)())
        labels = labels if value_type != "uint8" else [[max(x, 0) for x in row] for row in labels]
    rows = _parquet_rows(tmp_path, {"input_ids": pa.array(ids, kind), "labels": pa.array(labels, kind), "n": range(5)})
    for row, want_ids, want_labels, n in zip(rows, ids, labels, range(5), strict=True):
        for key, want in (("input_ids", want_ids), ("labels", want_labels)):
            assert type(row[key]) is np.ndarray and row[key].dtype == np.int64 and row[key].flags.writeable
            assert row[key].tolist() == want
        assert row["n"] == n
    rows[0]["input_ids"][-1] = 99  # a view of its row group's array: only its own tokens
    assert rows[1]["input_ids"].tolist() == [8]
    _assert_only_the_sample_is_tracked(rows[2])


@pytest.mark.parametrize(
    ("column", "row", "problem"),
    [
        (
            [[5, 6], [7.5]],
            0,
            r"input_ids must be a list of integers, holds 5\.0 \(float\)",
        ),  # pyarrow makes the column float
        ([[True, False], [True]], 0, r"input_ids must be a list of integers, holds True \(bool\)"),
        ([[5, 6], None], 1, r"input_ids is null"),
        ([[5, None], [7]], 0, r"input_ids must be a list of integers, holds None \(NoneType\)"),
    ],
    ids=["float", "bool", "null list", "null id"],
)
def test_the_parquet_reader_refuses_other_token_columns_naming_file_row_group_and_row(
    tmp_path: Path, column: list, row: int, problem: str
) -> None:
    pytest.importorskip("pyarrow")
    with pytest.raises(ValueError, match=rf"d\.parquet: row group 0, row {row}: {problem}"):
        _parquet_rows(tmp_path, {"input_ids": column})


def test_the_parquet_reader_reads_uint64_token_columns_as_lists_for_the_checks(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    column = [[5, 6], [2**64 - 1]]
    rows = _parquet_rows(tmp_path, {"input_ids": pa.array(column, pa.list_(pa.uint64()))})
    assert [row["input_ids"] for row in rows] == column


def _assert_only_the_sample_is_tracked(sample: dict) -> None:
    gc.collect()  # untracks the tuples of plain numbers (a sample's position)
    reachable, tracked, todo = set(), [], [sample]
    while todo:
        item = todo.pop()
        if id(item) in reachable:
            continue
        reachable.add(id(item))
        tracked += [item] if gc.is_tracked(item) else []
        todo += [x for x in gc.get_referents(item) if not isinstance(x, type)]
        todo += [item.base] if isinstance(item, np.ndarray) and item.base is not None else []  # not a referent
    assert [type(x).__name__ for x in tracked if x is not sample] == []  # a plain dict of arrays is not tracked either


def test_a_parquet_stream_trains_the_same_batches_as_the_jsonl_stream_of_its_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    samples = _samples(300)
    columns = {key: [s[key] for s in samples] for key in ("input_ids", "labels")}
    pq.write_table(pa.table(columns), tmp_path / "d.parquet", row_group_size=37)
    settings = {"window": 50, "max_tokens": 128, "num_workers": 0}
    batches = [
        [{k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in module.train_dataloader()]
        for module in (
            SeqPackDataModule(source=JsonlStream(_write(tmp_path / "d.jsonl", samples)), **settings),
            SeqPackDataModule(source=ParquetStream(str(tmp_path / "d.parquet")), **settings),
        )
    ]
    assert batches[0] == batches[1] and len(batches[0]) > 10
