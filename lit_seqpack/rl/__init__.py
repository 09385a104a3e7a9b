"""RL post-training on packed or dynamic batches: rollouts in memory, a log-prob pass, exact policy losses.

::

    rollout = Rollout(input_ids=ids, loss_mask=response_masks, group_ids=prompt_ids)
    planner = RolloutPlanner(train_max_tokens=8192, logprob_max_tokens=16384, steps_per_rollout=2, trainer=trainer)
    logprobs = lambda b: token_logprobs(policy_logits(module, b), b["labels"])  # checks isolation once
    old = planner.compute_per_token(logprobs, rollout, gather=True)
    rollout = rollout.with_fields(token_fields={"old_logprobs": old, "advantages": advantages})
    for batch in planner.train_microbatches(rollout, device=device):
        loss = clipped_policy_loss(logprobs(batch), batch["old_logprobs"], batch["advantages"])
        manual_backward(step_loss(loss, batch, normalize="token", optimization="manual"))
        if batch["is_last_in_step"]:
            optimizer.step(); optimizer.zero_grad()

The planning itself (:mod:`lit_seqpack.planning.rollout`) is torch-free.
"""

from __future__ import annotations

from lit_seqpack.rl.forward import policy_logits
from lit_seqpack.rl.gather import gather_rollout
from lit_seqpack.rl.loss import (
    NORMALIZE,
    clipped_policy_loss,
    loss_output,
    scale_step_loss,
    step_loss,
    token_logprobs,
)
from lit_seqpack.rl.objectives import (
    KL_ESTIMATORS,
    kl_estimate,
    sequence_log_ratio,
    temperature_scaled,
    token_entropy,
    truncated_importance_weights,
)
from lit_seqpack.rl.planner import RolloutPlanner
from lit_seqpack.rl.rollout import Rollout
from lit_seqpack.rl.unpack import document_index, document_lengths, document_sums, per_document_to_tokens, unpack
from lit_seqpack.rl.values import gae, token_values, value_loss

__all__ = [
    "KL_ESTIMATORS",
    "NORMALIZE",
    "Rollout",
    "RolloutPlanner",
    "clipped_policy_loss",
    "document_index",
    "document_lengths",
    "document_sums",
    "gae",
    "gather_rollout",
    "kl_estimate",
    "loss_output",
    "per_document_to_tokens",
    "policy_logits",
    "scale_step_loss",
    "sequence_log_ratio",
    "step_loss",
    "temperature_scaled",
    "token_entropy",
    "token_logprobs",
    "token_values",
    "truncated_importance_weights",
    "unpack",
    "value_loss",
]
