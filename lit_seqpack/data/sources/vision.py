"""Vision-language conversations (TRL's vision format) rendered with a processor folder, images travelling along.

One conversation a JSONL line; ``images`` holds its pictures' paths, relative to the JSONL file, in the order of the
``{"type": "image"}`` entries of its messages::

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "a red square"}]}],
     "images": ["img/0.png"]}

A *processor folder* is what a checkpoint ships: tokenizer files, the image processor's ``preprocessor_config.json``
(loaded with transformers' PIL image processors, ``*ImageProcessorPil``: no torchvision), a chat template and a
``processor_config.json`` naming the processor class. Each image is processed once; its placeholder in the rendered
text becomes as many image tokens as the model's vision tower gives it (:data:`PROCESSORS`), so a sample's length
counts its image tokens and the planner packs whole conversations::

    tokens            <|im_start|>user <|vision_start|> I I I I <|vision_end|> what is it <|im_end|> <|im_start|>...
    mm_token_type_ids 0            0    0               1 1 1 1 0              0    0  0  0          0
    labels            -100 everywhere but the assistant's tokens (the prefix method of ChatSource)

A sample carries, besides ``input_ids`` / ``labels``, the token field ``mm_token_type_ids`` (1 on image tokens) and
the sample fields ``pixel_values`` (the conversation's image patches, an empty tensor without images) and, for Qwen,
``image_grid_thw``; declare them on the DataModule (:data:`VISION_TOKEN_FIELDS`, :data:`VISION_SAMPLE_FIELDS`) so
they travel with their conversation into packed and padded batches. Images are decoded and processed once, at
construction, and kept in memory: meant for sets that fit in RAM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_seqpack._imports import require
from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.sources.text import ROLES
from lit_seqpack.data.sources.tokenized import TokenizedDataset, text_lines

__all__ = [
    "PROCESSORS",
    "VISION_SAMPLE_FIELDS",
    "VISION_TOKEN_FIELDS",
    "VisionChatDataset",
    "VisionProcessor",
    "is_vision_processor",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Kind:
    """How one processor class turns an image into tokens."""

    placeholder: str
    """The image's token in the chat template's text (and the token the model scatters features onto)."""
    grid: bool
    """Whether the image processor returns ``image_grid_thw`` (Qwen) and the token count follows it."""


PROCESSORS: dict[str, _Kind] = {
    "Qwen2VLProcessor": _Kind(placeholder="<|image_pad|>", grid=True),
    "Qwen2_5_VLProcessor": _Kind(placeholder="<|image_pad|>", grid=True),
    "LlavaProcessor": _Kind(placeholder="<image>", grid=False),
}
"""The processor classes (``processor_config.json``'s ``processor_class``) whose image tokens are expanded here."""

VISION_TOKEN_FIELDS: dict[str, int] = {"mm_token_type_ids": 0}
"""The token field of vision samples and its pad value (``data.token_fields``)."""

VISION_SAMPLE_FIELDS: tuple[str, ...] = ("pixel_values", "image_grid_thw")
"""The sample fields of vision samples (``data.sample_fields``; LLaVA samples carry ``pixel_values`` only)."""


def is_vision_processor(folder: str | Path) -> bool:
    """Whether ``folder`` holds an image processor (``preprocessor_config.json``) beside its tokenizer."""
    return (Path(folder).expanduser() / "preprocessor_config.json").is_file()


class VisionProcessor:
    """A processor folder without the processor class: tokenizer, PIL image processor, chat template, expansion.

    transformers' multimodal processors cannot be built beside a CPU torch without torchvision (their video
    processor attribute needs it), so this class does their text part: it renders the chat template, processes the
    images with the folder's ``*ImageProcessorPil`` and replaces each placeholder with the image's tokens.

    Args:
        folder: the processor folder.
        chat_template: a Jinja template to use instead of the folder's.

    Raises:
        ValueError: no ``processor_config.json`` / an unknown ``processor_class`` (naming the supported ones), or
            no chat template.
    """

    def __init__(self, folder: str | Path, chat_template: str | None = None) -> None:
        transformers = require("transformers", purpose="vision-language conversations (a processor folder)")
        self.folder = Path(folder).expanduser()
        config_path = self.folder / "processor_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        name = config.get("processor_class")
        if name not in PROCESSORS:
            raise ValueError(
                f"{self.folder}: processor_config.json names processor_class={name!r}; vision conversations are "
                f"rendered for {sorted(PROCESSORS)}"
            )
        self.name, self.kind, self.config = name, PROCESSORS[name], config
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder)
        self.images = transformers.AutoImageProcessor.from_pretrained(self.folder)
        template = chat_template or getattr(self.tokenizer, "chat_template", None) or config.get("chat_template")
        if not template:
            raise ValueError(f"{self.folder}: no chat template (tokenizer, chat_template.jinja or processor_config)")
        self.template = template
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.kind.placeholder)
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.folder}: the tokenizer has no {self.kind.placeholder!r} token")

    def process_images(self, images: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The image processor's tensors for ``images`` (PIL) and the token count of each image."""
        out = self.images(images=list(images), return_tensors="pt")
        fields = {"pixel_values": out["pixel_values"]}
        if self.kind.grid:
            grid = out["image_grid_thw"].to(torch.int64)
            merge = int(getattr(self.images, "merge_size", 1)) ** 2
            fields["image_grid_thw"] = grid
            return fields, [int(g.prod()) // merge for g in grid]
        patch = int(self.config["patch_size"])
        height, width = out["pixel_values"].shape[-2:]
        per_image = (height // patch) * (width // patch) + int(self.config.get("num_additional_image_tokens", 0))
        if self.config.get("vision_feature_select_strategy", "default") == "default":
            per_image -= 1
        return fields, [per_image] * len(images)

    def encode(self, messages: list[dict[str, Any]], counts: Sequence[int], where: str, *, prompt: bool) -> np.ndarray:
        """The token ids of ``messages`` with their images' placeholders expanded (``counts`` tokens each).

        Raises:
            ValueError: the rendered text holds another number of placeholders than ``counts`` images (naming
                ``where``).
        """
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as err:  # a Jinja error, or raise_exception() in the template
            raise ValueError(f"{where}: the chat template failed ({type(err).__name__}: {err})") from err
        parts = text.split(self.kind.placeholder)
        if len(parts) - 1 != len(counts):
            raise ValueError(
                f"{where}: the chat template rendered {len(parts) - 1} image placeholders "
                f"({self.kind.placeholder!r}) for {len(counts)} images"
            )
        expanded = parts[0] + "".join(
            self.kind.placeholder * n + part for n, part in zip(counts, parts[1:], strict=True)
        )
        return np.asarray(self.tokenizer(expanded, add_special_tokens=False)["input_ids"], dtype=np.int64)


class VisionChatDataset(TokenizedDataset):
    """Vision-language conversations from a JSONL file, trained on the assistant turns (prefix masking).

    Args:
        path: the JSONL file (one conversation a line; image paths relative to it).
        processor: the processor folder (see :class:`VisionProcessor`).
        chat_template: the Jinja text of a template to use instead of the folder's (``ChatSource`` resolves a file).
        messages_field: the field holding each conversation.
        images_field: the field holding its image paths.

    Raises:
        ValueError: naming the file and line: a missing or unreadable image, a count of ``{"type": "image"}``
            entries other than the number of images, a conversation without an assistant turn, or a template whose
            shorter renderings are not token prefixes of the longer ones.
    """

    truncatable = False
    """An over-long conversation cannot be cut (its images' tokens and patches belong together)."""

    def __init__(
        self,
        path: str | Path,
        processor: str | Path,
        *,
        chat_template: str | None = None,
        messages_field: str = "messages",
        images_field: str = "images",
    ) -> None:
        self.processor = VisionProcessor(processor, chat_template)
        path = Path(path).expanduser()
        if path.suffix.lower() not in (".jsonl", ".ndjson") or not path.is_file():
            raise ValueError(f"path={str(path)!r}: vision conversations are read from an existing .jsonl file")
        ids_parts, label_parts, self.where, self.pixel_values, self.image_grid_thw = [], [], [], [], []
        for where, messages, images in _records(path, messages_field, images_field):
            fields, counts = self.processor.process_images(images) if images else (self._no_image(), [])
            ids, labels = self._mask(messages, counts, where)
            ids_parts.append(ids)
            label_parts.append(labels)
            self.where.append(where)
            self.pixel_values.append(fields["pixel_values"])
            self.image_grid_thw.append(fields.get("image_grid_thw"))
        if not ids_parts:
            raise ValueError(f"{path}: no conversations")
        tokens = np.concatenate(ids_parts)
        offsets = np.concatenate(([0], np.cumsum([len(p) for p in ids_parts])))
        types = (tokens == self.processor.image_token_id).astype(np.int64)
        super().__init__(
            tokens, offsets, np.concatenate(label_parts), token_fields={"mm_token_type_ids": types}, source=str(path)
        )
        self.vocab_size = len(self.processor.tokenizer)
        self.image_token_id = self.processor.image_token_id
        log.info("%s: %d conversations, %d tokens, %d image tokens", path, len(self), len(tokens), int(types.sum()))

    @property
    def sample_field_names(self) -> tuple[str, ...]:
        """The sample fields this dataset's samples carry."""
        return VISION_SAMPLE_FIELDS if self.processor.kind.grid else ("pixel_values",)

    def sample_where(self, index: int) -> str:
        """The file and line of sample ``index``."""
        return self.where[index]

    def has_images(self, index: int) -> bool:
        """Whether sample ``index`` holds an image."""
        return len(self.pixel_values[index]) > 0

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        sample["pixel_values"] = self.pixel_values[index]
        if self.processor.kind.grid:
            sample["image_grid_thw"] = self.image_grid_thw[index]
        return sample

    def _no_image(self) -> dict[str, torch.Tensor]:
        """Empty image tensors of the right trailing shape, so every sample carries the same fields."""
        if self.processor.kind.grid:
            images = self.processor.images
            width = 3 * int(images.temporal_patch_size) * int(images.patch_size) ** 2
            return {"pixel_values": torch.empty(0, width), "image_grid_thw": torch.empty(0, 3, dtype=torch.int64)}
        return {"pixel_values": torch.empty(0, 3, 0, 0)}

    def _mask(self, messages: list[dict[str, Any]], counts: list[int], where: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids and labels: assistant turn ``i`` is the tokens between the renderings before and through it."""
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistants:
            raise ValueError(f"{where}: no assistant message, so nothing to train on")
        images_before = np.cumsum([0] + [_image_entries(m) for m in messages])
        ids = self.processor.encode(messages, counts, where, prompt=False)
        mask = np.zeros(len(ids), dtype=bool)
        for turn in assistants:
            before = self.processor.encode(messages[:turn], counts[: images_before[turn]], where, prompt=True)
            through = self.processor.encode(
                messages[: turn + 1], counts[: images_before[turn + 1]], where, prompt=False
            )
            for part in (before, through):
                if len(part) > len(ids) or not np.array_equal(ids[: len(part)], part):
                    raise ValueError(
                        f"{where}: the chat template rendering up to message {turn} is not a token prefix of the "
                        "whole conversation, so the assistant tokens cannot be located"
                    )
            if len(through) <= len(before):
                raise ValueError(f"{where}, message {turn}: the assistant turn renders to no token")
            mask[len(before) : len(through)] = True
        return ids, np.where(mask, ids, IGNORE_INDEX).astype(np.int64)


def _image_entries(message: dict[str, Any]) -> int:
    content = message["content"]
    return 0 if isinstance(content, str) else sum(1 for c in content if c.get("type") == "image")


def _records(path: Path, messages_field: str, images_field: str) -> Iterator[tuple[str, list[dict[str, Any]], list]]:
    """``(where, messages, images)`` of every line: messages checked, images opened (RGB) from beside the file."""
    from PIL import Image, UnidentifiedImageError

    for number, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict) or messages_field not in record:
            raise ValueError(f"{where}: expected an object with a {messages_field!r} list of messages")
        messages = _check_messages(record[messages_field], where)
        paths = record.get(images_field) or []
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"{where}: {images_field!r} must be a list of image paths, got {paths!r:.80}")
        entries = sum(_image_entries(m) for m in messages)
        if entries != len(paths):
            raise ValueError(
                f"{where}: the messages hold {entries} {{'type': 'image'}} entries but {images_field!r} lists "
                f"{len(paths)} images; each image entry takes the next image, in order"
            )
        images = []
        for name in paths:
            file = path.parent / name
            try:
                with Image.open(file) as image:
                    images.append(image.convert("RGB"))
            except (OSError, UnidentifiedImageError) as err:
                raise ValueError(
                    f"{where}: image {name!r} ({file}) cannot be read ({type(err).__name__}: {err})"
                ) from None
        yield where, messages, images


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Messages whose ``content`` is a string or a list of ``{"type": "text", "text"}`` / ``{"type": "image"}``."""

    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"{where}, message {i}: expected a 'role' among {ROLES}, got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise ValueError(f"{where}, message {i}: 'content' must be a string or a non-empty list of parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind != "image":
                raise ValueError(
                    f"{where}, message {i}: a content part must be {{'type': 'text', 'text': ...}} or "
                    f"{{'type': 'image'}}, got {part!r:.80}"
                )
    return messages
