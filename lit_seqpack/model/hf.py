"""Hugging Face causal LMs on packed rows, and a check that packed outputs equal per-document outputs.

A stock transformers model given a packed row with only ``position_ids`` is *not* safe: with the default
``use_cache=True`` it builds a cache, skips its packed-sequence detection and attends across documents (a tiny
random ``LlamaForCausalLM`` is off by 0.2 to 1.4 in the logits). This module registers a varlen attention
function with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`; :func:`prepare_hf_model`
switches a model to it and :func:`hf_model_inputs` maps the batch contract to the model's keywords::

    packed row     input_ids, position_ids, cu_seq_lens_q = cu_seq_lens_k = cu_seqlens,
                   max_length_q = max_length_k = max_seqlen, use_cache=False          -> varlen_attention
    padded [B, L]  input_ids, position_ids, attention_mask, use_cache=False           -> the original attention
                   (right padding only: lit_seqpack_right_padded=True, no padding mask, plain causal SDPA)
    anything else  (generate(), a KV cache, left padding, a 4-D mask)                 -> the original attention

Outside packed rows a prepared model computes exactly what it computed before :func:`prepare_hf_model`: the mask
is built by the original implementation's mask function and the attention delegated to the original's function
(see :mod:`lit_seqpack.model._hf_dispatch`). Model code that branches on the implementation's *name* (e.g.
GPT-2's ``reorder_and_upcast_attn`` under ``"eager"``) sees lit_seqpack's name; :func:`restore_hf_attention` gives
back the stock model entirely (before ``save_pretrained`` or serving).

:func:`check_packing_equivalence` runs each document of a batch alone and reports the largest difference with
the batch's logits; :class:`~lit_seqpack.model.mixin.PackedSequenceMixin` runs a two-document version of it once
(:func:`probe_packing_isolation`) and raises :class:`PackingLeakError` rather than train on leaking attention.

transformers is imported only inside the functions that need it; nothing here touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_seqpack.data.labels import IGNORE_INDEX
from lit_seqpack.model import _hf_dispatch
from lit_seqpack.model._hf_packed import ATTENTION_NAME, attention_extras, reject_unsupported
from lit_seqpack.model.attention import varlen_attention

__all__ = [
    "ATTENTION_NAME",
    "PackingLeakError",
    "PackingReport",
    "check_packing_equivalence",
    "documents_batch",
    "hf_model_inputs",
    "hf_varlen_attention",
    "prepare_hf_model",
    "probe_packing_isolation",
    "register_attention",
    "restore_hf_attention",
]


class PackingLeakError(RuntimeError):
    """A model's outputs on a packed row differ from its outputs on each document alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingReport:
    """Result of :func:`check_packing_equivalence`.

    Args:
        document_errors: per document, the largest absolute logit difference between the batch and the
            document alone.
        tolerance: the largest difference accepted.
    """

    document_errors: tuple[float, ...]
    tolerance: float

    @property
    def max_error(self) -> float:
        """The largest difference over all documents."""
        return max(self.document_errors, default=0.0)

    @property
    def passed(self) -> bool:
        """Whether every document is within ``tolerance``."""
        return self.max_error <= self.tolerance


