"""The ``"flex"`` backend of :func:`~lit_seqpack.model.attention.varlen_attention`: FlexAttention with a document mask.

A packed row is one ``[1, heads, T, head_dim]`` sequence for :func:`torch.nn.attention.flex_attention.flex_attention`;
what keeps the documents apart is a ``BlockMask`` built from ``cu_seqlens`` (segment ids from ``searchsorted`` on the
device), composed of the document mask, causality and the window::

    tokens    a a a b b b b b c c p p          segment  0 0 0 1 1 1 1 1 2 2 3 3
    allowed(q, k) = segment[q] == segment[k]  &  k <= q (causal)  &  q - left <= k <= q + right (window)

The softcap is a ``score_mod`` (``softcap * tanh(score / softcap)``, the score already scaled) and the sinks a
normaliser term: FlexAttention returns the log-sum-exp ``lse`` of each query's scores, and a softmax with one more
column ``s`` that no value reads is the plain one times ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``.

The block mask is built once per batch and shared by the layers: it is cached under the ``cu_seqlens`` tensor (its
contents on the host; on an accelerator its identity and version, which costs no device sync) with the row length,
causality and window, so every layer of one forward reuses it, and a model that alternates sliding and global
layers keeps one mask of each. Under ``torch.compile`` the mask is built inside the graph from the device tensor:
nothing is read on the host, so a new document count is no new graph.

Where it runs: FlexAttention's fused kernel comes from ``torch.compile``. Eagerly on CUDA the kernel is
``torch.compile(flex_attention)`` (compiled once per shape class, then reused); on CPU it is torch's unfused
implementation (exact, the scores written out), and torch 2.13 has no FlexAttention backward on CPU: a CPU call with
an input that requires a gradient is refused by name (use ``backend="sdpa"`` to train on CPU).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from lit_seqpack._imports import BackendUnavailableError

__all__ = ["clear_block_mask_cache", "document_block_mask", "flex_varlen", "load_flex"]

_CACHE_SIZE = 8
_BLOCK_MASKS: OrderedDict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor] | None, Any]] = OrderedDict()
_UNFUSED_WARNING = "flex_attention called without torch.compile"


def load_flex() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """``(flex_attention, None)``, or ``(None, why not)``; not cached (``torch.compile`` traces it)."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:
        module = None
    if module is None or not hasattr(module, "AuxRequest"):
        return None, (
            f"FlexAttention with AuxRequest (torch.nn.attention.flex_attention) needs torch >= 2.9, installed "
            f"{torch.__version__}: upgrade torch"
        )
    return module.flex_attention, None


def _mask_mod(segment: torch.Tensor, causal: bool, window: tuple[int, int] | None) -> Callable[..., torch.Tensor]:
    """The mask function: same document, and causal / inside the window when asked."""
    left, right = window if window is not None else (-1, -1)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        allowed = segment[q_idx] == segment[kv_idx]
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if left >= 0:
            allowed = allowed & (kv_idx >= q_idx - left)
        if right >= 0:
            allowed = allowed & (kv_idx <= q_idx + right)
        return allowed

    return mask_mod


def _build(cu_seqlens: torch.Tensor, total: int, causal: bool, window: tuple[int, int] | None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    position = torch.arange(total, device=cu_seqlens.device)
    # int64 segment ids: inductor's CPU FlexAttention template finds no kernel for an int32 mask buffer (torch 2.13)
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.int64), position, right=True)
    return create_block_mask(_mask_mod(segment, causal, window), None, None, total, total, device=cu_seqlens.device)


