"""Autoregressive generation from a trained causal LM: greedy or sampled (temperature, nucleus top-p), seeded.

Model-agnostic: the loop asks a function for the logits of a ``[1, T]`` row of token ids and recomputes the whole
row at every step (no KV cache: the models trained here are small, and the result is the plain forward pass that
training used). :func:`logits_function` adapts :class:`~lit_seqpack.model.lm.ReferenceLM`,
:class:`~lit_seqpack.model.lm.HFCausalLM` and any module whose forward returns logits (or an output with
``.logits``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lit_seqpack._checks import check_int

__all__ = ["Logits", "generate_ids", "logits_function", "max_length", "next_token"]

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