# ------------------------------------------------------------------------------------------- transformers glue
def register_attention() -> str:
    """Register :func:`hf_varlen_attention` with transformers' attention and mask interfaces (idempotent); its name.

    The mask function registered under the same name builds the mask of each model's original implementation
    (none on a packed row).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, hf_varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _hf_dispatch.original_mask)
    return ATTENTION_NAME


def prepare_hf_model(model: Any) -> Any:
    """Switch a transformers model (and its sub-models) to lit_seqpack's varlen attention; returns ``model``.

    The implementation every config had before (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ... for the
    model and each sub-model) is recorded on the model, so :func:`restore_hf_attention` can switch it back exactly.
    Preparing a prepared model again keeps the first record.
    """
    _hf_dispatch.record(model)
    model.set_attn_implementation(register_attention())
    _hf_dispatch.install_hooks(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        _hf_dispatch.restore(model)
        raise ValueError(
            f"{type(model).__name__} does not support custom attention functions (its attn_implementation stayed "
            f"{model.config._attn_implementation!r}); packed training needs a model built on AttentionInterface"
        )
    return model


def restore_hf_attention(model: Any) -> Any:
    """Switch a model prepared by :func:`prepare_hf_model` back to its original attention; returns ``model``.

    Every config (the model's and each sub-model's) gets back exactly the implementation it had before
    :func:`prepare_hf_model`, so the model computes what the stock model computes (e.g. before ``save_pretrained``
    or for serving).

    Raises:
        ValueError: ``model`` was not prepared by :func:`prepare_hf_model`.
    """
    return _hf_dispatch.restore(model)


def hf_model_inputs(batch: Mapping[str, Any], *, backend: str = "auto") -> dict[str, Any]:
    """Keyword arguments for a model prepared by :func:`prepare_hf_model`, from a contract batch.

    A padded batch passes the standard ``attention_mask`` (models that read it for more than attention get it);
    when every row's padding is on the right it also passes ``lit_seqpack_right_padded=True``, so the mask is built
    without the padding (plain causal SDPA, exact for every real token; see :mod:`lit_seqpack.model._hf_dispatch`).

    Args:
        batch: a packed row (with ``cu_seqlens``) or a padded ``[B, L]`` batch (with ``attention_mask``).
        backend: the :func:`~lit_seqpack.model.attention.varlen_attention` backend for packed rows.
    """
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, "lit_seqpack_backend": backend}
    if batch.get("position_ids") is not None:
        inputs["position_ids"] = batch["position_ids"]
    if batch.get("cu_seqlens") is not None:
        cu_seqlens, max_seqlen = batch["cu_seqlens"], int(batch["max_seqlen"])
        inputs.update(
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen
        )
    elif batch.get("attention_mask") is not None:
        mask = batch["attention_mask"]
        inputs["attention_mask"] = mask
        if mask.ndim == 2 and _is_right_padded(mask):
            inputs[_hf_dispatch.RIGHT_PADDED_KWARG] = True
    return inputs


def _is_right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a 2-D ``[B, L]`` padding mask is ones then zeros (one host sync)."""
    keep = mask.bool()
    return bool((keep[:, 1:] <= keep[:, :-1]).all()) if keep.shape[1] > 1 else True


