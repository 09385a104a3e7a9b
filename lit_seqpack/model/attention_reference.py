"""The ground truth of the attention tests: dense masked attention, and a CPU stand-in for flash-attn's kernel.

Both check their arguments and compute with :mod:`lit_seqpack.model.attention`'s own checks and arithmetic, so the
reference and the ``"sdpa"`` backend share one definition of windows, softcaps and sinks.
"""

from __future__ import annotations

import torch

from lit_seqpack.model.attention import allowed_mask, check_extras, check_inputs, explicit_attention, segment_lengths


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive dense masked attention with :func:`varlen_attention`'s signature: the ground truth of the tests.

    Builds the full ``[total_tokens, total_tokens]`` block-diagonal (and windowed) mask and computes in the inputs'
    dtype (pass float64 for a high-precision reference). Quadratic in the row length: for tests only.

    Example:
        >>> q = torch.randn(5, 2, 4, dtype=torch.float64)
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> out = reference_varlen_attention(q, q, q, cu, 3)
        >>> torch.allclose(out[:2], reference_varlen_attention(q[:2], q[:2], q[:2], cu[:2], 2))
        True
    """
    check_inputs(q, k, v, cu_seqlens, max_seqlen)
    lengths = segment_lengths(cu_seqlens, q.shape[0], max_seqlen)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    window, _ = check_extras(q, window, softcap, sinks, causal)
    segment = torch.repeat_interleave(
        torch.arange(len(lengths), device=q.device), torch.tensor(lengths, device=q.device)
    )
    allowed = segment[:, None] == segment[None, :]
    band = allowed_mask(q.shape[0], window, causal, q.device)
    if band is not None:
        allowed = allowed & band
    out = explicit_attention(*(x.transpose(0, 1) for x in (q, k, v)), allowed, scale, softcap, sinks)
    return out.transpose(0, 1)


def reference_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """A CPU stand-in with ``flash_attn.flash_attn_varlen_func``'s signature (self-attention, no dropout).

    Use it with :func:`override_backend` to test code that routes through the ``"flash_attn"`` backend.
    ``window_size`` and ``softcap`` follow flash-attn (``(-1, -1)``: no window; ``0.0``: no cap).
    """
    if dropout_p != 0.0:
        raise ValueError(f"the reference kernel has no dropout, got dropout_p={dropout_p}")
    if not torch.equal(cu_seqlens_q, cu_seqlens_k) or max_seqlen_q != max_seqlen_k:
        raise ValueError("the reference kernel only does self-attention (cu_seqlens_q == cu_seqlens_k)")
    return reference_varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        max_seqlen_q,
        causal=causal,
        softmax_scale=softmax_scale,
        window=tuple(window_size),
        softcap=softcap or None,
    )
