"""A tiny chat tokenizer built locally (the ``tokenizers`` library, no download) and generated conversations.

``write_demo(folder)`` also wrote the committed assets of ``configs/chat_sft.yaml`` under
``lit_seqpack/data/assets/chat_demo/`` (``python -m tests.data._chat_tiny lit_seqpack/data/assets/chat_demo``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
NUMBERS = [str(n) for n in range(41)]
WORDS = [
    "what",
    "is",
    "plus",
    "minus",
    "and",
    "then",
    "answer",
    "with",
    "a",
    "number",
    "thanks",
    "you",
    "are",
    "welcome",
]

# Each turn is "<|role|> content <|end|>"; the assistant's content and its <|end|> are the generation.
TAGGED = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|end|> {% endgeneration %}"
    "{% else %}{{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
PLAIN = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same rendering without generation tags (the prefix method must find the same tokens)."""


def build_tokenizer(template: str | None = TAGGED) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over digits and a few words, with ``template`` as chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(NUMBERS), " ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = template
    return fast


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A system prompt (half the time) and one to three sums asked and answered."""
    messages = [{"role": "system", "content": "answer with a number"}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        messages.append({"role": "user", "content": f"what is {a} plus {b}"})
        messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}"})
    return messages


def write_demo(folder: str | Path, num_conversations: int = 400, seed: int = 0) -> Path:
    """Write ``tokenizer/`` (with the tagged template), ``chat.jsonl`` and ``chat_val.jsonl`` (a tenth as many other
    conversations) under ``folder``; return ``folder``."""
    folder = Path(folder)
    build_tokenizer().save_pretrained(folder / "tokenizer")
    rng = random.Random(seed)
    for name, count in (("chat.jsonl", num_conversations), ("chat_val.jsonl", max(1, num_conversations // 10))):
        with (folder / name).open("w", encoding="utf-8") as handle:
            for _ in range(count):
                handle.write(json.dumps({"messages": conversation(rng)}) + "\n")
    return folder


if __name__ == "__main__":
    write_demo(sys.argv[1])
