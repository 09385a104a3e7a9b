"""Ready-made LightningModules: the reference decoder and any transformers causal LM, trained packed.

Both are ``PackedSequenceMixin`` + ``LightningModule`` with keyword-only typed ``__init__`` (so LightningCLI can
build them from YAML), ``save_hyperparameters`` and AdamW with an optional linear warmup and cosine decay::

    model = ReferenceLM(vocab_size=32000, n_layer=12, n_head=12, n_kv_head=4, n_embd=768, lr=3e-4)
    model = HFCausalLM(model_name_or_path="/models/llama-1b")                        # a local checkpoint
    model = HFCausalLM(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32, ...})  # random init
    model = HFCausalLM(model_name_or_path="/models/qwen2-vl-2b")   # image-text-to-text: AutoModelForImageTextToText

A trained :class:`~lit_seqpack.model.lm.ReferenceLM` as a plain folder: ``config.json`` + ``model.safetensors``.

No Lightning state and no pickle: the folder holds the model's constructor arguments and its weights, plus the
tokenizer it trained with when one is known. :func:`load_reference_lm` rebuilds the module from it::

    from lit_seqpack.model.lm import load_reference_lm
    model = load_reference_lm("outputs/text_sft/exported")   # ReferenceLM, eval mode
"""

from __future__ import annotations

import copy
import json
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
from lit_seqpack.model.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE, OutputHead, hf_output_head, verify_output_head
from lit_seqpack.model.hf import UnsupportedAttentionError, hf_model_inputs, prepare_hf_model, register_attention
from lit_seqpack.model.hf_load import (
    DTYPES,
    apply_peft,
    attention_dropout_settings,
    export_hf_model,
    load_hf_model,
    weight_dtype_warning,
)
from lit_seqpack.model.mixin import _VERIFIED, PackedSequenceMixin
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder
from lit_seqpack.model.vlm import (
    IMAGES_KWARG,
    PendingImages,
    encode_images_in_forward,
    is_multimodal_batch,
    multimodal_inputs,
    vision_parameters,
)

__all__ = [
    "HFCausalLM",
    "ReferenceLM",
    "warmup_cosine",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "load_reference_lm",
    "save_reference_lm",
]


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


class _ChunkedLossMixin:
    """``seqpack_output_head`` for the ready-made modules: their ``chunked_loss`` / ``loss_chunk_size`` settings, or
    the full-logits path with one log line naming why (an overridden loss, a sharded head, a transform the chunked
    loss does not reproduce)."""

    def seqpack_output_head(self) -> OutputHead | None:
        """The head of the chunked loss, or ``None`` (full logits) when ``chunked_loss`` is off or cannot be exact."""
        if not self.hparams.chunked_loss:  # type: ignore[attr-defined]
            return None
        cls = type(self)
        if cls.seqpack_loss is not PackedSequenceMixin.seqpack_loss:  # type: ignore[attr-defined]
            return self._seqpack_fall_back("seqpack_loss is overridden (it takes the full logits)")
        if cls.seqpack_forward is not PackedSequenceMixin.seqpack_forward:  # type: ignore[attr-defined]
            return self._seqpack_fall_back("seqpack_forward is overridden (the loss must see its logits)")
        flattening = _flattening_strategy(self)
        if flattening is not None:
            return self._seqpack_fall_back(f"{flattening} shards the output projection outside the forward")
        if any(_is_dtensor(p) for p in self.parameters()):  # type: ignore[attr-defined]
            return self._seqpack_fall_back(
                "its parameters are sharded DTensors (FSDP2 / tensor parallel), gathered only inside the forward"
            )
        head = self._seqpack_head()
        return self._seqpack_fall_back(head) if isinstance(head, str) else head

    def _seqpack_head(self) -> OutputHead | str:
        raise NotImplementedError(f"{type(self).__name__} must say which output head the chunked loss projects through")

    def _seqpack_fall_back(self, reason: str) -> None:
        logged = self.__dict__.setdefault("_seqpack_fallbacks", set())
        if reason not in logged:
            logged.add(reason)
            rank_zero_info(
                f"{type(self).__name__}: the loss takes the full [tokens, vocab] logits (not chunked) because {reason}"
            )
        return None


def _process_group_size() -> int:
    """The default process group's size (1 without one)."""
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def _is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


class ReferenceLM(_ChunkedLossMixin, PackedSequenceMixin, _OptimizerMixin, LightningModule):
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
        chunked_loss: compute the training and validation loss from the hidden states, ``loss_chunk_size`` tokens
            at a time through the output projection (recomputed in backward), never holding ``[tokens, vocab]``
            logits (:func:`~lit_seqpack.model.chunked_loss.chunked_cross_entropy`); ``False``: the full logits.
            ``forward`` returns the full logits either way.
        loss_chunk_size: tokens whose logits exist at once in the chunked loss.
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
        chunked_loss: bool = True,
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        _check_optim(lr, weight_decay, warmup_steps, min_lr_ratio, lr_schedule)
        check_int("loss_chunk_size", loss_chunk_size, minimum=1)
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

    def seqpack_hidden_states(self, batch: Any) -> torch.Tensor:
        """The decoder's last hidden states ``[B, T, n_embd]`` for ``batch`` (the chunked loss's input)."""
        return self.model.hidden_states(**self.seqpack_model_inputs(batch), attn_backend=self.hparams.attn_backend)

    def _seqpack_head(self) -> OutputHead | str:
        return OutputHead(weight=self.model.output_weight(), chunk_size=self.hparams.loss_chunk_size)


