"""Variable-length (packed) attention: one signature, three backends, and a reference to test them against.

A packed row holds several documents back to back; ``cu_seqlens`` (int32, FlashAttention-2 naming) marks where
each one starts, and attention never crosses a boundary::

    tokens       a a a b b b b b c c p p      q, k, v: [total_tokens=12, heads, head_dim]
    cu_seqlens   0     3         8   10  12   (the padding tail p p is a segment of its own)

    causal mask  a: a a a   b: b b b b b   c: c c   p: p p   (lower triangle inside each block)

Backends (``backend=`` of :func:`varlen_attention`) are one :class:`AttentionBackend` record each in
:data:`ATTENTION_BACKENDS` (what each needs, what it honours, where to go when it cannot run);
:func:`available_backends`, ``"auto"``, the error messages and the table of docs/packing.md (:func:`backend_table`)
read them:

* ``"flash_attn"``: ``flash_attn.flash_attn_varlen_func``.
* ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn``. Its signature changed between releases
  (``is_causal=`` first, ``window_size=(-1, 0)`` later); it is adapted at call time by inspecting the installed
  function.
* ``"sdpa"``: exact ``F.scaled_dot_product_attention`` per document over ``torch.split`` views. Runs anywhere;
  the CPU path. (Slicing ``x[s:e]`` per document is 10-50x slower in backward than ``split``.)
* ``"flex"``: torch's FlexAttention with a block mask built from ``cu_seqlens`` once per batch
  (:mod:`lit_seqpack.model.flex_attention`); honours windows, softcaps and sinks together. On CPU forward only.

``"auto"`` picks the first usable one in that order for the tensors' device and dtype (so never ``"flex"``, which
comes after ``"sdpa"``: ask for it by name). Nothing here touches
CUDA or imports flash-attn at import time. Tests force a backend with :func:`use_backend` and swap a kernel
for a CPU stand-in with the kernel's own signature with :func:`override_backend` (for instance
:func:`~lit_seqpack.model.attention_reference.reference_flash_attn_varlen_func`), so the argument routing is tested
without a GPU.

:func:`route_varlen_attention` is the extension point for attention that is not local to one process: inside
the block every :func:`varlen_attention` call (from any model: the reference decoder, a transformers model
through :mod:`lit_seqpack.model.hf`) goes to a handler instead; context parallelism
(:mod:`lit_seqpack.model.cp_attention`) uses it.

**Kernels.** The calls into the CUDA varlen kernels (``flash_attn_varlen_func``,
``torch.nn.attention.varlen.varlen_attn``): each adapter maps :func:`varlen_attention`'s arguments onto the installed
kernel's signature (read with :func:`parameters`), and raises :class:`BackendUnavailableError` naming what the installed
kernel lacks, rather than dropping an argument.

**Checks** of :func:`varlen_attention`'s arguments (shapes, window, softcap, sinks) run before any kernel.

**Arithmetic.** The exact attention behind the ``"sdpa"`` backend and the reference (windows, softcaps, sinks), one
document (or one dense row, for the reference) at a time, on ``[1, heads, n, head_dim]`` views:

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

import contextlib
import contextvars
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from lit_seqpack._imports import FLASH_ATTN_AVAILABLE, FLASH_ATTN_INSTALL_HINT, BackendUnavailableError
from lit_seqpack.model.flex_attention import flex_varlen, load_flex

__all__ = [
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "AttentionBackend",
    "BackendUnavailableError",
    "autocast_inputs",
    "available_backends",
    "backend_table",
    "override_backend",
    "route_varlen_attention",
    "use_backend",
    "varlen_attention",
]


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


_OVERRIDES: dict[str, Callable[..., torch.Tensor]] = {}
_FORCED: list[str] = []
_ROUTES_ACTIVE = [0]  # open route_varlen_attention blocks: a plain global that torch.compile guards on
_ROUTE: contextvars.ContextVar[Callable[..., torch.Tensor] | None] = contextvars.ContextVar(
    "lit_seqpack_varlen_route", default=None
)


@functools.cache
def _load_flash_attn() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    if not FLASH_ATTN_AVAILABLE:
        return None, f"flash-attn is not installed: {FLASH_ATTN_INSTALL_HINT}"
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError) as err:  # OSError: a CUDA library the extension links to is missing
        return None, f"flash-attn is installed but does not import ({err}); {FLASH_ATTN_INSTALL_HINT}"
    return flash_attn_varlen_func, None


@functools.cache
def _load_torch_varlen() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, f"torch.nn.attention.varlen needs torch >= 2.9 (installed {torch.__version__}): upgrade torch"
    return varlen_attn, None


Loader = Callable[[], tuple[Callable[..., torch.Tensor] | None, str | None]]
"""Imports a kernel: ``(kernel, None)``, or ``(None, why it cannot)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionBackend:
    """One attention backend: ``"auto"``, :func:`available_backends`, the errors and :func:`backend_table` read it.

    Args:
        name: the ``backend=`` value.
        requires: what must be installed, in words (for the table).
        devices: device types it runs on (empty: any).
        dtypes: tensor dtypes it takes (empty: any).
        load: imports its kernel (``None``: plain torch, nothing to load).
        honours: what it computes exactly beyond ``softmax_scale`` and grouped-query heads (``causal``,
            ``window``, ``softcap``, ``sinks``); ``"auto"`` skips it for the others and an explicit request raises.
        fallback: the backend to use where it cannot run (``None``: it runs anywhere).
    """

    name: str
    requires: str
    devices: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    load: Loader | None = None
    honours: frozenset[str]
    fallback: str | None = None


