"""Ready-made LightningModules: the reference decoder and any transformers causal LM, trained packed.

Both are ``PackedSequenceMixin`` + ``LightningModule`` with keyword-only typed ``__init__`` (so LightningCLI can
build them from YAML), ``save_hyperparameters`` and AdamW with an optional linear warmup and cosine decay::

    model = ReferenceLM(vocab_size=32000, n_layer=12, n_head=12, n_kv_head=4, n_embd=768, lr=3e-4)
    model = HFCausalLM(model_name_or_path="/models/llama-1b")                        # a local checkpoint
    model = HFCausalLM(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32, ...})  # random init
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

from lit_seqpack._checks import check_choice, check_int
from lit_seqpack._imports import require
from lit_seqpack.model._hf_packed import (
    BACKEND_KWARG,
    RIGHT_PADDED_KWARG,
    missing_kernel_error,
    refuse_packing_without_interface,
    unwrapped_model,
    uses_varlen_attention,
)
from lit_seqpack.model.hf import UnsupportedAttentionError, hf_model_inputs, prepare_hf_model, register_attention
from lit_seqpack.model.hf_load import (
    apply_peft,
    attention_dropout_settings,
    export_hf_model,
    load_hf_model,
    weight_dtype_warning,
)
from lit_seqpack.model.mixin import _VERIFIED, PackedSequenceMixin
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder

__all__ = ["HFCausalLM", "ReferenceLM", "warmup_cosine"]

Schedule = Literal["constant", "cosine"]
WeightDtype = Literal["float32", "bfloat16", "float16", "auto"]


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup over ``warmup_steps``, then cosine down to ``min_lr_ratio``.

    ``total_steps=None`` keeps the multiplier at 1 after the warmup.

    Example:
        >>> [round(warmup_cosine(s, warmup_steps=2, total_steps=6, min_lr_ratio=0.0), 2) for s in range(7)]
        [0.5, 1.0, 1.0, 0.85, 0.5, 0.15, 0.0]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None or total_steps <= warmup_steps:
        return 1.0
    progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_optim(lr: float, weight_decay: float, warmup_steps: int, min_lr_ratio: float, schedule: str) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    check_int("warmup_steps", warmup_steps, minimum=0)
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    check_choice("lr_schedule", schedule, ("constant", "cosine"))


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    """A parameter's name without the prefixes FSDP1, activation checkpointing and ``torch.compile`` insert.

    Example:
        >>> _clean_name("model.layers.0._fsdp_wrapped_module.attn.q_proj.weight")
        'model.layers.0.attn.q_proj.weight'
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _flattening_strategy(module: Any) -> str | None:
    """The strategy's name if ``configure_optimizers`` sees flat or partitioned parameters (FSDP1, DeepSpeed)."""
    owner = getattr(module, "_trainer", None) or getattr(module, "_fabric", None)
    strategy = getattr(owner, "strategy", None)
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    flat = isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, FabricFSDP, FabricDeepSpeed))
    return type(strategy).__name__ if flat else None