class HFCausalLM(_ChunkedLossMixin, PackedSequenceMixin, _OptimizerMixin, LightningModule):
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
        model_name_or_path: a checkpoint for ``AutoModelForCausalLM.from_pretrained`` (a local path offline), or
            ``AutoModelForImageTextToText`` for a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA; see
            :mod:`lit_seqpack.model.vlm`).
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
        chunked_loss: compute the training and validation loss from the decoder's hidden states,
            ``loss_chunk_size`` tokens at a time through the output projection (recomputed in backward), never
            holding ``[tokens, vocab]`` logits. The model's own logit transforms (bias, Gemma2/3
            ``final_logit_softcapping``, Granite ``logits_scaling``, Cohere ``logit_scale``, Falcon-H1
            ``lm_head_multiplier``) are reproduced and checked once against its forward on a short probe; a model
            whose logits are anything else (or a sharded / adapted head) takes the full logits, with one log line
            naming why. ``False``: always the full logits. ``forward`` returns the full logits either way.
        loss_chunk_size: tokens whose logits exist at once in the chunked loss.
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
        chunked_loss: bool = True,
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        check_int("loss_chunk_size", loss_chunk_size, minimum=1)
        if (model_name_or_path is None) == (config is None):
            raise ValueError(
                "give exactly one of model_name_or_path and config, got "
                f"model_name_or_path={model_name_or_path!r}, config={config!r}"
            )
        _check_optim(lr, weight_decay, warmup_steps, min_lr_ratio, lr_schedule)
        self.save_hyperparameters()
        if vocab_size is not None and config is not None and "vocab_size" not in config:
            text = config.get("text_config")  # a vision-language model: the vocabulary is its text model's
            if isinstance(text, dict):
                config = {**config, "text_config": {"vocab_size": vocab_size, **text}}
            else:
                config = {**config, "vocab_size": vocab_size}
        model = load_hf_model(
            model_name_or_path=model_name_or_path,
            config=config,
            model_kwargs=model_kwargs,
            config_overrides=config_overrides,
            dtype=dtype,
        )
        embedded = getattr(model.config, "vocab_size", None)
        if embedded is None:  # a vision-language model: its text model's vocabulary
            embedded = getattr(getattr(model.config, "text_config", None), "vocab_size", None)
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
        if gradient_checkpointing:  # activation_checkpointing_enable: the name since transformers 5.24
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        self.model = apply_peft(model, peft_config) if peft_config is not None else model
        self._image_microbatches = 0  # this rank's microbatches with images since the last optimizer step
        self._probing = False  # inside the isolation probe's own forward passes

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
        self._probing = True  # the probe runs the row's tokens, image placeholders included, as text
        try:
            super().seqpack_verify_packing(batch)
        finally:
            self._probing = False

    def seqpack_model_inputs(self, batch: Any) -> dict[str, Any]:
        """transformers keywords: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ``use_cache=False``.

        A model that keeps its own attention (see :class:`~lit_seqpack.model.hf.UnsupportedAttentionError`) gets
        transformers' keywords only, and a packed row is refused. A batch with images (``pixel_values``) gets the
        vision tower's outputs and its positions from :func:`~lit_seqpack.model.vlm.multimodal_inputs`.
        """
        inputs = hf_model_inputs(batch, backend=self.hparams.attn_backend)
        model = unwrapped_model(self.model)
        if is_multimodal_batch(batch):  # images: the vision tower's outputs and per-conversation (mRoPE) positions
            multimodal_inputs(model, batch, inputs)
        training = self.training and torch.is_grad_enabled()
        if IMAGES_KWARG in inputs:
            self._image_microbatches += int(training)
        elif self._runs_vision_on_every_rank(training):  # no image here: the tower still runs, as on the other ranks
            encode_images_in_forward(model)
            inputs[IMAGES_KWARG] = PendingImages(None)
        if not uses_varlen_attention(self.model):
            refuse_packing_without_interface(self.model, batch)
            for key in (BACKEND_KWARG, RIGHT_PADDED_KWARG):
                inputs.pop(key, None)
        return inputs

    def _trains_vision(self) -> bool:
        """Whether this is a run over several ranks of a vision-language model whose vision tower trains: the same
        answer on every rank (no batch is read)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size < 2:
            return False
        return any(p.requires_grad for p in vision_parameters(unwrapped_model(self.model)))

    def _runs_vision_on_every_rank(self, training: bool) -> bool:
        """Whether every rank must run the vision tower in this forward: a training one whose tower trains (DDP's
        reducer waits for its gradients), or any one whose tower is sharded (FSDP2 and tensor parallel gather its
        parameters in the forward, on every rank)."""
        trainer = self._trainer
        ranks = trainer.world_size if trainer is not None else _process_group_size()  # a Trainer's, or Fabric's
        if ranks < 2 or self._probing:  # the probe runs text on every rank alike
            return False
        params = vision_parameters(unwrapped_model(self.model))
        return any(_is_dtensor(p) for p in params) or (training and any(p.requires_grad for p in params))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Drop the vision tower's gradients after a step in which no rank saw an image (Trainer only: a Fabric loop
        keeps the zeros, on which AdamW still applies weight decay and momentum to the tower).

        Those gradients are the idle tower's zeros (see :meth:`seqpack_model_inputs`); a run that never called the
        tower has none, and AdamW then leaves the tower as it is (zeros would still apply weight decay and momentum).
        The ranks agree on the step's image count with one all-reduce of a scalar, on every rank alike.
        """
        if not self._trains_vision():
            self._image_microbatches = 0
            return
        count = torch.tensor(float(self._image_microbatches), device=self.device)
        self._image_microbatches = 0
        if float(self.trainer.strategy.reduce(count, reduce_op="sum")) == 0.0:
            for param in vision_parameters(unwrapped_model(self.model)):
                param.grad = None

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

    def seqpack_hidden_states(self, batch: Any) -> torch.Tensor:
        """The decoder's last hidden states for ``batch`` (the chunked loss's input), as the model's own forward makes
        them.

        The whole model runs as :meth:`forward` runs it (so a base model that drops keywords on their way to its
        layers, or a vision-language model that places its vision tower's outputs on the image tokens, behaves exactly
        as in the full-logits path), with ``logits_to_keep=1`` so the head projects one position only; the hidden
        states are read from the output of ``get_decoder()`` during that call.
        """
        decoder = unwrapped_model(self.model).get_decoder()
        captured: list[torch.Tensor] = []

        def keep(module: Any, args: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

        handle = decoder.register_forward_hook(keep)
        try:
            self.forward(**self.seqpack_model_inputs(batch), logits_to_keep=1)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise RuntimeError(
                f"{type(decoder).__name__} (get_decoder()) ran {len(captured)} times in one forward of "
                f"{type(unwrapped_model(self.model)).__name__}; set chunked_loss=False for this model"
            )
        return captured[0]

    def _seqpack_head(self) -> OutputHead | str:
        model = unwrapped_model(self.model)
        head = hf_output_head(model, chunk_size=self.hparams.loss_chunk_size)
        if isinstance(head, str):
            return head
        checked = self.__dict__.get("_seqpack_head_checked")
        if checked is None:  # once per module: the head must reproduce the model's own logits
            checked = verify_output_head(model, head) or ""
            self.__dict__["_seqpack_head_checked"] = checked
        return checked or head

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


CONFIG_FILE = "config.json"
"""The constructor arguments: ``{"class_path": ..., "init_args": {...}}``."""

WEIGHTS_FILE = "model.safetensors"
"""The decoder's weights (``ReferenceLM.model``), tied embeddings stored once."""


def save_reference_lm(module: Any, path: str | Path, *, dtype: str | None = None, tokenizer: str | None = None) -> Path:
    """Write ``module`` (a ReferenceLM) as ``config.json`` + ``model.safetensors`` (+ the tokenizer) in ``path``.

    Args:
        module: the trained :class:`~lit_seqpack.model.lm.ReferenceLM`.
        path: the output folder (created).
        dtype: the saved weights' dtype (``"bfloat16"``, ...; default: as trained).
        tokenizer: a tokenizer folder to save alongside (``AutoTokenizer``), or ``None``.
    """
    safetensors = require("safetensors.torch", purpose="saving the weights")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = module.model
    if dtype is not None:
        if dtype not in DTYPES or dtype == "auto":
            raise ValueError(f"dtype={dtype!r} must be one of float32, bfloat16, float16")
        model = copy.deepcopy(model).to(DTYPES[dtype])
    init_args = {key: value for key, value in module.hparams.items() if not key.startswith("_")}
    config = {"class_path": f"{type(module).__module__}.{type(module).__qualname__}", "init_args": init_args}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    safetensors.save_model(model, str(out / WEIGHTS_FILE))
    if tokenizer is not None:
        transformers = require("transformers", purpose="saving the tokenizer")
        transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def load_reference_lm(path: str | Path) -> Any:
    """The :class:`~lit_seqpack.model.lm.ReferenceLM` written by :func:`save_reference_lm`, in eval mode.

    Raises:
        FileNotFoundError: ``path`` lacks ``config.json`` or ``model.safetensors``.
    """
    from lit_seqpack.model.lm import ReferenceLM

    safetensors = require("safetensors.torch", purpose="loading the weights")
    folder = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing (write the folder with `lit-seqpack export`)")
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    module = ReferenceLM(**config["init_args"])
    safetensors.load_model(module.model, str(folder / WEIGHTS_FILE))
    return module.eval()