def document_block_mask(
    cu_seqlens: torch.Tensor, total: int, *, causal: bool = True, window: tuple[int, int] | None = None
) -> Any:
    """The ``BlockMask`` of a packed row: attention inside each segment of ``cu_seqlens`` (causal, windowed).

    Cached (see the module docstring): the layers of one forward get the same object. Under ``torch.compile`` it is
    built in the graph, uncached.

    Args:
        cu_seqlens: int32 segment boundaries, ``0`` first and ``total`` last.
        total: the row's tokens.
        causal: mask future tokens.
        window: ``(left, right)`` as in :func:`~lit_seqpack.model.attention.varlen_attention` (``-1``: unbounded).

    Example:
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> document_block_mask(cu, 5).to_dense().shape  # one block of 128 covers the row
        torch.Size([1, 1, 1, 1])
        >>> document_block_mask(cu, 5) is document_block_mask(cu, 5)
        True
    """
    if torch.compiler.is_compiling():
        return _build(cu_seqlens, total, causal, window)
    on_host = cu_seqlens.device.type == "cpu"
    layout = tuple(cu_seqlens.tolist()) if on_host else (id(cu_seqlens), cu_seqlens._version)
    key = (on_host, layout, str(cu_seqlens.device), total, causal, window)
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and (hit[0] is None or hit[0]() is cu_seqlens):
        _BLOCK_MASKS.move_to_end(key)
        return hit[1]
    mask = _build(cu_seqlens, total, causal, window)
    _BLOCK_MASKS[key] = (None if on_host else weakref.ref(cu_seqlens), mask)
    while len(_BLOCK_MASKS) > _CACHE_SIZE:
        _BLOCK_MASKS.popitem(last=False)
    return mask


def clear_block_mask_cache() -> None:
    """Forget the cached block masks."""
    _BLOCK_MASKS.clear()


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _kernel(override: Callable[..., Any] | None, device: torch.device) -> Callable[..., Any]:
    """The flex kernel to call: an override, torch's in a graph being compiled, compiled on CUDA, else unfused."""
    if override is not None:
        return override
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()
    return load_flex()[0]  # type: ignore[return-value]


def _check_trainable(device: torch.device, tensors: tuple[torch.Tensor | None, ...]) -> None:
    if device.type == "cpu" and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise BackendUnavailableError(
            f"attention backend 'flex' cannot train on CPU: torch {torch.__version__} has no FlexAttention backward "
            "on CPU and an input requires a gradient; train with backend='sdpa' (exact, runs anywhere) or run "
            "flex under torch.no_grad() for inference"
        )


def flex_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kernel: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Varlen attention with FlexAttention over the whole row; ``[T, heads, head_dim]``.

    Args:
        q: ``[T, heads, head_dim]``.
        k: ``[T, kv_heads, head_dim]``.
        v: like ``k``.
        cu_seqlens: int32 segment boundaries.
        causal: mask future tokens inside each segment.
        scale: the score scale.
        window: ``(left, right)`` or ``None``.
        softcap: the score cap or ``None``.
        sinks: ``[heads]`` sink logits or ``None``.
        kernel: a stand-in with ``flex_attention``'s signature (``None``: torch's, see :func:`_kernel`).

    Raises:
        BackendUnavailableError: on CPU with an input that requires a gradient (no backward there).
    """
    from torch.nn.attention.flex_attention import AuxRequest

    _check_trainable(q.device, (q, k, v, sinks))
    if q.device.type == "cpu" and not torch.is_grad_enabled():  # torch refuses a leaf that requires grad even here
        q, k, v = q.detach(), k.detach(), v.detach()
        sinks = None if sinks is None else sinks.detach()
    block_mask = document_block_mask(cu_seqlens, q.shape[0], causal=causal, window=window)
    qh, kh, vh = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": scale, "enable_gqa": kh.shape[1] != qh.shape[1]}
    if softcap is not None:
        cap = float(softcap)
        kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap) * cap
    if sinks is not None:
        kwargs["return_aux"] = AuxRequest(lse=True)
    call = _kernel(kernel, q.device)
    if torch.compiler.is_compiling() or q.device.type != "cpu":
        result = call(qh, kh, vh, **kwargs)
    else:
        with warnings.catch_warnings():  # the unfused CPU path is chosen here on purpose (exact, forward only)
            warnings.filterwarnings("ignore", message=_UNFUSED_WARNING)
            result = call(qh, kh, vh, **kwargs)
    if sinks is None:
        out = result
    else:
        out, aux = result
        keep = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # exp(lse) / (exp(lse) + exp(sink))
        out = (out.float() * keep[..., None]).to(out.dtype)
    return out[0].transpose(0, 1).contiguous()
