"""Conversations tokenised with a Hugging Face chat template, trained on the assistant turns only.

Every conversation is rendered once, at construction, with ``tokenizer.apply_chat_template``; the result is a
:class:`~lit_seqpack.data.sources.TokenizedDataset` (flat token buffer, free ``lengths``, no tokenizer pickled into
workers) whose ``labels`` are -100 outside the trained tokens::

    messages   system: "be brief"   user: "two plus two"     assistant: "four"
    tokens     <|system|> be brief <|end|> <|user|> two plus two <|end|> <|assistant|> four <|end|>
    labels     -100       -100 ... -100    -100     -100 ...     -100    -100          four <|end|>

Which tokens are an assistant's comes from one of two methods (``mask_method``):

- ``"generation"``: the template marks them with ``{% generation %} ... {% endgeneration %}`` and
  ``return_assistant_tokens_mask=True`` returns the mask;
- ``"prefix"``: for templates without the tag, assistant turn ``i`` covers the tokens between the conversation
  rendered up to turn ``i`` with the generation prompt and the one rendered through turn ``i``. A template whose
  shorter renderings are not token prefixes of the longer ones (one that rewrites earlier turns, or a tokenizer that
  merges across a turn boundary) fails naming the sample: a mask from it would be silently wrong.

``"auto"`` (the default) uses the tag when the template has it. Long conversations are never cut here: the
DataModule's over-long policy (``overlong``) decides, and counts, what happens to them.

Conversations read from JSONL, Parquet or ``save_to_disk`` folders, each checked and named by where it is.

A conversation is a list of messages ``{"role": str, "content": str, ...}``. Every reader yields
``(where, messages)`` pairs, where ``where`` names the file and line or row (``"chat.jsonl, line 3"``), so a bad
conversation fails naming the sample.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.sources._arrow import load_disk_split, require
from lit_seqpack.data.sources.files import FileSource, check_tokenizer_folder
from lit_seqpack.data.sources.text import ROLES, load_tokenizer, tokenizer_vocab_size
from lit_seqpack.data.sources.tokenized import TokenizedDataset, text_lines
from lit_seqpack.data.sources.vision import VISION_TOKEN_FIELDS, VisionChatDataset, is_vision_processor

__all__ = [
    "MASK_METHODS",
    "TRAIN_ON",
    "ChatDataset",
    "ChatSource",
    "has_generation_tags",
    "CHAT_FORMATS",
    "ROLES",
    "check_messages",
    "read_conversations",
]


CHAT_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet", "hf_disk")


def read_conversations(
    path: str | Path, *, messages_field: str = "messages", format: str = "auto", split: str | None = None
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """``(where, messages)`` of every conversation at ``path``, validated by :func:`check_messages`.

    Args:
        path: a ``.jsonl`` file, a ``.parquet`` file or a ``datasets.save_to_disk`` folder.
        messages_field: the field (column) holding each conversation's list of messages.
        format: one of :data:`CHAT_FORMATS`; ``"auto"`` picks by suffix, a folder is ``hf_disk``.
        split: the split of a saved ``DatasetDict`` (``hf_disk`` only).

    Raises:
        ValueError: a missing file, an unknown format, or a bad conversation (naming its line or row).
    """
    path = Path(path).expanduser()
    if format not in CHAT_FORMATS:
        raise ValueError(f"format={format!r} must be one of {CHAT_FORMATS}")
    if not path.exists():
        raise ValueError(f"path={str(path)!r} does not exist (a chat JSONL / Parquet file or save_to_disk folder)")
    if format == "auto":
        format = _detect(path)
    if split is not None and format != "hf_disk":
        raise ValueError(f"split={split!r} only applies to a save_to_disk folder, not to the {format} file {path}")
    if format == "jsonl":
        records = _jsonl(path)
    elif format == "parquet":
        records = _rows(_parquet_column(path, messages_field), str(path), messages_field)
    else:
        where = str(path) if split is None else f"{path} [split {split!r}]"
        records = _rows(_hf_disk_column(path, messages_field, split), where, messages_field)
    for where, record in records:
        if not isinstance(record, dict) or messages_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: expected an object with a {messages_field!r} list of messages, got {keys}")
        yield where, check_messages(record[messages_field], where)


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts when every message has a known ``role`` and a non-empty ``content``.

    Args:
        messages: one conversation.
        where: how messages name the conversation.

    Raises:
        ValueError: naming ``where``, the message index and the problem.

    Example:
        >>> check_messages([{"role": "user", "content": "hi"}], "sample 0")
        [{'role': 'user', 'content': 'hi'}]
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: a conversation must be a non-empty list of messages, got {messages!r}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {i}: expected an object with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            found = "no 'role'" if "role" not in message else f"role={role!r}"
            raise ValueError(f"{where}, message {i}: {found}; a role is one of {ROLES}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}, message {i} ({role}): 'content' must be a non-empty string, got {content!r}")
        checked.append(dict(message))
    return checked


def _detect(path: Path) -> str:
    if path.is_dir():
        return "hf_disk"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the format of {str(path)!r} from its suffix: use .jsonl, .parquet or a folder")


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for number, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
        except RecursionError:
            raise ValueError(f"{where}: JSON nested too deeply to parse") from None


def _rows(column: list[Any], source: str, field: str) -> Iterator[tuple[str, Any]]:
    if not column:
        raise ValueError(f"{source}: no conversations")
    return ((f"{source}, row {i}", {field: value}) for i, value in enumerate(column))


def _parquet_column(path: Path, field: str) -> list[Any]:
    pq = require("pyarrow.parquet", purpose="reading Parquet conversations")
    pa = require("pyarrow", purpose="reading Parquet conversations")
    try:
        names = pq.read_schema(path).names
        if field not in names:
            raise ValueError(f"{path}: no {field!r} column (columns: {names}); set messages_field")
        return pq.read_table(path, columns=[field]).column(field).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None


def _hf_disk_column(path: Path, field: str, split: str | None) -> list[Any]:
    loaded = load_disk_split(path, split)
    if field not in loaded.column_names:
        raise ValueError(f"{path}: no {field!r} column (columns: {loaded.column_names}); set messages_field")
    return loaded[field]


log = logging.getLogger(__name__)

TRAIN_ON: tuple[str, ...] = ("assistant", "last_assistant", "all")
MASK_METHODS: tuple[str, ...] = ("auto", "generation", "prefix")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    """Whether a Jinja chat template marks assistant tokens with ``{% generation %}``.

    Example:
        >>> has_generation_tags("{% generation %}{{ m['content'] }}{% endgeneration %}"), has_generation_tags("{{ x }}")
        (True, False)
    """
    return _GENERATION.search(template) is not None


class ChatDataset(TokenizedDataset):
    """Conversations (lists of ``{"role", "content"}`` messages) tokenised with a chat template.

    Args:
        conversations: a list of conversations, or the path of a ``.jsonl`` / ``.parquet`` file or a
            ``datasets.save_to_disk`` folder whose ``messages_field`` holds them.
        tokenizer: a ``transformers`` tokenizer, or the path of a local one (``AutoTokenizer.from_pretrained``).
        chat_template: the Jinja template to use instead of the tokenizer's: the template text (anything holding
            ``{%`` or ``{{``) or the path of a file holding it.
        train_on: ``"assistant"`` (every assistant turn), ``"last_assistant"`` (the last one only) or ``"all"``
            (every token, the template's markup included).
        mask_method: ``"auto"``, ``"generation"`` or ``"prefix"`` (see the module docstring).
        messages_field: the field holding each conversation in a file.
        format: ``"auto"``, ``"jsonl"``, ``"parquet"`` or ``"hf_disk"`` (files only).
        split: the split of a saved ``DatasetDict`` folder.

    Raises:
        ValueError: a bad setting (naming it), a bad conversation or a template that cannot mask it (naming the
            sample).

    Example:
        >>> ds = ChatDataset([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]],
        ...                  tokenizer="./my_tokenizer")  # doctest: +SKIP
        >>> ds[0]["labels"]  # doctest: +SKIP
        tensor([-100, -100, -100, 17, 3])
    """

    def __init__(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]] | str | os.PathLike[str],
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        train_on: Literal["assistant", "last_assistant", "all"] = "assistant",
        mask_method: Literal["auto", "generation", "prefix"] = "auto",
        messages_field: str = "messages",
        format: str = "auto",
        split: str | None = None,
    ) -> None:
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on={train_on!r} must be one of {TRAIN_ON}")
        if mask_method not in MASK_METHODS:
            raise ValueError(f"mask_method={mask_method!r} must be one of {MASK_METHODS}")
        tok = load_tokenizer(tokenizer)
        if not callable(getattr(tok, "apply_chat_template", None)):
            raise TypeError(f"tokenizer {type(tok).__name__} has no apply_chat_template (a transformers tokenizer)")
        template = _template(chat_template, tok)
        tagged = has_generation_tags(template)
        if mask_method == "generation" and not tagged:
            raise ValueError(
                "mask_method='generation' but the chat template has no {% generation %} tag: use "
                "mask_method='prefix' (or 'auto'), or a template that marks assistant tokens"
            )
        if mask_method == "auto":
            mask_method = "generation" if tagged else "prefix"
        self.train_on, self.mask_method = train_on, mask_method
        masker = _Masker(tok, template, train_on, self.mask_method)
        source, records = _records(conversations, messages_field, format, split)
        ids_parts, label_parts = [], []
        for where, messages in records:
            ids, labels = masker(messages, where)
            ids_parts.append(ids)
            label_parts.append(labels)
        if not ids_parts:
            raise ValueError(f"{source}: no conversations")
        tokens = np.concatenate(ids_parts)
        offsets = np.concatenate(([0], np.cumsum([len(p) for p in ids_parts])))
        super().__init__(tokens, offsets, np.concatenate(label_parts), source=source)
        self.vocab_size = tokenizer_vocab_size(tok, tokens)  # the model's vocabulary is the tokenizer's
        log.info(
            "%s: %d conversations, %d tokens, %d trained on (train_on=%r, mask_method=%r)",
            source,
            len(self),
            len(tokens),
            int((self.labels != IGNORE_INDEX).sum()),
            train_on,
            self.mask_method,
        )


class _Masker:
    """Renders one conversation and returns its ids and labels under a masking policy and method."""

    def __init__(self, tok: Any, template: str, train_on: str, method: str) -> None:
        self.tok, self.template, self.train_on, self.method = tok, template, train_on, method

    def __call__(self, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on != "all" and not assistants:
            raise ValueError(
                f"{where}: no assistant message, so nothing to train on with train_on={self.train_on!r}; "
                "remove the conversation or set train_on='all'"
            )
        if self.train_on == "all":
            ids = self._render(messages, where)
            return ids, ids.copy()
        if self.method == "generation":
            ids, mask = self._render_with_mask(messages, where)
            if self.train_on == "last_assistant":
                mask[: self._span(messages, assistants[-1], ids, where)[0]] = False
        else:
            ids = self._render(messages, where)
            mask = np.zeros(len(ids), dtype=bool)
            for turn in assistants[-1:] if self.train_on == "last_assistant" else assistants:
                start, stop = self._span(messages, turn, ids, where)
                mask[start:stop] = True
        if not mask.any():
            raise ValueError(
                f"{where}: the chat template marks no token of the assistant turns ({self.method!r} mask); "
                "check its {% generation %} block or use mask_method='prefix'"
            )
        return ids, np.where(mask, ids, IGNORE_INDEX).astype(np.int64)

    def _span(self, messages: list[dict[str, Any]], turn: int, ids: np.ndarray, where: str) -> tuple[int, int]:
        """Token positions of assistant turn ``turn``: after its generation prompt, through its end."""
        before = self._render(messages[:turn], where, prompt=True)
        through = self._render(messages[: turn + 1], where)
        for part, name in ((before, f"messages[:{turn}] + the generation prompt"), (through, f"messages[:{turn + 1}]")):
            if len(part) > len(ids) or not np.array_equal(ids[: len(part)], part):
                raise ValueError(
                    f"{where}: the chat template rendering of {name} is not a token prefix of the whole "
                    "conversation, so the assistant tokens cannot be located by prefix; use a template with "
                    "{% generation %} tags (mask_method='generation') or train_on='all'"
                )
        if len(through) <= len(before):
            raise ValueError(f"{where}, message {turn}: the assistant turn renders to no token")
        return len(before), len(through)

    def _render(self, messages: list[dict[str, Any]], where: str, *, prompt: bool = False) -> np.ndarray:
        return self._apply(messages, where, prompt=prompt, with_mask=False)[0]

    def _render_with_mask(self, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = self._apply(messages, where, prompt=False, with_mask=True)
        if mask is None or mask.shape != ids.shape:
            raise ValueError(f"{where}: the tokenizer returned no assistant mask matching the ids")
        return ids, mask

    def _apply(
        self, messages: list[dict[str, Any]], where: str, *, prompt: bool, with_mask: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        try:
            out = self.tok.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=prompt,
                return_assistant_tokens_mask=with_mask,
            )
        except Exception as err:  # a Jinja error, or raise_exception() in the template
            raise ValueError(f"{where}: the chat template failed ({type(err).__name__}: {err})") from err
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"{where}: the chat template returned ids of shape {ids.shape}, not one sequence")
        mask = out.get("assistant_masks") if with_mask else None
        return ids, None if mask is None else np.asarray(mask, dtype=bool)


def _template(chat_template: str | None, tok: Any) -> str:
    if chat_template is None:
        template = getattr(tok, "chat_template", None)
        if not isinstance(template, str) or not template.strip():
            raise ValueError("the tokenizer has no chat template: set chat_template (the Jinja text or a file)")
        return template
    if not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a string (template text or file), got {type(chat_template)}")
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ValueError(
            f"chat_template={chat_template!r} is neither a Jinja template (no '{{%' or '{{{{') nor an existing file"
        )
    return path.read_text(encoding="utf-8")


def _records(
    conversations: Any, messages_field: str, format: str, split: str | None
) -> tuple[str, Iterable[tuple[str, list[dict[str, Any]]]]]:
    if isinstance(conversations, (str, os.PathLike)):
        path = str(conversations)
        return path, read_conversations(path, messages_field=messages_field, format=format, split=split)
    if split is not None or format != "auto":
        raise ValueError("format and split only apply to conversations read from a path")
    return "<memory>", (
        (f"conversation {i}", check_messages(c, f"conversation {i}")) for i, c in enumerate(conversations)
    )


class ChatSource(FileSource):
    """Conversations (JSONL / Parquet / ``save_to_disk``, a ``messages`` list each) rendered with a local tokenizer's
    chat template and trained on the assistant turns (:class:`ChatDataset`).

    A ``tokenizer`` folder with an image processor (``preprocessor_config.json``: a vision-language model's processor
    folder) reads TRL's vision format instead (:class:`~lit_seqpack.data.sources.vision.VisionChatDataset`: JSONL,
    ``images`` relative to the file, assistant turns by prefix); its samples carry ``mm_token_type_ids``,
    ``pixel_values`` and (Qwen) ``image_grid_thw``, which the DataModule must declare as token and sample fields.

    Args:
        path: the training file or folder.
        tokenizer: the folder of a local Hugging Face tokenizer (``save_pretrained``; nothing is downloaded), or of a
            vision-language processor.
        chat_template: a Jinja template (text or a file) instead of the tokenizer's own.
        train_on: ``"assistant"``, ``"last_assistant"`` or ``"all"``.
        mask_method: ``"auto"``, ``"generation"`` (the template's ``{% generation %}`` tags) or ``"prefix"``.
        messages_field: the column holding each conversation's messages.
        **files: ``split``, ``val_path``, ``test_path``, ``val_split``, ``test_split`` (see
            :class:`~lit_seqpack.data.sources.files.FileSource`).
    """

    reads_splits = True

    def __init__(
        self,
        path: str,
        tokenizer: str,
        *,
        chat_template: str | None = None,
        train_on: Literal["assistant", "last_assistant", "all"] = "assistant",
        mask_method: Literal["auto", "generation", "prefix"] = "auto",
        messages_field: str = "messages",
        **files: Any,
    ) -> None:
        self.tokenizer = check_tokenizer_folder(type(self).__name__, tokenizer)
        self.reads_fields = is_vision_processor(self.tokenizer)  # vision samples carry their images as fields
        if self.reads_fields and (train_on != "assistant" or mask_method == "generation"):
            raise ValueError(
                f"ChatSource(train_on={train_on!r}, mask_method={mask_method!r}): vision conversations train every "
                "assistant turn, located by prefix; use train_on='assistant' and mask_method='auto' or 'prefix'"
            )
        if train_on not in TRAIN_ON:
            raise ValueError(f"ChatSource(train_on={train_on!r}) must be one of {TRAIN_ON}")
        if mask_method not in MASK_METHODS:
            raise ValueError(f"ChatSource(mask_method={mask_method!r}) must be one of {MASK_METHODS}")
        self.options = {
            "chat_template": chat_template,
            "train_on": train_on,
            "mask_method": mask_method,
            "messages_field": messages_field,
        }
        super().__init__(path, **files)

    def read(
        self, path: str, split: str | None, *, token_fields: tuple[str, ...], sample_fields: tuple[str, ...]
    ) -> ChatDataset:
        """Render and mask one file or folder of conversations."""
        if not self.reads_fields:
            return ChatDataset(path, self.tokenizer, split=split, **self.options)
        if split is not None:
            raise ValueError(f"ChatSource(split={split!r}): vision conversations are read from a JSONL file")
        template = self.options["chat_template"]
        options = {
            "chat_template": None if template is None else _template(template, None),  # the text chats' rules
            "messages_field": self.options["messages_field"],
        }
        dataset = VisionChatDataset(path, self.tokenizer, **options)
        missing = [n for n in VISION_TOKEN_FIELDS if n not in token_fields]
        missing += [n for n in dataset.sample_field_names if n not in sample_fields]
        if missing:
            raise ValueError(
                f"ChatSource({path!r}) with the vision processor {self.tokenizer!r} gives every sample {missing}, "
                f"which the DataModule does not declare, so the images would not reach the model: set "
                f"token_fields={VISION_TOKEN_FIELDS} and sample_fields={list(dataset.sample_field_names)} "
                "(data.token_fields / data.sample_fields in YAML)"
            )
        return dataset