_HALF = (torch.float16, torch.bfloat16)
ATTENTION_BACKENDS: Mapping[str, AttentionBackend] = MappingProxyType(
    {
        record.name: record
        for record in (
            AttentionBackend(
                name="flash_attn",
                requires="flash-attn >= 2.6 built against your torch (``pip install 'lit-seqpack[flash-attn]'``)",
                devices=("cuda",),
                dtypes=_HALF,
                load=_load_flash_attn,
                honours=frozenset({"causal", "window", "softcap"}),
                fallback="sdpa",
            ),
            AttentionBackend(
                name="torch_varlen",
                requires="torch >= 2.9 (``torch.nn.attention.varlen``; the window needs torch >= 2.11)",
                devices=("cuda",),
                dtypes=_HALF,
                load=_load_torch_varlen,
                honours=frozenset({"causal", "window"}),
                fallback="sdpa",
            ),
            AttentionBackend(
                name="sdpa",
                requires="torch (``F.scaled_dot_product_attention``)",
                honours=frozenset({"causal", "window", "softcap", "sinks"}),
            ),
            AttentionBackend(
                name="flex",
                requires="torch >= 2.9 (``torch.nn.attention.flex_attention``); forward only on CPU (no backward)",
                load=load_flex,
                honours=frozenset({"causal", "window", "softcap", "sinks"}),
                fallback="sdpa",
            ),
        )
    }
)
"""Every attention backend's record, in the order ``"auto"`` tries them."""
BACKENDS: tuple[str, ...] = tuple(ATTENTION_BACKENDS)
"""Backend names, in the order ``"auto"`` tries them."""


def backend_table() -> str:
    """The attention backends as a Markdown table (docs/packing.md's, kept equal to it by a test).

    Example:
        >>> backend_table().splitlines()[0]
        '| backend | runs on | needs | honours | elsewhere |'
    """
    rows = ["| backend | runs on | needs | honours | elsewhere |", "|---|---|---|---|---|"]
    for r in ATTENTION_BACKENDS.values():
        where = ", ".join(filter(None, [" / ".join(d.upper() for d in r.devices), _dtype_names(r.dtypes, " / ")]))
        honours = ", ".join(f"`{f}`" for f in _FEATURE_ORDER if f in r.honours)
        requires = r.requires.replace("``", "`")
        rows.append(
            f"| `{r.name}` | {where or 'any'} | {requires} | {honours} | {f'`{r.fallback}`' if r.fallback else '-'} |"
        )
    return "\n".join(rows)


_FEATURE_ORDER = ("causal", "window", "softcap", "sinks")


def _dtype_names(dtypes: tuple[torch.dtype, ...], sep: str) -> str:
    return sep.join(str(t).removeprefix("torch.") for t in dtypes)


