"""The new loss modes (``sequence_token_sum``, ``constant``) and policy losses (CISPO, SAPO, REINFORCE): one optimizer
step over packed or dynamic microbatches (gradient accumulation; 1 process, then 2 gloo ranks through Lightning's DDP)
equals the loss on one big padded batch in float64, written here without lit_seqpack's batching; the losses against
their formulas per token, and the log-ratio guard."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.rl.forward import policy_logits
from lit_seqpack.rl.loss import (
    cispo_loss,
    clipped_policy_loss,
    reinforce_loss,
    sapo_loss,
    step_loss,
    token_logprobs,
)
from lit_seqpack.rl.planner import RolloutPlanner
from tests._limits import TEST_TIMEOUT_S
from tests._ranks import free_port, join_ranks
from tests.model.test_exact_loss import assert_gradients_match
from tests.rl._policies import one_item_loader, prefixed
from tests.rl._rollouts import (
    TINY_REFERENCE,
    VOCAB,
    make_policy,
    make_rollout,
    plain_logits,
    stock_model,
    with_policy_fields,
    without_loss,
)

FACTOR = 37.0  # Dr.GRPO's constant (e.g. samples per step x max completion length)
CASES = [  # (policy loss, normalize)
    ("ppo", "sequence_token_sum"),
    ("cispo", "constant"),
    ("sapo", "sequence_token_sum"),
    ("reinforce", "constant"),
]


def policy_loss(kind: str, logprobs, old, adv) -> torch.Tensor:
    if kind == "ppo":
        return clipped_policy_loss(logprobs, old, adv)
    if kind == "cispo":
        return cispo_loss(logprobs, old, adv, clip_low=0.1, clip_high=0.3)
    if kind == "sapo":
        return sapo_loss(logprobs, old, adv, tau_pos=1.0, tau_neg=1.05)
    return reinforce_loss(logprobs, adv)


def rollout_with_fields(seed: int = 0):
    module = make_policy("reference", seed=seed)
    rollout = with_policy_fields(module, make_rollout(count=12, seed=seed, group_size=3), seed=seed)
    return module, without_loss(rollout, [4])  # a sample without a loss counts in no mean


def padded_gradients(module, rollout, samples: list[int], kind: str, normalize: str) -> dict[str, torch.Tensor]:
    """The step's loss on one right-padded float64 batch of ``samples`` through the stock model."""
    model = stock_model(module).double()
    width = int(rollout.lengths[samples].max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    old, adv = torch.zeros(ids.shape, dtype=torch.float64), torch.zeros(ids.shape, dtype=torch.float64)
    for row, i in enumerate(samples):
        n = int(rollout.lengths[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        old[row, :n] = rollout.token_fields["old_logprobs"][i].double()
        adv[row, :n] = rollout.token_fields["advantages"][i].double()
    logprobs = token_logprobs(plain_logits(model, ids, attention), torch.where(mask, ids, -100))
    per_sample = torch.where(mask, policy_loss(kind, logprobs, old, adv), 0.0).sum(dim=1)
    has_loss = mask.any(dim=1)
    total = per_sample[has_loss].mean() if normalize == "sequence_token_sum" else per_sample.sum() / FACTOR
    total.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def run_step(module, rollout, kind: str, normalize: str, batches) -> None:
    factor = FACTOR if normalize == "constant" else None
    for micro in batches:
        logprobs = token_logprobs(policy_logits(module, micro), micro["labels"])
        loss = policy_loss(kind, logprobs, micro["old_logprobs"], micro["advantages"])
        step_loss(loss, micro, normalize=normalize, loss_scale_factor=factor, optimization="manual").backward()


@pytest.mark.parametrize(("kind", "normalize"), CASES)
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_one_step_equals_the_big_padded_batch(kind: str, normalize: str, mode: str) -> None:
    module, rollout = rollout_with_fields()
    planner = RolloutPlanner(train_max_tokens=40, mode=mode, steps_per_rollout=1, world_size=1, rank=0)
    batches = list(planner.train_microbatches(rollout))
    assert len(batches) > 2 and len({b["num_loss_tokens"] for b in batches}) > 1
    run_step(module, rollout, kind, normalize, batches)
    expected = padded_gradients(module, rollout, list(range(len(rollout))), kind, normalize)
    got = {name: p.grad for name, p in module.named_parameters()}
    assert_gradients_match(got, prefixed(expected), rtol=1e-5)


def test_constant_needs_its_factor_and_only_it_takes_one() -> None:
    _, rollout = rollout_with_fields()
    batch = next(RolloutPlanner(train_max_tokens=64, world_size=1, rank=0).train_microbatches(rollout))
    ones = torch.ones(batch["labels"].shape)
    with pytest.raises(ValueError, match="loss_scale_factor is the constant of normalize='constant'"):
        step_loss(ones, batch, normalize="constant", optimization="manual")
    with pytest.raises(ValueError, match="loss_scale_factor is the constant"):
        step_loss(ones, batch, normalize="token", loss_scale_factor=2.0, optimization="manual")
    with pytest.raises(ValueError, match="loss_scale_factor must be a finite number > 0, got -1"):
        step_loss(ones, batch, normalize="constant", loss_scale_factor=-1.0, optimization="manual")
    value = step_loss(ones, batch, normalize="constant", loss_scale_factor=4.0, optimization="manual")
    assert value.item() == pytest.approx(batch["num_loss_tokens"] / 4.0)


def test_losses_equal_their_formulas_per_token() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(50, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + 0.5 * torch.randn(50, generator=gen, dtype=torch.float64)
    adv = torch.randn(50, generator=gen, dtype=torch.float64)
    for i in range(50):  # each token on its own
        r = math.exp(lp[i].item() - old[i].item())
        clipped = min(max(r, 0.9), 1.3)
        assert cispo_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1], clip_low=0.1, clip_high=0.3).item() == (
            pytest.approx(-clipped * adv[i].item() * lp[i].item(), rel=1e-12)
        )
        tau = 1.0 if adv[i] > 0 else 1.05
        gate = 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
        assert sapo_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1]).item() == pytest.approx(-gate * adv[i].item())
        assert reinforce_loss(lp[i : i + 1], adv[i : i + 1]).item() == pytest.approx(-adv[i].item() * lp[i].item())
    cispo_loss(lp, old, adv, clip_low=0.1, clip_high=0.3).sum().backward()  # the clipped weight is detached
    weight = (lp.detach() - old).exp().clamp(0.9, 1.3)
    torch.testing.assert_close(lp.grad, -weight * adv, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_loss_is_nan_or_inf_for_huge_finite_log_ratios(dtype: torch.dtype) -> None:
    lp = torch.tensor([100.0, -100.0, 100.0, 0.0], dtype=dtype, requires_grad=True)
    old = torch.zeros(4, dtype=dtype)
    adv = torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=dtype)  # zero advantages: a GRPO group of equal rewards
    assert torch.isnan(torch.exp(lp.detach() - old) * adv).any()  # what the guard prevents
    losses = [
        clipped_policy_loss(lp, old, adv),
        clipped_policy_loss(lp, old, adv, dual_clip=3.0),
        cispo_loss(lp, old, adv),
        sapo_loss(lp, old, adv),
    ]
    for loss in losses:
        assert torch.isfinite(loss).all(), loss
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        assert torch.isfinite(grad).all(), grad