class _OptimizerMixin:
    """AdamW (no decay on biases and norms) with warmup and cosine decay, read from ``self.hparams``.

    The decay group holds the parameters that are at least 2-D *before* any sharding: FSDP1 (``FSDPStrategy``) and
    DeepSpeed ZeRO-3 show ``configure_optimizers`` flat 1-D shards, so the unsharded dimensions are recorded in
    ``setup`` (which Lightning calls before the strategy wraps the model) and looked up by parameter name. FSDP2
    (``ModelParallelStrategy``) parameters are DTensors, whose ``ndim`` is the full tensor's.
    """

    def setup(self, stage: str) -> None:
        """Record every parameter's unsharded ``ndim`` (override with ``super().setup(stage)``)."""
        super().setup(stage)  # type: ignore[misc]
        named = self.named_parameters()  # type: ignore[attr-defined]
        self._seqpack_param_ndims = {_clean_name(name): p.ndim for name, p in named}

    def _decays(self, name: str, param: torch.Tensor) -> bool:
        recorded = getattr(self, "_seqpack_param_ndims", {}).get(_clean_name(name))
        if recorded is not None:
            return recorded >= 2
        flattening = _flattening_strategy(self)
        if flattening is not None and not _is_dtensor(param):
            raise ValueError(
                f"configure_optimizers under {flattening} sees parameter {name!r} flattened (shape "
                f"{tuple(param.shape)}), so its weight-decay group cannot be read from its shape, and no unsharded "
                "shape was recorded for it: the shapes are recorded in setup(); call super().setup(stage) in an "
                "override, and create parameters before setup (not in configure_model)"
            )
        return param.ndim >= 2

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp = self.hparams  # type: ignore[attr-defined]
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]  # type: ignore[attr-defined]
        decays = [self._decays(name, p) for name, p in named]
        groups = [
            {"params": [p for (_, p), d in zip(named, decays, strict=True) if d], "weight_decay": hp.weight_decay},
            {"params": [p for (_, p), d in zip(named, decays, strict=True) if not d], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=(0.9, 0.95))
        total = None
        if hp.lr_schedule == "cosine":
            estimate = self.trainer.estimated_stepping_batches  # type: ignore[attr-defined]
            total = int(estimate) if math.isfinite(estimate) and estimate > 0 else None
        kwargs = {"warmup_steps": hp.warmup_steps, "total_steps": total, "min_lr_ratio": hp.min_lr_ratio}
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, **kwargs))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


class ReferenceLM(PackedSequenceMixin, _OptimizerMixin, LightningModule):
    """The reference Llama-style decoder, trained packed or dynamically batched with the exact loss.

    The defaults are the ``demo`` size of :data:`~lit_seqpack.model.reference.REFERENCE_PRESETS`.

    Args:
        vocab_size: vocabulary size.
        n_layer: decoder blocks.
        n_head: query heads.
        n_kv_head: key/value heads (grouped-query attention when fewer than ``n_head``).
        n_embd: model width.
        intermediate_size: hidden width of the SwiGLU MLP.
        rope_theta: RoPE base.
        max_seq_len: the longest row the model accepts.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the input embedding with the output projection.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not applied to biases and norm weights).
        warmup_steps: linear warmup optimizer steps.
        lr_schedule: ``"cosine"`` (decay to ``min_lr_ratio * lr`` over the run) or ``"constant"``.
        min_lr_ratio: the final learning rate as a fraction of ``lr``.
        attn_backend: :func:`~lit_seqpack.model.attention.varlen_attention` backend (``"auto"``, ``"flash_attn"``,
            ``"torch_varlen"``, ``"sdpa"``, ``"flex"``).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 512,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_embd: int = 128,
        intermediate_size: int = 352,
        rope_theta: float = 10000.0,
        max_seq_len: int = 4096,
        norm_eps: float = 1e-5,
        tie_embeddings: bool = True,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        lr_schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.1,
        attn_backend: str = "auto",
    ) -> None:
        super().__init__()
        _check_optim(lr, weight_decay, warmup_steps, min_lr_ratio, lr_schedule)
        self.save_hyperparameters()
        config = ReferenceConfig(
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv_head,
            n_embd=n_embd,
            intermediate_size=intermediate_size,
            rope_theta=rope_theta,
            max_seq_len=max_seq_len,
            norm_eps=norm_eps,
            tie_embeddings=tie_embeddings,
        )
        self.model = ReferenceDecoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]``: a packed row with ``cu_seqlens``, or ``[B, L]`` with ``attention_mask``."""
        return self.model(
            input_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            attention_mask=attention_mask,
            attn_backend=self.hparams.attn_backend,
        )


