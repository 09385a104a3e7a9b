"""RL's log-prob pass from hidden states in chunks (``policy_token_logprobs``) equals ``token_logprobs`` of the full
logits: values on the planner's packed and padded batches (each sample as if run alone), and gradients."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.rl import RolloutPlanner, policy_logits, token_logprobs
from lit_seqpack.rl.forward import policy_token_logprobs
from lit_seqpack.rl.objectives import temperature_scaled
from tests.rl._rollouts import alone_logprobs, make_policy, make_rollout


@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_chunked_logprobs_equal_each_sample_alone(kind: str, mode: str) -> None:
    module = make_policy(kind)
    module.hparams.loss_chunk_size = 7
    assert module.seqpack_output_head() is not None
    rollout = make_rollout()
    planner = RolloutPlanner(train_max_tokens=64, logprob_max_tokens=64, mode=mode, world_size=1, rank=0)
    got = planner.compute_per_token(lambda batch: policy_token_logprobs(module, batch), rollout)
    for value, expected in zip(got, alone_logprobs(module, rollout), strict=True):
        assert torch.allclose(value, expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["reference", "hf"])
def test_chunked_logprobs_and_their_gradients_equal_the_full_logits_path(kind: str) -> None:
    module = make_policy(kind).train()
    module.hparams.loss_chunk_size = 5
    planner = RolloutPlanner(train_max_tokens=96, world_size=1, rank=0)
    batch = next(iter(planner.train_microbatches(make_rollout(6))))
    weights = torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(0))
    results = []
    for chunked in (False, True):
        module.hparams.chunked_loss = chunked
        module.zero_grad(set_to_none=True)
        if chunked:
            logprobs = policy_token_logprobs(module, batch, temperature=0.7)
        else:
            logprobs = token_logprobs(temperature_scaled(policy_logits(module, batch), 0.7), batch["labels"])
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}))
    (plain, plain_grads), (chunked, chunked_grads) = results
    assert torch.allclose(chunked, plain, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        assert float((chunked_grads[name] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()), name


def test_without_a_head_the_full_logits_path_runs() -> None:
    module = make_policy("reference")
    module.hparams.chunked_loss = False
    planner = RolloutPlanner(train_max_tokens=96, world_size=1, rank=0)
    batch = next(iter(planner.train_microbatches(make_rollout(4))))
    expected = token_logprobs(policy_logits(module, batch), batch["labels"])
    assert torch.equal(policy_token_logprobs(module, batch), expected)
    with pytest.raises(ValueError, match="temperature"):
        policy_token_logprobs(module, batch, temperature=0.0)
