"""Context-parallel varlen attention by all-gathering K/V (the recipe of Llama 3), over ``torch.distributed``.

Every CP rank holds two chunks of every segment of a packed row (chunks ``r`` and ``2 cp - 1 - r``, see
:mod:`lit_seqpack.parallel`). Attention needs, for a query, the keys of its own document up to its
position, which live on other ranks; so each layer all-gathers the K/V of the whole row (one collective per
layer) and every rank attends its local queries to the gathered keys with the right per-document causal mask::

    document of 8 tokens, cp = 2, chunk size C = 2          rank 0 queries        keys they attend to
    chunks    [a0 a1][a2 a3][a4 a5][a6 a7]                   a0 a1 (chunk 0)        a0..a1   causal
    rank 0    a0 a1             a6 a7                        a6 a7 (chunk 3)        a0..a7   causal, bottom-right
    rank 1          a2 a3 a4 a5

Every rank then does the same causal work (``2 cp C^2 + C`` pairs per document). The backward of the all-gather is
a reduce-scatter of the K/V gradients (:class:`_GatherTokens`), so each rank receives the gradient its keys and
values got from every rank's queries. Works on gloo (CPU) and NCCL (GPU). Each chunk is one
``F.scaled_dot_product_attention`` call with a lower-right causal bias (on CUDA that dispatches to the fused
flash / memory-efficient kernels without materialising a mask).

Models need no change: inside :func:`context_parallel` every
:func:`~lit_seqpack.model.attention.varlen_attention` call is routed here (see
:func:`~lit_seqpack.model.attention.route_varlen_attention`), with the local ``q``/``k``/``v`` and the global
``cu_seqlens``/``max_seqlen`` of the shard. :class:`~lit_seqpack.model.mixin.PackedSequenceMixin` enters it for
every batch sharded by :func:`~lit_seqpack.parallel.shard_packed_batch` (:func:`context_parallel_scope`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lit_seqpack.model.attention import route_varlen_attention
from lit_seqpack.parallel import ParallelLayout
from lit_seqpack.parallel.context import context_parallel_index

__all__ = [
    "all_gather_tokens",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_group",
    "context_parallel_scope",
]

log = logging.getLogger(__name__)
_GROUPS: dict[tuple[int, int, int, int], Any] = {}
_WARNED: set[str] = set()
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = local.new_empty((world * local.shape[0], *local.shape[1:]))
        _all_gather(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


class _Layout:
    """What one packed row's CP split needs: segment and chunk sizes (host) and the gather permutation (device)."""

    def __init__(self, cu_seqlens: torch.Tensor, cp: int, rank: int) -> None:
        self.segments = np.diff(np.asarray(cu_seqlens.tolist(), dtype=np.int64)).tolist()
        self.total, self.local = int(sum(self.segments)), int(sum(self.segments)) // cp
        indices = [context_parallel_index(cu_seqlens, cp, r).cpu() for r in range(cp)]
        order = torch.empty(self.total, dtype=torch.int64)
        order[torch.cat(indices)] = torch.arange(self.total)
        self.order = order.to(cu_seqlens.device)  # global position p sits at order[p] in the rank-major gather
        self.chunks = [length // (2 * cp) for length in self.segments]
        self.chunk_ids = (rank, 2 * cp - 1 - rank)


_CACHE: list[tuple[Any, int, int, int, _Layout]] = []


def _layout(cu_seqlens: torch.Tensor, cp: int, rank: int) -> _Layout:
    """The layout of ``cu_seqlens``, cached on the tensor object (every layer of a forward passes the same one)."""
    if _CACHE:
        ref, version, c, r, layout = _CACHE[0]
        if ref() is cu_seqlens and version == cu_seqlens._version and (c, r) == (cp, rank):
            return layout
    layout = _Layout(cu_seqlens, cp, rank)
    _CACHE[:] = [(weakref.ref(cu_seqlens), cu_seqlens._version, cp, rank, layout)]
    return layout


def all_gather_tokens(local: torch.Tensor, cu_seqlens: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """The per-token tensor of the whole packed row from every CP rank's local part, in global order.

    Differentiable (the gradient of the local part is the sum over ranks of the gradient of its positions), so
    per-sequence outputs (log-probabilities for RL, logits for checks) can be assembled on every rank.

    Args:
        local: this rank's part, ``T / cp`` positions along ``dim``.
        cu_seqlens: the global segment boundaries of the shard.
        group: the CP process group.
        dim: the token dimension of ``local``.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = _layout(cu_seqlens, cp, rank)
    if local.shape[dim] != layout.local:
        raise ValueError(f"local has {local.shape[dim]} tokens along dim {dim}, cu_seqlens needs {layout.local}")
    gathered = _GatherTokens.apply(local.movedim(dim, 0), group)
    return gathered.index_select(0, layout.order.to(local.device)).movedim(0, dim)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group: Any,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Varlen attention of this rank's shard of a packed row (``varlen_attention``'s semantics over the row).

    Args:
        q: local queries ``[T / cp, heads, head_dim]`` (chunks ``r`` and ``2 cp - 1 - r`` of every segment).
        k: local keys ``[T / cp, kv_heads, head_dim]`` (``kv_heads`` divides ``heads``).
        v: local values, shaped like ``k``.
        cu_seqlens: int32 global segment boundaries (every segment a multiple of ``2 cp``), ``T`` last.
        max_seqlen: the longest global segment (checked like ``varlen_attention`` does).
        group: the CP process group; its size is ``cp``, this process's rank in it the CP rank.
        causal: mask future tokens inside each segment.
        softmax_scale: score scale; default ``head_dim ** -0.5``.

    Returns:
        The local output ``[T / cp, heads, head_dim]``.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    _check(q, k, v, cu_seqlens, cp)
    layout = _layout(cu_seqlens, cp, rank)
    if q.shape[0] != layout.local:
        raise ValueError(f"q has {q.shape[0]} tokens but cu_seqlens ends at {layout.total} = cp ({cp}) x local tokens")
    if max(layout.segments) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest segment ({max(layout.segments)})")
    kv_heads = k.shape[1]
    kv = all_gather_tokens(torch.cat([k, v], dim=1), cu_seqlens, group).transpose(0, 1)  # [2 kv_heads, T, d]
    keys, values = kv[:kv_heads].split(layout.segments, dim=1), kv[kv_heads:].split(layout.segments, dim=1)
    queries = q.transpose(0, 1).split([c for c in layout.chunks for _ in range(2)], dim=1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    outs = []
    for s, (chunk, length) in enumerate(zip(layout.chunks, layout.segments, strict=True)):
        if chunk == 0:
            continue
        for j, c in enumerate(layout.chunk_ids):
            end = (c + 1) * chunk if causal else length
            bias = causal_lower_right(chunk, end) if causal else None
            outs.append(
                F.scaled_dot_product_attention(
                    queries[2 * s + j],
                    keys[s][:, :end],
                    values[s][:, :end],
                    attn_mask=bias,
                    scale=scale,
                    enable_gqa=kv_heads != q.shape[1],
                )  # fmt: skip
            )
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cp: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [local_tokens, heads, head_dim] tensor, got {getattr(t, 'shape', t)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"k and v must be [{q.shape[0]}, kv_heads, {q.shape[2]}] with kv_heads dividing "
                         f"{q.shape[1]}, got {tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {getattr(cu_seqlens, 'dtype', cu_seqlens)}")


@contextlib.contextmanager
def context_parallel(group: Any) -> Iterator[None]:
    """Route every ``varlen_attention`` call inside the block to :func:`context_parallel_attention` on ``group``.

    Example (in each process of a CP group, on its shard of a packed batch)::

        with context_parallel(group):
            logits = model(shard["input_ids"], position_ids=shard["position_ids"],
                           cu_seqlens=shard["cu_seqlens"], max_seqlen=shard["max_seqlen"])
    """

    def handler(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        causal: bool,
        softmax_scale: float | None,
        backend: str,
        **extras: Any,
    ) -> torch.Tensor:
        if extras:  # window / softcap / sinks: the all-gather chunks below compute plain causal attention
            named = ", ".join(f"{key}={_describe(value)}" for key, value in sorted(extras.items()))
            raise NotImplementedError(
                f"context-parallel attention does not support {named} (sliding windows, softcaps and attention "
                "sinks); train this model with context_parallel_size=1"
            )
        if backend not in ("auto", "sdpa") and backend not in _WARNED:
            _WARNED.add(backend)
            log.warning("context-parallel attention computes each chunk with SDPA; backend=%r is not used", backend)
        return context_parallel_attention(
            q, k, v, cu_seqlens, max_seqlen, group=group, causal=causal, softmax_scale=softmax_scale
        )

    with route_varlen_attention(handler):
        yield


def _describe(value: Any) -> str:
    return f"tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def context_parallel_group(context_parallel_size: int, tensor_parallel_size: int = 1) -> Any:
    """This process's CP group for the :class:`~lit_seqpack.parallel.ParallelLayout` (created once).

    Creating the groups is a collective: every process of the default group must call this (the first CP batch
    of a training run reaches every rank at the same step, which is where the mixin calls it).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"context_parallel_size={context_parallel_size} needs torch.distributed: run under a multi-process "
            "Trainer (strategy='ddp') or call torch.distributed.init_process_group first"
        )
    layout = ParallelLayout(context_parallel_size=context_parallel_size, tensor_parallel_size=tensor_parallel_size)
    world = dist.get_world_size()
    key = (id(dist.group.WORLD), world, layout.context_parallel_size, layout.tensor_parallel_size)
    if key not in _GROUPS:
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration(layout.context_parallel_groups(world))
    return _GROUPS[key]


@contextlib.contextmanager
def context_parallel_scope(batch: Mapping[str, Any]) -> Iterator[Any]:
    """:func:`context_parallel` for a batch sharded by ``shard_packed_batch`` (no-op for any other batch).

    Yields the CP group (``None`` when the batch is not sharded). Raises ``RuntimeError`` when the shard's
    ``context_parallel_rank`` is not this process's rank in the group (data and model disagree on the layout).
    """
    cp = int(batch.get("context_parallel_size", 1))
    if cp == 1:
        yield None
        return
    group = context_parallel_group(cp, int(batch.get("tensor_parallel_size", 1)))
    if dist.get_rank(group) != batch["context_parallel_rank"]:
        raise RuntimeError(
            f"global rank {dist.get_rank()} is CP rank {dist.get_rank(group)} but received the shard of CP rank "
            f"{batch['context_parallel_rank']}: the data and the model use different rank layouts (see ParallelLayout)"
        )
    with context_parallel(group):
        yield group
