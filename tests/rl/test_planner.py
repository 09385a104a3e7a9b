"""``RolloutPlanner`` on one rank: the log-prob pass equals every sample run alone, in the rollout's order, and the
training microbatches carry the step totals and the lock-step layout."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.rl import Rollout, RolloutPlanner
from tests.rl._rollouts import alone_logprobs, make_policy, make_rollout, policy_logprobs, with_loss_weights


@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
@pytest.mark.parametrize("budget", ["longest", "larger", "whole_rollout"])
def test_compute_per_token_equals_each_sample_alone(kind: str, mode: str, budget: str) -> None:
    rollout = make_rollout(count=10, seed=1)
    longest = int(rollout.lengths.max())
    tokens = {"longest": longest, "larger": longest + 13, "whole_rollout": int(rollout.lengths.sum())}[budget]
    module = make_policy(kind)
    planner = RolloutPlanner(train_max_tokens=tokens, mode=mode, world_size=1, rank=0)
    batches = list(planner.logprob_microbatches(rollout))
    assert sorted(i for b in batches for i in b["sample_indices"]) == list(range(len(rollout)))
    if budget != "whole_rollout":
        assert len(batches) > 1  # several microbatches, in an order that is not the rollout's
    values = planner.compute_per_token(policy_logprobs(module), rollout)
    expected = alone_logprobs(module, rollout)
    for index, (got, want) in enumerate(zip(values, expected, strict=True)):
        assert got is not None and got.shape == want.shape, index
        assert (got[~rollout.loss_mask[index]] == 0).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"sample {index}")


def test_a_budget_below_the_longest_sample_is_refused_naming_the_knob() -> None:
    rollout = make_rollout(count=6, seed=2)
    longest = int(rollout.lengths.max())
    planner = RolloutPlanner(train_max_tokens=4 * longest, logprob_max_tokens=longest - 1, world_size=1, rank=0)
    with pytest.raises(ValueError, match=rf"has {longest} tokens > logprob_max_tokens={longest - 1}"):
        next(planner.logprob_microbatches(rollout))
    planner = RolloutPlanner(train_max_tokens=longest - 1, logprob_max_tokens=4 * longest, world_size=1, rank=0)
    with pytest.raises(ValueError, match=rf"> train_max_tokens={longest - 1}"):
        next(planner.train_microbatches(rollout))


def test_the_logprob_budget_defaults_to_the_train_budget_and_plans_one_step() -> None:
    rollout = make_rollout(count=9, seed=3)
    planner = RolloutPlanner(train_max_tokens=40, steps_per_rollout=3, world_size=1, rank=0)
    assert planner.budgets == {"train_max_tokens": 40, "logprob_max_tokens": 40}
    assert planner.logprob_plan(rollout).num_steps == 1
    assert planner.plan(rollout).num_steps == 3


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_train_microbatches_carry_the_step_totals(mode: str) -> None:
    rollout = make_rollout(count=12, seed=4, group_size=3)
    planner = RolloutPlanner(train_max_tokens=30, mode=mode, steps_per_rollout=2, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    plan = planner.plan(rollout)
    assert len(batches) == plan.num_steps * plan.accumulate_grad_batches
    loss_tokens, groups = rollout.loss_tokens, rollout.group_ids
    for step in range(plan.num_steps):
        mine = [b for b in batches if b["step"] == step]
        indices = [i for b in mine for i in b["sample_indices"]]
        assert [b["is_last_in_step"] for b in mine] == [False] * (len(mine) - 1) + [True]
        assert all(b["step_loss_tokens"] == int(loss_tokens[indices].sum()) for b in mine)
        assert all(b["step_documents"] == len(indices) for b in mine)
        assert all(b["step_groups"] == len(set(groups[indices].tolist())) for b in mine)
        for b in mine:
            assert b["num_loss_tokens"] == int(b["document_loss_tokens"].sum())
            assert b["document_loss_tokens"].tolist() == loss_tokens[b["sample_indices"]].tolist()
            for i, total in zip(b["sample_indices"], b["group_loss_tokens"].tolist(), strict=True):
                assert total == int(loss_tokens[(groups == groups[i]).numpy()].sum())
    assert sorted(i for b in batches for i in b["sample_indices"]) == list(range(len(rollout)))


def test_batches_move_to_the_device_and_keep_python_scalars() -> None:
    rollout = Rollout(input_ids=[[5, 6, 7], [8, 9]])
    batch = next(RolloutPlanner(train_max_tokens=8, world_size=1, rank=0).train_microbatches(rollout, device="meta"))
    assert batch["input_ids"].device.type == "meta" and batch["group_loss_tokens"].device.type == "meta"
    assert isinstance(batch["step_loss_tokens"], int) and isinstance(batch["sample_indices"], list)


def test_world_and_rank_come_together() -> None:
    with pytest.raises(ValueError, match="give both world_size and rank"):
        RolloutPlanner(train_max_tokens=8, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
        RolloutPlanner(train_max_tokens=8, world_size=2, rank=2)
    assert RolloutPlanner(train_max_tokens=8).world == (1, 0)  # no trainer, no process group


def test_a_model_that_mixes_packed_documents_is_refused_in_the_logprob_pass() -> None:
    from lit_seqpack.model.isolation import PackingLeakError
    from lit_seqpack.model.lm import ReferenceLM

    class LeakyLM(ReferenceLM):  # drops the document boundaries: one long causal sequence per row
        def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, attention_mask=None):
            return super().forward(input_ids, position_ids=position_ids)

    torch.manual_seed(0)
    module = LeakyLM(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64).eval()
    rollout = make_rollout(count=6, seed=5)
    planner = RolloutPlanner(train_max_tokens=int(rollout.lengths.sum()), world_size=1, rank=0)
    with pytest.raises(PackingLeakError):
        planner.compute_per_token(policy_logprobs(module), rollout)


def test_world_comes_from_the_trainer_when_given() -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(world_size=4, global_rank=3, strategy=SimpleNamespace())
    planner = RolloutPlanner(train_max_tokens=64, trainer=trainer)
    assert planner.world == (4, 3)
    rollout = make_rollout(count=9, seed=6)
    batches = list(planner.train_microbatches(rollout))
    plan = planner.plan(rollout)
    assert plan.config.world_size == 4 and len(batches) == plan.accumulate_grad_batches
    assert [b["sample_indices"] for b in batches] == [mb for _, _, mb in plan.rank_microbatches(3)]


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_weighted_batches_carry_the_step_weight_over_every_rank(mode: str) -> None:
    rollout = with_loss_weights(make_rollout(count=12, seed=8, group_size=2), seed=8)
    kwargs = {"train_max_tokens": 40, "mode": mode, "steps_per_rollout": 2, "loss_weight_field": "weights"}
    per_rank = [list(RolloutPlanner(**kwargs, world_size=2, rank=r).train_microbatches(rollout)) for r in range(2)]
    sums = rollout.loss_weight_sums("weights")
    for step in range(2):
        mine = [b for batches in per_rank for b in batches if b["step"] == step]
        indices = [i for b in mine for i in b["sample_indices"]]
        assert all(b["step_loss_weight"] == pytest.approx(sums[indices].sum(), rel=1e-12) for b in mine)
        assert sum(b["num_loss_weight"] for b in mine) == pytest.approx(sums[indices].sum(), rel=1e-12)
        for b in mine:  # the weights sit on the loss tokens only
            assert (b["loss_weights"][b["labels"] == -100] == 0).all()
            expected = sorted(
                float(w)
                for i in b["sample_indices"]
                for w in rollout.token_fields["weights"][i][rollout.loss_mask[i]]
                if w != 0
            )
            assert sorted(b["loss_weights"][b["loss_weights"] != 0].tolist()) == pytest.approx(expected)
    assert sums[0] == pytest.approx(float(rollout.token_fields["weights"][0][rollout.loss_mask[0]].sum()))


def test_the_logprob_pass_ignores_the_loss_weights() -> None:
    rollout = make_rollout(count=4, seed=9)  # no weights yet: the log-prob pass comes before them
    planner = RolloutPlanner(train_max_tokens=64, loss_weight_field="weights", world_size=1, rank=0)
    assert all("loss_weights" not in b for b in planner.logprob_microbatches(rollout))
    with pytest.raises(ValueError, match=r"loss_weight_field='weights' is not a token field of the rollout"):
        next(planner.train_microbatches(rollout))


def test_bad_loss_weights_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="loss_weight_field='loss_mask' is not supported"):
        RolloutPlanner(train_max_tokens=8, loss_weight_field="loss_mask")
    with pytest.raises(ValueError, match="loss_weight_field must be None or a token field name, got 3"):
        RolloutPlanner(train_max_tokens=8, loss_weight_field=3)
    rollout = Rollout(input_ids=[[5, 6, 7]], token_fields={"weights": [[0.0, 1.0, -0.5]]})
    planner = RolloutPlanner(train_max_tokens=8, loss_weight_field="weights", world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"sample 0: loss weights \('weights'\) must be >= 0, got -0.5"):
        next(planner.train_microbatches(rollout))


def test_the_rollout_check_is_off_on_one_process_and_needs_a_process_group_when_forced() -> None:
    rollout = make_rollout(count=4, seed=10)
    with pytest.raises(ValueError, match="check_rollout must be None, True or False, got 'yes'"):
        RolloutPlanner(train_max_tokens=64, check_rollout="yes")
    forced = RolloutPlanner(train_max_tokens=64, world_size=2, rank=0, check_rollout=True)
    with pytest.raises(ValueError, match="check_rollout=True .* but torch.distributed is not initialised"):
        next(forced.train_microbatches(rollout))
    assert list(RolloutPlanner(train_max_tokens=64, world_size=2, rank=0).train_microbatches(rollout))


class _PlannedRollout(torch.utils.data.IterableDataset):
    def __init__(self, planner: RolloutPlanner) -> None:
        self.planner = planner

    def __iter__(self):
        for batch in self.planner.train_microbatches(make_rollout(count=4, seed=11)):
            yield batch["sample_indices"]


def test_the_rollout_check_is_not_run_in_a_dataloader_worker() -> None:
    unchecked = RolloutPlanner(train_max_tokens=64, world_size=2, rank=0)  # default: skipped in a worker
    loader = torch.utils.data.DataLoader(_PlannedRollout(unchecked), batch_size=None, num_workers=1)
    assert len(list(loader)) == unchecked.plan(make_rollout(count=4, seed=11)).accumulate_grad_batches
    forced = RolloutPlanner(train_max_tokens=64, world_size=2, rank=0, check_rollout=True)
    loader = torch.utils.data.DataLoader(_PlannedRollout(forced), batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="check_rollout=True .* but it runs in a DataLoader worker"):
        list(loader)


def test_every_pass_over_one_rollout_reuses_its_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    import lit_seqpack.rl.planner as planner_module

    calls = []
    real = planner_module.plan_rollout
    monkeypatch.setattr(planner_module, "plan_rollout", lambda *a, **k: calls.append(a[1].max_tokens) or real(*a, **k))
    rollout = make_rollout(count=10, seed=12)
    planner = RolloutPlanner(train_max_tokens=40, logprob_max_tokens=80, world_size=2, rank=1)
    zeros = [torch.zeros(n) for n in rollout.lengths.tolist()]
    old = planner.compute_per_token(lambda b: torch.zeros(b["input_ids"].shape), rollout)  # old log-probs
    rollout = rollout.with_fields(
        token_fields={"old_logprobs": [o if o is not None else z for o, z in zip(old, zeros, strict=True)]}
    )
    planner.compute_per_token(lambda b: torch.zeros(b["input_ids"].shape), rollout)  # reference log-probs
    rollout = rollout.with_fields(token_fields={"advantages": zeros})
    for _ in range(2):  # two epochs over the rollout
        assert list(planner.train_microbatches(rollout))
    assert calls == [80, 40]  # one log-prob plan and one training plan
    kept = planner.plan(rollout)
    assert kept is planner.plan(rollout.with_fields(sample_fields={"r": torch.zeros(10)}))
    fresh = make_rollout(count=10, seed=12)  # the same samples in a new rollout: planned again, identically
    again = planner.plan(fresh)
    assert again is not kept and again.microbatches == kept.microbatches and calls == [80, 40, 40]


@pytest.mark.parametrize("name", ["train_max_tokens", "logprob_max_tokens"])
def test_a_bad_budget_is_named_as_the_planner_spells_it(name) -> None:
    budgets = {"train_max_tokens": 8} | {name: 0}
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        RolloutPlanner(**budgets, world_size=1, rank=0)