def hf_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers attention function: varlen attention with ``cu_seq_lens_q``, the original attention otherwise.

    ``query`` is ``[B, heads, T, head_dim]`` and ``key``/``value`` ``[B, kv_heads, T, head_dim]``; returns
    ``([B, T, heads, head_dim], None)`` on a packed row. Without ``cu_seq_lens_q`` the call goes, with the same
    arguments, to the attention function of the model's original implementation (what the model ran before
    :func:`prepare_hf_model`). On a packed row anything this function cannot honour raises rather than being
    ignored.
    """
    backend = kwargs.pop("lit_seqpack_backend", "auto")
    kwargs.pop(_hf_dispatch.RIGHT_PADDED_KWARG, None)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return _hf_dispatch.delegate(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    reject_unsupported(module, attention_mask, dropout, kwargs)
    extras = attention_extras(module, kwargs)
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    if cu_seqlens_k is None or (cu_seqlens_k is not cu_seqlens and not torch.equal(cu_seqlens_k, cu_seqlens)):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (self-attention without a cache)")
    if query.shape[0] != 1:
        raise ValueError(f"a packed row must have batch size 1, got query of shape {tuple(query.shape)}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim] views
    out = varlen_attention(
        q,
        k,
        v,
        cu_seqlens.to(torch.int32),
        kwargs["max_length_q"],  # an int (a SymInt under torch.compile: no int() that would specialise it)
        causal=True,
        softmax_scale=scaling,
        backend=backend,
        **extras,
    )
    return out.unsqueeze(0), None


# ------------------------------------------------------------------------------------------- equivalence check
def documents_batch(documents: Sequence[torch.Tensor], *, packed: bool = True) -> dict[str, Any]:
    """A contract batch of whole documents (1-D token tensors on one device): one packed row or padded rows.

    Every token but each document's first is a target. Padded rows are right-padded with token 0.

    Example:
        >>> b = documents_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
        >>> b["position_ids"].tolist(), b["cu_seqlens"].tolist(), b["labels"].tolist()
        ([[0, 1, 2, 0, 1]], [0, 3, 5], [[-100, 6, 7, -100, 9]])
    """
    if not documents or any(d.ndim != 1 or d.numel() == 0 for d in documents):
        raise ValueError(f"documents must be non-empty 1-D tensors, got shapes {[tuple(d.shape) for d in documents]}")
    device, lengths = documents[0].device, [int(d.numel()) for d in documents]
    if packed:
        input_ids = torch.cat(list(documents)).long()[None]
        position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        bounds = torch.tensor([0, *lengths], device=device).cumsum(0)
        extra: dict[str, Any] = {"cu_seqlens": bounds.to(torch.int32), "max_seqlen": max(lengths)}
        labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
    else:
        width = max(lengths)
        input_ids = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
        for row, doc in enumerate(documents):
            input_ids[row, : len(doc)] = doc
        position_ids = torch.arange(width, device=device).expand(len(lengths), -1)
        extra = {"attention_mask": (position_ids < torch.tensor(lengths, device=device)[:, None]).long()}
        labels = input_ids.masked_fill((position_ids == 0) | (extra["attention_mask"] == 0), IGNORE_INDEX)
    num_loss_tokens = sum(lengths) - len(lengths)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        **extra,
        "num_documents": len(lengths),
        "num_real_tokens": sum(lengths),
        "num_padding_tokens": input_ids.numel() - sum(lengths),
        "num_loss_tokens": num_loss_tokens,
        "step_loss_tokens": num_loss_tokens,
        "world_size": 1,
        "accumulate_grad_batches": 1,
        "max_tokens": None,
        "is_empty": False,
    }


def check_packing_equivalence(
    model: Any, batch: Mapping[str, Any], *, atol: float = 1e-5, strict: bool = False
) -> PackingReport:
    """Compare a batch's logits with the logits of each of its documents run alone (eval mode, no grad).

    Args:
        model: a module with ``seqpack_forward`` (a :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`), or a
            transformers causal LM, called with :func:`hf_model_inputs` (prepare it with :func:`prepare_hf_model`).
        batch: a packed row (documents are its first ``num_documents`` segments) or a padded ``[B, L]`` batch
            (each row is a document of ``attention_mask.sum()`` tokens).
        atol: the largest absolute logit difference accepted.
        strict: raise :class:`PackingLeakError` instead of returning a failed report.
    """
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    forward = _forward_fn(model)
    packed = batch.get("cu_seqlens") is not None
    errors = []
    with _evaluation(model):
        logits = forward(batch).float()
        for row, start, end in _documents(batch):
            alone = forward(documents_batch([batch["input_ids"][row, start:end]], packed=packed)).float()
            errors.append((logits[row, start:end] - alone[0]).abs().max().item())
    report = PackingReport(document_errors=tuple(errors), tolerance=atol)
    if strict and not report.passed:
        raise PackingLeakError(
            f"packed logits differ from per-document logits by up to {report.max_error:.3g} (atol={atol}); errors "
            f"per document: {[f'{e:.3g}' for e in errors]}"
        )
    return report


def probe_packing_isolation(model: Any, batch: Mapping[str, Any]) -> PackingReport:
    """Raise :class:`PackingLeakError` if ``model`` attends across documents; a cheap one-time runtime probe.

    Two documents (up to 4 tokens of ``batch`` then 6 seeded random tokens) are run packed in one row and each
    alone; the tolerance is ``1e-3 * (1 + max |logit|)`` for float32/64 logits and 50x that for half precision.
    """
    forward = _forward_fn(model)
    first = batch["input_ids"].reshape(-1)[:4]
    with _evaluation(model):
        alone_first = forward(documents_batch([first])).float()
        gen = torch.Generator().manual_seed(0)
        second = torch.randint(0, alone_first.shape[-1], (6,), generator=gen).to(first.device)
        alone_second = forward(documents_batch([second])).float()
        packed = forward(documents_batch([first, second]))
    expected = torch.cat([alone_first, alone_second], dim=1)
    scale = 1e-3 if packed.dtype in (torch.float32, torch.float64) else 5e-2
    tolerance = scale * (1.0 + expected.abs().max().item())
    errors = tuple(
        (packed.float()[:, s:e] - expected[:, s:e]).abs().max().item() for s, e in [(0, len(first)), (len(first), None)]
    )
    report = PackingReport(document_errors=errors, tolerance=tolerance)
    if not report.passed:
        raise PackingLeakError(
            f"{type(model).__name__} attends across documents in a packed row: a 2-document row differs from the "
            f"documents run alone by {report.max_error:.3g} (tolerance {tolerance:.3g}). Its forward must use "
            "cu_seqlens (lit_seqpack.varlen_attention); for a transformers model use lit_seqpack.model.hf."
            "prepare_hf_model and hf_model_inputs (which also pass use_cache=False)."
        )
    return report


def _forward_fn(model: Any) -> Callable[[Mapping[str, Any]], torch.Tensor]:
    if hasattr(model, "seqpack_forward"):
        return model.seqpack_forward
    return lambda batch: model(**hf_model_inputs(batch)).logits


def _documents(batch: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of a contract batch."""
    if batch.get("cu_seqlens") is not None:
        bounds = batch["cu_seqlens"].tolist()
        count = batch.get("num_documents", len(bounds) - 1)
        return [(0, bounds[i], bounds[i + 1]) for i in range(count) if bounds[i + 1] > bounds[i]]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [(row, 0, int(n)) for row, n in enumerate(lengths) if n > 0]


@contextlib.contextmanager
def _evaluation(model: Any) -> Iterator[None]:
    """Eval mode and no grad inside the block; every submodule's own mode is restored after it."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    if isinstance(model, torch.nn.Module):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
