"""The packed-row contract between lit_seqpack and a transformers model: names, inputs, and what a call may carry.

Both sides read this module (the glue in :mod:`lit_seqpack.model.hf` and :mod:`lit_seqpack.model.hf`, and
the isolation probe in :mod:`lit_seqpack.model.isolation`), so it imports neither of them:

- :data:`ATTENTION_NAME`, :data:`BACKEND_KWARG`, :data:`RIGHT_PADDED_KWARG`: the names lit_seqpack registers with
  transformers and the keywords it passes through the model to its attention function and mask function;
- :func:`hf_model_inputs`: the batch contract mapped to a prepared model's keywords (re-exported by
  :mod:`lit_seqpack.model.hf`, its public home);
- :func:`attention_extras` turns transformers' ``sliding_window`` / ``softcap`` / ``s_aux`` keywords into
  :func:`~lit_seqpack.model.attention.varlen_attention`'s ``window`` / ``softcap`` / ``sinks``;
  :func:`reject_unsupported` raises, naming the setting, for everything a packed row cannot honour (attention
  dropout, a mask or bias the model built itself, keywords without a varlen mapping, non-causal layers);
- :func:`refuse_packing_without_interface`: a model that keeps its own attention (Falcon, ...: no
  ``AttentionInterface``) trains in dynamic and padded mode only;
- :func:`missing_kernel_error`: transformers' refusal of a packed row for a missing kernel package
  (flash-linear-attention for Qwen3-Next / Qwen3.5, mamba-ssm, ...) in lit_seqpack's words: the mode that is exact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from lit_seqpack._checks import check_int
from lit_seqpack.batch import is_right_padded

ATTENTION_NAME = "lit_seqpack_varlen"
"""The name of lit_seqpack's attention function in transformers' ``AttentionInterface``."""

BACKEND_KWARG = "lit_seqpack_backend"
"""The keyword that carries the :func:`~lit_seqpack.model.attention.varlen_attention` backend to the attention."""

RIGHT_PADDED_KWARG = "lit_seqpack_right_padded"
"""The keyword :func:`hf_model_inputs` sets on a batch whose padding is only on the right."""

_MISSING_KERNEL = re.compile(r"`(?P<function>[\w.]+)` can't keep packed sequences apart without `(?P<package>[\w.-]+)`")
"""transformers' refusal (``integrations/hub_kernels.py``) when a layer's packed path needs a kernel package."""

_REFUSED_KWARGS = ("position_bias", "sinks", "indices", "block_indices")
"""Attention-function keywords of some transformers models that change the result and have no varlen mapping."""


def hf_model_inputs(batch: Mapping[str, Any], *, backend: str = "auto") -> dict[str, Any]:
    """Keyword arguments for a model prepared by :func:`~lit_seqpack.model.hf.prepare_hf_model`, from a contract batch.

    A padded batch passes the standard ``attention_mask`` (models that read it for more than attention get it);
    when every row's padding is on the right it also passes ``lit_seqpack_right_padded=True``, so the mask is built
    without the padding (plain causal SDPA, exact for every real token; see :mod:`lit_seqpack.model.hf`).

    Args:
        batch: a packed row (with ``cu_seqlens``) or a padded ``[B, L]`` batch (with ``attention_mask``).
        backend: the :func:`~lit_seqpack.model.attention.varlen_attention` backend for packed rows.
    """
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, BACKEND_KWARG: backend}
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
            inputs[RIGHT_PADDED_KWARG] = True
    return inputs


def attention_extras(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``window``/``softcap``/``sinks`` of :func:`varlen_attention` from transformers' keywords.

    ``sliding_window=W`` (a query sees the ``W`` latest keys, itself included: ``sliding_window_overlay`` builds
    ``kv_idx > q_idx - W``) is ``window=(W - 1, 0)``; ``softcap`` is passed on; ``s_aux`` (GPT-OSS sinks) becomes
    ``sinks``. A layer that the config declares sliding but that passes no ``sliding_window`` (its window would live
    in the mask only, which packed rows do not build) raises, as does a window that differs from the config's.
    """
    sliding_window, expected = kwargs.get("sliding_window"), configured_window(module)
    if expected is not None and sliding_window != expected:
        name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        raise ValueError(
            f"{name} is a sliding-window layer (config sliding_window={expected}) but passes "
            f"sliding_window={sliding_window!r} to its attention function; its stock mask uses the config's window, "
            "so a packed row would compute another function: train this model with mode: dynamic"
        )
    extras: dict[str, Any] = {}
    if sliding_window is not None:
        window = check_int(f"{type(module).__name__}: sliding_window", sliding_window, minimum=1)
        extras["window"] = (window - 1, 0)
    if kwargs.get("softcap") is not None:
        extras["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        extras["sinks"] = kwargs["s_aux"]
    return extras


def configured_window(module: torch.nn.Module) -> int | None:
    """The window the config gives ``module``'s layer (``None``: full attention).

    With ``layer_types`` a ``"sliding_attention"`` layer has ``config.sliding_window`` and a ``"full_attention"``
    layer none; any other type (chunked attention, ...) is refused on packed rows. Without ``layer_types``, the
    config's ``sliding_window`` (unless ``use_sliding_window`` is false) applies to every layer (Mistral).
    """
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and isinstance(index, int) and index < len(layer_types):
        kind = layer_types[index]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"{type(module).__name__} layer {index} is a {kind!r} layer, which {ATTENTION_NAME!r} cannot "
                "compute on a packed row; train this model with mode: dynamic"
            )
        return window if kind == "sliding_attention" else None
    if layer_types or not getattr(config, "use_sliding_window", True):
        return None
    return window if isinstance(window, int) else None


