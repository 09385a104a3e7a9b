"""DPO on packed preference pairs with automatic optimization: pairs kept in one microbatch, an exact pair mean.

Chosen and rejected responses of a prompt share a group id, and ``keep_together="microbatch"`` never splits a pair,
so the DPO loss (not a per-token loss: a function of both sequences' log-prob sums) is computed inside each
microbatch. The reference model's log-probs come from one packed, no-grad pass (:meth:`compute_per_token`,
gathered over ranks); the loss goes through :class:`~lit_seqpack.model.mixin.PackedSequenceMixin` (override of
``seqpack_loss``) whose exact normalisation divides by the step's pair count, over accumulation and ranks::

    python examples/dpo.py                         # 1 process
    python examples/dpo.py --devices 2 --check     # 2 CPU processes (DDP on gloo); last line: the gradient error

``--check`` compares the first optimizer step's gradient (after DDP's all-reduce) with the DPO loss of one big
padded batch of that step's pairs, in float64 on rank 0 with the stock model (eager attention).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, Trainer

from lit_seqpack import HFCausalLM
from lit_seqpack.model.loss import LossOutput
from lit_seqpack.rl import Rollout, RolloutPlanner, policy_logits, token_logprobs
from lit_seqpack.rl.unpack import document_sums

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
TINY_LLAMA |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP on gloo when > 1)")
    parser.add_argument("--pairs", type=int, default=24, help="preference pairs")
    parser.add_argument("--pairs-per-step", type=int, default=12, help="pairs of one optimizer step")
    parser.add_argument("--accumulate-grad-batches", type=int, default=3, help="microbatches per rank per step")
    parser.add_argument("--max-tokens", type=int, default=192, help="token budget of a microbatch")
    parser.add_argument("--max-steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO temperature")
    parser.add_argument("--check", action="store_true", help="print the first step's gradient error last")
    return parser.parse_args(argv)


def preference_pairs(pairs: int, vocab: int = 64) -> Rollout:
    """Pairs ``(prompt + chosen, prompt + rejected)`` with random tokens; ``chosen`` is 1.0 on the chosen one."""
    gen = torch.Generator().manual_seed(7)
    ids, masks, chosen = [], [], []
    for _ in range(pairs):
        prompt = torch.randint(1, vocab, (int(torch.randint(3, 13, (1,), generator=gen)),), generator=gen)
        for flag in (1.0, 0.0):
            response = torch.randint(1, vocab, (int(torch.randint(2, 21, (1,), generator=gen)),), generator=gen)
            ids.append(torch.cat([prompt, response]))
            masks.append(torch.arange(len(ids[-1])) >= len(prompt))
            chosen.append(flag)
    groups = torch.arange(pairs).repeat_interleave(2)
    return Rollout(input_ids=ids, loss_mask=masks, group_ids=groups, sample_fields={"chosen": torch.tensor(chosen)})


def dpo_loss_sum(margins_per_doc: torch.Tensor, chosen: torch.Tensor, groups: torch.Tensor, beta: float):
    """Sum over the pairs of ``-log sigmoid(beta * (chosen margin - rejected margin))``; the number of pairs."""
    pair_ids, position = torch.unique(groups, return_inverse=True)
    signed = margins_per_doc * (2.0 * chosen.to(margins_per_doc.dtype) - 1.0)
    per_pair = margins_per_doc.new_zeros(pair_ids.numel()).index_add(0, position, signed)
    return -F.logsigmoid(beta * per_pair).sum(), int(pair_ids.numel())


class DPOPolicy(HFCausalLM):
    """A tiny random Llama trained with DPO through the mixin (automatic optimization)."""

    def __init__(self, beta: float) -> None:
        super().__init__(config=TINY_LLAMA, lr=1e-3, lr_schedule="constant", weight_decay=0.0, attn_backend="sdpa")
        self.beta = beta

    def seqpack_loss(self, logits: torch.Tensor, batch: dict[str, Any]) -> LossOutput:
        log_ratio = token_logprobs(logits, batch["labels"]) - batch["ref_logprobs"]  # both 0 off the loss mask
        margins = document_sums(log_ratio, batch)
        loss_sum, pairs = dpo_loss_sum(margins, batch["chosen"], batch["group_ids"], self.beta)
        return LossOutput(loss_sum=loss_sum, num_units=pairs, step_units=batch["step_groups"])


class PreferenceBatches(LightningDataModule):
    """Each rank's DPO microbatches, with the reference log-probs of one packed no-grad pass over the pairs."""

    def __init__(self, args: argparse.Namespace, reference: torch.nn.Module) -> None:
        super().__init__()
        self.args, self.reference = args, reference
        self.rollout: Rollout | None = None

    def planner(self) -> RolloutPlanner:
        return RolloutPlanner(
            train_max_tokens=self.args.max_tokens,
            samples_per_step=2 * self.args.pairs_per_step,
            accumulate_grad_batches=self.args.accumulate_grad_batches,
            keep_together="microbatch",
            trainer=self.trainer,
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rollout, planner = preference_pairs(self.args.pairs), self.planner()

        def reference_logprobs(batch: dict[str, Any]) -> torch.Tensor:
            return token_logprobs(policy_logits(self.reference, batch), batch["labels"])

        ref = planner.compute_per_token(reference_logprobs, rollout, gather=True)
        self.rollout = rollout.with_fields(token_fields={"ref_logprobs": ref})
        return torch.utils.data.DataLoader(list(planner.train_microbatches(self.rollout)), batch_size=None)


class FirstStep(Callback):
    """Keeps the first optimizer step's gradients (after the all-reduce)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def padded_gradient_error(grads, weights, data: PreferenceBatches, beta: float) -> float:
    """Max relative error of the first step's gradient against one big padded batch in float64 (stock model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(data.reference.model.config, attn_implementation="eager").double()
    model.load_state_dict(weights)
    rollout = data.rollout
    samples = sorted(i for r in data.planner().plan(rollout).microbatches[0] for mb in r for i in mb)
    width = int(rollout.lengths[samples].max())
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    ref = torch.zeros(ids.shape, dtype=torch.float64)
    for row, i in enumerate(samples):
        n = len(rollout.input_ids[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        ref[row, :n] = rollout.token_fields["ref_logprobs"][i]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    margins = ((token_logprobs(logits, torch.where(mask, ids, -100)) - ref) * mask).sum(dim=1)
    chosen, groups = rollout.sample_fields["chosen"][samples], rollout.group_ids[samples]
    loss_sum, pairs = dpo_loss_sum(margins, chosen, groups, beta)
    (loss_sum / pairs).backward()
    errors = [
        (grads[name].double() - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30)
        for name, p in model.named_parameters()
    ]
    return float(torch.stack(errors).max())


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = DPOPolicy(args.beta)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    weights = copy.deepcopy(policy.model.state_dict())
    data, first = PreferenceBatches(args, reference), FirstStep()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        use_distributed_sampler=False,
        callbacks=[first],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(policy, datamodule=data)
    result = {"loss": float(trainer.callback_metrics["train/loss"]), "optimizer_steps": float(trainer.global_step)}
    if trainer.global_rank == 0:
        print(f"DPO: {args.pairs} pairs, {trainer.global_step} optimizer steps, final loss {result['loss']:.4f}")
        if args.check:
            result["gradient_error"] = padded_gradient_error(first.grads, weights, data, args.beta)
            print(f"max relative gradient error vs one big padded batch: {result['gradient_error']:.2e}")
    return result


if __name__ == "__main__":
    main()
