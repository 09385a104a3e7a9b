"""Hugging Face causal LMs on packed rows, and a check that packed outputs equal per-document outputs.

A stock transformers model given a packed row with only ``position_ids`` is *not* safe: with the default
``use_cache=True`` it builds a cache, skips its packed-sequence detection and attends across documents (a tiny
random ``LlamaForCausalLM`` is off by 0.2 to 1.4 in the logits). This module registers a varlen attention
function with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`; :func:`prepare_hf_model`
switches a model to it and :func:`hf_model_inputs` maps the batch contract to the model's keywords::

    packed row     input_ids, position_ids, cu_seq_lens_q = cu_seq_lens_k = cu_seqlens,
                   max_length_q = max_length_k = max_seqlen, use_cache=False          -> varlen_attention
    padded [B, L]  input_ids, position_ids, lit_seqpack_padding_mask = attention_mask, use_cache=False
                                                                                      -> SDPA, causal + padding

:func:`check_packing_equivalence`, :func:`probe_packing_isolation` (the structural leak guard that
:class:`~lit_seqpack.model.mixin.PackedSequenceMixin` runs once), :class:`PackingLeakError` and
:func:`documents_batch` live in :mod:`lit_seqpack.model.isolation` and are re-exported here.

transformers is imported only inside the functions that need it; nothing here touches CUDA at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lit_seqpack.model import _hf_dispatch
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

ATTENTION_NAME = "lit_seqpack_varlen"
"""The name of lit_seqpack's attention function in transformers' ``AttentionInterface``."""


# ------------------------------------------------------------------------------------------- transformers glue
def register_attention() -> str:
    """Register :func:`hf_varlen_attention` with transformers' ``AttentionInterface`` (idempotent); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_varlen_attention)
    return ATTENTION_NAME


def prepare_hf_model(model: Any) -> Any:
    """Switch a transformers model (and its sub-models) to lit_seqpack's varlen attention; returns ``model``.

    The implementation every config had before (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ... for the
    model and each sub-model) is recorded on the model, so :func:`restore_hf_attention` can switch it back exactly.
    Preparing a prepared model again keeps the first record.
    """
    _hf_dispatch.record(model)
    model.set_attn_implementation(register_attention())
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
        inputs["lit_seqpack_padding_mask"] = batch["attention_mask"]
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
) -> tuple[torch.Tensor, None]:
    """transformers attention function: varlen attention with ``cu_seq_lens_q``, causal SDPA otherwise.

    ``query`` is ``[B, heads, T, head_dim]`` and ``key``/``value`` ``[B, kv_heads, T, head_dim]``; returns
    ``([B, T, heads, head_dim], None)``. Anything this function cannot honour raises rather than being ignored.
    """
    _reject_unsupported(module, dropout, kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
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
            int(kwargs["max_length_q"]),
            causal=True,
            softmax_scale=scaling,
            backend=kwargs.get("lit_seqpack_backend", "auto"),
        )
        return out.unsqueeze(0), None
    mask = _dense_mask(attention_mask, kwargs.get("lit_seqpack_padding_mask"), query.shape[2], key.shape[2])
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _reject_unsupported(module: torch.nn.Module, dropout: float, kwargs: Mapping[str, Any]) -> None:
    if dropout > 0.0:
        raise ValueError(
            f"attention dropout is not supported by {ATTENTION_NAME!r}, got {dropout}; set attention_dropout=0"
        )
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{ATTENTION_NAME!r} does not support {name}={kwargs[name]!r} ({type(module).__name__})")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"{ATTENTION_NAME!r} supports causal attention only ({type(module).__name__} is not causal)")


def _dense_mask(
    attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None, q_len: int, kv_len: int
) -> torch.Tensor | None:
    """The SDPA mask of a padded batch: a prepared 4-D mask as is, else causal and key padding (``None``: causal)."""
    if attention_mask is not None and attention_mask.ndim == 4:
        return attention_mask
    if padding_mask is None:
        return None
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=padding_mask.device).tril()
    keys = padding_mask.bool()[:, None, None, :]
    # a query always sees itself, so a padding row never softmaxes over nothing (no NaN)
    return (causal & keys) | torch.eye(q_len, kv_len, dtype=torch.bool, device=padding_mask.device)
