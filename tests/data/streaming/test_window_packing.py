"""How a stream window is packed: full rows before the stream's end, an even last window, the tail read ahead."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.streaming.buffer import CARRY_FILL, carried_over, even_bins, stream_windows
from lit_seqpack.planning.algorithms import get_packer
from lit_seqpack.planning.plan import PlanConfig, build_plan

MAX_TOKENS = 2048


def _config(algorithm: str = "best_fit_decreasing", world_size: int = 2, accumulate: int = 2) -> PlanConfig:
    return PlanConfig(
        mode="packing",
        max_tokens=MAX_TOKENS,
        algorithm=algorithm,
        world_size=world_size,
        accumulate_grad_batches=accumulate,
        shuffle=False,
    )


def _lognormal(count: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(np.log(128), 1.0, count).astype(np.int64), 1, MAX_TOKENS)


def _stream(lengths: np.ndarray) -> GeneratorStream:
    return GeneratorStream(lambda: ({"input_ids": [1] * int(n), "index": i} for i, n in enumerate(lengths)))


def _bin_fills(planned: np.ndarray, flat: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return np.add.reduceat(planned[flat], np.concatenate(([0], ends[:-1])))


def _row_fills(window) -> list[int]:  # noqa: ANN001 - a StreamWindow
    lengths = [len(sample["input_ids"]) for sample in window.samples]
    plan = window.plan
    return [sum(lengths[i] for i in mb) for r in range(2) for mb in plan.rank_microbatches(r)]


@pytest.mark.parametrize("algorithm", ["best_fit_decreasing", "first_fit_decreasing"])
def test_carried_in_samples_are_never_carried_again_and_the_bins_kept_are_full_and_whole_steps(algorithm: str) -> None:
    config = _config(algorithm)
    planned = _lognormal(600, seed=3)
    eligible = np.ones(planned.size, dtype=bool)
    eligible[:150] = False  # carried in: small samples, the kind that ended in the least-full bins before
    planned[:150] = np.sort(planned)[:150]
    held, (flat, ends) = carried_over(planned, eligible, config, limit=200)
    assert eligible[held].all()  # no sample waits two windows
    kept = np.setdiff1d(np.arange(planned.size), held)
    assert sorted(kept[flat].tolist()) == kept.tolist()  # every sample once: kept or held
    assert ends.size % config.slots_per_step == 0  # whole optimizer steps: no bin split into two half-empty ones
    assert _bin_fills(planned[kept], flat, ends).min() >= CARRY_FILL * MAX_TOKENS
    assert held.size <= 200


def test_at_most_limit_samples_are_carried_and_one_bin_is_always_kept() -> None:
    config = _config()
    planned = np.full(40, 100)  # 2 bins: one of 20 samples full, one of 20 samples at 2,000 / 2,048
    assert carried_over(planned, np.ones(40, dtype=bool), config, limit=5)[0].size == 0
    small = np.array([100, 50])  # one bin far from full: never carried away (nothing would train)
    held, (flat, ends) = carried_over(small, np.ones(2, dtype=bool), config, limit=5)
    assert held.size == 0 and ends.tolist() == [2]


def test_even_bins_match_the_packers_count_in_whole_steps_and_spread_the_tokens() -> None:
    config = _config()
    planned = _lognormal(700, seed=5)
    flat, ends = even_bins(planned, config)
    bins = get_packer("best_fit_decreasing", MAX_TOKENS).count_bins(planned)
    assert ends.size == -(-bins // config.slots_per_step) * config.slots_per_step
    assert sorted(flat.tolist()) == list(range(planned.size))
    fills = _bin_fills(planned, flat, ends)
    assert fills.max() <= MAX_TOKENS
    assert fills.min() >= fills.mean() - 0.01 * MAX_TOKENS  # no half-empty bin: the leftover is spread
    best_fit = get_packer("best_fit_decreasing", MAX_TOKENS, bin_count_multiple=config.slots_per_step)
    assert _bin_fills(planned, *best_fit.pack_flat(planned)).min() < 0.9 * MAX_TOKENS  # what it replaces


def test_even_bins_refuse_what_would_overfill_a_bin() -> None:
    config = PlanConfig(mode="packing", max_tokens=10, shuffle=False)
    assert even_bins(np.array([6, 4, 3, 3, 2, 2]), config) is None  # best fit 6+4, 3+3+2+2; dealt: 6+3+2 = 11


def _windows(lengths: np.ndarray, config: PlanConfig, window_size: int) -> list:
    return list(stream_windows(_stream(lengths).open(), config=config, window_size=window_size, epoch=0))


def test_every_row_before_the_last_window_is_nearly_full_and_the_last_window_is_even() -> None:
    config = _config()
    lengths = _lognormal(5000, seed=2)  # best fit alone leaves a last row of 526 tokens here
    windows = _windows(lengths, config, window_size=500)
    for window in windows[:-1]:
        assert min(_row_fills(window)) >= CARRY_FILL * MAX_TOKENS, window.index
    last = _row_fills(windows[-1])
    assert min(last) >= 0.9 * MAX_TOKENS, last  # the stream's leftover spread over the last rows
    seen = Counter(s["index"] for w in windows for r in range(2) for mb in w.plan.rank_microbatches(r)
                   for s in (w.samples[i] for i in mb))  # fmt: skip
    assert seen == Counter(range(lengths.size))  # every sample once
    offline = build_plan(lengths, config, epoch=0).microbatches_per_rank
    assert sum(w.plan.microbatches_per_rank for w in windows) <= offline + config.accumulate_grad_batches


@pytest.mark.parametrize("count", [499, 500, 750, 1000, 1150, 1250, 1251, 1700, 2600])
def test_a_short_tail_joins_the_window_before_it(count: int) -> None:
    """Windows of 500 read 250 ahead: a stream ending within them makes that window its last, so the last window
    (unless it is the first) holds at least 250 samples read after the window before it."""
    planned = _windows(_lognormal(count, seed=2), _config(), window_size=500)
    assert sum(len(w.samples) for w in planned) == count
    last = planned[-1]
    assert last.samples_read == count
    if len(planned) > 1:
        assert last.samples_read - planned[-2].samples_read >= 250
    reads = [w.samples_read for w in planned]
    assert all(w.first_sample == r for w, r in zip(planned[1:], reads, strict=False))  # read ahead: the next's


def test_a_window_read_ahead_is_resumed_from_its_own_start() -> None:
    """The samples read ahead belong to the next window: its record starts before them, so a resume re-reads them."""
    config, lengths = _config(), _lognormal(1600, seed=4)
    whole = _windows(lengths, config, window_size=500)
    second = whole[1]
    reader = _stream(lengths).open()
    for _ in range(second.first_sample):
        next(reader)
    resumed = next(
        stream_windows(
            reader,
            config=config,
            window_size=500,
            epoch=0,
            start=(second.index, second.first_sample, second.first_microbatch, second.first_step),
            carried=list(second.carried_in),
        )
    )
    assert [s["index"] for s in resumed.samples] == [s["index"] for s in second.samples]
    assert resumed.plan.rank_microbatches(0) == second.plan.rank_microbatches(0)


def test_a_shuffled_packer_packs_each_epoch_its_own_way() -> None:
    config = dataclasses.replace(_config("first_fit_shuffle"), shuffle=True)
    lengths = _lognormal(900, seed=6)

    def bins(epoch: int) -> list[list[int]]:
        windows = stream_windows(_stream(lengths).open(), config=config, window_size=400, epoch=epoch)
        return sorted(sorted(w.samples[i]["index"] for i in mb) for w in windows for r in range(2)
                      for mb in w.plan.rank_microbatches(r))  # fmt: skip

    assert bins(0) == bins(0)  # deterministic (a resume re-plans the same window)
    assert bins(0) != bins(1)
