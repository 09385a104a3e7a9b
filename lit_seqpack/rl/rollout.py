"""``Rollout``: one RL rollout batch in memory, validated once, read by :class:`~lit_seqpack.rl.RolloutPlanner`.

A rollout holds, for each of its ``N`` samples (prompt + response), the token ids, a loss mask (1 on the tokens
the policy is trained on, the response), declared per-token fields (old and reference log-probs, advantages,
...), per-sample fields (rewards, ...) and optional group ids (GRPO groups, DPO pairs). Every per-token value at
position ``t`` belongs to token ``t``, like ``labels``: ``old_logprobs[t]`` is the log-probability of token ``t``
given the tokens before it, so position 0 of a sample has no value of its own (its loss mask must be 0).

A fast digest of a rollout's tokens: what :meth:`~lit_seqpack.rl.Rollout.fingerprint` hashes.

Every token ``t`` of the flat ids becomes one 64-bit word ``(t << 32) ^ (id << 1) ^ mask`` (one-to-one for ids below
2^31, any vocabulary), mixed by splitmix64's finaliser; two 64-bit lanes sum the mixed words and a nonlinear
function of them (sums wrap modulo 2^64). A pass over 2.8M tokens costs about 5 ms compiled, against about 22 ms
for SHA-256 over the same ids: the digest catches ranks that hold different rollouts (a mistake, not an
adversary), and :meth:`~lit_seqpack.rl.Rollout.fingerprint` hashes the two lanes with the lengths and group ids
by SHA-256.

The loop runs compiled with numba (``LIT_SEQPACK_DISABLE_NUMBA`` turns it off, like the planner's kernels); the
vectorised numpy reference computes the same lanes (tested), more slowly.

The checks of a :class:`~lit_seqpack.rl.Rollout`'s parts, run once over all samples at a time.

Each part (token ids, loss masks, a token field) is concatenated into one flat tensor, checked with a few vectorised
operations (the first offending sample is found from the flat position), and handed back as per-sample views of the
flat tensor: the rollout holds one buffer per part, whose bytes :meth:`~lit_seqpack.rl.Rollout.fingerprint` hashes
without a copy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from lit_seqpack.planning._kernels import numba_enabled

__all__ = [
    "RESERVED_KEYS",
    "Rollout",
    "token_lanes",
    "check_name",
    "flat_ids",
    "flat_mask",
    "flat_token_field",
    "integers",
    "vector",
]


RESERVED_KEYS = frozenset(
    {"input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen", "group_ids"}
    | {"sample_indices", "document_loss_tokens", "group_loss_tokens", "num_groups", "step", "step_documents"}
    | {"step_groups", "step_loss_tokens", "is_last_in_step", "loss_weights", "num_loss_weight", "step_loss_weight"}
    | {"num_loss_documents", "num_loss_groups", "step_loss_documents", "step_loss_groups"}
)
"""Names a declared field cannot take: the batch contract's keys and the planner's own."""


def vector(value: Any, what: str) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tensor.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.detach().cpu()


def integers(value: Any, what: str) -> torch.Tensor:
    tensor = vector(value, what)
    if tensor.numel() == 0:  # numpy types an empty list as float64
        return tensor.to(torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{what} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(torch.int64)


def check_name(name: Any, kind: str) -> None:
    if not isinstance(name, str) or not name or name in RESERVED_KEYS:
        raise ValueError(f"{kind} name {name!r} is not allowed (reserved: {sorted(RESERVED_KEYS)})")


def _sample_at(position: int, lengths: np.ndarray) -> int:
    """The sample holding flat position ``position``."""
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


def flat_ids(values: Sequence[Any]) -> tuple[torch.Tensor, np.ndarray]:
    """The token ids of every sample as one flat ``int64`` tensor, and each sample's length."""
    ids = [integers(x, f"sample {i}: input_ids") for i, x in enumerate(values)]
    lengths = np.fromiter((x.numel() for x in ids), dtype=np.int64, count=len(ids))
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"sample {int(empty[0])}: input_ids is empty (a sample needs at least one token)")
    flat = torch.cat(ids)
    if int(flat.min()) < 0:
        first = int(torch.nonzero(flat < 0)[0])
        raise ValueError(f"sample {_sample_at(first, lengths)}: input_ids holds a negative id")
    return flat, lengths


