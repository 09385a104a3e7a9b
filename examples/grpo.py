"""GRPO on packed rollouts with manual optimization: old and reference log-probs, group advantages, a clipped loss
with a k3 KL penalty to the reference model and an entropy bonus, truncated completions masked out, and a
checkpoint at every rollout boundary to resume from.

Each ``training_step`` receives one rollout (synthetic prompts and responses with a rule-based reward, the same on
every rank; a response longer than ``--max-response`` is cut there and gets an all-zero loss mask, as NeMo-RL's
overlong filtering does). :meth:`RolloutPlanner.compute_per_token` computes the behaviour policy's and the frozen
reference model's log-probs (packed, no grad, gathered over ranks, one plan for both passes and the training);
rewards become advantages (``advantages(..., estimator=--estimator)``; the last prompt is answered once, a group of
one sample, whose advantage is 0); then exactly ``--steps-per-rollout`` optimizer steps run over the
planner's training microbatches::

    python examples/grpo.py                        # 1 process
    python examples/grpo.py --devices 2 --check    # 2 CPU processes (DDP on gloo); last line: the gradient error
    python examples/grpo.py --rollouts 3 --ckpt-dir ckpt --stop-after 1   # stops after rollout 0 with ckpt/last.ckpt
    python examples/grpo.py --rollouts 3 --ckpt-dir ckpt                  # resumes at rollout 1
    python examples/grpo.py --rollouts 2 --resume-check   # an interrupted-and-resumed run against a straight one

One rollout is one epoch (a one-item loader), so a checkpoint saved at the end of an epoch resumes exactly at the
next rollout. ``--check`` compares the first optimizer step's gradient (after DDP's all-reduce) with the same loss on
one big padded batch of that step's samples, computed in float64 on rank 0 with the stock model (eager attention).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_seqpack import HFCausalLM
from lit_seqpack.rl import (
    Rollout,
    RolloutPlanner,
    clipped_policy_loss,
    kl_estimate,
    policy_logits,
    step_loss,
    token_entropy,
    token_logprobs,
)
from lit_seqpack.rl.advantages import ADVANTAGE_ESTIMATORS, advantages, spread_over_tokens

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
TINY_LLAMA |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP on gloo when > 1)")
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts (one epoch each)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (a GRPO group)")
    parser.add_argument("--max-response", type=int, default=20, help="longer responses are cut and masked out")
    parser.add_argument("--steps-per-rollout", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--train-max-tokens", type=int, default=96, help="token budget of a training microbatch")
    parser.add_argument("--logprob-max-tokens", type=int, default=192, help="token budget of the log-prob passes")
    parser.add_argument("--normalize", default="token", choices=["token", "sequence", "group"])
    parser.add_argument("--estimator", default="grpo", choices=sorted(ADVANTAGE_ESTIMATORS), help="advantages")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="weight of the k3 KL to the reference model")
    parser.add_argument("--entropy-coef", type=float, default=0.01, help="weight of the entropy bonus")
    parser.add_argument("--ckpt-dir", default=None, help="save ckpt-dir/last.ckpt after every rollout; resume from it")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many rollouts (with --ckpt-dir)")
    parser.add_argument("--resume-check", action="store_true", help="compare a resumed run with a straight one")
    parser.add_argument("--check", action="store_true", help="print the first step's gradient error last")
    return parser.parse_args(argv)


def synthetic_rollout(iteration: int, prompts: int, group_size: int, max_response: int, vocab: int = 64) -> Rollout:
    """Prompts of 4-16 tokens, each answered ``group_size`` times (the last one once: a group of one sample) with 2-24
    tokens; reward: share of even tokens. A response longer than ``max_response`` is truncated there and masked out
    (no loss), reward 0."""
    gen = torch.Generator().manual_seed(1000 + iteration)
    ids, masks, rewards, groups = [], [], [], []
    for p in range(prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(4, 17, (1,), generator=gen)),), generator=gen)
        for _ in range(group_size if p < prompts - 1 else 1):
            groups.append(p)
            response = torch.randint(1, vocab, (int(torch.randint(2, 25, (1,), generator=gen)),), generator=gen)
            truncated = len(response) > max_response
            response = response[:max_response]
            ids.append(torch.cat([prompt, response]))
            masks.append(torch.arange(len(ids[-1])) >= len(prompt) if not truncated else torch.zeros(len(ids[-1])))
            rewards.append(torch.tensor(0.0) if truncated else (response % 2 == 0).float().mean())
    masks = [m.bool() for m in masks]
    return Rollout(input_ids=ids, loss_mask=masks, group_ids=groups, sample_fields={"reward": torch.stack(rewards)})


def group_advantages(rollout: Rollout, estimator: str = "grpo") -> list[torch.Tensor]:
    """One advantage per sample from its reward and group (a group of one gets 0), on each of its response tokens."""
    values = advantages(
        rollout.sample_fields["reward"], rollout.group_ids, estimator=estimator, token_counts=rollout.loss_tokens
    )
    return spread_over_tokens(values, rollout)


def grpo_token_loss(logits, labels, old, ref, advantages, args: argparse.Namespace) -> torch.Tensor:
    """The per-token loss: clipped surrogate + ``kl_coef`` k3 KL to the reference - ``entropy_coef`` entropy."""
    logprobs = token_logprobs(logits, labels)
    loss = clipped_policy_loss(logprobs, old, advantages) + args.kl_coef * kl_estimate(logprobs, ref, "k3")
    return loss - args.entropy_coef * token_entropy(logits, labels)


class GRPOPolicy(HFCausalLM):
    """A tiny random Llama trained with GRPO against a frozen copy of its initial weights; one rollout an epoch."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(config=TINY_LLAMA, lr=1e-3, lr_schedule="constant", weight_decay=0.0, attn_backend="sdpa")
        self.automatic_optimization = False
        self.args = args
        self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()  # kept in the checkpoint, not trained
        self.first_step: dict[str, Any] | None = None
        self.losses: list[float] = []

    def policy_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        return token_logprobs(policy_logits(self, batch), batch["labels"])

    def reference_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        return token_logprobs(self.reference(**self.seqpack_model_inputs(batch)).logits, batch["labels"])

    def training_step(self, batch: int, batch_idx: int) -> None:
        args, optimizer = self.args, self.optimizers()
        planner = RolloutPlanner(
            train_max_tokens=args.train_max_tokens,
            logprob_max_tokens=args.logprob_max_tokens,
            steps_per_rollout=args.steps_per_rollout,
            trainer=self.trainer,
        )
        rollout = synthetic_rollout(self.current_epoch, args.prompts, args.group_size, args.max_response)
        old = planner.compute_per_token(self.policy_logprobs, rollout, gather=True, device=self.device)
        ref = planner.compute_per_token(self.reference_logprobs, rollout, gather=True, device=self.device)
        fields = {"old_logprobs": old, "ref_logprobs": ref, "advantages": group_advantages(rollout, args.estimator)}
        rollout = rollout.with_fields(token_fields=fields)  # the same plans: with_fields keeps the rollout's identity
        weights = copy.deepcopy(self.model.state_dict()) if args.check and self.first_step is None else None
        step_total = 0.0
        for micro in planner.train_microbatches(rollout, device=self.device):
            token_loss = grpo_token_loss(
                policy_logits(self, micro), micro["labels"], micro["old_logprobs"], micro["ref_logprobs"],
                micro["advantages"], args,
            )  # fmt: skip
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

    first, args = policy.first_step, policy.args
    model = AutoModelForCausalLM.from_config(policy.model.config, attn_implementation="eager").double()
    model.load_state_dict(first["weights"])
    rollout, samples = first["rollout"], sorted(first["samples"])
    width = int(rollout.lengths[samples].max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    fields = {
        name: torch.zeros(ids.shape, dtype=torch.float64) for name in ("old_logprobs", "ref_logprobs", "advantages")
    }
    for row, i in enumerate(samples):
        n = len(rollout.input_ids[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        for name, values in fields.items():
            values[row, :n] = rollout.token_fields[name][i]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    labels = torch.where(mask, ids, -100)
    loss = grpo_token_loss(logits, labels, fields["old_logprobs"], fields["ref_logprobs"], fields["advantages"], args)
    loss = torch.where(mask, loss, 0.0)
    per_sample, tokens = loss.sum(dim=1), mask.sum(dim=1).double()
    has = tokens > 0  # truncated completions carry no loss and count in no mean
    if args.normalize == "token":
        total = per_sample.sum() / tokens.sum()
    elif args.normalize == "sequence":
        total = (per_sample[has] / tokens[has]).mean()
    else:
        groups = rollout.group_ids[samples]
        parts = [per_sample[groups == g].sum() / tokens[groups == g].sum() for g in groups.unique()]
        total = torch.stack(
            [p for p, g in zip(parts, groups.unique(), strict=True) if tokens[groups == g].sum()]
        ).mean()
    total.backward()
    errors = [
        (first["grads"][name].double() - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)
        for name, p in model.named_parameters()
    ]
    return float(torch.stack(errors).max())


def fit(args: argparse.Namespace, epochs: int, ckpt_dir: str | None) -> tuple[GRPOPolicy, Trainer]:
    """Train ``epochs`` rollouts, resuming from ``ckpt_dir/last.ckpt`` when it exists and saving it every rollout."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = GRPOPolicy(args)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, save_on_train_epoch_end=True))
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=epochs,
        use_distributed_sampler=False,  # every rank runs every rollout (the planner shards it)
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        callbacks=callbacks,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    last = None if ckpt_dir is None else Path(ckpt_dir, "last.ckpt")
    resume = str(last) if last is not None and last.exists() else None
    loader = torch.utils.data.DataLoader([0], batch_size=None)
    trainer.fit(policy, loader, ckpt_path=resume, weights_only=False)  # our own checkpoint: its hparams hold args
    return policy, trainer


def resume_error(args: argparse.Namespace) -> float:
    """Max weight difference between a straight run and one stopped after its first rollout, then resumed."""
    straight, _ = fit(args, args.rollouts, None)
    with tempfile.TemporaryDirectory() as ckpt:
        fit(args, 1, ckpt)
        resumed, _ = fit(args, args.rollouts, ckpt)
    pairs = zip(straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True)
    return max(float((a - b).abs().max()) for a, b in pairs)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.resume_check:
        error = resume_error(args)
        print(f"max weight difference, resumed after rollout 0 vs straight: {error:.2e}")
        return {"resume_error": error}
    policy, trainer = fit(args, args.stop_after or args.rollouts, args.ckpt_dir)
    rollouts = trainer.current_epoch
    result = {"loss": policy.losses[-1], "optimizer_steps": float(trainer.global_step)}
    if trainer.global_rank == 0:
        print(f"GRPO: {rollouts} rollouts, {trainer.global_step} optimizer steps, final loss {result['loss']:.4f}")
        if args.check:
            result["gradient_error"] = padded_gradient_error(policy)
            print(f"max relative gradient error vs one big padded batch: {result['gradient_error']:.2e}")
    return result


if __name__ == "__main__":
    main()
