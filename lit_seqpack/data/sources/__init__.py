"""Data sources: objects that own their settings and say where samples come from.

=====================================  ==========================================================
name                                   what
=====================================  ==========================================================
:class:`IndexedSource`                 a map-style source: ``load(split)`` -> the dataset of
                                       ``"train"`` / ``"val"`` / ``"test"`` (``base.py``)
any map-style dataset                  its own training split (:class:`DatasetSource`); a
                                       ``torch.utils.data.Dataset`` subclass is chosen in YAML
                                       by ``class_path``
:class:`SyntheticInstructionDataset`   embedded default (``source="synthetic"``): a generated,
                                       learnable instruction task with heavy-tailed lengths
:class:`TokenizedSource`               pre-tokenised JSONL / Parquet / ``save_to_disk`` files,
                                       with their validation and test files (``files.py``)
:class:`TextSource`                    raw text + a local Hugging Face tokenizer (``text.py``)
:class:`ChatSource`                    conversations + the tokenizer's chat template (``chat.py``)
:class:`StreamSource`                  read in order, never indexed (split by rank where it is a
                                       :class:`SplittableStream`): :class:`JsonlStream`,
                                       :class:`ParquetStream`, :class:`HFIterableStream`,
                                       :class:`GeneratorStream`, :class:`SyntheticStream`,
                                       :class:`MixtureStream` (``streams.py``; the file streams
                                       in ``file_streams.py``),
                                       :class:`LitDataStream` (a ``litdata.optimize`` folder,
                                       ``litdata.py``)
:class:`TokenDataset`                  what a dataset may declare so it is never scanned:
                                       ``lengths``, ``loss_tokens``, ``fingerprint``
                                       (``base.py``)
=====================================  ==========================================================

Every dataset here is map-style, picklable (DataLoader workers) and returns samples
``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` (``labels`` omitted when every token is trained on).

Example:
    >>> from lit_seqpack.data.sources.base import TokenDataset, resolve_source
    >>> source = resolve_source("synthetic")
    >>> dataset = source.load("train")
    >>> isinstance(dataset, TokenDataset), len(dataset) > 0
    (True, True)
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "IndexedSource": "lit_seqpack.data.sources.base",
    "DatasetSource": "lit_seqpack.data.sources.base",
    "FileSource": "lit_seqpack.data.sources.files",
    "SyntheticInstructionDataset": "lit_seqpack.data.sources.synthetic",
    "TokenizedSource": "lit_seqpack.data.sources.files",
    "TextSource": "lit_seqpack.data.sources.text",
    "ChatSource": "lit_seqpack.data.sources.chat",
    "StreamSource": "lit_seqpack.data.sources.streams",
    "SplittableStream": "lit_seqpack.data.sources.streams",
    "JsonlStream": "lit_seqpack.data.sources.file_streams",
    "ParquetStream": "lit_seqpack.data.sources.file_streams",
    "LitDataStream": "lit_seqpack.data.sources.litdata",
    "HFIterableStream": "lit_seqpack.data.sources.streams",
    "GeneratorStream": "lit_seqpack.data.sources.streams",
    "MixtureStream": "lit_seqpack.data.sources.streams",
    "SyntheticStream": "lit_seqpack.data.sources.streams",
    "write_litdata": "lit_seqpack.data.sources.litdata",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
