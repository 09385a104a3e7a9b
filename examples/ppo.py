"""PPO on packed rollouts with a value head: one no-grad pass for old log-probs and values, KL-shaped rewards, GAE per
sample, then a clipped policy loss plus a clipped value loss, exact over microbatches and ranks.

Each ``training_step`` receives one rollout (synthetic prompts and responses with a rule-based score, the same on
every rank). :meth:`RolloutPlanner.compute_per_token` runs the policy and its value head over packed rows once (no
grad, gathered over ranks) and returns per sample the log-probs and the values, aligned with the tokens they score
(:func:`~lit_seqpack.rl.token_values`); a second pass gives the frozen reference model's log-probs. Rewards are
``-kl_coef * k1`` per response token plus the score on the last one; :func:`~lit_seqpack.rl.gae` turns them into
advantages (whitened over the rollout) and returns; then ``--steps-per-rollout`` optimizer steps run::

    python examples/ppo.py                        # 1 process
    python examples/ppo.py --devices 2 --check    # 2 CPU processes (DDP on gloo); last line: the gradient error

``--check`` compares the first optimizer step's gradient (after DDP's all-reduce; the decoder and the value head)
with the same loss on one big padded batch of that step's samples, in float64 on rank 0 with the stock model.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from lightning.pytorch import Trainer

from lit_seqpack import HFCausalLM
from lit_seqpack.rl import (
    Rollout,
    RolloutPlanner,
    clipped_policy_loss,
    gae,
    kl_estimate,
    policy_logits,
    step_loss,
    token_logprobs,
    value_loss,
)
from lit_seqpack.rl.values import token_values

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
TINY_LLAMA |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP on gloo when > 1)")
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts (training_step calls)")
    parser.add_argument("--samples", type=int, default=24, help="prompt + response samples per rollout")
    parser.add_argument("--steps-per-rollout", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--train-max-tokens", type=int, default=96, help="token budget of a training microbatch")
    parser.add_argument("--logprob-max-tokens", type=int, default=192, help="token budget of the no-grad passes")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="per-token KL penalty in the reward")
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--vf-coef", type=float, default=0.5, help="weight of the value loss")
    parser.add_argument("--value-clip", type=float, default=0.2)
    parser.add_argument("--check", action="store_true", help="print the first step's gradient error last")
    return parser.parse_args(argv)


def synthetic_rollout(iteration: int, samples: int, vocab: int = 64) -> Rollout:
    """Prompts of 4-16 tokens answered with 2-24 tokens; score: the share of even tokens of the response."""
    gen = torch.Generator().manual_seed(2000 + iteration)
    ids, masks, scores = [], [], []
    for _ in range(samples):
        prompt = torch.randint(1, vocab, (int(torch.randint(4, 17, (1,), generator=gen)),), generator=gen)
        response = torch.randint(1, vocab, (int(torch.randint(2, 25, (1,), generator=gen)),), generator=gen)
        ids.append(torch.cat([prompt, response]))
        masks.append(torch.arange(len(ids[-1])) >= len(prompt))
        scores.append((response % 2 == 0).float().mean())
    return Rollout(input_ids=ids, loss_mask=masks, sample_fields={"score": torch.stack(scores)})


def ppo_token_loss(logits, values, labels, batch: dict[str, Any], args: argparse.Namespace) -> torch.Tensor:
    """Clipped surrogate plus ``vf_coef`` times the clipped value loss, per token."""
    policy = clipped_policy_loss(token_logprobs(logits, labels), batch["old_logprobs"], batch["advantages"])
    critic = value_loss(values, batch["old_values"], batch["returns"], clip=args.value_clip)
    return policy + args.vf_coef * critic


class PPOPolicy(HFCausalLM):
    """A tiny random Llama with a value head on its output (a shared trunk), and a frozen reference copy."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(config=TINY_LLAMA, lr=1e-3, lr_schedule="constant", weight_decay=0.0, attn_backend="sdpa")
        self.automatic_optimization = False
        self.args = args
        self.value_head = torch.nn.Linear(TINY_LLAMA["vocab_size"], 1)
        self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.first_step: dict[str, Any] | None = None
        self.losses: list[float] = []

    def logprobs_and_values(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = policy_logits(self, batch)
        return logits, token_values(self.value_head(logits), batch["labels"])

    def old_pass(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[B, T, 2]``: log-probs and values in one forward (``compute_per_token`` keeps trailing dimensions)."""
        logits, values = self.logprobs_and_values(batch)
        return torch.stack([token_logprobs(logits, batch["labels"]), values], dim=-1)

    def reference_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        return token_logprobs(self.reference(**self.seqpack_model_inputs(batch)).logits, batch["labels"])

    def prepare(self, rollout: Rollout, planner: RolloutPlanner) -> Rollout:
        """Old log-probs and values, the reference's log-probs, KL-shaped rewards, whitened GAE advantages."""
        args = self.args
        old = planner.compute_per_token(self.old_pass, rollout, gather=True, device=self.device)
        ref = planner.compute_per_token(self.reference_logprobs, rollout, gather=True, device=self.device)
        old_logprobs, old_values = [o[:, 0].cpu() for o in old], [o[:, 1].cpu() for o in old]
        rewards = []
        for lp, rp, mask, score in zip(
            old_logprobs, ref, rollout.loss_mask, rollout.sample_fields["score"], strict=True
        ):
            reward = torch.where(mask, -args.kl_coef * kl_estimate(lp, rp.cpu(), "k1"), 0.0)
            reward[mask.nonzero().flatten()[-1]] += score
            rewards.append(reward)
        advantages, returns = gae(rewards, old_values, rollout.loss_mask, gamma=args.gamma, lam=args.lam)
        flat = torch.cat([a[m] for a, m in zip(advantages, rollout.loss_mask, strict=True)])
        mean, std = flat.mean(), flat.std() + 1e-6  # the same on every rank: the rollout is
        advantages = [torch.where(m, (a - mean) / std, 0.0) for a, m in zip(advantages, rollout.loss_mask, strict=True)]
        fields = {"old_logprobs": old_logprobs, "old_values": old_values, "advantages": advantages, "returns": returns}
        return rollout.with_fields(token_fields=fields)

    def training_step(self, batch: int, batch_idx: int) -> None:
        args, optimizer = self.args, self.optimizers()
        planner = RolloutPlanner(
            train_max_tokens=args.train_max_tokens,
            logprob_max_tokens=args.logprob_max_tokens,
            steps_per_rollout=args.steps_per_rollout,
            trainer=self.trainer,
        )
        rollout = self.prepare(synthetic_rollout(batch, args.samples), planner)
        weights = copy.deepcopy(self.state_dict()) if args.check and self.first_step is None else None
        step_total = 0.0
        for micro in planner.train_microbatches(rollout, device=self.device):
            logits, values = self.logprobs_and_values(micro)
            loss = step_loss(
                ppo_token_loss(logits, values, micro["labels"], micro, args), micro, normalize="token", module=self
            )
            self.manual_backward(loss)
            step_total += float(loss.detach()) / micro["world_size"]
            if micro["is_last_in_step"]:
                if weights is not None and self.first_step is None:
                    grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
                    samples = [i for r in planner.plan(rollout).microbatches[0] for mb in r for i in mb]
                    self.first_step = {"grads": grads, "weights": weights, "rollout": rollout, "samples": samples}
                optimizer.step()
                optimizer.zero_grad()
                self.losses.append(step_total)
                step_total = 0.0


def padded_gradient_error(policy: PPOPolicy) -> float:
    """Max relative error of the first step's gradient against one big padded batch in float64 (stock model)."""
    from transformers import AutoModelForCausalLM

    first = policy.first_step
    model = AutoModelForCausalLM.from_config(policy.model.config, attn_implementation="eager").double()
    model.load_state_dict({k[len("model.") :]: v for k, v in first["weights"].items() if k.startswith("model.")})
    head = copy.deepcopy(policy.value_head).double()
    head.load_state_dict(
        {k[len("value_head.") :]: v for k, v in first["weights"].items() if k.startswith("value_head.")}
    )
    rollout, samples = first["rollout"], sorted(first["samples"])
    width = int(rollout.lengths[samples].max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    names = ("old_logprobs", "old_values", "advantages", "returns")
    fields = {name: torch.zeros(ids.shape, dtype=torch.float64) for name in names}
    for row, i in enumerate(samples):
        n = len(rollout.input_ids[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        for name, values in fields.items():
            values[row, :n] = rollout.token_fields[name][i]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    labels = torch.where(mask, ids, -100)
    loss = torch.where(
        mask, ppo_token_loss(logits, token_values(head(logits), labels), labels, fields, policy.args), 0.0
    )
    (loss.sum() / mask.sum()).backward()
    expected = {f"model.{n}": p.grad for n, p in model.named_parameters()}
    expected |= {f"value_head.{n}": p.grad for n, p in head.named_parameters()}
    errors = [
        (first["grads"][name].double() - grad).abs().max() / grad.abs().max().clamp(min=1e-30)
        for name, grad in expected.items()
    ]
    return float(torch.stack(errors).max())


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = PPOPolicy(args)
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
        print(f"PPO: {args.rollouts} rollouts, {trainer.global_step} optimizer steps, final loss {result['loss']:.4f}")
        if args.check:
            result["gradient_error"] = padded_gradient_error(policy)
            print(f"max relative gradient error vs one big padded batch: {result['gradient_error']:.2e}")
    return result


if __name__ == "__main__":
    main()
