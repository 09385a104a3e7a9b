"""How ranks split the work, shared by the data and model layers: the parallel layout, context-parallel sharding of
packed rows, and the strategy's device mesh.

**Layout.** :class:`ParallelLayout` orders global ranks tensor-parallel innermost, then context-parallel, then
data-parallel, and derives every pad multiple from the context- and tensor-parallel sizes, so the planner, the
collator and the model cannot disagree.

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

**The strategy's device mesh is the source of truth** for data-parallel size and rank. :func:`mesh_layout` reads a
``DeviceMesh`` whose dimensions are recognised by name::

    data parallel      data_parallel, dp, dp_replicate, dp_shard, replicate, shard, ddp, fsdp   (several: row-major)
    context parallel   context_parallel, cp
    tensor parallel    tensor_parallel, tp

Lightning's ``ModelParallelStrategy`` mesh is ``("data_parallel", "tensor_parallel")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lit_seqpack.data.labels import IGNORE_INDEX, shift_labels

__all__ = [
    "SHIFT_PREFIX",
    "MeshLayout",
    "ParallelLayout",
    "check_mesh",
    "context_parallel_index",
    "gather_packed_batches",
    "mesh_layout",
    "shard_packed_batch",
    "shard_tokens",
    "shift_tokens",
    "strategy_mesh",
    "unshard_tokens",
]

_CP_KEYS = ("context_parallel_size", "context_parallel_rank")
SHIFT_PREFIX = "shift_"
"""Under context parallelism ``shift_<name>`` holds the targets' values of the per-token tensor ``<name>``."""


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """How ranks split the work, and the pad multiples that follow from it (the single source of truth).

    Global ranks are laid out tensor-parallel innermost, then context-parallel, then data-parallel (Megatron's
    default order): ``global_rank = (dp_rank * cp + cp_rank) * tp + tp_rank``. The ``cp * tp`` ranks of one
    data-parallel rank get the same microbatches; only data-parallel ranks get different ones.

    * ``document_multiple``: with CP every document is padded to a multiple of ``2 * cp * tp`` (``2 * cp`` equal
      chunks, each split evenly by sequence parallelism), combined (lcm) with the user's own multiple.
    * ``row_multiple``: sequence parallelism alone (``cp == 1``) splits the packed row, not each document, into
      ``tp`` shards, so the row length must be a multiple of ``tp``; with CP the row is a multiple of
      ``document_multiple`` (its padding tail is a segment split like a document).

    Args:
        context_parallel_size: ranks that split every sequence (``cp``).
        tensor_parallel_size: tensor-parallel ranks with sequence parallelism (``tp``).

    Example:
        >>> layout = ParallelLayout(context_parallel_size=2, tensor_parallel_size=2)
        >>> layout.document_multiple(pad_to_multiple_of=3), layout.row_multiple(sequence_length_round=8)
        (24, 8)
        >>> layout.coordinates(global_rank=6), layout.data_parallel_size(world_size=8)
        ((1, 1, 0), 2)
    """

    context_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_int("context_parallel_size", self.context_parallel_size, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one data-parallel rank's microbatches: ``cp * tp``."""
        return self.context_parallel_size * self.tensor_parallel_size

    def document_multiple(self, pad_to_multiple_of: int = 1) -> int:
        """Every document is padded to a multiple of this (``pad_to_multiple_of`` itself when ``cp == 1``)."""
        own = _check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
        return math.lcm(own, 2 * self.model_parallel_size) if self.context_parallel_size > 1 else own

    def row_multiple(self, sequence_length_round: int = 1, pad_to_multiple_of: int = 1) -> int:
        """Every packed row is padded to a multiple of this (``sequence_length_round`` when ``cp == tp == 1``)."""
        own = _check_int("sequence_length_round", sequence_length_round, 1)
        if self.context_parallel_size > 1:
            return math.lcm(own, self.document_multiple(pad_to_multiple_of))
        return math.lcm(own, self.tensor_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks among ``world_size`` processes (``ValueError`` unless ``cp * tp`` divides it)."""
        world = _check_int("world_size", world_size, 1)
        if world % self.model_parallel_size:
            raise ValueError(
                f"world_size={world} is not a multiple of context_parallel_size x tensor_parallel_size = "
                f"{self.context_parallel_size} x {self.tensor_parallel_size}"
            )
        return world // self.model_parallel_size

    def coordinates(self, global_rank: int) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, tp_rank)`` of a global rank."""
        rank = _check_int("global_rank", global_rank, 0)
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return rank // (cp * tp), (rank // tp) % cp, rank % tp

    def context_parallel_groups(self, world_size: int) -> list[list[int]]:
        """The global ranks of every CP group, each listed by CP rank (for ``new_subgroups_by_enumeration``)."""
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return [
            [(dp * cp + c) * tp + t for c in range(cp)]
            for dp in range(self.data_parallel_size(world_size))
            for t in range(tp)
        ]


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
    cp = _check_int("context_parallel_size", context_parallel_size, 1)
    rank = _check_int("context_parallel_rank", context_parallel_rank, 0)
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
    local token's target, the field's pad value after the row's last token). The counts become local:
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
    cp = _check_int("context_parallel_size", context_parallel_size, 1)
    rank = _check_int("context_parallel_rank", context_parallel_rank, 0)
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
    out["max_tokens"] = None if first["max_tokens"] is None else first["max_tokens"] * cp
    return out


_KINDS = {
    **dict.fromkeys(("data_parallel", "dp", "dp_replicate", "dp_shard", "replicate", "shard", "ddp", "fsdp"), "dp"),
    **dict.fromkeys(("context_parallel", "cp"), "cp"),
    **dict.fromkeys(("tensor_parallel", "tp"), "tp"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshLayout:
    """This process's place in a device mesh: the size and rank of its data-, context- and tensor-parallel groups."""

    data_parallel_size: int
    data_parallel_rank: int
    context_parallel_size: int = 1
    context_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0


def strategy_mesh(strategy: Any) -> Any:
    """The ``device_mesh`` of a strategy (``None`` when it has none, e.g. DDP, FSDP1, DeepSpeed)."""
    has_mesh = hasattr(type(strategy), "device_mesh") or "device_mesh" in getattr(strategy, "__dict__", {})
    if strategy is None or not has_mesh:
        return None
    return strategy.device_mesh  # ModelParallelStrategy raises if asked before the processes are initialised


def mesh_layout(mesh: Any) -> MeshLayout:
    """Data-, context- and tensor-parallel size and rank of this process, read from a ``DeviceMesh``.

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh``; its dimensions are classified by name (see the
            module docstring); a 1-D mesh without names is data parallel.

    Raises:
        ValueError: a dimension whose name says nothing about what it splits (e.g. ``"pp"``): the planner cannot
            know whether its ranks need the same or different microbatches.
    """
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"the strategy's {mesh.ndim}-D device mesh has no dimension names: name them (e.g. "
                "mesh_dim_names=('data_parallel', 'tensor_parallel')) so the DataModule knows which ranks share data"
            )
        names = ("data_parallel",)
    sizes = {"dp": 1, "cp": 1, "tp": 1}
    ranks = {"dp": 0, "cp": 0, "tp": 0}
    for dim, name in enumerate(names):
        kind = _KINDS.get(name)
        if kind is None:
            data = sorted(k for k, v in _KINDS.items() if v == "dp")
            raise ValueError(
                f"the strategy's device mesh has a dimension {name!r} (of {tuple(names)}) that SeqPackDataModule "
                f"cannot place: name data-parallel dimensions one of {data}, context-parallel 'cp' or "
                "'context_parallel', tensor-parallel 'tp' or 'tensor_parallel'"
            )
        size, rank = int(mesh.size(dim)), int(mesh.get_local_rank(dim))
        ranks[kind] = ranks[kind] * size + rank  # several dimensions of one kind: row-major
        sizes[kind] *= size
    return MeshLayout(
        data_parallel_size=sizes["dp"],
        data_parallel_rank=ranks["dp"],
        context_parallel_size=sizes["cp"],
        context_parallel_rank=ranks["cp"],
        tensor_parallel_size=sizes["tp"],
        tensor_parallel_rank=ranks["tp"],
    )


def check_mesh(mesh: MeshLayout, parallel: ParallelLayout, world_size: int, global_rank: int) -> None:
    """Fail unless the mesh agrees with the DataModule's parallel sizes (and, with CP, with its rank order).

    Raises:
        ValueError: naming the mesh's value and the DataModule setting it contradicts.
    """
    for name in ("context_parallel_size", "tensor_parallel_size"):
        own, theirs = getattr(parallel, name), getattr(mesh, name)
        if own != theirs:
            raise ValueError(
                f"the strategy's device mesh has {name.removesuffix('_size')} size {theirs} but "
                f"SeqPackDataModule({name}={own}): set {name}={theirs} (the mesh is the source of truth; the "
                "ranks that share a data-parallel rank must get the same microbatches)"
            )
    total = mesh.data_parallel_size * parallel.model_parallel_size
    if total != world_size:
        raise ValueError(
            f"the strategy's device mesh spans data_parallel x context_parallel x tensor_parallel = "
            f"{mesh.data_parallel_size} x {mesh.context_parallel_size} x {mesh.tensor_parallel_size} = {total} ranks "
            f"but the world size is {world_size}"
        )
    if parallel.context_parallel_size > 1:
        expected = (mesh.data_parallel_rank, mesh.context_parallel_rank, mesh.tensor_parallel_rank)
        if parallel.coordinates(global_rank) != expected:
            raise ValueError(
                f"global rank {global_rank} is (dp, cp, tp) = {expected} in the strategy's device mesh, but "
                "lit_seqpack's context-parallel groups assume the order tensor-parallel innermost, then "
                f"context-parallel, then data-parallel, which gives {parallel.coordinates(global_rank)}: order the "
                "mesh dimensions (data_parallel, context_parallel, tensor_parallel)"
            )
