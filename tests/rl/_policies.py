"""LightningModules that train a policy on rollouts: automatic optimization through the mixin's ``seqpack_loss``,
and manual optimization with one or more optimizer steps per rollout inside ``training_step``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.rl import Rollout, RolloutPlanner, clipped_policy_loss, loss_output, step_loss, token_logprobs
from tests.rl._rollouts import TINY_REFERENCE, VOCAB


class AutomaticPolicy(ReferenceLM):
    """The mixin runs forward and the exact normalisation; only the policy loss is written here."""

    def __init__(self, normalize: str) -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.normalize = normalize

    def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
        logprobs = token_logprobs(logits, batch["labels"])
        token_loss = clipped_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"])
        return loss_output(token_loss, batch, normalize=self.normalize)


class ManualPolicy(ReferenceLM):
    """One ``training_step`` per rollout: every optimizer step of the rollout, from the planner's microbatches."""

    def __init__(self, normalize: str, rollout: Rollout, planner_kwargs: dict[str, Any]) -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.automatic_optimization = False
        self.normalize, self.rollout, self.planner_kwargs = normalize, rollout, planner_kwargs
        self.step_gradients: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        planner = RolloutPlanner(**self.planner_kwargs, trainer=self.trainer)
        for micro in planner.train_microbatches(self.rollout, device=self.device):
            logits = self.seqpack_forward(micro)
            token_loss = clipped_policy_loss(
                token_logprobs(logits, micro["labels"]), micro["old_logprobs"], micro["advantages"]
            )
            self.manual_backward(step_loss(token_loss, micro, normalize=self.normalize, module=self))
            if micro["is_last_in_step"]:
                self.step_gradients.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})
                optimizer.step()
                optimizer.zero_grad()


def one_item_loader() -> torch.utils.data.DataLoader:
    """A loader of one dummy item: the manual policy's ``training_step`` runs once, over the whole rollout."""
    return torch.utils.data.DataLoader([0], batch_size=None)


def prefixed(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain decoder's gradients named like the LightningModule's parameters (``model.`` + name)."""
    return {f"model.{name}": grad for name, grad in gradients.items()}


__all__ = ["AutomaticPolicy", "LightningModule", "ManualPolicy", "one_item_loader", "prefixed"]