def flat_mask(values: Sequence[Any] | None, lengths: np.ndarray) -> torch.Tensor:
    """The loss masks as one flat ``bool`` tensor (``None``: every token but each sample's first)."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if values is None:
        mask = torch.ones(int(lengths.sum()), dtype=torch.bool)
        mask[torch.from_numpy(starts)] = False
        return mask
    if len(values) != lengths.size:
        raise ValueError(f"loss_mask has {len(values)} entries for {lengths.size} samples")
    masks = []
    for i, raw in enumerate(values):
        mask = vector(raw, f"sample {i}: loss_mask")
        if mask.numel() != lengths[i]:
            raise ValueError(f"sample {i}: loss_mask has {mask.numel()} entries but input_ids has {lengths[i]}")
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(f"sample {i}: loss_mask must hold only 0 and 1 (integers or booleans)")
        masks.append(mask)
    flat = torch.cat(masks)
    if flat.dtype != torch.bool:
        bad = torch.nonzero((flat != 0) & (flat != 1))
        if bad.numel():
            raise ValueError(
                f"sample {_sample_at(int(bad[0]), lengths)}: loss_mask must hold only 0 and 1 (integers or booleans)"
            )
        flat = flat.bool()
    first = np.flatnonzero(flat[torch.from_numpy(starts)].numpy())
    if first.size:
        raise ValueError(f"sample {int(first[0])}: loss_mask[0] is 1, but no token predicts a sample's first token")
    return flat


def flat_token_field(name: str, values: Any, lengths: np.ndarray) -> torch.Tensor:
    """A declared per-token field as one flat tensor, checked against the samples' lengths (finite numbers)."""
    if isinstance(values, torch.Tensor) or len(values) != lengths.size:
        raise ValueError(f"token field {name!r} must be a list of {lengths.size} 1-D tensors (one per sample)")
    parts = []
    for i, raw in enumerate(values):
        part = vector(raw, f"sample {i}: token field {name!r}")
        if part.dtype == torch.bool or part.is_complex():
            raise ValueError(f"sample {i}: token field {name!r} must hold real numbers, got dtype {part.dtype}")
        if part.numel() != lengths[i]:
            raise ValueError(
                f"sample {i}: token field {name!r} has {part.numel()} entries but the sample has {lengths[i]} tokens"
            )
        parts.append(part)
    flat = torch.cat(parts)
    if flat.is_floating_point():
        bad = torch.nonzero(~torch.isfinite(flat))
        if bad.numel():
            raise ValueError(
                f"sample {_sample_at(int(bad[0]), lengths)}: token field {name!r} holds a NaN or an infinity"
            )
    return flat


def sample_field(name: str, values: Any, n: int) -> torch.Tensor:
    """A declared per-sample field: ``n`` finite real numbers."""
    tensor = vector(values, f"sample field {name!r}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"sample field {name!r} must hold real numbers, got dtype {tensor.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"sample field {name!r} holds a NaN or an infinity")
    if tensor.numel() != n:
        raise ValueError(f"sample field {name!r} has {tensor.numel()} entries for {n} samples")
    return tensor


_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_SEED = 0x9E3779B97F4A7C15

try:
    import numba
except ImportError:  # numba is a dependency; the reference below still works without it
    numba = None


def _lanes_loop(ids: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    m1, m2, seed = np.uint64(_M1), np.uint64(_M2), np.uint64(_SEED)
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    for t in range(ids.shape[0]):
        z = (np.uint64(t) << np.uint64(32)) ^ (np.uint64(ids[t]) << np.uint64(1)) ^ np.uint64(mask[t]) ^ seed
        z = (z ^ (z >> np.uint64(30))) * m1
        z = (z ^ (z >> np.uint64(27))) * m2
        z = z ^ (z >> np.uint64(31))
        s1 += z
        s2 += z * (z | np.uint64(1))
    return s1, s2


_compiled = None
if numba is not None:
    try:
        _compiled = numba.njit(cache=True)(_lanes_loop)
    except RuntimeError:  # no writable cache location
        _compiled = numba.njit(_lanes_loop)


def _lanes_numpy(ids: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    """The same lanes as the compiled loop, vectorised (numpy's uint64 arrays wrap silently)."""
    t = np.arange(ids.shape[0], dtype=np.uint64)
    z = (t << np.uint64(32)) ^ (ids.astype(np.uint64) << np.uint64(1)) ^ mask.astype(np.uint64) ^ np.uint64(_SEED)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z.sum(dtype=np.uint64), (z * (z | np.uint64(1))).sum(dtype=np.uint64)


def token_lanes(ids: np.ndarray, mask: np.ndarray) -> bytes:
    """The two 64-bit lanes of the flat ``ids`` (``int64``) and loss ``mask`` (``bool``), as 16 bytes.

    Example:
        >>> a = token_lanes(np.array([5, 6, 7]), np.array([False, True, True]))
        >>> b = token_lanes(np.array([5, 7, 6]), np.array([False, True, True]))
        >>> len(a), a == b
        (16, False)
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    mask = np.ascontiguousarray(mask, dtype=np.bool_)
    lanes = _compiled(ids, mask) if _compiled is not None and numba_enabled() else _lanes_numpy(ids, mask)
    return np.array([int(lane) for lane in lanes], dtype=np.uint64).tobytes()


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
    def flat_loss_mask(self) -> torch.Tensor:
        """Every sample's loss mask, concatenated (one ``bool`` tensor; the per-sample masks are views of it)."""
        return self._flat[1]

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
        per rollout (about 5 ms for 2.8M tokens; :mod:`lit_seqpack.rl.rollout`) and kept by :meth:`with_fields`,
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
