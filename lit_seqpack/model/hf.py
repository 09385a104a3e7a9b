"""Hugging Face causal LMs on packed rows: lit_seqpack's varlen attention inside a transformers model.

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
(see :mod:`lit_seqpack.model.hf`). Model code that branches on the implementation's *name* (e.g.
GPT-2's ``reorder_and_upcast_attn`` under ``"eager"``) sees lit_seqpack's name; :func:`restore_hf_attention` gives
back the stock model entirely (before ``save_pretrained`` or serving).

The isolation checks (:func:`~lit_seqpack.model.isolation.check_packing_equivalence`,
:func:`~lit_seqpack.model.isolation.probe_packing_isolation`, :class:`~lit_seqpack.model.isolation.PackingLeakError`,
:func:`~lit_seqpack.model.isolation.documents_batch`) live in :mod:`lit_seqpack.model.isolation` (and are exported by
:mod:`lit_seqpack.model`); :data:`ATTENTION_NAME` and :func:`hf_model_inputs` are defined in
:mod:`lit_seqpack.model._hf_packed`, which both this module and the isolation probe read.

transformers is imported only inside the functions that need it; nothing here touches CUDA at import time.

What a prepared transformers model does outside packed rows: exactly what its original attention does.

:func:`~lit_seqpack.model.hf.prepare_hf_model` switches every config to lit_seqpack's attention name; this module
keeps the original in reach, so that a call without packing metadata (cached decoding, left padding, ``generate()``,
a 4-D or 2-D ``attention_mask``) computes the stock function:

* the **mask**: lit_seqpack's name is registered in transformers' ``AttentionMaskInterface`` with
  :func:`original_mask`, which builds the mask the original implementation would get (``sdpa_mask``,
  ``eager_mask``, ``flash_attention_mask``, ...), or none on a packed call (the varlen kernel needs none);
* the **attention**: :func:`delegate` calls the original's function (transformers' ``ALL_ATTENTION_FUNCTIONS``
  entry, or the model's own ``eager_attention_forward``) with the same arguments;
* a **forward pre-hook** on every sub-model (:func:`install_hooks`) tells the mask function which kind of call is
  running: a packed row (``cu_seq_lens_q`` present) or a right-padded training batch (see
  :func:`~lit_seqpack.model.hf.hf_model_inputs`), whose padding needs no mask under causality.

:func:`~lit_seqpack.model.hf.prepare_hf_model` records, for every config of the model (the top-level one, those of
its sub-models and their ``sub_configs``), the ``_attn_implementation`` it had, in an :class:`AttentionRecord` kept
on the model. :func:`original_implementation` reads it back for one config (what a call without packing metadata
delegates to) and :func:`restore` puts every config back. The record re-registers itself when the model is
unpickled or deep-copied (``ddp_spawn``, ``torch.save`` of a whole model, ``copy.deepcopy``).

Configs are looked up by identity (they are not hashable); an entry dies with its config.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lit_seqpack._imports import require
from lit_seqpack.model._hf_packed import (
    ATTENTION_NAME,
    BACKEND_KWARG,
    RIGHT_PADDED_KWARG,
    attention_extras,
    hf_model_inputs,
    reject_unsupported,
)
from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.isolation import PackingLeakError

__all__ = [
    "ATTENTION_NAME",
    "UnsupportedAttentionError",
    "hf_model_inputs",
    "hf_varlen_attention",
    "prepare_hf_model",
    "register_attention",
    "restore_hf_attention",
]


RECORD_ATTR = "_lit_seqpack_attention_record"
"""The attribute of the top-level model that holds its :class:`AttentionRecord`."""

_ORIGINALS: dict[int, tuple[weakref.ref[Any], str | None]] = {}
# the kind of each model call in progress, innermost last. A plain list (not a ContextVar, which torch.compile
# cannot trace): calls nest on one thread; concurrent forwards of one model from several threads are not supported.
_CALLS: list[str | None] = []


class AttentionRecord:
    """The attention implementation of each config of a model, before lit_seqpack switched it.

    Args:
        entries: ``(config, implementation)`` pairs, one per distinct config object.
    """

    def __init__(self, entries: list[tuple[Any, str | None]]) -> None:
        self.entries = entries
        self.register()

    def register(self) -> None:
        """Make :func:`original_implementation` answer for this record's configs."""
        for config, implementation in self.entries:
            key = id(config)
            _ORIGINALS[key] = (weakref.ref(config, lambda _, key=key: _ORIGINALS.pop(key, None)), implementation)

    def unregister(self) -> None:
        """Forget this record's configs."""
        for config, _ in self.entries:
            entry = _ORIGINALS.get(id(config))
            if entry is not None and entry[0]() is config:
                del _ORIGINALS[id(config)]

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.entries = state["entries"]
        self.register()


def model_configs(model: Any) -> list[Any]:
    """Every distinct config object of ``model``: its sub-models' configs and, recursively, their sub-configs."""
    pretrained = require("transformers", purpose="a transformers model").PreTrainedModel
    found: dict[int, Any] = {}
    stack = [m.config for m in model.modules() if isinstance(m, pretrained)]
    while stack:
        config = stack.pop(0)
        if id(config) in found:
            continue
        found[id(config)] = config
        stack += [sub for key in getattr(config, "sub_configs", {}) if (sub := getattr(config, key, None)) is not None]
    return list(found.values())


