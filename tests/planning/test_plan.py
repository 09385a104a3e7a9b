from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_seqpack.planning.dynamic import round_up
from lit_seqpack.planning.plan import Plan, PlanConfig, build_plan


def _config(mode: str, **overrides) -> PlanConfig:
    budget = {"batch_size": 4} if mode == "padded" else {"max_tokens": 64}
    return PlanConfig(mode=mode, **{**budget, **overrides})


def _lognormal(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(512), 1.0, n)), 16, 4096).astype(np.int64)


def _all_microbatches(plan: Plan) -> list[list[int]]:
    return [mb for rank in range(plan.config.world_size) for mb in plan.rank_microbatches(rank)]


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"mode": "both"}, "mode"),
        ({"mode": "packing"}, "max_tokens"),
        ({"mode": "packing", "max_tokens": 0}, "max_tokens"),
        ({"mode": "dynamic", "max_tokens": 100, "batch_size": 4}, "batch_size"),
        ({"mode": "padded"}, "batch_size"),
        ({"mode": "padded", "batch_size": 4, "max_tokens": 64}, "max_tokens"),
        ({"mode": "packing", "max_tokens": 100, "sequence_length_round": 64}, "sequence_length_round"),
        ({"mode": "packing", "max_tokens": 64, "sequence_length_round": 0}, "sequence_length_round"),
        ({"mode": "packing", "max_tokens": 64, "algorithm": "magic"}, "algorithm"),
        ({"mode": "dynamic", "max_tokens": 64, "algorithm": "first_fit_decreasing"}, "algorithm"),
        ({"mode": "packing", "max_tokens": 64, "window": 0}, "window"),
        ({"mode": "packing", "max_tokens": 64, "world_size": 0}, "world_size"),
        ({"mode": "packing", "max_tokens": 64, "world_size": True}, "world_size"),
        ({"mode": "packing", "max_tokens": 64, "accumulate_grad_batches": 0}, "accumulate_grad_batches"),
        ({"mode": "packing", "max_tokens": 64, "seed": -1}, "seed"),
        ({"mode": "packing", "max_tokens": 64, "shuffle": "yes"}, "shuffle"),
        ({"mode": "packing", "max_tokens": 64, "microbatch_order": "random"}, "microbatch_order"),
        ({"mode": "packing", "max_tokens": 64, "cost_linear": -1.0}, "cost_linear"),
        ({"mode": "packing", "max_tokens": 64, "cost_quadratic": float("nan")}, "cost_quadratic"),
        ({"mode": "packing", "max_tokens": 64, "cost_quadratic": "fast"}, "cost_quadratic"),
        ({"mode": "padded", "batch_size": 4, "cost_linear": 0.0}, "cost_linear"),
        ({"mode": "packing", "max_tokens": 64, "cost_linear": 0.0}, "cost_linear"),
    ],
)
def test_config_errors_name_the_knob(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        PlanConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    cfg = PlanConfig(mode="packing", max_tokens=64)
    with pytest.raises(AttributeError):
        cfg.max_tokens = 32
    with pytest.raises(TypeError):
        PlanConfig("packing", 64)
    assert cfg.slots_per_step == 1


# ---------------------------------------------------------------- input validation


def test_overlong_sample_names_index_length_and_budget():
    with pytest.raises(ValueError, match=r"sample 2 has length 65 > max_tokens=64"):
        build_plan([10, 20, 65, 70], _config("packing"), epoch=0)
    with pytest.raises(ValueError, match=r"sample 0 has length 100"):
        build_plan([100], _config("dynamic"), epoch=0)
    build_plan([10_000], _config("padded"), epoch=0)  # padded mode has no budget


@pytest.mark.parametrize(
    ("lengths", "loss_tokens", "match"),
    [
        ([1, -2], None, r"lengths\[1\] = -2"),
        ([1.5, 2], None, "integers"),
        ([[1, 2]], None, "one-dimensional"),
        ([3, 4], [1], "one entry per sample"),
        ([3, 4], [1, 5], r"loss_tokens\[1\] = 5 exceeds"),
        ([3, 4], [1, -1], r"loss_tokens\[1\] = -1"),
    ],
)
def test_bad_lengths_and_loss_tokens(lengths, loss_tokens, match):
    with pytest.raises(ValueError, match=match):
        build_plan(lengths, _config("packing"), epoch=0, loss_tokens=loss_tokens)


def test_bad_epoch():
    with pytest.raises(ValueError, match="epoch"):
        build_plan([1, 2], _config("packing"), epoch=-1)


# ---------------------------------------------------------------- invariants (property tests)

modes = st.sampled_from(["packing", "dynamic", "padded"])


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 64), min_size=0, max_size=70),
    mode=modes,
    world_size=st.integers(1, 8),
    accumulate=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 40)),
    rounding=st.sampled_from([1, 8]),
    algorithm=st.sampled_from(["first_fit_decreasing", "concatenative", "first_fit_shuffle", "best_fit_decreasing"]),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
    order=st.sampled_from(["packer", "largest_first"]),
)
def test_plan_invariants(lengths, mode, world_size, accumulate, window, rounding, algorithm, seed, epoch, order):
    extra = {"algorithm": algorithm} if mode == "packing" else {}
    cfg = _config(
        mode,
        world_size=world_size,
        accumulate_grad_batches=accumulate,
        window=window,
        sequence_length_round=rounding,
        seed=seed,
        microbatch_order=order,
        **extra,
    )
    rng = np.random.default_rng(len(lengths))
    loss_tokens = [int(rng.integers(0, n + 1)) for n in lengths]
    plan = build_plan(lengths, cfg, epoch=epoch, loss_tokens=loss_tokens)
    arr, loss = np.asarray(lengths, dtype=np.int64), np.asarray(loss_tokens, dtype=np.int64)

    # nothing lost: every index exactly once over all ranks
    assert Counter(i for mb in _all_microbatches(plan) for i in mb) == Counter(range(len(lengths)))
    # lock-step: the same count on every rank and per step
    per_rank = [plan.rank_microbatches(r) for r in range(world_size)]
    assert {len(mbs) for mbs in per_rank} == {plan.num_steps * accumulate}
    assert plan.stats.num_microbatches == plan.num_steps * world_size * accumulate
    assert plan.stats.num_empty_microbatches == sum(1 for mbs in per_rank for mb in mbs if not mb)
    for step in range(plan.num_steps):
        grid = plan.step_microbatches(step)
        assert len(grid) == world_size and all(len(row) == accumulate for row in grid)
        # exact loss metadata: the true loss-token total of the step over all ranks
        true_total = sum(int(loss[mb].sum()) for row in grid for mb in row)
        assert plan.step_loss_tokens[step] == true_total
        for rank in range(world_size):
            for j in range(accumulate):
                planned = plan.microbatch(rank, step * accumulate + j)
                assert planned.step == step and planned.step_loss_tokens == true_total
    # the budget holds
    for mb in _all_microbatches(plan):
        if not mb:
            continue
        if mode == "packing":
            assert round_up(int(arr[mb].sum()), rounding) <= cfg.max_tokens
        elif mode == "dynamic":
            assert len(mb) * round_up(int(arr[mb].max()), rounding) <= cfg.max_tokens
        else:
            assert len(mb) <= cfg.batch_size
    # determinism
    again = build_plan(lengths, cfg, epoch=epoch, loss_tokens=loss_tokens)
    assert again.fingerprint() == plan.fingerprint()
    assert [again.rank_microbatches(r) for r in range(world_size)] == per_rank


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 90),
    window=st.integers(1, 30),
    mode=modes,
    world_size=st.integers(1, 4),
    accumulate=st.integers(1, 3),
)
def test_windows_train_in_order(n, window, mode, world_size, accumulate):
    cfg = _config(mode, window=window, shuffle=False, world_size=world_size, accumulate_grad_batches=accumulate)
    lengths = np.random.default_rng(n).integers(1, 64, n)
    plan = build_plan(lengths, cfg, epoch=0)
    # without shuffling, window w holds indices [w * window, (w + 1) * window)
    step_windows = []
    for step in range(plan.num_steps):
        ids = {i // window for row in plan.step_microbatches(step) for mb in row for i in mb}
        assert len(ids) <= 1  # a step never mixes windows
        step_windows.extend(ids)
    assert step_windows == sorted(step_windows)
    assert set(step_windows) == set(range(-(-n // window)))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=40, max_size=80),
    mode=modes,
    world_size=st.integers(1, 8),
    accumulate=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(20, 50)),
)
def test_every_epoch_reorders(lengths, mode, world_size, accumulate, window):
    cfg = _config(mode, world_size=world_size, accumulate_grad_batches=accumulate, window=window)
    orders = {tuple(i for mb in build_plan(lengths, cfg, epoch=e).rank_microbatches(0) for i in mb) for e in range(4)}
    assert len(orders) > 1


@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_order_changes_with_epoch_only_when_shuffling(mode):
    lengths = np.random.default_rng(0).integers(1, 64, 300)
    cfg = _config(mode, world_size=2, accumulate_grad_batches=2)
    first, second = (build_plan(lengths, cfg, epoch=e) for e in (0, 1))
    assert first.rank_microbatches(0) != second.rank_microbatches(0)
    assert first.fingerprint() != second.fingerprint()
    fixed = _config(mode, world_size=2, accumulate_grad_batches=2, shuffle=False)
    assert build_plan(lengths, fixed, epoch=0).rank_microbatches(1) == build_plan(
        lengths, fixed, epoch=5
    ).rank_microbatches(1)


def test_seed_changes_the_plan():
    lengths = np.random.default_rng(0).integers(1, 64, 300)
    plans = [build_plan(lengths, _config("packing", seed=s), epoch=0) for s in (0, 1)]
    assert plans[0].fingerprint() != plans[1].fingerprint()


# ---------------------------------------------------------------- lock-step fillers and edge cases


def test_fewer_samples_than_slots_spread_then_fill():
    plan = build_plan([10, 20, 30], _config("packing", world_size=4, accumulate_grad_batches=2), epoch=0)
    assert plan.num_steps == 1
    assert plan.stats.num_empty_microbatches == 5  # each sample alone (3 ranks busy), 5 fillers
    assert sorted(len(mb) for mb in _all_microbatches(plan)) == [0] * 5 + [1] * 3


def test_dynamic_splits_groups_before_adding_fillers():
    plan = build_plan([8] * 8, _config("dynamic", world_size=4), epoch=0)  # one 8-row group of 64 tokens
    assert plan.stats.num_empty_microbatches == 0
    assert sorted(len(mb) for mb in _all_microbatches(plan)) == [2, 2, 2, 2]


def test_padded_fills_with_empty_batches_never_drops():
    plan = build_plan(list(range(1, 11)), _config("padded", world_size=2, accumulate_grad_batches=2), epoch=0)
    assert plan.stats.num_microbatches == 4 and plan.stats.num_empty_microbatches == 1
    assert sorted(len(mb) for mb in _all_microbatches(plan)) == [0, 2, 4, 4]


def test_empty_dataset_and_zero_lengths():
    plan = build_plan([], _config("packing", world_size=2), epoch=0)
    assert plan.num_steps == 0 and plan.rank_microbatches(1) == [] and plan.stats.num_microbatches == 0
    plan = build_plan([0, 0, 5], _config("dynamic"), epoch=0)
    assert sorted(i for mb in _all_microbatches(plan) for i in mb) == [0, 1, 2]


def test_microbatch_argument_errors():
    plan = build_plan([10, 20], _config("packing", world_size=2), epoch=0)
    with pytest.raises(ValueError, match="rank"):
        plan.microbatch(2, 0)
    with pytest.raises(IndexError):
        plan.microbatch(0, plan.microbatches_per_rank)


def test_default_loss_tokens_skip_the_first_token():
    plan = build_plan([1, 5, 0, 3], _config("packing"), epoch=0)
    assert int(plan.step_loss_tokens.sum()) == 0 + 4 + 0 + 2


# ---------------------------------------------------------------- efficiency and balance on skewed data


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_rank_balance_on_skewed_data(mode, accumulate):
    cfg = PlanConfig(mode=mode, max_tokens=4096, world_size=8, accumulate_grad_batches=accumulate, cost_quadratic=0.0)
    stats = build_plan(_lognormal(20_000), cfg, epoch=0).stats
    assert stats.imbalance_mean <= 1.05
    assert stats.num_empty_microbatches == 0


def test_default_window_keeps_packing_efficiency():
    cfg = PlanConfig(mode="packing", max_tokens=4096, world_size=8, accumulate_grad_batches=4)
    stats = build_plan(_lognormal(50_000, seed=1), cfg, epoch=0).stats
    assert stats.utilization >= 0.99
    assert stats.padding_ratio == 0.0


def test_whole_epoch_window_gives_a_stable_count_with_sort_based_packers():
    lengths = _lognormal(5_000)
    for mode in ("packing", "dynamic"):
        cfg = PlanConfig(mode=mode, max_tokens=4096, world_size=4, accumulate_grad_batches=2)
        assert len({build_plan(lengths, cfg, epoch=e).num_steps for e in range(4)}) == 1


def test_quadratic_cost_balances_attention_work():
    lengths = _lognormal(8_000, seed=2)

    def quadratic_imbalance(plan: Plan) -> float:
        work = np.array(
            [
                [sum(int((lengths[mb] ** 2).sum()) for mb in row) for row in plan.step_microbatches(s)]
                for s in range(plan.num_steps)
            ]
        )
        return float((work.max(axis=1) / work.mean(axis=1)).mean())

    base = {"mode": "packing", "max_tokens": 8192, "world_size": 8, "accumulate_grad_batches": 2}
    linear = build_plan(lengths, PlanConfig(**base, cost_quadratic=0.0), epoch=0)
    quadratic = build_plan(lengths, PlanConfig(**base, cost_quadratic=1.0 / 4096), epoch=0)
    assert quadratic_imbalance(quadratic) < quadratic_imbalance(linear)
    auto = build_plan(lengths, PlanConfig(**base), epoch=0)  # the default: b = 1 / max_tokens
    assert quadratic_imbalance(auto) < quadratic_imbalance(linear)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_auto_quadratic_cost_balances_long_contexts_by_default(mode):
    lengths = np.clip(np.round(np.random.default_rng(4).lognormal(np.log(1024), 1.0, 20_000)), 16, 8192)
    lengths = lengths.astype(np.int64)
    base = {"mode": mode, "max_tokens": 8192, "world_size": 8}
    auto = PlanConfig(**base)
    assert auto.cost_quadratic == "auto" and auto.quadratic_cost == 1 / 8192
    assert PlanConfig(**base, cost_linear=2.0).quadratic_cost == 2 / 8192
    assert PlanConfig(mode="padded", batch_size=4).quadratic_cost == 0.0
    cost = lengths + lengths.astype(np.float64) ** 2 / 8192

    def worst_rank_share(config: PlanConfig) -> float:
        plan = build_plan(lengths, config, epoch=0)
        steps = [plan.step_microbatches(s) for s in range(plan.num_steps)]
        work = np.array([[sum(cost[mb].sum() for mb in row) for row in step] for step in steps])
        return float((work.max(axis=1) / work.mean(axis=1)).mean())

    assert worst_rank_share(auto) < 1.01 < 1.1 < worst_rank_share(PlanConfig(**base, cost_quadratic=0.0))
    explicit = PlanConfig(**base, cost_quadratic=1 / 8192)
    assert build_plan(lengths, auto, epoch=0).rank_microbatches(3) == build_plan(
        lengths, explicit, epoch=0
    ).rank_microbatches(3)


def test_largest_first_order():
    lengths = _lognormal(3_000, seed=3)
    cfg = PlanConfig(mode="dynamic", max_tokens=8192, world_size=2, accumulate_grad_batches=4, cost_quadratic=0.0)
    plan = build_plan(lengths, cfg, epoch=0)

    def cost(mb: list[int]) -> int:
        return len(mb) * int(lengths[mb].max()) if mb else 0

    for rank in range(2):
        mbs = plan.rank_microbatches(rank)
        for s in range(plan.num_steps):
            costs = [cost(mb) for mb in mbs[4 * s : 4 * s + 4]]
            assert costs == sorted(costs, reverse=True)
    first_step = max(cost(mb) for row in plan.step_microbatches(0) for mb in row)
    assert first_step == max(cost(mb) for r in range(2) for mb in plan.rank_microbatches(r))


def test_planner_does_not_import_torch():
    # conftest imports torch in this process, so check in a fresh interpreter
    code = (
        "import sys; from lit_seqpack.planning import build_plan, PlanConfig; "
        "build_plan([5, 6], PlanConfig(mode='packing', max_tokens=16), epoch=0); "
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
