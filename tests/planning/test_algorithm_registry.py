"""The packing algorithm records: one per algorithm, read by every default, table, docstring and error."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import numpy as np
import pytest

from lit_seqpack.planning import algorithms
from lit_seqpack.planning.algorithms import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    PACKING_ALGORITHMS,
    PackingAlgorithm,
    get_packer,
    packing_algorithm,
)
from lit_seqpack.planning.config import PlanConfig
from lit_seqpack.planning.lazy import LazyPlan
from lit_seqpack.planning.plan import build_plan
from lit_seqpack.planning.rollout import RolloutPlanConfig, plan_rollout


def _one_per_bin(sizes: np.ndarray, capacity: int, seed: int) -> algorithms.Assignment:
    """A toy assigner: every sequence alone in its bin, in input order."""
    n = sizes.shape[0]
    return np.arange(n), np.arange(n), sizes.astype(np.int64)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> PackingAlgorithm:
    """A new algorithm registered the way a contributor adds one: one assigner plus one record."""
    record = PackingAlgorithm(name="toy", assign=_one_per_bin, sort_based=False, description="one per bin.")
    monkeypatch.setattr(algorithms, "ALGORITHMS", MappingProxyType({**ALGORITHMS, "toy": record}))
    return record


def test_a_new_record_plans_through_every_planner(toy: PackingAlgorithm) -> None:
    lengths = np.array([5, 3, 4, 4, 2, 7, 1])
    config = PlanConfig(mode="packing", max_tokens=8, algorithm="toy", world_size=2, shuffle=False)
    plan = build_plan(lengths, config, epoch=0)
    microbatches = [mb for rank in range(2) for mb in plan.rank_microbatches(rank)]
    assert sorted(len(mb) for mb in microbatches if mb) == [1] * lengths.size  # the toy's bins, nobody else's
    assert sorted(i for mb in microbatches for i in mb) == list(range(lengths.size))
    lazy = LazyPlan(lengths, config, epoch=0)
    assert [lazy.microbatch(0, p).indices for p in range(lazy.microbatches_per_rank)] == plan.rank_microbatches(0)
    rollout = plan_rollout(lengths, RolloutPlanConfig(max_tokens=8, algorithm="toy"))
    assert all(len(samples) == 1 for _, _, samples in rollout.rank_microbatches(0))
    with pytest.raises(ValueError, match=r"one of \('concatenative'.*'toy'\), got 'nope'"):
        PlanConfig(mode="packing", max_tokens=8, algorithm="nope")


def _counts_ignore_order(algorithm: str, rng: np.random.Generator) -> bool:
    """Whether the bin count stayed the same under shuffles of the input, over a few random inputs."""
    packer = get_packer(algorithm, 20)
    for _ in range(30):
        lengths = rng.integers(1, 21, size=int(rng.integers(2, 25)))
        count = packer.count_bins(lengths)
        if any(packer.count_bins(rng.permutation(lengths)) != count for _ in range(5)):
            return False
    return True


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_sort_based_agrees_with_behaviour(algorithm: str) -> None:
    """``sort_based`` promises an order-free bin count (lazy counting) and one bin listed longest first (rollouts)."""
    lengths = np.array([1, 3, 2, 3, 5, 0, 4, 2])  # one bin of capacity 20, ties included
    longest_first = get_packer(algorithm, 20).pack(lengths) == [np.argsort(-lengths, kind="stable").tolist()]
    order_free = _counts_ignore_order(algorithm, np.random.default_rng(0))
    assert ALGORITHMS[algorithm].sort_based == longest_first == order_free


def test_the_default_is_one_record_and_every_default_reads_it() -> None:
    from lit_seqpack.data.settings import BatchingSettings

    assert [r.name for r in ALGORITHMS.values() if r.default] == [DEFAULT_ALGORITHM]
    assert packing_algorithm().name == packing_algorithm(None).name == DEFAULT_ALGORITHM
    assert BatchingSettings().algorithm == DEFAULT_ALGORITHM
    assert tuple(ALGORITHMS) == PACKING_ALGORITHMS
    assert all(f"``{name}``: {ALGORITHMS[name].description}" in algorithms.__doc__ for name in ALGORITHMS)


def test_the_registry_refuses_two_defaults_and_duplicate_names() -> None:
    record = ALGORITHMS[DEFAULT_ALGORITHM]
    with pytest.raises(ValueError, match="exactly one packing algorithm must be the default"):
        algorithms._registry([record, dataclasses.replace(record, name="other")])
    with pytest.raises(ValueError, match="distinct and lower-case"):
        algorithms._registry([record, record])
    with pytest.raises(ValueError, match=r"must be one of .*, got \['x'\]"):
        packing_algorithm(["x"])  # type: ignore[arg-type]
