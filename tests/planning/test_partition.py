"""Karmarkar-Karp's largest differencing: the compiled kernel deals exactly what the textbook heap of partial
partitions deals (ties included), compiled or not, and keeps the rollout planner's balance."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from lit_seqpack.planning import _kernels
from lit_seqpack.planning.balance import karmarkar_karp, karmarkar_karp_parts
from lit_seqpack.planning.rollout import RolloutPlanConfig, plan_rollout


def textbook_karmarkar_karp(costs: np.ndarray, parts: int) -> list[list[int]]:
    """A heap of (-spread, creation, sums, members); merge the two widest, heaviest part with the lightest."""
    heap = []
    for i in np.argsort(-costs, kind="stable").tolist():
        sums = np.zeros(parts)
        sums[0] = costs[i]
        heap.append((-float(costs[i]), len(heap), sums, [[i]] + [[] for _ in range(parts - 1)]))
    heapq.heapify(heap)
    created = len(heap)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        merged = sums_a + sums_b[::-1]
        order = np.argsort(-merged, kind="stable")
        members = [members_a[j] + members_b[parts - 1 - j] for j in order.tolist()]
        heapq.heappush(heap, (-float(merged[order[0]] - merged[order[-1]]), created, merged[order], members))
        created += 1
    return [sorted(part) for part in heap[0][3]]


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_deals_what_the_textbook_heap_deals(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, parts = int(rng.integers(0, 150)), int(rng.integers(1, 12))
        costs = rng.integers(0, 5, n).astype(float) if seed % 2 else rng.random(n) * 100  # ties / no ties
        expected = textbook_karmarkar_karp(costs, parts) if n else [[] for _ in range(parts)]
        assert karmarkar_karp(costs, parts) == expected, (n, parts)


def test_compiled_and_pure_python_kernels_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    costs = np.random.default_rng(3).lognormal(6, 0.8, 700)
    compiled = karmarkar_karp_parts(costs, 16)
    monkeypatch.setenv(_kernels.DISABLE_ENV_VAR, "1")
    assert karmarkar_karp_parts(costs, 16).tolist() == compiled.tolist()


def test_parts_are_numbered_heaviest_first_and_inputs_are_checked() -> None:
    costs = np.random.default_rng(4).random(50)
    part = karmarkar_karp_parts(costs, 5)
    sums = np.bincount(part, weights=costs, minlength=5)
    assert sums.tolist() == sorted(sums.tolist(), reverse=True) and sums.max() / sums.mean() < 1.01
    assert karmarkar_karp_parts([7.0], 3).tolist() == [0]
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        karmarkar_karp([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        karmarkar_karp([1.0], 0)


def test_a_grpo_rollout_of_4096_samples_on_64_ranks_keeps_its_balance() -> None:
    """The figures of ``benchmarks/bench_rl.py`` (lognormal median 512, 8192 tokens): worst step 1.0070 by tokens,
    1.0000 by cost, as with the pure-Python heap this kernel replaced."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(512), 0.8, 4096)), 16, 8192).astype(np.int64)
    plan = plan_rollout(lengths, RolloutPlanConfig(max_tokens=8192, world_size=64))
    assert plan.imbalance("tokens")[1] < 1.0071 and plan.imbalance("cost")[1] < 1.0001
