"""Where the data's vocabulary comes from: the tokenizer's size, and which setting a vocabulary error should name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["tokenizer_vocab_size", "vocab_hint"]


def tokenizer_vocab_size(tokenizer: Any, tokens: np.ndarray) -> int:
    """The ids a model needs for data made by ``tokenizer``: ``len(tokenizer)`` (added tokens included), or more
    when the data holds a larger id.

    Example:
        >>> tokenizer_vocab_size(["a", "b", "c"], np.array([0, 2]))
        3
    """
    top = int(tokens.max()) + 1 if tokens.size else 0
    try:
        return max(len(tokenizer), top)
    except TypeError:  # a tokenizer callable without a length: the data decides
        return top


def vocab_hint(hparams: Mapping[str, Any]) -> str:
    """The data-side setting behind the vocabulary, for messages, from a DataModule's hyperparameters.

    Example:
        >>> vocab_hint({"source": "synthetic"})
        'or lower data.synthetic.vocab_size'
        >>> vocab_hint({"source": "jsonl", "path": "train.jsonl"})
        "or check the pre-tokenised data at data.path='train.jsonl' that the ids come from"
    """
    source = hparams.get("source")
    if source == "synthetic":
        return "or lower data.synthetic.vocab_size"
    if source in ("text", "chat"):
        return (
            f"or use a model made for the tokenizer data.tokenizer={hparams.get('tokenizer')!r} that the ids come "
            "from (the CLI links the vocab_size of ReferenceLM and HFCausalLM to it)"
        )
    if hparams.get("path") is not None:
        return f"or check the pre-tokenised data at data.path={hparams['path']!r} that the ids come from"
    return "or check the data's token ids"
