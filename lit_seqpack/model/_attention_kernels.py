"""The calls into the CUDA varlen kernels: ``flash_attn_varlen_func`` and ``torch.nn.attention.varlen.varlen_attn``.

Each adapter maps :func:`~lit_seqpack.model.attention.varlen_attention`'s arguments onto the installed kernel's
signature (read with :func:`parameters`), and raises :class:`BackendUnavailableError` naming what the installed
kernel lacks, rather than dropping an argument.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch


class BackendUnavailableError(RuntimeError):
    """An explicitly requested attention backend cannot run here; the message says why and how to fix it."""


def flash_attn_call(
    kernel: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None,
    softcap: float | None,
) -> torch.Tensor:
    kwargs: dict[str, object] = {"dropout_p": 0.0, "softmax_scale": scale, "causal": causal}
    for key, value in (("window_size", window), ("softcap", softcap)):
        if value is None:
            continue
        if key not in parameters(kernel):
            raise BackendUnavailableError(
                f"the installed flash_attn_varlen_func has no {key!r} (flash-attn >= 2.6 has window_size and softcap)"
                "; upgrade flash-attn or use backend='sdpa'"
            )
        kwargs[key] = value
    return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


@functools.cache
def parameters(kernel: Callable[..., torch.Tensor]) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def torch_varlen_call(
    kernel: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    params = parameters(kernel)
    kwargs: dict[str, object] = {}
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0)
        kwargs["window_size"] = window if window is not None else ((-1, 0) if causal else (-1, -1))
    elif window is not None:
        raise BackendUnavailableError(
            f"this torch's varlen_attn has no window_size (torch >= 2.11 has it); window={window} needs "
            "backend='sdpa' or a newer torch"
        )
    elif "is_causal" in params:  # torch 2.9 / 2.10
        kwargs["is_causal"] = causal
    else:
        raise BackendUnavailableError(f"unrecognised varlen_attn signature {sorted(params)}; use backend='sdpa'")
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel applies head_dim ** -0.5 itself
        q = q * (scale * math.sqrt(q.shape[-1]))
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