class ManualModes(ReferenceLM):
    """Every (loss, normalize) case over one rollout at the same weights (the optimizer never steps); each rank saves
    its gradient per case."""

    def __init__(self, rollout, save_dir: str) -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.automatic_optimization = False
        self.rollout, self.save_dir, self.grads = rollout, save_dir, []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        planner = RolloutPlanner(train_max_tokens=40, steps_per_rollout=1, trainer=self.trainer)
        for kind, normalize in CASES:
            factor = FACTOR if normalize == "constant" else None
            for micro in planner.train_microbatches(self.rollout, device=self.device):
                logprobs = token_logprobs(policy_logits(self, micro), micro["labels"])
                loss = policy_loss(kind, logprobs, micro["old_logprobs"], micro["advantages"])
                self.manual_backward(step_loss(loss, micro, normalize=normalize, loss_scale_factor=factor, module=self))
            self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})
            optimizer.zero_grad()

    def on_train_end(self) -> None:
        torch.save(self.grads, f"{self.save_dir}/modes{self.global_rank}.pt")


def _modes_worker(rank: int, port: int, out_dir: str) -> None:
    from tests.rl.test_ddp import _ddp_trainer

    join_ranks(rank, 2, port)
    reference, rollout = rollout_with_fields()
    torch.manual_seed(0)
    module = ManualModes(rollout, out_dir)
    module.load_state_dict(reference.state_dict())
    _ddp_trainer(max_epochs=1).fit(module, one_item_loader())


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_loss_modes_on_two_ranks_equal_the_big_padded_batch(tmp_path: Path) -> None:
    mp.spawn(_modes_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    reference, rollout = rollout_with_fields()
    saved = [torch.load(tmp_path / f"modes{rank}.pt") for rank in range(2)]
    for k, (kind, normalize) in enumerate(CASES):
        expected = prefixed(padded_gradients(reference, rollout, list(range(len(rollout))), kind, normalize))
        for rank in range(2):
            assert_gradients_match(saved[rank][k], expected, rtol=1e-5)