def record(model: Any) -> AttentionRecord:
    """The model's :class:`AttentionRecord`, created (from its current implementations) on the first call."""
    existing = getattr(model, RECORD_ATTR, None)
    if existing is not None:
        return existing
    entries = [(config, config._attn_implementation) for config in model_configs(model)]
    new = AttentionRecord(entries)
    object.__setattr__(model, RECORD_ATTR, new)  # a plain attribute: not a submodule, not in the state dict
    return new


def is_prepared(model: Any) -> bool:
    """Whether ``model`` was switched to lit_seqpack's attention (and not restored since)."""
    return getattr(model, RECORD_ATTR, None) is not None


def original_implementation(config: Any) -> str | None:
    """The implementation ``config`` had before lit_seqpack switched it.

    Raises:
        LookupError: ``config`` belongs to no model prepared in this process.
    """
    entry = _ORIGINALS.get(id(config))
    if entry is None or entry[0]() is not config:
        raise LookupError(
            f"{type(config).__name__} is set to lit_seqpack's attention but its model was not prepared in this "
            "process, so its original attention implementation is unknown; call "
            "lit_seqpack.model.hf.prepare_hf_model(model) on the loaded model"
        )
    return entry[1]


def restore(model: Any) -> Any:
    """Put every config of ``model`` back on its recorded implementation and drop the record; returns ``model``.

    Raises:
        ValueError: ``model`` was never prepared.
    """
    existing = getattr(model, RECORD_ATTR, None)
    if existing is None:
        raise ValueError(
            f"{type(model).__name__} was not prepared by lit_seqpack.model.hf.prepare_hf_model: nothing to restore"
        )
    for config, implementation in existing.entries:
        config._attn_implementation_internal = implementation
    existing.unregister()
    object.__delattr__(model, RECORD_ATTR)
    remove_hooks(model)
    return model


# ------------------------------------------------------------------------------------------------ call kind
_MULTIMODAL_KWARGS = ("pixel_values", "pixel_values_videos", "input_features", "token_type_ids", "mm_token_type_ids")
"""Inputs whose attention pattern (bidirectional image blocks, ...) lives only in the mask that packed rows skip."""


def _check_packed_call(module: Any, kwargs: dict[str, Any]) -> None:
    """Refuse the packed-call inputs that would silently compute another function than per-document runs."""
    name = type(module).__name__
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            f"{name} got an attention_mask with cu_seq_lens_q: on a packed row cu_seq_lens mark the documents and "
            "no mask is applied; drop the attention_mask (padding belongs in its own segment)"
        )
    if kwargs.get("position_ids") is None:
        raise ValueError(
            f"{name} got cu_seq_lens_q without position_ids: positions would run across the documents of the row; "
            "pass position_ids restarting at 0 for every document (lit_seqpack.model.hf.hf_model_inputs does)"
        )
    given = [key for key in _MULTIMODAL_KWARGS if kwargs.get(key) is not None]
    if given:
        raise ValueError(
            f"{name} got {', '.join(given)} on a packed row: the packing keywords would reach its vision tower and "
            "their attention pattern (e.g. bidirectional image tokens) lives in a mask that packed rows do not "
            "build; train image rows through HFCausalLM (lit_seqpack.model.vlm.multimodal_inputs runs the vision "
            "tower per image and gives each conversation its own positions), or with mode: dynamic"
        )


def _pre_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("cu_seq_lens_q") is not None:
        _check_packed_call(module, kwargs)
        kind = "packed"
    elif kwargs.get(RIGHT_PADDED_KWARG):
        kind = "right_padded"
    else:
        kind = None
    _CALLS.append(kind)


def _post_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    if _CALLS:
        _CALLS.pop()


def install_hooks(model: Any) -> None:
    """Register the call-kind hooks on every sub-model of ``model`` (once)."""
    pretrained = require("transformers", purpose="a transformers model").PreTrainedModel
    for module in model.modules():
        if isinstance(module, pretrained) and _pre_hook not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)


def remove_hooks(model: Any) -> None:
    """Remove the hooks of :func:`install_hooks`."""
    for module in model.modules():
        for hooks, hook in ((module._forward_pre_hooks, _pre_hook), (module._forward_hooks, _post_hook)):
            for key in [key for key, value in hooks.items() if value is hook]:
                del hooks[key]
                for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                    getattr(module, extra).pop(key, None)
                module._forward_hooks_always_called.pop(key, None)


