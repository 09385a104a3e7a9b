"""Raw text tokenised once, at construction, with a local Hugging Face tokenizer.

The result is a :class:`~lit_seqpack.data.sources.tokenized.TokenizedDataset` (flat token buffer, free
``lengths``), so nothing is tokenised again in DataLoader workers and the tokenizer is not pickled.
``transformers`` is optional: it is imported only when ``tokenizer`` is given as a path or name.

Where the data's vocabulary comes from: the tokenizer's size, and which setting a vocabulary error should name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lit_seqpack._checks import check_flag, check_int
from lit_seqpack._imports import require
from lit_seqpack.data.sources.files import FileSource, check_tokenizer_folder
from lit_seqpack.data.sources.tokenized import TokenizedDataset, text_lines

__all__ = ["TextDataset", "TextSource", "tokenizer_vocab_size", "vocab_hint"]


ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (text and vision conversations alike)."""


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
        >>> from lit_seqpack.data.sources import TokenizedSource
        >>> from lit_seqpack.data.sources.base import resolve_source
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


log = logging.getLogger(__name__)


class TextDataset(TokenizedDataset):
    """Documents of raw text, tokenised with a Hugging Face tokenizer; every token is trained on.

    Args:
        texts: a list of strings, or the path of a ``.jsonl`` file (field ``text_field`` of each
            object) or of a text file (one document per line; blank lines separate nothing and are
            skipped, and their count is logged). A ``str`` is always read as a path.
        tokenizer: a tokenizer object (``transformers.PreTrainedTokenizerBase`` or anything callable
            the same way), or a local directory / name handed to ``AutoTokenizer.from_pretrained``.
        add_eos: append the tokenizer's ``eos_token_id`` to every document that does not already end
            with it, so the model learns where a document stops.
        add_special_tokens: passed to the tokenizer (e.g. a BOS token for Llama tokenizers).
        text_field: the key holding the text in a JSONL file.
        batch_size: texts tokenised per tokenizer call.

    Example:
        >>> ds = TextDataset(["a b", "b"], tokenizer=my_tokenizer)  # doctest: +SKIP
        >>> ds[0]["input_ids"]  # doctest: +SKIP
        tensor([5, 6, 2])
    """

    def __init__(
        self,
        texts: Sequence[str] | str | os.PathLike[str],
        tokenizer: Any,
        *,
        add_eos: bool = True,
        add_special_tokens: bool = True,
        text_field: str = "text",
        batch_size: int = 1024,
    ) -> None:
        batch_size = check_int("batch_size", batch_size, minimum=1)
        add_eos = check_flag("add_eos", add_eos)
        add_special_tokens = check_flag("add_special_tokens", add_special_tokens)
        tok = load_tokenizer(tokenizer)
        eos = getattr(tok, "eos_token_id", None)
        if add_eos and eos is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token_id; set add_eos=False or give it one")
        source, docs = _read_texts(texts, text_field)
        lengths: list[int] = []
        parts: list[np.ndarray] = []
        for start in range(0, len(docs), batch_size):
            batch = docs[start : start + batch_size]
            for offset, ids in enumerate(_encode(tok, batch, add_special_tokens)):
                if add_eos and (not ids or ids[-1] != eos):
                    ids = [*ids, eos]
                if not ids:
                    raise ValueError(f"{source}, document {start + offset}: the tokenizer produced no token")
                parts.append(np.asarray(ids, dtype=np.int64))
                lengths.append(len(ids))
        tokens = np.concatenate(parts)
        super().__init__(tokens, np.concatenate(([0], np.cumsum(lengths))), None, source=source)
        self.add_eos = add_eos
        self.vocab_size = tokenizer_vocab_size(tok, tokens)  # the model's vocabulary is the tokenizer's


