"""Token counts of one microbatch, read from the batch contract's Python scalars.

Every metric updates from the same four numbers: real tokens, padding tokens (so computed tokens), and the
plan's token budget. The collators put them in the batch as Python ints, so reading them costs no device
sync; :func:`batch_counts` reads and validates them once, and the metrics accept either a batch or the
:class:`BatchCounts` it returns (the monitor reads each batch once and feeds every metric).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_seqpack._checks import check_choice, check_int, check_optional_int

__all__ = ["BatchCounts", "TokenKind", "batch_counts", "check_token_kind"]

TokenKind = Literal["real", "computed"]
"""Which tokens a rate or a balance counts: ``"real"`` (documents) or ``"computed"`` (real + padding)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchCounts:
    """Token counts of one microbatch (or the sum over several, e.g. the microbatches of an optimizer step).

    Args:
        real_tokens: tokens that belong to documents (``num_real_tokens``).
        padding_tokens: tokens computed for nothing (``num_padding_tokens``; a dummy batch is all padding).
        max_tokens: the plan's token budget of a microbatch, ``None`` when unknown (padded baseline).

    Example:
        >>> c = BatchCounts(real_tokens=14, padding_tokens=2, max_tokens=16)
        >>> c.computed_tokens, c.capacity, (c + c).real_tokens
        (16, 16, 28)
    """

    real_tokens: int
    padding_tokens: int
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("real_tokens", "padding_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=0))
        object.__setattr__(self, "max_tokens", check_optional_int("max_tokens", self.max_tokens, minimum=1))

    @property
    def computed_tokens(self) -> int:
        """Tokens the model computed: real + padding."""
        return self.real_tokens + self.padding_tokens

    @property
    def capacity(self) -> int:
        """Tokens this microbatch could have held: ``max_tokens``, or the computed tokens when the budget is unknown."""
        return self.computed_tokens if self.max_tokens is None else self.max_tokens

    def tokens(self, kind: TokenKind) -> int:
        """The real or the computed tokens."""
        return self.real_tokens if kind == "real" else self.computed_tokens

    def __add__(self, other: BatchCounts) -> BatchCounts:
        """Sum of token counts; keeps a budget only when both sides agree on it."""
        if not isinstance(other, BatchCounts):
            return NotImplemented
        budget = self.max_tokens if self.max_tokens == other.max_tokens else None
        return BatchCounts(
            real_tokens=self.real_tokens + other.real_tokens,
            padding_tokens=self.padding_tokens + other.padding_tokens,
            max_tokens=budget,
        )


def check_token_kind(tokens: str) -> TokenKind:
    """Validate a ``tokens=`` setting."""
    return check_choice("tokens", tokens, ("real", "computed"))  # type: ignore[return-value]


def _scalar(batch: Mapping[str, Any], key: str) -> int:
    value = batch[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())  # a batch that went through default_collate; costs a sync on an accelerator
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"batch[{key!r}] must be a Python int, got {value!r:.60}")
    return value


def batch_counts(batch: Mapping[str, Any] | BatchCounts) -> BatchCounts:
    """Read the token counts of a microbatch in the batch contract.

    Uses the Python scalars ``num_real_tokens``, ``num_padding_tokens`` and ``max_tokens`` that
    :class:`~lit_seqpack.PackedCollator` and :class:`~lit_seqpack.PaddedCollator` write. A ``[B, L]`` batch
    from another collator without them is counted from its ``attention_mask`` (one device sync per batch).

    Args:
        batch: a batch dict, or counts already read (returned unchanged).

    Raises:
        ValueError: neither the scalars nor an ``attention_mask`` are present, or a count is not an int >= 0.

    Example:
        >>> batch_counts({"num_real_tokens": 10, "num_padding_tokens": 6, "max_tokens": None})
        BatchCounts(real_tokens=10, padding_tokens=6, max_tokens=None)
    """
    if isinstance(batch, BatchCounts):
        return batch
    if not isinstance(batch, Mapping):
        raise ValueError(f"expected a batch dict or BatchCounts, got {type(batch).__name__}")
    if "num_real_tokens" in batch and "num_padding_tokens" in batch:
        max_tokens = batch.get("max_tokens")
        return BatchCounts(
            real_tokens=_scalar(batch, "num_real_tokens"),
            padding_tokens=_scalar(batch, "num_padding_tokens"),
            max_tokens=None if max_tokens is None else _scalar(batch, "max_tokens"),
        )
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        real = int(mask.count_nonzero())
        return BatchCounts(real_tokens=real, padding_tokens=mask.numel() - real)
    raise ValueError(
        "batch has neither the scalars 'num_real_tokens' and 'num_padding_tokens' (see the batch contract) "
        f"nor a 2-D 'attention_mask'; keys: {sorted(batch)}"
    )
