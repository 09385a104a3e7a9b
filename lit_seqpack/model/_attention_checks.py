"""Checks of :func:`~lit_seqpack.model.attention.varlen_attention`'s arguments (shapes, window, softcap, sinks)."""

from __future__ import annotations

import math
import numbers

import torch


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [total_tokens, heads, head_dim] tensor, got {getattr(t, 'shape', t)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must be [{q.shape[0]}, kv_heads, {q.shape[2]}] like q, got {k.shape} and {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) for GQA")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on {q.device}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [num_segments + 1], got {getattr(cu_seqlens, 'shape', None)}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 (FlashAttention's dtype), got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    integral = isinstance(max_seqlen, numbers.Integral | torch.SymInt)  # SymInt: a dynamic int under torch.compile
    if isinstance(max_seqlen, bool) or not integral or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive Python int (not a tensor: no device sync), got {max_seqlen!r}")


def segment_lengths(cu_seqlens: torch.Tensor, total_tokens: int, max_seqlen: int) -> list[int]:
    """Check cu_seqlens' values and return the segment lengths (reads the tensor on the host)."""
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    if bounds[0] != 0 or bounds[-1] != total_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at total_tokens={total_tokens}, got {bounds}")
    if min(lengths) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest segment ({max(lengths)})")
    return lengths


def check_extras(
    q: torch.Tensor,
    window: tuple[int, int] | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    causal: bool,
) -> tuple[tuple[int, int] | None, frozenset[str]]:
    """Validate ``window``/``softcap``/``sinks``; the window to use (``None``: unbounded) and the features asked."""
    if window is not None:
        if (
            not isinstance(window, tuple | list)
            or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1 for w in window)
        ):
            raise ValueError(f"window must be (left, right) with ints >= -1 (-1: unbounded), got {window!r}")
        left, right = int(window[0]), 0 if causal else int(window[1])
        window = None if left < 0 and (causal or right < 0) else (left, right)  # unbounded: plain attention
    if softcap is not None and not (isinstance(softcap, numbers.Real) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float (None: no cap), got {softcap!r}")
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],) or not sinks.is_floating_point()
    ):
        raise ValueError(f"sinks must be a float tensor [heads={q.shape[1]}], got {getattr(sinks, 'shape', sinks)}")
    asked = (("window", window), ("softcap", softcap), ("sinks", sinks))
    return window, frozenset(key for key, val in asked if val is not None)
