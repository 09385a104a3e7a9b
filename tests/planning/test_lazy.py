"""The lazy plan: the same microbatches as build_plan, a window at a time; the auto window layout."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning import _order
from lit_seqpack.planning.lazy import LazyPlan
from lit_seqpack.planning.plan import PlanConfig, build_plan


def _config(mode: str, **overrides) -> PlanConfig:
    budget = {"batch_size": 4} if mode == "padded" else {"max_tokens": 64}
    return PlanConfig(mode=mode, **{**budget, **overrides})


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 64), min_size=0, max_size=90),
    mode=st.sampled_from(["packing", "dynamic", "padded"]),
    world_size=st.integers(1, 6),
    accumulate=st.integers(1, 3),
    window=st.one_of(st.none(), st.integers(1, 40)),
    auto_min=st.integers(1, 60),
    algorithm=st.sampled_from(["first_fit_decreasing", "first_fit_shuffle", "best_fit_decreasing"]),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_lazy_plan_equals_build_plan(
    lengths, mode, world_size, accumulate, window, auto_min, algorithm, shuffle, epoch
):
    extra = {"algorithm": algorithm} if mode == "packing" else {}
    cfg = _config(
        mode, world_size=world_size, accumulate_grad_batches=accumulate, window=window, shuffle=shuffle, **extra
    )
    loss = [int(np.random.default_rng(n).integers(0, n + 1)) for n in lengths]
    with mock.patch.object(_order, "AUTO_WINDOW_MIN", auto_min), mock.patch.object(_order, "AUTO_WINDOW_STEPS", 1):
        eager = build_plan(lengths, cfg, epoch=epoch, loss_tokens=loss)
        lazy = LazyPlan(np.asarray(lengths, dtype=np.int64), cfg, epoch=epoch, loss_tokens=np.asarray(loss))
    assert lazy.num_steps == eager.num_steps and lazy.microbatches_per_rank == eager.microbatches_per_rank
    for rank in range(world_size):
        for position in range(eager.microbatches_per_rank):
            expected, got = eager.microbatch(rank, position), lazy.microbatch(rank, position)
            assert got == expected
            assert lazy.microbatch_loss_tokens(rank, position) == sum(loss[i] for i in got.indices)


def _lognormal(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(200), 1.0, n)), 1, 2048).astype(np.int64)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_auto_window_chunks_are_fixed_and_counts_constant(mode):
    lengths = _lognormal(6_000)
    cfg = PlanConfig(mode=mode, max_tokens=2048, world_size=4, accumulate_grad_batches=2)
    with mock.patch.object(_order, "AUTO_WINDOW_MIN", 1_000), mock.patch.object(_order, "AUTO_WINDOW_STEPS", 4):
        plans = [LazyPlan(lengths, cfg, epoch=e) for e in range(3)]
        assert build_plan(lengths, cfg, epoch=1).num_steps == plans[1].num_steps
        # the chunk steps of epoch 0 are reused for epoch 1 (no recount) and give the same plan
        reused = LazyPlan(lengths, cfg, epoch=1, partition=plans[0].partition, chunk_steps=plans[0].chunk_steps)
    assert plans[0].window == 1_000 and len({p.num_steps for p in plans}) == 1  # the count is the same every epoch
    orders = []
    for plan in plans:
        seen = [i for r in range(4) for mb in plan.rank_microbatches(r) for i in mb]
        assert Counter(seen) == Counter(range(lengths.size))
        orders.append(plan.rank_microbatches(0))
    assert orders[0] != orders[1] != orders[2]
    assert reused.fingerprint() == plans[1].fingerprint()
    assert reused.rank_microbatches(3) == plans[1].rank_microbatches(3)


def test_seek_plans_only_the_window_holding_the_step():
    lengths = _lognormal(3_000, seed=1)
    cfg = PlanConfig(mode="packing", max_tokens=2048, world_size=2, window=500)
    plan = LazyPlan(lengths, cfg, epoch=0)
    last = plan.microbatches_per_rank - 1
    assert plan.microbatch(1, last) == build_plan(lengths, cfg, epoch=0).microbatch(1, last)
    assert plan._cached[0] == 5  # only the last of the six windows was planned
    assert plan._lengths.dtype == np.uint16  # lengths kept in 2 bytes a sample


def test_lazy_plan_checks_its_inputs():
    cfg = PlanConfig(mode="packing", max_tokens=8)
    with pytest.raises(ValueError, match=r"sample 1 has length 9 > max_tokens=8"):
        LazyPlan(np.array([3, 9]), cfg, epoch=0)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1"):
        LazyPlan(np.array([3, -1]), cfg, epoch=0)
    plan = LazyPlan(np.array([3, 4]), cfg, epoch=0)
    with pytest.raises(IndexError):
        plan.microbatch(0, plan.microbatches_per_rank)
    with pytest.raises(ValueError, match="rank"):
        plan.microbatch(1, 0)
    assert LazyPlan(np.zeros(0, dtype=np.int64), cfg, epoch=0).num_steps == 0


@pytest.mark.parametrize(("n", "window"), [(10, 4), (5_000, 1_000), (1_000_003, 100_000), (9_000_000, 2_100_000)])
def test_chunk_partition_holds_every_sample_once_in_blocks(n, window):
    part = _order.ChunkPartition(n, window, seed=3)
    members = [part.members(c) for c in range(part.num_chunks)]
    assert [m.size for m in members[:-1]] == [window] * (part.num_chunks - 1)
    every = np.concatenate(members)
    assert every.dtype == np.uint32 and np.array_equal(np.sort(every), np.arange(n))
    assert part.block_order.size == -(-n // part.block) and part.block <= _order.PARTITION_BLOCK_MAX
    assert part.block == 1 or window // part.block >= _order.PARTITION_BLOCKS_PER_CHUNK
    again = _order.ChunkPartition(n, window, seed=3)
    assert all(np.array_equal(a, again.members(c)) for c, a in enumerate(members))
    if n > 100:  # a chunk mixes samples from all over the dataset, not a contiguous slice
        assert np.ptp(members[0]) > n // 2


def test_counts_in_chunk_order_match_the_plan_of_the_shuffled_window():
    lengths = _lognormal(40_000, seed=2)
    cfg = PlanConfig(mode="packing", max_tokens=2048, world_size=3, accumulate_grad_batches=2)
    with mock.patch.object(_order, "AUTO_WINDOW_MIN", 7_000), mock.patch.object(_order, "AUTO_WINDOW_STEPS", 4):
        plan = LazyPlan(lengths, cfg, epoch=1)
        order = _order.WindowOrder(lengths.size, cfg, 1, plan.window, plan.partition)
        for w in range(order.num_windows):
            assert np.array_equal(np.sort(order.members(w)), np.sort(order.positions(w)))
            assert not np.array_equal(order.members(w), order.positions(w))  # another order, the same samples
        # every window is planned and checked against its count (a mismatch raises RuntimeError)
        assert len(plan.rank_microbatches(2)) == plan.microbatches_per_rank
