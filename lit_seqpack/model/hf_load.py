"""Loading, adapting and exporting the transformers model inside :class:`~lit_seqpack.model.lm.HFCausalLM`.

- :func:`load_hf_model`: ``from_pretrained`` (or ``from_config``) with options, config overrides and an explicit
  weight dtype (float32 by default: transformers 5 would load a bf16 checkpoint as bf16 weights), in train mode.
- :func:`apply_peft`: PEFT adapters (LoRA by default) from a plain dict, so they can be set in YAML.
- :func:`attention_dropout_settings`: the config keys that set attention dropout, by architecture
  (``attn_pdrop`` for GPT-2, ``attention_dropout`` for Llama, ...).
- :func:`weight_dtype_warning`: a loud message when half-precision weights meet a precision that would update them
  in half precision without saying so.
- :func:`export_hf_model`: a ``save_pretrained`` folder with adapters merged and the stock attention restored,
  loadable by plain ``AutoModelForCausalLM.from_pretrained``.

transformers and peft are imported inside the functions.

How many token ids a model can embed, read from the model itself (its config or hyperparameters).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_seqpack._imports import require

__all__ = [
    "DTYPES",
    "apply_peft",
    "attention_dropout_settings",
    "export_hf_model",
    "load_hf_model",
    "weight_dtype_warning",
    "model_max_seq_len",
    "model_vocab_size",
]


def model_vocab_size(model: Any) -> int | None:
    """The number of token ids ``model`` can embed, or ``None`` when it does not say.

    Looked up, in order: the ``config.vocab_size`` of the wrapped network ``model.model`` (the reference decoder
    and transformers models both have one), then the hyperparameter ``vocab_size``, then the ``vocab_size`` of a
    ``config`` hyperparameter (:class:`~lit_seqpack.model.lm.HFCausalLM` built from a config dict).

    Example:
        >>> from types import SimpleNamespace
        >>> model_vocab_size(SimpleNamespace(hparams={"config": {"vocab_size": 64}}))
        64
        >>> model_vocab_size(SimpleNamespace()) is None
        True
    """
    inner_config = getattr(getattr(model, "model", None), "config", None)
    value = getattr(inner_config, "vocab_size", None)
    if value is None:  # a vision-language model: its text model's vocabulary
        value = getattr(getattr(inner_config, "text_config", None), "vocab_size", None)
    hparams = getattr(model, "hparams", None) or {}
    if value is None:
        value = hparams.get("vocab_size")
    if value is None and isinstance(hparams.get("config"), Mapping):
        value = hparams["config"].get("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
"""The accepted ``dtype`` values: a torch dtype name, or ``"auto"`` (the checkpoint's own dtype)."""

_RESERVED_KWARGS = {"dtype": "dtype", "torch_dtype": "dtype", "config": "config_overrides"}


def _torch_dtype(dtype: str) -> torch.dtype | str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_hf_model(
    *,
    model_name_or_path: str | None,
    config: Mapping[str, Any] | None,
    model_kwargs: Mapping[str, Any] | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> Any:
    """A transformers causal LM in train mode, from a checkpoint or a config dict.

    A config that ``AutoModelForCausalLM`` does not map but ``AutoModelForImageTextToText`` does (a vision-language
    model) is built by the latter.

    Args:
        model_name_or_path: a checkpoint for ``AutoModelForCausalLM.from_pretrained`` (a local path offline).
        config: instead, the keyword arguments of a config (with its ``model_type``, default ``"llama"``).
        model_kwargs: more ``from_pretrained`` / ``from_config`` keywords (``revision``, ``trust_remote_code``,
            ``attn_implementation``: the implementation restored on export, ...).
        config_overrides: config attributes set before the model is built (``{"attn_pdrop": 0.0}``, ...).
        dtype: the weights' dtype, ``"float32"`` (master weights for any Lightning precision), ``"bfloat16"``,
            ``"float16"`` or ``"auto"`` (the checkpoint's).
    """
    transformers = require("transformers", purpose="HFCausalLM")

    kwargs = dict(model_kwargs or {})
    for key, use in _RESERVED_KWARGS.items():
        if key in kwargs:
            raise ValueError(f"model_kwargs[{key!r}] is not accepted: set HFCausalLM's {use} instead")
    torch_dtype = _torch_dtype(dtype)
    hub = {k: kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token", "subfolder") if k in kwargs}
    if model_name_or_path is not None:
        model_config = transformers.AutoConfig.from_pretrained(model_name_or_path, **hub)
    else:
        settings = dict(config or {})
        model_config = transformers.AutoConfig.for_model(settings.pop("model_type", "llama"), **settings)
    for key, value in (config_overrides or {}).items():
        if not hasattr(model_config, key):
            raise ValueError(
                f"config_overrides[{key!r}]: {type(model_config).__name__} has no attribute {key!r} "
                "(a typo would otherwise be ignored silently)"
            )
        setattr(model_config, key, value)
    auto = _auto_class(transformers, model_config)
    if model_name_or_path is not None:
        model = auto.from_pretrained(model_name_or_path, config=model_config, dtype=torch_dtype, **kwargs)
    else:
        build = {k: v for k, v in kwargs.items() if k not in hub or k == "trust_remote_code"}
        model = auto.from_config(model_config, dtype=None if dtype == "auto" else torch_dtype, **build)
    return model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes


def _auto_class(transformers: Any, config: Any) -> Any:
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a config only the latter maps (Qwen2-VL,
    LLaVA, ...: a vision-language model whose causal LM is its text part)."""
    auto = require("transformers.models.auto.modeling_auto", purpose="HFCausalLM")
    if (
        type(config) not in auto.MODEL_FOR_CAUSAL_LM_MAPPING
        and type(config) in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    ):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def apply_peft(model: Any, peft_config: Mapping[str, Any]) -> Any:
    """``model`` with PEFT adapters: ``peft_config`` is a ``peft.get_peft_config`` dict, LoRA by default.

    ``{"r": 8, "target_modules": ["q_proj", "v_proj"]}`` gives LoRA; ``{"peft_type": "IA3", ...}`` another method.
    ``task_type`` defaults to ``"CAUSAL_LM"``. Only the adapters (and ``modules_to_save``) stay trainable.
    """
    peft = require("peft", purpose="peft_config")
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **peft_config}
    return peft.get_peft_model(model, peft.get_peft_config(settings)).train()


def attention_dropout_settings(model: torch.nn.Module) -> list[tuple[str, float]]:
    """``(config key, value)`` of every nonzero attention dropout of ``model``, named as its config names it.

    The value is read where the attention modules keep it (``attention_dropout``, or the ``p`` of an
    ``attn_dropout`` ``nn.Dropout``); the key is the config attribute with that value whose name says dropout,
    preferring names that say attention (GPT-2: ``attn_pdrop``, not ``resid_pdrop``).
    """
    values = set()
    for module in model.modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        value = getattr(module, "attention_dropout", None)
        layer = getattr(module, "attn_dropout", None)
        value = layer.p if isinstance(layer, torch.nn.Dropout) else value
        if isinstance(value, (int, float)) and value > 0:
            values.add(float(value))
    configs = [getattr(m, "config", None) for m in model.modules()]
    items = {k: v for c in configs if hasattr(c, "to_dict") for k, v in c.to_dict().items()}
    found = []
    for value in sorted(values):
        keys = [k for k, v in items.items() if "drop" in k and isinstance(v, (int, float)) and float(v) == value]
        named = [k for k in keys if "attn" in k or "attention" in k] or keys or ["attention_dropout"]
        found += [(key, value) for key in named]
    return found


def weight_dtype_warning(model: torch.nn.Module, precision: str) -> str | None:
    """A warning when trainable weights are half precision under a precision that would not say so, else ``None``.

    ``"bf16-true"`` / ``"16-true"`` are explicit choices; under ``"32-true"`` or a ``*-mixed`` precision the
    optimizer would silently update bf16/fp16 weights (no fp32 master copy).
    """
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    half = sorted(str(d).removeprefix("torch.") for d in dtypes if d in (torch.bfloat16, torch.float16))
    if not half or precision in ("bf16-true", "16-true", "bf16", "16"):
        return None
    return (
        f"HFCausalLM: trainable weights are {'/'.join(half)} but the Trainer runs precision={precision!r}: the "
        "optimizer updates half-precision weights without an fp32 master copy (updates smaller than the weights' "
        "resolution are lost). Load them as float32 (HFCausalLM(dtype='float32'), the default) for mixed "
        "precision, or choose precision='bf16-true' if half-precision weights are what you want."
    )


def export_hf_model(model: Any, path: str | Path, *, dtype: str | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder: adapters merged, stock attention restored, ``save_pretrained``.

    With adapters to merge or a ``dtype`` the written model is a copy (it needs the memory of one more model);
    otherwise the live model is switched to its original attention for the save and back afterwards.

    Args:
        model: a transformers model prepared by :func:`~lit_seqpack.model.hf.prepare_hf_model` (or one that keeps its
            own attention, see :class:`~lit_seqpack.model.hf.UnsupportedAttentionError`), or a PEFT model wrapping one.
        path: the output folder.
        dtype: the saved weights' dtype (default: as trained).
    """
    from lit_seqpack.model.hf import is_prepared, prepare_hf_model, restore_hf_attention

    copied = hasattr(model, "merge_and_unload") or dtype is not None
    target = copy.deepcopy(model) if copied else model
    if hasattr(target, "merge_and_unload"):
        target = target.merge_and_unload()
    if dtype is not None:
        target.to(_torch_dtype(dtype))
    prepared = is_prepared(target)
    if prepared:
        restore_hf_attention(target)
    try:
        target.save_pretrained(Path(path))
    finally:
        if prepared and not copied:
            prepare_hf_model(target)
    return Path(path)


def model_max_seq_len(model: Any) -> int | None:
    """The longest row ``model`` accepts, or ``None`` when it sets no limit.

    Read from the wrapped network's ``config.max_seq_len`` (the reference decoder), then the hyperparameter
    ``max_seq_len``. A transformers model sets none (its ``max_position_embeddings`` is no hard limit).

    Example:
        >>> from types import SimpleNamespace
        >>> model_max_seq_len(SimpleNamespace(hparams={"max_seq_len": 512}))
        512
    """
    value = getattr(getattr(getattr(model, "model", None), "config", None), "max_seq_len", None)
    if value is None:
        value = (getattr(model, "hparams", None) or {}).get("max_seq_len")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