def _unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype | None, explain: bool = False
) -> str | None:
    """Why backend ``name`` cannot run on ``device``/``dtype`` (``None`` when it can).

    The kernel's import is only attempted for CUDA tensors, or with ``explain`` (an explicit request that already
    failed), so that CPU code never imports flash-attn.
    """
    record = ATTENTION_BACKENDS[name]
    if record.load is None or name in _OVERRIDES:
        return None
    reasons = []
    if record.devices and device.type not in record.devices:
        where = " or ".join(d.upper() for d in record.devices)
        reasons.append(f"the {name} kernel runs on {where} tensors only (got device {device.type!r})")
    if record.dtypes and dtype is not None and dtype not in record.dtypes:
        reasons.append(f"the {name} kernel needs {_dtype_names(record.dtypes, ' or ')} tensors (got {dtype})")
    if not reasons or explain:
        load_error = record.load()[1]
        reasons += [load_error] if load_error else []
    fallback = [f"backend={record.fallback!r} runs anywhere"] if record.fallback else []
    return "; ".join([*reasons, *fallback]) if reasons else None


def available_backends(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: CUDA if visible, else CPU) and ``dtype`` (default: any).

    Example:
        >>> "sdpa" in available_backends("cpu")
        True
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return [name for name in BACKENDS if _unavailable_reason(name, device, dtype) is None]


def _resolve(backend: str, device: torch.device, dtype: torch.dtype, features: frozenset[str] = frozenset()) -> str:
    if backend == "auto" and _FORCED:
        backend = _FORCED[-1]
    if backend == "auto":
        usable = (name for name, record in ATTENTION_BACKENDS.items() if features <= record.honours)
        return next(name for name in usable if _unavailable_reason(name, device, dtype) is None)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    missing = sorted(features - ATTENTION_BACKENDS[backend].honours)
    if missing:
        able = " or ".join(f"backend={n!r}" for n, r in ATTENTION_BACKENDS.items() if features <= r.honours)
        raise BackendUnavailableError(
            f"attention backend {backend!r} cannot honour {', '.join(missing)}; {able} computes it exactly"
        )
    if _unavailable_reason(backend, device, dtype) is not None:
        reason = _unavailable_reason(backend, device, dtype, explain=True)
        raise BackendUnavailableError(f"attention backend {backend!r} is unavailable: {reason}")
    return backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the block (an unusable ``name`` then raises)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


