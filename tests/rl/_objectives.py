"""A policy whose loss uses every objective helper (temperature, truncated importance sampling, dual clip, GSPO's
sequence ratio, k3 KL to a reference, entropy bonus), and the same loss on one big padded batch, written without
lit_seqpack's batching (full log-softmax entropy, per-row sequence means)."""

from __future__ import annotations

from typing import Any

import torch

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.rl import (
    Rollout,
    clipped_policy_loss,
    kl_estimate,
    token_entropy,
    token_logprobs,
    truncated_importance_weights,
)
from lit_seqpack.rl.loss import loss_output
from lit_seqpack.rl.objectives import sequence_log_ratio, temperature_scaled
from tests.rl._rollouts import TINY_REFERENCE, VOCAB, alone_logprobs, plain_logits, reference_step_mean, stock_model

TEMPERATURE, CAP, DUAL_CLIP, KL_COEF, ENTROPY_COEF = 0.7, 1.2, 1.5, 0.1, 0.05


def objective_terms(logits, labels, old, sampler, ref, adv, *, log_ratio) -> torch.Tensor:
    """The per-token loss both sides share, from logits already scaled by the temperature."""
    logprobs = token_logprobs(logits, labels)
    ratio = log_ratio(logprobs) if log_ratio is not None else None
    policy = clipped_policy_loss(logprobs, old, adv, dual_clip=DUAL_CLIP, log_ratio=ratio)
    policy = policy * truncated_importance_weights(old, sampler, cap=CAP)
    return policy + KL_COEF * kl_estimate(logprobs, ref, "k3"), logprobs


class ObjectivePolicy(ReferenceLM):
    """Automatic optimization: the mixin runs forward; ``seqpack_loss`` combines the objective helpers."""

    def __init__(self, normalize: str, gspo: bool = False) -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.normalize, self.gspo = normalize, gspo

    def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
        logits = temperature_scaled(logits, TEMPERATURE)
        old = batch["old_logprobs"]
        ratio = (lambda lp: sequence_log_ratio(lp, old, batch)) if self.gspo else None
        loss, _ = objective_terms(
            logits, batch["labels"], old, batch["sampler_logprobs"], batch["ref_logprobs"], batch["advantages"],
            log_ratio=ratio,
        )  # fmt: skip
        loss = loss - ENTROPY_COEF * token_entropy(logits, batch["labels"], chunk=7)
        return loss_output(loss, batch, normalize=self.normalize)


def with_objective_fields(module: torch.nn.Module, rollout: Rollout, seed: int = 0) -> Rollout:
    """Adds ``sampler_logprobs`` and ``ref_logprobs``: the policy's own, perturbed (some weights hit the cap)."""
    gen = torch.Generator().manual_seed(100 + seed)
    own = alone_logprobs(module, rollout)
    return rollout.with_fields(
        token_fields={
            "sampler_logprobs": [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in own],
            "ref_logprobs": [lp + 0.2 * torch.randn(lp.shape, generator=gen) for lp in own],
        }
    )


def padded_objective_gradients(
    module: torch.nn.Module, rollout: Rollout, samples: list[int], normalize: str, gspo: bool = False
) -> dict[str, torch.Tensor]:
    """Gradient (float64) of the objective over ``samples`` as one right-padded batch."""
    model = stock_model(module).double()
    width = int(rollout.lengths[samples].max())
    shape = (len(samples), width)
    ids, mask, attention = (
        torch.zeros(shape, dtype=torch.long),
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape),
    )
    names = ("old_logprobs", "sampler_logprobs", "ref_logprobs", "advantages")
    fields = {name: torch.zeros(shape, dtype=torch.float64) for name in names}
    for row, i in enumerate(samples):
        n = int(rollout.lengths[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        for name in names:
            fields[name][row, :n] = rollout.token_fields[name][i].double()
    logits = plain_logits(model, ids, attention.long()) / TEMPERATURE
    labels = torch.where(mask, ids, -100)
    tokens = mask.sum(dim=1, keepdim=True).clamp(min=1)

    def row_mean(lp: torch.Tensor) -> torch.Tensor:  # GSPO: each row's mean log-ratio on its loss tokens
        return torch.where(mask, (torch.where(mask, lp - fields["old_logprobs"], 0.0).sum(1, keepdim=True) / tokens), 0)

    loss, _ = objective_terms(
        logits, labels, fields["old_logprobs"], fields["sampler_logprobs"], fields["ref_logprobs"],
        fields["advantages"], log_ratio=row_mean if gspo else None,
    )  # fmt: skip
    log_p = logits.log_softmax(-1)
    entropy = torch.nn.functional.pad(-(log_p.exp() * log_p).sum(-1)[:, :-1], (1, 0))
    loss = torch.where(mask, loss - ENTROPY_COEF * entropy, 0.0)
    groups = rollout.group_ids[samples] if rollout.group_ids is not None else torch.arange(len(samples))
    reference_step_mean(loss.sum(dim=1), mask.sum(dim=1).double(), groups, normalize).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


__all__ = ["ObjectivePolicy", "objective_terms", "padded_objective_gradients", "with_objective_fields"]
