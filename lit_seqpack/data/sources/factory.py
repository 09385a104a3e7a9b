"""Build a dataset from the DataModule's ``source`` settings (what a YAML config can say)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FILE_SOURCES", "SOURCES", "build_dataset"]

SOURCES: tuple[str, ...] = ("synthetic", "jsonl", "parquet", "hf_disk", "text", "chat")
FILE_SOURCES: tuple[str, ...] = ("jsonl", "parquet", "hf_disk")
"""The pre-tokenised file sources (:func:`~lit_seqpack.data.sources.tokenized.load_tokenized`): their files may
carry declared token and sample fields."""


def build_dataset(
    source: str,
    *,
    path: str | None = None,
    synthetic: Mapping[str, Any] | None = None,
    tokenizer: str | None = None,
    text_field: str = "text",
    chat: Mapping[str, Any] | None = None,
    split: str | None = None,
    token_fields: Sequence[str] = (),
    sample_fields: Sequence[str] = (),
) -> Sequence[Mapping[str, Any]]:
    """The map-style dataset that ``source`` names.

    Args:
        source: ``"synthetic"`` (the embedded task, no download), ``"jsonl"``, ``"parquet"`` or
            ``"hf_disk"`` (pre-tokenised data at ``path``), or ``"text"`` (raw text at ``path``,
            tokenised with the local Hugging Face tokenizer at ``tokenizer``), or ``"chat"`` (conversations at
            ``path``, rendered with that tokenizer's chat template,
            :class:`~lit_seqpack.data.sources.chat.ChatDataset`).
        path: the file or folder of an on-disk source.
        synthetic: keyword arguments of :class:`~lit_seqpack.data.sources.synthetic.SyntheticInstructionDataset`.
        tokenizer: path of a local Hugging Face tokenizer (``source="text"`` only).
        text_field: the JSONL field holding the text (``source="text"`` only).
        chat: keyword arguments of :class:`~lit_seqpack.data.sources.chat.ChatDataset` (``source="chat"`` only).
        split: the split of a saved ``DatasetDict`` folder (``hf_disk`` data, or ``chat`` read from a folder).
        token_fields: names of declared per-token fields to keep from the files (``jsonl``, ``parquet``,
            ``hf_disk``); each record holds a list of numbers as long as its ``input_ids``.
        sample_fields: names of declared per-sample fields to keep from the files (one number a record).

    Raises:
        ValueError: an unknown ``source``, a missing ``path`` or ``tokenizer``, settings of another source, or
            declared fields for a source that does not read them.
    """
    if source not in SOURCES:
        raise ValueError(f"source={source!r} must be one of {SOURCES}")
    declared = [*token_fields, *sample_fields]
    if declared and source not in FILE_SOURCES:
        raise ValueError(
            f"token_fields/sample_fields {declared} are read from the files of source {FILE_SOURCES}, but "
            f"source={source!r} builds samples without them: pass a dataset whose samples carry the fields "
            "(dataset=...) or store the data pre-tokenised"
        )
    if source == "synthetic":
        if path is not None:
            raise ValueError(f"path={path!r} is only read by on-disk sources, not source='synthetic'")
        from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset

        return SyntheticInstructionDataset(**dict(synthetic or {}))
    if synthetic:
        raise ValueError(f"synthetic={dict(synthetic)!r} is only read by source='synthetic', not {source!r}")
    if path is None:
        raise ValueError(f"source={source!r} needs path= (the file or folder to read)")
    if chat and source != "chat":
        raise ValueError(f"chat={dict(chat)!r} is only read by source='chat', not {source!r}")
    if split is not None and source not in ("hf_disk", "chat"):
        raise ValueError(f"split={split!r} picks a split of a DatasetDict folder (source 'hf_disk' or 'chat')")
    if source in ("text", "chat"):
        if tokenizer is None:
            raise ValueError(f"source={source!r} needs tokenizer= (the path of a local Hugging Face tokenizer)")
        if not Path(tokenizer).expanduser().is_dir():
            raise ValueError(
                f"tokenizer={tokenizer!r} is not a local folder: source={source!r} reads a Hugging Face tokenizer "
                "saved with save_pretrained (no download); pass its folder"
            )
    if source == "chat":
        from lit_seqpack.data.sources.chat import ChatDataset

        return ChatDataset(path, tokenizer, split=split, **dict(chat or {}))
    if source == "text":
        from lit_seqpack.data.sources.text import TextDataset

        return TextDataset(path, tokenizer, text_field=text_field)
    from lit_seqpack.data.sources.tokenized import load_tokenized

    return load_tokenized(path, format=source, split=split, token_fields=token_fields, sample_fields=sample_fields)
