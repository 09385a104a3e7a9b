"""Lanes: under ``stream_split="rank"`` each DataLoader worker reads only its own lane of the rank's share (ranks
simulated by threads): every sample once in lock step, each sample parsed by one worker only, an exact resume at the
same ``num_workers`` and a refused one at another, and ``lit-seqpack inspect`` planning the lanes as the workers do."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import (
    GeneratorStream,
    JsonlStream,
    MixtureStream,
    ParquetStream,
    SyntheticStream,
    file_streams,
)
from lit_seqpack.data.sources.litdata import LitDataStream, write_litdata
from lit_seqpack.data.streaming.lanes import LaneHistory, lane_source
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.parallel import DataParallelLayout
from tests._limits import TEST_TIMEOUT_S
from tests.data.streaming.test_lockstep import Shares, ThreadGather, _check, _run
from tests.data.streaming.test_lockstep import _loader as lockstep_loader
from tests.data.streaming.test_prefix import ACCUMULATE as PREFIX_ACCUMULATE
from tests.data.streaming.test_prefix import WORLD, _inspect, _stream
from tests.data.streaming.test_prefix import _module as _prefix_module

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

SHARES = [list(range(0, 60)), list(range(60, 190))]  # rank 0's share ends first: it fills while rank 1 trains


def _loader(source: Any, rank: int, world: int, gather: ThreadGather, workers: int) -> StreamingDataLoader:
    context = "fork" if workers else None  # the parse counter below is inherited by forked workers
    return lockstep_loader(source, rank, world, gather, workers, multiprocessing_context=context)


def _train(source: Any, workers: int, world: int = 2) -> list[list[dict[str, Any]]]:
    per_rank = _run(world, lambda rank, gather: list(_loader(source, rank, world, gather, workers)))
    assert not any(isinstance(batches, Exception) for batches in per_rank), per_rank
    return per_rank


@pytest.mark.parametrize("workers", [2, 3])
def test_lanes_train_every_sample_once_in_lock_step_with_the_step_totals_over_ranks(workers: int) -> None:
    per_rank = _train(Shares(SHARES), workers)
    _check(per_rank, set(range(190)))  # lock step, every sample once, step_loss_tokens = the step's total
    assert sum(b["is_empty"] for b in per_rank[0]) > sum(b["is_empty"] for b in per_rank[1])
    assert per_rank != _train(Shares(SHARES), 0)  # the lanes' windows, not the share's: another (exact) order


def test_every_epoch_reads_the_lanes_again_every_sample_once() -> None:
    stream = GeneratorStream(lambda: ({"input_ids": [1] * (2 + n * 37 % 200), "index": n} for n in range(150)))

    def epochs(rank: int, gather: ThreadGather) -> list[list[dict[str, Any]]]:
        loader = _loader(stream, rank, 2, gather, 2)
        return [list(loader), list(loader)]

    first, second = zip(*_run(2, epochs), strict=True)
    _check(list(first), set(range(150)))
    _check(list(second), set(range(150)))
    _check(_train(stream, 2, world=1), set(range(150)))  # one rank reads its stream in lanes too


def _jsonl(tmp_path: Path, count: int) -> str:
    lines = [json.dumps({"input_ids": [1 + n % 7] * (2 + n * 37 % 120), "index": n}) for n in range(count)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_each_worker_parses_only_its_lane_of_the_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "parsed.log"
    parse = file_streams._with_token_arrays

    def counted(sample: Any, line: bytes) -> Any:  # every JSONL line parsed, by which process
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()} {sample['index']}\n")
        return parse(sample, line)

    monkeypatch.setattr(file_streams, "_with_token_arrays", counted)
    per_rank = _train(JsonlStream(_jsonl(tmp_path, 200)), 2)
    _check(per_rank, set(range(200)))
    parsed = [line.split() for line in log.read_text().splitlines()]
    assert Counter(int(index) for _, index in parsed) == Counter(range(200))  # each line parsed once, not per worker
    processes = Counter(pid for pid, _ in parsed)
    assert len(processes) == 4 and str(os.getpid()) not in processes  # 2 ranks x 2 workers, each parsing its lane


@pytest.mark.parametrize("cut", [1, 3, 4, 6, 8, 9, 12, 15])  # in windows, at their ends, in fillers
def test_a_mid_epoch_resume_at_the_same_num_workers_continues_exactly(cut: int) -> None:
    whole = _train(Shares(SHARES), 2)
    assert cut < len(whole[0])

    def first_part(rank: int, gather: ThreadGather) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        loader = _loader(Shares(SHARES), rank, 2, gather, 2)
        batches = iter(loader)
        head = [next(batches) for _ in range(cut)]
        return head, loader.state_dict()

    parts = _run(2, first_part)
    assert parts[0][1]["shares"] == parts[1][1]["shares"] and parts[0][1]["num_workers"] == 2

    def resumed(rank: int, gather: ThreadGather) -> list[dict[str, Any]]:
        loader = _loader(Shares(SHARES), rank, 2, gather, 2)
        loader.load_state_dict(parts[0][1])  # rank 0's checkpoint resumes every rank
        return list(loader)

    rest = _run(2, resumed)
    assert [parts[rank][0] + rest[rank] for rank in range(2)] == whole


@pytest.mark.parametrize(("written", "resumed"), [(2, 1), (2, 3), (1, 2)])
def test_a_resume_with_another_num_workers_is_refused_naming_it(written: int, resumed: int) -> None:
    state = _loader(GeneratorStream(lambda: iter(())), 0, 1, ThreadGather(1), written).state_dict()
    loader = _loader(GeneratorStream(lambda: iter(())), 0, 1, ThreadGather(1), resumed)
    said = written if written > 1 else "0 or 1"
    with pytest.raises(ValueError, match=rf"written with num_workers={said}.*resume with num_workers={said}"):
        loader.load_state_dict(state)


def _module(source: Any, **kwargs: Any) -> SeqPackDataModule:
    settings = {"window": 30, "max_tokens": 128, "num_workers": 2, "stream_split": "rank"} | kwargs
    return SeqPackDataModule(source=source, **settings)


def test_the_datamodule_resumes_its_lanes_exactly_and_refuses_another_num_workers(tmp_path: Path) -> None:
    stream = JsonlStream(_jsonl(tmp_path, 160), vocab_size=8)
    cut = {"max_tokens": 64, "overlong": "truncate"}  # the over-long counts are summed over the lanes
    whole = _module(stream, **cut)
    reference = [b["input_ids"].tolist() for b in whole.train_dataloader()]
    counted = whole.overlong_report
    assert counted is not None and counted.num_samples == 160 and counted.num_truncated > 0
    first = _module(stream, **cut)
    batches = iter(first.train_dataloader())
    head = [next(batches)["input_ids"].tolist() for _ in range(7)]
    state = first.state_dict()
    resumed = _module(stream, **cut)
    resumed.load_state_dict(state)
    assert head + [b["input_ids"].tolist() for b in resumed.train_dataloader()] == reference
    assert resumed.overlong_report == counted
    other = _module(stream, num_workers=1, **cut)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"num_workers=2 .*this run has num_workers=1"):
        other.train_dataloader()


def test_a_stream_that_splits_itself_among_workers_is_refused_naming_num_workers() -> None:
    datasets = pytest.importorskip("datasets")
    from lit_seqpack.data.sources import HFIterableStream

    hf = HFIterableStream(datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 4}).to_iterable_dataset(num_shards=2))
    for source in (hf, MixtureStream([GeneratorStream(lambda: iter(())), hf], [1, 1])):
        with pytest.raises(ValueError, match=r"num_workers=2 .*splits itself among DataLoader workers.*num_workers=0"):
            lane_source(source, 0, 2)
    assert lane_source(hf, 0, 1) is hf  # one lane (num_workers=1): the share itself


def test_the_history_keeps_one_record_a_lane_before_its_last_arrivals() -> None:
    history = LaneHistory(2, kept=2)
    for n in range(4):  # lanes 0, 1, 0, 1; 2 microbatches (1 step) each
        item = {"microbatches": 2, "step_loss_tokens": (5,), "overlong_after": {"read": n}}
        history.arrive(
            n % 2, {"window": n // 2, "overlong_before": {"read": n - 1}}, microbatch=2 * n, step=n, item=item
        )
    assert [e["record"]["window"] for e in history.base] == [0, 0] and len(history.arrivals) == 2
    start = history.start_at(5)  # inside the 3rd window (lane 0's second): lane 0 first, from its microbatch 1
    assert (start.first, start.microbatch, start.step) == (0, 4, 2)
    assert start.lanes[0] == {
        "record": {"window": 1, "overlong_before": {"read": 1}},
        "skip": 1,
        "overlong": {"read": 1},
    }
    assert start.lanes[1]["skip"] == 2 and start.lanes[1]["overlong"] == {"read": 1}  # its window 0, read in full
    end = history.start_at(8)  # after the last window: lane 0 goes on first
    assert (end.first, end.microbatch, end.step) == (0, 8, 4)
    with pytest.raises(RuntimeError, match="no window starting at or before it"):
        history.start_at(3)


def test_inspect_plans_each_lane_as_the_loader_workers_do(tmp_path: Path) -> None:
    folder = _stream(tmp_path)

    def drain(rank: int, gather: ThreadGather) -> list[dict[str, Any]]:
        pipeline = _prefix_module(folder, num_workers=2).pipeline
        pipeline.layout = DataParallelLayout(WORLD, rank, PREFIX_ACCUMULATE)
        loader = pipeline.train_loader()
        loader.gather = gather.of(rank)
        return list(loader)

    per_rank = _run(WORLD, drain)
    assert not any(isinstance(batches, Exception) for batches in per_rank), per_rank
    trained = len(per_rank[0])
    report = _inspect(folder, "--max_samples=1000", "--data.num_workers=2")  # the whole of each lane
    assert f"train them in {trained} microbatches a rank in lock step" in report
    assert "of each of the 2 lanes its loader workers read" in report
    shares = next(line for line in report.splitlines() if line.startswith("stream shares: "))
    for rank, batches in enumerate(per_rank):
        documents, empty = sum(int(b["num_documents"]) for b in batches), sum(bool(b["is_empty"]) for b in batches)
        assert f"rank {rank}: {documents} samples, {empty} of {trained} microbatches empty" in shares


def test_an_error_names_the_sample_in_its_lane() -> None:
    samples = [{"input_ids": [1] * (0 if n == 5 else 3), "index": n} for n in range(40)]
    per_rank = _run(1, lambda rank, gather: list(_loader(GeneratorStream(lambda: iter(samples)), 0, 1, gather, 2)))
    assert isinstance(per_rank[0], Exception), per_rank  # sample 5 is sample 2 of lane 1 (samples 1, 3, 5, ...)
    assert "sample 2 of lane 1 of the stream has no token" in str(per_rank[0])


def _by_tokens(microbatch: Any) -> dict[str, Any]:
    """The test collator, each sample named by its tokens (streams without an index)."""
    meta = microbatch.meta
    return {
        "indices": [tuple(int(t) for t in s["input_ids"]) for s in microbatch],
        "loss_tokens": meta.loss_tokens,
        "step_loss_tokens": meta.step_loss_tokens,
        "is_empty": meta.is_empty,
        "world_size": meta.world_size,
    }


def _sources(tmp_path: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input_ids": [1 + n % 7] * (2 + n * 37 % 120), "labels": [n % 5] * (2 + n * 37 % 120)} for n in range(150)]
    for part in range(3):
        pq.write_table(
            pa.Table.from_pylist(rows[part * 50 : (part + 1) * 50]), tmp_path / f"p{part}.parquet", row_group_size=10
        )
    sources = {
        "parquet": ParquetStream(str(tmp_path)),
        "synthetic": SyntheticStream(num_samples=150, vocab_size=50, median_length=40, max_length=200),
        "mixture": MixtureStream(
            [SyntheticStream(num_samples=60, max_length=200, seed=1), ParquetStream(str(tmp_path))], [1, 2]
        ),
    }
    if importlib.util.find_spec("litdata") is not None:
        write_litdata(rows, tmp_path / "litdata", chunk_bytes=4096)
        sources["litdata"] = LitDataStream(str(tmp_path / "litdata"))
    return sources


@pytest.mark.parametrize("kind", ["parquet", "synthetic", "mixture", "litdata"])
def test_every_source_is_read_in_lanes_every_sample_once(tmp_path: Path, kind: str) -> None:
    sources = _sources(tmp_path)
    if kind not in sources:
        pytest.skip("litdata is not installed")
    source = sources[kind]

    def drain(rank: int, gather: ThreadGather) -> list[dict[str, Any]]:
        loader = _loader(source, rank, 2, gather, 2)
        loader.dataset.collator = _by_tokens
        return list(loader)

    per_rank = _run(2, drain)
    assert not any(isinstance(batches, Exception) for batches in per_rank), per_rank
    _check(per_rank, [tuple(int(t) for t in s["input_ids"]) for s in source.open()])


@pytest.mark.parametrize("split", ["replicate", "rank"])
def test_a_stream_that_splits_itself_among_workers_is_refused_under_either_split(split: str) -> None:
    """Under "replicate" every worker reads the whole stream and keeps every W-th microbatch: a Hugging Face
    IterableDataset read its own shards in each worker instead, and 98 of 200 documents trained without an error."""
    datasets = pytest.importorskip("datasets")
    from lit_seqpack.data.sources import HFIterableStream

    rows = datasets.Dataset.from_dict({"input_ids": [[1 + i % 7] * (2 + i % 5) for i in range(200)]})
    hf = HFIterableStream(rows.to_iterable_dataset(num_shards=4), vocab_size=8)
    module = SeqPackDataModule(source=hf, max_tokens=32, num_workers=2, stream_split=split)
    with pytest.raises(ValueError, match=r"num_workers=2.* splits itself among DataLoader workers"):
        module.train_dataloader()
    one = SeqPackDataModule(source=hf, max_tokens=32, num_workers=1, stream_split=split)
    assert sum(int(b["num_documents"]) for b in one.train_dataloader()) == 200  # one worker reads it all
