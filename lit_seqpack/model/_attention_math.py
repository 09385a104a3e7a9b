"""The exact attention arithmetic behind the ``"sdpa"`` backend and the reference: windows, softcaps and sinks.

One document (or one dense row, for the reference) at a time, on ``[1, heads, n, head_dim]`` views:

* no window shorter than the document, no softcap, no sinks: ``F.scaled_dot_product_attention`` (fused kernel);
* a window shorter than the document: SDPA with the banded boolean mask of :func:`allowed_mask`;
* a softcap or sinks: :func:`explicit_attention`, the scores written out as transformers' eager attention does.

A window is ``(left, right)`` in FlashAttention's convention: query ``i`` sees keys ``j`` with
``i - left <= j <= i + right`` (``-1``: unbounded on that side); ``causal`` caps ``right`` at 0. transformers'
``sliding_window=W`` (a query sees ``W`` keys, itself included) is ``(W - 1, 0)``::

    W = 3, causal      keys 0 1 2 3 4
                 q 0      x
                 q 1      x x
                 q 2      x x x
                 q 3        x x x
                 q 4          x x x
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Window = tuple[int, int]


def covers(window: Window | None, length: int, causal: bool) -> bool:
    """Whether ``window`` masks nothing inside a segment of ``length`` tokens (then it is a no-op).

    Example:
        >>> covers((15, 0), 16, True), covers((15, 0), 17, True), covers(None, 10**6, False)
        (True, False, True)
    """
    if window is None:
        return True
    left, right = window
    return (left < 0 or left >= length - 1) and (causal or right < 0 or right >= length - 1)


def allowed_mask(length: int, window: Window | None, causal: bool, device: torch.device) -> torch.Tensor | None:
    """The ``[length, length]`` boolean mask of one segment (``True``: attend), or ``None`` for no mask at all.

    Example:
        >>> allowed_mask(4, (1, 0), True, torch.device("cpu")).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    if not causal and covers(window, length, causal):
        return None
    position = torch.arange(length, device=device)
    offset = position[None, :] - position[:, None]  # key - query
    allowed = offset <= 0 if causal else torch.ones(length, length, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (offset >= -left)
        if right >= 0:
            allowed = allowed & (offset <= right)
    return allowed


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with the scores written out, as transformers' eager attention computes it.

    ``scores = q k^T * scale``; with ``softcap``: ``softcap * tanh(scores / softcap)`` (Gemma2); masked by
    ``allowed``; with ``sinks`` (one logit per query head, GPT-OSS ``s_aux``): an extra column in the softmax
    denominator that no value reads. The softmax runs in float32 (or float64 for float64 inputs).

    Args:
        q: ``[..., heads, n, head_dim]``.
        k: ``[..., kv_heads, m, head_dim]``; query head ``h`` reads kv head ``h // (heads // kv_heads)``.
        v: like ``k``.
        allowed: a boolean mask broadcastable to ``[..., heads, n, m]`` (``True``: attend), or ``None``.
        scale: the score scale.
        softcap: the cap, or ``None``.
        sinks: ``[heads]`` sink logits, or ``None``.
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    causal: bool,
    scale: float,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact varlen attention, one document at a time over ``torch.split`` views; ``[T, heads, head_dim]``.

    The leading batch dimension of the views matters: SDPA sends 3-D inputs to its unfused math path and 4-D
    ones to the fused (flash) CPU kernel, about 2x faster.
    """
    gqa = q.shape[1] != k.shape[1]
    chunks = zip(*(x.transpose(0, 1)[None].split(lengths, dim=2) for x in (q, k, v)), strict=True)
    outs = []
    for (qd, kd, vd), length in zip(chunks, lengths, strict=True):
        if length == 0:
            continue
        if softcap is not None or sinks is not None:
            allowed = allowed_mask(length, window, causal, q.device)
            outs.append(explicit_attention(qd, kd, vd, allowed, scale, softcap, sinks))
        elif covers(window, length, causal):
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale, enable_gqa=gqa))
        else:
            mask = allowed_mask(length, window, causal, q.device)
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)[0].transpose(0, 1).contiguous()


def dense_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact varlen attention over the whole row with a block-diagonal mask built on the device; ``[T, heads, d]``.

    Nothing is read on the host (segment ids come from ``searchsorted`` on ``cu_seqlens``), so ``torch.compile``
    traces it without a graph break and without guarding on segment lengths or counts. It costs a ``[T, T]`` mask
    and ``T^2`` score work instead of ``sum(n_i^2)``: the path for compiled CPU runs, not the fastest eager one.
    """
    total = q.shape[0]
    position = torch.arange(total, device=q.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.int64), position, right=True)
    allowed = segment[:, None] == segment[None, :]
    band = allowed_mask(total, window, causal, q.device)
    if band is not None:
        allowed = allowed & band
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    if softcap is not None or sinks is not None:
        out = explicit_attention(qh, kh, vh, allowed, scale, softcap, sinks)
    else:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
        )
    return out[0].transpose(0, 1).contiguous()
