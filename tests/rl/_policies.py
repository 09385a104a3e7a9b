"""LightningModules that train a policy on rollouts: automatic optimization through the mixin's ``seqpack_loss``,
and manual optimization with one or more optimizer steps per rollout inside ``training_step``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, Trainer

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.rl import Rollout, RolloutPlanner, clipped_policy_loss, policy_logits, step_loss, token_logprobs
from lit_seqpack.rl.loss import loss_output
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
    """One ``training_step`` per rollout: every optimizer step of the rollout, from the planner's microbatches.

    With several ``normalize`` values the rollout is run once per value, at the same weights (the gradients are
    kept and zeroed, the optimizer never steps); ``save_dir`` makes each rank save what it kept.
    """

    def __init__(
        self, normalize: str | list[str], rollout: Rollout, planner_kwargs: dict[str, Any], save_dir: str | None = None
    ) -> None:
        super().__init__(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
        self.automatic_optimization = False
        self.normalize, self.rollout, self.planner_kwargs, self.save_dir = normalize, rollout, planner_kwargs, save_dir
        self.step_gradients: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        planner = RolloutPlanner(**self.planner_kwargs, trainer=self.trainer)
        step_optimizer = isinstance(self.normalize, str)
        for normalize in [self.normalize] if step_optimizer else self.normalize:
            for micro in planner.train_microbatches(self.rollout, device=self.device):
                logits = policy_logits(self, micro)
                token_loss = clipped_policy_loss(
                    token_logprobs(logits, micro["labels"]), micro["old_logprobs"], micro["advantages"]
                )
                self.manual_backward(step_loss(token_loss, micro, normalize=normalize, module=self))
                if micro["is_last_in_step"]:
                    self.step_gradients.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})
                    if step_optimizer:
                        optimizer.step()
                    optimizer.zero_grad()

    def on_train_end(self) -> None:
        if self.save_dir is not None:
            torch.save(self.step_gradients, f"{self.save_dir}/manual{self.global_rank}.pt")


class RolloutBatches(LightningDataModule):
    """Each rank's training microbatches of a rollout, planned in the rank's own process from the trainer."""

    def __init__(self, rollout: Rollout, planner_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.rollout, self.planner_kwargs = rollout, planner_kwargs

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        planner = RolloutPlanner(**self.planner_kwargs, trainer=self.trainer)
        return torch.utils.data.DataLoader(list(planner.train_microbatches(self.rollout)), batch_size=None)


def one_item_loader() -> torch.utils.data.DataLoader:
    """A loader of one dummy item: the manual policy's ``training_step`` runs once, over the whole rollout."""
    return torch.utils.data.DataLoader([0], batch_size=None)


def prefixed(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain decoder's gradients named like the LightningModule's parameters (``model.`` + name)."""
    return {f"model.{name}": grad for name, grad in gradients.items()}


__all__ = ["AutomaticPolicy", "ManualPolicy", "RolloutBatches", "one_item_loader", "prefixed"]


def cpu_trainer(**kwargs: Any) -> Trainer:
    """A quiet one-step fp32 CPU Trainer (no logger, checkpoint, progress bar or summary)."""
    return Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