def reject_unsupported(
    module: torch.nn.Module, attention_mask: torch.Tensor | None, dropout: float, kwargs: Mapping[str, Any]
) -> None:
    name = type(module).__name__
    if dropout > 0.0:
        raise ValueError(
            f"attention dropout is not supported on packed rows by {ATTENTION_NAME!r}, got {dropout} ({name}); "
            "set the model's attention dropout to 0"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{name} passes its own attention mask or bias on a packed row ({ATTENTION_NAME!r} builds none there), "
            "which varlen attention cannot honour; train this model with mode: dynamic"
        )
    for key in _REFUSED_KWARGS:
        if kwargs.get(key) is not None:
            raise ValueError(
                f"{name} passes {key}= to its attention function, which {ATTENTION_NAME!r} cannot honour on a packed "
                "row; train this model with mode: dynamic"
            )
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"{ATTENTION_NAME!r} supports causal attention only ({name} is not causal)")


def missing_kernel_error(model: Any, error: BaseException) -> ValueError | None:
    """lit_seqpack's refusal for ``error`` when it is transformers' "install <kernel> to train on packed sequences".

    Some layers (gated delta rule, Mamba scans, ...) keep packed documents apart only through a kernel package that
    takes the boundaries (``cu_seqlens`` / ``seq_idx``); without it transformers refuses the packed row. Padded rows
    hold one document each and need no boundary, so ``mode: dynamic`` (or ``padded``) is exact for such a model.
    Returns ``None`` for any other error.
    """
    found = _MISSING_KERNEL.search(str(error))
    if found is None:
        return None
    function, package = found["function"], found["package"]
    return ValueError(
        f"{type(model).__name__} cannot be trained with mode: packing here: its layers' {function} needs the "
        f"{package!r} kernel package (not installed) to keep the documents of a packed row apart, and transformers "
        "refuses the packed row without it. Train it with mode: dynamic (or padded), where every row holds one "
        f"document: that is exact for this model without the kernel; or install {package} (GPU kernels) "
        "to pack it, and the isolation probe checks it on the first packed batch"
    )


def unwrapped_model(model: Any) -> Any:
    """The transformers model inside PEFT's wrappers (``get_base_model``), or ``model`` itself."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def uses_varlen_attention(model: Any) -> bool:
    """Whether ``model`` (PEFT-wrapped or not) runs lit_seqpack's attention, i.e. can run packed rows."""
    return getattr(getattr(unwrapped_model(model), "config", None), "_attn_implementation", None) == ATTENTION_NAME


def refuse_packing_without_interface(model: Any, batch: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a packed ``batch`` when ``model`` keeps its own attention (no AttentionInterface)."""
    if batch.get("cu_seqlens") is None or uses_varlen_attention(model):
        return
    inner = unwrapped_model(model)
    if getattr(inner, "_lit_seqpack_attention_record", None) is not None:  # prepared (RECORD_ATTR), then switched
        now = getattr(getattr(inner, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"{type(inner).__name__}: the model's config was changed to {now!r} after it was prepared; build other "
            "models from a copy of the config (e.g. AutoModelForCausalLM.from_config(copy.deepcopy(model.config)) "
            "for a reference model: from_config(config) sets that config object's attention implementation, which "
            "this model shares)"
        )
    raise ValueError(
        f"{type(unwrapped_model(model)).__name__} cannot be trained with mode: packing: it does not dispatch "
        "attention through transformers' AttentionInterface, so lit_seqpack cannot give its attention the packed "
        "boundaries and its documents would attend to each other. Train it with mode: dynamic (or padded), where "
        "every row holds one document: that is exact for this model with its own attention"
    )