@contextlib.contextmanager
def override_backend(name: str, kernel: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Replace backend ``name``'s kernel by ``kernel`` inside the block; it then counts as usable everywhere.

    ``kernel`` takes the replaced kernel's own signature (``flash_attn_varlen_func``'s for ``"flash_attn"``,
    ``torch.nn.attention.varlen.varlen_attn``'s for ``"torch_varlen"``), so the code that maps
    :func:`varlen_attention`'s arguments onto the kernel is exercised unchanged, e.g. on CPU with
    :func:`reference_flash_attn_varlen_func`.
    """
    kernels = tuple(n for n, record in ATTENTION_BACKENDS.items() if record.load is not None)
    if name not in kernels:
        raise ValueError(f"only kernel backends {kernels} can be overridden, got {name!r}")
    previous = _OVERRIDES.get(name)
    _OVERRIDES[name] = kernel
    try:
        yield
    finally:
        if previous is None:
            del _OVERRIDES[name]
        else:
            _OVERRIDES[name] = previous


@contextlib.contextmanager
def route_varlen_attention(handler: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Send every :func:`varlen_attention` call inside the block to ``handler`` instead.

    ``handler(q, k, v, cu_seqlens, max_seqlen, causal=..., softmax_scale=..., backend=...)`` returns the output;
    it runs with the route cleared, so it may call :func:`varlen_attention` for its local work. The route is a
    ``contextvars`` variable: it holds for the forward pass run inside the block (not for a recomputation in
    backward, e.g. activation checkpointing, which runs after the block).
    """
    token = _ROUTE.set(handler)
    _ROUTES_ACTIVE[0] += 1
    try:
        yield
    finally:
        _ROUTES_ACTIVE[0] -= 1
        _ROUTE.reset(token)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v`` in autocast's dtype when autocast is on for their device, else unchanged.

    Under autocast, transformers' RoPE returns float32 queries and keys while the values come out of a bfloat16
    projection. SDPA under autocast casts its three inputs to the autocast dtype, and transformers' flash-attention
    path casts them to it too (``get_target_dtype``); every backend here does the same, so a packed row computes
    what the stock model computes under the same autocast. Outside autocast the dtypes must already agree.

    Example:
        >>> q, v = torch.zeros(3, 2, 4), torch.zeros(3, 2, 4, dtype=torch.bfloat16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     [t.dtype for t in autocast_inputs(q, q, v)]
        [torch.bfloat16, torch.bfloat16, torch.bfloat16]
    """
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in (q, k, v))


def _sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The ``"sdpa"`` backend: SDPA per document in eager mode, one block-diagonal SDPA under ``torch.compile``.

    The per-document loop reads ``cu_seqlens`` on the host and splits by its lengths, so traced it would graph-break
    and guard on every segment length (one recompilation per new document count: 28-48 in 10 steps). Under
    ``torch.compile`` the row is computed at once with a mask built on the device (:func:`dense_varlen`): no
    graph break, no guard on the layout, the same function (exact), at ``T^2`` instead of ``sum(n_i^2)`` cost.
    """
    if torch.compiler.is_compiling():
        return dense_varlen(q, k, v, cu_seqlens, causal, scale, window, softcap, sinks)
    lengths = segment_lengths(cu_seqlens, q.shape[0], max_seqlen)
    return sdpa_varlen(q, k, v, lengths, causal, scale, window, softcap, sinks)


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    return _OVERRIDES.get(name) or ATTENTION_BACKENDS[name].load()[0]  # type: ignore[misc,return-value]


def varlen_attention(
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
    backend: str = "auto",
) -> torch.Tensor:
    """Attention inside each segment of a packed row.

    Args:
        q: queries ``[total_tokens, heads, head_dim]``.
        k: keys ``[total_tokens, kv_heads, head_dim]``; ``kv_heads`` divides ``heads`` (grouped-query attention:
            query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        v: values, shaped like ``k``.
        cu_seqlens: int32 ``[num_segments + 1]`` segment boundaries, ``0`` first and ``total_tokens`` last.
        max_seqlen: the longest segment, a Python int (no device sync).
        causal: mask future tokens inside each segment.
        softmax_scale: score scale; default ``head_dim ** -0.5``.
        window: ``(left, right)``, FlashAttention's local window: query ``i`` sees keys ``i - left ..
            i + right`` of its segment (``-1``: unbounded; ``causal`` caps ``right`` at 0). transformers'
            ``sliding_window=W`` is ``(W - 1, 0)``. A window at least as long as a segment changes nothing there.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma2).
        sinks: ``[heads]`` float sink logits, one extra softmax column per query head that no value reads
            (GPT-OSS ``s_aux``).
        backend: ``"auto"`` or one of :data:`BACKENDS` (``"auto"`` never picks ``"flex"``). ``"auto"`` skips
            backends that cannot honour the requested ``window``/``softcap``/``sinks``
            (``AttentionBackend.honours``); an explicit backend that cannot raises.

    Under autocast, ``q``/``k``/``v`` are first cast to the autocast dtype (see :func:`autocast_inputs`).

    Returns:
        ``[total_tokens, heads, head_dim]``.

    Raises:
        ValueError: bad shapes, dtypes, boundaries, window, softcap or sinks (the values of ``cu_seqlens`` are
            checked whenever they are on the host or the backend reads them anyway, so a CUDA kernel call never
            pays for a sync).
        BackendUnavailableError: an explicit ``backend`` cannot run here or cannot honour a requested feature; the
            message names it and says how to fix it.
    """
    q, k, v = autocast_inputs(q, k, v)
    handler = _ROUTE.get() if _ROUTES_ACTIVE[0] else None  # no ContextVar read (a graph break) outside a route
    if handler is not None:  # see route_varlen_attention
        extra = {
            key: val for key, val in (("window", window), ("softcap", softcap), ("sinks", sinks)) if val is not None
        }
        token = _ROUTE.set(None)
        try:
            return handler(
                q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, backend=backend, **extra
            )
        finally:
            _ROUTE.reset(token)
    check_inputs(q, k, v, cu_seqlens, max_seqlen)
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    window, features = check_extras(q, window, softcap, sinks, causal)
    name = _resolve(backend, q.device, q.dtype, features)
    if name == "sdpa":
        return _sdpa_backend(q, k, v, cu_seqlens, max_seqlen, causal, scale, window, softcap, sinks)
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        segment_lengths(cu_seqlens, q.shape[0], max_seqlen)
    if name == "flash_attn":
        return flash_attn_call(_kernel("flash_attn"), q, k, v, cu_seqlens, max_seqlen, causal, scale, window, softcap)
    if name == "torch_varlen":
        return torch_varlen_call(_kernel("torch_varlen"), q, k, v, cu_seqlens, max_seqlen, causal, scale, window)
    return flex_varlen(q, k, v, cu_seqlens, causal, scale, window, softcap, sinks, _OVERRIDES.get("flex"))
