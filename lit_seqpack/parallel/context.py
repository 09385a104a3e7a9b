"""Context-parallel sharding of packed rows: which tokens each CP rank holds, shard and gather a packed batch.

**Context parallelism (CP)** splits every sequence of a packed row across ``cp`` ranks. Each segment of
``cu_seqlens`` (a document padded to a multiple of ``2 * cp``, or the padding tail) is cut into ``2 * cp`` equal
chunks and CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` of every segment, so that every rank holds as
much causal attention work as any other (an early, cheap chunk with a late, expensive one). Two documents of 8
and 4 tokens, ``cp = 2``::

    global row      a0 a1 a2 a3 a4 a5 a6 a7 b0 b1 b2 b3      cu_seqlens  0 8 12
    chunks          [0:a0 a1][1:a2 a3][2:a4 a5][3:a6 a7][0:b0][1:b1][2:b2][3:b3]
    rank 0 keeps    a0 a1 a6 a7 b0 b3                      position_ids 0 1 6 7 0 3   (global positions)
    rank 1 keeps    a2 a3 a4 a5 b1 b2                      position_ids 2 3 4 5 1 2

A rank's shard (Transformer Engine / Megatron "thd" layout) holds its local ``input_ids``, ``labels``,
``position_ids``, every other per-token ``[1, T]`` tensor and ``shift_labels`` (``[1, T / cp]``) with the
*global* ``cu_seqlens`` (padded boundaries), ``cu_seqlens_unpadded`` and ``max_seqlen``. Labels cannot be shifted
locally (the target of a chunk's last token lives in the next chunk, on another rank), so ``shift_labels`` holds
each local token's target, shifted on the whole row before sharding (the name transformers' losses use). Declared
token fields get the same treatment: ``shift_<name>`` holds the value of the field at each local token's target
(for fields that score targets, such as per-token weights or advantages), next to ``<name>`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lit_seqpack._checks import check_int
from lit_seqpack.batch import IGNORE_INDEX, SHIFT_PREFIX, shift_labels

__all__ = [
    "SHIFT_PREFIX",
    "context_parallel_index",
    "gather_packed_batches",
    "shard_packed_batch",
    "shard_tokens",
    "shift_tokens",
    "unshard_tokens",
]

_CP_KEYS = ("context_parallel_size", "context_parallel_rank")
"""Under context parallelism ``shift_<name>`` holds the targets' values of the per-token tensor ``<name>``."""


def _segment_lengths(cu_seqlens: torch.Tensor, context_parallel_size: int) -> np.ndarray:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [segments + 1], got {getattr(cu_seqlens, 'shape', None)}")
    bounds = np.asarray(cu_seqlens.tolist(), dtype=np.int64)
    lengths = np.diff(bounds)
    if bounds[0] != 0 or (lengths < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds.tolist()}")
    chunks = 2 * context_parallel_size
    bad = np.flatnonzero(lengths % chunks)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"segment {i} of cu_seqlens has {int(lengths[i])} tokens, not a multiple of 2 x context_parallel_size = "
            f"{chunks}: collate with pad_document_to_multiple_of and pad_to_multiple_of multiples of {chunks} "
            "(SeqPackDataModule(context_parallel_size=...) does it)"
        )
    return lengths


def context_parallel_index(
    cu_seqlens: torch.Tensor, context_parallel_size: int, context_parallel_rank: int
) -> torch.Tensor:
    """Global row positions (int64, on ``cu_seqlens``' device) of the tokens CP rank ``r`` holds, in local order.

    Example:
        >>> context_parallel_index(torch.tensor([0, 8, 12]), 2, 0).tolist()
        [0, 1, 6, 7, 8, 11]
    """
    cp = check_int("context_parallel_size", context_parallel_size, minimum=1)
    rank = check_int("context_parallel_rank", context_parallel_rank, minimum=0)
    if rank >= cp:
        raise ValueError(f"context_parallel_rank must be in [0, {cp}), got {rank}")
    lengths = _segment_lengths(cu_seqlens, cp)
    chunk = lengths // (2 * cp)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    firsts = np.stack([starts + rank * chunk, starts + (2 * cp - 1 - rank) * chunk], axis=1).reshape(-1)
    sizes = np.repeat(chunk, 2)
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return torch.from_numpy(np.repeat(firsts, sizes) + offsets).to(cu_seqlens.device)


