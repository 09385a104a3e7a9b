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
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from lit_seqpack.rl._digest import token_lanes
from lit_seqpack.rl._validate import (
    RESERVED_KEYS,
    check_name,
    flat_ids,
    flat_mask,
    flat_token_field,
    integers,
    sample_field,
)

__all__ = ["RESERVED_KEYS", "Rollout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """A rollout batch: per-sample tokens, loss mask and fields, validated at construction.

    Args:
        input_ids: one 1-D integer tensor (or list) of token ids per sample, each non-empty.
        loss_mask: per sample, 1 on the tokens that carry the loss (the response), 0 elsewhere; position 0 must be
            0 (no token predicts it). A mask without a 1 (a truncated, filtered or over-long completion masked out) is
            a sample without a loss: it is planned and run, counted in :attr:`zero_loss_samples` and in the batches
            (``num_loss_documents``), and left out of every loss mean. ``None``: every token but the first.
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

    _lengths: np.ndarray = field(init=False, repr=False, compare=False)
    _loss_tokens: np.ndarray = field(init=False, repr=False, compare=False)
    _flat: tuple[torch.Tensor, torch.Tensor] = field(init=False, repr=False, compare=False)
    _fingerprint: list[str] = field(init=False, repr=False, compare=False)
    _identity: object = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.input_ids, torch.Tensor) or not isinstance(self.input_ids, Sequence):
            raise ValueError("input_ids must be a list of 1-D tensors (use Rollout.from_padded for an [N, L] tensor)")
        if len(self.input_ids) == 0:
            raise ValueError("the rollout has no sample (input_ids is empty)")
        ids, lengths = flat_ids(self.input_ids)
        mask = flat_mask(self.loss_mask, lengths)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        loss_tokens = np.add.reduceat(mask.numpy(), starts, dtype=np.int64)
        sizes = lengths.tolist()
        object.__setattr__(self, "input_ids", list(ids.split(sizes)))
        object.__setattr__(self, "loss_mask", list(mask.split(sizes)))
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_loss_tokens", loss_tokens)
        object.__setattr__(self, "_flat", (ids, mask))
        object.__setattr__(self, "_fingerprint", [])
        object.__setattr__(self, "_identity", object())
        object.__setattr__(self, "token_fields", self._checked_token_fields(self.token_fields))
        object.__setattr__(self, "sample_fields", self._checked_sample_fields(self.sample_fields))
        if self.group_ids is not None:
            groups = integers(self.group_ids, "group_ids")
            if groups.numel() != len(self):
                raise ValueError(f"group_ids has {groups.numel()} entries for {len(self)} samples")
            object.__setattr__(self, "group_ids", groups)

    def _checked_token_fields(self, token_fields: Mapping[str, Any]) -> dict[str, list[torch.Tensor]]:
        checked = {}
        sizes = self._lengths.tolist()
        for name, values in dict(token_fields).items():
            check_name(name, "token field")
            checked[name] = list(flat_token_field(name, values, self._lengths).split(sizes))
        return checked

    def _checked_sample_fields(self, sample_fields: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        checked = {}
        for name, values in dict(sample_fields).items():
            check_name(name, "sample field")
            if name in self.token_fields:
                raise ValueError(f"{name!r} is declared both as a token field and as a sample field")
            checked[name] = sample_field(name, values, len(self))
        return checked

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
        """Tokens of every sample (``int64``, a read-only array computed once)."""
        return self._lengths

    @property
    def loss_tokens(self) -> np.ndarray:
        """Loss-mask tokens of every sample (``int64``, a read-only array computed once)."""
        return self._loss_tokens

    @property
    def zero_loss_samples(self) -> int:
        """Samples whose loss mask has no 1 (they contribute nothing to any loss).

        Example:
            >>> Rollout(input_ids=[[5, 6, 7], [8, 9]], loss_mask=[[0, 1, 1], [0, 0]]).zero_loss_samples
            1
        """
        return int((self._loss_tokens == 0).sum())

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

    @property
    def identity(self) -> object:
        """A token shared by this rollout and every copy :meth:`with_fields` makes of it (the same samples, masks and
        groups): :class:`~lit_seqpack.rl.RolloutPlanner` keys its plans by it, so the log-prob, reference and
        training passes over one rollout reuse one plan."""
        return self._identity

    def fingerprint(self) -> str:
        """A digest of the token ids, loss masks, sample boundaries and group ids (equal rollouts, equal digests).

        Every rank must plan the same rollout; the planner compares the ranks' digests before a pass. Computed once
        per rollout (about 5 ms for 2.8M tokens; :mod:`lit_seqpack.rl._digest`) and kept by :meth:`with_fields`,
        which changes none of what it covers; field values are not part of it.
        """
        if not self._fingerprint:
            ids, mask = self._flat
            digest = hashlib.sha256(self._lengths.tobytes())
            digest.update(token_lanes(ids.numpy(), mask.numpy()))
            if self.group_ids is not None:
                digest.update(b"groups" + self.group_ids.numpy().tobytes())
            self._fingerprint.append(digest.hexdigest())
        return self._fingerprint[0]

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
        derived = object.__new__(type(self))  # ids, masks and the fields already checked stay as they are
        for item in fields(self):
            object.__setattr__(derived, item.name, getattr(self, item.name))
        new_token = derived._checked_token_fields(token_fields or {})
        object.__setattr__(derived, "token_fields", {**self.token_fields, **new_token})
        new_sample = derived._checked_sample_fields(sample_fields or {})
        clash = sorted(set(new_token) & set(self.sample_fields) - set(new_sample))
        if clash:
            raise ValueError(f"{clash[0]!r} is declared both as a token field and as a sample field")
        object.__setattr__(derived, "sample_fields", {**self.sample_fields, **new_sample})
        return derived
