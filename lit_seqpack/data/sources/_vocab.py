"""Where the data's vocabulary comes from: the tokenizer's size, and which setting a vocabulary error should name."""

from __future__ import annotations

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


def vocab_hint(source: object) -> str:
    """The data-side setting behind the vocabulary, for messages, from the DataModule's training source.

    Example:
        >>> from lit_seqpack.data.sources import TokenizedSource, resolve_source
        >>> vocab_hint(resolve_source("synthetic"))
        'or lower the vocab_size of the SyntheticInstructionDataset source (data.source.init_args.vocab_size)'
        >>> vocab_hint(TokenizedSource.__new__(TokenizedSource))
        "or check the TokenizedSource data's token ids"
    """
    dataset = getattr(source, "dataset", None)  # a plain dataset as a source
    if dataset is not None and getattr(dataset, "config", None) is not None and hasattr(dataset.config, "vocab_size"):
        name = type(dataset).__name__
        return f"or lower the vocab_size of the {name} source (data.source.init_args.vocab_size)"
    name = type(source).__name__
    tokenizer = getattr(source, "tokenizer", None)
    if tokenizer is not None:
        return (
            f"or use a model made for the tokenizer {tokenizer!r} of the {name} source that the ids come from (the "
            "CLI links the vocab_size of ReferenceLM and HFCausalLM to it)"
        )
    path = getattr(source, "path", None)
    if path is not None:
        return f"or check the pre-tokenised data at {path!r} ({name}) that the ids come from"
    return f"or check the {name} data's token ids"