def shard_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The local part of a per-token tensor: the positions of :func:`context_parallel_index` along ``dim``."""
    index = context_parallel_index(cu_seqlens, cp_size, cp_rank).to(x.device)
    return x.index_select(dim, index)


def unshard_tokens(parts: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tokens`: the per-token tensor of the whole row from every CP rank's part, in order."""
    cp = len(parts)
    if cp == 0:
        raise ValueError("unshard_tokens needs the parts of every context-parallel rank, got none")
    shape = list(parts[0].shape)
    shape[dim] *= cp
    out = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        out.index_copy_(dim, context_parallel_index(cu_seqlens, cp, rank).to(part.device), part)
    return out


def _real_mask(batch: Mapping[str, Any], total: int) -> np.ndarray:
    """``[T]`` bool: True on document tokens, False on per-document padding and on the padding tail."""
    padded = np.asarray(batch["cu_seqlens"].tolist(), dtype=np.int64)
    lengths = np.diff(padded)
    if batch.get("cu_seqlens_unpadded") is not None:
        real = np.diff(np.asarray(batch["cu_seqlens_unpadded"].tolist(), dtype=np.int64))
    else:
        documents = int(batch.get("num_documents", len(lengths)))
        real = np.where(np.arange(len(lengths)) < documents, lengths, 0)
    offset = np.arange(total) - np.repeat(padded[:-1], lengths)
    return offset < np.repeat(real, lengths)


def shift_tokens(values: torch.Tensor, fill: float | int) -> torch.Tensor:
    """A per-token ``[B, T]`` tensor aligned with the targets: ``out[..., t] = values[..., t + 1]``, ``fill`` last.

    Example:
        >>> shift_tokens(torch.tensor([[0.5, 1.0, 0.25]]), 0.0).tolist()
        [[1.0, 0.25, 0.0]]
    """
    return F.pad(values[..., 1:], (0, 1), value=fill)


