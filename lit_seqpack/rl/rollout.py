"""``Rollout``: one RL rollout batch in memory, validated once, read by :class:`~lit_seqpack.rl.RolloutPlanner`.

A rollout holds, for each of its ``N`` samples (prompt + response), the token ids, a loss mask (1 on the tokens
the policy is trained on, the response), declared per-token fields (old and reference log-probs, advantages,
...), per-sample fields (rewards, ...) and optional group ids (GRPO groups, DPO pairs). Every per-token value at
position ``t`` belongs to token ``t``, like ``labels``: ``old_logprobs[t]`` is the log-probability of token ``t``
given the tokens before it, so position 0 of a sample has no value of its own (its loss mask must be 0).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

__all__ = ["RESERVED_KEYS", "Rollout"]

RESERVED_KEYS = frozenset(
    {"input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen", "group_ids"}
    | {"sample_indices", "document_loss_tokens", "group_loss_tokens", "num_groups", "step", "step_documents"}
    | {"step_groups", "step_loss_tokens", "is_last_in_step", "loss_weights", "num_loss_weight", "step_loss_weight"}
)
"""Names a declared field cannot take: the batch contract's keys and the planner's own."""


def _vector(value: Any, what: str) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tensor.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.detach().cpu()


def _integers(value: Any, what: str) -> torch.Tensor:
    tensor = _vector(value, what)
    if tensor.numel() == 0:  # numpy types an empty list as float64
        return tensor.to(torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{what} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.int64)


def _finite(value: Any, what: str, length: int | None) -> torch.Tensor:
    tensor = _vector(value, what)
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"{what} must hold real numbers, got dtype {tensor.dtype}")
    if length is not None and tensor.numel() != length:
        raise ValueError(f"{what} has {tensor.numel()} entries but the sample has {length} tokens")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds a NaN or an infinity")
    return tensor


def _check_name(name: Any, kind: str) -> None:
    if not isinstance(name, str) or not name or name in RESERVED_KEYS:
        raise ValueError(f"{kind} name {name!r} is not allowed (reserved: {sorted(RESERVED_KEYS)})")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """A rollout batch: per-sample tokens, loss mask and fields, validated at construction.

    Args:
        input_ids: one 1-D integer tensor (or list) of token ids per sample, each non-empty.
        loss_mask: per sample, 1 on the tokens that carry the loss (the response), 0 elsewhere; position 0 must be
            0 (no token predicts it) and every sample needs at least one 1. ``None``: every token but the first.
        token_fields: declared per-token fields, each a list of one 1-D tensor per sample (as long as its ids).
        sample_fields: declared per-sample fields, each ``N`` numbers.
        group_ids: a group label per sample (GRPO group, DPO pair) or ``None``.

    Raises:
        ValueError: the message names the sample, the field and what is wrong (lengths that disagree, an empty
            sample, a float id, a mask that is not 0/1, a NaN, a reserved field name).

    Example:
        >>> rollout = Rollout(input_ids=[[5, 6, 7], [8, 9]], loss_mask=[[0, 0, 1], [0, 1]], group_ids=[0, 0])
        >>> len(rollout), rollout.lengths.tolist(), rollout.loss_tokens.tolist()
        (2, [3, 2], [1, 1])
    """

    input_ids: Sequence[torch.Tensor]
    loss_mask: Sequence[torch.Tensor] | None = None
    token_fields: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)
    sample_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    group_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.input_ids, torch.Tensor) or not isinstance(self.input_ids, Sequence):
            raise ValueError("input_ids must be a list of 1-D tensors (use Rollout.from_padded for an [N, L] tensor)")
        if len(self.input_ids) == 0:
            raise ValueError("the rollout has no sample (input_ids is empty)")
        ids = [_integers(x, f"sample {i}: input_ids") for i, x in enumerate(self.input_ids)]
        for i, x in enumerate(ids):
            if x.numel() == 0:
                raise ValueError(f"sample {i}: input_ids is empty (a sample needs at least one token)")
            if bool((x < 0).any()):
                raise ValueError(f"sample {i}: input_ids holds a negative id")
        object.__setattr__(self, "input_ids", ids)
        object.__setattr__(self, "loss_mask", self._checked_mask(ids))
        object.__setattr__(self, "token_fields", self._checked_token_fields(ids))
        object.__setattr__(self, "sample_fields", self._checked_sample_fields(len(ids)))
        if self.group_ids is not None:
            groups = _integers(self.group_ids, "group_ids")
            if groups.numel() != len(ids):
                raise ValueError(f"group_ids has {groups.numel()} entries for {len(ids)} samples")
            object.__setattr__(self, "group_ids", groups)

    def _checked_mask(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.loss_mask is None:
            return [torch.arange(len(x)) > 0 for x in ids]
        if len(self.loss_mask) != len(ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(ids)} samples")
        masks = []
        for i, (x, raw) in enumerate(zip(ids, self.loss_mask, strict=True)):
            mask = _vector(raw, f"sample {i}: loss_mask")
            if mask.numel() != x.numel():
                raise ValueError(f"sample {i}: loss_mask has {mask.numel()} entries but input_ids has {x.numel()}")
            if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"sample {i}: loss_mask must hold only 0 and 1 (integers or booleans)")
            mask = mask.bool()
            if bool(mask[0]):
                raise ValueError(f"sample {i}: loss_mask[0] is 1, but no token predicts a sample's first token")
            if not bool(mask.any()):
                raise ValueError(f"sample {i}: loss_mask has no 1 (a sample without a response token trains nothing)")
            masks.append(mask)
        return masks

    def _checked_token_fields(self, ids: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        fields = {}
        for name, values in dict(self.token_fields).items():
            _check_name(name, "token field")
            if isinstance(values, torch.Tensor) or len(values) != len(ids):
                raise ValueError(f"token field {name!r} must be a list of {len(ids)} 1-D tensors (one per sample)")
            fields[name] = [_finite(v, f"sample {i}: token field {name!r}", len(ids[i])) for i, v in enumerate(values)]
        return fields

    def _checked_sample_fields(self, n: int) -> dict[str, torch.Tensor]:
        fields = {}
        for name, values in dict(self.sample_fields).items():
            _check_name(name, "sample field")
            if name in self.token_fields:
                raise ValueError(f"{name!r} is declared both as a token field and as a sample field")
            fields[name] = _finite(values, f"sample field {name!r}", None)
            if fields[name].numel() != n:
                raise ValueError(f"sample field {name!r} has {fields[name].numel()} entries for {n} samples")
        return fields

    @classmethod
    def from_padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        loss_mask: torch.Tensor | None = None,
        token_fields: Mapping[str, torch.Tensor] | None = None,
        sample_fields: Mapping[str, torch.Tensor] | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> Rollout:
        """A rollout from ``[N, L]`` tensors (e.g. ``generate()`` output, left- and/or right-padded).

        Each row keeps the positions where ``attention_mask`` is 1, which must be one contiguous run.

        Args:
            input_ids: ``[N, L]`` token ids.
            attention_mask: ``[N, L]``, 1 on real tokens.
            loss_mask: ``[N, L]``, 1 on response tokens (``None``: every real token but the first).
            token_fields: ``[N, L]`` tensors, cut like the ids.
            sample_fields: ``[N]`` tensors.
            group_ids: ``[N]`` group labels.

        Example:
            >>> ids = torch.tensor([[0, 5, 6, 7], [8, 9, 3, 0]])
            >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
            >>> [x.tolist() for x in Rollout.from_padded(ids, mask).input_ids]
            [[5, 6, 7], [8, 9, 3]]
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must both be [N, L], got {tuple(input_ids.shape)} and "
                f"{tuple(attention_mask.shape)}"
            )
        keep = attention_mask.detach().cpu().bool()
        rows = []
        for i, row in enumerate(keep):
            where = row.nonzero().flatten()
            if where.numel() == 0:
                raise ValueError(f"row {i} of attention_mask has no real token")
            start, stop = int(where[0]), int(where[-1]) + 1
            if stop - start != where.numel():
                raise ValueError(f"row {i} of attention_mask has a hole: real tokens must be one contiguous run")
            rows.append(slice(start, stop))
        tensors = {name: value for name, value in (token_fields or {}).items()}
        for name, value in (("loss_mask", loss_mask), *tensors.items()):
            if value is not None and tuple(value.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(value.shape)}"
                )

        def cut(value: torch.Tensor) -> list[torch.Tensor]:
            value = value.detach().cpu()
            return [value[i, part] for i, part in enumerate(rows)]

        return cls(
            input_ids=cut(input_ids),
            loss_mask=None if loss_mask is None else cut(loss_mask),
            token_fields={name: cut(value) for name, value in tensors.items()},
            sample_fields=dict(sample_fields or {}),
            group_ids=group_ids,
        )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sample (``int64``)."""
        return np.array([len(x) for x in self.input_ids], dtype=np.int64)

    @property
    def loss_tokens(self) -> np.ndarray:
        """Loss-mask tokens of every sample (``int64``)."""
        return np.array([int(m.sum()) for m in self.loss_mask], dtype=np.int64)

    def loss_weight_sums(self, field: str) -> np.ndarray:
        """Each sample's loss-weight sum: the token field ``field`` summed over the loss mask (``float64``).

        The weights are summed as the collators place them (float32, then added in float64), so a step's sum of
        these equals the sum of its microbatches' ``loss_weights``.

        Args:
            field: the declared token field holding the per-token weights (finite, ``>= 0``).

        Raises:
            ValueError: ``field`` is not a declared token field, or a weight is negative.

        Example:
            >>> rollout = Rollout(input_ids=[[5, 6, 7]], token_fields={"w": [[9.0, 0.5, 2.0]]})
            >>> rollout.loss_weight_sums("w").tolist()  # position 0 is off the loss mask
            [2.5]
        """
        if field not in self.token_fields:
            raise ValueError(
                f"loss_weight_field={field!r} is not a token field of the rollout (declared: "
                f"{sorted(self.token_fields)}); add it with rollout.with_fields(token_fields={{{field!r}: ...}})"
            )
        sums = np.empty(len(self), dtype=np.float64)
        for i, (weights, mask) in enumerate(zip(self.token_fields[field], self.loss_mask, strict=True)):
            if bool((weights < 0).any()):
                raise ValueError(f"sample {i}: loss weights ({field!r}) must be >= 0, got {weights.min().item()}")
            sums[i] = math.fsum(weights[mask].to(torch.float32).double().tolist())
        return sums

    def fingerprint(self) -> str:
        """A SHA-256 digest of the token ids, loss masks and group ids (equal rollouts, equal digests).

        Every rank must plan the same rollout; ``compute_per_token(gather=True)`` compares the ranks' digests.
        """
        digest = hashlib.sha256(self.lengths.tobytes())
        digest.update(torch.cat(list(self.input_ids)).numpy().tobytes())
        digest.update(torch.cat(list(self.loss_mask)).numpy().tobytes())
        if self.group_ids is not None:
            digest.update(self.group_ids.numpy().tobytes())
        return digest.hexdigest()

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a collator input: ``input_ids``, ``loss_mask`` and every declared field."""
        out: dict[str, Any] = {"input_ids": self.input_ids[index], "loss_mask": self.loss_mask[index]}
        out.update({name: values[index] for name, values in self.token_fields.items()})
        out.update({name: values[index] for name, values in self.sample_fields.items()})
        return out

    def with_fields(
        self,
        *,
        token_fields: Mapping[str, Sequence[torch.Tensor]] | None = None,
        sample_fields: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """A copy with more (or replaced) fields, e.g. the old log-probs returned by ``compute_per_token``.

        Example:
            >>> rollout = Rollout(input_ids=[[5, 6, 7]]).with_fields(sample_fields={"reward": [1.0]})
            >>> rollout.sample_fields["reward"].tolist()
            [1.0]
        """
        return replace(
            self,
            token_fields={**self.token_fields, **(token_fields or {})},
            sample_fields={**self.sample_fields, **(sample_fields or {})},
        )
