"""Vision-language models on packed and padded rows: each conversation's images, positions and vision features.

A multimodal batch carries, beside the tokens, the sample fields ``pixel_values`` (and for Qwen ``image_grid_thw``)
as one tensor per document and the token field ``mm_token_type_ids`` (1 on image tokens), as
:class:`~lit_seqpack.data.sources.vision.VisionChatDataset` writes them. :func:`multimodal_inputs` turns them into
the keywords of the stock ``*ForConditionalGeneration`` model::

    packed row   the vision tower runs once on the row's images (its own per-image attention, no packing keyword
                 reaches it) and its outputs go in as mm_encoder_outputs={"image": ...}, which the model scatters
                 onto the image tokens in document order; it runs inside the model's forward (a forward pre-hook
                 of ``model.model``, :func:`encode_images_in_forward`), where FSDP2 has gathered the parameters;
                 Qwen: position_ids [4, 1, T] = the row's text positions over the 3-D mRoPE positions that
                 get_rope_index gives each document alone (restarting at 0 per document; the padding tail
                 keeps its text positions);
                 LLaVA: the row's 1-D positions
    padded rows  the same vision outputs, plus image_grid_thw / mm_token_type_ids / attention_mask: the stock model
                 computes each row's mRoPE positions itself

The language model then runs lit_seqpack's varlen attention on the packed row exactly as for text.

Under DDP or FSDP every rank's vision tower must run in every microbatch (DDP waits for gradients of every
parameter, FSDP all-gathers and reduce-scatters each wrapped block on every rank): a microbatch without images
gets :func:`idle_vision_outputs`, the tower run on one blank image whose features join as zero rows, so its
parameters get zero gradients and the language model's inputs are unchanged (``HFCausalLM`` does this, and drops
the zero gradients of a step in which no rank saw an image, as a run that never called the tower would). What stays
refused, by name (:data:`REFUSED`): architectures whose image tokens attend bidirectionally (Gemma3, PaliGemma:
their pattern lives in a mask that packed rows do not build), and any architecture not in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "IMAGES_KWARG",
    "REFUSED",
    "PendingImages",
    "encode_images_in_forward",
    "idle_vision_outputs",
    "is_multimodal_batch",
    "multimodal_inputs",
    "mrope_position_ids",
    "vision_parameters",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Architecture:
    """What a vision-language architecture needs from a batch."""

    mrope: bool
    """3-D mRoPE positions (Qwen's ``get_rope_index``) and ``image_grid_thw``; else 1-D positions."""
    vision_modules: tuple[str, ...]
    """The attributes of ``model.model`` that ``get_image_features`` runs (the vision tower and its projector)."""


ARCHITECTURES: dict[str, _Architecture] = {
    "qwen2_vl": _Architecture(mrope=True, vision_modules=("visual",)),
    "qwen2_5_vl": _Architecture(mrope=True, vision_modules=("visual",)),
    "llava": _Architecture(mrope=False, vision_modules=("vision_tower", "multi_modal_projector")),
}
"""The ``model_type`` of every vision-language model trained here, packed, dynamic and padded."""

REFUSED: dict[str, str] = {
    "gemma3": "its image tokens attend to each other bidirectionally (token_type_ids build that mask)",
    "paligemma": "its image and prefix tokens attend bidirectionally (token_type_ids build that mask)",
}
"""Vision-language architectures refused on multimodal rows, with the reason."""

_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")

IMAGES_KWARG = "lit_seqpack_images"
"""The model keyword that carries a microbatch's :class:`PendingImages` to :func:`encode_images_in_forward`'s hook."""


@dataclass(frozen=True, slots=True)
class PendingImages:
    """A microbatch's images, for the vision tower to encode inside the model's forward."""

    pixel_values: torch.Tensor | None
    """The images' pixels, every document's concatenated; ``None``: no image, the tower runs idle
    (:func:`idle_vision_outputs`)."""
    image_grid_thw: torch.Tensor | None = None
    """Qwen: each image's patch grid."""


def encode_images_in_forward(model: Any) -> None:
    """Let ``model`` take ``lit_seqpack_images=PendingImages(...)``: the vision tower's outputs are computed inside
    its forward, as ``mm_encoder_outputs``, by a forward pre-hook of ``model.model`` (installed once).

    Inside the forward is where FSDP2 has initialised and gathered the model's own parameters (the projector of a
    LLaVA, any vision module not wrapped as a unit of its own); a call before it would meet shards, or initialise a
    vision unit before the root one.
    """
    inner = model.model
    if not getattr(inner, "_lit_seqpack_encodes_images", False):
        inner.register_forward_pre_hook(_encode_pending_images, with_kwargs=True)
        inner._lit_seqpack_encodes_images = True


def _encode_pending_images(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook of a vision-language ``*Model``: :data:`IMAGES_KWARG` becomes ``mm_encoder_outputs``."""
    pending = kwargs.pop(IMAGES_KWARG, None)
    if pending is None:
        return None
    if pending.pixel_values is None:
        features = _idle_features(module)
    else:
        extra = {} if pending.image_grid_thw is None else {"image_grid_thw": pending.image_grid_thw}
        features = module.get_image_features(pixel_values=pending.pixel_values, return_dict=True, **extra)
    kwargs["mm_encoder_outputs"] = {"image": features}
    return args, kwargs


def is_multimodal_batch(batch: Mapping[str, Any]) -> bool:
    """Whether ``batch`` carries images (a ``pixel_values`` field)."""
    return batch.get("pixel_values") is not None


def _architecture(model: Any) -> _Architecture:
    model_type = getattr(model.config, "model_type", None)
    if model_type in REFUSED:
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) is refused on image rows: {REFUSED[model_type]}, "
            "which lit_seqpack does not build for packed or padded rows; train it on text rows only"
        )
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) got a batch with pixel_values: image rows are "
            f"trained for model_type in {sorted(ARCHITECTURES)} only (each checked against the stock model)"
        )
    return ARCHITECTURES[model_type]


def vision_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters that ``model``'s ``get_image_features`` uses ([] for a model that is not in
    :data:`ARCHITECTURES`)."""
    architecture = ARCHITECTURES.get(getattr(model.config, "model_type", None))
    if architecture is None:
        return []
    return [p for name in architecture.vision_modules for p in getattr(model.model, name).parameters()]


def _blank_image(inner: Any, architecture: _Architecture) -> dict[str, torch.Tensor]:
    """``get_image_features`` keywords for the smallest image the vision tower of ``inner`` (a ``*Model``) takes,
    all zeros.

    The shapes come from the config and only the dtype and device from a parameter: under FSDP2 a parameter may be a
    shard, and any operation on one would be a collective that only this rank calls.
    """
    vision = inner.config.vision_config
    weight = next(getattr(inner, architecture.vision_modules[0]).parameters())
    like = {"dtype": weight.dtype, "device": weight.device}
    if architecture.mrope:  # Qwen: one merge window of patches of channels x temporal x patch x patch values
        merge, patch = int(vision.spatial_merge_size), int(vision.patch_size)
        values = int(vision.in_channels) * int(vision.temporal_patch_size) * patch * patch
        return {
            "pixel_values": torch.zeros(merge * merge, values, **like),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=weight.device),
        }
    size = int(vision.image_size)
    return {"pixel_values": torch.zeros(1, int(vision.num_channels), size, size, **like)}


def _idle_features(inner: Any) -> Any:
    architecture = ARCHITECTURES[inner.config.model_type]
    features = inner.get_image_features(**_blank_image(inner, architecture), return_dict=True)
    features.pooler_output = [torch.cat(tuple(features.pooler_output), dim=0)[:0]]
    return features


def idle_vision_outputs(model: Any) -> Any:
    """The vision tower's outputs for a microbatch without images: no features, yet every vision parameter in the graph.

    The tower runs on one blank image and its features are cut to zero rows, which the stock model scatters onto the
    row's zero image tokens: the language model's inputs are unchanged and the vision parameters get zero gradients,
    so DDP's reducer and FSDP's collectives see the same parameters on every rank. Give the result as
    ``mm_encoder_outputs={"image": ...}`` (``HFCausalLM`` asks for it with ``PendingImages(None)``).
    """
    return _idle_features(model.model)


def _cat(parts: Any) -> torch.Tensor | None:
    """The non-empty per-document tensors of a sample field, concatenated (``None`` when there is none)."""
    if isinstance(parts, torch.Tensor):
        return parts if parts.numel() else None
    kept = [p for p in parts if p.numel()]
    return torch.cat(kept) if kept else None


def multimodal_inputs(model: Any, batch: Mapping[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` (from :func:`~lit_seqpack.model.hf.hf_model_inputs`) completed with ``batch``'s images.

    The images go in as ``lit_seqpack_images=PendingImages(...)``, which the vision tower encodes inside the model's
    forward (:func:`encode_images_in_forward`, installed here); the positions as ``position_ids`` (packed rows) or
    the stock model's own keywords (padded rows).

    Args:
        model: the transformers ``*ForConditionalGeneration`` model (unwrapped from PEFT).
        batch: a packed row or a padded batch with the fields ``pixel_values`` (per document), ``image_grid_thw``
            (Qwen, per document) and ``mm_token_type_ids`` (per token).
        inputs: the text keywords; changed in place and returned.

    Raises:
        ValueError: an architecture refused on image rows (:data:`REFUSED`) or not supported, or a batch without
            ``mm_token_type_ids`` / ``image_grid_thw`` that the architecture needs.
    """
    architecture = _architecture(model)
    for key in _IMAGE_KEYS:
        inputs.pop(key, None)
    if architecture.mrope:
        for key in ("image_grid_thw", "mm_token_type_ids"):
            if batch.get(key) is None:
                raise ValueError(
                    f"{type(model).__name__}: a batch with pixel_values but no {key!r}; declare it on the DataModule "
                    "(token_fields={'mm_token_type_ids': 0}, sample_fields=['pixel_values', 'image_grid_thw'])"
                )
    pixels = _cat(batch["pixel_values"])
    grid = _cat(batch["image_grid_thw"]) if architecture.mrope else None
    if pixels is not None:
        # no packing keyword reaches the vision tower: it runs its own per-image attention, as in the stock model
        encode_images_in_forward(model)
        inputs[IMAGES_KWARG] = PendingImages(pixels, grid)
    if not architecture.mrope:
        return inputs
    if batch.get("cu_seqlens") is not None:
        inputs["position_ids"] = mrope_position_ids(model, batch)
    else:  # the stock model computes each row's positions from its mask, its grids and its token types
        inputs.pop("position_ids", None)
        inputs["mm_token_type_ids"] = batch["mm_token_type_ids"]
        inputs["image_grid_thw"] = grid
    return inputs


def mrope_position_ids(model: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """``[4, 1, T]`` positions of a packed row: its text positions over each document's own 3-D mRoPE positions.

    Every document's positions are the stock ``get_rope_index`` of that document alone (its tokens, token types
    and image grids), so they restart at each document; the segments after the documents (the padding tail) keep
    their text positions on all three axes.
    """
    text = batch["position_ids"]
    bounds = batch["cu_seqlens"].tolist()
    documents = int(batch.get("num_documents", len(bounds) - 1))
    ids, types = batch["input_ids"], batch["mm_token_type_ids"]
    parts = []
    for d in range(len(bounds) - 1):
        start, end = bounds[d], bounds[d + 1]
        if d >= documents:
            parts.append(text[:, start:end].unsqueeze(0).expand(3, -1, -1))
            continue
        grid = batch["image_grid_thw"][d]
        positions, _ = model.model.get_rope_index(
            ids[:, start:end],
            mm_token_type_ids=types[:, start:end],
            image_grid_thw=grid if grid.numel() else None,
        )
        parts.append(positions.to(text.dtype))
    return torch.cat([text.unsqueeze(0), torch.cat(parts, dim=2)], dim=0)
