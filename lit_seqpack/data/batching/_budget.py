"""The per-document token budget of a DataModule: the over-long policy applied to it, and the planned lengths.

With ``pad_to_multiple_of`` (or context parallelism) every document of a packed row is padded to a multiple
``m``, so a microbatch of ``max_tokens`` holds documents of at most ``max_tokens - max_tokens % m`` tokens:
that is the budget the over-long policy enforces and the padded lengths are what the planner packs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from lit_seqpack.data.batching._samples import sample_loss_tokens
from lit_seqpack.data.batching.overlong import (
    DroppedDataset,
    OverlongReport,
    SplitDataset,
    TruncatedDataset,
    apply_overlong_policy,
)
from lit_seqpack.data.sources.protocol import declared_counts

__all__ = ["apply_document_budget", "budget_note", "document_budget", "planned_lengths", "view_loss_tokens"]


def document_budget(max_tokens: int, *, mode: str, pad_to_multiple_of: int, document_multiple: int) -> int:
    """The longest document a microbatch holds: ``max_tokens``, rounded down to the per-document pad multiple.

    Args:
        max_tokens: token budget of a microbatch.
        mode: ``"packing"``, ``"dynamic"`` or ``"padded"``; only packing pads documents.
        pad_to_multiple_of: the user's per-document pad multiple (named in the error).
        document_multiple: the multiple every document is really padded to (with context parallelism too).

    Raises:
        ValueError: the multiple is larger than ``max_tokens``, so no document fits.

    Example:
        >>> document_budget(100, mode="packing", pad_to_multiple_of=16, document_multiple=16)
        96
    """
    budget = max_tokens - max_tokens % document_multiple if mode == "packing" else max_tokens
    if budget == 0:
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold a single document: pad_to_multiple_of="
            f"{pad_to_multiple_of} pads every document to a multiple of {document_multiple} tokens"
            f"{' (with context parallelism)' if document_multiple != pad_to_multiple_of else ''}; "
            "raise max_tokens or lower pad_to_multiple_of"
        )
    return budget


def budget_note(max_tokens: int, budget: int, *, pad_to_multiple_of: int, document_multiple: int) -> str:
    """Why the document budget is below ``max_tokens`` (appended to over-long errors and summaries)."""
    return (
        f"max_tokens={max_tokens} holds documents of at most {budget} tokens because "
        f"pad_to_multiple_of={pad_to_multiple_of} pads each to a multiple of {document_multiple}"
    )


def apply_document_budget(
    data: Sequence[Mapping[str, Any]],
    lengths: np.ndarray,
    loss_tokens: np.ndarray,
    *,
    max_tokens: int,
    mode: str,
    overlong: str,
    pad_to_multiple_of: int,
    document_multiple: int,
    token_fields: Sequence[str] = (),
    truncation_side: str = "right",
) -> tuple[Sequence[Mapping[str, Any]], np.ndarray, np.ndarray, OverlongReport]:
    """Apply the over-long policy at the document budget; log a summary when some samples were over it.

    Args:
        data: the whole dataset.
        lengths: token count of every sample.
        loss_tokens: loss-token count of every sample.
        max_tokens: token budget of a microbatch.
        mode: the DataModule's batching mode.
        overlong: ``"error"``, ``"truncate"``, ``"drop"`` or ``"split"``.
        pad_to_multiple_of: the user's per-document pad multiple.
        document_multiple: the multiple every document is really padded to.
        token_fields: the declared per-token fields, truncated (or split) with the tokens.
        truncation_side: the end ``overlong="truncate"`` cuts.

    Returns:
        The policy's view of the data, its lengths and loss tokens, and the over-long report.
    """
    pads = {"pad_to_multiple_of": pad_to_multiple_of, "document_multiple": document_multiple}
    budget = document_budget(max_tokens, mode=mode, **pads)
    try:
        view, view_lengths, report = apply_overlong_policy(
            data, lengths, budget, overlong, token_fields, truncation_side=truncation_side
        )
    except ValueError as err:
        if budget == max_tokens:
            raise
        raise ValueError(f"{err} ({budget_note(max_tokens, budget, **pads)})") from None
    view_loss = view_loss_tokens(view, lengths, loss_tokens)
    if report.num_overlong:
        note = f" ({budget_note(max_tokens, budget, **pads)})" if budget < max_tokens else ""
        rank_zero_info(f"lit_seqpack: {report.summary()}{note}")
    return view, view_lengths, view_loss, report


def planned_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Document lengths after per-document padding to ``multiple`` (what a packed row really holds).

    Example:
        >>> planned_lengths(np.array([1, 8, 9]), 8).tolist()
        [8, 8, 16]
    """
    if multiple == 1:
        return lengths
    return (lengths + multiple - 1) // multiple * multiple


def view_loss_tokens(view: Any, full_lengths: np.ndarray, full_loss_tokens: np.ndarray) -> np.ndarray:
    """Loss tokens of the samples of an over-long policy's view (dropped samples gone, cut or split ones recounted).

    Args:
        view: what :func:`~lit_seqpack.data.batching.overlong.apply_overlong_policy` returned for the data.
        full_lengths: token count of every sample of the whole dataset.
        full_loss_tokens: loss-token count of every sample of the whole dataset.
    """
    if not isinstance(
        view, (DroppedDataset, TruncatedDataset, SplitDataset)
    ):  # the data itself: its (validated) counts
        return full_loss_tokens
    offered = declared_counts(view, "loss_tokens")
    if offered is not None:
        return offered
    if isinstance(view, DroppedDataset):
        return full_loss_tokens[view.original_indices]
    if isinstance(view, SplitDataset):
        return view.piece_loss_tokens(full_loss_tokens)
    if isinstance(view, TruncatedDataset):
        counts = full_loss_tokens.copy()
        for i in np.flatnonzero(full_lengths > view.max_tokens):
            counts[i] = sample_loss_tokens(view[int(i)])
        return counts
    return full_loss_tokens
