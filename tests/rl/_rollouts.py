"""Shared pieces of the RL tests: tiny random policies (ReferenceLM, a transformers Llama), synthetic rollouts,
and the ground truth: every sample run alone, or every sample of a step in one big padded batch."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch import LightningModule

from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from lit_seqpack.rl import Rollout, policy_logits, token_logprobs
from tests.model._hf_tiny import TINY_HF

VOCAB = TINY_HF["vocab_size"]
TINY_REFERENCE = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64}


def make_policy(kind: str, seed: int = 0) -> LightningModule:
    """A tiny random ``ReferenceLM`` or ``HFCausalLM`` (Llama) in float32, in eval mode (no dropout)."""
    torch.manual_seed(seed)
    if kind == "reference":
        module = ReferenceLM(vocab_size=VOCAB, **TINY_REFERENCE, lr_schedule="constant", attn_backend="sdpa")
    else:
        module = HFCausalLM(config={"model_type": "llama", **TINY_HF}, lr_schedule="constant", attn_backend="sdpa")
    return module.eval()


def make_rollout(count: int = 12, seed: int = 0, *, group_size: int | None = None, longest: int = 24) -> Rollout:
    """Samples of 3..``longest`` tokens: a prompt of 1..length-1 tokens then a response (the loss mask)."""
    gen = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(count):
        length = int(torch.randint(3, longest + 1, (1,), generator=gen))
        prompt = int(torch.randint(1, length, (1,), generator=gen))
        ids.append(torch.randint(1, VOCAB, (length,), generator=gen))
        masks.append(torch.arange(length) >= prompt)
    groups = None if group_size is None else torch.arange(count) // group_size
    return Rollout(input_ids=ids, loss_mask=masks, group_ids=groups)


def stock_model(module: LightningModule) -> torch.nn.Module:
    """The policy's plain model: ReferenceDecoder as it is, the transformers model with eager attention."""
    if isinstance(module, ReferenceLM):
        return copy.deepcopy(module.model)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(module.model.config, attn_implementation="eager")
    model.load_state_dict(module.model.state_dict())
    return model.eval()


def plain_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Logits of the plain model on ``[B, L]`` (right padding in ``attention_mask``)."""
    out = model(input_ids, attention_mask=attention_mask) if attention_mask is not None else model(input_ids)
    return getattr(out, "logits", out)


def alone_logprobs(module: LightningModule, rollout: Rollout) -> list[torch.Tensor]:
    """Each sample's token log-probs, the sample run alone through the stock model (0 off the loss mask)."""
    model = stock_model(module)
    out = []
    with torch.no_grad():
        for ids, mask in zip(rollout.input_ids, rollout.loss_mask, strict=True):
            labels = torch.where(mask, ids, -100)[None]
            out.append(token_logprobs(plain_logits(model, ids[None]), labels)[0])
    return out


def policy_logprobs(module: LightningModule):
    """The ``fn`` of ``compute_per_token``: the module's own packed or padded forward, then token log-probs."""
    return lambda batch: token_logprobs(policy_logits(module, batch), batch["labels"])


def with_policy_fields(module: LightningModule, rollout: Rollout, seed: int = 0) -> Rollout:
    """Adds ``old_logprobs`` (the policy's own, perturbed so some ratios clip) and GRPO ``advantages``
    (group-normalised random rewards, repeated over each sample's tokens) as token fields, ``reward`` per sample."""
    gen = torch.Generator().manual_seed(seed)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in alone_logprobs(module, rollout)]
    rewards = torch.rand(len(rollout), generator=gen)
    groups = rollout.group_ids if rollout.group_ids is not None else torch.zeros(len(rollout), dtype=torch.long)
    advantages = torch.zeros(len(rollout))
    for g in groups.unique():
        members = groups == g
        advantages[members] = rewards[members] - rewards[members].mean()
    per_token = [torch.full((len(ids),), float(a)) for ids, a in zip(rollout.input_ids, advantages, strict=True)]
    return rollout.with_fields(
        token_fields={"old_logprobs": old, "advantages": per_token}, sample_fields={"reward": rewards}
    )


