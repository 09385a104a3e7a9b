"""Stream sources: every sample in order, and a reader reopened at a saved position continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_seqpack.data.sources import (
    GeneratorStream,
    HFIterableStream,
    JsonlStream,
    MixtureStream,
    ParquetStream,
    StreamSource,
)


def _samples(count: int, offset: int = 0) -> list[dict]:
    return [{"input_ids": [1 + (i % 7)] * (1 + i % 5), "index": offset + i} for i in range(count)]


def _indices(reader) -> list[int]:
    return [sample["index"] for sample in reader]


def _split_read(source: StreamSource, first: int) -> tuple[list[int], list[int]]:
    """Read ``first`` samples, reopen a fresh reader at the saved position, read the rest."""
    reader = source.open()
    head = [next(reader)["index"] for _ in range(first)]
    return head, _indices(source.open(reader.position))


@pytest.fixture
def jsonl_shards(tmp_path: Path) -> Path:
    for shard in range(3):
        lines = [json.dumps(s) for s in _samples(7, offset=7 * shard)]
        (tmp_path / f"part-{shard:02d}.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
    return tmp_path


@pytest.fixture
def parquet_shards(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for shard in range(2):
        pq.write_table(
            pa.Table.from_pylist(_samples(11, offset=11 * shard)), tmp_path / f"{shard}.parquet", row_group_size=4
        )
    return tmp_path


def test_jsonl_shards_stream_in_order_and_reopen_at_a_byte_offset(jsonl_shards: Path) -> None:
    source = JsonlStream(str(jsonl_shards))
    assert _indices(source.open()) == list(range(21))
    for first in (0, 3, 7, 20):
        head, tail = _split_read(source, first)
        assert head + tail == list(range(21))
    assert _indices(JsonlStream(str(jsonl_shards / "part-*.jsonl")).open()) == list(range(21))


def test_a_bad_jsonl_line_names_the_file_and_offset(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"input_ids": [1]}\nnot json\n')
    reader = JsonlStream(str(tmp_path)).open()
    next(reader)
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2 \(byte 19\): not a JSON line"):
        next(reader)


def test_parquet_shards_stream_row_group_by_row_group_and_reopen(parquet_shards: Path) -> None:
    source = ParquetStream(str(parquet_shards))
    assert _indices(source.open()) == list(range(22))
    for first in (0, 4, 5, 11, 21):
        head, tail = _split_read(source, first)
        assert head + tail == list(range(22))


def test_a_generator_function_streams_and_reopens_by_skipping() -> None:
    source = GeneratorStream(lambda: iter(_samples(9)))
    head, tail = _split_read(source, 4)
    assert head + tail == list(range(9))
    with pytest.raises(ValueError, match="generator object cannot be read twice"):
        GeneratorStream(iter(_samples(3)))  # type: ignore[arg-type]


def test_a_hugging_face_iterable_dataset_streams_and_reopens() -> None:
    datasets = pytest.importorskip("datasets")
    iterable = datasets.Dataset.from_list(_samples(12)).to_iterable_dataset(num_shards=3)
    source = HFIterableStream(iterable)
    assert _indices(source.open()) == list(range(12))
    head, tail = _split_read(source, 5)
    assert head + tail == list(range(12))


def test_missing_paths_are_named() -> None:
    with pytest.raises(ValueError, match="JsonlStream.paths: no such file or folder"):
        JsonlStream("/nonexistent/data.jsonl")


def _mixture(seed: int) -> MixtureStream:
    a = GeneratorStream(lambda: iter(_samples(30)))
    b = GeneratorStream(lambda: iter(_samples(10, offset=100)))
    return MixtureStream([a, b], [3.0, 1.0], seed=seed)


def test_a_mixture_reads_every_sample_of_every_child_once_deterministically() -> None:
    order = _indices(_mixture(5).open())
    assert sorted(order) == list(range(30)) + list(range(100, 110))
    assert order == _indices(_mixture(5).open())  # same seed, same interleaving (every rank, every pass)
    assert order != _indices(_mixture(6).open())
    # each child keeps its own order; the weights shape the interleaving (3:1 early on)
    assert [i for i in order if i < 100] == list(range(30))
    assert sum(i >= 100 for i in order[:20]) < 10
    for first in (1, 17, 39):
        head, tail = _split_read(_mixture(5), first)
        assert head + tail == order


@pytest.mark.parametrize(
    ("weights", "message"), [([1.0], "1 entries for 2 sources"), ([1.0, 0.0], "finite numbers > 0")]
)
def test_bad_mixture_weights_are_refused(weights: list[float], message: str) -> None:
    streams = [GeneratorStream(lambda: iter(_samples(2))) for _ in range(2)]
    with pytest.raises(ValueError, match=message):
        MixtureStream(streams, weights)