# ------------------------------------------------------------------------------------------------ delegation
def original_mask(**kwargs: Any) -> Any:
    """transformers mask function for lit_seqpack's name: the original implementation's mask.

    A packed call gets no mask (the varlen kernel reads ``cu_seq_lens``). A right-padded training batch gets the
    original's mask without its padding part (``sdpa`` then skips the mask and runs causal): exact for every real
    token, because under causality a real query never sees a right-padding key, and padded positions carry no loss.
    """
    kind = _CALLS[-1] if _CALLS else None
    if kind == "packed":
        if kwargs.get("use_vmap"):  # an or/and overlay (create_*_mask(or_mask_function=...)) the kernel would drop
            raise ValueError(
                f"{type(kwargs['config']).__name__}: the model overlays its own pattern on the causal mask "
                "(or_mask_function / and_mask_function), which varlen attention on a packed row cannot honour; "
                "train this model with mode: dynamic"
            )
        return None
    masks = require("transformers.masking_utils", purpose="a transformers model").ALL_MASK_ATTENTION_FUNCTIONS
    mask_function = masks._global_mapping.get(original_implementation(kwargs["config"]))
    if mask_function is None or mask_function is original_mask:  # the stock model builds no mask either
        return None
    if kind == "right_padded" and _causal_without_offsets(kwargs):
        kwargs["attention_mask"] = None
    return mask_function(**kwargs)


def _causal_without_offsets(kwargs: dict[str, Any]) -> bool:
    """Whether a mask call builds a causal mask (or a sub-pattern of one: window, chunks) over a fresh row.

    Bidirectional masks (``allow_is_bidirectional_skip``) and user overlays (``or_mask_function`` sets
    ``use_vmap``) may let a query see later keys, so their padding must stay.
    """
    no_offset = kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
    causal = getattr(kwargs["config"], "is_causal", True) and "allow_is_bidirectional_skip" not in kwargs
    return no_offset and causal and not kwargs.get("use_vmap", False) and kwargs["q_length"] == kwargs["kv_length"]


@functools.cache
def _eager_function(module_type: type) -> Callable[..., Any] | None:
    return getattr(sys.modules.get(module_type.__module__), "eager_attention_forward", None)


def delegate(module: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``module``'s original attention function with the arguments lit_seqpack's function received.

    Raises:
        PackingLeakError: a causal layer is called without ``cu_seq_lens_q`` inside a packed call: something
            between the model and this layer dropped the boundary keywords, and its documents would see each other.
    """
    functions = require("transformers.modeling_utils", purpose="a transformers model").ALL_ATTENTION_FUNCTIONS

    if _CALLS and _CALLS[-1] == "packed" and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise PackingLeakError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was called without cu_seq_lens_q "
            "in a packed forward: a module between the model and its attention (typically a decoder layer that "
            "does not pass **kwargs on) drops the packing keywords, so its documents would attend to each other. "
            "Train this model with mode: dynamic"
        )

    implementation = original_implementation(module.config)
    eager = _eager_function(type(module))
    if implementation in (None, "eager") and eager is None:
        raise NotImplementedError(
            f"{type(module).__name__} ran eager attention before lit_seqpack switched it, but its module "
            f"{type(module).__module__} has no eager_attention_forward to delegate to; call "
            "lit_seqpack.model.hf.restore_hf_attention(model) before using it outside packed rows"
        )
    return functions.get_interface(implementation, eager)(module, *args, **kwargs)


class UnsupportedAttentionError(ValueError):
    """A transformers model whose attention cannot be switched: it does not dispatch through ``AttentionInterface``.

    Such a model (Falcon, and other architectures with their own attention classes) cannot be given the packed
    boundaries, so packing is refused; :class:`~lit_seqpack.model.lm.HFCausalLM` keeps its own attention and trains
    it in ``mode: dynamic`` or ``padded``, where every row holds one document.
    """


# ------------------------------------------------------------------------------------------- transformers glue
def register_attention() -> str:
    """Register :func:`hf_varlen_attention` with transformers' attention and mask interfaces (idempotent); its name.

    The mask function registered under the same name builds the mask of each model's original implementation
    (none on a packed row).
    """
    transformers = require("transformers", purpose="prepare_hf_model")
    masking = require("transformers.masking_utils", purpose="prepare_hf_model")
    transformers.AttentionInterface.register(ATTENTION_NAME, hf_varlen_attention)
    masking.AttentionMaskInterface.register(ATTENTION_NAME, original_mask)
    return ATTENTION_NAME


def prepare_hf_model(model: Any) -> Any:
    """Switch a transformers model (and its sub-models) to lit_seqpack's varlen attention; returns ``model``.

    The implementation every config had before (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ... for the
    model and each sub-model) is recorded on the model, so :func:`restore_hf_attention` can switch it back exactly.
    Preparing a prepared model again keeps the first record.

    Raises:
        UnsupportedAttentionError: the model does not dispatch attention through transformers'
            ``AttentionInterface`` (Falcon, ...); it is left as it was.
    """
    record(model)
    model.set_attn_implementation(register_attention())
    install_hooks(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        restore(model)
        raise UnsupportedAttentionError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface (its "
            f"attn_implementation stayed {model.config._attn_implementation!r}), so its attention cannot be given "
            "the packed boundaries and packing is refused for it; train it with mode: dynamic (or padded), where "
            "every row holds one document (HFCausalLM keeps the model's own attention for those modes)"
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
    return restore(model)


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
    backend = kwargs.pop(BACKEND_KWARG, "auto")
    kwargs.pop(RIGHT_PADDED_KWARG, None)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return delegate(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
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
