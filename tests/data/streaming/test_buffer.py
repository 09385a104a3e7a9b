"""The bounded look-ahead buffer: windows planned for every rank, every sample once, memory bounded by the buffer."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest

from lit_seqpack.data.batching.overlong import apply_overlong_policy
from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.data.streaming.buffer import OverlongCounter, stream_windows
from lit_seqpack.planning.plan import PlanConfig, build_plan

CONFIG = PlanConfig(
    mode="packing", max_tokens=256, algorithm="best_fit_decreasing", world_size=2, accumulate_grad_batches=3
)


def _lognormal(count: int, seed: int = 0, cap: int = 256) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(3.5, 1.0, count).astype(np.int64), 1, cap)


def _stream(lengths: np.ndarray) -> GeneratorStream:
    return GeneratorStream(lambda: ({"input_ids": [1] * int(n), "index": i} for i, n in enumerate(lengths)))


def test_every_sample_once_in_lock_step_and_each_step_knows_its_loss_tokens() -> None:
    lengths = _lognormal(1003)
    windows = list(stream_windows(_stream(lengths).open(), config=CONFIG, window_size=100, epoch=0))
    held = [len(w.samples) + len(after.carried_in) for w, after in zip(windows, windows[1:], strict=False)]
    assert max(held) == 100  # planned + carried on: never more than the buffer
    assert sum(len(w.carried_in) for w in windows) > 0  # the least-full bins wait for the next window
    seen: Counter[int] = Counter()
    first_microbatch = 0
    for window in windows:
        plan = window.plan
        assert window.first_microbatch == first_microbatch
        first_microbatch += plan.microbatches_per_rank
        assert plan.microbatches_per_rank % CONFIG.accumulate_grad_batches == 0  # whole steps in every window
        per_rank = [plan.rank_microbatches(rank) for rank in range(CONFIG.world_size)]
        assert len({len(r) for r in per_rank}) == 1
        for step in range(plan.num_steps):
            groups = plan.step_microbatches(step)
            loss = sum(int(window.loss_tokens[i]) for rank in groups for mb in rank for i in mb)
            assert plan.step_loss_tokens[step] == loss  # the exact-loss normaliser, from this window alone
        seen.update(window.samples[i]["index"] for rank in per_rank for mb in rank for i in mb)
    assert seen == Counter(range(1003))


def test_a_stream_shorter_than_a_step_ends_with_lock_step_fillers() -> None:
    (window,) = stream_windows(_stream(np.array([5, 9, 30])).open(), config=CONFIG, window_size=100, epoch=0)
    assert window.plan.microbatches_per_rank == CONFIG.accumulate_grad_batches  # one step of 3 microbatches a rank
    assert window.plan.stats.num_empty_microbatches == 3  # 3 samples for 6 slots: no rank waits for another


def test_memory_is_bounded_by_the_buffer_on_a_stream_far_larger_than_it() -> None:
    """200,000 samples (about 100 MB of token lists if held) through a buffer of 500: peak a few MB."""
    count, buffer = 200_000, 500

    def samples():
        rng = np.random.default_rng(1)
        for n in np.clip(rng.lognormal(3.5, 1.0, count).astype(np.int64), 1, 256):
            yield {"input_ids": [7] * int(n)}

    tracemalloc.start()
    try:
        held, total = 0, 0
        for window in stream_windows(GeneratorStream(samples).open(), config=CONFIG, window_size=buffer, epoch=0):
            held = max(held, len(window.samples))
            total += len(window.samples)
            del window
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == count and held == buffer
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB: the stream is held, not the buffer"


def test_packing_efficiency_with_1000_samples_of_lookahead_is_within_2_percent_of_the_offline_plan() -> None:
    lengths = _lognormal(20_000, seed=3, cap=2048)
    config = PlanConfig(mode="packing", max_tokens=2048, algorithm="best_fit_decreasing", world_size=2)
    windows = stream_windows(_stream(lengths).open(), config=config, window_size=1000, epoch=0)
    streamed = sum(w.plan.stats.num_microbatches for w in windows)
    offline = build_plan(lengths, config, epoch=0).stats.num_microbatches
    assert offline / streamed >= 0.98, (offline, streamed)


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_the_overlong_policy_counts_as_the_map_style_path(policy: str) -> None:
    lengths = _lognormal(300, seed=4, cap=400)
    data = [{"input_ids": [1] * int(n)} for n in lengths]
    counter = OverlongCounter(policy=policy, max_tokens=200)
    windows = list(stream_windows(iter(data), config=CONFIG, window_size=64, epoch=0, counter=counter))
    _, kept_lengths, expected = apply_overlong_policy(data, lengths, 200, policy)
    got = counter.report()
    assert got.num_overlong == expected.num_overlong > 0
    assert (got.num_dropped, got.num_truncated) == (expected.num_dropped, expected.num_truncated)
    assert (got.tokens_dropped, got.tokens_truncated) == (expected.tokens_dropped, expected.tokens_truncated)
    assert got.indices == expected.indices and got.lengths == expected.lengths
    assert sorted(len(s["input_ids"]) for w in windows for s in w.samples) == sorted(kept_lengths.tolist())


def test_an_overlong_sample_under_error_names_its_stream_number() -> None:
    data = [{"input_ids": [1] * n} for n in (5, 9, 300)]
    counter = OverlongCounter(policy="error", max_tokens=256)
    with pytest.raises(ValueError, match=r"sample 2 of the stream has 300 tokens, more than max_tokens=256"):
        list(stream_windows(iter(data), config=CONFIG, window_size=2, epoch=0, counter=counter))


def test_an_empty_sample_is_refused() -> None:
    counter = OverlongCounter(policy="drop", max_tokens=256)
    with pytest.raises(ValueError, match="sample 1 of the stream has no token"):
        list(
            stream_windows(
                iter([{"input_ids": [1]}, {"input_ids": []}]), config=CONFIG, window_size=4, epoch=0, counter=counter
            )
        )


def test_truncate_cuts_the_declared_token_fields_with_the_tokens() -> None:
    counter = OverlongCounter(policy="truncate", max_tokens=3, token_fields=("score",))
    sample = {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "score": [0.1, 0.2, 0.3, 0.4], "reward": [9, 9]}
    assert counter.admit(0, sample) == {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "score": [0.1, 0.2, 0.3],
                                        "reward": [9, 9]}  # fmt: skip
    with pytest.raises(ValueError, match="sample 1 of the stream: score has 5 entries but input_ids has 4 tokens"):
        counter.admit(1, {**sample, "score": [0.0] * 5})
