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

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Rollout": "lit_seqpack.rl.rollout",
    "RolloutPlanner": "lit_seqpack.rl.planner",
    "RolloutSettings": "lit_seqpack.rl.planner",
    "advantages": "lit_seqpack.rl.advantages",
    "step_loss": "lit_seqpack.rl.loss",
    "clipped_policy_loss": "lit_seqpack.rl.loss",
    "kl_estimate": "lit_seqpack.rl.objectives",
    "token_logprobs": "lit_seqpack.rl.loss",
    "policy_logits": "lit_seqpack.rl.forward",
    "gae": "lit_seqpack.rl.values",
    "value_loss": "lit_seqpack.rl.values",
    "truncated_importance_weights": "lit_seqpack.rl.objectives",
    "token_entropy": "lit_seqpack.rl.objectives",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