def load_tokenizer(tokenizer: Any) -> Any:
    """Return ``tokenizer`` itself, or load it with ``transformers.AutoTokenizer`` from a path or name."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        if not callable(tokenizer):
            raise TypeError(f"tokenizer must be a path or a callable HF tokenizer, got {type(tokenizer).__name__}")
        return tokenizer
    text = os.path.expanduser(str(tokenizer))
    if _looks_like_a_path(text) and not Path(text).exists():
        raise ValueError(f"tokenizer={str(tokenizer)!r} does not exist (a local tokenizer folder was expected)")
    transformers = require("transformers", purpose="TextDataset with a tokenizer path")
    return transformers.AutoTokenizer.from_pretrained(text)


def _looks_like_a_path(text: str) -> bool:
    """An absolute or explicitly relative path (``/x``, ``./x``, ``../x``, ``~/x``), not a Hub name like ``gpt2``."""
    return os.path.isabs(text) or text.startswith(("./", "../", ".\\", "..\\")) or text in (".", "..")


def _encode(tok: Any, batch: list[str], add_special_tokens: bool) -> list[list[int]]:
    encoded = tok(batch, add_special_tokens=add_special_tokens)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if len(ids) != len(batch):
        raise TypeError(f"the tokenizer returned {len(ids)} sequences for {len(batch)} texts")
    return [list(map(int, seq)) for seq in ids]


def _read_texts(texts: Sequence[str] | str | os.PathLike[str], text_field: str) -> tuple[str, list[str]]:
    if not isinstance(texts, (str, os.PathLike)):
        docs = list(texts)
        for i, doc in enumerate(docs):
            if not isinstance(doc, str):
                raise ValueError(f"texts[{i}] must be a str, got {type(doc).__name__}")
        if not docs:
            raise ValueError("texts is empty")
        return "<memory>", docs
    path = Path(texts)
    if not path.is_file():
        raise ValueError(f"texts={str(texts)!r} is not a file (a str is read as a path; pass a list of strings)")
    docs = list(_jsonl_texts(path, text_field) if path.suffix.lower() in (".jsonl", ".ndjson") else _lines(path))
    if not docs:
        raise ValueError(f"{path}: no documents")
    return str(path), docs


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    for number, line in text_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: invalid JSON ({err.msg})") from err
        except RecursionError:
            raise ValueError(f"{path}, line {number}: JSON nested too deeply to parse") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(f"{path}, line {number}: expected an object with a string field {text_field!r}")
        yield record[text_field]


def _lines(path: Path) -> Iterator[str]:
    blank = 0
    for _, line in text_lines(path):
        text = line.rstrip("\r\n")
        if text.strip():
            yield text
        else:
            blank += 1
    if blank:
        log.info("%s: skipped %d blank lines (one document per non-blank line)", path, blank)


class TextSource(FileSource):
    """Raw text (a ``.jsonl`` file's ``text_field``, or a text file of one document a line) tokenised with a local
    Hugging Face tokenizer (:class:`TextDataset`); the model's vocabulary is the tokenizer's.

    Args:
        path: the training file.
        tokenizer: the folder of a local Hugging Face tokenizer (``save_pretrained``; nothing is downloaded).
        text_field: the JSONL field holding the text.
        add_eos: append the tokenizer's ``eos_token_id`` to every document that does not end with it.
        val_path: a file of validation texts.
        test_path: a file of test texts.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str,
        *,
        text_field: str = "text",
        add_eos: bool = True,
        val_path: str | None = None,
        test_path: str | None = None,
    ) -> None:
        self.tokenizer = check_tokenizer_folder(type(self).__name__, tokenizer)
        if not isinstance(text_field, str):
            raise TypeError(f"TextSource(text_field={text_field!r}) must be a str")
        self.text_field, self.add_eos = text_field, check_flag("add_eos", add_eos)
        super().__init__(path, val_path=val_path, test_path=test_path)

    def read(
        self, path: str, split: str | None, *, token_fields: tuple[str, ...], sample_fields: tuple[str, ...]
    ) -> TextDataset:
        """Tokenise one text file."""
        return TextDataset(path, self.tokenizer, text_field=self.text_field, add_eos=self.add_eos)
