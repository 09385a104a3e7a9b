"""A tiny chat tokenizer built locally (the ``tokenizers`` library, no download) and generated conversations.

``write_demo(folder)`` also wrote the committed assets of ``configs/chat_sft.yaml`` under
``lit_seqpack/data/assets/chat_demo/``, and ``write_sft_demo`` those of ``configs/text_sft.yaml`` and
``configs/tokenized_sft.yaml`` under ``lit_seqpack/data/assets/sft_demo/``
(``python -m tests.data._chat_tiny lit_seqpack/data/assets`` writes both).
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


def sum_text(rng: random.Random) -> tuple[str, str]:
    """One sum as a question and its answer, in the tokenizer's words."""
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"what is {a} plus {b}", f"{a} plus {b} is {a + b}"


def write_sft_demo(folder: str | Path, tokenizer: Any, num_samples: int = 400, seed: int = 0) -> Path:
    """Write the assets of ``configs/text_sft.yaml`` and ``configs/tokenized_sft.yaml`` under ``folder``.

    ``train.txt`` / ``val.txt``: one document a line (a question and its answer); ``train.jsonl`` / ``val.jsonl``:
    the same kind of samples pre-tokenised with ``tokenizer`` (``input_ids`` and ``labels``: -100 on the question,
    so only the answer trains).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in (("train", num_samples), ("val", max(1, num_samples // 10))):
        samples = [sum_text(rng) for _ in range(count)]
        (folder / f"{split}.txt").write_text("".join(f"{q} then {a}\n" for q, a in samples), encoding="utf-8")
        with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as handle:
            for question, answer in samples:
                prompt = [tokenizer.bos_token_id, *tokenizer.encode(question, add_special_tokens=False)]
                reply = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
                labels = [-100] * len(prompt) + reply
                handle.write(json.dumps({"input_ids": prompt + reply, "labels": labels}) + "\n")
    return folder


if __name__ == "__main__":
    # python -m tests.data._chat_tiny lit_seqpack/data/assets: chat_demo/ and sft_demo/
    root = Path(sys.argv[1])
    write_demo(root / "chat_demo")
    write_sft_demo(root / "sft_demo", build_tokenizer())