def with_loss_weights(rollout: Rollout, seed: int = 0, field: str = "weights") -> Rollout:
    """Adds random per-token loss weights in ``[0, 2)`` (some exactly 0) as the token field ``field``."""
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for ids in rollout.input_ids:
        w = 2 * torch.rand(len(ids), generator=gen)
        weights.append(torch.where(torch.rand(len(ids), generator=gen) < 0.2, 0.0, w))
    return rollout.with_fields(token_fields={field: weights})


def padded_reference_gradients(
    module: LightningModule, rollout: Rollout, steps: list[list[int]], normalize: str, weight_field: str | None = None
) -> dict[str, torch.Tensor]:
    """Gradient (float64) of the clipped policy loss of the first step's samples as one big right-padded batch,
    normalised over the step by tokens, sequences or groups (with ``weight_field``: weighted means
    ``sum(w * loss) / sum(w)``), samples and groups without a loss left out; computed without lit_seqpack's
    batching."""
    from lit_seqpack.rl import clipped_policy_loss

    model = stock_model(module).double()
    samples = steps[0]
    width = int(rollout.lengths[samples].max())
    shape = (len(samples), width)
    ids, mask, attention = (
        torch.zeros(shape, dtype=torch.long),
        torch.zeros(shape, dtype=torch.bool),
        torch.zeros(shape),
    )
    old, adv = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    weights = torch.zeros(shape, dtype=torch.float64)
    for row, i in enumerate(samples):
        n = int(rollout.lengths[i])
        ids[row, :n], mask[row, :n], attention[row, :n] = rollout.input_ids[i], rollout.loss_mask[i], 1
        old[row, :n] = rollout.token_fields["old_logprobs"][i].double()
        adv[row, :n] = rollout.token_fields["advantages"][i].double()
        if weight_field is not None:
            weights[row, :n] = rollout.token_fields[weight_field][i].float().double()
    logits = plain_logits(model, ids, attention.long())
    logprobs = token_logprobs(logits, torch.where(mask, ids, -100))
    loss = torch.where(mask, clipped_policy_loss(logprobs, old, adv), 0.0)
    if weight_field is not None:
        loss, units = loss * weights, torch.where(mask, weights, 0.0).sum(dim=1)
    else:
        units = mask.sum(dim=1).double()
    groups = rollout.group_ids[samples] if rollout.group_ids is not None else torch.arange(len(samples))
    total = reference_step_mean(loss.sum(dim=1), units, groups, normalize)
    total.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def reference_step_mean(per_sample: torch.Tensor, units: torch.Tensor, groups: torch.Tensor, normalize: str):
    """The step's loss from each sample's loss sum and units (tokens or weight sums): the token mean, the mean of the
    samples' means, or of the groups' means, leaving out samples and groups without units (0 when none has any)."""
    if normalize == "token":
        return per_sample.sum() / units.sum() if units.sum() > 0 else per_sample.sum() * 0.0
    if normalize == "sequence":
        has = units > 0
        return (per_sample[has] / units[has]).mean() if has.any() else per_sample.sum() * 0.0
    parts = [
        per_sample[groups == g].sum() / units[groups == g].sum() for g in groups.unique() if units[groups == g].sum()
    ]
    return torch.stack(parts).mean() if parts else per_sample.sum() * 0.0


def without_loss(rollout: Rollout, samples: list[int]) -> Rollout:
    """The rollout with the loss masks of ``samples`` all 0 (truncated or filtered completions), fields kept."""
    masks = [torch.zeros_like(m) if i in samples else m for i, m in enumerate(rollout.loss_mask)]
    return Rollout(
        input_ids=rollout.input_ids,
        loss_mask=masks,
        token_fields=rollout.token_fields,
        sample_fields=rollout.sample_fields,
        group_ids=rollout.group_ids,
    )
