"""GRPO on packed rollouts with manual optimization: a log-prob pass, group advantages, a clipped policy loss.

Each ``training_step`` receives one rollout (synthetic prompts and responses with a rule-based reward, the same on
every rank), computes the behaviour policy's log-probs with :meth:`RolloutPlanner.compute_per_token` (packed, no
grad, gathered over ranks), turns the rewards into group-normalised advantages, then runs exactly
``--steps-per-rollout`` optimizer steps over the planner's training microbatches with a token-mean clipped loss::

    python examples/grpo.py                        # 1 process
    python examples/grpo.py --devices 2 --check    # 2 CPU processes (DDP on gloo); last line: the gradient error

``--check`` compares the first optimizer step's gradient (after DDP's all-reduce) with the same loss on one big
padded batch of that step's samples, computed in float64 on rank 0 with the stock model (eager attention).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from lightning.pytorch import Trainer

from lit_seqpack import HFCausalLM
from lit_seqpack.rl import Rollout, RolloutPlanner, clipped_policy_loss, policy_logits, step_loss, token_logprobs

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
TINY_LLAMA |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP on gloo when > 1)")
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts (training_step calls)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (a GRPO group)")
    parser.add_argument("--steps-per-rollout", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--train-max-tokens", type=int, default=96, help="token budget of a training microbatch")
    parser.add_argument("--logprob-max-tokens", type=int, default=192, help="token budget of the log-prob pass")
    parser.add_argument("--normalize", default="token", choices=["token", "sequence", "group"])
    parser.add_argument("--check", action="store_true", help="print the first step's gradient error last")
    return parser.parse_args(argv)


def synthetic_rollout(iteration: int, prompts: int, group_size: int, vocab: int = 64) -> Rollout:
    """Prompts of 4-16 tokens, each answered ``group_size`` times with 2-24 tokens; reward: share of even tokens."""
    gen = torch.Generator().manual_seed(1000 + iteration)
    ids, masks, rewards = [], [], []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(4, 17, (1,), generator=gen)),), generator=gen)
        for _ in range(group_size):
            response = torch.randint(1, vocab, (int(torch.randint(2, 25, (1,), generator=gen)),), generator=gen)
            ids.append(torch.cat([prompt, response]))
            masks.append(torch.arange(len(ids[-1])) >= len(prompt))
            rewards.append((response % 2 == 0).float().mean())
    groups = torch.arange(prompts).repeat_interleave(group_size)
    return Rollout(input_ids=ids, loss_mask=masks, group_ids=groups, sample_fields={"reward": torch.stack(rewards)})


def group_advantages(rollout: Rollout) -> list[torch.Tensor]:
    """GRPO: ``(reward - group mean) / (group std + 1e-4)``, repeated over each sample's tokens."""
    rewards, groups = rollout.sample_fields["reward"], rollout.group_ids
    advantages = torch.zeros_like(rewards)
    for g in groups.unique():
        members = groups == g
        advantages[members] = (rewards[members] - rewards[members].mean()) / (rewards[members].std() + 1e-4)
    return [torch.full((len(ids),), float(a)) for ids, a in zip(rollout.input_ids, advantages, strict=True)]


class GRPOPolicy(HFCausalLM):
    """A tiny random Llama trained with GRPO; one ``training_step`` per rollout."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(config=TINY_LLAMA, lr=1e-3, lr_schedule="constant", weight_decay=0.0, attn_backend="sdpa")
        self.automatic_optimization = False
        self.args = args
        self.first_step: dict[str, Any] | None = None
        self.losses: list[float] = []

    def policy_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        return token_logprobs(policy_logits(self, batch), batch["labels"])

    def training_step(self, batch: int, batch_idx: int) -> None:
        args, optimizer = self.args, self.optimizers()
        planner = RolloutPlanner(
            train_max_tokens=args.train_max_tokens,
            logprob_max_tokens=args.logprob_max_tokens,
            steps_per_rollout=args.steps_per_rollout,
            trainer=self.trainer,
        )
        rollout = synthetic_rollout(batch, args.prompts, args.group_size)
        old = planner.compute_per_token(self.policy_logprobs, rollout, gather=True, device=self.device)
        rollout = rollout.with_fields(token_fields={"old_logprobs": old, "advantages": group_advantages(rollout)})
        weights = copy.deepcopy(self.model.state_dict()) if args.check and self.first_step is None else None
        step_total = 0.0
        for micro in planner.train_microbatches(rollout, device=self.device):
            token_loss = clipped_policy_loss(self.policy_logprobs(micro), micro["old_logprobs"], micro["advantages"])
            loss = step_loss(token_loss, micro, normalize=args.normalize, module=self)
            self.manual_backward(loss)
            step_total += float(loss.detach()) / micro["world_size"]
            if micro["is_last_in_step"]:
                if weights is not None and self.first_step is None:
                    grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
                    samples = [i for r in planner.plan(rollout).microbatches[0] for mb in r for i in mb]
                    self.first_step = {"grads": grads, "weights": weights, "rollout": rollout, "samples": samples}
                optimizer.step()
                optimizer.zero_grad()
                self.losses.append(step_total)
                step_total = 0.0


def padded_gradient_error(policy: GRPOPolicy) -> float:
    """Max relative error of the first step's gradient against one big padded batch in float64 (stock model)."""
    from transformers import AutoModelForCausalLM

    first, normalize = policy.first_step, policy.args.normalize
    model = AutoModelForCausalLM.from_config(policy.model.config, attn_implementation="eager").double()
    model.load_state_dict(first["weights"])
    rollout, samples = first["rollout"], sorted(first["samples"])
    width = int(rollout.lengths[samples].max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    old, adv = torch.zeros(ids.shape, dtype=torch.float64), torch.zeros(ids.shape, dtype=torch.float64)
    for row, i in enumerate(samples):
        n = len(rollout.input_ids[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        old[row, :n], adv[row, :n] = rollout.token_fields["old_logprobs"][i], rollout.token_fields["advantages"][i]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    loss = torch.where(mask, clipped_policy_loss(token_logprobs(logits, torch.where(mask, ids, -100)), old, adv), 0.0)
    per_sample, tokens = loss.sum(dim=1), mask.sum(dim=1).double()
    if normalize == "token":
        total = per_sample.sum() / tokens.sum()
    elif normalize == "sequence":
        total = (per_sample / tokens).mean()
    else:
        groups = rollout.group_ids[samples]
        total = torch.stack([per_sample[groups == g].sum() / tokens[groups == g].sum() for g in groups.unique()]).mean()
    total.backward()
    errors = [
        (first["grads"][name].double() - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)
        for name, p in model.named_parameters()
    ]
    return float(torch.stack(errors).max())


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = GRPOPolicy(args)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=1,
        use_distributed_sampler=False,  # every rank runs every rollout (the planner shards it)
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(policy, torch.utils.data.DataLoader(list(range(args.rollouts)), batch_size=None))
    result = {"loss": policy.losses[-1], "optimizer_steps": float(trainer.global_step)}
    if trainer.global_rank == 0:
        print(f"GRPO: {args.rollouts} rollouts, {trainer.global_step} optimizer steps, final loss {result['loss']:.4f}")
        if args.check:
            result["gradient_error"] = padded_gradient_error(policy)
            print(f"max relative gradient error vs one big padded batch: {result['gradient_error']:.2e}")
    return result


if __name__ == "__main__":
    main()
