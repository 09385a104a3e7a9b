"""Sources read from files: where each split lives (:class:`FileSource`), pre-tokenised data (:class:`TokenizedSource`).

A file source owns its settings: the training file or folder (``path``, ``split`` of a saved ``DatasetDict``) and,
optionally, where its validation and test samples live (``val_path`` / ``test_path``, ``val_split`` /
``test_split``; a split without a path reads ``path``). Subclasses say how one file is read
(:meth:`FileSource.read`): :class:`TokenizedSource` here, :class:`~lit_seqpack.data.sources.text.TextSource` (raw
text + tokenizer) and :class:`~lit_seqpack.data.sources.chat.ChatSource` (conversations + chat template) beside it.

In YAML::

    data:
      source:
        class_path: lit_seqpack.data.sources.TokenizedSource
        init_args: {path: data/train.jsonl, val_path: data/val.jsonl}

Reading files safely: UTF-8 lines that name the line of a bad byte, and a content fingerprint of files.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_seqpack.data.sources.base import IndexedSource
from lit_seqpack.data.sources.tokenized import TOKENIZED_FORMATS, load_tokenized

__all__ = ["SPLITS", "FileSource", "TokenizedSource", "check_tokenizer_folder"]


SPLITS: tuple[str, ...] = ("train", "val", "test")


class FileSource(IndexedSource):
    """A source whose splits are files or folders; subclasses implement :meth:`read`.

    Args:
        path: the training file or folder.
        split: the split of ``path`` when it is a saved ``DatasetDict`` folder.
        val_path: a file or folder of validation samples, read like ``path``.
        test_path: a file or folder of test samples, read like ``path``.
        val_split: the split of ``val_path`` (or, without ``val_path``, of ``path``) for a ``DatasetDict`` folder.
        test_split: the split of ``test_path`` (or, without ``test_path``, of ``path``) for a ``DatasetDict``
            folder.

    Raises:
        ValueError: a path that is not a string, a split this source cannot read, or a validation or test split
            that is the training data itself.
    """

    reads_splits: bool = False
    """Whether :meth:`read` understands ``split`` (a saved ``DatasetDict`` folder)."""
    reads_fields: bool = False
    """Whether :meth:`read` keeps declared token and sample fields (pre-tokenised files)."""

    def __init__(
        self,
        path: str,
        *,
        split: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        val_split: str | None = None,
        test_split: str | None = None,
    ) -> None:
        name = type(self).__name__
        for setting, value in (("path", path), ("val_path", val_path), ("test_path", test_path)):
            if value is not None and not isinstance(value, (str, Path)):
                raise TypeError(f"{name}({setting}={value!r}) must be a str")
        if not isinstance(path, (str, Path)):
            raise TypeError(f"{name}(path=...) is required: the file or folder to read")
        for setting, value in (("split", split), ("val_split", val_split), ("test_split", test_split)):
            if value is not None and not self.reads_splits:
                raise ValueError(
                    f"{name}({setting}={value!r}) picks a split of a DatasetDict folder, which {name} does not read"
                )
        self.path, self.split = str(path), split
        self.files: dict[str, tuple[str, str | None]] = {"train": (self.path, split)}
        for part, file, which in (("val", val_path, val_split), ("test", test_path, test_split)):
            if file is None and which is None:
                continue
            file = self.path if file is None else str(file)
            if Path(file).expanduser().resolve() == Path(self.path).expanduser().resolve() and which == split:
                raise ValueError(
                    f"{name}({part}_path={file!r}, {part}_split={which!r}) is the training data itself "
                    f"(path={self.path!r}, split={split!r}): the {part} samples would all be trained on; choose "
                    "another file or split"
                )
            self.files[part] = (file, which)

    def load(
        self, split: str, *, token_fields: Sequence[str] = (), sample_fields: Sequence[str] = ()
    ) -> Sequence[Mapping[str, Any]] | None:
        """The dataset of ``split`` (``"train"``, ``"val"`` or ``"test"``), or ``None`` when this source has none.

        Args:
            split: which split.
            token_fields: declared per-token fields the samples must carry.
            sample_fields: declared per-sample fields the samples must carry.

        Raises:
            ValueError: declared fields for a source that does not read them.
        """
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}")
        declared = [*token_fields, *sample_fields]
        if declared and not self.reads_fields:
            raise ValueError(
                f"token_fields/sample_fields {declared} are read from pre-tokenised files (TokenizedSource), but "
                f"{type(self).__name__} builds samples without them: pass a dataset whose samples carry the fields "
                "(source=your Dataset) or store the data pre-tokenised"
            )
        if split not in self.files:
            return None
        path, part = self.files[split]
        return self.read(path, part, token_fields=tuple(token_fields), sample_fields=tuple(sample_fields))

    def splits(self) -> tuple[str, ...]:
        """The splits this source holds: ``"train"``, and ``"val"`` / ``"test"`` when their file or split is set."""
        return tuple(self.files)

    @abstractmethod
    def read(
        self, path: str, split: str | None, *, token_fields: tuple[str, ...], sample_fields: tuple[str, ...]
    ) -> Sequence[Mapping[str, Any]]:
        """Read one file or folder (``split``: of a ``DatasetDict`` folder) as a token dataset."""

    def __repr__(self) -> str:
        files = ", ".join(
            f"{part}={file!r}" + (f"[{which!r}]" if which else "") for part, (file, which) in self.files.items()
        )
        return f"{type(self).__name__}({files})"


class TokenizedSource(FileSource):
    """Pre-tokenised samples: JSONL (``input_ids`` and optional ``labels`` / ``loss_mask`` per line), Parquet, or a
    ``datasets.save_to_disk`` folder (:func:`~lit_seqpack.data.sources.tokenized.load_tokenized`).

    The files keep the DataModule's declared token and sample fields (checked per line or row).

    Args:
        path: the training file or folder.
        format: ``"auto"`` (by suffix, a folder is ``hf_disk``), ``"jsonl"``, ``"parquet"`` or ``"hf_disk"``.
        **files: ``split``, ``val_path``, ``test_path``, ``val_split``, ``test_split`` (see :class:`FileSource`).

    Example:
        >>> import json, pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "train.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\\n")
        >>> source = TokenizedSource(str(folder / "train.jsonl"))
        >>> len(source.load("train")), source.load("val")
        (1, None)
    """

    reads_splits = True
    reads_fields = True

    def __init__(self, path: str, *, format: str = "auto", **files: Any) -> None:
        if format not in TOKENIZED_FORMATS:
            raise ValueError(f"TokenizedSource(format={format!r}) must be one of {TOKENIZED_FORMATS}")
        self.format = format
        if format not in ("auto", "hf_disk"):
            for setting in ("split", "val_split", "test_split"):
                if files.get(setting) is not None:
                    raise ValueError(
                        f"TokenizedSource({setting}={files[setting]!r}) picks a split of a DatasetDict folder, which "
                        f"format={format!r} does not hold"
                    )
        super().__init__(path, **files)

    def read(
        self, path: str, split: str | None, *, token_fields: tuple[str, ...], sample_fields: tuple[str, ...]
    ) -> Sequence[Mapping[str, Any]]:
        """Read one pre-tokenised file or folder, keeping the declared fields."""
        return load_tokenized(
            path, format=self.format, split=split, token_fields=token_fields, sample_fields=sample_fields
        )


def check_tokenizer_folder(source: str, tokenizer: object) -> str:
    """The path of a local tokenizer folder (``save_pretrained``), or a ``ValueError`` naming ``source``'s setting."""
    if not isinstance(tokenizer, (str, Path)) or not Path(tokenizer).expanduser().is_dir():
        raise ValueError(
            f"{source}(tokenizer={tokenizer!r}) is not a local folder: it reads a Hugging Face tokenizer saved with "
            "save_pretrained (no download); pass its folder"
        )
    return str(tokenizer)