class HFCausalLM(PackedSequenceMixin, _OptimizerMixin, LightningModule):
    """A transformers causal LM trained packed through lit_seqpack's varlen attention (no download here).

    The model is in train mode after loading (``from_pretrained`` returns eval mode, and Lightning keeps
    submodule modes, so dropout would silently stay off). Its weights are float32 unless ``dtype`` says otherwise
    (transformers 5 loads a checkpoint in its own dtype; float32 master weights suit every Lightning precision);
    half-precision weights under a precision that would update them silently (``32-true``, ``*-mixed``) get a
    loud warning at ``fit``. In YAML::

        model:
          class_path: lit_seqpack.HFCausalLM
          init_args:
            model_name_or_path: /models/llama-1b
            model_kwargs: {revision: main}                  # more from_pretrained keywords
            config_overrides: {attention_dropout: 0.0}      # config attributes set before building
            peft_config: {r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}   # LoRA (pip install peft)

    A model that does not dispatch attention through transformers' ``AttentionInterface`` (Falcon, ...) keeps its
    own attention and trains with ``mode: dynamic`` or ``padded``; packed batches are refused for it, as they are for
    a model whose layers need a kernel package that is not installed to keep packed documents apart (Qwen3-Next and
    Qwen3.5 without flash-linear-attention), naming ``mode: dynamic``.

    :meth:`export_hf` (and ``lit-seqpack export``) writes the trained model as a Hugging Face folder with the
    adapters merged and the stock attention restored.

    Args:
        model_name_or_path: a checkpoint for ``AutoModelForCausalLM.from_pretrained`` (a local path offline).
        config: instead, the keyword arguments of a config for a randomly initialised model, with its
            ``model_type`` (default ``"llama"``), e.g. ``{"vocab_size": 64, "hidden_size": 32, ...}``.
        model_kwargs: more ``from_pretrained`` / ``from_config`` keywords (``revision``, ``trust_remote_code``,
            ``attn_implementation``: the implementation restored on export, ...); not ``dtype``, use ``dtype``.
        config_overrides: config attributes set before the model is built; an unknown name raises.
        dtype: the weights' dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the checkpoint's).
        peft_config: PEFT adapters, a ``peft.get_peft_config`` dict (``peft_type`` defaults to ``"LORA"``,
            ``task_type`` to ``"CAUSAL_LM"``); only the adapters train.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not applied to biases and norm weights).
        warmup_steps: linear warmup optimizer steps.
        lr_schedule: ``"cosine"`` or ``"constant"``.
        min_lr_ratio: the final learning rate as a fraction of ``lr``.
        attn_backend: :func:`~lit_seqpack.model.attention.varlen_attention` backend for packed rows.
        gradient_checkpointing: recompute activations in backward (transformers' gradient checkpointing).
        vocab_size: the token ids the data needs (the CLI links it to ``data.vocab_size``: a tokenizer's size, or
            the synthetic task's). A ``config`` without ``vocab_size`` is built with it; a checkpoint or ``config``
            with fewer ids is refused; more ids (padded embeddings) are kept.
    """

    def __init__(
        self,
        *,
        model_name_or_path: str | None = None,
        config: dict[str, Any] | None = None,
        model_kwargs: dict[str, Any] | None = None,
        config_overrides: dict[str, Any] | None = None,
        dtype: WeightDtype = "float32",
        peft_config: dict[str, Any] | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        lr_schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.1,
        attn_backend: str = "auto",
        gradient_checkpointing: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if (model_name_or_path is None) == (config is None):
            raise ValueError(
                "give exactly one of model_name_or_path and config, got "
                f"model_name_or_path={model_name_or_path!r}, config={config!r}"
            )
        _check_optim(lr, weight_decay, warmup_steps, min_lr_ratio, lr_schedule)
        self.save_hyperparameters()
        if vocab_size is not None and config is not None and "vocab_size" not in config:
            config = {**config, "vocab_size": vocab_size}
        model = load_hf_model(
            model_name_or_path=model_name_or_path,
            config=config,
            model_kwargs=model_kwargs,
            config_overrides=config_overrides,
            dtype=dtype,
        )
        embedded = getattr(model.config, "vocab_size", None)
        if vocab_size is not None and isinstance(embedded, int) and embedded < vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} (the data's ids) is more than the model's config.vocab_size={embedded}: "
                "token ids would index past the embedding; use a model made for the data's tokenizer"
            )
        try:
            model = prepare_hf_model(model)
        except UnsupportedAttentionError:  # Falcon, ...: its own attention, for mode dynamic and padded only
            rank_zero_info(
                f"HFCausalLM: {type(model).__name__} keeps its own attention ({model.config._attn_implementation!r}; "
                "it does not dispatch through transformers' AttentionInterface): it trains with mode: dynamic or "
                "padded, and packed batches are refused"
            )
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = apply_peft(model, peft_config) if peft_config is not None else model

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a process that unpickles this module (ddp_spawn, DataLoader workers) must know the attention function
        register_attention()
        super().__setstate__(state)

    def on_fit_start(self) -> None:
        """Warn loudly when half-precision weights would be updated under a precision that does not say so."""
        message = weight_dtype_warning(self.model, str(self.trainer.precision))
        if message is not None:
            rank_zero_warn(message)

    def seqpack_verify_packing(self, batch: Any) -> None:
        """Refuse a model without lit_seqpack's attention, or with attention dropout, then run the isolation probe."""
        refuse_packing_without_interface(self.model, batch)
        first = self.training and True not in _VERIFIED.get(self, ())  # once, with the train-mode probe
        settings = attention_dropout_settings(self.model) if first else []
        if settings:
            keys = ", ".join(f"{key}={value}" for key, value in settings)
            overrides = ", ".join(f"{key}: 0.0" for key, _ in settings)
            raise ValueError(
                f"{type(self.model).__name__} has attention dropout ({keys}), which packed rows do not support: "
                f"set config_overrides: {{{overrides}}} or train with mode: dynamic"
            )
        super().seqpack_verify_packing(batch)

    def seqpack_model_inputs(self, batch: Any) -> dict[str, Any]:
        """transformers keywords: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ``use_cache=False``.

        A model that keeps its own attention (see :class:`~lit_seqpack.model.hf.UnsupportedAttentionError`) gets
        transformers' keywords only, and a packed row is refused.
        """
        inputs = hf_model_inputs(batch, backend=self.hparams.attn_backend)
        if not uses_varlen_attention(self.model):
            refuse_packing_without_interface(self.model, batch)
            for key in (BACKEND_KWARG, RIGHT_PADDED_KWARG):
                inputs.pop(key, None)
        return inputs

    def forward(self, **inputs: Any) -> Any:
        """The wrapped model's output (a ``CausalLMOutput``; the mixin reads its ``logits``).

        A packed row that transformers refuses for a missing kernel package (flash-linear-attention for Qwen3-Next /
        Qwen3.5, ...) raises ``ValueError`` naming the mode that is exact without it (``mode: dynamic``).
        """
        try:
            return self.model(**inputs)
        except ValueError as err:
            packed = inputs.get("cu_seq_lens_q") is not None
            refusal = missing_kernel_error(unwrapped_model(self.model), err) if packed else None
            if refusal is None:
                raise
            raise refusal from err

    def export_hf(self, path: str | Path, *, dtype: str | None = None, tokenizer: str | None = None) -> Path:
        """Write the trained model as a Hugging Face folder (``AutoModelForCausalLM.from_pretrained`` loads it).

        PEFT adapters are merged into the weights and the model's original attention implementation is restored
        in the saved config. See :func:`~lit_seqpack.model.hf_load.export_hf_model`.

        Args:
            path: the output folder.
            dtype: the saved weights' dtype (``"bfloat16"``, ...; default: as trained).
            tokenizer: a tokenizer to save alongside (a path or name for ``AutoTokenizer``); by default the one
                in the ``model_name_or_path`` folder, if it has one.
        """
        out = export_hf_model(self.model, path, dtype=dtype)
        source = tokenizer or _local_tokenizer(self.hparams.model_name_or_path)
        if source is not None:
            transformers = require("transformers", purpose="saving the tokenizer")
            transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
        return out


def _local_tokenizer(model_name_or_path: str | None) -> str | None:
    """``model_name_or_path`` when it is a local folder with tokenizer files, else ``None``."""
    if model_name_or_path is None or not Path(model_name_or_path).is_dir():
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return model_name_or_path if any((Path(model_name_or_path) / n).exists() for n in names) else None
