"""The RL planner on 2 gloo ranks: the gathered log-prob pass equals every sample run alone, and one optimizer
step of a clipped policy loss equals one big padded batch, through Lightning's DDP (automatic and manual)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack.rl import RolloutPlanner
from tests._limits import COLLECTIVE_TIMEOUT, TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks, spawn_ranks
from tests.model.test_exact_loss import GradientCapture, assert_gradients_match
from tests.rl._policies import AutomaticPolicy, ManualPolicy, RolloutBatches, one_item_loader, prefixed
from tests.rl._rollouts import (
    alone_logprobs,
    make_policy,
    make_rollout,
    padded_reference_gradients,
    policy_logprobs,
    with_loss_weights,
    with_policy_fields,
    without_loss,
)

WORLD = 2
CASES = [("packing", "longest"), ("packing", "larger"), ("dynamic", "longest"), ("dynamic", "larger")]


def _planner_worker(rank: int, init_file: str, out_dir: str) -> None:
    """The planner's collectives on one pair of ranks: the gathered log-probs, then the rollout checks."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        _logprobs(rank, out_dir)
        _rollout_checks(rank, out_dir)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def planner_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_planner_worker`'s results (``logprobs{rank}.pt``, ``check{rank}.pt``)."""
    out = tmp_path_factory.mktemp("planner")
    spawn_ranks(_planner_worker, (str(out / "init"), str(out)), WORLD)
    return out


def _logprobs(rank: int, out_dir: str) -> None:
    """Each case's local and gathered log-probs, then a gathered pass over another rollout (``logprobs{rank}.pt``)."""
    module, rollout = make_policy("reference"), make_rollout(count=11, seed=7)
    longest = int(rollout.lengths.max())
    results = {}
    for mode, budget in CASES:
        planner = RolloutPlanner(train_max_tokens=longest if budget == "longest" else 3 * longest, mode=mode)
        assert planner.world == (WORLD, rank)  # from torch.distributed
        mine = [b["sample_indices"] for b in planner.logprob_microbatches(rollout)]
        local = planner.compute_per_token(policy_logprobs(module), rollout)
        gathered = planner.compute_per_token(policy_logprobs(module), rollout, gather=True)
        results[(mode, budget)] = {"microbatches": mine, "local": local, "gathered": gathered}
    other = make_rollout(count=11, seed=7 + rank)  # each rank a different rollout: refused, not mixed
    forwards = []

    def counted(batch):
        forwards.append(batch["sample_indices"])
        return policy_logprobs(module)(batch)

    try:
        planner.compute_per_token(counted, other, gather=True)
        results["mismatch"] = "no error"
    except RuntimeError as err:
        results["mismatch"] = str(err)
    results["forwards_before_the_error"] = len(forwards)
    torch.save(results, Path(out_dir, f"logprobs{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gathered_logprobs_equal_each_sample_alone_on_two_ranks(planner_runs: Path) -> None:
    results = [torch.load(planner_runs / f"logprobs{rank}.pt") for rank in range(WORLD)]
    module, rollout = make_policy("reference"), make_rollout(count=11, seed=7)
    expected = alone_logprobs(module, rollout)
    assert all("the ranks planned different rollouts" in results[rank]["mismatch"] for rank in range(WORLD))
    assert [results[rank]["forwards_before_the_error"] for rank in range(WORLD)] == [0, 0]  # checked first
    for case in CASES:
        shares = [results[rank][case]["microbatches"] for rank in range(WORLD)]
        assert len(shares[0]) == len(shares[1])  # lock step
        owned = [sorted(i for mb in share for i in mb) for share in shares]
        assert sorted(owned[0] + owned[1]) == list(range(len(rollout))) and owned[0] and owned[1]
        for rank in range(WORLD):
            local, gathered = results[rank][case]["local"], results[rank][case]["gathered"]
            assert [i for i, v in enumerate(local) if v is not None] == owned[rank]  # only its own share
            for index, want in enumerate(expected):
                torch.testing.assert_close(gathered[index], want, rtol=0, atol=1e-5, msg=f"{case} sample {index}")


def _ddp_trainer(use_distributed_sampler: bool = False, *, spawn: bool = False, **kwargs) -> Trainer:
    """A DDP Trainer for one optimizer step in a process that is one of the ``WORLD`` ranks (:func:`join_ranks`), or
    with ``spawn`` one that spawns its ranks itself (a test run in pytest's own process)."""
    if spawn:
        strategy = DDPStrategy(start_method="spawn", timeout=COLLECTIVE_TIMEOUT)
    else:
        strategy = DDPStrategy(process_group_backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        precision="32-true",
        max_steps=1,
        use_distributed_sampler=use_distributed_sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


ddp_spawn_trainer = functools.partial(_ddp_trainer, spawn=True)
"""The DDP Trainer of a test in pytest's own process (it spawns the ranks)."""


AUTOMATIC_CASES = [  # (normalize, mode, weight_field, silent samples)
    ("token", "packing", None, []),
    ("group", "dynamic", None, []),
    ("token", "packing", "weights", []),
    ("sequence", "packing", None, [0, 1, 5, 9]),  # samples without a loss: truncated completions
    ("group", "dynamic", "weights", [2, 3, 6]),  # all-zero weights: group 1 (samples 2, 3) has none at all
]


def _automatic_case(normalize: str, mode: str, weight_field: str | None, silent: list[int]) -> tuple[Any, Any, dict]:
    """The seeded policy, the rollout (``silent`` samples without a loss) and the planner's arguments of a case."""
    _, rollout = _policy_rollout()
    kwargs = {"train_max_tokens": 48, "mode": mode, "accumulate_grad_batches": 4, "loss_weight_field": weight_field}
    if weight_field is not None:
        rollout = with_loss_weights(rollout, seed=3, field=weight_field)
        weights = rollout.token_fields[weight_field]
        zeroed = [torch.zeros_like(w) if i in silent else w for i, w in enumerate(weights)]
        rollout = rollout.with_fields(token_fields={weight_field: zeroed})
    else:
        rollout = without_loss(rollout, silent)
    torch.manual_seed(0)
    return AutomaticPolicy(normalize), rollout, kwargs


MANUAL_KWARGS = {"train_max_tokens": 40, "mode": "packing", "steps_per_rollout": 2}
MANUAL_NORMALIZATIONS = ["token", "sequence", "group"]


def _manual_policy(save_dir: str | None = None) -> tuple[ManualPolicy, Any]:
    """The seeded manual policy (every normalisation, the optimizer never steps) and its rollout."""
    _, rollout = _policy_rollout()
    torch.manual_seed(0)
    return ManualPolicy(MANUAL_NORMALIZATIONS, rollout, MANUAL_KWARGS, save_dir=save_dir), rollout


def _steps_worker(rank: int, port: int, out_dir: str) -> None:
    """Every automatic case, the manual policy, then a rollout per sampler seed, on one pair of ranks, one Trainer
    after the other: rank 0's gradients of automatic case ``i`` before its optimizer step go to ``grads{i}.pt``, each
    rank's manual step gradients to ``manual{rank}.pt``, the outcome of the last fit to ``per_seed{rank}.txt``."""
    join_ranks(rank, WORLD, port)
    for index, case in enumerate(AUTOMATIC_CASES):
        module, rollout, kwargs = _automatic_case(*case)
        capture = GradientCapture(str(Path(out_dir, f"grads{index}.pt")))
        try:
            trainer = _ddp_trainer(accumulate_grad_batches=4, callbacks=[capture])
            trainer.fit(module, datamodule=RolloutBatches(rollout, kwargs))
        except Exception as err:
            raise RuntimeError(f"rank {rank}, automatic case {case}: {err}") from err
    module, _ = _manual_policy(save_dir=out_dir)
    try:  # no optimizer step: max_steps never counts, one epoch of one item
        _ddp_trainer(max_epochs=1).fit(module, one_item_loader())
    except Exception as err:
        raise RuntimeError(f"rank {rank}, the manual policy: {err}") from err
    seeds = torch.utils.data.DataLoader([0, 1], batch_size=None)
    trainer = _ddp_trainer(use_distributed_sampler=True, max_epochs=1)  # Lightning's default: rank r gets seed r
    try:
        trainer.fit(RolloutPerSeed(), seeds)
        outcome = "no error"
    except Exception as err:  # expected: the test reads it
        outcome = f"{type(err).__name__}: {err}"
    Path(out_dir, f"per_seed{rank}.txt").write_text(outcome)


@pytest.fixture(scope="module")
def ddp_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of :func:`_steps_worker`'s results (one spawned pair of ranks for all of them: ~7 s of start-up
    each)."""
    out = tmp_path_factory.mktemp("ddp_steps")
    spawn_ranks(_steps_worker, (free_port(), str(out)), WORLD)
    return out


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize(("normalize", "mode", "weight_field", "silent"), AUTOMATIC_CASES)
def test_automatic_ddp_step_equals_the_big_padded_batch(
    normalize: str, mode: str, weight_field: str | None, silent: list[int], ddp_steps: Path
) -> None:
    case = (normalize, mode, weight_field, silent)
    module, rollout, _ = _automatic_case(*case)
    expected = padded_reference_gradients(module, rollout, [list(range(len(rollout)))], normalize, weight_field)
    grads = torch.load(ddp_steps / f"grads{AUTOMATIC_CASES.index(case)}.pt")
    assert_gradients_match(grads, prefixed(expected), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_manual_ddp_steps_equal_the_big_padded_batch_for_every_normalisation(ddp_steps: Path) -> None:
    module, rollout = _manual_policy()  # the ranks' weights: their optimizer never steps
    plan = RolloutPlanner(**MANUAL_KWARGS, world_size=WORLD, rank=0).plan(rollout)
    steps = [sorted(i for rank in step for mb in rank for i in mb) for step in plan.microbatches]
    saved = [torch.load(ddp_steps / f"manual{rank}.pt") for rank in range(WORLD)]
    assert len(saved[0]) == len(saved[1]) == 2 * len(MANUAL_NORMALIZATIONS)
    for k, normalize in enumerate(MANUAL_NORMALIZATIONS):
        for s, samples in enumerate(steps):
            expected = padded_reference_gradients(module, rollout, [samples], normalize)
            for rank in range(WORLD):
                assert_gradients_match(saved[rank][2 * k + s], prefixed(expected), rtol=1e-5)


def _rollout_checks(rank: int, out_dir: str) -> None:
    """The planners' outcomes on the same rollout and on a different one on each rank (``check{rank}.pt``)."""
    same, other = make_rollout(count=8, seed=3), make_rollout(count=8, seed=3 + rank)
    results = {"same": len(list(RolloutPlanner(train_max_tokens=64).train_microbatches(same)))}
    for name, planner in (
        ("train", RolloutPlanner(train_max_tokens=64)),
        ("logprob", RolloutPlanner(train_max_tokens=64, check_rollout=True)),
    ):
        batches = planner.train_microbatches if name == "train" else planner.logprob_microbatches
        try:
            next(batches(other))
            results[name] = "no error"
        except RuntimeError as err:
            results[name] = str(err)
    unchecked = RolloutPlanner(train_max_tokens=64, check_rollout=False)
    results["unchecked"] = len(list(unchecked.train_microbatches(other)))  # the opt-out: no collective
    dist.barrier()  # every rank got here: nobody waits in a check the other skipped
    torch.save(results, Path(out_dir, f"check{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_different_rollouts_on_two_ranks_raise_on_both(planner_runs: Path) -> None:
    results = [torch.load(planner_runs / f"check{rank}.pt") for rank in range(WORLD)]
    for rank in range(WORLD):
        assert results[rank]["same"] > 0 and results[rank]["unchecked"] > 0
        for name in ("train", "logprob"):
            assert "the ranks planned different rollouts" in results[rank][name], (rank, name)
            assert "use_distributed_sampler=False" in results[rank][name]


class RolloutPerSeed(LightningModule):
    """Builds its rollout from the seed the DataLoader hands ``training_step``: the examples' mistake when
    Lightning's DistributedSampler shards that loader."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        planner = RolloutPlanner(train_max_tokens=64, trainer=self.trainer)
        for _ in planner.train_microbatches(make_rollout(count=8, seed=int(batch))):
            pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_distributed_sampler_over_rollout_seeds_is_caught_through_the_strategy(ddp_steps: Path) -> None:
    for rank in range(WORLD):  # Lightning's default sampler hands rank r the seed r: refused on every rank
        assert "the ranks planned different rollouts" in (ddp_steps / f"per_seed{rank}.txt").read_text(), rank


def _policy_rollout():
    reference = make_policy("reference")
    return reference, with_policy_fields(reference, make_rollout(count=14, seed=2, group_size=2), seed=2)