def shard_packed_batch(
    batch: Mapping[str, Any],
    context_parallel_size: int,
    context_parallel_rank: int,
    token_fields: Mapping[str, float | int] | None = None,
) -> dict[str, Any]:
    """The shard of a packed batch (``PackedCollator``'s contract) that CP rank ``context_parallel_rank`` trains.

    Per-token ``[1, T]`` tensors become ``[1, T / cp]`` (``position_ids`` keep their global values);
    ``cu_seqlens``, ``cu_seqlens_unpadded`` and ``max_seqlen`` stay global; ``shift_labels`` (the targets of the
    local tokens) is added, and ``shift_<name>`` for every entry of ``token_fields`` (the field's value at each
    local token's target, the field's pad value after the row's last token; ``loss_weights``, when the batch
    has them, always gets ``shift_loss_weights`` and a local ``num_loss_weight``). The counts become local:
    ``num_real_tokens``, ``num_padding_tokens``, ``num_loss_tokens`` (targets in ``shift_labels``) and
    ``max_tokens / cp``; ``num_documents``, ``step_loss_tokens``, ``world_size`` (data-parallel ranks) and
    ``accumulate_grad_batches`` are unchanged, and ``context_parallel_size`` / ``context_parallel_rank`` are added.
    The exact loss scales by ``world_size x context_parallel_size``: DDP averages over every rank, and a
    microbatch's loss is the *sum* of its CP ranks'.

    Args:
        batch: a packed batch (``input_ids [1, T]`` and ``cu_seqlens``).
        context_parallel_size: CP ranks (``cp``).
        context_parallel_rank: the rank whose shard to return.
        token_fields: the declared per-token fields (name to pad value) that also get a ``shift_<name>``.

    Raises:
        ValueError: not a packed ``[1, T]`` row, already sharded, a segment that is not a multiple of ``2 cp``, or
            a declared token field missing from the batch.
    """
    cp = check_int("context_parallel_size", context_parallel_size, minimum=1)
    rank = check_int("context_parallel_rank", context_parallel_rank, minimum=0)
    if batch.get("cu_seqlens") is None or "input_ids" not in batch or batch["input_ids"].dim() != 2:
        raise ValueError("shard_packed_batch needs a packed batch (input_ids [1, T] and cu_seqlens)")
    if any(key in batch for key in _CP_KEYS) or any(key.startswith(SHIFT_PREFIX) for key in batch):
        raise ValueError("the batch is already sharded for context parallelism (it has context_parallel_size)")
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    total = ids.shape[1]
    if ids.shape[0] != 1 or int(cu[-1]) != total:
        raise ValueError(f"a packed batch is one row with cu_seqlens[-1] == T, got {tuple(ids.shape)}, {cu.tolist()}")
    max_tokens = batch.get("max_tokens")
    if max_tokens is not None and max_tokens % cp:
        raise ValueError(f"max_tokens={max_tokens} must be a multiple of context_parallel_size={cp}")
    fields = dict(token_fields or {})
    if "loss_weights" in batch:  # a weighted loss scores targets: its weights are shifted like the labels
        fields.setdefault("loss_weights", 0.0)
    missing = sorted(set(fields) - set(batch))
    if missing:
        raise ValueError(f"token_fields {missing} are declared but the batch has no such key")
    index = context_parallel_index(cu, cp, rank)
    shifted = {"labels": shift_labels(batch["labels"])}
    shifted |= {name: shift_tokens(batch[name], pad) for name, pad in fields.items()}
    out = {key: _local(value, index, total) for key, value in batch.items()}
    for name, values in shifted.items():
        out[SHIFT_PREFIX + name] = values.index_select(1, index.to(values.device))
    real = int(_real_mask(batch, total)[index.cpu().numpy()].sum())
    out |= {
        "num_real_tokens": real,
        "num_padding_tokens": total // cp - real,
        "num_loss_tokens": int((out["shift_labels"] != IGNORE_INDEX).sum()),
        "max_tokens": None if max_tokens is None else max_tokens // cp,
        "context_parallel_size": cp,
        "context_parallel_rank": rank,
    }
    if "loss_weights" in fields:  # the weights of the local targets (a weighted loss's local sum)
        out["num_loss_weight"] = math.fsum(out[SHIFT_PREFIX + "loss_weights"].double().flatten().tolist())
    return out


def _local(value: Any, index: torch.Tensor, total: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, total):
        return value.index_select(1, index.to(value.device))
    return value


def gather_packed_batches(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Inverse of :func:`shard_packed_batch`: the whole batch from the shards of every CP rank (any order).

    The ``shift_*`` tensors the shards added are left out (they are derived from the gathered tensors).
    """
    if not shards:
        raise ValueError("gather_packed_batches needs the shards of every context-parallel rank, got none")
    ordered = sorted(shards, key=lambda s: s.get("context_parallel_rank", -1))
    cp = len(ordered)
    if [s.get("context_parallel_rank") for s in ordered] != list(range(cp)) or any(
        s.get("context_parallel_size") != cp for s in ordered
    ):
        raise ValueError(f"need one shard per CP rank 0..{cp - 1}, each with context_parallel_size={cp}")
    first, cu = ordered[0], ordered[0]["cu_seqlens"]
    if any(not torch.equal(s["cu_seqlens"], cu) for s in ordered):
        raise ValueError("the shards come from different batches (their cu_seqlens differ)")
    local = first["input_ids"].shape[1]
    out: dict[str, Any] = {}
    for key, value in first.items():
        if key in _CP_KEYS or key.startswith(SHIFT_PREFIX):
            continue
        is_token = isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, local)
        out[key] = unshard_tokens([s[key] for s in ordered], cu) if is_token else value
    for key in ("num_real_tokens", "num_padding_tokens", "num_loss_tokens"):
        out[key] = sum(int(s[key]) for s in ordered)
    if "num_loss_weight" in first:
        out["num_loss_weight"] = math.fsum(s["num_loss_weight"] for s in ordered)
    out["max_tokens"] = None if first["max_tokens"] is None else first["max_tokens"] * cp
    return out
