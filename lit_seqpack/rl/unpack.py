"""Per-token values of a batch back to per-sample tensors, per-document sums, and per-document values per token.

A packed row ``[1, T]`` holds its documents one after the other (``cu_seqlens``, a padding tail last); a padded
block ``[B, L]`` holds one document per row (``attention_mask``). Documents are in the order of the batch's
``sample_indices``. A value at position ``t`` belongs to token ``t`` (the ``labels`` convention)::

    packed   values  [a0 a1 a2 b0 b1 p p]   cu_seqlens 0 3 5 7   ->  [a0 a1 a2], [b0 b1]
    padded   values  [[a0 a1 a2]            attention_mask 1 1 1 ->  [a0 a1 a2], [b0 b1]
                      [b0 b1 p ]]                          1 1 0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["document_index", "document_lengths", "document_sums", "per_document_to_tokens", "unpack"]


def _is_packed(batch: Mapping[str, Any]) -> bool:
    return batch.get("cu_seqlens") is not None


def document_lengths(batch: Mapping[str, Any]) -> list[int]:
    """Tokens of each document of ``batch`` (Python ints, one device sync at most).

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> document_lengths(PackedCollator(pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
        [3, 2]
    """
    documents = int(batch["num_documents"])
    if _is_packed(batch):
        if batch.get("cu_seqlens_unpadded") is not None:
            raise ValueError("per-document padding (pad_document_to_multiple_of) is not supported by unpack")
        return batch["cu_seqlens"].diff()[:documents].tolist()
    return batch["attention_mask"].sum(dim=1)[:documents].tolist()


def unpack(values: torch.Tensor, batch: Mapping[str, Any]) -> list[torch.Tensor]:
    """Per-document slices of a per-token tensor of ``batch`` (``[1, T, ...]`` packed or ``[B, L, ...]`` padded).

    Args:
        values: per-token values shaped like ``batch["input_ids"]`` (with optional trailing dimensions).
        batch: the batch the values were computed on.

    Returns:
        One tensor per document (views, not copies), in the order of ``batch["sample_indices"]``.

    Example:
        >>> from lit_seqpack.data.batching.collate import PaddedCollator
        >>> batch = PaddedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> [v.tolist() for v in unpack(batch["input_ids"] * 10, batch)]
        [[50, 60, 70], [80, 90]]
    """
    shape = tuple(batch["input_ids"].shape)
    if tuple(values.shape[:2]) != shape:
        raise ValueError(f"values must start with the batch's shape {shape}, got {tuple(values.shape)}")
    lengths = document_lengths(batch)
    if _is_packed(batch):
        parts = values[0].split([*lengths, shape[1] - sum(lengths)])
        return list(parts[: len(lengths)])
    return [values[row, :n] for row, n in enumerate(lengths)]


def document_index(batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` int64: the document of every position, ``-1`` on padding.

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> batch = PackedCollator(pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> document_index(batch).tolist()
        [[0, 0, 0, 1, 1, -1, -1, -1]]
    """
    ids = batch["input_ids"]
    documents = int(batch["num_documents"])
    if _is_packed(batch):
        segments = batch["cu_seqlens"].diff().to(device=ids.device, dtype=torch.int64)
        labels = torch.arange(segments.numel(), device=ids.device)
        labels = torch.where(labels < documents, labels, -1)
        return torch.repeat_interleave(labels, segments)[None]
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    real = batch["attention_mask"].bool() & (rows < documents)
    return torch.where(real, rows, -1)


def document_sums(values: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """``[num_documents]``: the sum of a per-token ``[B, T]`` tensor over each document (differentiable).

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> batch = PackedCollator(pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> document_sums(batch["input_ids"].double(), batch).tolist()
        [18.0, 17.0]
    """
    index = document_index(batch).to(values.device).reshape(-1)
    flat = values.reshape(-1)
    real = index >= 0
    out = flat.new_zeros(int(batch["num_documents"]))
    return out.index_add(0, index[real], flat[real])


def per_document_to_tokens(per_document: torch.Tensor, batch: Mapping[str, Any], fill: float = 0.0) -> torch.Tensor:
    """``[B, T]``: each position gets its document's value from a ``[num_documents]`` tensor, ``fill`` on padding.

    Example:
        >>> from lit_seqpack.data.batching.collate import PackedCollator
        >>> batch = PackedCollator(pad_to_multiple_of=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> per_document_to_tokens(torch.tensor([1.0, 2.0]), batch).tolist()
        [[1.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0]]
    """
    index = document_index(batch).to(per_document.device)
    padded = torch.cat([per_document, per_document.new_full((1,), fill)])
    return padded[torch.where(index >= 0, index, per_document.numel())]
