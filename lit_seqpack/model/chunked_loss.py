"""The loss from hidden states, chunk by chunk through the output projection: never ``[tokens, vocab]`` logits.

One packed row of 8,192 tokens with a 152k vocabulary is 5 GB of float32 logits, and as much again for their
gradient. :func:`chunked_cross_entropy` and :func:`chunked_token_logprobs` take the last hidden states ``[B, T, H]``
and the model's :class:`OutputHead` instead, and walk the tokens ``chunk_size`` at a time through an autograd
function that keeps only the hidden states (already alive for the model's own backward)::

    forward    for each chunk c:  z_c = head(h_c)  [C, V]   ->  log p(target_c)  [C]     (z_c freed)
    backward   for each chunk c:  z_c = head(h_c) again     ->  dL/dh_c, dL/dW += ...   (z_c freed)

so the peak holds one chunk's logits (and their gradient) however long the row. The head reproduces what a
model's own forward does after the projection: a bias, a scale (Granite's ``1 / logits_scaling``, Cohere's
``logit_scale``, Falcon-H1's ``lm_head_multiplier``), a final soft cap (Gemma2/3's ``final_logit_softcapping``)
and, for RL, a sampling temperature. Under autocast each chunk is recomputed in the forward's autocast state, so
the values are the plain path's up to summation order.

Example:
    >>> from lit_seqpack.model.loss import token_cross_entropy
    >>> _ = torch.manual_seed(0)
    >>> hidden, weight = torch.randn(1, 5, 4), torch.randn(7, 4)
    >>> labels = torch.tensor([[-100, 1, 2, 3, 4]])
    >>> chunked = chunked_cross_entropy(hidden, OutputHead(weight=weight, chunk_size=2), labels)
    >>> plain = token_cross_entropy(hidden @ weight.T, labels)
    >>> torch.allclose(chunked.loss_sum, plain.loss_sum), chunked.num_units
    (True, 4)
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from lit_seqpack.batch import IGNORE_INDEX, shift_labels
from lit_seqpack.model.loss import LossOutput

__all__ = [
    "DEFAULT_LOSS_CHUNK_SIZE",
    "OutputHead",
    "chunked_cross_entropy",
    "chunked_token_logprobs",
    "hf_output_head",
    "verify_output_head",
    "with_temperature",
]

log = logging.getLogger(__name__)

DEFAULT_LOSS_CHUNK_SIZE = 1024
"""Tokens per chunk: ``1024 x vocab`` float32 logits at a time (256 MiB at a 65k vocabulary)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputHead:
    """A model's output projection and the transforms its forward applies to the logits, in this order::

        logits = softcap * tanh((hidden @ weight.T + bias) * scale / softcap) / temperature

    Args:
        weight: ``[vocab, hidden]`` projection (the input embedding when tied).
        bias: ``[vocab]`` or ``None``.
        scale: multiplies the projected logits (Granite: ``1 / logits_scaling``; Cohere: ``logit_scale``).
        softcap: the final logit soft cap (Gemma2/3's ``final_logit_softcapping``); ``None``: none.
        temperature: divides the final logits (an RL sampler's temperature); 1: none.
        chunk_size: tokens whose logits exist at once, in the forward and in the backward.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.weight.ndim != 2:
            raise ValueError(f"OutputHead.weight must be [vocab, hidden], got shape {tuple(self.weight.shape)}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, bias: Any = ...) -> torch.Tensor:
        """The logits of ``hidden`` (``[..., H]``) as the model's forward computes them (same ops, same order)."""
        weight = self.weight if weight is None else weight
        z = F.linear(hidden, weight, self.bias if bias is ... else bias)
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature if self.temperature != 1.0 else z


