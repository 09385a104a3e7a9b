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

:func:`check_packing_equivalence`, :func:`probe_packing_isolation` (the structural leak guard that
:class:`~lit_seqpack.model.mixin.PackedSequenceMixin` runs once), :class:`PackingLeakError` and
:func:`documents_batch` live in :mod:`lit_seqpack.model.isolation` and are re-exported here.

transformers is imported only inside the functions that need it; nothing here touches CUDA at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lit_seqpack._imports import require
from lit_seqpack.model import _hf_dispatch
from lit_seqpack.model._hf_packed import ATTENTION_NAME, attention_extras, reject_unsupported
from lit_seqpack.model._padding import is_right_padded
from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.isolation import (
    PackingLeakError,
    PackingReport,
    check_packing_equivalence,
    documents_batch,
    probe_packing_isolation,
)

__all__ = [
    "ATTENTION_NAME",
    "PackingLeakError",  # re-exported from lit_seqpack.model.isolation, like the next four
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


# ------------------------------------------------------------------------------------------- transformers glue
def register_attention() -> str:
    """Register :func:`hf_varlen_attention` with transformers' attention and mask interfaces (idempotent); its name.

    The mask function registered under the same name builds the mask of each model's original implementation
    (none on a packed row).
    """
    transformers = require("transformers", purpose="prepare_hf_model")
    masking = require("transformers.masking_utils", purpose="prepare_hf_model")
    transformers.AttentionInterface.register(ATTENTION_NAME, hf_varlen_attention)
    masking.AttentionMaskInterface.register(ATTENTION_NAME, _hf_dispatch.original_mask)
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
        if mask.ndim == 2 and is_right_padded(mask):
            inputs[_hf_dispatch.RIGHT_PADDED_KWARG] = True
    return inputs


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
