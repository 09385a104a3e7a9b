"""``lit-seqpack generate``: prompts through a trained checkpoint, printed as text.

::

    lit-seqpack generate --ckpt_path outputs/text_sft/checkpoints/last.ckpt --prompt "what is 2 plus 3 then"
    lit-seqpack generate --ckpt_path CKPT --prompt_file prompts.txt --temperature 0.8 --top_p 0.9 --seed 1
    lit-seqpack generate --ckpt_path CKPT --chat '[{"role": "user", "content": "what is 2 plus 3"}]'

The checkpoint's model (:class:`~lit_seqpack.model.lm.ReferenceLM` or :class:`~lit_seqpack.model.lm.HFCausalLM`, as
the run recorded it) is loaded on the CPU (``--device`` elsewhere); the tokenizer is ``--tokenizer``, else the one the
run trained with (its data source's tokenizer folder, or the ``model_name_or_path`` folder of an ``HFCausalLM``).
Without a tokenizer (the synthetic demo, pre-tokenised data) prompts and outputs are token ids, and the output says
so. Greedy by default (``--temperature 0``: the same output every time); sampling is reproducible by ``--seed``.

Autoregressive generation from a trained causal LM: greedy or sampled (temperature, nucleus top-p), seeded.

Model-agnostic: the loop asks a function for the logits of a ``[1, T]`` row of token ids and recomputes the whole
row at every step (no KV cache: the models trained here are small, and the result is the plain forward pass that
training used). :func:`logits_function` adapts :class:`~lit_seqpack.model.lm.ReferenceLM`,
:class:`~lit_seqpack.model.lm.HFCausalLM` and any module whose forward returns logits (or an output with
``.logits``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_seqpack._checks import check_int
from lit_seqpack._imports import require
from lit_seqpack.export import checkpoint_tokenizer, load_checkpoint, load_module

__all__ = [
    "build_generate_parser",
    "generate_command",
    "Logits",
    "generate_ids",
    "logits_function",
    "max_length",
    "next_token",
]


Logits = Callable[[torch.Tensor], torch.Tensor]
"""``[1, T]`` token ids -> ``[1, T, vocab]`` logits."""


def next_token(
    logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """The next token id from the logits of the last position.

    Args:
        logits: ``[vocab]``.
        temperature: 0 picks the most likely token (greedy); above 0 samples from ``softmax(logits / temperature)``.
        top_p: sample only from the smallest set of tokens whose probability reaches ``top_p`` (1: all of them).
        generator: the random generator of the samples (seeded for reproducible samples).

    Example:
        >>> next_token(torch.tensor([0.1, 2.0, -1.0]))
        1
        >>> next_token(torch.tensor([0.0, 5.0, 4.9]), temperature=1.0, top_p=1e-6)  # only the most likely is kept
        1
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        sorted_probs[before >= top_p] = 0.0  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    logits: Logits,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    max_len: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The tokens generated after ``prompt`` (without it), until ``max_new_tokens``, a stop id or ``max_len``.

    Args:
        logits: the model (see :func:`logits_function`).
        prompt: the prompt's token ids (at least one).
        max_new_tokens: the most tokens generated.
        temperature: 0 is greedy (deterministic); see :func:`next_token`.
        top_p: nucleus sampling; see :func:`next_token`.
        seed: seed of the sampling generator (the same seed, the same samples).
        stop_ids: ids that end the generation (an end-of-sequence token); the stop id is returned too.
        max_len: the longest row the model accepts (prompt + generated); ``None``: no limit.
        device: where the rows are built (the model's device).

    Raises:
        ValueError: an empty prompt, or a prompt that already fills ``max_len``.

    Example:
        >>> table = torch.eye(5)[[1, 2, 3, 4, 0]]  # a "model" that always predicts the next id, mod 5
        >>> generate_ids(lambda ids: table[ids], [0], max_new_tokens=3)
        [1, 2, 3]
        >>> generate_ids(lambda ids: table[ids], [3], max_new_tokens=5, stop_ids=[0])
        [4, 0]
    """
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("the prompt has no token: give at least one")
    if max_len is not None and len(ids) >= max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, but the model accepts rows of at most {max_len}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    stops = {int(i) for i in stop_ids}
    new: list[int] = []
    while len(new) < max_new_tokens and (max_len is None or len(ids) < max_len):
        row = torch.tensor([ids], dtype=torch.long, device=device)
        token = next_token(logits(row)[0, -1].cpu(), temperature=temperature, top_p=top_p, generator=generator)
        ids.append(token)
        new.append(token)
        if token in stops:
            break
    return new


def logits_function(module: nn.Module) -> Logits:
    """The module's logits of an unpacked ``[1, T]`` row (``use_cache=False`` for a transformers model)."""
    from lit_seqpack.model.lm import HFCausalLM

    if isinstance(module, HFCausalLM):
        return lambda ids: module(input_ids=ids, use_cache=False).logits

    def forward(ids: torch.Tensor) -> torch.Tensor:
        out = module(ids)
        return out.logits if hasattr(out, "logits") else out

    return forward


def max_length(module: nn.Module) -> int | None:
    """The longest row the module accepts: ``max_seq_len`` (ReferenceLM) or ``max_position_embeddings`` (HF)."""
    hparams = getattr(module, "hparams", {})
    if "max_seq_len" in hparams:
        return int(hparams["max_seq_len"])
    config = getattr(getattr(module, "model", None), "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def build_generate_parser() -> argparse.ArgumentParser:
    """The ``lit-seqpack generate`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="lit-seqpack generate",
        description="Generate from a trained checkpoint (ReferenceLM or HFCausalLM): greedy or sampled.",
    )
    parser.add_argument("--ckpt_path", required=True, help="a Lightning checkpoint written by `lit-seqpack fit`")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeat for several)")
    prompts.add_argument("--prompt_file", help="a text file of prompts, one a line (blank lines skipped)")
    prompts.add_argument("--chat", help="a conversation: a JSON list of {role, content} messages, or a .json file")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="the most tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (deterministic); > 0: sampled")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling: keep the tokens of this mass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (the same seed, the same text)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the one the run trained with)")
    parser.add_argument("--stop", action="append", default=[], help="a token that ends the generation (besides EOS)")
    parser.add_argument("--model_class", default=None, help="module.Class of the checkpoint's LightningModule")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, ...)")
    return parser


def _prompts(args: argparse.Namespace) -> list[Any]:
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ValueError(f"--prompt_file {path}: no such file")
        lines = [line.rstrip("\r\n") for line in path.read_text(encoding="utf-8").splitlines()]
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"--prompt_file {path} holds no prompt (every line is blank)")
        return prompts
    if args.chat is not None:
        text = Path(args.chat).read_text(encoding="utf-8") if args.chat.endswith(".json") else args.chat
        try:
            messages = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"--chat is not valid JSON ({err.msg}): give a list of {{role, content}} messages"
            ) from None
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"--chat must be a non-empty JSON list of {{role, content}} messages, got {text[:80]!r}")
        return [messages]
    return list(args.prompt)


class _Ids:
    """Prompts and outputs as token ids, for a run without a tokenizer."""

    eos_token_id = None

    def encode(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError("--chat needs a tokenizer (its chat template): pass --tokenizer DIR")
        try:
            return [int(part) for part in prompt.split()]
        except ValueError:
            raise ValueError(
                f"prompt {prompt!r}: without a tokenizer a prompt is token ids separated by spaces (e.g. '5 9 3'); "
                "pass --tokenizer DIR for text"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    def stop_id(self, token: str) -> int:
        return int(token)


class _Text:
    """Prompts and outputs through a Hugging Face tokenizer."""

    def __init__(self, folder: str) -> None:
        transformers = require("transformers", purpose="reading the tokenizer")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.eos_token_id = self.tokenizer.eos_token_id

    def encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_id(self, token: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"--stop {token!r} is not a token of the tokenizer")
        return int(ids[0])


def generate_command(argv: Sequence[str]) -> str:
    """Run ``lit-seqpack generate`` with ``argv`` (after the word ``generate``); return the text to print.

    Raises:
        ValueError: a bad setting or prompt (named), or a checkpoint whose class is unknown.
        FileNotFoundError: no such checkpoint.
    """
    args = build_generate_parser().parse_args(list(argv))
    prompts = _prompts(args)
    folder = args.tokenizer or checkpoint_tokenizer(load_checkpoint(args.ckpt_path))
    codec: _Ids | _Text = _Ids() if folder is None else _Text(folder)
    module = load_module(args.ckpt_path, model_class=args.model_class).to(args.device)
    stops = [codec.stop_id(token) for token in args.stop]
    if codec.eos_token_id is not None:
        stops.append(codec.eos_token_id)
    logits, limit = logits_function(module), max_length(module)
    outputs = []
    for prompt in prompts:
        ids = generate_ids(
            logits,
            codec.encode(prompt),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_ids=stops,
            max_len=limit,
            device=args.device,
        )
        outputs.append(codec.decode(ids))
    lines = []
    if folder is None:
        lines.append(
            f"# token ids: {args.ckpt_path} names no tokenizer (its data source has none: synthetic or pre-tokenised "
            "ids); pass --tokenizer DIR to read and write text"
        )
    if len(outputs) == 1:
        return "\n".join([*lines, outputs[0]])
    for prompt, output in zip(prompts, outputs, strict=True):
        lines += [f"> {prompt}", output]
    return "\n".join(lines)