def _target_logprobs(head: OutputHead, hidden: torch.Tensor, weight: torch.Tensor, bias: Any, targets: torch.Tensor):
    """``log softmax(head(hidden))[target]`` in float32 (half-precision logits upcast), 0 where the target is -100."""
    z = head.logits(hidden, weight, bias)
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    keep = targets != IGNORE_INDEX
    picked = z.gather(-1, torch.where(keep, targets, 0)[:, None])[:, 0]
    return torch.where(keep, picked - torch.logsumexp(z, dim=-1), torch.zeros_like(picked))


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """Per-token target log-probabilities ``[N]`` from hidden states ``[N, H]``, one chunk of logits at a time.

    The forward keeps no logits; the backward recomputes each chunk's logits (under the forward's autocast state)
    and back-propagates through them with autograd, so every transform of the head gets its exact gradient.
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, head: OutputHead) -> torch.Tensor:  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64,
                          device=hidden.device)  # fmt: skip
        step = head.chunk_size
        for start in range(0, hidden.shape[0], step):
            stop = start + step
            out[start:stop] = _target_logprobs(head, hidden[start:stop], weight, bias, targets[start:stop])
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.head = head
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        head, (device, enabled, dtype) = ctx.head, ctx.autocast
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        accumulate = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_w = torch.zeros_like(weight, dtype=accumulate) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=accumulate) if need_b else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        step = head.chunk_size
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], step):
                stop = start + step
                h = hidden[start:stop].detach().requires_grad_(need_h)
                lp = _target_logprobs(head, h, w, b, targets[start:stop])
                wanted = [(x, acc) for x, acc in ((h, grad_h), (w, grad_w), (b, grad_b)) if acc is not None]
                grads = torch.autograd.grad(lp, [x for x, _ in wanted], grad[start:stop].to(lp.dtype))
                for (x, acc), g in zip(wanted, grads, strict=True):
                    if x is h:
                        acc[start:stop] = g
                    else:
                        acc += g
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None


def _flat_targets(labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    return (labels if shifted else shift_labels(labels)).reshape(-1)


def _check(hidden: torch.Tensor, head: OutputHead, labels: torch.Tensor) -> None:
    if hidden.ndim != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, H] and labels [B, T], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    if hidden.shape[-1] != head.weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match the head's weight {tuple(head.weight.shape)} ([vocab, H])"
        )


def _chunked_scores(hidden: torch.Tensor, head: OutputHead, targets: torch.Tensor) -> torch.Tensor:
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedTargetLogprobs.apply(flat, head.weight, head.bias, targets.to(flat.device), head)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: OutputHead,
    labels: torch.Tensor,
    *,
    num_loss_tokens: int | float | None = None,
    step_loss_tokens: int | float | None = None,
    shifted: bool = False,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """:func:`~lit_seqpack.model.loss.token_cross_entropy` of ``head(hidden)``, without ever holding the logits.

    The same sum, units and exact normalisation as the plain path (weighted loss and a context-parallel shard's
    ``shift_labels`` included): only ``head.chunk_size`` tokens' logits exist at a time, in the forward and in the
    backward (each chunk's logits are recomputed there, not kept).

    Args:
        hidden: ``[B, T, H]`` the model's last hidden states (after its final norm).
        head: the output projection and its transforms.
        labels: ``[B, T]`` with ``-100`` on positions without a target.
        num_loss_tokens: see :func:`~lit_seqpack.model.loss.token_cross_entropy`.
        step_loss_tokens: see :func:`~lit_seqpack.model.loss.token_cross_entropy`.
        shifted: ``labels`` are already the targets (``labels[:, t]`` for position ``t``).
        weights: ``[B, T]`` per-token loss weights aligned with ``labels`` (shifted with them unless ``shifted``).
    """
    _check(hidden, head, labels)
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"weights must have the shape of labels {tuple(labels.shape)}, got {tuple(weights.shape)}")
    targets = _flat_targets(labels, shifted)
    scores = _chunked_scores(hidden, head, targets)
    if weights is None:
        loss_sum = -scores.sum()
        if num_loss_tokens is None:
            num_loss_tokens = int((targets != IGNORE_INDEX).sum())
    else:
        flat_weights = (weights if shifted else F.pad(weights[..., 1:], (0, 1))).reshape(-1).to(scores.device)
        loss_sum = -(scores * flat_weights).sum()
        if num_loss_tokens is None:
            num_loss_tokens = float(flat_weights[targets != IGNORE_INDEX].double().sum())
    return LossOutput(loss_sum=loss_sum, num_units=num_loss_tokens, step_units=step_loss_tokens)


def chunked_token_logprobs(hidden: torch.Tensor, head: OutputHead, labels: torch.Tensor) -> torch.Tensor:
    """:func:`~lit_seqpack.rl.token_logprobs` of ``head(hidden)`` (differentiable), chunk by chunk: ``[B, T]``.

    ``out[:, t]`` is the log-probability of ``labels[:, t]`` given the tokens before it, 0 where the label is -100;
    the head's ``temperature`` divides the logits as :func:`~lit_seqpack.rl.temperature_scaled` does.
    """
    _check(hidden, head, labels)
    scores = _chunked_scores(hidden, head, shift_labels(labels).reshape(-1)).reshape(labels.shape)
    return F.pad(scores[:, :-1], (1, 0))


# ---------------------------------------------------------------------------------------------- transformers heads
_SCALES = (("logits_scaling", True), ("logit_scale", False), ("lm_head_multiplier", False))


def hf_output_head(model: Any, *, chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE) -> OutputHead | str:
    """The :class:`OutputHead` of a transformers causal LM, or why its loss must take the full logits.

    The transforms are read from its config (``final_logit_softcapping``, ``logits_scaling``, ``logit_scale``,
    ``lm_head_multiplier``) and the result is checked once on a short probe against the model's own logits
    (:func:`verify_output_head`), so an architecture doing anything else falls back instead of training differently.

    Args:
        model: the transformers model (PEFT wrappers removed).
        chunk_size: tokens per chunk.
    """
    projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(projection) is not torch.nn.Linear:
        return f"its output projection is {type(projection).__name__}, not a plain torch.nn.Linear"
    if _is_sharded(projection.weight):
        return "its output projection's weight is sharded (DTensor: FSDP2 / tensor parallel)"
    config = getattr(model, "config", None)
    scale = 1.0
    for name, divides in _SCALES:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
            scale = scale / value if divides else scale * value
    softcap = getattr(config, "final_logit_softcapping", None)
    return OutputHead(
        weight=projection.weight, bias=projection.bias, scale=scale, softcap=softcap or None, chunk_size=chunk_size
    )


def verify_output_head(model: Any, head: OutputHead) -> str | None:
    """``None`` if ``head(decoder(ids))`` reproduces ``model(ids).logits`` on an 8-token probe, else why not.

    Runs once per model, without grad and in eval mode (dropout off; the modes are restored after).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        return "it has no separate decoder (get_decoder) to read the hidden states from"
    ids = (torch.arange(8, device=head.weight.device) % head.weight.shape[0])[None]
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()
        # a compiled model runs this one-off unpacked probe eagerly: no graph (or graph break) of its own
        stance = getattr(torch.compiler, "set_stance", None)
        with torch.no_grad(), stance("force_eager") if stance is not None else contextlib.nullcontext():
            full = model(input_ids=ids, use_cache=False).logits
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            mine = head.logits(hidden)
    except Exception as err:  # any failure to reproduce is a reason to fall back, named in the log
        return f"its hidden states could not be read for the probe ({type(err).__name__}: {err})"
    finally:
        for module, training in modes.items():
            module.train(training)
    if full.shape != mine.shape:
        return f"its logits {tuple(full.shape)} are not head(hidden) {tuple(mine.shape)}"
    error = float((full.float() - mine.float()).abs().max())
    tolerance = 1e-3 * max(1.0, float(full.float().abs().max()))
    if not error <= tolerance:
        return f"its forward transforms the logits in a way the chunked loss does not reproduce (max diff {error:.3g})"
    return None


def _is_sharded(weight: torch.Tensor) -> bool:
    with contextlib.suppress(ImportError):
        from torch.distributed.tensor import DTensor

        return isinstance(weight, DTensor)
    return False


def with_temperature(head: OutputHead, temperature: float) -> OutputHead:
    """``head`` whose logits are also divided by ``temperature`` (an RL sampler's)."""
    return head if temperature == 1 else replace(head, temperature=head.temperature * temperature)
