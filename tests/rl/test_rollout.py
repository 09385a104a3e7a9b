"""``Rollout``: validation that names the sample and the field, ``from_padded`` and added fields."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.rl import Rollout, RolloutPlanner


def test_from_padded_cuts_left_and_right_padding_and_every_field() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 4, 3, 2, 0, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    response = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    advantages = torch.arange(12.0).reshape(2, 6)
    rollout = Rollout.from_padded(
        ids, attention, loss_mask=response, token_fields={"advantages": advantages}, group_ids=torch.tensor([3, 3])
    )
    assert [x.tolist() for x in rollout.input_ids] == [[5, 6, 7, 8], [9, 4, 3, 2]]
    assert [m.long().tolist() for m in rollout.loss_mask] == [[0, 1, 1, 1], [0, 0, 1, 1]]
    assert [a.tolist() for a in rollout.token_fields["advantages"]] == [[2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]
    assert rollout.loss_tokens.tolist() == [3, 2]


def test_fields_arrive_aligned_with_the_tokens_in_packed_and_padded_batches() -> None:
    rollout = Rollout(
        input_ids=[[5, 6, 7], [8, 9]],
        token_fields={"advantages": [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 4.0])]},
        sample_fields={"reward": [0.5, -1.0]},
    )
    packed = next(
        RolloutPlanner(train_max_tokens=8, world_size=1, rank=0, pad_to_multiple_of=8).train_microbatches(rollout)
    )
    order = packed["sample_indices"]
    expected = torch.cat([rollout.token_fields["advantages"][i] for i in order])
    assert packed["advantages"][0, :5].tolist() == expected.tolist() and packed["advantages"][0, 5:].eq(0).all()
    assert packed["reward"].tolist() == [[0.5, -1.0][i] for i in order]
    padded = next(RolloutPlanner(train_max_tokens=8, mode="dynamic", world_size=1, rank=0).train_microbatches(rollout))
    for row, i in enumerate(padded["sample_indices"]):
        n = len(rollout.input_ids[i])
        assert padded["advantages"][row, :n].tolist() == rollout.token_fields["advantages"][i].tolist()


def test_with_fields_adds_and_replaces_without_touching_the_original() -> None:
    rollout = Rollout(input_ids=[[5, 6, 7]], sample_fields={"reward": [1.0]})
    more = rollout.with_fields(token_fields={"old_logprobs": [torch.zeros(3)]}, sample_fields={"reward": [2.0]})
    assert more.sample_fields["reward"].tolist() == [2.0] and rollout.sample_fields["reward"].tolist() == [1.0]
    assert "old_logprobs" in more.token_fields and not rollout.token_fields


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": []}, "the rollout has no sample"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, "use Rollout.from_padded"),
        ({"input_ids": [[1, 2], []]}, "sample 1: input_ids is empty"),
        ({"input_ids": [[1.0, 2.0]]}, "sample 0: input_ids must hold integers"),
        ({"input_ids": [[1, -2]]}, "sample 0: input_ids holds a negative id"),
        ({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1]]}, "sample 0: loss_mask has 2 entries but input_ids has 3"),
        ({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 2, 1]]}, "sample 0: loss_mask must hold only 0 and 1"),
        ({"input_ids": [[1, 2, 3]], "loss_mask": [[1, 1, 1]]}, r"sample 0: loss_mask\[0\] is 1"),
        ({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[0, 1]]}, "loss_mask has 1 entries for 2 samples"),
        (
            {"input_ids": [[1, 2, 3]], "token_fields": {"advantages": [torch.zeros(2)]}},
            "sample 0: token field 'advantages' has 2 entries but the sample has 3 tokens",
        ),
        (
            {"input_ids": [[1, 2]], "token_fields": {"old_logprobs": [torch.tensor([0.0, float("nan")])]}},
            "token field 'old_logprobs' holds a NaN",
        ),
        ({"input_ids": [[1, 2]], "token_fields": {"labels": [torch.zeros(2)]}}, "token field name 'labels' is not"),
        ({"input_ids": [[1, 2]], "token_fields": {"adv": torch.zeros(1, 2)}}, "must be a list of 1 1-D tensors"),
        ({"input_ids": [[1, 2]], "sample_fields": {"step": [3]}}, "sample field name 'step' is not allowed"),
        ({"input_ids": [[1, 2], [3]], "sample_fields": {"reward": [1.0]}}, "'reward' has 1 entries for 2 samples"),
        ({"input_ids": [[1, 2]], "sample_fields": {"reward": [float("inf")]}}, "'reward' holds a NaN or an inf"),
        ({"input_ids": [[1, 2], [3, 4]], "group_ids": [0]}, "group_ids has 1 entries for 2 samples"),
        ({"input_ids": [[1, 2]], "group_ids": [0.5]}, "group_ids must hold integers"),
    ],
)
def test_bad_rollouts_fail_fast_with_named_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Rollout(**kwargs)


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        (torch.tensor([[1, 0, 1]]), "row 0 of attention_mask has a hole"),
        (torch.tensor([[0, 0, 0]]), "row 0 of attention_mask has no real token"),
        (torch.tensor([1, 1, 1]), r"must both be \[N, L\]"),
    ],
)
def test_bad_padded_rollouts_fail_fast(attention, message) -> None:
    with pytest.raises(ValueError, match=message):
        Rollout.from_padded(torch.tensor([[1, 2, 3]]), attention)


def test_planner_refuses_what_is_not_a_rollout() -> None:
    with pytest.raises(TypeError, match="expected a lit_seqpack.rl.Rollout"):
        next(RolloutPlanner(train_max_tokens=8, world_size=1, rank=0).train_microbatches([[1, 2, 3]]))


def test_the_fingerprint_tells_rollouts_apart_by_ids_masks_boundaries_and_groups() -> None:
    base = Rollout(input_ids=[[1, 2, 3], [4, 5]], loss_mask=[[0, 1, 1], [0, 1]], group_ids=[0, 0])
    same = Rollout(
        input_ids=[torch.tensor([1, 2, 3]), torch.tensor([4, 5])], loss_mask=base.loss_mask, group_ids=[0, 0]
    )
    assert base.fingerprint() == same.fingerprint()
    others = [
        Rollout(input_ids=[[1, 2, 3], [4, 6]], loss_mask=base.loss_mask, group_ids=[0, 0]),
        Rollout(input_ids=[[1, 2, 3], [4, 5]], loss_mask=[[0, 0, 1], [0, 1]], group_ids=[0, 0]),
        Rollout(input_ids=[[1, 2], [3, 4, 5]], loss_mask=[[0, 1], [0, 1, 1]], group_ids=[0, 0]),
        Rollout(input_ids=[[1, 2, 3], [4, 5]], loss_mask=base.loss_mask, group_ids=[0, 1]),
    ]
    assert len({base.fingerprint(), *(other.fingerprint() for other in others)}) == 1 + len(others)


def test_with_fields_keeps_the_samples_and_checks_only_the_new_fields() -> None:
    rollout = Rollout(input_ids=[[1, 2, 3], [4, 5]], sample_fields={"reward": [1.0, 0.0]}, group_ids=[0, 0])
    digest = rollout.fingerprint()
    more = rollout.with_fields(token_fields={"adv": [torch.ones(3), torch.ones(2)]})
    assert more.identity is rollout.identity and more.fingerprint() == digest
    assert more.input_ids is rollout.input_ids and more.lengths is rollout.lengths
    assert Rollout(input_ids=[[1, 2, 3], [4, 5]], group_ids=[0, 0]).identity is not rollout.identity
    with pytest.raises(ValueError, match="sample 1: token field 'adv' has 3 entries but the sample has 2 tokens"):
        rollout.with_fields(token_fields={"adv": [torch.ones(3), torch.ones(3)]})
    with pytest.raises(ValueError, match="'reward' is declared both as a token field and as a sample field"):
        rollout.with_fields(token_fields={"reward": [torch.ones(3), torch.ones(2)]})
    with pytest.raises(ValueError, match="sample field 'x' holds a NaN"):
        rollout.with_fields(sample_fields={"x": [float("nan"), 0.0]})


def test_the_token_digest_is_the_same_compiled_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from lit_seqpack.planning._kernels import DISABLE_ENV_VAR
    from lit_seqpack.rl.rollout import token_lanes

    rng = np.random.default_rng(0)
    ids, mask = rng.integers(0, 2**31, 5000), rng.random(5000) < 0.5
    compiled = token_lanes(ids, mask)
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    assert token_lanes(ids, mask) == compiled
    swapped = ids.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    flipped = mask.copy()
    flipped[7] = not flipped[7]
    assert len({compiled, token_lanes(swapped, mask), token_lanes(ids, flipped)}) == 3
