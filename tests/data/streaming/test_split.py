"""``StreamSource.split``: the shares of every source are disjoint, cover the stream, reopen at their positions, and
split again (by loader worker) the same way; a share that cannot be cut is refused naming the stream."""

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
    SyntheticStream,
)


def _samples(count: int, offset: int = 0) -> list[dict]:
    return [{"input_ids": [1 + (i % 7)] * (1 + i % 5), "index": offset + i} for i in range(count)]


def _jsonl(folder: Path, sizes: list[int]) -> JsonlStream:
    done = 0
    for shard, size in enumerate(sizes):
        lines = [json.dumps(s) for s in _samples(size, offset=done)]
        (folder / f"part-{shard:02d}.jsonl").write_text("\n".join(lines) + ("\n\n" if size else ""))
        done += size
    return JsonlStream(str(folder))


def _parquet(folder: Path, sizes: list[int]) -> ParquetStream:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = 0
    for shard, size in enumerate(sizes):
        pq.write_table(
            pa.Table.from_pylist(_samples(size, offset=done)), folder / f"p{shard}.parquet", row_group_size=4
        )
        done += size
    return ParquetStream(str(folder))


def _generator(count: int, offset: int = 0) -> GeneratorStream:
    return GeneratorStream(lambda: iter(_samples(count, offset)))


def _hf(count: int) -> HFIterableStream:
    datasets = pytest.importorskip("datasets")
    return HFIterableStream(datasets.Dataset.from_list(_samples(count)).to_iterable_dataset(num_shards=3))


def _key(sample: dict) -> object:
    return sample["index"] if "index" in sample else tuple(sample["input_ids"])


def _read(source) -> list:
    return [_key(s) for s in source.open()]


def _check_shares(source, count: int) -> list[list]:
    """Read every share of ``count`` (and reopen each one half way): disjoint, and together the whole stream."""
    whole = _read(source)
    shares = []
    for index in range(count):
        share = source.split(index, count)
        samples = _read(share)
        reader = share.open()
        head = [_key(next(reader)) for _ in range(len(samples) // 2)]
        assert head + [_key(s) for s in share.open(reader.position)] == samples  # reopened half way
        shares.append(samples)
    flat = [key for share in shares for key in share]
    assert sorted(flat, key=repr) == sorted(whole, key=repr)  # every sample once: disjoint and covering
    assert len(set(map(repr, flat))) == len(flat)
    assert [s == _read(source.split(i, count)) for i, s in enumerate(shares)] == [True] * count  # deterministic
    return shares


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_jsonl_shares_by_bytes_cover_every_line_once(tmp_path: Path, count: int) -> None:
    shares = _check_shares(_jsonl(tmp_path, [9, 0, 13, 5]), count)  # an empty file, blank lines, 7 > 4 files
    assert all(shares)  # 27 lines: every share gets some


def test_jsonl_one_file_is_cut_into_line_ranges(tmp_path: Path) -> None:
    shares = _check_shares(_jsonl(tmp_path, [20]), 4)
    assert max(map(len, shares)) - min(map(len, shares)) <= 2  # lines of 13 to 25 bytes: about equal shares


@pytest.mark.parametrize("count", [1, 2, 5, 12])
def test_parquet_shares_by_row_group(tmp_path: Path, count: int) -> None:
    shares = _check_shares(_parquet(tmp_path, [10, 7, 13]), count)  # 3 + 2 + 4 = 9 row groups
    assert (sum(not s for s in shares) > 0) == (count > 9)  # more shares than row groups: some are empty


@pytest.mark.parametrize(
    "make", [lambda: SyntheticStream(num_samples=23, vocab_size=9), lambda: _generator(23), lambda: _hf(23)]
)
@pytest.mark.parametrize("count", [1, 2, 4])
def test_counted_sources_share_by_sample_index(make, count: int) -> None:
    shares = _check_shares(make(), count)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_mixture_splits_every_child_and_keeps_its_draws(tmp_path: Path) -> None:
    mixture = MixtureStream([_jsonl(tmp_path, [11, 6]), _generator(9, offset=100)], [0.3, 0.7], seed=4)
    _check_shares(mixture, 3)
    again = MixtureStream([_jsonl(tmp_path, [11, 6]), _generator(9, offset=100)], [0.3, 0.7], seed=4).split(1, 3)
    assert _read(again) == _read(mixture.split(1, 3))


@pytest.mark.parametrize("make", ["jsonl", "parquet", "synthetic", "generator"])
def test_a_share_splits_again_into_disjoint_pieces(tmp_path: Path, make: str) -> None:
    source = {
        "jsonl": lambda: _jsonl(tmp_path, [12, 9]),
        "parquet": lambda: _parquet(tmp_path, [12, 9]),
        "synthetic": lambda: SyntheticStream(num_samples=21, vocab_size=9),
        "generator": lambda: _generator(21),
    }[make]()
    for rank in range(2):  # a rank's share, then its loader workers' shares of it
        share = source.split(rank, 2)
        assert sorted(_read(share), key=repr) == sorted(_check_shares(share, 2)[0] + _read(share.split(1, 2)), key=repr)


@pytest.mark.parametrize("bad", [(2, 2), (-1, 2), (0, 0), (0.5, 2), (True, 2)])
def test_a_share_that_does_not_exist_is_refused_naming_the_stream(tmp_path: Path, bad: tuple) -> None:
    with pytest.raises(ValueError, match=r"JsonlStream\(.*part-00\.jsonl.*\)\.split\(index="):
        _jsonl(tmp_path, [3]).split(*bad)


def test_a_mixture_of_a_stream_without_split_is_refused_naming_the_child() -> None:
    class Plain:
        def open(self, position=None):
            return iter(())

    with pytest.raises(ValueError, match="its child Plain has no split"):
        MixtureStream([_generator(3), Plain()], [1, 1]).split(0, 2)
