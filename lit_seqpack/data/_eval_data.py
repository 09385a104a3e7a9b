"""Evaluation data of the DataModule: validation / test files (or ``DatasetDict`` splits) and their token budget.

Validation and test samples come either from the training data (``val_fraction`` / ``test_fraction``, held out by
:func:`~lit_seqpack.data.splits.split_indices`) or from their own file or folder (``val_path`` / ``test_path``,
read like the training data, with ``val_split`` / ``test_split`` for a ``DatasetDict`` folder; a split without a
path reads the training ``path``). Both ways for one split at once is an error, and so is evaluating on the very
samples that train.

Evaluation has no gradients, so its microbatches may hold more tokens: ``eval_max_tokens`` (default:
``max_tokens``) is the budget the validation and test samplers plan with. Documents keep the training budget
(``max_tokens`` and the over-long policy), so every document evaluated is one the model could have trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lit_seqpack.data._budget import apply_document_budget
from lit_seqpack.data.overlong import OverlongReport
from lit_seqpack.data.splits import Split
from lit_seqpack.data.validation import DataScan, check_vocab_range

__all__ = ["EVAL_SPLITS", "EvalFile", "check_padded_batch_size", "eval_budget", "eval_files", "eval_split"]

EVAL_SPLITS: tuple[str, ...] = ("val", "test")
_FOLDER_SOURCES = ("hf_disk", "chat")


class EvalFile(NamedTuple):
    """Where one evaluation split is read from."""

    path: str
    split: str | None


def eval_files(
    *,
    source: str,
    path: str | None,
    split: str | None,
    paths: Mapping[str, str | None],
    splits: Mapping[str, str | None],
    fractions: Mapping[str, float],
    dataset_given: bool,
) -> dict[str, EvalFile]:
    """The evaluation splits read from their own file or folder (``"val"``, ``"test"``), checked.

    Args:
        source: the DataModule's source (the files are read the same way).
        path: the training data's file or folder.
        split: the training data's split of a ``DatasetDict`` folder.
        paths: ``val_path`` / ``test_path`` by split name.
        splits: ``val_split`` / ``test_split`` by split name.
        fractions: ``val_fraction`` / ``test_fraction`` by split name.
        dataset_given: a ready ``dataset=`` object replaces the source.

    Raises:
        ValueError: naming the settings that contradict each other.

    Example:
        >>> eval_files(source="hf_disk", path="dd", split="train", paths={}, splits={"val": "validation"},
        ...            fractions={"val": 0.0}, dataset_given=False)
        {'val': EvalFile(path='dd', split='validation')}
    """
    for name, value in (("split", split), ("val_split", splits.get("val")), ("test_split", splits.get("test"))):
        if value is not None and source not in _FOLDER_SOURCES:
            raise ValueError(
                f"{name}={value!r} picks a split of a DatasetDict folder, which source={source!r} does not read "
                f"(sources {_FOLDER_SOURCES})"
            )
    files = {}
    for name in EVAL_SPLITS:
        file, part = paths.get(name), splits.get(name)
        if file is None and part is None:
            continue
        where = f"{name}_path={file!r}" if file is not None else f"{name}_split={part!r}"
        if fractions.get(name, 0.0):
            raise ValueError(
                f"{where} and {name}_fraction={fractions[name]} both choose the {name} samples: set one of them "
                f"({name}_fraction holds samples out of the training data, {name}_path reads its own file)"
            )
        if dataset_given:
            raise ValueError(
                f"{where} reads files of data.source, but dataset= replaces the source: use {name}_fraction"
            )
        if source == "synthetic":
            raise ValueError(f"{where} needs an on-disk source, but source='synthetic': use {name}_fraction")
        if file is None:
            if path is None:
                raise ValueError(f"{name}_split={part!r} reads the training path, but path is not set")
            file = path
        if (
            path is not None
            and Path(file).expanduser().resolve() == Path(path).expanduser().resolve()
            and part == split
        ):
            raise ValueError(
                f"{name}_path={file!r} with {name}_split={part!r} is the training data itself (path={path!r}, "
                f"split={split!r}): the {name} samples would all be trained on; choose another file or split"
            )
        files[name] = EvalFile(file, part)
    return files


def eval_budget(eval_max_tokens: object, *, max_tokens: int | None, mode: str, row_multiple: int) -> int | None:
    """The token budget of evaluation microbatches: ``eval_max_tokens``, or ``max_tokens`` when it is ``None``.

    Raises:
        ValueError: ``eval_max_tokens`` in padded mode, not an int, below ``max_tokens`` (a document of the training
            budget would not fit) or not a multiple of the row multiple.

    Example:
        >>> eval_budget(None, max_tokens=1024, mode="packing", row_multiple=8), eval_budget(
        ...     4096, max_tokens=1024, mode="packing", row_multiple=8)
        (1024, 4096)
    """
    if eval_max_tokens is None:
        return max_tokens
    if mode == "padded":
        raise ValueError(
            f"eval_max_tokens={eval_max_tokens!r} is a token budget, but mode='padded' batches batch_size samples "
            "(validation and test too): remove eval_max_tokens or use mode='packing' or 'dynamic'"
        )
    if isinstance(eval_max_tokens, bool) or not isinstance(eval_max_tokens, int):
        raise ValueError(f"eval_max_tokens={eval_max_tokens!r} must be an int (or null: max_tokens)")
    assert max_tokens is not None  # packing and dynamic always have a budget
    if eval_max_tokens < max_tokens:
        raise ValueError(
            f"eval_max_tokens={eval_max_tokens} is below max_tokens={max_tokens}: a document of the training budget "
            "would not fit an evaluation microbatch; set eval_max_tokens >= max_tokens (evaluation fits more)"
        )
    if eval_max_tokens % row_multiple:
        raise ValueError(f"eval_max_tokens={eval_max_tokens} must be a multiple of {row_multiple}, as max_tokens is")
    return eval_max_tokens


def check_padded_batch_size(mode: str, batch_size: object) -> None:
    """Padded mode needs ``batch_size`` (there is no token budget to batch by)."""
    if mode == "padded" and batch_size is None:
        raise ValueError(
            "mode='padded' needs batch_size (data.batch_size: the samples of every microbatch), got None; or batch "
            "by a token budget with mode='dynamic' or 'packing' and max_tokens"
        )


def eval_split(
    dataset: Sequence[Mapping[str, Any]],
    scan: DataScan,
    *,
    name: str,
    model_vocab: int | None,
    pad_token_id: int,
    **budget_kwargs: Any,
) -> tuple[Split, OverlongReport | None]:
    """One evaluation file as a :class:`~lit_seqpack.data.splits.Split`, under the training document budget.

    Args:
        dataset: the evaluation dataset.
        scan: its validation pass (lengths, loss tokens, largest id).
        name: ``"val"`` or ``"test"``, for messages.
        model_vocab: the model's vocabulary, when known.
        pad_token_id: the padding id.
        **budget_kwargs: the settings of :func:`~lit_seqpack.data._budget.apply_document_budget` (``max_tokens``
            ``None`` in padded mode without a cap: no policy).

    Raises:
        ValueError: an empty file, an empty sample, or an id outside the model's vocabulary.
    """
    if len(dataset) == 0:
        raise ValueError(f"the {name} data ({name}_path) is empty")
    check_vocab_range(scan, vocab_size=model_vocab, pad_token_id=pad_token_id)
    lengths, loss_tokens = scan.lengths, scan.loss_tokens
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"sample {int(empty[0])} of the {name} data ({name}_path) has no token")
    if budget_kwargs.get("max_tokens") is None:
        return Split(dataset, lengths, loss_tokens), None
    try:
        view, lengths, loss_tokens, report = apply_document_budget(dataset, lengths, loss_tokens, **budget_kwargs)
    except ValueError as err:
        raise ValueError(f"the {name} data ({name}_path): {err}") from None
    return Split(view, lengths, loss_tokens), report
