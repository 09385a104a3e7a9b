"""Tiny vision-language fixtures built locally (no download): processor folders, PNGs, TRL-format conversations.

``qwen2_vl_processor(folder)`` writes a Qwen2-VL processor (a word-level tokenizer with Qwen's vision tokens, a
``Qwen2VLImageProcessorPil`` config with patch 8 and a chat template); ``llava_processor(folder)`` a LLaVA one
(``CLIPImageProcessorPil``, 16x16 crops); ``write_conversations(folder, ...)`` writes PNGs made with PIL under
``img/`` and a ``chat.jsonl`` in TRL's vision format whose image paths are relative to it. ``*_config()`` give the
configs of the tiny models the tests build (``HFCausalLM(config=...)``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ["what", "is", "in", "the", "image", "a", "red", "green", "blue", "square", "and", "both", "none", "hello"]
WORDS += [str(n) for n in range(10)]
QWEN_SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
QWEN_SPECIAL += ["<|image_pad|>", "<|video_pad|>"]
LLAVA_SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<image>"]

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}"
    "{% endif %}<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def _tokenizer(special: list[str], **tokens: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", **tokens)


def qwen2_vl_processor(folder: str | Path, processor_class: str = "Qwen2VLProcessor") -> Path:
    """Write a tiny Qwen2-VL processor folder (tokenizer, ``Qwen2VLImageProcessorPil``, chat template)."""
    from transformers import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(
        patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
    tokenizer = _tokenizer(QWEN_SPECIAL, eos_token="<|im_end|>")
    return _save(folder, tokenizer, images, QWEN_TEMPLATE, {"processor_class": processor_class})


def llava_processor(folder: str | Path) -> Path:
    """Write a tiny LLaVA processor folder (tokenizer, ``CLIPImageProcessorPil`` with 16x16 crops, chat template)."""
    from transformers import CLIPImageProcessorPil

    tokenizer = _tokenizer(LLAVA_SPECIAL, bos_token="<s>", eos_token="</s>")
    images = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    settings = {
        "processor_class": "LlavaProcessor",
        "patch_size": 8,
        "vision_feature_select_strategy": "full",
        "num_additional_image_tokens": 1,
    }
    return _save(folder, tokenizer, images, LLAVA_TEMPLATE, settings)


def _save(folder: str | Path, tokenizer: Any, images: Any, template: str, settings: dict[str, Any]) -> Path:
    """What ``Processor.save_pretrained`` writes (the processor classes need torchvision to be built here)."""
    folder = Path(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def write_png(path: Path, colour: str, size: tuple[int, int]) -> None:
    """A ``size`` PNG of one colour with a white square in a corner (PIL)."""
    from PIL import Image

    image = Image.new("RGB", size, COLOURS[colour])
    for x in range(min(6, size[0])):
        for y in range(min(6, size[1])):
            image.putpixel((x, y), (255, 255, 255))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def conversation(rng: random.Random, images: list[str]) -> dict[str, Any]:
    """One TRL-format conversation about ``images`` (0-2 relative paths), one or two turns."""
    colours = [Path(p).stem.split("_")[0] for p in images]
    content: list[dict[str, str]] = [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": "what is in the image" if images else "hello"})
    answer = " and ".join(colours) if colours else "none"
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    if rng.random() < 0.4:
        messages += [
            {"role": "user", "content": [{"type": "text", "text": "what is 2 and 3"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
        ]
    return {"messages": messages, "images": images}


def write_conversations(
    folder: str | Path,
    count: int = 16,
    seed: int = 0,
    sizes: tuple[tuple[int, int], ...] = ((32, 32), (48, 32)),
    images_per_conversation: list[int] | None = None,
) -> Path:
    """Write ``count`` conversations with 0-2 PNGs each (conversation ``i`` has ``i % 3``, or
    ``images_per_conversation[i]``) to ``folder/chat.jsonl`` (images under ``folder/img``)."""
    folder, rng = Path(folder), random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "chat.jsonl").open("w", encoding="utf-8") as handle:
        for i in range(count):
            images = []
            for k in range(i % 3 if images_per_conversation is None else images_per_conversation[i]):
                colour = rng.choice(sorted(COLOURS))
                name = f"img/{colour}_{i}_{k}.png"
                write_png(folder / name, colour, rng.choice(sizes))
                images.append(name)
            handle.write(json.dumps(conversation(rng, images)) + "\n")
    return folder / "chat.jsonl"


def qwen2_vl_config(processor: Any, model_type: str = "qwen2_vl") -> dict[str, Any]:
    """A tiny Qwen2-VL (or Qwen2.5-VL) config for ``processor``'s tokenizer: 2 text layers of width 64 with mRoPE
    sections; a 1-layer vision tower with patch 8 (Qwen2.5-VL: 2 layers, the first windowed, the second full)."""
    tok = processor.tokenizer
    ids = {
        name: tok.convert_tokens_to_ids(t)
        for name, t in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    text = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "attention_dropout": 0.0,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
    }
    vision = {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "mlp_ratio": 2,
    }
    if model_type == "qwen2_5_vl":
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "out_hidden_size": 64,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 32,
            "fullatt_block_indexes": [1],
        }
    return {"model_type": model_type, "text_config": text, "vision_config": vision, **ids}


def llava_config(processor: Any) -> dict[str, Any]:
    """A tiny LLaVA config for ``processor``'s tokenizer: a 2-layer Llama of width 64 and a 2-layer CLIP tower
    (16x16 images, patch 8, every patch and the class token as image tokens)."""
    tok = processor.tokenizer
    text = {
        "model_type": "llama",
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 8,
        "projection_dim": 32,
    }
    return {
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": tok.convert_tokens_to_ids("<image>"),
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
    }


def write_demo(folder: str | Path, count: int = 48) -> Path:
    """Write the assets of ``configs/vlm_sft.yaml`` under ``folder``: ``processor/`` (Qwen2-VL) and ``chat.jsonl``
    with its PNGs under ``img/`` (``python -m tests.data._vlm_tiny lit_seqpack/data/assets/vlm_demo``)."""
    folder = Path(folder)
    qwen2_vl_processor(folder / "processor")
    write_conversations(folder, count, seed=1, sizes=((16, 16), (32, 16), (32, 32)))
    return folder


if __name__ == "__main__":
    import sys

    write_demo(sys.argv[1])
