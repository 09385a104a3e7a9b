"""Policy losses written as if the batch were unpacked, and their exact normalisation over an optimizer step.

A per-token loss ``[B, T]`` (value at ``t`` for token ``t``, the ``labels`` convention) of a batch from
:meth:`~lit_seqpack.rl.RolloutPlanner.train_microbatches` becomes the value to back-propagate with
:func:`step_loss`. Over every microbatch of a step, on every rank, the gradients add up to the gradient of

- ``normalize="token"``: the mean over every loss token of the step (with a planner's ``loss_weight_field``, the
  weighted mean ``sum(w * loss) / sum(w)`` over the step: the batch's ``loss_weights`` and ``step_loss_weight``);
- ``normalize="sequence"``: the mean over the step's samples of each sample's token mean (weighted: each sample's
  ``sum(w * loss) / sum(w)``);
- ``normalize="group"``: the mean over the step's groups of each group's token mean (a group may be split over
  microbatches or ranks: the plan knows its total; weighted: each group's ``sum(w * loss) / sum(w)``);
- ``normalize="sequence_token_sum"``: the mean over the step's samples of each sample's token *sum* (verl's
  ``seq-mean-token-sum``; weighted: of each sample's ``sum(w * loss)``);
- ``normalize="constant"``: the step's token sum over a constant ``loss_scale_factor`` (Dr.GRPO: verl's
  ``seq-mean-token-sum-norm``, TRL's ``loss_type="dr_grpo"`` with ``loss_scale_factor = samples per step x
  max_completion_length``),

as if the step's samples were one big padded batch. A sample (a group) without a loss token, or whose weights are
all 0, is left out of every mean (numerator and count); a step where nothing has a loss gives a zero gradient. The
step totals travel in the batch (no collective). With automatic optimization Lightning divides the loss by
``accumulate_grad_batches``; with manual optimization it does not; DDP averages over ranks either way:
:func:`scale_step_loss` cancels exactly what applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lit_seqpack.batch import IGNORE_INDEX, shift_labels
from lit_seqpack.model.loss import LossOutput, exact_loss
from lit_seqpack.rl.unpack import per_document_to_tokens

__all__ = [
    "LOG_RATIO_CLAMP",
    "NORMALIZE",
    "cispo_loss",
    "clipped_policy_loss",
    "loss_output",
    "reinforce_loss",
    "safe_ratio",
    "sapo_loss",
    "scale_step_loss",
    "step_loss",
    "token_logprobs",
]

NORMALIZE: tuple[str, ...] = ("token", "sequence", "group", "sequence_token_sum", "constant")
Normalize = Literal["token", "sequence", "group", "sequence_token_sum", "constant"]
LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to ``[-20, 20]`` before ``exp`` (verl's bound): ``exp(20) = 4.9e8`` is finite in
float32 and bfloat16, so a ratio times a zero advantage stays 0 (``exp(100) * 0`` is NaN in float32)."""
_PLAN_KEYS = (
    "step_loss_tokens",
    "step_loss_documents",
    "step_loss_groups",
    "document_loss_tokens",
    "group_loss_tokens",
    "num_loss_documents",
    "num_loss_groups",
)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probabilities of each labelled token given the tokens before it; 0 where the label is -100.

    ``out[:, t] = log_softmax(logits[:, t - 1])[labels[:, t]]``: aligned with the token it scores. Half-precision
    logits are upcast to float32.

    Example:
        >>> logits = torch.zeros(1, 3, 4)
        >>> token_logprobs(logits, torch.tensor([[-100, 2, 3]])).exp().tolist()
        [[1.0, 0.25, 0.25]]
    """
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and labels [B, T], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    targets = shift_labels(labels)
    scores = -F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return F.pad(scores[:, :-1], (1, 0))


def safe_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -20, 20))``: an importance ratio that is finite for any finite log-ratio
    (:data:`LOG_RATIO_CLAMP`); outside the bound its gradient is 0, as verl's.

    Example:
        >>> safe_ratio(torch.tensor([0.0, 100.0])).tolist() == [1.0, torch.tensor(20.0).exp().item()]
        True
    """
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token PPO / GRPO clipped surrogate ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.

    With ``dual_clip = c > 1`` (dual-clip PPO, Ye et al. 2020; NeMo-RL's ``ratio_clip_c``) a negative advantage's loss
    is also capped at ``-c A``: ``min(-min(r A, clip(r) A), -c A)`` where ``A < 0``, so a huge ratio on a bad token
    cannot blow the gradient up.

    Args:
        logprobs: the policy's log-probabilities (with grad).
        old_logprobs: the behaviour policy's, ``r = exp(logprobs - old_logprobs)``.
        advantages: per-token advantages (a GRPO sample's advantage repeated over its tokens).
        clip_low: lower clip range.
        clip_high: upper clip range (``None``: ``clip_low``; DAPO's clip-higher uses a larger one).
        dual_clip: ``c > 1`` for dual-clip PPO; ``None``: off.
        log_ratio: ``log r`` to use instead of ``logprobs - old_logprobs``, e.g. GSPO's sequence-level
            :func:`~lit_seqpack.rl.sequence_log_ratio`. Clamped to ``[-20, 20]`` before ``exp`` (:func:`safe_ratio`).

    Example:
        >>> lp = torch.tensor([0.0, 0.5])
        >>> clipped_policy_loss(lp, torch.zeros(2), torch.ones(2)).tolist()  # r = 1 and exp(0.5) clipped to 1.2
        [-1.0, -1.2000000476837158]
        >>> clipped_policy_loss(torch.tensor([3.0]), torch.zeros(1), -torch.ones(1), dual_clip=3.0).tolist()
        [3.0]
    """
    high = clip_low if clip_high is None else clip_high
    ratio = safe_ratio(logprobs - old_logprobs if log_ratio is None else log_ratio)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_low, 1.0 + high) * advantages)
    if dual_clip is None:
        return loss
    if not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
    return torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> torch.Tensor:
    """CISPO's per-token loss ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprobs`` (MiniMax-M1; verl
    ``compute_policy_loss_cispo``, NeMo-RL ``use_cispo``, TRL ``loss_type="cispo"``).

    The clipped importance weight is detached: every token keeps the gradient of its own log-probability, however
    far its ratio moved (PPO's clip zeroes it).

    Example:
        >>> lp = torch.tensor([0.0, 1.0], requires_grad=True)
        >>> cispo_loss(lp, torch.zeros(2), torch.ones(2)).sum().backward()
        >>> lp.grad.tolist()  # -clip(r): 1 and exp(1) clipped to 1.2
        [-1.0, -1.2000000476837158]
    """
    high = clip_low if clip_high is None else clip_high
    weight = safe_ratio(logprobs.detach() - old_logprobs).clamp(1.0 - clip_low, 1.0 + high)
    return -weight * advantages * logprobs


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> torch.Tensor:
    """SAPO's per-token loss ``-(4 / tau) * sigmoid(tau * (r - 1)) * A``, ``tau = tau_pos`` where ``A > 0`` and
    ``tau_neg`` elsewhere: a smooth gate instead of a hard clip (Soft Adaptive Policy Optimization; verl
    ``compute_policy_loss_sapo``, TRL ``loss_type="sapo"`` with ``sapo_temperature_pos/neg``).

    Example:
        >>> sapo_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -1.0])).tolist()  # r = 1: gate 2 / tau
        [-2.0, 1.9047620296478271]
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos!r} and {tau_neg!r}")
    ratio = safe_ratio(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Plain REINFORCE ``-A * logprobs``, no ratio (NeMo-RL ``disable_ppo_ratio``, verl ``gpg``); on-policy only.

    Example:
        >>> reinforce_loss(torch.tensor([-0.5]), torch.tensor([2.0])).tolist()
        [1.0]
    """
    return -advantages * logprobs


def _plan_facts(batch: Mapping[str, Any]) -> None:
    missing = [key for key in _PLAN_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"the batch lacks {missing}: normalised RL losses need the step totals of a batch from "
            "RolloutPlanner.train_microbatches"
        )


def loss_output(
    token_loss: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    normalize: Normalize,
    loss_scale_factor: float | None = None,
) -> LossOutput:
    """The microbatch's :class:`~lit_seqpack.model.loss.LossOutput` for a per-token loss (positions off the loss
    mask are ignored, whatever their value), with the step's unit count as ``step_units``.

    A batch with ``loss_weights`` (``RolloutPlanner(loss_weight_field=...)``) gives the weighted means, whose units
    are weight sums (token) or the samples and groups with a weight sum above 0 (sequence, group,
    sequence_token_sum).

    Return it from a :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`'s ``seqpack_loss`` and the mixin's
    exact normalisation does the rest (automatic optimization).

    Args:
        token_loss: ``[B, T]`` per-token loss.
        batch: the microbatch of :meth:`~lit_seqpack.rl.RolloutPlanner.train_microbatches`.
        normalize: one of :data:`NORMALIZE` (the module docstring says what each one averages).
        loss_scale_factor: the constant of ``normalize="constant"`` (``> 0``); only with it.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    if (normalize == "constant") != (loss_scale_factor is not None):
        raise ValueError(
            f"loss_scale_factor is the constant of normalize='constant' (and only of it): got normalize={normalize!r}"
            f" with loss_scale_factor={loss_scale_factor!r}"
        )
    if loss_scale_factor is not None and not (math.isfinite(loss_scale_factor) and loss_scale_factor > 0):
        raise ValueError(f"loss_scale_factor must be a finite number > 0, got {loss_scale_factor!r}")
    _plan_facts(batch)
    labels = batch["labels"].to(token_loss.device)
    if token_loss.shape != labels.shape:
        raise ValueError(f"token_loss must have the batch's shape {tuple(labels.shape)}, got {tuple(token_loss.shape)}")
    masked = torch.where(labels != IGNORE_INDEX, token_loss, torch.zeros_like(token_loss))
    weighted = batch.get("loss_weights") is not None
    if weighted:
        if batch.get("step_loss_weight") is None or batch.get("document_loss_weight") is None:
            raise ValueError(
                "the batch carries loss_weights but no step_loss_weight / document_loss_weight: use a batch of "
                "RolloutPlanner(loss_weight_field=...).train_microbatches"
            )
        masked = masked * batch["loss_weights"].to(device=masked.device, dtype=masked.dtype)
    if normalize == "constant":
        factor = float(loss_scale_factor)
        return LossOutput(loss_sum=masked.sum(), num_units=factor, step_units=factor)
    if normalize == "sequence_token_sum":
        units = (int(batch["num_loss_documents"]), int(batch["step_loss_documents"]))
        return LossOutput(loss_sum=masked.sum(), num_units=units[0], step_units=units[1])
    if normalize == "token":
        if weighted:
            units = (float(batch["num_loss_weight"]), float(batch["step_loss_weight"]))
        else:
            units = (int(batch["num_loss_tokens"]), int(batch["step_loss_tokens"]))
        return LossOutput(loss_sum=masked.sum(), num_units=units[0], step_units=units[1])
    per = "document" if normalize == "sequence" else "group"
    totals = batch[f"{per}_loss_weight" if weighted else f"{per}_loss_tokens"].to(token_loss.device)
    inverse = torch.where(totals > 0, 1.0 / totals.double().clamp(min=1e-300), 0.0).to(token_loss.dtype)
    loss_sum = (masked * per_document_to_tokens(inverse, batch)).sum()
    plural = "documents" if normalize == "sequence" else "groups"
    return LossOutput(
        loss_sum=loss_sum, num_units=int(batch[f"num_loss_{plural}"]), step_units=int(batch[f"step_loss_{plural}"])
    )


def scale_step_loss(
    output: LossOutput,
    batch: Mapping[str, Any],
    *,
    optimization: Literal["automatic", "manual"] | None = None,
    module: Any = None,
) -> torch.Tensor:
    """The value to back-propagate for ``output`` so that one optimizer step gets the exact step mean.

    Args:
        output: the microbatch's loss sum and the step's unit count (``step_units``).
        batch: the batch (its ``world_size``, ``accumulate_grad_batches`` and ``context_parallel_size``).
        optimization: ``"automatic"`` (Lightning divides by ``accumulate_grad_batches``) or ``"manual"`` (it does
            not: ``manual_backward``, Fabric, plain torch).
        module: instead, the LightningModule: its ``automatic_optimization`` decides, and under a Trainer the
            batch's layout is checked against the trainer's (a mismatch would scale the gradient silently).
    """
    if module is not None:
        from_module = "automatic" if getattr(module, "automatic_optimization", True) else "manual"
        if optimization is not None and optimization != from_module:
            raise ValueError(f"optimization={optimization!r} but the module runs {from_module} optimization")
        optimization = from_module
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            from lit_seqpack.model.mixin import check_batch_layout

            accumulate = int(trainer.accumulate_grad_batches) if optimization == "automatic" else None
            check_batch_layout(
                batch, world_size=int(trainer.world_size), accumulate_grad_batches=accumulate, strategy=trainer.strategy
            )
    if optimization not in ("automatic", "manual"):
        raise ValueError(f"optimization must be 'automatic' or 'manual' (or give module=), got {optimization!r}")
    if output.step_units is None:
        raise ValueError("output.step_units is None: an exact step loss needs the step's unit count")
    if optimization == "automatic":
        return exact_loss(output, batch)
    if output.step_units == 0:
        return output.loss_sum * 0.0
    scale = int(batch.get("world_size", 1)) * int(batch.get("context_parallel_size", 1))
    return output.loss_sum * (scale / output.step_units)


def step_loss(
    token_loss: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    normalize: Normalize,
    loss_scale_factor: float | None = None,
    optimization: Literal["automatic", "manual"] | None = None,
    module: Any = None,
) -> torch.Tensor:
    """:func:`loss_output` then :func:`scale_step_loss`: the value to back-propagate for a per-token loss."""
    output = loss_output(token_loss, batch, normalize=normalize, loss_scale_factor=loss_scale_factor)
    return scale_step_loss(output, batch, optimization=optimization, module=module)
