"""The rank's streaming dataset: the same batches with any worker count, and the exact loss on two ranks."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.sources import GeneratorStream, JsonlStream, ParquetStream
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import StreamingDataLoader
from lit_seqpack.planning.plan import PlanConfig
from tests.model.test_exact_loss import assert_gradients_match, make_module, make_samples, reference_gradients

SAMPLES = make_samples(count=90, seed=5)


class WithIndices:
    """The collator, plus the stream numbers of the batch's samples."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self.collate(samples)
        batch["sample_indices"] = [int(s["index"]) for s in samples]
        return batch


def _source() -> GeneratorStream:
    return GeneratorStream(lambda: ({**s, "index": i} for i, s in enumerate(SAMPLES)))


def _dataset(mode: str, rank: int = 0, world: int = 1, buffer: int = 25) -> StreamingDataset:
    budget = {"max_tokens": 48} if mode != "padded" else {"batch_size": 3}
    config = PlanConfig(mode=mode, world_size=world, accumulate_grad_batches=2, seed=1, **budget)
    collate = PackedCollator() if mode == "packing" else PaddedCollator()
    return StreamingDataset(_source(), config=config, rank=rank, window_size=buffer, collator=WithIndices(collate))


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_workers_give_the_batches_of_the_main_process_in_order(mode: str) -> None:
    plain = [b["sample_indices"] for b in StreamingDataLoader(_dataset(mode))]
    with_workers = [b["sample_indices"] for b in StreamingDataLoader(_dataset(mode), num_workers=2)]
    assert with_workers == plain
    assert sorted(i for b in plain for i in b) == list(range(len(SAMPLES)))


def _indexed_samples() -> Iterator[dict[str, Any]]:
    """``SAMPLES`` with their stream numbers (a module-level function: a ``spawn`` worker unpickles it by name)."""
    return ({**s, "index": i} for i, s in enumerate(SAMPLES))


def _stream_batches(source: Any, **loader: Any) -> list[list[int]]:
    """The sample numbers of each packed batch a loader over ``source`` yields (``loader``: its arguments)."""
    config = PlanConfig(max_tokens=48, accumulate_grad_batches=2, seed=1)
    collator = WithIndices(PackedCollator())
    dataset = StreamingDataset(source, config=config, rank=0, window_size=25, collator=collator, check_samples=4)
    return [b["sample_indices"] for b in StreamingDataLoader(dataset, **loader)]


@pytest.mark.slow
def test_a_dataset_pickled_into_a_spawned_worker_gives_the_batches_of_the_main_process(tmp_path: Path) -> None:
    """A worker started with ``spawn`` (macOS, ``multiprocessing_context="spawn"``; Python 3.14 defaults to
    ``forkserver``) unpickles the dataset. The DDP tests' ranks fork their workers (``tests/_ranks.py``), so the
    streams they read are checked here: one in a real spawned worker, the others (the shares of files read by rank)
    through the same pickle round trip, which is what such a worker receives."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(_indexed_samples())
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet", row_group_size=30)
    generator = GeneratorStream(_indexed_samples)
    plain = _stream_batches(generator)
    assert sorted(i for b in plain for i in b) == list(range(len(SAMPLES)))
    assert _stream_batches(generator, num_workers=1, multiprocessing_context="spawn") == plain
    for share in (JsonlStream(str(tmp_path / "data.jsonl")), ParquetStream(str(tmp_path / "data.parquet"))):
        share = share.split(1, 2)
        read = _stream_batches(share)
        assert read and _stream_batches(pickle.loads(pickle.dumps(share))) == read, share


def test_the_stream_facts_never_reach_the_model() -> None:
    batch = next(iter(StreamingDataLoader(_dataset("packing"))))
    assert not any(key.startswith("_") for key in batch)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_streamed_step_on_two_ranks_has_the_gradient_of_the_big_padded_batch(mode: str) -> None:
    """Each rank's first optimizer step (2 microbatches) from the stream; Lightning's /2 and DDP's mean by hand."""
    module = make_module("reference").double()
    per_rank, step_samples, normalisers = [], [], set()
    for rank in range(2):
        batches = iter(StreamingDataLoader(_dataset(mode, rank=rank, world=2)))
        replica = copy.deepcopy(module)
        for batch in (next(batches), next(batches)):
            step_samples += [SAMPLES[i] for i in batch.pop("sample_indices")]
            normalisers.add(batch["step_loss_tokens"])
            (replica.training_step(batch, 0) / 2).backward()
        per_rank.append({name: p.grad for name, p in replica.named_parameters()})
    expected_tokens = sum(sum(label != -100 for label in s["labels"][1:]) for s in step_samples)
    assert normalisers == {expected_tokens}  # known from the window's plan on every rank, no collective
    expected = reference_gradients(module, step_samples)
    averaged = {name: (per_rank[0][name] + per_rank[1][name]) / 2 for name in expected}
    assert_gradients_match(averaged, expected, rtol=1e-5)


def test_a_rank_outside_the_plan_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        _dataset("packing", rank=2, world=2)


def test_an_id_outside_the_model_vocabulary_is_refused_naming_the_window() -> None:
    config = PlanConfig(mode="packing", max_tokens=48)
    dataset = StreamingDataset(
        _source(), config=config, rank=0, window_size=25, collator=PackedCollator(), vocab_size=8
    )
    with pytest.raises(ValueError, match=r"outside the model's vocab_size=8"):
        next(iter(StreamingDataLoader(dataset)))


def test_persistent_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True would keep"):
        StreamingDataLoader(_dataset("packing"), num_workers=1, persistent_workers=True)
