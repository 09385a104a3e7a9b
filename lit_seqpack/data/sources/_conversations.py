"""Conversations read from JSONL, Parquet or ``save_to_disk`` folders, each checked and named by where it is.

A conversation is a list of messages ``{"role": str, "content": str, ...}``. Every reader yields
``(where, messages)`` pairs, where ``where`` names the file and line or row (``"chat.jsonl, line 3"``), so a bad
conversation fails naming the sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_seqpack.data.sources._arrow import load_disk_split, require
from lit_seqpack.data.sources._files import text_lines

__all__ = ["CHAT_FORMATS", "ROLES", "check_messages", "read_conversations"]

CHAT_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet", "hf_disk")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


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
