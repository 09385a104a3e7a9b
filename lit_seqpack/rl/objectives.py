"""Per-token pieces of RL objectives, exact on packed and padded batches: KL estimators, entropy, temperature,
truncated importance sampling and the sequence-level importance ratio.

Every function returns a per-token ``[B, T]`` tensor (value at ``t`` for token ``t``, the ``labels`` convention) that
combines with :func:`~lit_seqpack.rl.clipped_policy_loss` and normalises with :func:`~lit_seqpack.rl.step_loss`::

    logits = temperature_scaled(policy_logits(module, batch), temperature)   # as the sampler saw them
    logprobs = token_logprobs(logits, batch["labels"])
    weights = truncated_importance_weights(batch["old_logprobs"], batch["sampler_logprobs"], cap=2.0)
    loss = weights * clipped_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], dual_clip=3.0)
    loss = loss + 0.01 * kl_estimate(logprobs, batch["ref_logprobs"], "k3") - 0.001 * token_entropy(logits)
    step_loss(loss, batch, normalize="token", module=module)

Only ``sequence_log_ratio`` looks across tokens, and it reads the batch's document boundaries, so a packed row gives
what each sample alone gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.rl.unpack import document_sums, per_document_to_tokens

__all__ = [
    "KL_ESTIMATORS",
    "kl_estimate",
    "sequence_log_ratio",
    "temperature_scaled",
    "token_entropy",
    "truncated_importance_weights",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k2", "k3"] = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens' log-probabilities (Schulman, 2020).

    With ``r = ref_logprobs - logprobs`` (the log of ``pi_ref / pi`` at the sampled token):

    - ``k1 = -r``: unbiased, high variance, can be negative;
    - ``k2 = r^2 / 2``: biased, low variance, ``>= 0``;
    - ``k3 = exp(r) - 1 - r``: unbiased and ``>= 0`` ("low-variance", GRPO's and NeMo-RL's default).

    Args:
        logprobs: the policy's log-probabilities (with grad), ``[B, T]``.
        ref_logprobs: the reference policy's.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Example:
        >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
        >>> [round(v, 4) for v in kl_estimate(lp, ref, "k3").tolist()]
        [0.0, 0.7183]
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio


def temperature_scaled(logits: torch.Tensor, temperature: float, *, inplace: bool = False) -> torch.Tensor:
    """``logits / temperature``: the distribution a sampler with that temperature drew from (NeMo-RL and verl divide
    the training logits by the generation temperature, or the log-probs disagree with the sampler's).

    Args:
        logits: ``[B, T, V]``.
        temperature: ``> 0``; 1 returns ``logits`` itself.
        inplace: divide in place (no second ``[B, T, V]`` tensor); autograd raises if the producer of ``logits``
            needs them for its backward (a softcap), it never computes a wrong gradient.

    Example:
        >>> temperature_scaled(torch.tensor([[[2.0, 4.0]]]), 2.0).tolist()
        [[[1.0, 2.0]]]
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if temperature == 1:
        return logits
    return logits.div_(temperature) if inplace else logits / temperature


class _ChunkedEntropy(torch.autograd.Function):
    """``H(z) = logsumexp(z) - sum(softmax(z) * z)`` per row, ``dH/dz = softmax(z) * (E[z] - z)``, over chunks of
    rows: only one chunk's ``[rows, V]`` softmax exists at a time, in the forward and in the backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk):
            z = flat[start : start + chunk].float()
            p = torch.softmax(z, dim=-1)
            out[start : start + chunk] = torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
        ctx.save_for_backward(logits)
        ctx.chunk = chunk
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = grad.reshape(-1)
        out = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk):
            z = flat[start : start + ctx.chunk].float()
            p = torch.softmax(z, dim=-1)
            expected = (p * z).sum(dim=-1, keepdim=True)
            out[start : start + ctx.chunk] = (grad[start : start + ctx.chunk, None] * p * (expected - z)).to(out.dtype)
        return out.reshape(logits.shape), None


def token_entropy(logits: torch.Tensor, labels: torch.Tensor | None = None, *, chunk: int = 1024) -> torch.Tensor:
    """``[B, T]`` entropy of the policy's next-token distribution, aligned with the token it predicts.

    ``out[:, t] = H(softmax(logits[:, t - 1]))`` (the distribution token ``t`` was drawn from, the ``labels``
    convention of :func:`~lit_seqpack.rl.token_logprobs`), 0 at ``t = 0`` and, with ``labels``, wherever the label is
    -100. Computed ``chunk`` rows at a time in float32, forward and backward (a custom autograd function recomputes
    each chunk's softmax): no second ``[B, T, V]`` tensor is kept, whatever the vocabulary.

    Args:
        logits: ``[B, T, V]`` (after :func:`temperature_scaled` if the sampler used a temperature).
        labels: the batch's labels, to zero the positions without a target; ``None`` keeps every position but 0.
        chunk: rows of ``[chunk, V]`` computed at once.

    Example:
        >>> round(token_entropy(torch.zeros(1, 2, 4))[0, 1].item(), 4)  # uniform over 4: log 4
        1.3863
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    entropy = _ChunkedEntropy.apply(logits, int(chunk))
    shifted = torch.nn.functional.pad(entropy[:, :-1], (1, 0))
    if labels is not None:
        shifted = torch.where(labels.to(shifted.device) != IGNORE_INDEX, shifted, torch.zeros_like(shifted))
    return shifted


def truncated_importance_weights(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, *, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(logprobs - sampler_logprobs), cap)``, without grad.

    The tokens were drawn by the inference engine (vLLM, SGLang), whose log-probabilities ``sampler_logprobs``
    differ from the trainer's ``logprobs`` of the same policy (kernels, precision): weighting each token's loss by
    ``pi_trainer / pi_sampler``, capped at ``cap``, corrects that mismatch with a bounded variance (Yao et al. 2025,
    "truncated importance sampling"; NeMo-RL's ``use_importance_sampling_correction``). Multiply the per-token loss
    by it.

    Example:
        >>> truncated_importance_weights(torch.tensor([0.0, 2.0]), torch.zeros(2), cap=2.0).tolist()
        [1.0, 2.0]
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    return torch.exp(logprobs.detach() - sampler_logprobs.detach()).clamp(max=cap)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]``: at each token, its sample's mean over loss tokens of ``logprobs - old_logprobs`` (0 off the mask).

    ``exp`` of it is GSPO's sequence-level importance ratio ``(pi(y|x) / pi_old(y|x)) ^ (1 / |y|)``; pass it as
    ``log_ratio=`` of :func:`~lit_seqpack.rl.clipped_policy_loss` to clip whole sequences instead of tokens (NeMo-RL's
    ``sequence_level_importance_ratios``). Read from the batch's document boundaries, so packing changes nothing.

    Args:
        logprobs: the policy's log-probabilities (with grad).
        old_logprobs: the behaviour policy's.
        batch: the batch they were computed on (its ``labels`` and ``document_loss_tokens``).
    """
    on = batch["labels"].to(logprobs.device) != IGNORE_INDEX
    diff = torch.where(on, logprobs - old_logprobs, torch.zeros_like(logprobs))
    tokens = batch["document_loss_tokens"].to(device=logprobs.device, dtype=logprobs.dtype).clamp(min=1)
    mean = per_document_to_tokens(document_sums(diff, batch) / tokens, batch)
    return torch.where(on, mean, torch.zeros_like(mean))
