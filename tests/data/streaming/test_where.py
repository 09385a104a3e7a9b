"""Errors on the stream path name the stream sample (not its position in the microbatch) and its file and line or row
group and row; unreadable files name the file and chain the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_seqpack.data.batching.collate import PackedCollator
from lit_seqpack.data.sources import JsonlStream, ParquetStream
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.planning.plan import PlanConfig


def _records(bad_id: int) -> list[dict]:
    records = [{"input_ids": [1 + i % 5] * (2 + i % 4)} for i in range(40)]
    records[33] = {"input_ids": [3, bad_id, 4]}
    return records


def _source(tmp_path: Path, kind: str, bad_id: int) -> JsonlStream | ParquetStream:
    records = _records(bad_id)
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return JsonlStream(str(path))
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"input_ids": [r["input_ids"] for r in records]}), tmp_path / "d.parquet", row_group_size=10
    )
    return ParquetStream(str(tmp_path / "d.parquet"))


WHERE = {
    "jsonl": r"stream sample 33, \S*d\.jsonl, line 34",
    "parquet": r"stream sample 33, \S*d\.parquet, row group 3, row 3",
}


def _read_all(source, vocab_size: int | None = None) -> None:
    config = PlanConfig(mode="packing", max_tokens=16, shuffle=False)
    dataset = StreamingDataset(
        source, config=config, rank=0, window_size=50, collator=PackedCollator(), vocab_size=vocab_size
    )
    for _ in StreamingDataLoader(dataset):
        pass


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_negative_id_names_the_stream_sample_and_its_place_in_the_file(tmp_path, kind):
    with pytest.raises(ValueError, match=rf"\({WHERE[kind]}\): input_ids must be >= 0"):
        _read_all(_source(tmp_path, kind, bad_id=-1))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_id_outside_the_vocabulary_names_the_stream_sample_and_its_place(tmp_path, kind):
    with pytest.raises(ValueError, match=rf"token id 99 of {WHERE[kind]} \(in stream window 0\) is outside"):
        _read_all(_source(tmp_path, kind, bad_id=99), vocab_size=50)


def test_a_non_utf8_jsonl_stream_names_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3]}\n{"input_ids": [4], "text": "\xe9"}\n')
    reader = JsonlStream(str(path)).open()
    next(reader), next(reader)
    with pytest.raises(ValueError, match=r"d\.jsonl, line 3: not UTF-8 text \(byte 0xe9") as info:
        next(reader)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


def test_a_file_that_is_not_parquet_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    path.write_text('{"input_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match=r"d\.parquet: not a readable Parquet file") as info:
        next(ParquetStream(str(path)).open())
    assert type(info.value.__cause__).__name__ == "ArrowInvalid"


def test_a_truncated_stream_sample_keeps_its_place(tmp_path):
    records = [{"input_ids": [1 + i % 5] * (2 + i % 4)} for i in range(40)]
    records[33] = {"input_ids": [3, -1] + [4] * 30}  # over-long, truncated to 16 tokens with its bad id
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = PlanConfig(mode="packing", max_tokens=16, shuffle=False)
    dataset = StreamingDataset(
        JsonlStream(str(path)), config=config, rank=0, window_size=50, collator=PackedCollator(), overlong="truncate"
    )
    with pytest.raises(ValueError, match=rf"\({WHERE['jsonl']}\): input_ids must be >= 0"):
        list(StreamingDataLoader(dataset))


def test_good_samples_are_never_located_in_their_file(tmp_path, monkeypatch):
    """Where a sample comes from is worked out only for an error: locating every sample read the file up to it,
    once per sample (a 370x slower stream loader)."""
    from lit_seqpack.data.streaming import dataset as _where

    located = []
    monkeypatch.setattr(_where, "describe_position", lambda *args: located.append(args))
    _read_all(_source(tmp_path, "jsonl", bad_id=7))
    assert located == []


@pytest.mark.parametrize("bad", ["negative", "overlong"])
def test_a_bad_sample_in_a_ranks_share_names_the_share_and_its_true_line(tmp_path, bad):
    """Under stream_split="rank" a sample's number counts in its rank's share; the file and line are the stream's."""
    records = [{"input_ids": [1 + i % 5] * (2 + i % 4)} for i in range(40)]
    records[33] = {"input_ids": [3, -1, 4]} if bad == "negative" else {"input_ids": [3] * 20}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    share = JsonlStream(str(path)).split(1, 2)
    config = PlanConfig(mode="packing", max_tokens=16, shuffle=False)
    dataset = StreamingDataset(
        share, config=config, rank=0, window_size=50, collator=PackedCollator(), data_parallel=(1, 2)
    )
    number = 33 - sum(1 for _ in JsonlStream(str(path)).split(0, 2).open())  # rank 0's share comes first
    where = rf"sample {number} of rank 1's share of the stream,? \(?\S*d\.jsonl, line 34"
    problem = "input_ids must be >= 0" if bad == "negative" else "has 20 tokens, more than max_tokens=16"
    with pytest.raises(ValueError, match=rf"{where}\)?:? {problem}"):
        list(dataset)
