"""Shared pieces of the RL tests: tiny random policies (ReferenceLM, a transformers Llama), synthetic rollouts,
and the ground truth: every sample run alone, or every sample of a step in one big padded batch."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch import LightningModule

from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from lit_seqpack.rl import Rollout, token_logprobs
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
    return lambda batch: token_logprobs(module.seqpack_forward(batch), batch["labels"])
