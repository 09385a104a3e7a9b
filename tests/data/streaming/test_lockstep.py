"""Lock step of shares read by rank, with ranks simulated by threads (the collective is a barrier): every sample once,
the same microbatches on every rank, one normaliser a step, shares that end early fill, an exact resume from the
gathered state, and a refused resume on another layout."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.streaming.dataset import StreamingDataset
from lit_seqpack.data.streaming.loader import LockStep, ShareFacts, StreamingDataLoader, _data_parallel, gather_object
from lit_seqpack.parallel import ParallelLayout
from lit_seqpack.planning.plan import PlanConfig
from tests._limits import COLLECTIVE_TIMEOUT, SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ACCUMULATE, MAX_TOKENS = 2, 256


class ThreadGather:
    """``all_gather_object`` for ``world`` threads."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=COLLECTIVE_TIMEOUT.total_seconds())
        self.slots: list[Any] = [None] * world

    def of(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            self.slots[rank] = value
            self.barrier.wait()
            everyone = list(self.slots)
            self.barrier.wait()
            return everyone

        return gather


class Shares:
    """A stream whose shares are given lists of sample numbers (shares of unequal length)."""

    def __init__(self, shares: list[list[int]]) -> None:
        self.shares = shares

    def open(self, position: Any = None) -> Any:
        raise AssertionError("only its shares are read")

    def split(self, index: int, count: int) -> GeneratorStream:
        assert count == len(self.shares)
        return GeneratorStream(lambda: ({"input_ids": [1] * (2 + n % 40), "index": n} for n in self.shares[index]))


def _collate(microbatch: Any) -> dict[str, Any]:
    meta = microbatch.meta
    return {
        "indices": [s["index"] for s in microbatch],
        "loss_tokens": meta.loss_tokens,
        "step_loss_tokens": meta.step_loss_tokens,
        "step": meta.step,
        "is_empty": meta.is_empty,
        "world_size": meta.world_size,
    }


def _loader(
    source: Any, rank: int, world: int, gather: ThreadGather, workers: int = 0, **options: Any
) -> StreamingDataLoader:
    dataset = StreamingDataset(
        source.split(rank, world),
        config=PlanConfig(mode="packing", max_tokens=MAX_TOKENS, accumulate_grad_batches=ACCUMULATE),
        rank=0,
        window_size=16,
        collator=_collate,
        data_parallel=(rank, world),
    )
    return StreamingDataLoader(dataset, num_workers=workers, gather=gather.of(rank), **options)


def _run(world: int, task: Callable[[int, ThreadGather], Any]) -> list[Any]:
    """``task(rank, gather)`` on ``world`` threads; their results (or the exception each raised)."""
    gather, results = ThreadGather(world), [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = task(rank, gather)
        except Exception as err:  # noqa: BLE001 - compared by the test
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SUBPROCESS_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    return results


def _check(per_rank: list[list[dict[str, Any]]], samples: set[int]) -> None:
    assert len({len(batches) for batches in per_rank}) == 1  # lock step
    assert Counter(i for batches in per_rank for b in batches for i in b["indices"]) == Counter(samples)
    for position in range(0, len(per_rank[0]), ACCUMULATE):
        step = [b for batches in per_rank for b in batches[position : position + ACCUMULATE]]
        assert {b["step_loss_tokens"] for b in step} == {sum(b["loss_tokens"] for b in step)}
        assert {b["world_size"] for b in step} == {len(per_rank)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shares_read_by_rank_train_every_sample_once_in_lock_step(world: int) -> None:
    source = GeneratorStream(lambda: ({"input_ids": [1] * (2 + n * 37 % 200), "index": n} for n in range(150)))
    _check(_run(world, lambda rank, gather: list(_loader(source, rank, world, gather))), set(range(150)))


def test_shares_of_unequal_length_fill_until_every_share_ended_and_an_empty_share_fills_throughout() -> None:
    shares = [list(range(0, 3)), list(range(3, 90)), [], list(range(90, 130))]
    per_rank = _run(4, lambda rank, gather: list(_loader(Shares(shares), rank, 4, gather)))
    _check(per_rank, set(range(130)))
    assert all(b["is_empty"] for b in per_rank[2])
    fillers = [sum(b["is_empty"] for b in batches) for batches in per_rank]
    assert fillers[0] > fillers[3] > fillers[1]


class FailingShares(Shares):
    """Rank 1's share raises at its 40th sample (a bad line, an over-long sample): inside its third window."""

    def split(self, index: int, count: int) -> GeneratorStream:
        def samples() -> Any:
            for n in self.shares[index]:
                if index == 1 and n == 90:
                    raise ValueError("data.jsonl: byte 1234: not a JSON line")
                yield {"input_ids": [1] * (2 + n % 40), "index": n}

        return GeneratorStream(samples)


def test_a_share_that_fails_to_read_raises_on_every_rank_naming_the_rank() -> None:
    errors = _run(
        2, lambda rank, gather: list(_loader(FailingShares([list(range(50)), list(range(50, 130))]), rank, 2, gather))
    )
    assert isinstance(errors[1], ValueError) and "not a JSON line" in str(errors[1])
    assert isinstance(errors[0], RuntimeError)
    assert "failed on rank(s) [1] (rank 1: ValueError: data.jsonl: byte 1234: not a JSON line)" in str(errors[0])


def test_an_empty_stream_is_refused_on_every_rank_naming_it() -> None:
    errors = _run(2, lambda rank, gather: list(_loader(Shares([[], []]), rank, 2, gather)))
    assert all(isinstance(e, ValueError) and "gave no microbatch in epoch 0" in str(e) for e in errors), errors


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_from_the_gathered_state_continues_every_share_exactly(workers: int) -> None:
    shares = [list(range(0, 50)), list(range(50, 130))]
    whole = _run(2, lambda rank, gather: list(_loader(Shares(shares), rank, 2, gather, workers)))  # lanes: W matters
    _check(whole, set(range(130)))
    cut = 2 * ACCUMULATE + 1  # inside an optimizer step: the loader resumes where it stopped

    def first_part(rank: int, gather: ThreadGather) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        loader = _loader(Shares(shares), rank, 2, gather, workers)
        batches = iter(loader)
        head = [next(batches) for _ in range(cut)]
        return head, loader.state_dict()

    parts = _run(2, first_part)
    assert parts[0][1]["shares"] == parts[1][1]["shares"] and len(parts[0][1]["shares"]) == 2

    def resumed(rank: int, gather: ThreadGather) -> list[dict[str, Any]]:
        loader = _loader(Shares(shares), rank, 2, gather, workers)
        loader.load_state_dict(parts[0][1])  # rank 0's checkpoint resumes every rank
        return list(loader)

    rest = _run(2, resumed)
    assert [parts[rank][0] + rest[rank] for rank in range(2)] == whole


def test_a_state_of_another_layout_is_refused_naming_it() -> None:
    states = _run(2, lambda rank, gather: _loader(Shares([[1], [2]]), rank, 2, gather).state_dict())
    three = _loader(Shares([[1], [2], [3]]), 0, 3, ThreadGather(1))
    with pytest.raises(ValueError, match=r"stream_split='rank' on 2 ranks, this run reads stream_split='rank' on 3"):
        three.load_state_dict(states[0])
    replicated = {k: v for k, v in states[0].items() if k != "shares"}
    with pytest.raises(ValueError, match=r"written with stream_split='replicate'"):
        _loader(Shares([[1], [2]]), 0, 2, ThreadGather(1)).load_state_dict(replicated)


def _everyone(layout: ParallelLayout, processes: int, values: list[Any]) -> list[tuple[int, Any]]:
    """What ``all_gather_object`` returns to every process: each global rank's (data-parallel rank, value)."""
    return [(layout.coordinates(rank).data_parallel_rank, values[rank]) for rank in range(processes)]


@pytest.mark.parametrize("layout", [ParallelLayout(tensor_parallel_size=2), ParallelLayout(context_parallel_size=2)])
def test_one_value_per_data_parallel_rank_of_2_data_x_2_model_parallel_processes(layout: ParallelLayout) -> None:
    facts = [ShareFacts(epoch=0, step_loss_tokens=(5,)), ShareFacts(epoch=0, ended=True)]
    everyone = _everyone(layout, 4, [facts[0], facts[0], facts[1], facts[1]])  # model-parallel ranks innermost
    assert _data_parallel(everyone, world_size=2) == facts
    lock = LockStep(rank=1, world_size=2, epoch=0, gather=lambda value: _data_parallel(everyone, 2))
    lock.exchange()
    assert lock.known == [1, 0] and lock.ended == [False, True] and lock.step_loss_tokens(0) == 5


def test_a_mesh_with_the_model_parallel_dimension_outermost_keeps_each_data_parallel_rank() -> None:
    # mesh ("tensor_parallel", "data_parallel"): global ranks 0 and 2 are data-parallel rank 0, 1 and 3 rank 1
    assert _data_parallel([(0, "a"), (1, "b"), (0, "a"), (1, "b")], world_size=2) == ["a", "b"]


def test_processes_that_do_not_form_the_data_parallel_ranks_or_disagree_raise_naming_the_global_ranks() -> None:
    with pytest.raises(
        RuntimeError, match=r"3 processes cannot hold 2 data-parallel ranks of equal size.*\{0: \[0, 1\]"
    ):
        _data_parallel([(0, "a"), (0, "a"), (1, "b")], world_size=2)
    with pytest.raises(RuntimeError, match=r"cannot hold 2 data-parallel ranks.*\{0: \[0, 1\], 2: \[2, 3\]\}"):
        _data_parallel([(0, "a"), (0, "a"), (2, "b"), (2, "b")], world_size=2)
    failed = ShareFacts(epoch=0, error="ValueError: bad line")
    with pytest.raises(RuntimeError, match=r"data-parallel rank 1 \(global ranks \[2, 3\]\) read different stream"):
        _data_parallel([(0, "a"), (0, "a"), (1, ShareFacts(epoch=0)), (1, failed)], world_size=2)


def test_gather_object_without_a_process_group_is_this_ranks_value() -> None:
    assert gather_object({"steps": 3}, world_size=2, rank=1) == [{"steps": 3}]


def test_values_holding_arrays_are_compared_without_an_ambiguous_truth_value() -> None:
    record = {"window": 0, "carried": [{"input_ids": np.arange(3)}]}
    assert _data_parallel([(0, record), (0, record)], world_size=1) == [record]
    other = {"window": 0, "carried": [{"input_ids": np.arange(4)}]}
    with pytest.raises(RuntimeError, match="read different stream shares"):
        _data_parallel([(0, record), (0, other)], world_size=1)


def test_the_over_long_summary_of_a_share_says_which_rank_it_counts(caplog: pytest.LogCaptureFixture) -> None:
    """Each rank counts the over-long samples of its own share, numbered in the share: the epoch's log says whose."""
    shares = [list(range(0, 40)), list(range(40, 80))]

    def task(rank: int, gather: ThreadGather) -> list[Any]:
        source = Shares(shares).split(rank, 2)

        def samples() -> Any:
            return ({**s, "input_ids": [1] * 300} if s["index"] == 50 else s for s in source.open())

        long = GeneratorStream(samples)
        dataset = StreamingDataset(
            long,
            config=PlanConfig(mode="packing", max_tokens=MAX_TOKENS),
            rank=0,
            window_size=16,
            collator=_collate,
            overlong="truncate",
            data_parallel=(rank, 2),
        )
        return list(StreamingDataLoader(dataset, gather=gather.of(rank)))

    with caplog.at_level("WARNING", logger="lit_seqpack.data.streaming.loader"):
        _run(2, task)
    summaries = [r.getMessage() for r in caplog.records if "longer than max_tokens" in r.getMessage()]
    assert summaries == ["lit_seqpack: stream epoch 0, rank 1's share: 1 of 40 samples are longer than max_tokens=256 "
                         "(first: #10: 300); overlong='truncate' cut 1 samples (44 tokens)"]  # fmt: skip
