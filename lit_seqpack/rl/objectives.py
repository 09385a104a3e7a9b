"""Per-token pieces of RL objectives, exact on packed and padded batches: KL estimators, entropy, temperature,
truncated importance sampling (token and sequence level, ICE-POP masks, rejection out of the normaliser), the
off-policy sequence mask and the sequence-level importance ratio.

Every function returns a per-token ``[B, T]`` tensor (value at ``t`` for token ``t``, the ``labels`` convention) that
combines with :func:`~lit_seqpack.rl.clipped_policy_loss` and normalises with :func:`~lit_seqpack.rl.step_loss`::

    logits = temperature_scaled(policy_logits(module, batch), temperature)   # as the sampler saw them
    logprobs = token_logprobs(logits, batch["labels"])
    weights = truncated_importance_weights(batch["old_logprobs"], batch["sampler_logprobs"], cap=2.0)
    loss = weights * clipped_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], dual_clip=3.0)
    loss = loss + 0.01 * kl_estimate(logprobs, batch["ref_logprobs"], "k3") - 0.001 * token_entropy(logits, batch)
    step_loss(loss, batch, normalize="token", module=module)

The functions that look across tokens (``sequence_log_ratio``, ``sequence_importance_weights``,
``off_policy_sequence_mask``, ``token_entropy`` given the batch) read the batch's document boundaries, so a packed
row gives what each sample alone gives. Every ratio is ``exp`` of a log-ratio clamped to ``[-20, 20]``
(:func:`~lit_seqpack.rl.loss.safe_ratio`): finite for finite inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.rl.loss import LOG_RATIO_CLAMP, safe_ratio
from lit_seqpack.rl.unpack import document_index, document_sums, per_document_to_tokens

__all__ = [
    "K3_CLAMP",
    "KL_ESTIMATORS",
    "ImportanceMask",
    "importance_mask",
    "kl_estimate",
    "off_policy_sequence_mask",
    "sequence_importance_weights",
    "sequence_log_ratio",
    "temperature_scaled",
    "token_entropy",
    "truncated_importance_weights",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k3+")
K3_CLAMP = 10.0
"""The default bound of the k3 estimate's value (verl's ``low_var_kl``, NeMo-RL's ``kl_output_clamp_value``)."""


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: Literal["k1", "k2", "k3", "abs", "k3+"] = "k3",
    *,
    clamp: float | Literal["auto"] | None = "auto",
    sampler_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens' log-probabilities (Schulman, 2020).

    With ``r = ref_logprobs - logprobs`` (the log of ``pi_ref / pi`` at the sampled token):

    - ``k1 = -r``: unbiased, high variance, can be negative;
    - ``k2 = r^2 / 2``: biased, low variance, ``>= 0``;
    - ``k3 = exp(r) - 1 - r``: unbiased and ``>= 0`` ("low-variance", GRPO's and NeMo-RL's default); ``r`` is
      clamped to ``[-20, 20]`` before ``exp``;
    - ``abs = |r|`` (verl's ``abs``);
    - ``k3+``: the value of k3 with the gradient of k2 (straight through, verl's ``k3+``): k3's expected value is
      the KL, but its expected gradient is not the KL's gradient; k2's is.

    Args:
        logprobs: the policy's log-probabilities (with grad), ``[B, T]``.
        ref_logprobs: the reference policy's.
        estimator: one of :data:`KL_ESTIMATORS`.
        clamp: bound of the estimate's value, ``[-clamp, clamp]``; ``"auto"``: 10 for k3 and k3+ (verl and
            NeMo-RL), none for the others; ``None``: no bound.
        sampler_logprobs: the on-policy correction (NeMo-RL's ``use_on_policy_kl_approximation``): the estimate is
            multiplied by the detached weight ``exp(logprobs - sampler_logprobs)``, which makes a sample drawn by
            the sampler (or an older policy) an estimate of the KL under the current policy.

    Example:
        >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
        >>> [round(v, 4) for v in kl_estimate(lp, ref, "k3").tolist()]
        [0.0, 0.7183]
        >>> kl_estimate(torch.tensor([-5.0]), torch.tensor([-1.0]), "k3").tolist()  # exp(4) - 5 = 49.6, bounded
        [10.0]
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if clamp == "auto":
        clamp = K3_CLAMP if estimator in ("k3", "k3+") else None
    if clamp is not None and not (isinstance(clamp, int | float) and clamp > 0):
        raise ValueError(f"clamp must be a number > 0, 'auto' or None, got {clamp!r}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        value = -log_ratio
    elif estimator == "k2":
        value = 0.5 * log_ratio.square()
    elif estimator == "abs":
        value = log_ratio.abs()
    else:
        bounded = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = torch.expm1(bounded) - bounded
    if clamp is not None:
        value = value.clamp(-clamp, clamp)
    if estimator == "k3+":
        k2 = 0.5 * log_ratio.square()
        value = k2 - k2.detach() + value.detach()
    if sampler_logprobs is not None:
        value = value * safe_ratio(logprobs.detach() - sampler_logprobs.detach())
    return value


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


def document_starts(batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` bool: the first position of every document and every padding position of ``batch``: where a
    value read from the position before belongs to another document (or to none).

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> batch = PackedCollator(pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> document_starts(batch).int().tolist()
        [[1, 0, 0, 1, 0, 1, 1, 1]]
    """
    index = document_index(batch)
    previous = torch.nn.functional.pad(index[:, :-1], (1, 0), value=-1)
    return (index < 0) | (index != previous)


def shift_to_token(
    per_position: torch.Tensor, labels_or_batch: torch.Tensor | Mapping[str, Any] | None
) -> torch.Tensor:
    """``out[:, t] = per_position[:, t - 1]`` (the ``labels`` convention), 0 at ``t = 0`` and: with a batch, at every
    document's first position and on padding (never a value across a document boundary); with a labels tensor,
    wherever the label is -100."""
    shifted = torch.nn.functional.pad(per_position[:, :-1], (1, 0))
    if labels_or_batch is None:
        return shifted
    if isinstance(labels_or_batch, torch.Tensor):
        off = labels_or_batch.to(shifted.device) == IGNORE_INDEX
    else:
        off = document_starts(labels_or_batch).to(shifted.device)
    if off.shape != shifted.shape:
        raise ValueError(f"the batch's shape {tuple(off.shape)} differs from the values' {tuple(shifted.shape)}")
    return torch.where(off, torch.zeros_like(shifted), shifted)


def token_entropy(
    logits: Any, labels_or_batch: torch.Tensor | Mapping[str, Any] | None = None, *, chunk: int = 1024
) -> torch.Tensor:
    """``[B, T]`` entropy of the policy's next-token distribution, aligned with the token it predicts.

    ``out[:, t] = H(softmax(logits[:, t - 1]))`` (the distribution token ``t`` was drawn from, the ``labels``
    convention of :func:`~lit_seqpack.rl.token_logprobs`), 0 at ``t = 0`` and: given the batch, at every document's
    first position and on padding (on a packed row position ``t - 1`` is the previous document's last token), with
    or without labels; given a labels tensor, wherever the label is -100. Computed ``chunk`` rows at a time in
    float32, forward and backward (a custom autograd function recomputes each chunk's softmax): no second
    ``[B, T, V]`` tensor is kept, whatever the vocabulary.

    Args:
        logits: ``[B, T, V]``, or a model output with ``.logits`` (after :func:`temperature_scaled` if the sampler
            used a temperature).
        labels_or_batch: the batch (its document boundaries), or its labels tensor; ``None`` keeps every position
            but 0 (a packed row then reads across documents).
        chunk: rows of ``[chunk, V]`` computed at once.

    Example:
        >>> round(token_entropy(torch.zeros(1, 2, 4))[0, 1].item(), 4)  # uniform over 4: log 4
        1.3863
    """
    logits = getattr(logits, "logits", logits)
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    return shift_to_token(_ChunkedEntropy.apply(logits, int(chunk)), labels_or_batch)


def truncated_importance_weights(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    *,
    cap: float | None = 2.0,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(logprobs - sampler_logprobs), cap)``, without grad.

    The tokens were drawn by the inference engine (vLLM, SGLang), whose log-probabilities ``sampler_logprobs``
    differ from the trainer's ``logprobs`` of the same policy (kernels, precision): weighting each token's loss by
    ``pi_trainer / pi_sampler``, capped at ``cap``, corrects that mismatch with a bounded variance (Yao et al. 2025,
    "truncated importance sampling"; NeMo-RL's ``use_importance_sampling_correction``). Multiply the per-token loss
    by it. With ``low`` and / or ``high`` a weight outside ``[low, high]`` becomes 0 (ICE-POP: NeMo-RL's
    ``icepop``, TRL's ``token_mask``); such tokens still count in the loss's normaliser here, as NeMo-RL and TRL
    count them; :func:`importance_mask` takes them out of it (verl's rejection sampling).

    Example:
        >>> truncated_importance_weights(torch.tensor([0.0, 2.0]), torch.zeros(2), cap=2.0).tolist()
        [1.0, 2.0]
        >>> truncated_importance_weights(torch.tensor([0.0, 2.0]), torch.zeros(2), cap=None, low=0.5, high=5).tolist()
        [1.0, 0.0]
    """
    _check_bounds(cap=cap, low=low, high=high)
    weights = safe_ratio(logprobs.detach() - sampler_logprobs.detach())
    weights = torch.where(_inside(weights, low, high), weights, torch.zeros_like(weights))
    return weights if cap is None else weights.clamp(max=cap)


def _check_bounds(**bounds: float | None) -> None:
    for name, value in bounds.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (or None), got {value!r}")
    low, high = bounds.get("low"), bounds.get("high")
    if low is not None and high is not None and not low <= high:
        raise ValueError(f"low must be <= high, got low={low!r} and high={high!r}")


def _inside(weights: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    keep = torch.ones_like(weights, dtype=torch.bool)
    if low is not None:
        keep &= weights >= low
    if high is not None:
        keep &= weights <= high
    return keep


def _document_log_ratio(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, batch: Mapping[str, Any], mean: bool
) -> torch.Tensor:
    """``[num_documents]``: each document's sum (``mean``: mean) over loss tokens of ``logprobs - sampler``."""
    on = batch["labels"].to(logprobs.device) != IGNORE_INDEX
    diff = torch.where(on, logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(logprobs))
    sums = document_sums(diff, batch)
    if not mean:
        return sums
    return sums / batch["document_loss_tokens"].to(device=sums.device, dtype=sums.dtype).clamp(min=1)


def sequence_importance_weights(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    geometric: bool = False,
    cap: float | None = 2.0,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """``[B, T]`` sequence-level importance weights, without grad: every token of a sample gets
    ``exp(sum_t (logprobs - sampler_logprobs))`` over its loss tokens (``geometric``: ``exp`` of the mean, the
    per-token geometric mean), 0 when outside ``[low, high]``, capped at ``cap`` (verl ``rollout_is: sequence`` /
    ``geometric``, NeMo-RL ``sequence_level_importance_ratios``, TRL ``sequence_truncate`` / ``sequence_mask``).
    Read from the batch's document boundaries, so packing changes nothing; 0 off the loss mask."""
    _check_bounds(cap=cap, low=low, high=high)
    weights = safe_ratio(_document_log_ratio(logprobs, sampler_logprobs, batch, geometric))
    weights = torch.where(_inside(weights, low, high), weights, torch.zeros_like(weights))
    weights = weights if cap is None else weights.clamp(max=cap)
    on = batch["labels"].to(logprobs.device) != IGNORE_INDEX
    return torch.where(on, per_document_to_tokens(weights, batch), torch.zeros_like(logprobs))


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    threshold: float,
) -> torch.Tensor:
    """``[B, T]`` 0/1 off-policy sequence mask (DeepSeek-V3.2; TRL ``off_policy_mask_threshold``): a token is
    dropped when its advantage is negative and its sample's mean over loss tokens of ``sampler_logprobs -
    logprobs`` (the KL of the sampler from the current policy) exceeds ``threshold``. Multiply the per-token loss
    by it (the dropped tokens still count in the normaliser, as in TRL). Without grad; packing changes nothing."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    kl = -_document_log_ratio(logprobs, sampler_logprobs, batch, mean=True)
    far = per_document_to_tokens(kl > threshold, batch)
    return torch.where((advantages < 0) & far, 0.0, 1.0).to(logprobs.dtype)


class ImportanceMask(NamedTuple):
    """What :func:`importance_mask` kept, per sample, and what it dropped."""

    weights: list[torch.Tensor]
    """Per sample, float32 1 on kept loss tokens, 0 elsewhere: a ``loss_weight_field`` token field."""
    masked_tokens: int
    masked_samples: int
    """Samples that lost every loss token (and had some)."""


def importance_mask(
    old_logprobs: Sequence[torch.Tensor],
    sampler_logprobs: Sequence[torch.Tensor],
    loss_mask: Sequence[torch.Tensor],
    *,
    low: float | None = None,
    high: float | None = None,
    level: Literal["token", "sequence", "geometric"] = "token",
) -> ImportanceMask:
    """Rejection of the tokens (``level="token"``, ICE-POP) or whole samples (``"sequence"``: the product of the
    ratios, ``"geometric"``: their geometric mean) whose ratio ``pi_old / pi_sampler`` lies outside ``[low, high]``,
    computed once per rollout from the old (trainer) and sampler log-probs, per sample and unpacked.

    Put the weights in the rollout as the planner's ``loss_weight_field`` and the rejected tokens leave the loss's
    normaliser too, exactly and on every rank (verl's ``rollout_rs`` removes them from the response mask): a
    sample that lost every token is left out of every mean, like a sample without a loss. Multiply them into your
    own loss weights if you have some::

        mask = importance_mask(old, sampler, rollout.loss_mask, low=0.5, high=2.0)
        rollout = rollout.with_fields(token_fields={"keep": mask.weights})
        planner = RolloutPlanner(..., loss_weight_field="keep")
    """
    _check_bounds(low=low, high=high)
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    if not (len(old_logprobs) == len(sampler_logprobs) == len(loss_mask)):
        raise ValueError(
            f"old_logprobs, sampler_logprobs and loss_mask hold {len(old_logprobs)}, {len(sampler_logprobs)} and "
            f"{len(loss_mask)} samples"
        )
    weights, masked_tokens, masked_samples = [], 0, 0
    for old, sampler, mask in zip(old_logprobs, sampler_logprobs, loss_mask, strict=True):
        on = torch.as_tensor(mask).bool().cpu()
        diff = torch.where(on, old.detach().cpu().double() - sampler.detach().cpu().double(), 0.0)
        if level == "token":
            keep = _inside(safe_ratio(diff), low, high) & on
        else:
            total = diff.sum() / (on.sum().clamp(min=1) if level == "geometric" else 1)
            keep = on & bool(_inside(safe_ratio(total), low, high))
        masked_tokens += int(on.sum() - keep.sum())
        masked_samples += int(bool(on.any()) and not bool(keep.any()))
        weights.append(keep.float())
    return ImportanceMask(weights, masked_tokens, masked_samples)


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
